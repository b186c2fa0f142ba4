"""The optimizers of `--optimizer`, each with the semantics of its torch reference (tests/train/test_optimizers.py
runs the same gradients through both):

    adamw      mlx.optimizers.AdamW as torch.optim.AdamW (bias correction, decoupled weight decay, eps
               1e-8; MLX's own defaults differ: G9). The default, as diffusers' trainers.
    adafactor  mlx.optimizers.Adafactor with torch.optim.Adafactor's step size: the relative step
               min(lr, 1/sqrt(t)) scaled by max(1e-3, RMS(parameter)), weight decay lr x wd (MLX's own
               default caps the step at 1e-2 and ignores lr). Its lr is of another scale than AdamW's
               (torch's default 1e-2): an adapter that starts at zero (LoRA's B) moves by 1e-3 x lr.
    lion       mlx.optimizers.Lion (Chen et al. 2023), as lion-pytorch's Lion: sign updates, betas
               (0.9, 0.99), decoupled weight decay; the paper advises an lr 3-10x smaller than AdamW's.
    prodigy    Prodigy (Mishchenko & Defazio 2023), written here (MLX has none) as the prodigyopt
               reference's defaults: Adam whose step d x lr is estimated from the distance travelled
               (d starts at 1e-6, grows, never falls), betas (0.9, 0.999), beta3 = sqrt(beta2), no bias
               correction, decoupled weight decay; lr is a multiplier of d (1.0 is usual).

The gradients reach each optimizer clipped to --max-grad-norm (objective.optimizer_step); the lr schedule
sets `learning_rate` before each step (for Prodigy, the multiplier of d).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

OPTIMIZERS = ("adamw", "adafactor", "lion", "prodigy")


def make_optimizer(settings) -> optim.Optimizer:
    """The optimizer of `settings.optimizer` at `settings.lr` and `settings.weight_decay`."""
    name = getattr(settings, "optimizer", "adamw")
    if name == "adafactor":
        return TorchAdafactor(learning_rate=settings.lr, weight_decay=settings.weight_decay)
    if name == "lion":
        return optim.Lion(learning_rate=settings.lr, betas=[0.9, 0.99], weight_decay=settings.weight_decay)
    if name == "prodigy":
        return Prodigy(learning_rate=settings.lr, weight_decay=settings.weight_decay)
    return optim.AdamW(
        learning_rate=settings.lr,
        betas=[0.9, 0.999],
        eps=1e-8,
        weight_decay=settings.weight_decay,
        bias_correction=True,
    )


def state_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-parameter state `name`'s optimizer keeps for a parameter of `shape` (the checkpoint's check,
    train/state.py): its names and shapes."""
    if name == "adafactor":  # factored over the last two axes, as MLX's Adafactor
        if len(shape) >= 2:
            return {"exp_avg_sq_row": shape[:-1], "exp_avg_sq_col": shape[:-2] + shape[-1:]}
        return {"exp_avg_sq": shape}
    if name == "lion":
        return {"m": shape}
    if name == "prodigy":
        return dict.fromkeys(("exp_avg", "exp_avg_sq", "s", "p0"), shape)
    return {"m": shape, "v": shape}


class TorchAdafactor(optim.Adafactor):
    """MLX's Adafactor (factored second moments of the last two axes, update clipped to RMS 1, no first
    moment) with torch.optim.Adafactor's step size and weight decay (module docstring)."""

    def __init__(self, learning_rate: float, weight_decay: float = 0.0):
        super().__init__(learning_rate=learning_rate, eps=(1e-30, 1e-3), relative_step=False, weight_decay=0.0)
        self.decay = weight_decay  # torch's: the parameter shrinks by lr x wd, not by the scaled step

    def _compute_learning_rate(self, step, parameter_rms):
        rho = mx.minimum(self.learning_rate.astype(mx.float32), mx.rsqrt(step.astype(mx.float32)))
        return mx.maximum(self.eps[1], parameter_rms) * rho.astype(parameter_rms.dtype)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        new = super().apply_single(gradient, parameter, state)
        if self.decay:
            new = new - parameter * (self.learning_rate.astype(parameter.dtype) * self.decay)
        return new


class Prodigy(optim.Optimizer):
    """Prodigy: Adam with the step d x lr, d estimated on line (module docstring). The run-wide estimates
    (d, its maximum, the numerator) live in `state` beside the per-parameter ones, so a checkpoint holds
    them; per parameter: the moments, the weighted gradient sum `s` and the starting point `p0`."""

    def __init__(self, learning_rate: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.betas = betas
        self.beta3 = math.sqrt(betas[1])
        self.eps = eps
        self.weight_decay = weight_decay
        self.d0 = 1e-6
        self.state["prodigy"] = {
            "d": mx.array(self.d0, mx.float32),
            "d_max": mx.array(self.d0, mx.float32),
            "numerator": mx.array(0.0, mx.float32),
        }

    def init_single(self, parameter: mx.array, state: dict):
        state["exp_avg"] = mx.zeros_like(parameter)
        state["exp_avg_sq"] = mx.zeros_like(parameter)
        state["s"] = mx.zeros_like(parameter)
        state["p0"] = mx.array(parameter)  # where this parameter started

    def apply_gradients(self, gradients: dict, parameters: dict):
        if not self._initialized:  # from the parameters (p0), not from the gradients as the base class would
            self.init(tree_map(lambda _, p: p, gradients, parameters))
        if self.learning_rate.item() == 0.0:  # a warmup's first step: the reference changes nothing but p0
            return tree_map(lambda _, p: p, gradients, parameters)
        b1, b2 = self.betas
        run = self.state["prodigy"]
        d, lr = run["d"], self.learning_rate.astype(mx.float32)
        dlr = d * lr
        grads = [g for _, g in tree_flatten(gradients)]
        params = [p for _, p in tree_flatten(tree_map(lambda _, p: p, gradients, parameters))]
        states = [s for _, s in tree_flatten(tree_map(lambda _, s: s, gradients, self.state), is_leaf=_is_state)]
        numerator = run["numerator"] * self.beta3
        denominator = mx.array(0.0, mx.float32)
        for g, p, st in zip(grads, params, states, strict=True):
            numerator = numerator + (d / self.d0) * dlr * mx.sum(g * (st["p0"] - p))
            st["exp_avg"] = b1 * st["exp_avg"] + d * (1 - b1) * g
            st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + d * d * (1 - b2) * g * g
            st["s"] = self.beta3 * st["s"] + (d / self.d0) * dlr * g
            denominator = denominator + mx.sum(mx.abs(st["s"]))
        if denominator.item() == 0.0:  # no gradient yet: the reference stops here (the moments updated)
            return tree_map(lambda _, p: p, gradients, parameters)
        d_max = mx.maximum(run["d_max"], numerator / denominator)
        new_d = d_max  # the reference's min(d_max, d x growth rate), its growth rate unbounded
        self.state["prodigy"] = {"d": new_d, "d_max": d_max, "numerator": numerator}
        self.state["step"] = self.step + 1

        def update(g, p, st):
            denom = mx.sqrt(st["exp_avg_sq"]) + new_d * self.eps
            if self.weight_decay:
                p = p - self.weight_decay * dlr * p
            return p - dlr * st["exp_avg"] / denom

        return tree_map(update, gradients, parameters, self.state)


def _is_state(node) -> bool:
    """A parameter's state dict (the leaves `tree_flatten` stops at for Prodigy's per-parameter states)."""
    return isinstance(node, dict) and "exp_avg" in node
