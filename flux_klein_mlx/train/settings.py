"""Every setting of a LoRA training run, with its default, checked once before anything runs.

`TrainSettings` is what `train_lora(...)` takes as keyword arguments and what the `train` command
fills from its options; `check()` refuses bad values with one line each (the checkers of
`inputs.RunSettings`) and returns a copy with the derived defaults filled (alpha = rank, the work
folder next to the output) and every value in its canonical type. `run_key()` is the subset that
decides the numbers a run computes: a checkpoint may only be resumed under the same run key.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..checks import check_choice, check_number, check_whole, is_int
from ..dtypes import DEFAULT_DTYPE, DTYPES
from ..errors import FluxKleinError
from ..inputs.settings import check_side
from ..limits import MAX_EPOCHS, MAX_REPEATS, MAX_SEED, MAX_STEPS, MAX_TRAIN_STEPS, MIN_SEED, check_path
from ..lora.layouts import check_layout
from ..models.quantize import check_quantization
from ..models.tokenizer import check_text
from .data.dataset import IMAGE_SUFFIXES
from .step.objective import check_schedule
from .step.optimizers import OPTIMIZERS

TIMESTEPS = ("shift", "logit-normal", "uniform")
ADAPTERS = ("lora", "lokr")  # LoRA pairs per diffusers module, or LoKr per layer
# The model `train` starts from: a Base model (generation's default, pipeline.DEFAULT_MODEL, is distilled).
# The run key's layout (TrainSettings.run_key, plan.run_key): raised when a field is added, renamed or
# changes meaning; a checkpoint written under another version is refused, never guessed at.
RUN_KEY_VERSION = 3  # 2 (issue 39): --optimizer, --repeats, --flip, --init-lora; 3 (issue 46): the model's family
DEFAULT_BASE_MODEL = "black-forest-labs/FLUX.2-klein-base-4B"
# (setting, low, high) of the whole-number settings, checked in this order
WHOLE = (
    ("rank", 1, 1024), ("steps", 1, MAX_TRAIN_STEPS), ("batch_size", 1, 1024), ("grad_accum", 1, 1024),
    ("group_size", 1, 1024), ("keep_checkpoints", 1, 1_000_000), ("sample_seed", MIN_SEED, MAX_SEED),
    ("seed", 0, 2**63 - 1), ("lokr_factor", -1, 65536), ("repeats", 1, MAX_REPEATS),
)  # fmt: skip
# whole-number settings that may be None (not asked for), with their (low, high); the counts' bounds: limits.py
OPTIONAL_WHOLE = {"save_every": (1, MAX_TRAIN_STEPS), "sample_every": (1, MAX_TRAIN_STEPS),
                  "sample_steps": (1, MAX_STEPS), "epochs": (1, MAX_EPOCHS), "save_every_epochs": (1, MAX_EPOCHS),
                  "sample_every_epochs": (1, MAX_EPOCHS)}  # fmt: skip
# (setting, low, high, low excluded) of the real-number settings, checked after the whole numbers
NUMBERS = (("lr", 0.0, 1.0, True), ("weight_decay", 0.0, 1.0, False), ("max_grad_norm", 0.0, 1e6, True),
           ("alpha", 0.0, 1e6, True), ("caption_dropout", 0.0, 1.0, False))  # fmt: skip


@dataclass
class TrainSettings:
    """A LoRA training run (see README "Training a LoRA"); `check()` before use."""

    data: str | Path = ""  # folder of images + .txt captions
    output: str | Path = ""  # the LoRA file to write (.safetensors); never overwritten
    model: str | Path = DEFAULT_BASE_MODEL
    caption: str | None = None  # caption of images without a .txt
    caption_extension: str = ".txt"  # the caption files' suffix (kohya's .caption works too)
    controls: tuple = ()  # control folders (edit LoRAs), in reference order
    adapter: str = "lora"  # or "lokr": LyCORIS' Kronecker adapters on whole layers
    lokr_factor: int = -1  # LoKr: the split of each width (-1: near square, LyCORIS' default)
    rank: int = 16
    alpha: float | None = None  # default: rank (scale 1)
    targets: str | tuple = "all"
    steps: int = 500  # optimizer steps (with --epochs: set from it, plan.py)
    epochs: int | None = None  # train this many epochs: --steps becomes the steps they take (train/plan.py)
    save_every_epochs: int | None = None  # also checkpoint at the step that ends every Nth epoch
    sample_every_epochs: int | None = None  # also sample at the step that ends every Nth epoch
    repeats: int = 1  # each image drawn this many times an epoch (times its N_name folder's N; train/data/dataset.py)
    flip: bool = False  # mirror an example left to right with probability 1/2 each time it is drawn
    init_lora: str | Path | None = None  # start from this LoRA file (any layout --lora reads; train/starting.py)
    lr: float = 1e-4
    batch_size: int = 1
    grad_accum: int = 1
    resolution: int | tuple = 512  # one size, or several ("512,768,1024" / [512, 768]): each image at each
    timesteps: str = "shift"
    seed: int = 0
    weight_decay: float = 1e-4  # diffusers' trainer; torch/MLX default 0.01 (G9)
    optimizer: str = (
        "adamw"  # adamw, adafactor, lion or prodigy, each as its torch reference (train/step/optimizers.py)
    )
    max_grad_norm: float = 1.0
    dtype: str = DEFAULT_DTYPE
    save_dtype: str | None = None  # the output's (and the kept sample LoRAs') dtype; default: dtype
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
    format: str = "diffusers"  # the output file's layout: diffusers, comfyui or kohya (lora/layouts.py)
    sample_model: str | Path | None = None  # default: the distilled sibling of a Base repo id, else `model`
    sample_size: int | None = None  # px, square; default: `resolution` (a multiple of 16)
    sample_strengths: tuple | str = (1.0,)  # LoRA strengths each sample is drawn at ("0.5,1,1.5")
    sample_quantize: int | None = None  # 4 or 8: the sample model quantized (default: as generate, none)
    # edit LoRAs: the samples' reference images, one per --control (the same for every prompt) or one per
    # --control for each prompt in turn; default: the first held-out image's references (samples.py)
    sample_images: tuple = ()
    trigger: str | None = None  # replaces "[trigger]" in each caption, else is prepended as "WORD, "
    caption_dropout: float = 0.0  # probability that an example trains with the empty caption
    lr_scheduler: str = "constant"  # diffusers' get_scheduler names (train/step/objective.py)
    warmup_steps: int = 0
    force: bool = False  # train even when the memory plan says the step will not fit
    ema: float | None = (
        None  # decay of the adapters' moving average, written as the output (train/report/evaluation.py)
    )
    validation: str | Path | None = None  # folder of held-out images + captions, measured at each checkpoint
    validation_controls: tuple = ()  # with --control: the held-out images' control folders, one per --control

    def check(self) -> TrainSettings:
        """Types and ranges of every setting (FluxKleinError, one line), checked with the same checkers as
        `RunSettings` and without changing this object; returns a copy with the derived defaults filled
        (alpha = rank, the work folder next to the output) and every value in its canonical type."""
        self._check_types()
        for name, low, high in WHOLE:
            check_whole(_label(name), getattr(self, name), low, high)
        for name, (low, high) in OPTIONAL_WHOLE.items():
            if getattr(self, name) is not None:
                check_whole(_label(name), getattr(self, name), low, high)
        parse_resolutions(self.resolution)
        for name, low, high, open_low in NUMBERS:
            if name != "alpha" or self.alpha is not None:  # no alpha: rank's, which is valid
                check_number(_label(name), getattr(self, name), low, high=high, open_low=open_low)
        check_schedule(self.lr_scheduler, self.warmup_steps, self.steps)
        check_choice("timesteps", self.timesteps, TIMESTEPS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("dtype", self.dtype, DTYPES)
        if self.save_dtype is not None:
            check_choice("save-dtype", self.save_dtype, DTYPES)
        self._check_adapter()
        if self.quantize is not None:
            if not is_int(self.quantize):
                raise FluxKleinError(f"quantize must be 4, 8 or None, not {self.quantize!r}")
            check_quantization(int(self.quantize), int(self.group_size))
        prompts = _prompts(self.sample_prompts)  # listed once: a one-shot iterable stays usable
        self._check_paths_and_text(prompts)
        self._check_samples_and_captions()
        self._check_sample_images(len(prompts))
        self._check_ema_and_validation()
        # AdamW and Lion move a value by about lr; Adafactor's and Prodigy's steps are scaled otherwise
        if self.optimizer in ("adamw", "lion") and (warning := lr_underflow(self.lr, self.rank)):
            warnings.warn(warning, stacklevel=2)
        return self._resolved(prompts)

    def _check_types(self) -> None:
        """The paths, texts and switches are of a usable type (the Python API takes anything)."""
        for name in ("data", "output", "model", "work_dir", "init_lora", "validation"):
            v = getattr(self, name)
            if not (
                isinstance(v, (str, os.PathLike)) or (name in ("work_dir", "init_lora", "validation") and v is None)
            ):
                raise FluxKleinError(f"{name} must be a path (str or Path), not {v!r}")
            if v is not None:
                check_path(v, _label(name))  # past the OS's limits a path is an OSError wherever it is used
        for name in ("controls", "validation_controls", "sample_images"):
            folders = folder_list(getattr(self, name))
            if not isinstance(folders, (list, tuple)) or not all(isinstance(c, (str, os.PathLike)) for c in folders):
                what = "an image path" if name == "sample_images" else "a folder path"
                raise FluxKleinError(f"{name} must be {what} or a list of them, not {getattr(self, name)!r}")
            for folder in folders:
                check_path(folder, _label(name))
        targets_ok = isinstance(self.targets, str) or (
            isinstance(self.targets, (list, tuple)) and all(isinstance(t, str) for t in self.targets)
        )
        if not targets_ok:
            raise FluxKleinError(
                f"targets must be a text (e.g. 'all', 'double') or a list of module names, not {self.targets!r}"
            )
        for name in ("resume", "low_memory", "force", "flip"):
            if not isinstance(getattr(self, name), bool):
                raise FluxKleinError(f"{name} must be True or False, not {getattr(self, name)!r}")
        for name in ("timesteps", "dtype", "caption_extension", "optimizer"):
            if not isinstance(getattr(self, name), str):
                raise FluxKleinError(f"{name} must be a text, not {getattr(self, name)!r}")
        ext = self.caption_extension
        if not ext.startswith(".") or len(ext) < 2 or "/" in ext or "\\" in ext or ext.lower() in IMAGE_SUFFIXES:
            raise FluxKleinError(f"--caption-extension must be a file suffix such as .txt or .caption, not {ext!r}")

    def _check_adapter(self) -> None:
        """--adapter, --lokr-factor and --format, and the pairs of them that cannot be written."""
        check_choice("adapter", self.adapter, ADAPTERS)
        if self.lokr_factor == 0:
            raise FluxKleinError(
                "lokr-factor must be -1 (the most nearly square split) or a whole number from 1, not 0"
            )
        check_layout(self.format)
        if self.adapter == "lokr" and self.init_lora is not None:
            raise FluxKleinError("--init-lora starts LoRA pairs from a LoRA file; it does not take --adapter lokr")
        if self.adapter == "lokr" and self.format == "kohya":
            raise FluxKleinError(
                "a LoKr is written as --format comfyui or diffusers; kohya's layout holds LoRA pairs only"
            )

    def _check_ema_and_validation(self) -> None:
        v = self.ema
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < 1):
            raise FluxKleinError(f"ema must be a decay in (0, 1) such as 0.999, not {v!r}")
        controls = folder_list(self.controls)
        held_out = folder_list(self.validation_controls)
        if self.validation is None and held_out:
            raise FluxKleinError("--validation-control needs --validation: the held-out images it gives references for")
        if self.validation is not None and len(held_out) != len(controls):
            raise FluxKleinError(
                f"--validation with {len(controls)} --control folder(s) needs as many --validation-control folders "
                f"(the held-out images' references, same names, same order), not {len(held_out)}"
            )

    def _check_paths_and_text(self, prompts: list) -> None:
        if not str(self.data):
            raise FluxKleinError("no --data folder given; point it at a folder of images with .txt captions")
        if not str(self.output) or Path(self.output).suffix.lower() != ".safetensors":
            raise FluxKleinError(f"--output must be a .safetensors file name, not {str(self.output)!r}")
        if any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise FluxKleinError("each --sample-prompt must be a non-empty text")
        if self.sample_every is not None and not prompts:
            raise FluxKleinError("--sample-every needs at least one --sample-prompt")
        if self.sample_every_epochs is not None and not prompts:
            raise FluxKleinError("--sample-every-epochs needs at least one --sample-prompt")
        if self.caption is not None and (not isinstance(self.caption, str) or not self.caption.strip()):
            raise FluxKleinError("--caption must be a non-empty text (e.g. a trigger word)")
        for name, text in [("--caption", self.caption), ("--trigger", self.trigger)] + [
            ("--sample-prompt", p) for p in prompts
        ]:
            if isinstance(text, str):  # bytes that are not UTF-8 (a shell's $'\xff'): refused before a folder is made
                check_text(text, name)

    def _check_samples_and_captions(self) -> None:
        """--sample-size (an image side, as --resolution), --sample-strengths, --sample-quantize,
        --sample-model, --trigger (--caption-dropout is checked with the other numbers)."""
        if self.sample_size is not None:
            check_side("sample-size", self.sample_size)
        parse_strengths(self.sample_strengths)
        if self.sample_quantize is not None and (
            not is_int(self.sample_quantize) or self.sample_quantize not in (4, 8)
        ):
            raise FluxKleinError(f"sample-quantize must be 4, 8 or None, not {self.sample_quantize!r}")
        if self.sample_model is not None and (
            not isinstance(self.sample_model, (str, Path)) or not str(self.sample_model)
        ):
            raise FluxKleinError(f"--sample-model must be a repo id or a folder, not {self.sample_model!r}")
        if self.trigger is not None:
            if not isinstance(self.trigger, str) or not self.trigger.strip() or "\n" in self.trigger:
                raise FluxKleinError(f"--trigger must be a word or phrase on one line (e.g. sks), not {self.trigger!r}")

    def _check_sample_images(self, prompts: int) -> None:
        """--sample-image: with --sample-every and --control, one per --control (for every prompt) or one
        per --control for each prompt in turn."""
        images = folder_list(self.sample_images)
        if not images:
            return
        controls = len(folder_list(self.controls))
        if not controls:
            raise FluxKleinError(
                "--sample-image gives the references of an edit LoRA's samples; it needs --control (the training "
                "references)"
            )
        if not self.sample_every and not self.sample_every_epochs:
            raise FluxKleinError("--sample-image needs --sample-every (and --sample-prompt): the samples it is for")
        if len(images) not in (controls, controls * prompts):
            raise FluxKleinError(
                f"--sample-image: give {controls} image(s) (one per --control, for every prompt) or "
                f"{controls * prompts} (one per --control for each of the {prompts} --sample-prompt), not {len(images)}"
            )

    def _resolved(self, prompts: list) -> TrainSettings:
        """A copy of checked settings with the derived defaults and canonical types (ints, floats, paths,
        tuples: a numpy integer becomes a Python int, for train.json and state.json)."""
        out = Path(self.output).expanduser()
        wholes = {name: int(getattr(self, name)) for name, *_ in WHOLE}
        optional = {name: int(getattr(self, name)) for name in OPTIONAL_WHOLE if getattr(self, name) is not None}
        for name in ("quantize", "sample_quantize", "sample_size"):
            if getattr(self, name) is not None:
                optional[name] = int(getattr(self, name))
        return dataclasses.replace(
            self,
            **wholes,
            **optional,
            **{name: float(getattr(self, name)) for name, *_ in NUMBERS if name != "alpha"},
            alpha=float(self.rank if self.alpha is None else self.alpha),
            resolution=parse_resolutions(self.resolution),
            sample_strengths=parse_strengths(self.sample_strengths),
            trigger=self.trigger.strip() if self.trigger is not None else None,
            save_dtype=self.save_dtype or self.dtype,
            ema=float(self.ema) if self.ema is not None else None,
            output=out,
            work_dir=Path(self.work_dir).expanduser() if self.work_dir else default_work_dir(out),
            controls=tuple(str(c) for c in folder_list(self.controls)),
            validation_controls=tuple(str(c) for c in folder_list(self.validation_controls)),
            sample_images=tuple(str(c) for c in folder_list(self.sample_images)),
            sample_prompts=tuple(prompts),
        )

    def run_key(self) -> dict:
        """The settings that decide what a step computes (resume needs them equal), every field always, under
        `RUN_KEY_VERSION`: a checkpoint of another version is refused (state.resume_point)."""
        keep = (
            "model",
            "rank",
            "alpha",
            "lr",
            "batch_size",
            "grad_accum",
            "timesteps",
            "seed",
            "weight_decay",
            "max_grad_norm",
            "dtype",
            "quantize",
            "group_size",
            "caption",
            "lr_scheduler",
            "warmup_steps",
            "adapter",
            "trigger",
            "caption_dropout",
            "ema",  # a checkpoint's EMA continues only under the same decay
            "optimizer",
            "repeats",  # the epoch's draws (a repeat folder's N is in the data's names)
            "flip",
            "init_lora",  # where the adapters start
        )
        key = {"version": RUN_KEY_VERSION, **{k: getattr(self, k) for k in keep}}
        key["model"] = str(self.model)
        key["init_lora"] = str(self.init_lora) if self.init_lora is not None else None
        key["targets"] = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        key["resolution"] = self.resolution if isinstance(self.resolution, int) else list(self.resolution)
        # A decay's every value depends on the run's length; a constant rate (after warm-up) does not, so
        # such a run may resume with more --steps.
        key["schedule_steps"] = self.steps if self.lr_scheduler in ("linear", "cosine") else None
        key["lokr_factor"] = self.lokr_factor if self.adapter == "lokr" else None
        return key

    @property
    def resolutions(self) -> tuple[int, ...]:
        """The training sizes, as a tuple (one or several)."""
        return (self.resolution,) if isinstance(self.resolution, int) else tuple(self.resolution)

    def record(self) -> dict:
        """Every setting, JSON-able (train.json)."""
        d = dataclasses.asdict(self)
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def default_work_dir(output: Path) -> Path:
    """A run's work folder when --work-dir is not given: <output stem>.train/ next to the output."""
    return output.with_name(output.stem + ".train")


