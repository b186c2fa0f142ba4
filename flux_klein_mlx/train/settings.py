"""Every setting of a LoRA training run, with its default, checked once before anything runs.

`TrainSettings` is what `train_lora(...)` takes as keyword arguments and what the `train` command
fills from its options; `check()` refuses bad values with one line each and fills the derived
defaults (alpha = rank, the work folder next to the output). `run_key()` is the subset that decides
the numbers a run computes: a checkpoint may only be resumed under the same run key.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from ..errors import FluxKleinError
from ..loading import DTYPES
from ..models.quantize import check_quantization

TIMESTEPS = ("shift", "logit-normal", "uniform")
DEFAULT_MODEL = "black-forest-labs/FLUX.2-klein-base-4B"


@dataclass
class TrainSettings:
    """A LoRA training run (see README "Training a LoRA"); `check()` before use."""

    data: str | Path = ""  # folder of images + .txt captions
    output: str | Path = ""  # the LoRA file to write (.safetensors); never overwritten
    model: str | Path = DEFAULT_MODEL
    caption: str | None = None  # caption of images without a .txt
    controls: tuple = ()  # control folders (edit LoRAs), in reference order
    rank: int = 16
    alpha: float | None = None  # default: rank (scale 1)
    targets: str | tuple = "all"
    steps: int = 500  # optimizer steps
    lr: float = 1e-4
    batch_size: int = 1
    grad_accum: int = 1
    resolution: int = 512
    timesteps: str = "shift"
    seed: int = 0
    weight_decay: float = 1e-4  # diffusers' trainer; torch/MLX default 0.01 (G9)
    max_grad_norm: float = 1.0
    dtype: str = "bfloat16"
    quantize: int | None = None  # 4 or 8: the frozen base is quantized (QLoRA)
    group_size: int = 64
    low_memory: bool = False  # gradient checkpointing per block
    save_every: int | None = 250
    keep_checkpoints: int = 2
    work_dir: str | Path | None = None  # default: <output stem>.train/ next to the output
    resume: bool = False
    sample_every: int | None = None
    sample_prompts: tuple = ()
    sample_steps: int | None = None  # default: the model's (50 for Base)
    sample_seed: int = 0
    ema: float | None = None  # decay of the adapters' moving average, written as the output (train/evaluation.py)
    validation: str | Path | None = None  # folder of held-out images + captions, measured at each checkpoint

    def check(self) -> "TrainSettings":
        """Types and ranges of every setting (FluxKleinError, one line); fills derived defaults."""
        _whole(self, "rank", 1, 1024)
        _whole(self, "steps", 1, 10_000_000)
        _whole(self, "batch_size", 1, 1024)
        _whole(self, "grad_accum", 1, 1024)
        _whole(self, "resolution", 64, 4096)
        _whole(self, "group_size", 1, 1024)
        _whole(self, "keep_checkpoints", 1, 1_000_000)
        _whole(self, "sample_seed", -(2**63), 2**64)
        _whole(self, "seed", 0, 2**63 - 1)
        for name in ("save_every", "sample_every", "sample_steps"):
            if getattr(self, name) is not None:
                _whole(self, name, 1, 10_000_000)
        _number(self, "lr", 0.0, 1.0, open_low=True)
        _number(self, "weight_decay", 0.0, 1.0)
        _number(self, "max_grad_norm", 0.0, 1e6, open_low=True)
        if self.alpha is None:
            self.alpha = float(self.rank)
        _number(self, "alpha", 0.0, 1e6, open_low=True)
        if self.timesteps not in TIMESTEPS:
            raise FluxKleinError(f"timesteps must be one of {', '.join(TIMESTEPS)}, not {self.timesteps!r}")
        if self.dtype not in DTYPES:
            raise FluxKleinError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quantize is not None:
            if isinstance(self.quantize, bool) or not isinstance(self.quantize, numbers.Integral):
                raise FluxKleinError(f"quantize must be 4, 8 or None, not {self.quantize!r}")
            check_quantization(int(self.quantize), int(self.group_size))
        self._check_paths_and_text()
        self._check_ema_and_validation()
        return self

    def _check_ema_and_validation(self) -> None:
        v = self.ema
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < 1:
                raise FluxKleinError(f"ema must be a decay in (0, 1) such as 0.999, not {v!r}")
            self.ema = float(v)
        if self.validation is not None and self.controls:
            raise FluxKleinError("--validation does not measure edit LoRAs (--control) yet; leave one of the two out")

    def _check_paths_and_text(self) -> None:
        if not str(self.data):
            raise FluxKleinError("no --data folder given; point it at a folder of images with .txt captions")
        out = Path(self.output).expanduser() if str(self.output) else None
        if out is None or out.suffix.lower() != ".safetensors":
            raise FluxKleinError(f"--output must be a .safetensors file name, not {str(self.output)!r}")
        self.output = out
        self.work_dir = Path(self.work_dir).expanduser() if self.work_dir else out.with_name(out.stem + ".train")
        self.controls = tuple(str(c) for c in ([self.controls] if isinstance(self.controls, (str, Path)) else self.controls))
        prompts = [self.sample_prompts] if isinstance(self.sample_prompts, str) else list(self.sample_prompts)
        if any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise FluxKleinError("each --sample-prompt must be a non-empty text")
        self.sample_prompts = tuple(prompts)
        if self.sample_every is not None and not prompts:
            raise FluxKleinError("--sample-every needs at least one --sample-prompt")
        if self.caption is not None and (not isinstance(self.caption, str) or not self.caption.strip()):
            raise FluxKleinError("--caption must be a non-empty text (e.g. a trigger word)")

    def run_key(self) -> dict:
        """The settings that decide what a step computes (resume needs them equal)."""
        keep = ("model", "rank", "alpha", "targets", "lr", "batch_size", "grad_accum", "resolution", "timesteps",
                "seed", "weight_decay", "max_grad_norm", "dtype", "quantize", "group_size", "caption")  # fmt: skip
        key = {k: getattr(self, k) for k in keep}
        key["model"] = str(self.model)
        key["targets"] = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        key["ema"] = self.ema  # a checkpoint's EMA continues only under the same decay
        return key

    def record(self) -> dict:
        """Every setting, JSON-able (train.json)."""
        d = dataclasses.asdict(self)
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _whole(s: TrainSettings, name: str, low: int, high: int) -> None:
    v = getattr(s, name)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not low <= v <= high:
        raise FluxKleinError(f"{name.replace('_', '-')} must be a whole number in [{low}, {high}], not {v!r}")


def _number(s: TrainSettings, name: str, low: float, high: float, open_low: bool = False) -> None:
    v = getattr(s, name)
    ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
    ok = ok and (low < v if open_low else low <= v) and v <= high
    if not ok:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise FluxKleinError(f"{name.replace('_', '-')} must be a number in {bound}, not {v!r}")
    setattr(s, name, float(v))


def differences(old: dict, new: dict) -> list[str]:
    """"name: old -> new" for every run-key setting that differs (the data list included)."""
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
