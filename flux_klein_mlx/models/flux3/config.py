"""FLUX 3 Image Klein's transformer hyper-parameters, with BFL-style field names like `FluxKleinParams`.

Defaults are the released 5.5B model (both the Base and the step-distilled one; the distilled one sets
`flow_map`). diffusers' `transformer/config.json` names are read by `Flux3Params.from_dict`.

`FLUX3_VARIANTS` holds the two released models' rows (their three components and sampling defaults) in
FLUX.2's `Variant` shape, beside `models/flux2/config.VARIANTS` rather than in it: VARIANTS is read as FLUX.2's
table (its pipeline classes, `variant_for`, the download sizes build `FluxKlein`s), so a FLUX 3 row there
would make each of those readers filter by family. Each family hands its rows out (`Family.variants`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..config import DIFFUSERS_TRANSFORMER_NAMES, QWEN3_4B, AutoEncoderConfig, TransformerParams, Variant

# diffusers `Flux3Transformer2DModel` config names -> ours; `attention_head_dim` is folded into hidden_size.
FLUX3_DIFFUSERS_CONFIG = {**DIFFUSERS_TRANSFORMER_NAMES, "timestep_channels": "time_channels"}


@dataclass
class Flux3Params(TransformerParams):
    """FLUX 3 transformer hyper-parameters; defaults = the released 5.5B model."""

    DIFFUSERS_NAMES: ClassVar[dict[str, str]] = FLUX3_DIFFUSERS_CONFIG
    TITLE: ClassVar[str] = "FLUX 3 transformer"
    SHAPE_FIELDS: ClassVar[str] = (  # with the reference tokens' input and the flow map's second embedder
        "in_channels cond_in_channels hidden_size context_in_dim num_heads mlp_hidden depth depth_single "
        "time_channels flow_map"
    )

    in_channels: int = 128  # packed latent channels of the image tokens (32 VAE channels x 2 x 2)
    cond_in_channels: int = 128  # the same for the reference tokens
    hidden_size: int = 3072
    num_heads: int = 24
    context_in_dim: int = 20480  # 8 stacked Qwen3-VL hidden states of 2560
    mlp_ratio: float = 3.0
    depth: int = 5  # per-mode blocks (each of image, image_cond and txt has its own stack)
    depth_single: int = 28
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)
    theta: float = 10000.0
    eps: float = 1e-6
    time_channels: int = 256
    flow_map: bool = False  # the step-distilled flow-map model: a second embedder of the target time
    image_rope_scale: float = 0.5  # image ids are (0, y, x, 0) x this; not in diffusers' config

    def __post_init__(self):
        self.flow_map = bool(self.flow_map)
        super().__post_init__()

    @property
    def variant(self) -> str:
        """ "flux3": one released size (FLUX.2's "klein-4b" / "klein-9b" name its two)."""
        return "flux3"

    def describe(self) -> str:
        """E.g. "FLUX 3 Image Klein (hidden 3072, 5 mode / 28 single blocks)"."""
        return f"FLUX 3 Image Klein (hidden {self.hidden_size}, {self.depth} mode / {self.depth_single} single blocks)"


# Qwen3-VL-4B-Instruct's language tower (its `text_config`, flux3.md section 5): Qwen3-4B's shape with a RoPE base
# of 5e6 (max_position_embeddings: Qwen3Config's default, as the row always had). FLUX 3 taps layers 4..32 of
# its 36, so only 32 are ever built (`family.text_taps`). The vision tower is never built nor read.
QWEN3_VL_4B_TEXT = dataclasses.replace(QWEN3_4B, rope_theta=5e6, max_position_embeddings=32768)


def _flux3_rows() -> dict[str, Variant]:
    rows = {}
    for distilled in (True, False):
        name = "flux3-klein" if distilled else "flux3-klein-base"
        rows[name] = Variant(
            name=name,
            title="FLUX 3 Image Klein" + ("" if distilled else " Base"),
            family="flux3",  # the transformer's shape (`Flux3Params.variant`)
            distilled=distilled,
            transformer=Flux3Params(flow_map=distilled),  # the distilled model is the flow map
            text_encoder=dataclasses.replace(QWEN3_VL_4B_TEXT),
            vae=AutoEncoderConfig(),  # FLUX.2's VAE, unchanged
            steps=16 if distilled else 50,
            # diffusers' Flux3LoopDenoiser default and mflux's; BFL's README table says "CFG 4" (docs/flux3.md)
            guidance=None if distilled else 3.5,
            pipeline_class="Flux3DistilledModularPipeline" if distilled else "Flux3ModularPipeline",
            repo="black-forest-labs/flux-3-image-klein" + ("" if distilled else "-base"),
        )
    return rows


FLUX3_VARIANTS: dict[str, Variant] = _flux3_rows()


# diffusers' modular pipelines (modular_model_index.json `_class_name`): Base, and the step-distilled flow map
FLUX3_PIPELINE_CLASSES = ("Flux3ModularPipeline", "Flux3DistilledModularPipeline")
