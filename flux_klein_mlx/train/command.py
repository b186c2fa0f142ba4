"""`python -m flux_klein_mlx train`: a LoRA from a folder of captioned images, with a progress bar.

A thin wrapper over `train.train_lora`: the options are `TrainSettings`' fields, checked there, so
the command and the Python API refuse the same things with the same words.
"""

from __future__ import annotations

import signal
import sys
import time
import warnings
from pathlib import Path

import click
from click.core import ParameterSource

from ..cli import dtype_option, model_option, quantize_option
from ..dtypes import DTYPES
from ..errors import FluxKleinError
from .config_file import check_recorded_data, option_names, read_config
from .memory import MemoryPlanned, describe_plan
from .report.evaluation import ValidationFinished
from .settings import DEFAULT_BASE_MODEL, TIMESTEPS, TrainSettings, default_work_dir
from .step.distributed import PeerLost, world
from .step.objective import SCHEDULES
from .step.optimizers import OPTIMIZERS
from .trainer import (
    CheckpointSaved,
    SamplesSaved,
    StageFinished,
    StageStarted,
    StepFinished,
    TrainFinished,
    TrainStarted,
    train_lora,
)
from .workdir import checkpoints

_D = TrainSettings()  # the defaults, shown in --help


def setting(flag: str, **kwargs):
    """An option whose default is `TrainSettings`' own (`--lokr-factor`: `lokr_factor`), shown in --help."""
    default = getattr(_D, flag.removeprefix("--").replace("-", "_"))
    return click.option(flag, default=default, show_default=True, **kwargs)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressLine:
    """step, loss (and the average loss.png draws), s/step and ETA: redrawn in place on a terminal,
    one line per step otherwise (logs)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.avg = None  # moving average of seconds per step
        self.open = False

    def step(self, ev: StepFinished) -> None:
        k = 0.1
        self.avg = ev.seconds if self.avg is None else (1 - k) * self.avg + k * ev.seconds
        eta = _clock(self.avg * (ev.total - ev.step))
        line = (
            f"step {ev.step}/{ev.total}  loss {ev.loss:.4f} (avg {ev.average:.4f})  lr {ev.lr:.3g}  "
            f"{ev.seconds:.2f} s/step  ETA {eta}  peak {ev.peak_memory / 1e9:.2f} GB"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            self.open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a line drawn in place, so that what follows starts on its own line."""
        if self.open:
            self.stream.write("\n")
            self.open = False

    def say(self, text: str) -> None:
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()


def describe_event(ev) -> str | None:
    """The line an event prints (steps are drawn by `ProgressLine`)."""
    if isinstance(ev, StageStarted):
        return ev.detail
    if isinstance(ev, MemoryPlanned):
        return describe_plan(ev) + ("" if ev.fits else "; it may not fit (--force)")
    if isinstance(ev, StageFinished):
        return f"{ev.stage}: {ev.detail} ({ev.seconds:.1f} s)"
    if isinstance(ev, TrainStarted):
        where = f"resuming from {ev.resumed_from} at step {ev.first_step}" if ev.resumed_from else "starting"
        if ev.first_step > ev.total_steps:  # a finished run whose output was not written: written now
            where = f"writing the output from {ev.resumed_from} (all {ev.total_steps} steps done, no training)"
        buckets = ", ".join(f"{k} x{v}" for k, v in ev.buckets.items())
        processes = (
            f"; {ev.processes} processes train (mlx.launch), each {ev.batch_size} of every batch of "
            f"{ev.processes * ev.batch_size}"
            if ev.processes > 1
            else ""
        )
        return (
            f"{where}: {ev.images} image(s) ({buckets}), {ev.adapters} adapters on {ev.layers} layers, "
            f"{ev.parameters / 1e6:.2f} M trainable parameters, {ev.total_steps} steps; work folder {ev.work_dir}"
            f"{processes}\na caption as it trains ({ev.images} image(s)): {ev.caption!r}"
        )
    if isinstance(ev, CheckpointSaved):
        return f"checkpoint: {ev.path}"
    if isinstance(ev, SamplesSaved):
        return describe_samples(ev)
    if isinstance(ev, ValidationFinished):
        levels = ", ".join(f"{k} {v:.4f}" for k, v in ev.by_sigma.items())
        return f"validation at step {ev.step}: loss {ev.loss:.4f} (by noise level: {levels})"
    if isinstance(ev, TrainFinished):
        return f"wrote {ev.output} ({ev.steps} steps, {_clock(ev.seconds)}); loss plot and train.json in {ev.work_dir}"
    return None


