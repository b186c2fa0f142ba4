"""A training run's checkpoints: written crash-safe, checked whole before a resume, read back; the run's
output and train.json (the folder itself, its mark and its lock: workdir.py).

    ink.train/                      (default: <output stem>.train/ next to the output)
        .flux_klein_mlx-train       the mark of a folder that runs of this program write
        train.lock                  while a run uses the folder: its pid, host and start time
        train.json                  every setting, the data list with hashes, versions
        loss.png                    the loss of every step and its moving average, with the lr
        checkpoint-000250/
            lora.safetensors        diffusers/PEFT format, float32: loads with --lora as it is
            optimizer.safetensors   the optimizer's state (AdamW's moments) and step count
            state.json              step, the epoch's batch order and position, RNG state, losses, run key
        samples/step-000250-0.png

A checkpoint is written into a temporary folder, flushed and renamed into place when complete
(files.folder_transaction; a rename is atomic), so a crash or a full disk leaves the earlier
checkpoints as they were. Only the newest `keep` checkpoints are kept. Before a resume the newest
one is checked whole, every value finite, its EMA too (`checkpoint_problem`), so a damaged one is
named with an earlier good one before any model loads; a run at --steps without --output writes it.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checks import is_int
from ..errors import FluxKleinError
from ..lora import layouts
from ..storage.files import (
    folder_transaction,
    write_exclusive,
    write_replacing,
)
from ..storage.weights import read_safetensors, safetensors_table, save_safetensors_streaming
from .settings import differences
from .step.adapters import CHECKPOINT_LAYOUTS
from .step.optimizers import state_shapes
from .workdir import checkpoints

EMA_FILE = "ema.safetensors"  # a checkpoint's moving average of the adapters (train/report/evaluation.py), with --ema


def write_checkpoint(
    work_dir: Path,
    step: int,
    *,
    lora: tuple[dict, dict],
    optimizer: dict[str, mx.array],
    state: dict,
    keep: int,
    extra: dict | None = None,
) -> Path:
    """Write checkpoint `step` (lora = (tensors, header metadata)) and drop all but the newest `keep`;
    `extra` maps more file names to (tensors, metadata) (ema.safetensors).

    On an OSError (a full disk, say) nothing of the new checkpoint remains and the earlier ones are
    untouched; the FluxKleinError names the last good one.
    """
    final = work_dir / f"checkpoint-{step:06d}"
    try:
        with folder_transaction(final, durable=True) as tmp:  # the same step written before is replaced whole
            save_safetensors_streaming(tmp / "lora.safetensors", dict(lora[0]), metadata=lora[1])
            save_safetensors_streaming(tmp / "optimizer.safetensors", dict(optimizer), metadata={"format": "mlx"})
            for name, (tensors, metadata) in (extra or {}).items():
                save_safetensors_streaming(tmp / name, dict(tensors), metadata=metadata)
            (tmp / "state.json").write_text(json.dumps(state))
    except (OSError, FluxKleinError) as e:
        why = (e.strerror or e) if isinstance(e, OSError) else e
        raise FluxKleinError(f"cannot write checkpoint {final.name} ({why}); {way_back(work_dir)}") from None
    for _, old in checkpoints(work_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --- a checkpoint checked whole before a resume (no model loaded) ---------------------------------


def _tensor_table(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of a safetensors file from its header; ValueError says what is wrong."""
    if not path.is_file():
        raise ValueError(f"{path.name} is missing")
    try:
        table, needed = safetensors_table(path)
    except OSError as e:
        raise ValueError(f"{path.name} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{path.name} is not a whole safetensors file ({e})") from None
    size = path.stat().st_size
    if needed > size:
        raise ValueError(f"{path.name} is cut short ({size} bytes of {needed})")
    return table


def _state_problem(state, step: int, n_items: int) -> str | None:
    """What is wrong with a checkpoint's state.json (types and values), or None."""
    if not isinstance(state, dict):
        return "state.json is not a JSON object"
    for key in ("step", "epoch", "position"):
        if not is_int(state.get(key)) or state[key] < 0:
            return f"state.json's {key} is {state.get(key)!r}, not a whole number"
    if state["step"] != step:
        return f"state.json says step {state['step']}, its folder name step {step}"
    batches = state.get("batches")
    losses = state.get("losses")
    if not isinstance(batches, list) or not all(isinstance(b, list) and b for b in batches):
        return "state.json's batches is not a list of batches"
    if not all(is_int(i) and 0 <= i < n_items for b in batches for i in b):
        return f"state.json's batches name examples outside the {n_items} of --data"
    if state["position"] > len(batches):
        return f"state.json's position {state['position']} is past its {len(batches)} batches"
    numbers = isinstance(losses, list) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses)
    if not numbers or len(losses) != step:
        return f"state.json's losses is not a list of {step} numbers"
    try:
        np.random.default_rng().bit_generator.state = state.get("rng")
    except (TypeError, ValueError, KeyError):
        return "state.json's rng is not a random generator's state"
    if not isinstance(state.get("run_key"), dict) or not isinstance(state.get("data"), list):
        return "state.json has no run key or data list"
    return None


