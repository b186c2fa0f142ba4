"""The module names a LoRA may use on a transformer of any family, and which family a file's names are for.
The one door to "which diffusers / BFL / kohya name is which of our layers (and rows)", read by the readers
(`formats.parse_lora`), the writers (`layouts`) and the trainer (`train/step/adapters`); each family keeps its
own tables (`Family.lora`: family/<family>/lora.py). The family is found from the type of the model's
hyper-parameters, or, for a file without a model, from the names only its LoRA files carry.
"""

from __future__ import annotations

from ..family import FAMILIES, family_of
from ..family import family_of_names as model_family_of_names
from ..family.base import LoraNames, Target

__all__ = ["LoraNames", "Target", "diffusers_modules", "family_of_names", "layer_shapes", "lora_family",
           "target_table", "unmarked_lora"]  # fmt: skip


def lora_family(params) -> LoraNames:
    """The LoRA names of the family of a transformer's hyper-parameters (`FluxKleinParams`, `Flux3Params`)."""
    return family_of(params).lora


def unmarked_lora() -> LoraNames:
    """The LoRA names a file is read with when no name tells its family (`family.family_of_names`' first)."""
    return model_family_of_names(()).lora


def family_of_names(names) -> tuple[LoraNames, str] | None:
    """The family a LoRA's module names (or keys) are for, and a name that says it; None when no name, or
    names of both, tell (names both have: `txt_in`, `time_in`, `single_blocks.N`, `proj_out`, ...)."""
    hits = [(f.lora, next((n for n in names if f.lora.markers.search(n)), None)) for f in FAMILIES.values()]
    hits = [(f, n) for f, n in hits if n is not None]
    return hits[0] if len(hits) == 1 else None


def layer_shapes(params) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear of the transformer with `params` (any family), by our module path."""
    return lora_family(params).shapes(params)


def diffusers_modules(params, *, blocks_only: bool = False) -> list[str]:
    """The diffusers modules of a transformer that are Linears, in model order. The one list of "a block's
    diffusers layers" (the trainer's slots, the diffusers layout's units)."""
    return lora_family(params).modules(params, blocks_only)


def target_table(params) -> dict[str, Target]:
    """Every module name a LoRA for this transformer may use (ours, diffusers', dotted and underscored) -> its
    Target, from the family's own name tables."""
    return lora_family(params).table(params)
