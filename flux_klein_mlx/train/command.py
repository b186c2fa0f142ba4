"""`python -m flux_klein_mlx train`: a LoRA from a folder of captioned images, with a progress bar.

A thin wrapper over `train.train_lora`: the options are `TrainSettings`' fields, checked there, so
the command and the Python API refuse the same things with the same words.
"""

from __future__ import annotations

import signal
import sys
import time
import warnings

import click

from ..cli import run_command
from ..errors import FluxKleinError
from .distributed import PeerLost, world
from .evaluation import ValidationFinished
from .trainer import CheckpointSaved, SamplesSaved, StageFinished, StepFinished, TrainFinished, TrainStarted, train_lora
from .settings import DEFAULT_MODEL, TIMESTEPS, TrainSettings

_D = TrainSettings()  # the defaults, shown in --help


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressLine:
    """step, loss, s/step and ETA: redrawn in place on a terminal, one line per step otherwise (logs)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.avg = None  # moving average of seconds per step
        self.smooth = None  # moving average of the loss
        self.open = False

    def step(self, ev: StepFinished) -> None:
        k = 0.1
        self.avg = ev.seconds if self.avg is None else (1 - k) * self.avg + k * ev.seconds
        self.smooth = ev.loss if self.smooth is None else (1 - k) * self.smooth + k * ev.loss
        eta = _clock(self.avg * (ev.total - ev.step))
        line = (f"step {ev.step}/{ev.total}  loss {ev.loss:.4f} (avg {self.smooth:.4f})  {ev.seconds:.2f} s/step  "
                f"ETA {eta}  peak {ev.peak_memory / 1e9:.2f} GB")  # fmt: skip
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
    if isinstance(ev, StageFinished):
        return f"{ev.stage}: {ev.detail} ({ev.seconds:.1f} s)"
    if isinstance(ev, TrainStarted):
        where = f"resuming from {ev.resumed_from} at step {ev.first_step}" if ev.resumed_from else "starting"
        buckets = ", ".join(f"{k} x{v}" for k, v in ev.buckets.items())
        return (f"{where}: {ev.images} image(s) ({buckets}), {ev.adapters} adapters, "
                f"{ev.parameters / 1e6:.2f} M trainable values, {ev.total_steps} steps; work folder {ev.work_dir}")  # fmt: skip
    if isinstance(ev, CheckpointSaved):
        return f"checkpoint: {ev.path}"
    if isinstance(ev, SamplesSaved):
        return "samples: " + ", ".join(str(p) for p in ev.paths)
    if isinstance(ev, ValidationFinished):
        levels = ", ".join(f"{k} {v:.4f}" for k, v in ev.by_sigma.items())
        return f"validation at step {ev.step}: loss {ev.loss:.4f} (by noise level: {levels})"
    if isinstance(ev, TrainFinished):
        return f"wrote {ev.output} ({ev.steps} steps, {_clock(ev.seconds)}); loss plot and train.json in {ev.work_dir}"
    return None


@click.command("train")
@click.option("--data", "-d", required=True, help="Folder of images (.png .jpg .jpeg .webp), each with a <name>.txt caption.")
@click.option("--output", "-o", required=True, help="The LoRA file to write (.safetensors, diffusers format); never overwritten.")
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help="A klein Base repo id or folder.")
@click.option("--caption", default=None, help="Caption of images without a .txt (e.g. a trigger word).")
@click.option("--control", "controls", multiple=True,
              help="Edit LoRAs: folder of reference images, same names as --data; repeat for more references.")
@click.option("--rank", type=int, default=_D.rank, show_default=True)
@click.option("--alpha", type=float, default=None, help="LoRA alpha; scale = alpha / rank [default: rank].")
@click.option("--targets", default=_D.targets, show_default=True,
              help="all, attention, double (style), single:0-12 (structure), or module names; comma-separated.")
@click.option("--steps", type=int, default=_D.steps, show_default=True, help="Optimizer steps.")
@click.option("--lr", type=float, default=_D.lr, show_default=True, help="Learning rate (constant).")
@click.option("--batch-size", type=int, default=_D.batch_size, show_default=True)
@click.option("--grad-accum", type=int, default=_D.grad_accum, show_default=True, help="Micro-batches per step.")
@click.option("--resolution", type=int, default=_D.resolution, show_default=True,
              help="Train at about this many px squared, aspect ratio kept, sides multiples of 16.")
@click.option("--timesteps", type=click.Choice(TIMESTEPS), default=_D.timesteps, show_default=True,
              help="Noise-level sampling: musubi's flux2_shift, diffusers' logit-normal, or uniform.")
@click.option("--seed", type=int, default=_D.seed, show_default=True)
@click.option("--weight-decay", type=float, default=_D.weight_decay, show_default=True)
@click.option("--max-grad-norm", type=float, default=_D.max_grad_norm, show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=_D.dtype, show_default=True)
@click.option("--quantize", "-q", type=click.Choice(["4", "8"]), default=None, help="Quantize the frozen model (QLoRA).")
@click.option("--low-memory", is_flag=True, help="Gradient checkpointing per block: much less memory, 1.2-1.5x the time per step.")
@click.option("--save-every", type=int, default=_D.save_every, show_default=True, help="Checkpoint every N steps.")
@click.option("--keep-checkpoints", type=int, default=_D.keep_checkpoints, show_default=True)
@click.option("--work-dir", default=None, help="Checkpoints, samples, loss.png, train.json [default: <output stem>.train/].")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in the work folder.")
@click.option("--sample-every", type=int, default=None, help="Write sample images every N steps.")
@click.option("--sample-prompt", "sample_prompts", multiple=True, help="Prompt of the sample images; repeatable.")
@click.option("--sample-steps", type=int, default=None, help="Denoising steps of the samples [default: the model's].")
@click.option("--sample-seed", type=int, default=_D.sample_seed, show_default=True)
@click.option("--ema", type=float, default=None,
              help="Write an exponential moving average of the adapters (decay in (0, 1), e.g. 0.999) as the output.")
@click.option("--validation", default=None, help="Folder of held-out images + captions: their loss at each checkpoint.")
def train(**options):
    """Train a LoRA on FLUX.2 [klein] Base from a folder of captioned images.

    Under mlx.launch (several Macs) every process runs this command; rank 0 alone prints and writes."""
    options["quantize"] = int(options["quantize"]) if options["quantize"] else None
    w = world()
    if w.size > 1:  # mlx.launch ends the others with SIGTERM when one process fails: say so, in one line
        signal.signal(signal.SIGTERM, lambda *_: _stopped(w.size))
    if not w.is_main:
        _follow(options)
        return
    events = train_lora(**options)  # everything is checked here, before any model loads
    progress = ProgressLine()
    t0 = time.perf_counter()
    for ev in events:
        if isinstance(ev, StepFinished):
            progress.step(ev)
            continue
        text = describe_event(ev)
        if isinstance(ev, TrainFinished):
            progress.close()
            click.echo(text)  # the result, on stdout
        elif text:
            progress.say(text)
    click.echo(f"done in {_clock(time.perf_counter() - t0)}", err=True)


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


def main(argv=None) -> int:
    return run_command(train, argv)


if __name__ == "__main__":
    sys.exit(main())
