"""Qwen3 text encoder: the decoder layers up to the deepest tap, their hidden states stacked per token.

FLUX.2 [klein] conditions on the raw residual stream of Qwen3 (4B for klein-4B, 8B for
klein-9B) after decoder layers 9, 18 and 27 (1-based; transformers' `hidden_states[9]`,
`[18]`, `[27]`), concatenated per token: (B, 512, 3 * hidden). FLUX 3 Image Klein reads the
language tower of Qwen3-VL-4B the same way, after layers 4, 8, ..., 32: (1, L, 8 * 2560).
Layers above the deepest tap, the final norm, the LM head and Qwen3-VL's vision tower do not
contribute, so they are neither built nor read from disk.

The decoder layer is mlx-lm's (`mlx_lm.models.qwen3.TransformerBlock`): its module names are
the Hugging Face ones, its RMSNorm q/k norms and half-split RoPE match transformers, and its
attention takes the boolean (B, 1, L, L) mask we build for right-padded prompts. Its RoPE takes
one offset for the whole sequence; FLUX 3 puts its pads at position 1, so explicit per-token
positions go through `_layer_at`, the same block with our RoPE (Qwen3-VL's multimodal RoPE is
1-D RoPE for text-only input, see `Qwen3Config.from_dict`).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..errors import FluxKleinError
from .config import Qwen3Config
from .tokenizer import PromptTokenizer, TextWindow

OUT_LAYERS = (9, 18, 27)  # FLUX.2 [klein]'s taps (1-based decoder layers)
FLUX3_TAPS = (4, 8, 12, 16, 20, 24, 28, 32)  # FLUX 3 Image Klein's taps: 8 x 2560 = 20480 per token


def causal_padding_mask(mask: mx.array) -> mx.array:
    """Causal AND key-padding mask, as transformers builds it: (B, L) 0/1 -> bool (B, 1, L, L).

    Query i attends key j when j <= i and mask[j] = 1, so pad queries (right padding) attend
    to the real tokens only. Token 0 is always real, so no row is fully masked.
    """
    L = mask.shape[1]
    pos = mx.arange(L)
    causal = pos[:, None] >= pos[None, :]  # (L, L)
    return causal[None, None] & (mask != 0)[:, None, None, :]  # (B, 1, L, L)


class Qwen3Trunk(nn.Module):
    """Embedding + the first `num_layers` decoder layers (named like HF's `Qwen3Model`)."""

    def __init__(self, config: Qwen3Config, num_layers: int):
        super().__init__()
        # Imported when an encoder is first built: importing anything of mlx_lm runs its package
        # __init__, which imports transformers and torch (3.9 s of the 4.2 s that `import
        # flux_klein_mlx.generate` took on our Linux VM), and a run whose prompts are cached never builds it.
        from mlx_lm.models import qwen3

        # mlx-lm's ModelArgs has our config's field names
        fields = dataclasses.asdict(config) | {"model_type": "qwen3", "rope_theta": float(config.rope_theta)}
        args = qwen3.ModelArgs.from_dict(fields)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [qwen3.TransformerBlock(args) for _ in range(num_layers)]


class Qwen3TextEncoder(nn.Module):
    """Prompt embeddings for FLUX.2 [klein]: Qwen3 hidden states after `out_layers`, concatenated.

    `encoder(input_ids, attention_mask)` with int (B, L) inputs returns (B, L, len(out_layers) *
    hidden) in the weights' dtype: for klein-4B (B, 512, 7680). Positions are 0..L-1 for every
    token, pads included, and pad positions are computed too (the transformer reads all 512).
    """

    def __init__(self, config: Qwen3Config, out_layers: tuple[int, ...] = OUT_LAYERS):
        super().__init__()
        out_layers = tuple(int(i) for i in out_layers)
        if not out_layers or min(out_layers) < 1 or max(out_layers) > config.num_hidden_layers:
            raise FluxKleinError(f"text encoder output layers {out_layers} must lie in 1..{config.num_hidden_layers}")
        self.config = config
        self.out_layers = out_layers
        # Only the layers up to the deepest tap exist; the rest would never be used.
        self.model = Qwen3Trunk(config, max(out_layers))

    @property
    def output_dim(self) -> int:
        return len(self.out_layers) * self.config.hidden_size

    def __call__(
        self, input_ids: mx.array, attention_mask: mx.array | None = None, position_ids: mx.array | None = None
    ) -> mx.array:
        """`position_ids` int (B, L): the RoPE position of each token (FLUX 3: pads at 1); None: 0..L-1."""
        h = self.model.embed_tokens(input_ids)  # (B, L, hidden)
        if attention_mask is None:
            attention_mask = mx.ones(input_ids.shape, dtype=mx.int32)
        mask = causal_padding_mask(attention_mask)
        rope = None if position_ids is None else rope_at(position_ids, self.config, h.dtype)
        taps = {}
        for i, layer in enumerate(self.model.layers, start=1):
            h = layer(h, mask) if rope is None else _layer_at(layer, h, mask, rope)
            if i in self.out_layers:
                taps[i] = h
        # channel = slot * hidden + d, slot in out_layers order
        return mx.concatenate([taps[i] for i in self.out_layers], axis=-1)  # (B, L, n * hidden)


def rope_at(position_ids: mx.array, config: Qwen3Config, dtype) -> tuple[mx.array, mx.array]:
    """cos and sin (B, 1, L, head_dim) in `dtype` for int positions (B, L), as transformers builds them:
    angles pos * theta^(-2j/d) in float32, the half-split layout (the d/2 angles twice)."""
    d = config.head_dim
    inv_freq = 1.0 / (float(config.rope_theta) ** (mx.arange(0, d, 2, dtype=mx.float32) / d))  # (d/2,)
    angles = position_ids.astype(mx.float32)[:, None, :, None] * inv_freq  # (B, 1, L, d/2)
    angles = mx.concatenate([angles, angles], axis=-1)  # (B, 1, L, d)
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # x (B, H, L, d); half-split RoPE in x's dtype, as transformers' apply_rotary_pos_emb
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _layer_at(layer, x: mx.array, mask: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
    """mlx-lm's Qwen3 `TransformerBlock` (its own weights and norms) with RoPE at explicit positions."""
    attn = layer.self_attn
    y = layer.input_layernorm(x)
    B, L, _ = y.shape
    q = attn.q_norm(attn.q_proj(y).reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)  # (B, H, L, d)
    k = attn.k_norm(attn.k_proj(y).reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(y).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)  # GQA broadcast inside
    h = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _canonical_key(key: str) -> str:
    # A bare `Qwen3Model` checkpoint has no "model." prefix; `Qwen3ForCausalLM` has it; Qwen3-VL
    # (`Qwen3VLForConditionalGeneration`) keeps its language tower under "model.language_model."
    # beside "model.visual." (never read).
    if key.startswith("model.language_model."):
        return "model." + key.removeprefix("model.language_model.")
    return "model." + key if key.startswith(("embed_tokens.", "layers.", "norm.")) else key


def keeps_key(key: str, num_layers: int = max(OUT_LAYERS)) -> bool:
    """Whether a checkpoint key (any prefix style) is read at all: the embedding and layers < `num_layers`.
    Filtering on the lazy dict means layers above, the final norm and the lm_head never leave the file."""
    key = _canonical_key(key)
    if key.startswith("model.layers."):
        index = key.split(".")[2]
        # Old checkpoints store RoPE frequencies as buffers; they are recomputed.
        return index.isdigit() and int(index) < num_layers and not key.endswith("rotary_emb.inv_freq")
    # model.norm.weight and lm_head.weight (tied or not) are never used.
    return key.startswith("model.embed_tokens.")


def sanitize_qwen3_weights(weights: dict[str, mx.array], num_layers: int = max(OUT_LAYERS)) -> dict[str, mx.array]:
    """Keep the weights the encoder uses, under its module names (`num_layers`: the deepest tap).

    Drops Qwen3-VL's vision tower, decoder layers with 0-based index >= `num_layers`, the final
    `model.norm` and the `lm_head` (present when embeddings are untied, as in Qwen3-8B). Works on
    lazy arrays: the dropped tensors are never evaluated, hence never read from disk.
    """
    return {_canonical_key(k): v for k, v in weights.items() if keeps_key(k, num_layers)}


def encode_prompts(
    encoder: Qwen3TextEncoder, tokenizer: PromptTokenizer, prompts: str | list[str], window: TextWindow
) -> mx.array:
    """Tokenize and encode prompts, lazy: FLUX.2's window gives (B, 512, encoder.output_dim) for B
    prompts; a window sized per prompt (FLUX 3) takes one prompt and gives (1, L, output_dim)."""
    tokens = tokenizer.tokens(prompts, window)
    # positions 0..L-1 are the layers' own RoPE (FLUX.2, bit for bit); other positions go explicit
    positions = None if window.pad_position is None else tokens.positions
    return encoder(tokens.ids, tokens.mask, positions)