def describe_samples(ev: SamplesSaved) -> str:
    """Where the samples are, how much the LoRA changes each baseline, what sampling adds to the peak."""
    if ev.step == 0 and ev.kept:
        return "baseline samples (no LoRA) kept from the run's start, not redrawn: " + ", ".join(
            str(p) for p in ev.paths
        )
    if ev.step == 0:
        head = f"baseline samples (no LoRA) on {ev.model}: " + ", ".join(str(p) for p in ev.paths)
    else:
        parts = [f"{p.name} {c:.1f}" for p, c in zip(ev.paths, ev.changes, strict=True)]
        where = f"samples at step {ev.step} on {ev.model} in {ev.paths[0].parent}"
        head = f"{where}, change from the baseline (mean |pixel difference|, of 255): " + ", ".join(parts)
    added = "" if ev.added_memory is None else f", {ev.added_memory / 1e9:.2f} GB over training's peak"
    return f"{head}; sampling peak {ev.peak_memory / 1e9:.2f} GB{added}"


@click.command("train")
@click.option(
    "--config",
    default=None,
    help="Settings from a .toml file (keys: the long option names with underscores) or a run's train.json; "
    "options given here override it.",
)
@click.option(
    "--data", "-d", default="", help="Folder of images (.png .jpg .jpeg .webp), each with a <name>.txt caption."
)
@click.option(
    "--output", "-o", default="", help="The LoRA file to write (.safetensors, in --format's layout); never overwritten."
)
@setting(
    "--format",
    help="The LoRA file's layout: diffusers, comfyui (ComfyUI, ai-toolkit; diffusers loads it too) or kohya.",
)
@model_option("A klein Base repo id or folder.", default=DEFAULT_BASE_MODEL, show_default=True)
@click.option("--caption", default=None, help="Caption of images without a .txt (e.g. a trigger word).")
@setting("--caption-extension", help="Suffix of the caption files (.caption for kohya-style datasets).")
@click.option(
    "--control",
    "controls",
    multiple=True,
    help="Edit LoRAs: folder of reference images, same names as --data; repeat for more references.",
)
@setting("--adapter", help="lora, or lokr: LyCORIS' Kronecker adapters on whole layers (the fused qkv included).")
@setting("--lokr-factor", type=int, help="LoKr: split each width as FACTOR x rest (-1: the most nearly square split).")
@setting("--rank", type=int)
@click.option(
    "--init-lora",
    default=None,
    help="Start from this LoRA file (any layout --lora reads; its rank must be --rank) instead of from zero.",
)
@click.option("--alpha", type=float, default=None, help="LoRA alpha; scale = alpha / rank [default: rank].")
@setting("--targets", help="all, attention, double (style), single:0-12 (structure), or module names; comma-separated.")
@setting("--steps", type=int, help="Optimizer steps.")
@click.option(
    "--epochs", type=int, default=None, help="Train this many epochs (each image its repeats times): sets --steps."
)
@click.option("--save-every-epochs", type=int, default=None, help="Also checkpoint at the end of every N epochs.")
@click.option("--sample-every-epochs", type=int, default=None, help="Also sample at the end of every N epochs.")
@setting(
    "--repeats", type=int, help="Draw each image N times an epoch (times the N of a kohya N_name sub-folder of --data)."
)
@click.option("--flip", is_flag=True, help="Mirror each drawn example left to right with probability 1/2.")
@setting("--lr", type=float, help="Learning rate (the schedule's peak).")
@setting("--lr-scheduler", help=f"{'|'.join(SCHEDULES)}: diffusers' get_scheduler schedules.")
@setting(
    "--warmup-steps", type=int, help="Steps of linear warmup from 0 (the *_with_warmup, linear and cosine schedules)."
)
@setting("--batch-size", type=int)
@setting("--grad-accum", type=int, help="Micro-batches per step.")
@click.option(
    "--resolution",
    default=str(_D.resolution),
    show_default=True,
    help="Train at about this many px squared, aspect ratio kept, sides multiples of 16; several "
    "(512,768,1024): every image at each.",
)
@setting(
    "--timesteps",
    type=click.Choice(TIMESTEPS),
    help="Noise-level sampling: musubi's flux2_shift, diffusers' logit-normal, or uniform.",
)
@setting("--seed", type=int)
@setting("--weight-decay", type=float)
@setting(
    "--optimizer",
    help=f"{'|'.join(OPTIMIZERS)}: each as its torch reference (prodigy: --lr 1 is usual; adafactor: torch's "
    "step size).",
)
@setting("--max-grad-norm", type=float)
@dtype_option(default=_D.dtype)
@click.option(
    "--save-dtype",
    default=None,
    help=f"{'|'.join(DTYPES)}: the output file's dtype, and that of the LoRA each sample point keeps and is "
    "drawn with [default: --dtype].",
)
@quantize_option("Quantize the frozen model to 4 or 8 bits (QLoRA).")
@click.option(
    "--low-memory", is_flag=True, help="Gradient checkpointing per block: much less memory, 1.2-1.5x the time per step."
)
@setting("--save-every", type=int, help="Checkpoint every N steps.")
@setting("--keep-checkpoints", type=int)
@click.option(
    "--work-dir", default=None, help="Checkpoints, samples, loss.png, train.json [default: <output stem>.train/]."
)
@click.option(
    "--resume",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[DIR]",
    help="Continue from the latest checkpoint in the work folder (DIR, or --work-dir); the options not given "
    "are the run's own, from its train.json.",
)
@click.option("--sample-every", type=int, default=None, help="Write sample images every N steps.")
@click.option("--sample-prompt", "sample_prompts", multiple=True, help="Prompt of the sample images; repeatable.")
@click.option("--sample-steps", type=int, default=None, help="Denoising steps of the samples [default: the model's].")
@setting("--sample-seed", type=int)
@click.option(
    "--sample-model",
    default=None,
    help="Model the samples are drawn on [default: the distilled sibling of a Base repo id, e.g. "
    "FLUX.2-klein-4B for FLUX.2-klein-base-4B; else --model].",
)
@click.option(
    "--sample-size", type=int, default=None, help="Sample width = height in px, multiple of 16 [default: --resolution]."
)
@click.option(
    "--sample-strengths", default="1", show_default=True, help="LoRA strengths of each sample, e.g. 0.5,1,1.5."
)
@quantize_option(
    "Quantize the sample model to 4 or 8 bits (to fit beside training) [default: none, as generate].",
    "--sample-quantize",
)
@click.option(
    "--sample-image",
    "sample_images",
    multiple=True,
    help="Edit LoRAs: the samples' reference image, one per --control (or per --control and prompt); repeatable "
    "[default: the first held-out image's references].",
)
@click.option("--trigger", default=None, help="Replaces [trigger] in each caption, else is prepended: 'sks, a fox'.")
@setting("--caption-dropout", type=float, help="Probability of training an example with the empty caption.")
@click.option("--force", is_flag=True, help="Train even when the memory plan says a step will not fit.")
@click.option(
    "--ema",
    type=float,
    default=None,
    help="Write an exponential moving average of the adapters (decay in (0, 1), e.g. 0.999) as the output.",
)
@click.option("--validation", default=None, help="Folder of held-out images + captions: their loss at each checkpoint.")
@click.option(
    "--validation-control",
    "validation_controls",
    multiple=True,
    help="With --control: the held-out images' reference folder, one per --control, same names.",
)
def train(**options):
    """Train a LoRA on FLUX.2 [klein] Base from a folder of captioned images.

    Under mlx.launch (several Macs) every process runs this command; rank 0 alone prints and writes."""
    ctx = click.get_current_context()
    options, from_config = with_config(ctx, options)
    options = with_resume(ctx, options, from_config)
    if options["epochs"] is not None and ctx.get_parameter_source("steps") == ParameterSource.COMMANDLINE:
        raise FluxKleinError("give --epochs or --steps, not both: --epochs sets the steps its epochs take")
    w = world()
    if w.size > 1:  # mlx.launch ends the others with SIGTERM when one process fails: say so, in one line
        signal.signal(signal.SIGTERM, lambda *_: _stopped(w.size))
    if not w.is_main:
        _follow(options)
        return
    events = train_lora(**options)  # everything is checked here, before any model loads
    progress = ProgressLine()
    t0 = time.perf_counter()
    step = 0
    ctrl_c = []  # each SIGINT while the run goes on (see on_ctrl_c)

    def on_ctrl_c(*_):
        """Python's own Ctrl-C (KeyboardInterrupt at once), remembered: one raised where Python drops it (in
        a finalizer: "Exception ignored in ...") still ends the run, at its next event."""
        ctrl_c.append(time.monotonic())
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # a run started with Ctrl-C ignored (a script's background job) keeps it so
        signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        for ev in events:
            if ctrl_c:
                raise KeyboardInterrupt
            if isinstance(ev, StepFinished):
                step = ev.step
                progress.step(ev)
                continue
            if isinstance(ev, TrainStarted) and ev.resumed_from is not None:
                step = ev.first_step - 1
            text = describe_event(ev)
            if isinstance(ev, TrainFinished):
                progress.close()
                click.echo(text)  # the result, on stdout
            elif text:
                progress.say(text)
    except KeyboardInterrupt:
        events.close()  # the run's own cleanup (its lock) before the line
        progress.say(interrupted(step, run_work_dir(options)))
        click.get_current_context().exit(130)  # the exit status of an interrupted program
    finally:
        signal.signal(signal.SIGINT, previous)
    click.echo(f"done in {_clock(time.perf_counter() - t0)}", err=True)


