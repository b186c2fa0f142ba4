"""The training objective of klein LoRAs: diffusers' flow matching, sigma sampling, AdamW.

The objective is that of diffusers' `train_dreambooth_lora_flux2_klein.py` (docs/training.md#the-objective),
per batch of images that share a bucket:

    x0     = the image's VAE posterior mean, 2x2-patchified, BatchNorm-normalised (cached once)
    eps    ~ N(0, I);  sigma ~ --timesteps;  x_t = (1 - sigma) x0 + sigma eps
    pred   = transformer(x_t tokens [+ clean control tokens], caption, timestep sigma)
    loss   = mean over batch, tokens and channels of (pred[:, :L] - (eps - x0))^2, in float32

The transformer rounds sigma to the activation dtype before it scales it by 1000 (as diffusers
does). Edit LoRAs (`controls`): each control image's clean latent tokens follow the target tokens,
with RoPE time coordinate 10, 20, ... as in our editing; only the target tokens carry loss.

The model's family makes the transformer call (family/, `training_rope` / `training_velocity`): FLUX.2 puts
the control tokens after the target's in one stream; FLUX 3 Image Klein gives them their own stream (RoPE
l = -(k + 1)), sees the image at sigma and text and references at 0, and reads each caption in its own window
(`batch_loss`: one pass per window length). docs/training.md#flux-3-image-klein says what FLUX 3 trains.

Sigma sampling (`timesteps`):
    shift         (default) musubi-tuner's `flux2_shift`: t = sigmoid(N(0, 1)), s = e^mu with mu linear
                  in the image's token count L (0.5 at L = 256, i.e. 256^2 px; 1.15 at L = 4096, 1024^2),
                  sigma = s t / (1 + (s - 1) t). Mid-range noise, shifted toward noise for larger images,
                  as klein's own sampling schedule is; musubi's FLUX.2 guide recommends it. diffusers'
                  uniform default spends as many steps on sigma < 0.1, where the image is nearly clean
                  and the loss says little. (musubi feeds the model sigma + 0.001; we feed sigma.)
    logit-normal  diffusers' `logit_normal`: u = sigmoid(N(0, 1)), sigma = (1000 - floor(1000 u)) / 1000.
    uniform       diffusers' default (`none`): u ~ U(0, 1) on the same grid, sigma uniform on {0.001 .. 1}.
On FLUX 3 `shift` uses the family's constant shift (6.93, its sampling schedule's) at every size.

Optimizer: AdamW with torch's semantics (bias correction, decoupled weight decay 1e-4 as diffusers,
eps 1e-8; it and the others of --optimizer: optimizers.py), gradients averaged over `grad_accum`
micro-batches and clipped to a global norm of 1.0, at the learning rate of `lr_scheduler` (diffusers'
schedules, below). The trainer (trainer.py) runs these on its batches; each is checked against
diffusers and torch in tests/train/test_objective.py.

Learning-rate schedules: diffusers' `get_scheduler`, as a plain function of the step.

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

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ...checks import check_choice
from ...errors import FluxKleinError
from ...family import family_of
from ...sampling import scale_noise

TRAIN_TIMESTEPS = 1000  # the scheduler's num_train_timesteps: sigma lives on a grid of 1/1000


def shift_mu(tokens: int) -> float:
    """musubi's flux2_shift mu: linear in the token count, 0.5 at 256 tokens, 1.15 at 4096."""
    m = (1.15 - 0.5) / (4096 - 256)
    return m * tokens + 0.5 - m * 256


def sigmas_from_draws(scheme: str, draws: np.ndarray, tokens: int, shift: float | None = None) -> np.ndarray:
    """sigma (B,) float32 from the run's random numbers: U(0, 1) draws for `uniform`, N(0, 1) for the others.
    `shift`: the family's constant shift of the `shift` scheme (FLUX 3: 6.93); None: FLUX.2's, by `tokens`."""
    d = np.asarray(draws, dtype=np.float32)
    if scheme == "shift":
        t = (1.0 / (1.0 + np.exp(-d.astype(np.float64)))).astype(np.float32)
        s = math.exp(shift_mu(tokens)) if shift is None else shift
        return ((t * np.float32(s)) / (np.float32(1) + np.float32(s - 1) * t)).astype(np.float32)
    u = d if scheme == "uniform" else (1.0 / (1.0 + np.exp(-d.astype(np.float64)))).astype(np.float32)
    idx = (u * np.float32(TRAIN_TIMESTEPS)).astype(np.int64)  # diffusers: (u * 1000).long()
    # scheduler.sigmas[idx] for klein's config (dynamic shifting: no static shift): (1000 - idx) / 1000
    return (np.float32(TRAIN_TIMESTEPS) - idx.astype(np.float32)) / np.float32(TRAIN_TIMESTEPS)