def _optimizer_problem(table: dict, lora_shapes: list[tuple[int, ...]], optimizer: str = "adamw") -> str | None:
    """The optimizer's state: its step count and the per-adapter state of `optimizer` (AdamW's two moments m, v
    shaped like each adapter tensor; the others': optimizers.state_shapes)."""
    if "step" not in table:
        return "optimizer.safetensors has no step count"
    wanted = [state_shapes(optimizer, shape) for shape in lora_shapes]
    names = {name for per in wanted for name in per}
    moments = sorted(shape for name, (_, shape) in table.items() if name.rsplit(".", 1)[-1] in names)
    need = sorted(shape for per in wanted for shape in per.values())
    if moments != need:
        return f"optimizer.safetensors holds {len(moments)} moments, this run's adapters need {len(need)}"
    return None


def _values_problem(path: Path) -> str | None:
    """NaN or infinity in a checkpoint file (its bytes read: a resume would train on them from the first step)."""
    try:
        tensors = read_safetensors(path)
        for name, t in tensors.items():
            if mx.issubdtype(t.dtype, mx.floating) and not mx.all(mx.isfinite(t)).item():
                return f"{path.name} holds NaN or infinite values ({name})"
    except (FluxKleinError, RuntimeError, ValueError) as e:
        return f"{path.name} cannot be read ({str(e).splitlines()[0][:120]})"
    return None


def checkpoint_problem(
    folder: Path, step: int, lora_shapes: dict[str, tuple[int, ...]], *, n_items: int, ema: bool = False
) -> str | None:
    """What is wrong with checkpoint `folder` (state.json, lora.safetensors, optimizer.safetensors and,
    with `ema`, ema.safetensors: present, whole, of the types and shapes this run needs, every value
    finite; `lora_shapes` is the file's name -> shape), or None when it can be resumed. Reads the
    files' bytes and state.json; loads no model."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except FileNotFoundError:
        return "state.json is missing"
    except (OSError, ValueError) as e:
        return f"state.json cannot be read ({getattr(e, 'strerror', None) or e})"
    if why := _state_problem(state, step, n_items):
        return why
    try:
        lora = _tensor_table(folder / "lora.safetensors")
        optimizer = _tensor_table(folder / "optimizer.safetensors")
    except ValueError as e:
        return str(e)
    if {k: shape for k, (_, shape) in lora.items()} != lora_shapes:
        other = sorted(set(lora) ^ set(lora_shapes))
        detail = other[0] if other else "tensor shapes"
        return f"lora.safetensors holds other adapters than this run's ({detail} differs): another run's file"
    trained = [shape for shape in lora_shapes.values() if shape != ()]  # every factor a matrix; LoKr's alpha a constant
    if why := _optimizer_problem(optimizer, trained, state["run_key"].get("optimizer", "adamw")):
        return why
    files = ["lora.safetensors", "optimizer.safetensors"] + ([EMA_FILE] if ema else [])
    if ema:  # the average is the output --ema writes: checked as lora.safetensors is
        try:
            average = _tensor_table(folder / EMA_FILE)
        except ValueError as e:
            return str(e)
        if {k: shape for k, (_, shape) in average.items()} != lora_shapes:
            return f"{EMA_FILE} holds other adapters than lora.safetensors"
    return next(filter(None, (_values_problem(folder / name) for name in files)), None)


def damaged(folder: Path, why: str, earlier: list[tuple[int, Path]], is_good=lambda c: True) -> FluxKleinError:
    """The one line for a damaged checkpoint: which, why, and what to do (never "download it again"):
    continue from the newest earlier checkpoint that `is_good` (naming the damaged ones to delete first)."""
    good = next((c for c in reversed(earlier) if is_good(c)), None)
    newer = [p.name for s, p in earlier if good is None or s > good[0]]  # damaged too: in the way of a resume
    also = f" and {', '.join(newer)} (damaged too)" if newer else ""
    todo = f"to continue from {good[1].name} with --resume" if good else "and start anew without --resume"
    return FluxKleinError(f"{folder.name} in {folder.parent} is damaged: {why}; delete that folder{also} {todo}")


def adapter_file(adapters) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A checkpoint's lora.safetensors (and ema.safetensors), as (tensors, header): the adapters'
    (train.adapters) terms through lora/layouts' one writer, in their checkpoint layout, float32.
    Alpha stays apart from B (PEFT's header), so a resume reads back the very values it trained."""
    layout = CHECKPOINT_LAYOUTS[adapters.kind]
    return layouts.adapter_file(
        adapters.terms(), layout, adapters.params, what="the checkpoint", dtype=mx.float32, fold_alpha=False
    )


