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

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from .errors import FluxKleinError
from .weights import component_files, load_into, read_json, read_weight_files

if TYPE_CHECKING:
    from mlx_lm.models.qwen3 import ModelArgs

OUT_LAYERS = (9, 18, 27)


@dataclass
class Qwen3Config:
    """The Qwen3 hyper-parameters the encoder needs (a Hugging Face `text_encoder/config.json`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: as many as query heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # transformers' Qwen3 default when a config names none
    vocab_size: int = 151936
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        """Build from a config dict; unknown keys are ignored, missing required ones named."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        # transformers >= 5 nests rope_theta under rope_parameters; older configs use rope_scaling.
        for nested in ("rope_parameters", "rope_scaling"):
            rope = d.get(nested)
            if not isinstance(rope, dict):
                continue
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in (None, "default"):
                raise FluxKleinError(
                    f"the text encoder config asks for '{kind}' RoPE scaling, which FLUX.2 [klein]'s "
                    "Qwen3 does not use; use the text_encoder/ of a FLUX.2 [klein] snapshot"
                )
            if "rope_theta" in rope and "rope_theta" not in kwargs:
                kwargs["rope_theta"] = rope["rope_theta"]
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise FluxKleinError(
                f"the text encoder config lacks {', '.join(missing)}; it is not a Qwen3 config.json"
            )
        return cls(**kwargs)

    def model_args(self) -> "ModelArgs":
        """The same hyper-parameters as mlx-lm's Qwen3 `ModelArgs`."""
        # Importing mlx_lm runs its package __init__, which imports transformers (seconds): that
        # happens when a model is built, not when this module is imported.
        from mlx_lm.models.qwen3 import ModelArgs

        return ModelArgs(
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_theta=float(self.rope_theta),
        )


def qwen3_4b() -> Qwen3Config:
    """Qwen3-4B, the text encoder of klein-4B (embeddings 3 x 2560 = 7680 wide)."""
    return Qwen3Config(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
    )  # fmt: skip


def qwen3_8b() -> Qwen3Config:
    """Qwen3-8B, the text encoder of klein-9B (embeddings 3 x 4096 = 12288 wide)."""
    return Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
    )  # fmt: skip


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
        from mlx_lm.models.qwen3 import TransformerBlock

        super().__init__()
        args = config.model_args()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(num_layers)]


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
            raise FluxKleinError(
                f"text encoder output layers {out_layers} must lie in 1..{config.num_hidden_layers}"
            )
        self.config = config
        self.out_layers = out_layers
        # Only the layers up to the deepest tap exist; the rest would never be used.
        self.model = Qwen3Trunk(config, max(out_layers))

    @property
    def num_layers(self) -> int:
        return max(self.out_layers)

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
    if key.startswith(("embed_tokens.", "layers.", "norm.")):
        return "model." + key
    return key


def _wanted(key: str, num_layers: int) -> bool:
    """Whether the encoder uses a (canonical) checkpoint key: embedding and layers < num_layers."""
    if key.startswith("model.embed_tokens."):
        return True
    if key.startswith("model.layers."):
        index = key.split(".")[2]
        # Old checkpoints store RoPE frequencies as buffers; they are recomputed.
        return index.isdigit() and int(index) < num_layers and not key.endswith("rotary_emb.inv_freq")
    # model.norm.weight and lm_head.weight (tied or not) are never used.
    return False


def sanitize_qwen3_weights(weights: dict[str, mx.array], num_layers: int = max(OUT_LAYERS)) -> dict[str, mx.array]:
    """Keep the weights the encoder uses, under its module names.

    Drops decoder layers with 0-based index >= `num_layers`, the final `model.norm` and the
    `lm_head` (present when embeddings are untied, as in Qwen3-8B). Works on lazy arrays: the
    dropped tensors are never evaluated, hence never read from disk.
    """
    out = {}
    for k, v in weights.items():
        k = _canonical_key(k)
        if _wanted(k, num_layers):
            out[k] = v
    return out


def _text_encoder_folder(folder: str | Path) -> Path:
    """Accept a model snapshot (with a `text_encoder/` folder) or the text encoder folder itself."""
    folder = Path(folder)
    if (folder / "text_encoder").is_dir():
        return folder / "text_encoder"
    if (folder / "config.json").is_file():
        return folder
    raise FluxKleinError(
        f"missing text encoder: neither {folder / 'text_encoder'} nor {folder / 'config.json'} exists; "
        "point to a FLUX.2 [klein] snapshot that has a text_encoder/ folder"
    )


def _model_names(hidden: int, joint_dim: int) -> str:
    encoders = {2560: "Qwen3-4B", 4096: "Qwen3-8B"}
    dits = {7680: "klein-4B", 12288: "klein-9B"}
    if hidden in encoders and joint_dim in dits:
        return f": the text encoder is {encoders[hidden]}, the transformer {dits[joint_dim]}"
    return ": use the text encoder from the same snapshot as the transformer"


def load_text_encoder(
    folder: str | Path,
    dtype: mx.Dtype = mx.bfloat16,
    expected_dim: int | None = None,
    out_layers: tuple[int, ...] = OUT_LAYERS,
) -> Qwen3TextEncoder:
    """Load the Qwen3 text encoder of a snapshot (`folder` or `folder/text_encoder`).

    Reads `config.json` and the (sharded) `model*.safetensors`; only the embedding and layers
    1..max(out_layers) are ever read from disk. Weights stay lazy until first used or until the
    caller evaluates `model.parameters()`. `expected_dim` is the transformer's
    `joint_attention_dim`; a text encoder of another width is refused before any weight is read.
    """
    folder = _text_encoder_folder(folder)
    config = Qwen3Config.from_dict(read_json(folder / "config.json"))
    width = len(out_layers) * config.hidden_size
    if expected_dim is not None and width != expected_dim:
        raise FluxKleinError(
            f"text encoder hidden size {config.hidden_size} gives {width}-wide embeddings but the "
            f"transformer expects {expected_dim} (joint_attention_dim)"
            + _model_names(config.hidden_size, expected_dim)
        )
    model = Qwen3TextEncoder(config, out_layers)
    n = model.num_layers
    # Filtering keys before anything is evaluated means the unused tensors are never read.
    weights = read_weight_files(component_files(folder), keep=lambda k: _wanted(_canonical_key(k), n))
    load_into(model, sanitize_qwen3_weights(weights, n), "text encoder", dtype=dtype)
    return model


def encode_prompts(encoder: Qwen3TextEncoder, tokenizer, prompts: str | list[str], max_length: int = 512) -> mx.array:
    """Tokenize and encode prompts: (B, max_length, encoder.output_dim), lazy."""
    input_ids, mask = tokenizer(prompts, max_length=max_length)
    return encoder(input_ids, mask)
