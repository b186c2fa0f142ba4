"""Configurations as data that every family shares: the text encoder's and the VAE's dataclasses, a released
model's row (`Variant`), and the helpers that read a diffusers config.json into a dataclass.

Each family's transformer params and its table of released models live in models/<family>/config.py.
Configs ignore unknown JSON keys (style.md habit 3).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from ..errors import FluxKleinError


def from_dict(cls, d: dict, renames: dict[str, str] | None = None):
    """`cls(**d)` for the keys that are fields of `cls` (after `renames` theirs -> ours); others ignored.

    Lists become tuples for tuple-typed fields (JSON has no tuples), None values are dropped so
    that defaults apply.
    """
    names = {f.name for f in fields(cls)}
    pairs = (((renames or {}).get(k, k), v) for k, v in d.items() if v is not None)
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in pairs if k in names})


# diffusers transformer config names -> ours (BFL's) that every family shares; each adds its timestep width's name
DIFFUSERS_TRANSFORMER_NAMES = {
    "num_layers": "depth",
    "num_single_layers": "depth_single",
    "joint_attention_dim": "context_in_dim",
    "axes_dims_rope": "axes_dim",
    "rope_theta": "theta",
    "num_attention_heads": "num_heads",
}


def transformer_from_dict(cls, d: dict, renames: dict[str, str]):
    """`from_dict` of a diffusers transformer config (any family): diffusers gives heads and head dim where
    we keep the hidden size (their product)."""
    d = dict(d)
    if "attention_head_dim" in d and "hidden_size" not in d:
        heads = d.get("num_attention_heads", d.get("num_heads", cls.num_heads))
        d["hidden_size"] = int(d["attention_head_dim"]) * int(heads)
    return from_dict(cls, d, renames)


def check_heads_and_axes(params, what: str) -> None:
    """A transformer config's widths agree (any family): the hidden size splits into whole heads, and the
    RoPE axes are even and fill a head. `what` names the config in the message."""
    if params.hidden_size % params.num_heads:
        raise FluxKleinError(
            f"{what} config is inconsistent: hidden size {params.hidden_size} is not a multiple of "
            f"{params.num_heads} heads; fix config.json"
        )
    if sum(params.axes_dim) != params.head_dim or any(a % 2 for a in params.axes_dim):
        raise FluxKleinError(
            f"{what} config is inconsistent: RoPE axes {params.axes_dim} must be even and sum to the "
            f"head dim {params.head_dim}; fix config.json"
        )


class TransformerParams:
    """What every family's transformer hyper-parameters (a dataclass of BFL-style fields: hidden_size,
    num_heads, mlp_ratio, axes_dim, ...) derive alike; `DIFFUSERS_NAMES` maps its diffusers config names to them."""

    DIFFUSERS_NAMES: ClassVar[dict[str, str]] = {}
    TITLE: ClassVar[str] = "transformer"  # the config's name in a message
    SHAPE_FIELDS: ClassVar[str] = ""  # the fields that decide a weight's shape, by name (theta, eps, axes do not)

    def __post_init__(self):
        self.axes_dim = tuple(int(a) for a in self.axes_dim)
        check_heads_and_axes(self, self.TITLE)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def shape_key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.SHAPE_FIELDS.split())

    @classmethod
    def from_dict(cls, d: dict):
        """From a diffusers `transformer/config.json` (or a dict of our own field names); unknown keys ignored."""
        return transformer_from_dict(cls, d, cls.DIFFUSERS_NAMES)


# --- the Qwen3 text encoder ----------------------------------------------------------------------


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
    def from_dict(cls, d: dict) -> Qwen3Config:
        """Build from a config dict; unknown keys are ignored, missing required ones named.

        A Qwen3-VL config (FLUX 3) keeps the language tower's fields under `text_config`. Its MRoPE
        (`mrope_section`) splits the frequencies among (t, h, w) position rows; text-only input gives
        the three rows the same ids, so it is plain 1-D RoPE (tests/models/test_text_encoder.py).
        """
        d = dict(d)
        if isinstance(d.get("text_config"), dict):
            # top-level keys (tie_word_embeddings, ...) fill what the text tower does not say
            d = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"]}
        # transformers >= 5 nests rope_theta under rope_parameters; older configs use rope_scaling.
        for rope in (d.get("rope_parameters"), d.get("rope_scaling")):
            if not isinstance(rope, dict):
                continue
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in (None, "default"):
                raise FluxKleinError(
                    f"the text encoder config asks for '{kind}' RoPE scaling, which FLUX.2 [klein]'s "
                    "Qwen3 does not use; use the text_encoder/ of a FLUX.2 [klein] snapshot"
                )
            if "rope_theta" in rope and d.get("rope_theta") is None:
                d["rope_theta"] = rope["rope_theta"]
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise FluxKleinError(f"the text encoder config lacks {', '.join(missing)}; it is not a Qwen3 config.json")
        return from_dict(cls, d)


# Qwen3-4B's language tower: the text encoder of the 4B-class models, and the shape of every other Qwen3 tower
# they read (the models' own config rows say how theirs differ).
QWEN3_4B = Qwen3Config(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
)


# --- the VAE -----------------------------------------------------------------------------------


@dataclass
class AutoEncoderConfig:
    """The VAE's shape, as in a diffusers `vae/config.json` (unknown keys are ignored).

    The defaults are the VAE shared by every FLUX.2 [klein] model (diffusers' constructor defaults).
    """

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_block_out_channels: tuple[int, ...] | None = None  # None: same as the encoder's
    layers_per_block: int = 2
    latent_channels: int = 32
    norm_num_groups: int = 32
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    batch_norm_eps: float = 1e-4
    patch_size: tuple[int, int] = (2, 2)

    @classmethod
    def flux2(cls) -> AutoEncoderConfig:
        return cls()  # the defaults

    from_dict = classmethod(from_dict)

    @property
    def downscale(self) -> int:
        """Image pixels per latent pixel (8 for FLUX.2): one stride-2 downsample per level but the last."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this (16 for FLUX.2): VAE downscale times the 2x2 patch."""
        return self.downscale * self.patch_size[0]

    @property
    def token_channels(self) -> int:
        """Channels of a transformer token (128 for FLUX.2): latent channels times the patch area."""
        return self.latent_channels * self.patch_size[0] * self.patch_size[1]


# --- the variants ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One released klein model: its three components' shapes and its sampling defaults."""

    name: str  # key of VARIANTS, e.g. "klein-4b-base"
    title: str  # e.g. "FLUX.2 [klein] 4B Base"
    family: str  # "klein-4b" | "klein-9b": the transformer's shape
    distilled: bool  # guidance-distilled (no CFG) or Base
    transformer: object  # the family's params: models/flux2/config.FluxKleinParams, models/flux3/config.Flux3Params
    text_encoder: Qwen3Config
    vae: AutoEncoderConfig
    steps: int  # default denoising steps
    guidance: float | None  # default CFG scale (None: no CFG)
    pipeline_class: str = "Flux2KleinPipeline"  # model_index.json `_class_name`
    reference_kv: bool = False  # distilled to cache the references' K/V (klein 9B-KV, see kv_cache.py)
    repo: str = ""  # the Hugging Face repo id it is published under


# --- FLUX.1, which no family runs: its files are refused by name (checkpoints and LoRAs) ---------------

# Module names that only FLUX.1 has (checkpoints and LoRAs; LoRA files may write them with "_" for ".").
FLUX1_MARKERS = (".img_mod.", ".txt_mod.", "vector_in.", "time_text_embed.", ".norm1.linear.", ".norm1_context.",
                 "ff.net.")  # fmt: skip


def flux1_marker(name: str) -> str | None:
    """The FLUX.1-only marker that module or key `name` carries (dotted or underscored), or None."""
    dotted, underscored = f".{name}.", f"_{name}_"
    return next((m for m in FLUX1_MARKERS if m in dotted or m.replace(".", "_") in underscored), None)
