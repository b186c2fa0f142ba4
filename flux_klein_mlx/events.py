"""What a run's stages hand on (pipeline.py): the `Job` in flight between them, the `Event`s they
yield with their typed `Stats`, and the `MemoryPlan` that says what a pipeline gives up for memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from PIL import Image

from .errors import FluxKleinError
from .inputs.settings import PreparedInputs
from .models.rope import token_grid


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What a pipeline gives up for memory; `low_memory=True` is all four, `False` none.

    blockwise: evaluate the transformer block by block (lower activation peak, one sync per block).
    tiled_decode: decode in row bands (same image, bounded decoder activations).
    release_models: release the transformer before the decode and the VAE after it (they reload
        for the next image), so one big model is resident at a time.
    drop_lora_originals: fuse LoRAs without keeping the original weights (a change of LoRAs then
        reloads the transformer; with release_models it reloads for every image anyway).
    """

    blockwise: bool = False
    tiled_decode: bool = False
    release_models: bool = False
    drop_lora_originals: bool = False

    @classmethod
    def of(cls, low_memory) -> MemoryPlan:
        if isinstance(low_memory, MemoryPlan):
            return low_memory
        if not isinstance(low_memory, bool):
            raise FluxKleinError(f"low_memory must be True, False or a MemoryPlan, not {low_memory!r}")
        return (
            cls(blockwise=True, tiled_decode=True, release_models=True, drop_lora_originals=True)
            if low_memory
            else cls()
        )


@dataclass(kw_only=True)
class StageStats:
    seconds: float = 0.0
    peak_memory: int = 0  # bytes (mx.get_peak_memory over the stage)
    load_seconds: float = 0.0  # the part of `seconds` spent loading models (first use, or after a release)


@dataclass(kw_only=True)
class Stats:
    """Where one image's time and memory went."""

    encode: StageStats = field(default_factory=StageStats)
    denoise: StageStats = field(default_factory=StageStats)
    decode: StageStats = field(default_factory=StageStats)
    seconds_per_step: float = 0.0
    reference_kv_seconds: float | None = None  # klein 9B-KV: the reference pass of the first step
    reference_kv_bytes: int | None = None  # ... and the size of its cache
    upsample_seconds: float | None = None  # FLUX 3 --upsample: writing the caption (None: not upsampled)

    @property
    def total_seconds(self) -> float:
        return self.encode.seconds + self.denoise.seconds + self.decode.seconds + (self.upsample_seconds or 0.0)

    @property
    def load_seconds(self) -> float:
        """Time spent loading models while making this image (included in the stages' seconds)."""
        return self.encode.load_seconds + self.denoise.load_seconds + self.decode.load_seconds


@dataclass(kw_only=True)
class Event:
    """One event of `FluxKleinPipeline.stream`: a finished stage or denoising step."""

    stage: str  # "encode" | "denoise" | "decode"
    step: int = 0  # denoising step just finished (1-based); 0 outside the loop
    total: int = 0  # number of denoising steps that run
    seconds: float = 0.0  # wall time of this step or stage
    stats: Stats = field(default_factory=Stats)
    image: Image.Image | np.ndarray | None = None  # the final "decode" event's image
    metadata: dict | None = None  # ... and its record (output.image_metadata)
    # "denoise" events: the step's estimate of the clean latent tokens (1, h*w, C), lazy (for previews)
    denoised: mx.array | None = None
    grid: tuple[int, int] = (0, 0)  # (h, w) of the latent token grid: image size / 16


@dataclass(kw_only=True)
class Job:
    """One image in flight between the stages: its inputs, conditioning, latents and stats."""

    inputs: PreparedInputs
    x: mx.array  # (1, h*w, 128) packed latents; the denoise stage advances it
    ctx: list[mx.array]  # prompt embeddings, each (1, L, C); [cond, uncond] with CFG (FLUX.2: L = 512)
    ref_tokens: mx.array | None  # (1, sum h_k*w_k, 128) init image + reference tokens, or None
    ref_ids: mx.array | None  # (sum h_k*w_k, 4) their RoPE ids
    prior: mx.array  # (1, h*w, 128) float32 noise, reused to re-noise the kept region (inpainting)
    sigmas: list[float]  # the sigmas of the steps that run, then 0 (img2img: the first t_start skipped)
    x0: mx.array | None = None  # (1, h*w, 128) init image tokens
    mask: mx.array | None = None  # (1, h*w, 1) inpainting mask on the token grid, 1 = repaint
    stats: Stats = field(default_factory=Stats)

    @property
    def grid(self) -> tuple[int, int]:
        """(h, w) of the latent token grid: image size / 16."""
        return token_grid(self.inputs.settings.width, self.inputs.settings.height)
