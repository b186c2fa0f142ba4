"""The model families: what FLUX.2 [klein] and FLUX 3 Image Klein each contribute, in one seam.

A family is everything that differs between two generations of klein models while the rest of the
house (settings, inputs, the prompt cache, the VAE, the stages, the record, the server) stays the
same. `loading.describe` decides a model's family from its files and puts it in `ModelInfo.family`;
`pipeline`, `loading`, `convert`, `lora/`, `serve/` and `bench/` ask it instead of branching on it:

- its transformer: the hyper-parameters from a config, the module, the checkpoint sanitizer, the
  shapes of every Linear (the LoRA tables read them);
- its text window and taps: how a prompt becomes the embeddings the transformer reads;
- its schedule and timestep rule, and its sampling defaults (steps, guidance);
- its reference images: how they are prepared, where their tokens sit (RoPE ids), how many;
- its denoising call: `family.steps(model, job, ...)` builds, once per image, what depends only on
  shapes and returns the velocity of the target tokens at each step (CFG included).

`Family` below is the contract; `flux2.FLUX2` and `flux3.FLUX3` are the two families.
"""

from __future__ import annotations

from .base import Family, Steps
from .flux2.family import FLUX2
from .flux3.family import FLUX3

FAMILIES: dict[str, Family] = {FLUX2.key: FLUX2, FLUX3.key: FLUX3}


def family_named(key: str) -> Family:
    """The family a converted folder or a record names ("flux2", ...)."""
    return FAMILIES[key]


def all_variants() -> dict:
    """Every family's released models (`models/config.Variant` rows) by name: the benchmark's random models."""
    return {name: row for f in FAMILIES.values() for name, row in f.variants.items()}


def family_of_names(names) -> Family:
    """The one family whose markers (`LoraNames.markers`) a checkpoint's keys (or module names) carry; the first
    family, FLUX.2 [klein] (whose reader also knows FLUX.1's and FLUX.2-dev's names, to refuse them), when none
    or several show."""
    names = list(names)  # read once per family: an iterator would be spent by the first
    marked = [f for f in FAMILIES.values() if any(f.lora.markers.search(n) for n in names)]
    return marked[0] if len(marked) == 1 else next(iter(FAMILIES.values()))


def family_of_class(name) -> Family | None:
    """The family a diffusers `_class_name` (a pipeline's or a transformer's) belongs to, or None."""
    return next((f for f in FAMILIES.values() if isinstance(name, str) and name.startswith(f.class_prefix)), None)


def default_upsampler() -> str:
    """The prompt upsampler `upsample` runs without --upsampler: the one a family names (FLUX 3's)."""
    return next(f.upsampler for f in FAMILIES.values() if f.upsampler)


def family_of(params) -> Family:
    """The family whose transformer has these hyper-parameters (a `FluxKleinParams`, ...)."""
    return next(f for f in FAMILIES.values() if isinstance(params, f.params_type))


__all__ = [
    "FAMILIES",
    "FLUX2",
    "FLUX3",
    "Family",
    "Steps",
    "all_variants",
    "default_upsampler",
    "family_named",
    "family_of",
    "family_of_class",
    "family_of_names",
]
