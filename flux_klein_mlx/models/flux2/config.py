"""FLUX.2 [klein]'s configuration as data: the transformer's hyper-parameters and the table of its variants.

Every number that says what klein-4B or klein-9B is lives in `VARIANTS` below; the presets
elsewhere (`FluxKleinParams.klein_4b()`, `qwen3_4b()`, the benchmark's random models, the default
steps and guidance of the pipeline) read it. Also here: the names that tell FLUX.1 and FLUX.2-dev
files apart from klein's (FLUX.2's sanitizer and LoRA reader refuse them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..config import DIFFUSERS_TRANSFORMER_NAMES, QWEN3_4B, AutoEncoderConfig, Qwen3Config, TransformerParams, Variant

# --- the flow transformer ------------------------------------------------------------------------

# diffusers `transformer/config.json` names -> ours (BFL's)
DIFFUSERS_TRANSFORMER = {**DIFFUSERS_TRANSFORMER_NAMES, "timestep_guidance_channels": "time_channels"}


@dataclass
class FluxKleinParams(TransformerParams):
    """Transformer hyper-parameters (BFL names); defaults are klein-4B."""

    DIFFUSERS_NAMES: ClassVar[dict[str, str]] = DIFFUSERS_TRANSFORMER
    SHAPE_FIELDS: ClassVar[str] = (
        "in_channels hidden_size context_in_dim num_heads mlp_hidden depth depth_single time_channels"
    )

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

    @classmethod
    def klein_4b(cls) -> FluxKleinParams:
        return dataclasses.replace(VARIANTS["klein-4b"].transformer)

    @classmethod
    def klein_9b(cls) -> FluxKleinParams:
        return dataclasses.replace(VARIANTS["klein-9b"].transformer)

    @property
    def variant(self) -> str:
        """ "klein-4b", "klein-9b" or "other", judged from the shape-deciding fields."""
        row = variant_for(self, True)
        return row.family if row is not None else "other"

    def describe(self) -> str:
        """E.g. "klein-4B (hidden 3072, 5 double / 20 single blocks)"."""
        name = {"klein-4b": "klein-4B", "klein-9b": "klein-9B"}.get(self.variant, "a custom FLUX.2 transformer")
        return f"{name} (hidden {self.hidden_size}, {self.depth} double / {self.depth_single} single blocks)"


# --- the variants ------------------------------------------------------------------------------


_QWEN3_8B = dataclasses.replace(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
_KLEIN_4B = FluxKleinParams()
_KLEIN_9B = FluxKleinParams(hidden_size=4096, context_in_dim=12288, num_heads=32, depth=8, depth_single=24)


def _rows() -> dict[str, Variant]:
    rows = {}
    for family, size, transformer, qwen in (
        ("klein-4b", "4B", _KLEIN_4B, QWEN3_4B),
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


# --- the other FLUX models (FLUX.1, FLUX.2-dev), told apart from klein here and nowhere else --------------

FLUX1_BLOCKS = (19, 38)  # double / single blocks of FLUX.1 [dev] and [schnell]
FLUX1_IMG_IN = (3072, 64)  # x_embedder (out, in): FLUX.1 packs 16 latent channels x 2 x 2
DEV_MARKERS = ("guidance_in.", ".guidance_embedder.")  # FLUX.2-dev's guidance embedder
# Transformers by hidden size (klein-4B and FLUX.1 share 3072; their MLPs differ: 2 x 3D SwiGLU vs 4D GELU).
HIDDEN_SIZES = {3072: "FLUX.2 [klein] 4B", 4096: "FLUX.2 [klein] 9B", 6144: "FLUX.2-dev"}
DEV_HIDDEN = 6144


def qwen3_4b() -> Qwen3Config:
    """Qwen3-4B, the text encoder of klein-4B (embeddings 3 x 2560 = 7680 wide)."""
    return dataclasses.replace(VARIANTS["klein-4b"].text_encoder)


def qwen3_8b() -> Qwen3Config:
    """Qwen3-8B, the text encoder of klein-9B (embeddings 3 x 4096 = 12288 wide)."""
    return dataclasses.replace(VARIANTS["klein-9b"].text_encoder)