def folder_list(value) -> list | tuple:
    """A folder path, or a list of them, as a list (a list as it is)."""
    return [value] if isinstance(value, (str, os.PathLike)) else value


def _label(name: str) -> str:
    """A setting as its option is spelled in messages: batch_size -> batch-size."""
    return name.replace("_", "-")


def parse_resolutions(value) -> int | tuple[int, ...]:
    """One size (an int) or several (a tuple), from an int, "512,768,1024" or a list; each a multiple
    of 16 in [64, 4096], none repeated."""
    parts = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    sizes = []
    for v in parts:
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v.strip())
        check_side("resolution", v)
        sizes.append(int(v))
    if not sizes or len(set(sizes)) != len(sizes):
        raise FluxKleinError(f"resolution must list each size once (e.g. 512,768,1024), not {value!r}")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)


def _prompts(prompts) -> list:
    """`sample_prompts` as a list: one text, or a sequence of them (a TOML's number is neither)."""
    if isinstance(prompts, str):
        return [prompts]
    try:
        return list(prompts)
    except TypeError:
        raise FluxKleinError(f"sample-prompt must be a text or a list of texts, not {prompts!r}") from None


def parse_strengths(value) -> tuple[float, ...]:
    """--sample-strengths: "0.5,1,1.5" or numbers -> a tuple of distinct LoRA strengths in (0, 8]."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        items = [value]
    out = []
    for v in items:
        try:
            x = float(v) if not isinstance(v, bool) else math.nan
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x) or not 0.0 < x <= 8.0 or x in out:
            raise FluxKleinError(
                "sample-strengths must be distinct numbers in (0, 8] separated by commas (e.g. 0.5,1,1.5), "
                f"not {value!r}"
            )
        out.append(x)
    if not out:
        raise FluxKleinError("sample-strengths is empty; give at least one strength (e.g. 1)")
    return tuple(out)


def differences(old: dict, new: dict) -> list[str]:
    """ "name: old -> new" for every run-key setting that differs (the data list included)."""
    return [
        f"{k}: {old.get(k)!r} there, {new.get(k)!r} now"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def lr_underflow(lr: float, rank: int) -> str | None:
    """A warning when `lr` is too small to change the adapters at all: they are float32 master weights
    (A starts at N(0, 1/rank^2), mean |A| = 0.8 / rank), an AdamW step moves a value by about lr, and
    a change under half a float32 ulp of |A| (|A| * 2^-24) rounds away."""
    typical = math.sqrt(2 / math.pi) / rank
    bound = typical * 2.0**-24
    if lr >= bound:
        return None
    # the bound rounded up to 2 significant digits: never shown below an --lr it refuses (2e-08 for 2.4e-08)
    digits = 10 ** (math.floor(math.log10(bound)) - 1)
    shown = math.ceil(bound / digits) * digits
    return (
        f"--lr {lr:g} is too small to change the float32 adapters: an update of {lr:g} on values of about "
        f"{typical:.2g} rounds away (it needs at least {shown:.2g}), so the adapters would barely "
        "move from where they start; raise --lr (1e-4 is usual)"
    )