def flow_loss(model, x0, noise, *, sigma, ctx, rope, refs=None, checkpoint: bool = False) -> mx.array:
    """The flow-matching loss of one batch, float32.

    x0, noise (B, L, C): clean target tokens and noise; sigma (B,) float32; ctx (B, Lt, E) caption
    embeddings; rope the tables of [text; target; refs]; refs (B, Lr, C) clean control tokens or None.
    The model's family makes the call (family/: where references go, the timestep each stream sees).
    """
    s = sigma.astype(mx.float32)[:, None, None]
    xt = scale_noise(x0, noise, s)  # (B, L, C) float32
    family = family_of(model.params)
    pred = family.training_velocity(model, xt, ctx, sigma=sigma, rope=rope, refs=refs, checkpoint=checkpoint)
    target = noise.astype(mx.float32) - x0.astype(mx.float32)
    return mx.mean(mx.square(pred.astype(mx.float32) - target))


def batch_loss(model, x0, noise, *, sigma, ctx: list, rope, refs=None, checkpoint: bool = False) -> mx.array:
    """`flow_loss` of a batch whose captions may have windows of different lengths (FLUX 3: each caption keeps
    its own window, as at inference; FLUX.2's are all 512). ctx: one (1, Lt_i, E) per example; rope(Lt) the
    tables for Lt text tokens. Examples sharing a window run as one pass, weighted by their share of the batch:
    the loss is a mean over examples of equal size, so this equals one pass over the batch."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(ctx):
        groups.setdefault(c.shape[1], []).append(i)
    if len(groups) == 1:  # one window: the batch as it is
        ctx, tables = mx.concatenate(ctx, axis=0), rope(ctx[0].shape[1])
        return flow_loss(model, x0, noise, sigma=sigma, ctx=ctx, rope=tables, refs=refs, checkpoint=checkpoint)
    total = mx.array(0.0)
    for length, rows in groups.items():
        take = mx.array(rows)
        part = flow_loss(
            model,
            x0[take],
            noise[take],
            sigma=sigma[take],
            ctx=mx.concatenate([ctx[i] for i in rows], axis=0),
            rope=rope(length),
            refs=None if refs is None else refs[take],
            checkpoint=checkpoint,
        )
        total = total + part * (len(rows) / len(ctx))
    return total


def optimizer_step(optimizer: optim.Optimizer, model: nn.Module, grads, max_grad_norm: float) -> mx.array:
    """Clip the gradients to a global norm (torch's `clip_grad_norm_`) and update; returns the norm before clipping."""
    grads, norm = optim.clip_grad_norm(grads, max_grad_norm)
    optimizer.update(model, grads)
    return norm


# --- the learning-rate schedule ------------------------------------------------------------------------

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")


def check_schedule(name: str, warmup: int, steps: int) -> None:
    """Refuse an unknown schedule, a negative warmup, a warmup as long as the run or past it (its steps never
    reach the lr; a 1-step run at lr 0 writes an all-zero LoRA), or a warmup `constant` ignores."""
    check_choice("lr-scheduler", name, SCHEDULES)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise FluxKleinError(f"warmup-steps must be a whole number >= 0, not {warmup!r}")
    if warmup > steps:
        raise FluxKleinError(f"--warmup-steps {warmup} is past --steps {steps}; give at most {steps - 1}")
    if warmup and warmup == steps and name != "constant":  # step k runs at (k - 1) / W: never at --lr, step 1 at 0
        fewer = f"give --warmup-steps at most {steps - 1}" if steps > 1 else "give --warmup-steps 0"
        raise FluxKleinError(
            f"--warmup-steps {warmup} equals --steps {steps}: every step would run inside the warmup, below --lr "
            f"(step 1 at lr 0{', so the LoRA would stay all zero' if steps == 1 else ''}); {fewer} or raise --steps"
        )
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


def lr_at_step(name: str, *, base_lr: float, step: int, warmup: int, total: int) -> float:
    """The learning rate optimizer step `step` (1-based) runs at."""
    return base_lr * lr_factor(name, step - 1, warmup, total)
