"""A run checked whole before any model loads: `plan_run` checks the settings, the model files, the output,
the data, the work folder and its checkpoints and the memory plan, and returns the `RunPlan` the
`Trainer` (trainer.py) runs. Under mlx.launch every process checks its own view, then they agree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..dtypes import as_dtype
from ..errors import FluxKleinError
from ..limits import MAX_TRAIN_STEPS
from ..run.components import check_for_training, check_weights
from ..run.loading import ModelInfo, describe, single_file_refusal
from ..storage.files import check_output_file
from .data.dataset import batches_per_epoch, check_held_out, running_batch, say_shared_images, scan_data
from .data.latents import LatentCache, run_latents
from .memory import MemoryPlanned, check_memory
from .report.samples import check_sample_model, sample_references
from .settings import TrainSettings
from .starting import init_arrays
from .state import resume_point
from .step.adapters import adapter_file_shapes, adapter_parameters, parse_targets
from .step.distributed import World, check_processes, world
from .step.objective import check_schedule
from .workdir import check_not_locked, check_work_dir, checkpoints

# --- checks before anything runs -----------------------------------------------------------------


@dataclass(kw_only=True)
class RunPlan:
    """A checked run: settings, the model as described, the adapters, the data, where to resume."""

    settings: TrainSettings
    info: ModelInfo
    slots: list
    items: list
    resume_from: Path | None
    sample_info: ModelInfo | None = None  # the sample model (None: no samples)
    sample_references: list = field(default_factory=list)  # per sample prompt, its reference images (edit LoRAs)
    memory: MemoryPlanned | None = None
    validation: list = field(default_factory=list)  # held-out TrainItems (--validation)
    init_arrays: dict = field(default_factory=dict)  # --init-lora: the adapters' start (train/starting.py)
    latents: LatentCache | None = None  # the latents the run needs, from the latent cache or the VAE
    batches_per_epoch: int = 1  # global batches of one epoch (data.epoch_batches)
    world: World = field(default_factory=World)  # the processes of an mlx.launch run


def _check_model(settings: TrainSettings) -> ModelInfo:
    if Path(settings.model).expanduser().is_file():  # a transformer or a LoRA file: what train needs, in load()'s words
        raise single_file_refusal(settings.model)
    info = describe(settings.model)
    check_for_training(info, settings.quantize, weights=("transformer", "text_encoder"))  # the VAE: _latents
    return info


def with_epochs(settings: TrainSettings, batches: int) -> TrainSettings:
    """--epochs E: --steps becomes the steps E epochs of `batches` global batches take, ceil(E x batches /
    grad_accum) (the last step may reach into epoch E + 1 when grad_accum does not divide them), its lr
    schedule checked again for that length."""
    if settings.epochs is None:
        return settings
    steps = math.ceil(settings.epochs * batches / settings.grad_accum)
    if steps > MAX_TRAIN_STEPS:
        raise FluxKleinError(
            f"--epochs {settings.epochs} of {batches} batches is {steps:,} steps; the limit of --steps is "
            f"{MAX_TRAIN_STEPS:,}: give at most {MAX_TRAIN_STEPS * settings.grad_accum // batches:,} epochs"
        )
    check_schedule(settings.lr_scheduler, settings.warmup_steps, steps)
    return dataclasses.replace(settings, steps=steps)


def epochs_ended(step: int, *, batches: int, grad_accum: int) -> range:
    """The epochs whose last batch optimizer step `step` runs: e with (step - 1) x grad_accum < e x batches
    <= step x grad_accum (1-based; empty for a step inside an epoch)."""
    return range((step - 1) * grad_accum // batches + 1, step * grad_accum // batches + 1)


def _latents(settings: TrainSettings, info: ModelInfo, items: list, held_out: list) -> LatentCache:
    """The run's latents (train/data/latents.py); the VAE's weight files are checked here unless every latent is
    stored (a resume or rerun opens none of them; a damaged entry has them checked before the VAE loads)."""
    latents = run_latents(settings, info, as_dtype(settings.dtype), items=items, held_out=held_out)
    if latents.stored():
        latents.unchecked = True
    else:
        check_weights(info, ("vae",))
    return latents


def run_key(settings: TrainSettings, info: ModelInfo, processes: int = 1) -> dict:
    """The settings a checkpoint must share with a run that resumes it; the model by its resolved path and
    its family's title (a checkpoint of another family's adapters is said to be one: state.resume_point)."""
    return {**settings.run_key(), "model": str(info.path), "family": info.family.title, "processes": processes}


def data_key(items) -> list:
    """What a checkpoint records of the data: each example's name, hashes and caption."""
    return [[it.stem, it.image.sha256, it.caption, [c.sha256 for c in it.controls], list(it.bucket)] for it in items]


