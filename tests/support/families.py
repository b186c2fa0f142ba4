"""Each family's test kit: what a test written once for both families asks of the family it runs on
(issue 45). `KITS[name]` is the kit of the registry's family `name`; conftest.py's `family` fixture runs a
test once per kit. A field belongs here only when both families have it: what truly differs (the KV cache,
the flow map, the canvas reference) stays in the per-family test files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from text_encoders import TEXTS
from tiny_flux3 import shared_tiny_flux3_snapshot
from tiny_loras import LORAS
from tiny_model import shared_tiny_snapshot
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

    def reference_transformer_class(self):
        import diffusers

        return getattr(diffusers, self.transformer_class)


def models_kit(name: str) -> dict:
    """The tw-models fields (tests/models, tests/lora) of family `name`'s kit."""
    return dict(text=TEXTS[name], transformer=TRANSFORMERS[name], lora=LORAS[name])


KITS = {
    "flux2": FamilyKit("flux2", shared_tiny_snapshot, "Flux2Transformer2DModel", **models_kit("flux2")),
    "flux3": FamilyKit("flux3", shared_tiny_flux3_snapshot, "Flux3Transformer2DModel", **models_kit("flux3")),
}
