"""A run checked whole before any model loads: `plan_run` checks the settings, the model files, the output,
the data, the work folder and its checkpoints and the memory plan, and returns the `RunPlan` the
`Trainer` (trainer.py) runs. Under mlx.launch every process checks its own view, then they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FluxKleinError
from ..files import check_output_file
from ..loading import check_for_training, describe, single_file_refusal
from .adapters import adapter_file_shapes, lokr_layers, parse_targets
from .data import scan_data
from .distributed import World, check_processes, world
from .memory import MemoryPlanned, check_memory
from .samples import check_sample_model
from .settings import TrainSettings
from .state import check_not_locked, check_work_dir, checkpoints, resume_point

# --- checks before anything runs -----------------------------------------------------------------


@dataclass
class RunPlan:
    """A checked run: settings, the model as described, the adapters, the data, where to resume."""

    settings: TrainSettings
    info: object  # loading.ModelInfo
    slots: list
    items: list
    resume_from: Path | None
    sample_info: object = None  # loading.ModelInfo of the sample model (None: no samples)
    memory: MemoryPlanned | None = None
    validation: list = field(default_factory=list)  # held-out TrainItems (--validation)
    world: World = field(default_factory=World)  # the processes of an mlx.launch run


def _check_model(s: TrainSettings):
    if Path(s.model).expanduser().is_file():  # a transformer or a LoRA file: what train needs, in load()'s words
        raise single_file_refusal(s.model)
    info = describe(s.model)
    check_for_training(info, s.quantize)
    return info


def run_key(s: TrainSettings, info, processes: int = 1) -> dict:
    """The settings a checkpoint must share with a run that resumes it; the model by its resolved path."""
    key = {**s.run_key(), "model": str(info.path)}
    if processes != 1:  # absent for one process, as before mlx.launch runs existed
        key["processes"] = processes
    return key


def data_key(items) -> list:
    """What a checkpoint records of the data: each example's name, hashes and caption."""
    return [[it.stem, it.image.sha256, it.caption, [c.sha256 for c in it.controls], list(it.bucket)] for it in items]


def plan_run(settings: TrainSettings, processes: World | None = None) -> RunPlan:
    """Every check of a run, before any model loads: settings, model files, output, data, work folder."""
    w = processes or world()  # under mlx.launch every process checks its own view, then they agree
    return w.agree(lambda: _plan(settings, w), lambda plan: (plan.settings.run_key(), data_key(plan.items)))


def _plan(settings: TrainSettings, w: World) -> RunPlan:
    s = settings.check()
    if s.output.exists() or s.output.is_symlink():
        raise FluxKleinError(f"--output {s.output} exists and is never overwritten; choose another name")
    check_output_file(s.output)
    check_work_dir(s.work_dir, s.data, s.controls)
    info = _check_model(s)
    slots = parse_targets(s.targets, info.params)
    if s.adapter == "lokr":
        lokr_layers(slots, info.params)  # whole layers only: refused here, before any model loads
    items = scan_data(
        s.data, s.caption, s.controls, s.resolution, trigger=s.trigger, caption_extension=s.caption_extension
    )
    held_out = []
    if s.validation:
        held_out = scan_data(
            s.validation,
            s.caption,
            s.validation_controls,
            s.resolution,
            option="--validation",
            control_option="--validation-control",
        )
    sample_info = check_sample_model(s, info)
    resume = _resume_point(s, info, slots, items, w.size) if w.is_main else None  # rank 0 alone has the work folder
    return RunPlan(s, info, slots, items, resume, sample_info, check_memory(s, info, slots), held_out, w)


def _resume_point(s: TrainSettings, info, slots, items, processes: int) -> Path | None:
    """The checkpoint to continue from (state.resume_point), after the lock and the process count."""
    check_not_locked(s.work_dir)
    done = checkpoints(s.work_dir) if s.resume and s.work_dir.is_dir() else []
    if done:  # another process count is named as such, before the settings' general comparison
        check_processes(done[-1][1], processes)
    shapes = adapter_file_shapes(slots, info.params, adapter=s.adapter, rank=s.rank, factor=s.lokr_factor)
    key, data = run_key(s, info, processes), data_key(items)
    return resume_point(s.work_dir, s.resume, s.steps, key, data, shapes, len(items))