def run_work_dir(options: dict) -> Path:
    """The run's work folder, as TrainSettings resolves it (--work-dir, or <output stem>.train/)."""
    if options.get("work_dir"):
        return Path(options["work_dir"]).expanduser()
    return default_work_dir(Path(options["output"]).expanduser())


def interrupted(step: int, work_dir: Path | None) -> str:
    """The line after Ctrl-C: where the run stopped and how to go on, from the newest checkpoint on the disk
    (each is written whole or not at all: one finished as Ctrl-C came counts, its event seen or not)."""
    done = checkpoints(Path(work_dir)) if work_dir is not None else []
    if not done:
        return f"stopped at step {step}; no checkpoint yet: run the same command again to start over"
    at, folder = done[-1]
    return f"stopped at step {max(step, at)}; last checkpoint {folder}: continue with the same command and --resume"


def with_config(ctx: click.Context, options: dict) -> tuple[dict, set[str]]:
    """The options with those of --config filled in where the command line gave none; and their names."""
    path = options.pop("config")
    if not path:
        return options, set()
    config = read_config(path, option_names(ctx.command))
    filled = set()
    for name, value in config.settings.items():
        if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            options[name] = value
            filled.add(name)
    if config.recorded_data is not None and ctx.get_parameter_source("data") != ParameterSource.COMMANDLINE:
        check_recorded_data(config, options["data"])  # the same images as the recorded run, byte for byte
    return options, filled


