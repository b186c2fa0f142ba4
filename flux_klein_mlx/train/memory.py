"""The planned peak memory of a training step, before any model loads, and whether it fits the machine.

    peak = weights + 12 B x trainable values (float32 adapters + AdamW's two moments)
         + batch x (4 B x trainable values (the gradients) + b x L + c x L^2)

L = image tokens (H/16 x W/16 of the largest resolution, times 1 + the number of control images) +
the family's text tokens (FLUX.2: 512). The weights are counted from the model's shapes (bf16 2 B per value; quantized
Linears bits + 32/group_size bits per value: a scale and a bias per group). b (bytes per token) and
c (bytes per token pair: the attention probabilities) are fitted to the peaks that
`benchmarks/train_step.py memory` measured for klein-4B Base, rank 16 on all block Linears, batch 1
(benchmarks/train_step.json, the rows of README's training memory table; full depth fitted from 1-3
blocks, which agrees with the full-depth measurements to 1.5 %):

    setting                     measured peak - resident at 512², 1024²   fit
    bf16, --low-memory          1.503 GB, 5.130 GB                          exact at both
    4-bit, --low-memory         1.682 GB, 5.610 GB                          exact at both
    bf16 / 4-bit, all kept      9.065 / 9.102 GB (512² only)                c: the --low-memory c plus 24 more
                                                                            blocks' (24, L, L) bf16 probabilities

(8-bit uses the 4-bit coefficients: both run the adapters beside a quantized matmul.) For another
model (klein-9B) b is scaled by hidden size x blocks and c by heads (x blocks when all are kept),
relative to klein-4B's 3072 x 25 and 24 heads: an extrapolation, not a measurement. FLUX 3 Image Klein
is planned the same way from its own shapes (the weights of its transformer, its 5 + 28 blocks the image
passes, the family's planned 160 text tokens: two caption windows); no FLUX 3 step has been measured. The
measurements used Metal-like stand-ins on Linux, not a Mac; treat the plan as a guide (about 5 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..errors import FluxKleinError
from ..family import family_of
from ..limits import machine_memory  # the one home of the machine's memory (the pipeline's size limit reads it too)
from ..models.rope import token_grid

# klein-4B's reference geometry (the model the coefficients were measured on)
REF_HIDDEN = 3072
REF_BLOCKS = 25
REF_HEADS = 24
# (quantized, low_memory) -> (b bytes per token, c bytes per token pair), from the measured rows above
_MEASURED = {  # (quantized, low_memory) -> ((L, peak - resident - gradients) at 512², at 1024²)
    (False, True): ((1536, 1502567248 - 96337920), (4608, 5129862676 - 96337920)),
    (True, True): ((1536, 1681769594 - 96337920), (4608, 5609738362 - 96337920)),
    (False, False): ((1536, 9064708100 - 96337920),),
    (True, False): ((1536, 9102469124 - 96337920),),
}  # fmt: skip
KEPT_PROBABILITIES = (REF_BLOCKS - 1) * REF_HEADS * 2  # bytes per token pair: the other blocks' bf16 probabilities


def coefficients(quantized: bool, low_memory: bool) -> tuple[float, float]:
    """(b, c) for klein-4B: exact through the two --low-memory points; without it, c adds the kept
    probabilities of the other blocks and b goes through the 512² point."""
    ckpt = _MEASURED[(quantized, True)]
    (l1, y1), (l2, y2) = ckpt
    c = (y2 - y1 * l2 / l1) / (l2 * l2 - l1 * l2)  # solve b L + c L^2 = y at both points
    if not low_memory:
        c += KEPT_PROBABILITIES
        ((l1, y1),) = _MEASURED[(quantized, False)]
    b = (y1 - c * l1 * l1) / l1
    return b, c


def weight_bytes(params, bits: int | None, group_size: int = 64) -> int:
    """The transformer's bytes in memory: shapes counted on a lazy (never evaluated) model."""
    model = family_of(params).build_transformer(params)
    total = 0.0
    for _, m in model.named_modules():
        for name, v in m.parameters().items():
            if not isinstance(v, mx.array):
                continue
            quantized = bits and isinstance(m, nn.Linear) and name == "weight" and v.shape[-1] % group_size == 0
            total += v.size * ((bits + 32 / group_size) / 8 if quantized else 2)
    return int(total)


@dataclass(kw_only=True)
class MemoryPlanned:
    """The planned peak of a step (an event, before any model loads)."""

    peak: int  # bytes
    weights: int
    trainable: int  # the adapters' trainable values (the trainer's TrainStarted.parameters)
    available: int
    available_from: str
    fits: bool
    remedies: list[str]  # options that would make it fit, each with its planned peak


