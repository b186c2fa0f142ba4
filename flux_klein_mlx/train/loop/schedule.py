"""The learning-rate schedules of diffusers' `get_scheduler`, as a plain function of the step.

diffusers' training scripts build `get_scheduler(name, optimizer, num_warmup_steps=W,
num_training_steps=T)` (a torch `LambdaLR`) and call `lr_scheduler.step()` after each optimizer
step, so optimizer step k (1, 2, ...) runs at base_lr * f(k - 1), where f(n) is the factor after n
scheduler steps (diffusers' `optimization.py`):

    constant              1
    constant_with_warmup  n / W while n < W, then 1
    linear                n / W while n < W, then max(0, (T - n) / (T - W))
    cosine                n / W while n < W, then max(0, (1 + cos(pi * p)) / 2) with p = (n - W) / (T - W)

(a denominator of 0 counts as 1, as diffusers' `max(1, ...)`). With a warmup, step 1 runs at lr 0,
as in diffusers. The factor depends on the step alone, so a resumed run meets the same values.
"""

from __future__ import annotations

import math

from ...errors import FluxKleinError

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")


def check_schedule(name: str, warmup: int, steps: int) -> None:
    """Refuse an unknown schedule, a negative warmup, a warmup past the run, or a warmup `constant` ignores."""
    if name not in SCHEDULES:
        raise FluxKleinError(f"lr-scheduler must be one of {', '.join(SCHEDULES)}, not {name!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise FluxKleinError(f"warmup-steps must be a whole number >= 0, not {warmup!r}")
    if warmup > steps:
        raise FluxKleinError(f"--warmup-steps {warmup} is past --steps {steps}; give at most {steps}")
    if warmup and name == "constant":
        raise FluxKleinError(
            "--warmup-steps has no effect with --lr-scheduler constant; use --lr-scheduler constant_with_warmup"
        )


def lr_factor(name: str, n: int, warmup: int, total: int) -> float:
    """The schedule's factor after `n` scheduler steps (n = step - 1), for a run of `total` steps."""
    if name == "constant":
        return 1.0
    if n < warmup:
        return float(n) / float(max(1, warmup))
    if name == "constant_with_warmup":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - n) / float(max(1, total - warmup)))
    progress = float(n - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))  # diffusers: num_cycles 0.5


def lr_at_step(name: str, base_lr: float, step: int, warmup: int, total: int) -> float:
    """The learning rate optimizer step `step` (1-based) runs at."""
    return base_lr * lr_factor(name, step - 1, warmup, total)
