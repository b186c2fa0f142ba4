"""Qwen3 text encoder: the first 27 decoder layers, tapped after layers 9, 18 and 27.

FLUX.2 [klein] conditions on the raw residual stream of Qwen3 (4B for klein-4B, 8B for
klein-9B) after decoder layers 9, 18 and 27 (1-based; transformers' `hidden_states[9]`,
`[18]`, `[27]`), concatenated per token: (B, 512, 3 * hidden). Layers above 27, the final norm
and the LM head do not contribute, so they are neither built nor read from disk.

The decoder layer is mlx-lm's (`mlx_lm.models.qwen3.TransformerBlock`): its module names are
the Hugging Face ones, its RMSNorm q/k norms and half-split RoPE match transformers, and its
attention takes the boolean (B, 1, L, L) mask we build for right-padded prompts.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..errors import FluxKleinError
from .config import Qwen3Config

OUT_LAYERS = (9, 18, 27)


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

    def __call__(self, input_ids: mx.array, attention_mask: mx.array | None = None) -> mx.array:
        h = self.model.embed_tokens(input_ids)  # (B, L, hidden)
        if attention_mask is None:
            attention_mask = mx.ones(input_ids.shape, dtype=mx.int32)
        mask = causal_padding_mask(attention_mask)
        taps = {}
        for i, layer in enumerate(self.model.layers, start=1):
            h = layer(h, mask)
            if i in self.out_layers:
                taps[i] = h
        # channel = slot * hidden + d, slot in out_layers order
        return mx.concatenate([taps[i] for i in self.out_layers], axis=-1)  # (B, L, n * hidden)


def _canonical_key(key: str) -> str:
    # A bare `Qwen3Model` checkpoint has no "model." prefix; `Qwen3ForCausalLM` has it.
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
    """Keep the weights the encoder uses, under its module names.

    Drops decoder layers with 0-based index >= `num_layers`, the final `model.norm` and the
    `lm_head` (present when embeddings are untied, as in Qwen3-8B). Works on lazy arrays: the
    dropped tensors are never evaluated, hence never read from disk.
    """
    return {_canonical_key(k): v for k, v in weights.items() if keeps_key(k, num_layers)}


def encode_prompts(encoder: Qwen3TextEncoder, tokenizer, prompts: str | list[str], max_length: int = 512) -> mx.array:
    """Tokenize and encode prompts: (B, max_length, encoder.output_dim), lazy."""
    input_ids, mask = tokenizer(prompts, max_length=max_length)
    return encoder(input_ids, mask)
