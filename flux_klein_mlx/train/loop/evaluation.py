"""What a run keeps and measures beside its raw weights: an EMA of the adapters, a held-out loss.

EMA (`--ema DECAY`): diffusers' `EMAModel` (training_utils.py, its defaults: no warmup,
update_after_step 0) over the adapter weights, in float32. After optimizer step k (1-based):

    d_k = 0 for k = 1,  min(DECAY, k / (9 + k)) after      (EMAModel.get_decay: (1 + s) / (10 + s), s = k - 1)
    ema <- ema - (1 - d_k) (ema - w_k)

The ramp k / (9 + k) keeps a short run's average from being mostly the (zero) starting LoRA: a plain
0.999 average would still hold 0.999^500 = 61 % of it after 500 steps. The EMA is the run's output
file, and `ema.safetensors` (the layout of `lora.safetensors`, float32: diffusers/PEFT for a LoRA,
ComfyUI for a LoKr) beside `lora.safetensors` in every checkpoint, so a resumed run continues it
exactly and the average of any checkpoint loads where its LoRA does.

Validation (`--validation DIR`, images + captions as `--data`): at each checkpoint, the flow-matching
loss of the current (raw) weights on each held-out image at the noise levels `VALIDATION_SIGMAS`,
each with fixed noise: image i (in the folder's name order) uses

    np.random.default_rng([VALIDATION_SEED, i]).standard_normal((len(VALIDATION_SIGMAS), L, C), dtype=np.float32)

(level k takes row k), whatever `--seed` is, so runs with other settings compare number for number.
The reported loss is the mean over images and levels; `by_sigma` keeps the mean over images per level.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ...errors import FluxKleinError
from ..state import read_adapter_file

VALIDATION_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)  # midpoints of five equal bins of sigma in [0, 1]
VALIDATION_SEED = 29  # fixed for every run: the noise does not follow --seed
EMA_FILE = "ema.safetensors"


@dataclass
class ValidationFinished:
    step: int
    loss: float  # mean over images and noise levels
    by_sigma: dict = field(default_factory=dict)  # "0.1" -> mean over images at that level


def ema_decay(decay: float, step: int) -> float:
    """diffusers' EMAModel.get_decay (use_ema_warmup False, update_after_step 0) at optimizer step `step` (1-based)."""
    s = step - 1
    if s <= 0:
        return 0.0
    return min(decay, (1 + s) / (10 + s))


class AdapterEMA:
    """The float32 moving average of every adapter tensor, keyed as the adapters' `arrays()`."""

    def __init__(self, decay: float, lora):
        self.decay = decay
        self.values = dict(lora.arrays(mx.float32))

    def update(self, lora, step: int) -> None:
        """Fold in the weights after optimizer step `step`, as EMAModel.step does (s -= (1 - d)(s - w))."""
        one_minus = 1.0 - ema_decay(self.decay, step)
        for key, w in lora.arrays(mx.float32).items():
            e = self.values[key]
            self.values[key] = e - one_minus * (e - w)
        mx.eval(list(self.values.values()))

    @contextmanager
    def in_adapters(self, lora):
        """The average in the adapters for the block; the trained weights are put back after it."""
        trained = lora.arrays(mx.float32)
        lora.load(self.values, "the EMA")
        try:
            yield
        finally:
            lora.load(trained, "the trained weights")

    def writing(self, lora, write: Callable[[Path], None]) -> Callable[[Path], None]:
        """`write` (the run's own LoRA file writer: its layout and header) run with the average in the
        adapters: the EMA is the run's output file."""

        def run(path: Path) -> None:
            with self.in_adapters(lora):
                write(path)

        return run

    def load(self, folder: Path, lora) -> None:
        """The EMA of checkpoint `folder` (its ema.safetensors), read through the adapters, which check
        every name and shape."""
        path = folder / EMA_FILE
        if not path.is_file():
            raise FluxKleinError(f"checkpoint {folder} has no {EMA_FILE}; resume it without --ema or start anew")
        trained = lora.arrays(mx.float32)
        try:
            lora.load(read_adapter_file(path), str(path))
            self.values = lora.arrays(mx.float32)
        finally:
            lora.load(trained, "the trained weights")
        mx.eval(list(self.values.values()))


def validation_noise(index: int, tokens: int, channels: int) -> np.ndarray:
    """The fixed noise of validation image `index`: (levels, L, C) float32 (module docstring)."""
    rng = np.random.default_rng([VALIDATION_SEED, index])
    return rng.standard_normal((len(VALIDATION_SIGMAS), tokens, channels), dtype=np.float32)


class Validation:
    """The held-out images (`data.TrainItem`s), their cached latents, and the losses measured so far."""

    def __init__(self, items: list):
        self.items = items
        self.latents: list[mx.array] = []  # per item (1, L, C)
        self.refs: list[mx.array | None] = []  # per item (1, n_controls * L, C), or None without controls
        self.history: list[dict] = []  # {"step", "loss", "by_sigma"} per checkpoint

    def __bool__(self) -> bool:
        return bool(self.items)

    def captions(self) -> list[str]:
        return [it.caption for it in self.items]

    def encode(self, encode: Callable) -> None:
        """Cache each image's latent tokens with `encode(path, bucket)` -> (1, L, C) (the VAE is loaded then),
        and its control images' (clean references, one image after another), as training does."""
        for it in self.items:
            x0 = encode(it.image.path, it.bucket)
            refs = mx.concatenate([encode(c.path, it.bucket) for c in it.controls], axis=1) if it.controls else None
            mx.eval(x0 if refs is None else [x0, refs])
            self.latents.append(x0)
            self.refs.append(refs)

    def measure(self, step: int, loss_fn: Callable, ctx: dict, rope: Callable) -> ValidationFinished:
        """The loss at every (image, level): `loss_fn(x0, noise, sigma, ctx, rope, refs)` is the run's objective,
        called without gradients; `ctx` maps captions to (1, Lt, E); `rope(item, n)` gives the item's tables
        with n control images."""
        sums = np.zeros(len(VALIDATION_SIGMAS))
        for i, (it, x0, refs) in enumerate(zip(self.items, self.latents, self.refs)):
            noise = validation_noise(i, x0.shape[1], x0.shape[2])
            tables = rope(it, len(it.controls))
            for k, sigma in enumerate(VALIDATION_SIGMAS):
                sigma_k = mx.array([sigma], dtype=mx.float32)
                loss = loss_fn(x0, mx.array(noise[k : k + 1]), sigma_k, ctx[it.caption], tables, refs)
                sums[k] += loss.item()
        by_sigma = {str(sigma): float(v / len(self.items)) for sigma, v in zip(VALIDATION_SIGMAS, sums)}
        result = ValidationFinished(step, float(np.mean(list(by_sigma.values()))), by_sigma)
        self.history = [h for h in self.history if h["step"] != step] + [vars(result).copy()]
        return result

    def points(self) -> list[tuple[int, float]]:
        """(step, loss) of every measurement, for loss.png."""
        return [(h["step"], h["loss"]) for h in self.history]
