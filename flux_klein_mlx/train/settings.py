"""Every setting of a LoRA training run, with its default, checked once before anything runs.

`TrainSettings` is what `train_lora(...)` takes as keyword arguments and what the `train` command
fills from its options; `check()` refuses bad values with one line each (the checkers of
`inputs.RunSettings`) and returns a copy with the derived defaults filled (alpha = rank, the work
folder next to the output). `run_key()` is the subset that decides the numbers a run computes: a
checkpoint may only be resumed under the same run key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import FluxKleinError
from ..inputs import check_choice, check_number, check_whole, is_int
from ..loading import DTYPES
from ..models.quantize import check_quantization

TIMESTEPS = ("shift", "logit-normal", "uniform")
# The model `train` starts from: a Base model (generation's default, pipeline.DEFAULT_MODEL, is distilled).
DEFAULT_BASE_MODEL = "black-forest-labs/FLUX.2-klein-base-4B"
# (setting, low, high) of the whole-number settings, checked in this order
WHOLE = (
    ("rank", 1, 1024), ("steps", 1, 10_000_000), ("batch_size", 1, 1024), ("grad_accum", 1, 1024),
    ("resolution", 64, 4096), ("group_size", 1, 1024), ("keep_checkpoints", 1, 1_000_000),
    ("sample_seed", -(2**63), 2**64), ("seed", 0, 2**63 - 1),
)  # fmt: skip
# (setting, low, high, low excluded) of the real-number settings, checked after the whole numbers
NUMBERS = (("lr", 0.0, 1.0, True), ("weight_decay", 0.0, 1.0, False), ("max_grad_norm", 0.0, 1e6, True),
           ("alpha", 0.0, 1e6, True))  # fmt: skip


@dataclass
class TrainSettings:
    """A LoRA training run (see README "Training a LoRA"); `check()` before use."""

    data: str | Path = ""  # folder of images + .txt captions
    output: str | Path = ""  # the LoRA file to write (.safetensors); never overwritten
    model: str | Path = DEFAULT_BASE_MODEL
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

    def check(self) -> "TrainSettings":
        """Types and ranges of every setting (FluxKleinError, one line), checked with the same checkers as
        `RunSettings` and without changing this object; returns a copy with the derived defaults filled
        (alpha = rank, the work folder next to the output) and every value in its canonical type."""
        for name, low, high in WHOLE:
            check_whole(_label(name), getattr(self, name), low, high)
        for name in ("save_every", "sample_every", "sample_steps"):
            if getattr(self, name) is not None:
                check_whole(_label(name), getattr(self, name), 1, 10_000_000)
        for name, low, high, open_low in NUMBERS:
            if name != "alpha" or self.alpha is not None:  # no alpha: rank's, which is valid
                check_number(_label(name), getattr(self, name), low, high, open_low)
        check_choice("timesteps", self.timesteps, TIMESTEPS)
        check_choice("dtype", self.dtype, DTYPES)
        if self.quantize is not None:
            if not is_int(self.quantize):
                raise FluxKleinError(f"quantize must be 4, 8 or None, not {self.quantize!r}")
            check_quantization(int(self.quantize), int(self.group_size))
        prompts = _prompts(self.sample_prompts)  # listed once: a one-shot iterable stays usable
        self._check_paths_and_text(prompts)
        return self._resolved(prompts)

    def _check_paths_and_text(self, prompts: list) -> None:
        if not str(self.data):
            raise FluxKleinError("no --data folder given; point it at a folder of images with .txt captions")
        if not str(self.output) or Path(self.output).suffix.lower() != ".safetensors":
            raise FluxKleinError(f"--output must be a .safetensors file name, not {str(self.output)!r}")
        if any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise FluxKleinError("each --sample-prompt must be a non-empty text")
        if self.sample_every is not None and not prompts:
            raise FluxKleinError("--sample-every needs at least one --sample-prompt")
        if self.caption is not None and (not isinstance(self.caption, str) or not self.caption.strip()):
            raise FluxKleinError("--caption must be a non-empty text (e.g. a trigger word)")

    def _resolved(self, prompts: list) -> "TrainSettings":
        """A copy of checked settings with the derived defaults and canonical types (floats, paths, tuples)."""
        out = Path(self.output).expanduser()
        controls = [self.controls] if isinstance(self.controls, (str, Path)) else self.controls
        return dataclasses.replace(
            self,
            **{name: float(getattr(self, name)) for name, *_ in NUMBERS if name != "alpha"},
            alpha=float(self.rank if self.alpha is None else self.alpha),
            output=out,
            work_dir=Path(self.work_dir).expanduser() if self.work_dir else out.with_name(out.stem + ".train"),
            controls=tuple(str(c) for c in controls),
            sample_prompts=tuple(prompts),
        )

    def run_key(self) -> dict:
        """The settings that decide what a step computes (resume needs them equal)."""
        keep = ("model", "rank", "alpha", "targets", "lr", "batch_size", "grad_accum", "resolution", "timesteps",
                "seed", "weight_decay", "max_grad_norm", "dtype", "quantize", "group_size", "caption")  # fmt: skip
        key = {k: getattr(self, k) for k in keep}
        key["model"] = str(self.model)
        key["targets"] = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        return key

    def record(self) -> dict:
        """Every setting, JSON-able (train.json)."""
        d = dataclasses.asdict(self)
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _label(name: str) -> str:
    """A setting as its option is spelled in messages: batch_size -> batch-size."""
    return name.replace("_", "-")


def _prompts(prompts) -> list:
    """`sample_prompts` as a list: one text, or a sequence of them."""
    return [prompts] if isinstance(prompts, str) else list(prompts)


def differences(old: dict, new: dict) -> list[str]:
    """"name: old -> new" for every run-key setting that differs (the data list included)."""
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