def with_resume(ctx: click.Context, options: dict, given: set[str]) -> dict:
    """`--resume [DIR]`: the work folder is DIR (or --work-dir, or the --output's default) and every option
    neither on the command line nor in --config (`given`) is the run's own, from its train.json. What is
    given must agree where it decides a step (the checkpoint's run key, state.resume_point, names what
    differs); --steps may grow, and --output, saving and sampling may change."""
    value = options["resume"]
    options["resume"] = value is not None
    if value is None:
        return options
    work = resume_folder(value, options["work_dir"], options["output"])
    options["work_dir"] = str(work)
    record = work / "train.json"
    if not record.is_file():
        if not options["data"] or not options["output"]:
            raise FluxKleinError(
                f"--resume: {work} holds no train.json of a run; give the run's work folder (--resume DIR)"
            )
        return options  # the run's options are all given: the checkpoint's check says whether they agree
    recorded = read_config(record, option_names(ctx.command))
    for name, v in recorded.settings.items():
        if name not in given and ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            options[name] = v
    return options


def resume_folder(value: str, work_dir: str | None, output: str) -> Path:
    """The work folder of `--resume [DIR]`: DIR, --work-dir (the same one when both), or the --output's default."""
    if value and work_dir and Path(value).expanduser().resolve() != Path(work_dir).expanduser().resolve():
        raise FluxKleinError(f"--resume {value} and --work-dir {work_dir} name two folders; give one of them")
    if value or work_dir:
        return Path(value or work_dir).expanduser()
    if output:
        return default_work_dir(Path(output).expanduser())
    raise FluxKleinError("--resume needs the run's work folder: --resume DIR, or --work-dir DIR")


def _stopped(size: int):
    raise PeerLost(f"another process of this {size}-process run ended, and mlx.launch stopped this one")


def _follow(options: dict) -> None:
    """A process other than rank 0: train silently and end with status 1 on an error, which rank 0 (or,
    when rank 0 itself stopped, mlx.launch) reports: the run ends with one line, not one per process."""
    warnings.simplefilter("ignore")
    try:
        for _ in train_lora(**options):
            pass
    except FluxKleinError:
        raise click.exceptions.Exit(1) from None
