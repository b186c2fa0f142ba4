"""4-axis rotary position embedding of the FLUX.2 transformer: position ids and cos/sin tables.

Every token carries 4 coordinates (t, y, x, l): text token j is (0, 0, 0, j), a target latent
at row y, column x is (0, y, x, 0), the k-th reference image uses t = 10·(k+1) (`sampling.reference_time`).
FLUX 3 halves y and x (float ids: (0, y/2, x/2, 0)) and puts reference k at l = -(k+1) instead of on t.
Each axis owns a slice of the head dimension (32 dims each for klein) and rotates interleaved pairs
(2j, 2j+1) by `pos · theta^(-2j/dim)`. The tables depend only on the ids, so a denoising loop builds them once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

# One latent token covers PIXELS_PER_TOKEN² pixels: the VAE's 8x downscale times the transformer's 2x2
# patch. Every image side the model sees is a multiple of it.
PIXELS_PER_TOKEN = 16


def token_grid(width: int, height: int) -> tuple[int, int]:
    """(h, w) of the latent-token grid of a width x height px image: (height / 16, width / 16)."""
    return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def text_ids(length: int = 512) -> mx.array:
    """Ids of `length` text tokens, (L, 4) int32: token j sits at (0, 0, 0, j)."""
    j = mx.arange(length, dtype=mx.int32)
    zero = mx.zeros_like(j)
    return mx.stack([zero, zero, zero, j], axis=1)


def image_ids(h: int, w: int, t: int = 0, *, scale: float = 1.0, l: int = 0) -> mx.array:  # noqa: E741 (the l axis)
    """Ids of an h×w latent-token grid (H/16 × W/16), (h·w, 4), row-major: (t, y·scale, x·scale, l).

    FLUX.2: scale 1 and l 0, int32 (a reference moves along t). FLUX 3 scales the y and x axes by its image
    RoPE scale (0.5) and puts reference k at l = -(k + 1): float32 ids, as diffusers' `_prepare_image_ids`
    (the products are exact: scale 0.5 halves an integer)."""
    exact = scale == 1.0
    dtype = mx.int32 if exact else mx.float32
    y = mx.repeat(mx.arange(h, dtype=dtype), w)  # 0,0,..,1,1,..
    x = mx.tile(mx.arange(w, dtype=dtype), h)  # 0,1,..,0,1,..
    if not exact:
        y, x = y * scale, x * scale
    return mx.stack([mx.full((h * w,), t, dtype=dtype), y, x, mx.full((h * w,), l, dtype=dtype)], axis=1)


def rope_tables(
    ids: mx.array, axes_dim: Sequence[int] = (32, 32, 32, 32), theta: float = 2000.0
) -> tuple[mx.array, mx.array]:
    """cos and sin tables for `ids` (L, 4) or (B, L, 4), each float32 of shape (L, sum(axes_dim)/2).

    Column j of the table belongs to the head-dim pair (2j, 2j+1). A batched `ids` uses batch element
    0 for every element, as both references do. Angles are computed in float64 on the CPU stream (the
    references do the same; float32 angles for positions ~500 would be off by ~3e-5).
    """
    if ids.ndim == 3:
        ids = ids[0]
    # float64 exists only on the CPU (Metal has none), so the angle math runs on the CPU stream.
    with mx.stream(mx.cpu):
        pos = ids.astype(mx.float64)  # (L, n_axes)
        angles = []
        for a, dim in enumerate(axes_dim):
            freqs = 1.0 / mx.power(float(theta), mx.arange(0, dim, 2, dtype=mx.float64) / dim)  # (dim/2,)
            angles.append(pos[:, a : a + 1] * freqs[None, :])  # (L, dim/2)
        angle = mx.concatenate(angles, axis=1)  # (L, hd/2)
        # MLX's float64 cos/sin are only float32-accurate (~1e-5 off at angles ~500): reduce to [-pi, pi]
        # in float64 first, then float32 cos/sin are accurate to ~1e-7.
        turns = mx.round(angle / (2 * math.pi))
        reduced = (angle - turns * (2 * math.pi)).astype(mx.float32)
    return mx.cos(reduced), mx.sin(reduced)


# Compiled: the fused kernel is 2.3x faster on the CPU in float32 (1.2x in bf16) at 4608 tokens x 24 heads.
@mx.compile
def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate interleaved pairs of `x` (B, H, L, D) by the tables (L, D/2); float32 math, x's dtype out."""
    B, H, L, D = x.shape
    xf = x.astype(mx.float32).reshape(B, H, L, D // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]  # (B, H, L, D/2) each
    out = mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)  # (B, H, L, D/2, 2)
    return out.reshape(B, H, L, D).astype(x.dtype)
