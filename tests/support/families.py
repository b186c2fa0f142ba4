"""Each family's test kit: what a test written once for both families asks of the family it runs on
(issue 45). `KITS[name]` is the kit of the registry's family `name`; conftest.py's `family` fixture runs a
test once per kit. A field belongs here only when both families have it: what truly differs (the KV cache,
the flow map, the canvas reference) stays in the per-family test files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flux3_refs import flux3_reference
from refs import flux2_reference
from text_encoders import TEXTS
from tiny_flux3 import shared_tiny_flux3_snapshot, write_bfl_flux3_file
from tiny_loras import LORAS
from tiny_model import shared_tiny_snapshot, write_bfl_file
from tiny_transformers import TRANSFORMERS


@dataclass(frozen=True)
class FamilyKit:
    name: str  # the key of flux_klein_mlx.family.FAMILIES
    snapshot: Callable[..., Path]  # (tmp_path_factory, *, distilled) -> the tiny snapshot, built once a session
    transformer_class: str  # diffusers' transformer class, by name (diffusers imports late: it is slow)
    # --- tw-models (tests/models, tests/lora) ---
    text: object  # text_encoders.Qwen3Texts / Qwen3VLTexts: the tiny text encoder, its judge, prompts, tolerance
    transformer: object  # tiny_transformers.Flux2Transformers / Flux3Transformers: references, inputs, BFL names
    lora: object  # tiny_loras.Flux2Loras / Flux3Loras: BFL names of a peft adapter, diffusers' LoRA loader
    # --- tw-doors: the doors' tests (test_pipeline, serve, benchmark, the command line) ---
    # diffusers' image from injected latents: (snapshot, *, prompt, latents, steps, images=None, guidance=None,
    # negative_prompt=None, width=None, height=None) -> (H, W, 3) float32 in [0, 1], the pipeline loaded once
    reference_image: Callable[..., object] = None
    title: str = ""  # the tiny distilled snapshot's model name (info.name); Base's is it + " Base"
    defaults: tuple = ()  # (steps, guidance) of the distilled model, then of Base (guidance None: no CFG)
    windows: tuple[int, int] = ()  # the text window (tokens) of a prompt of over 80 tokens, of a short one
    custom_variant: str = ""  # what `info.variant` says of the tiny snapshots (no released row's size)
    text_layers: int = 0  # the text encoder's layers a prompt runs through (its deepest tap)
    base_runs_once_per_image: bool = False  # Base runs the text and references' modes once per image, not per step
    keeps_reference_size: bool = False  # one reference runs on its canvas and the image is cropped back to it
    has_upsampler: bool = False  # the family's prompt upsampler (`upsample`, the page's checkbox)
    repo_id: str = ""  # the released distilled model's hub id (a test lays the tiny snapshot out under it)
    write_bfl: Callable[..., Path] = None  # (snapshot, path, *, prefix="") -> the transformer as a BFL file
    # bits -> (numpy statistic of |quantized - float32| image, its bound): 3 steps at 64x64 (test_pipeline)
    quantized_bounds: dict = None
    bfloat16_max: float = 0.0  # the most a bfloat16 image may differ from float32's (4 steps, 64x64, seed 0)

    def reference_transformer_class(self):
        import diffusers

        return getattr(diffusers, self.transformer_class)


def models_kit(name: str) -> dict:
    """The tw-models fields (tests/models, tests/lora) of family `name`'s kit."""
    return dict(text=TEXTS[name], transformer=TRANSFORMERS[name], lora=LORAS[name])


KITS = {
    "flux2": FamilyKit(
        "flux2",
        shared_tiny_snapshot,
        "Flux2Transformer2DModel",
        **models_kit("flux2"),
        # tw-doors
        reference_image=flux2_reference,
        title="FLUX.2 [klein] (custom size)",
        defaults=((4, None), (50, 4.0)),
        windows=(512, 512),  # every prompt fills the whole window
        custom_variant="other",  # neither klein-4b nor klein-9b
        text_layers=27,
        base_runs_once_per_image=False,
        keeps_reference_size=False,  # the reference is cropped to the 16-px grid, the image has its size
        has_upsampler=False,
        repo_id="black-forest-labs/FLUX.2-klein-4B",
        write_bfl=write_bfl_file,
        # measured at seeds 6-8: max 0.0067-0.0098 at 8 bits, 0.18-0.24 at 4 (means 0.0009-0.0010, 0.017-0.019)
        quantized_bounds={8: ("max", 0.05), 4: ("max", 0.5)},
        bfloat16_max=0.1,
    ),
    "flux3": FamilyKit(
        "flux3",
        shared_tiny_flux3_snapshot,
        "Flux3Transformer2DModel",
        **models_kit("flux3"),
        # tw-doors
        reference_image=flux3_reference,
        title="FLUX 3 Image Klein",
        defaults=((16, None), (50, 3.5)),
        windows=(160, 80),  # the prompt's length rounded up to 80 tokens
        custom_variant="flux3",  # FLUX 3's params name the family alone
        text_layers=32,
        base_runs_once_per_image=True,
        keeps_reference_size=True,
        has_upsampler=True,
        repo_id="black-forest-labs/flux-3-image-klein",
        write_bfl=write_bfl_flux3_file,
        # group 64: the tiny hidden size 64 is one group per row, the worst case (the 5.5B model has 48 per row).
        # Measured at seeds 6-8: mean 0.0012-0.0013 at 8 bits, 0.021-0.024 at 4 (max 0.26); twice the worst mean.
        quantized_bounds={8: ("mean", 0.005), 4: ("mean", 0.05)},
        bfloat16_max=0.3,  # measured 0.21 on the tiny FLUX 3 (its mean against diffusers stays under 0.05)
    ),
}
