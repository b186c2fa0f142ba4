"""--init-lora FILE: a run that starts from a LoRA file instead of from zero, read in any layout `--lora`
reads (diffusers / PEFT, ComfyUI and ai-toolkit, kohya / musubi, BFL names; alpha from the file).

The file's updates are mapped onto our layers (lora/formats.parse_lora), then split per diffusers
module as the diffusers layout writes them (lora/layouts.layout_pairs: a fused qkv that is three
adapters side by side gives back each at its rank; one adapter on the fused layer gives each module
its rows of it). Each module's pair becomes the run's (A, B) with the run's scale alpha / rank:

    file:  factor · up @ down        run:  (alpha / rank) · B @ A
    A = down,  B = up · factor · rank / alpha      (exact when factor = alpha / rank, e.g. alpha = rank
                                                      and a file whose alpha is folded, as ours are)

so the run's first image (step 0) is `generate` with the file. Refused before any model loads, in one
line: a LoKr file, a module --targets does not train, a rank other than --rank, a shape of another
model. Modules the file does not hold start as a new run's (A drawn, B zero).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import FluxKleinError, first_few
from ..lora.formats import parse_lora
from ..lora.layouts import layout_pairs
from ..lora.names import target_table
from ..storage.weights import read_lora_file


def init_arrays(path, slots: list, params, *, rank: int, alpha: float) -> dict[str, mx.array]:
    """`{slot}.down` (rank, in) and `{slot}.up` (out, rank) float32 for every slot the file at `path` holds
    (the names of adapters.TrainableLoRA.load), checked against `slots` (module docstring)."""
    where = f"--init-lora {path}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise FluxKleinError(f"{where} is not a file; give a LoRA .safetensors file")
    tensors, metadata, _ = read_lora_file(file)
    parsed = parse_lora(tensors, metadata, params, where)
    if parsed.unmatched:
        raise FluxKleinError(f"{where} holds adapters of no layer of this model ({first_few(parsed.unmatched)})")
    if any(t.down is None for t in parsed.terms):
        raise FluxKleinError(f"{where} is a LoKr; --init-lora starts LoRA pairs (--adapter lora) from a LoRA file")
    by_name = {slot.name: slot for slot in slots}
    pairs = layout_pairs(parsed.terms, "diffusers", params, where)
    untrained = [name for name, *_ in pairs if name not in by_name]
    if untrained:
        raise FluxKleinError(
            f"{where} holds adapters on {first_few(untrained)}, which --targets does not train; give --targets all "
            "(or the modules the file holds)"
        )
    ranks = sorted({int(down.shape[0]) for _, down, _, _ in pairs})
    if ranks != [rank]:
        raise FluxKleinError(
            f"{where} holds adapters of rank {', '.join(map(str, ranks))}, not --rank {rank}; give --rank {ranks[-1]}"
        )
    swapped = {name for name, t in target_table(params).items() if t.swap}
    out = {}
    for name, down, up, factor in pairs:
        slot = by_name[name]
        if name in swapped:  # diffusers' [scale ; shift] rows back to ours (layout_pairs rolled them by half)
            up = mx.roll(up, up.shape[0] // 2, axis=0)
        if tuple(down.shape) != (rank, slot.in_dims) or tuple(up.shape) != (slot.out_dims, rank):
            raise FluxKleinError(
                f"{where}: {name} has shapes {tuple(down.shape)} and {tuple(up.shape)}, not this model's"
            )
        out[f"{name}.down"] = mx.array(down).astype(mx.float32)
        out[f"{name}.up"] = mx.array(up).astype(mx.float32) * (float(factor) * rank / alpha)
    return out
