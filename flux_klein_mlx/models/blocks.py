"""The transformer pieces both families build from (FLUX.2 [klein]'s and FLUX 3 Image Klein's): the timestep
sinusoid, adaptive LayerNorm modulation, SwiGLU, QK RMS norm, the MLP embedder, the output layer, and the
block count of a checkpoint's keys.

Shapes: B batch, L tokens, D hidden size, H heads, hd head dim.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn


def timestep_embedding(t: mx.array, dim: int = 256, max_period: float = 10000.0, *, scale: float = 1000.0) -> mx.array:
    """Sinusoid of scale·t, (B,) -> (B, dim) float32, cosine half first (FLUX 3 scales in its dtype: scale=1)."""
    half = dim // 2
    freqs = mx.exp(-math.log(max_period) * mx.arange(half, dtype=mx.float32) / half)
    args = (t.astype(mx.float32) * scale)[:, None] * freqs[None, :]
    return mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)


def modulate(x: mx.array, shift: mx.array, scale: mx.array, eps: float) -> mx.array:
    """(1 + scale) · LayerNorm(x) + shift, LayerNorm without affine parameters."""
    return (1 + scale) * mx.fast.layer_norm(x, None, None, eps) + shift


def swiglu(x: mx.array) -> mx.array:
    """SiLU(a) · b for x = [a | b] along the last axis (the first half is gated)."""
    a, b = mx.split(x, 2, axis=-1)
    return nn.silu(a) * b


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.scale = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.scale, self.eps)


class QKNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.query_norm = RMSNorm(dim, eps)
        self.key_norm = RMSNorm(dim, eps)

    def __call__(self, qkv: mx.array, num_heads: int) -> tuple[mx.array, mx.array, mx.array]:
        """(B, L, 3·D) laid out [q | k | v], each head-major -> normed q, k and v, each (B, H, L, hd)."""
        B, L, _ = qkv.shape
        q, k, v = qkv.reshape(B, L, 3, num_heads, -1).transpose(2, 0, 3, 1, 4)  # (3, B, H, L, hd)
        return self.query_norm(q), self.key_norm(k), v


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden, bias=False)
        self.out_layer = nn.Linear(hidden, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.out_layer(nn.silu(self.in_layer(x)))


class Modulation(nn.Module):
    """SiLU(vec) -> Linear -> `n` chunks of width D, each (B, 1, D) to broadcast over tokens."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, n * dim, bias=False)

    def __call__(self, vec: mx.array) -> list[mx.array]:
        return mx.split(self.lin(nn.silu(vec))[:, None, :], self.n, axis=-1)


class LastLayer(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.eps = p.eps
        # index 1 as in BFL's nn.Sequential(SiLU, Linear); rows are [shift ; scale]
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(p.hidden_size, 2 * p.hidden_size, bias=False)]
        self.linear = nn.Linear(p.hidden_size, p.in_channels, bias=False)

    def __call__(self, x: mx.array, vec: mx.array) -> mx.array:
        shift, scale = mx.split(self.adaLN_modulation[1](nn.silu(vec))[:, None, :], 2, axis=-1)
        return self.linear(modulate(x, shift, scale, self.eps))


def count_blocks(keys, prefix: str) -> int:
    idx = {int(m.group(1)) for k in keys if (m := re.match(rf"{re.escape(prefix)}\.(\d+)\.", k))}
    return max(idx) + 1 if idx else 0