def step_peak(
    params,
    trainable: int,
    *,
    resolution: int,
    bits: int | None,
    low_memory: bool,
    batch: int = 1,
    controls: int = 0,
    group_size: int = 64,
) -> tuple[int, int]:
    """(planned peak, weight bytes) of one step (module docstring)."""
    weights = weight_bytes(params, bits, group_size)
    L = math.prod(token_grid(resolution, resolution)) * (1 + controls) + family_of(params).planned_text_tokens
    b, c = coefficients(bits is not None, low_memory)
    blocks = params.depth + params.depth_single
    kb = params.hidden_size * blocks / (REF_HIDDEN * REF_BLOCKS)
    kc = params.num_heads / REF_HEADS * (1 if low_memory else blocks / REF_BLOCKS)
    activations = 4 * trainable + b * kb * L + c * kc * L * L
    return int(weights + 12 * trainable + batch * activations), weights


def plan_memory(
    settings,
    *,
    params,
    trainable: int,
    controls: int = 0,
    bits: int | None = None,
    batch: int | None = None,
) -> MemoryPlanned:
    """The plan for `settings` (TrainSettings; `bits`: the base's quantization, stored or asked; `batch`: the
    batch that runs, data.running_batch, default --batch-size), with the options that fit when it does not."""
    available, source = machine_memory()
    batch = settings.batch_size if batch is None else batch

    # (peak, weights) of a step of this run at `bits`, `low_memory`, `resolution`
    sized = partial(step_peak, params, trainable, batch=batch, controls=controls, group_size=settings.group_size)

    def peak(bits, low_memory, resolution) -> int:
        return sized(bits=bits, low_memory=low_memory, resolution=resolution)[0]

    size = max(settings.resolutions)
    planned, weights = sized(bits=bits, low_memory=settings.low_memory, resolution=size)
    remedies: list[str] = []
    if planned > available:
        tries = []  # (the options to add, bits, low_memory, resolution)
        if bits != 4:
            tries.append(("--quantize 4", 4, settings.low_memory, size))
        if not settings.low_memory:
            tries.append(("--low-memory", bits, True, size))
        single_fits = any(peak(b, low, r) <= available for _, b, low, r in tries)
        if bits != 4 and not settings.low_memory and not single_fits:
            tries.append(("--quantize 4 --low-memory", 4, True, size))
        smaller = [r for r in (1024, 768, 512, 384, 256) if r < size]
        for b, low, words in ((bits, settings.low_memory, ""), (4, True, " --quantize 4 --low-memory")):
            fit = next((r for r in smaller if peak(b, low, r) <= available), None)
            if fit is not None:  # several sizes: keep those up to the one that fits
                kept = [str(r) for r in settings.resolutions if r <= fit] or [str(fit)]
                tries.append((f"--resolution {','.join(kept)}{words}", b, low, fit))
                break
        for words, bits, low, res in tries:
            p = peak(bits, low, res)
            if p <= available:
                remedies.append(f"{words} ({p / 1e9:.1f} GB)")
    return MemoryPlanned(
        peak=planned,
        weights=weights,
        trainable=trainable,
        available=available,
        available_from=source,
        fits=planned <= available,
        remedies=remedies,
    )


def describe_plan(plan: MemoryPlanned) -> str:
    """One line: the planned peak (with the weights and the trainable values in it) against the machine's memory."""
    return (
        f"memory plan: a step peaks at about {plan.peak / 1e9:.1f} GB (weights {plan.weights / 1e9:.1f} GB, "
        f"{plan.trainable:,} trainable parameters) of {plan.available / 1e9:.1f} GB ({plan.available_from})"
    )


def check_memory(settings, info, trainable: int, batch: int | None = None) -> MemoryPlanned:
    """The plan of a run (`settings`, `info` a loading.ModelInfo, `trainable` its adapters' values, `batch`
    the batch that runs); refuses a step that will not fit (FluxKleinError naming what would), unless `s.force`."""
    stored = (info.quantization.get("transformer") or {}).get("bits")
    bits = settings.quantize if settings.quantize is not None else stored
    plan = plan_memory(
        settings, params=info.params, trainable=trainable, controls=len(settings.controls), bits=bits, batch=batch
    )
    if not plan.fits and not settings.force:
        fix = "; ".join(plan.remedies) if plan.remedies else "no setting of --quantize, --low-memory, --resolution fits"
        raise FluxKleinError(
            f"{describe_plan(plan)}: it will not fit. It fits with: {fix}; or give --force to try anyway"
        )
    return plan