def read_adapter_file(path: Path, adapters) -> list:
    """A checkpoint's adapter file (lora.safetensors, ema.safetensors) read back through lora/layouts
    as the terms it was written from, for `adapters.load_terms`."""
    return layouts.read_adapter(path, adapters.params, str(path))


def read_checkpoint(folder: Path, adapters) -> tuple[list, dict[str, mx.array], dict]:
    """(the adapter terms of `adapters`' run, optimizer tensors, state) of one checkpoint."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise FluxKleinError(f"checkpoint {folder} is damaged ({e}); resume from another or start anew") from None
    terms = read_adapter_file(folder / "lora.safetensors", adapters)
    optimizer = read_safetensors(folder / "optimizer.safetensors")
    mx.eval(optimizer)
    return terms, optimizer, state


def way_back(work_dir: Path) -> str:
    """What to do after a write in the work folder failed: continue from its last good checkpoint
    (named), or, before the first one, run again (--resume would find nothing to continue)."""
    if done := checkpoints(Path(work_dir)):
        last = f"{done[-1][1]} (step {done[-1][0]})"
        return f"the last good checkpoint is {last}: free some space and continue with --resume"
    return "no checkpoint was written yet: free some space and run the same command again"


def write_atomic(path: Path, write: Callable[[Path], None], work_dir: Path | None = None) -> None:
    """Write a file of the work folder (`work_dir`, default the file's folder) through a temporary name
    and a rename (replacing the old one); a failure names the way back (`way_back`) and leaves no temporary."""
    try:
        write_replacing(path, write)
    except OSError as e:
        raise FluxKleinError(f"cannot write {path} ({e.strerror or e}); {way_back(work_dir or path.parent)}") from None


def write_output(output: Path, write: Callable[[Path], None], work_dir: Path) -> Path:
    """The run's --output, never over a file (files.write_exclusive); when it cannot be written the
    line names the checkpoint that holds the run and the one command that writes the output from it."""
    try:
        return write_exclusive(output, write)
    except FluxKleinError as e:
        if not (done := checkpoints(work_dir)):
            raise
        raise FluxKleinError(
            f"{e}; the trained run is kept in {done[-1][1]} (step {done[-1][0]}): free some space and run the same "
            f"command with --resume, which writes {output} from it (as asked: layout, EMA) without training"
        ) from None


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def resume_point(
    wd: Path, *, resume: bool, steps: int, key: dict, data: list, lora_shapes: dict, n_items: int, ema: bool = False
) -> Path | None:
    """The checkpoint a run continues from (None: a new run), checked whole and against this run's
    run `key` and `data` key; refuses mixing runs in one work folder and a run that is already done."""
    done = checkpoints(wd)
    if not resume:
        if done:
            raise FluxKleinError(
                f"{wd} holds checkpoints of a run (latest: step {done[-1][0]}); continue it with --resume, "
                "or choose another --work-dir"
            )
        return None
    if not done:
        raise FluxKleinError(f"--resume: no checkpoint in {wd}; run without --resume to start training")
    step, folder = done[-1]
    _refuse_other_settings(folder, key, data)
    if why := checkpoint_problem(folder, step, lora_shapes, n_items=n_items, ema=ema):
        raise damaged(
            folder, why, done[:-1], lambda c: not checkpoint_problem(c[1], c[0], lora_shapes, n_items=n_items, ema=ema)
        )
    if step > steps:  # (at --steps, with no --output written: the run writes it from there, without training)
        raise FluxKleinError(f"--resume: {folder} is at step {step}, past --steps {steps}; raise --steps")
    return folder


def _refuse_other_settings(folder: Path, key: dict, data: list) -> None:
    """A checkpoint whose state.json names another run (settings or data): say what differs."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return  # damaged: checkpoint_problem says how
    if not isinstance(state, dict) or not isinstance(state.get("run_key"), dict):
        return
    if state["run_key"].get("version") != key["version"]:
        raise FluxKleinError(
            f"--resume: {folder} was written under run key version {state['run_key'].get('version')} (this "
            f"flux_klein_mlx writes {key['version']}) and cannot be continued; start anew in another --work-dir"
        )
    there = state["run_key"].get("family")
    if there != key.get("family"):
        raise FluxKleinError(
            f"--resume: {folder} is a checkpoint of {there}'s adapters (--model {state['run_key'].get('model')}) and "
            f"this run's model is {key.get('family')}'s; give that run's --model, or start anew in another --work-dir"
        )
    diffs = differences(state["run_key"], key)
    if state.get("data") != data:
        diffs.append("data: the images, captions or controls differ from the checkpoint's")
    if diffs:
        raise FluxKleinError(
            f"--resume: {folder} is from a run with other settings ({'; '.join(diffs[:3])}); give the same "
            "settings, or start anew in another --work-dir"
        )
