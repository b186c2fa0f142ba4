"""What a run keeps and measures beside its raw weights: an EMA of the adapters, a held-out loss, the
loss average and loss.png.

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

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ...errors import FluxKleinError
from ..state import EMA_FILE, read_adapter_file, write_atomic

VALIDATION_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)  # midpoints of five equal bins of sigma in [0, 1]
VALIDATION_SEED = 29  # fixed for every run: the noise does not follow --seed


@dataclass(kw_only=True)
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
            raise FluxKleinError(f"checkpoint {folder} has no {EMA_FILE}; delete it to resume from an earlier one")
        trained = lora.arrays(mx.float32)
        try:
            lora.load_terms(read_adapter_file(path, lora), str(path))
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
        """Cache each image's latent tokens with `encode(picture, bucket)` -> (1, L, C) (train/data/latents.py),
        and its control images' (clean references, one image after another), as training does."""
        for it in self.items:
            x0 = encode(it.image, it.bucket)
            refs = mx.concatenate([encode(c, it.bucket) for c in it.controls], axis=1) if it.controls else None
            mx.eval(x0 if refs is None else [x0, refs])
            self.latents.append(x0)
            self.refs.append(refs)

    def measure(self, step: int, loss_fn: Callable, ctx: dict, rope: Callable) -> ValidationFinished:
        """The loss at every (image, level): `loss_fn(x0, noise, sigma=, ctx=, rope=, refs=)` is the run's objective,
        called without gradients; `ctx` maps captions to (1, Lt, E); `rope(item, n, Lt)` gives the item's tables
        with n control images and Lt text tokens."""
        sums = np.zeros(len(VALIDATION_SIGMAS))
        for i, (it, x0, refs) in enumerate(zip(self.items, self.latents, self.refs, strict=True)):
            noise = validation_noise(i, x0.shape[1], x0.shape[2])
            tables = rope(it, len(it.controls), ctx[it.caption].shape[1])
            for k, sigma in enumerate(VALIDATION_SIGMAS):
                sigma_k = mx.array([sigma], dtype=mx.float32)
                loss = loss_fn(
                    x0, mx.array(noise[k : k + 1]), sigma=sigma_k, ctx=ctx[it.caption], rope=tables, refs=refs
                )
                sums[k] += loss.item()
        by_sigma = {str(sigma): float(v / len(self.items)) for sigma, v in zip(VALIDATION_SIGMAS, sums, strict=True)}
        result = ValidationFinished(step=step, loss=float(np.mean(list(by_sigma.values()))), by_sigma=by_sigma)
        self.history = [h for h in self.history if h["step"] != step] + [vars(result).copy()]
        return result

    def points(self) -> list[tuple[int, float]]:
        """(step, loss) of every measurement, for loss.png."""
        return [(h["step"], h["loss"]) for h in self.history]


# --- the loss average and loss.png ------------------------------------------------------------------


