"""Configurations as data: the three components' dataclasses and the table of klein variants.

Every number that says what klein-4B or klein-9B is lives in `VARIANTS` below; the presets
elsewhere (`FluxKleinParams.klein_4b()`, `qwen3_4b()`, the benchmark's random models, the default
steps and guidance of the pipeline) read it. Configs ignore unknown JSON keys (style.md habit 3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from ..errors import FluxKleinError


def from_dict(cls, d: dict, renames: dict[str, str] | None = None):
    """`cls(**d)` for the keys that are fields of `cls` (after `renames` theirs -> ours); others ignored.

    Lists become tuples for tuple-typed fields (JSON has no tuples), None values are dropped so
    that defaults apply.
    """
    names = {f.name for f in fields(cls)}
    pairs = (((renames or {}).get(k, k), v) for k, v in d.items() if v is not None)
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in pairs if k in names})


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


# --- the flow transformer ------------------------------------------------------------------------

# diffusers `transformer/config.json` names -> ours (BFL's)
_DIFFUSERS_TRANSFORMER = {
    "num_layers": "depth",
    "num_single_layers": "depth_single",
    "joint_attention_dim": "context_in_dim",
    "axes_dims_rope": "axes_dim",
    "rope_theta": "theta",
    "timestep_guidance_channels": "time_channels",
    "num_attention_heads": "num_heads",
}


@dataclass
class FluxKleinParams:
    """Transformer hyper-parameters (BFL names); defaults are klein-4B."""

    in_channels: int = 128
    hidden_size: int = 3072
    context_in_dim: int = 7680
    num_heads: int = 24
    mlp_ratio: float = 3.0
    depth: int = 5
    depth_single: int = 20
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)
    theta: float = 2000.0
    eps: float = 1e-6
    time_channels: int = 256

    def __post_init__(self):
        self.axes_dim = tuple(int(a) for a in self.axes_dim)
        check_heads_and_axes(self, "transformer")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @classmethod
    def klein_4b(cls) -> FluxKleinParams:
        return dataclasses.replace(VARIANTS["klein-4b"].transformer)

    @classmethod
    def klein_9b(cls) -> FluxKleinParams:
        return dataclasses.replace(VARIANTS["klein-9b"].transformer)

    @classmethod
    def from_dict(cls, d: dict) -> FluxKleinParams:
        """From a diffusers `transformer/config.json` (or a dict of our own field names); unknown keys ignored."""
        return transformer_from_dict(cls, d, _DIFFUSERS_TRANSFORMER)

    def shape_key(self) -> tuple:
        """Everything that decides a weight's shape; theta/eps/axes do not."""
        return (
            self.in_channels,
            self.hidden_size,
            self.context_in_dim,
            self.num_heads,
            self.mlp_hidden,
            self.depth,
            self.depth_single,
            self.time_channels,
        )

    @property
    def variant(self) -> str:
        """ "klein-4b", "klein-9b" or "other", judged from the shape-deciding fields."""
        row = variant_for(self, True)
        return row.family if row is not None else "other"

    def describe(self) -> str:
        """E.g. "klein-4B (hidden 3072, 5 double / 20 single blocks)"."""
        name = {"klein-4b": "klein-4B", "klein-9b": "klein-9B"}.get(self.variant, "a custom FLUX.2 transformer")
        return f"{name} (hidden {self.hidden_size}, {self.depth} double / {self.depth_single} single blocks)"


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
        the three rows the same ids, so it is plain 1-D RoPE (tests/models/test_flux3_text.py).
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
    transformer: FluxKleinParams  # or a family's own params (models/flux3/config.Flux3Params)
    text_encoder: Qwen3Config
    vae: AutoEncoderConfig
    steps: int  # default denoising steps
    guidance: float | None  # default CFG scale (None: no CFG)
    pipeline_class: str = "Flux2KleinPipeline"  # model_index.json `_class_name`
    reference_kv: bool = False  # distilled to cache the references' K/V (klein 9B-KV, see kv_cache.py)
    repo: str = ""  # the Hugging Face repo id it is published under