def plan_run(settings: TrainSettings, processes: World | None = None) -> RunPlan:
    """Every check of a run, before any model loads: settings, model files, output, data, work folder."""
    w = processes or world()  # under mlx.launch every process checks its own view, then they agree
    return w.agree(lambda: _plan(settings, w), lambda plan: (plan.settings.run_key(), data_key(plan.items)))


def _plan(settings: TrainSettings, w: World) -> RunPlan:
    settings = settings.check()
    if settings.output.exists() or settings.output.is_symlink():
        _refuse_finished(settings)
        raise FluxKleinError(f"--output {settings.output} exists and is never overwritten; choose another name")
    check_output_file(settings.output)
    check_work_dir(settings.work_dir, settings.data, settings.controls)
    info = _check_model(settings)
    slots = parse_targets(settings.targets, info.params, references=bool(settings.controls))
    # counted before any model loads; a LoKr's layers must be whole (lokr_layers refuses here)
    trainable = adapter_parameters(
        slots, info.params, adapter=settings.adapter, rank=settings.rank, lokr_factor=settings.lokr_factor
    )
    read = dict(  # how captions and sizes are read: the same for the held-out images
        caption=settings.caption,
        caption_extension=settings.caption_extension,
        resolution=settings.resolution,
        trigger=settings.trigger,
    )
    items = scan_data(settings.data, **read, controls=settings.controls, repeats=settings.repeats)
    epoch = batches_per_epoch(items, settings.batch_size * w.size)
    settings = with_epochs(settings, epoch)
    start = {}
    if settings.init_lora is not None:  # read and checked against the adapters, before any model loads
        start = init_arrays(settings.init_lora, slots, info.params, rank=settings.rank, alpha=settings.alpha)
    held_out = []
    if settings.validation:
        check_held_out(settings.validation, settings.data, settings.validation_controls, settings.controls)
        held_out = scan_data(  # held-out captions read as the training ones
            settings.validation,
            **read,
            controls=settings.validation_controls,
            option="--validation",
            control_option="--validation-control",
        )
        say_shared_images(held_out, items)
    sample_info = check_sample_model(settings, info)
    references = sample_references(settings, items, held_out) if sample_info is not None else []
    resume = (
        _resume_point(settings, info, slots=slots, items=items, processes=w.size) if w.is_main else None
    )  # rank 0 alone has the work folder
    return RunPlan(
        settings=settings,
        info=info,
        slots=slots,
        items=items,
        resume_from=resume,
        sample_info=sample_info,
        sample_references=references,
        memory=check_memory(settings, info, trainable, running_batch(items, settings.batch_size)),
        validation=held_out,
        latents=_latents(settings, info, items, held_out),
        world=w,
        batches_per_epoch=epoch,
        init_arrays=start,
    )


def _refuse_finished(settings: TrainSettings) -> None:
    """--resume of a run whose last checkpoint is at --steps and whose --output is written: nothing to do.
    (Without its output, the run writes it from that checkpoint: the way back from a failed final write.)"""
    done = checkpoints(settings.work_dir) if settings.resume else []
    if done and done[-1][0] == settings.steps:
        raise FluxKleinError(
            f"--resume: {settings.work_dir} is already at step {settings.steps} of {settings.steps} and its LoRA "
            f"is written to {settings.output}; raise --steps to train on (with another --output)"
        )


def _resume_point(settings: TrainSettings, info: ModelInfo, *, slots, items, processes: int) -> Path | None:
    """The checkpoint to continue from (state.resume_point), after the lock and the process count."""
    check_not_locked(settings.work_dir)
    done = checkpoints(settings.work_dir) if settings.resume and settings.work_dir.is_dir() else []
    if done:  # another process count is named as such, before the settings' general comparison
        check_processes(done[-1][1], processes)
    shapes = adapter_file_shapes(
        slots, info.params, adapter=settings.adapter, rank=settings.rank, factor=settings.lokr_factor
    )
    key = run_key(settings, info, processes)
    data = data_key(items)
    return resume_point(
        settings.work_dir,
        resume=settings.resume,
        steps=settings.steps,
        key=key,
        data=data,
        lora_shapes=shapes,
        n_items=len(items),
        ema=settings.ema is not None,  # its ema.safetensors checked with the checkpoint
    )