def average_window(total_steps: int) -> int:
    """The loss average's window: ~1/20 of the run (1 to 100 steps). The console's "avg" and the
    plot's blue line are the same numbers: the trailing mean of this many step losses."""
    return max(1, min(100, total_steps // 20))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first ones average what exists). Each mean is
    summed afresh, so the mean at a step is the same number however long the list is."""
    out = []
    for i in range(len(values)):
        last = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(last) / len(last))
    return out


def nice_ticks(lo: float, hi: float, count: int = 6, whole: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    if whole:
        raw = max(raw, 1.0)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    ticks = []
    k = first
    while k * step <= hi + 1e-9 * step:
        ticks.append(k * step)
        k += 1
    return ticks


_GREY, _BLUE, _ORANGE, _GRID, _RED = (170, 170, 170), (30, 80, 220), (230, 120, 20), (232, 232, 232), (220, 40, 40)


def plot_title(window: int, lr_text: str = "") -> str:
    """loss.png's title. A window of 1 step (a run under 40 steps) averages nothing: no blue line, and
    the title says so rather than name an "average over 1 step"."""
    if window > 1:
        return f"training loss per step (grey) and its average over the last {window} steps (blue){lr_text}"
    return f"training loss per step (grey; no average: the run is under 40 steps){lr_text}"


def loss_plot(
    losses: list[float], *, window: int, lrs: list[float] | None = None, validation=(), size=(900, 440)
) -> Image.Image:
    """Loss per step (grey) and its average (blue) against the step, with tick labels on both axes;
    the learning rate in the title when constant, as an orange line on a right-hand axis when not;
    `validation` (step, loss) pairs as red dots."""
    W, H = size
    left, right, top, bottom = 78, 84, 44, 48
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    varying = bool(lrs) and max(lrs) > min(lrs)
    lr_text = "" if not lrs else ", lr (orange, right axis)" if varying else f", lr {lrs[0]:g} (constant)"
    title = plot_title(window, lr_text)
    draw.text((left, 10), title, fill="black", font=font)
    if not losses:
        return img
    n = len(losses)
    smooth = moving_average(losses, window)
    measured = losses + [v for _, v in validation]
    lo, hi = min(measured), max(measured)
    hi = hi if hi > lo else lo + max(abs(lo) * 1e-3, 1e-6)
    lo, hi = lo - 0.04 * (hi - lo), hi + 0.04 * (hi - lo)  # the lines clear the frame
    x0, x1, y0, y1 = left, W - right, top, H - bottom

    def x_of(step: float) -> float:
        return x0 + (x1 - x0) * ((step - 1) / max(n - 1, 1))

    def y_of(v: float, a: float = lo, b: float = hi) -> float:
        return y1 - (y1 - y0) * (v - a) / (b - a)

    for t in nice_ticks(lo, hi, 5):
        draw.line([(x0, y_of(t)), (x1, y_of(t))], fill=_GRID)
        draw.text((x0 - 6, y_of(t)), f"{t:.4g}", fill="black", font=font, anchor="rm")
    for t in nice_ticks(1, max(n, 2), 8, whole=True):
        if t <= n:
            draw.line([(x_of(t), y0), (x_of(t), y1)], fill=_GRID)
            draw.text((x_of(t), y1 + 6), f"{int(t)}", fill="black", font=font, anchor="mt")
    draw.text(((x0 + x1) / 2, H - 14), "step", fill="black", font=font, anchor="mm")
    draw.text((x0 - 6, y0 - 16), "loss", fill="black", font=font, anchor="rm")
    draw.rectangle([x0, y0, x1, y1], outline="black")
    steps = range(1, n + 1)
    lines = ((losses, _GREY, 1), (smooth, _BLUE, 2)) if window > 1 else ((losses, _GREY, 1),)  # 1: the loss itself
    for values, colour, width in lines:
        points = [(x_of(s), y_of(v)) for s, v in zip(steps, values, strict=False)]
        draw.line(points if n > 1 else points * 2, fill=colour, width=width)
    if varying:
        top_lr = max(lrs)
        for t in nice_ticks(0.0, top_lr, 4):
            draw.text((x1 + 6, y_of(t, 0.0, top_lr)), f"{t:.2g}", fill=_ORANGE, font=font, anchor="lm")
        draw.text((x1 + 6, y0 - 16), "lr", fill=_ORANGE, font=font, anchor="lm")
        draw.line([(x_of(s), y_of(v, 0.0, top_lr)) for s, v in zip(steps, lrs, strict=False)], fill=_ORANGE, width=1)
    for step, v in validation:
        x, y = x_of(step), y_of(v)
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=_RED)
    if validation:
        draw.text((x1 - 150, y0 - 16), "validation loss (red)", fill=_RED, font=font)
    return img


def write_loss_plot(
    path: Path, losses: list[float], *, window: int, lrs: list[float] | None = None, validation=()
) -> None:
    write_atomic(
        path, lambda tmp: loss_plot(losses, window=window, lrs=lrs, validation=list(validation)).save(tmp, format="PNG")
    )