_QWEN3_4B = Qwen3Config(
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
_QWEN3_8B = dataclasses.replace(_QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
_KLEIN_4B = FluxKleinParams()
_KLEIN_9B = FluxKleinParams(hidden_size=4096, context_in_dim=12288, num_heads=32, depth=8, depth_single=24)


def _rows() -> dict[str, Variant]:
    rows = {}
    for family, size, transformer, qwen in (
        ("klein-4b", "4B", _KLEIN_4B, _QWEN3_4B),
        ("klein-9b", "9B", _KLEIN_9B, _QWEN3_8B),
    ):
        for distilled in (True, False):
            name = family if distilled else f"{family}-base"
            rows[name] = Variant(
                name=name,
                title=f"FLUX.2 [klein] {size}" + ("" if distilled else " Base"),
                family=family,
                distilled=distilled,
                transformer=transformer,
                text_encoder=qwen,
                vae=AutoEncoderConfig(),
                steps=4 if distilled else 50,
                guidance=None if distilled else 4.0,
                repo=f"black-forest-labs/FLUX.2-klein-{'' if distilled else 'base-'}{size}",
            )
    # klein 9B-KV (black-forest-labs/FLUX.2-klein-9b-kv): klein-9B's shapes, distilled for the reference
    # K/V cache. Its model_index.json has no is_distilled key; the pipeline class tells it apart.
    rows["klein-9b-kv"] = dataclasses.replace(
        rows["klein-9b"],
        name="klein-9b-kv",
        title="FLUX.2 [klein] 9B-KV",
        pipeline_class=KV_PIPELINE_CLASS,
        reference_kv=True,
        repo="black-forest-labs/FLUX.2-klein-9b-kv",
    )
    return rows


KV_PIPELINE_CLASS = "Flux2KleinKVPipeline"
VARIANTS: dict[str, Variant] = _rows()
PIPELINE_CLASSES = tuple(dict.fromkeys(v.pipeline_class for v in VARIANTS.values()))


def variant_for(params: FluxKleinParams, distilled: bool, reference_kv: bool = False) -> Variant | None:
    """The table row of a transformer shape and distillation, or None for a custom size."""
    return next(
        (
            v
            for v in VARIANTS.values()
            if v.distilled == distilled
            and v.reference_kv == reference_kv
            and v.transformer.shape_key() == params.shape_key()
        ),
        None,
    )


def sampling_defaults(distilled: bool) -> tuple[int, float | None]:
    """(steps, guidance) of a distilled or Base model, also for custom sizes (from the table)."""
    row = VARIANTS["klein-4b" if distilled else "klein-4b-base"]
    return row.steps, row.guidance


# --- the other FLUX models, told apart from klein here and nowhere else --------------------------------

# Module names that only FLUX.1 has (checkpoints and LoRAs; LoRA files may write them with "_" for ".").
FLUX1_MARKERS = (".img_mod.", ".txt_mod.", "vector_in.", "time_text_embed.", ".norm1.linear.", ".norm1_context.",
                 "ff.net.")  # fmt: skip
FLUX1_BLOCKS = (19, 38)  # double / single blocks of FLUX.1 [dev] and [schnell]
FLUX1_IMG_IN = (3072, 64)  # x_embedder (out, in): FLUX.1 packs 16 latent channels x 2 x 2
DEV_MARKERS = ("guidance_in.", ".guidance_embedder.")  # FLUX.2-dev's guidance embedder
# Transformers by hidden size (klein-4B and FLUX.1 share 3072; their MLPs differ: 2 x 3D SwiGLU vs 4D GELU).
HIDDEN_SIZES = {3072: "FLUX.2 [klein] 4B", 4096: "FLUX.2 [klein] 9B", 6144: "FLUX.2-dev"}
DEV_HIDDEN = 6144
# FLUX 3 Image Klein: diffusers' Flux3Transformer2DModel (pipelines Flux3ModularPipeline and
# Flux3DistilledModularPipeline); BFL's file has per-mode blocks and, distilled, a second timestep embedder
# (the keys diffusers' single-file loader tells it by). Its hidden size is klein-4B's (24 heads x 128 = 3072),
# so it is told apart by these names, never by its shapes.
FLUX3_CLASS_PREFIX = "Flux3"
FLUX3_MARKERS = ("early_stream_modulations.", "single_stream_modulations.", "mode_blocks.", "ref_time_in.")
FLUX3_NAME = "FLUX 3 Image Klein"
# diffusers' modular pipelines (modular_model_index.json `_class_name`): Base, and the step-distilled flow map
FLUX3_PIPELINE_CLASSES = ("Flux3ModularPipeline", "Flux3DistilledModularPipeline")


def flux1_marker(name: str) -> str | None:
    """The FLUX.1-only marker that module or key `name` carries (dotted or underscored), or None."""
    dotted, underscored = f".{name}.", f"_{name}_"
    return next((m for m in FLUX1_MARKERS if m in dotted or m.replace(".", "_") in underscored), None)


def flux3_marker(names) -> str | None:
    """The first of `names` (checkpoint keys or module names) that only FLUX 3 Image Klein has, or None."""
    return next((n for n in names if any(m in f".{n}" for m in FLUX3_MARKERS)), None)


def qwen3_4b() -> Qwen3Config:
    """Qwen3-4B, the text encoder of klein-4B (embeddings 3 x 2560 = 7680 wide)."""
    return dataclasses.replace(VARIANTS["klein-4b"].text_encoder)


def qwen3_8b() -> Qwen3Config:
    """Qwen3-8B, the text encoder of klein-9B (embeddings 3 x 4096 = 12288 wide)."""
    return dataclasses.replace(VARIANTS["klein-9b"].text_encoder)
