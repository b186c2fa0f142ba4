"""The work folder of a training run: checked up front, locked while a run uses it, checkpoints
written crash-safe and checked whole before a resume, train.json, loss.png.

    ink.train/                      (default: <output stem>.train/ next to the output)
        .flux_klein_mlx-train       the mark of a folder that runs of this program write
        train.lock                  while a run uses the folder: its pid, host and start time
        train.json                  every setting, the data list with hashes, versions
        loss.png                    the loss of every step and its moving average, with the lr
        checkpoint-000250/
            lora.safetensors        diffusers/PEFT format, float32: loads with --lora as it is
            optimizer.safetensors   AdamW's moments and step count
            state.json              step, the epoch's batch order and position, RNG state, losses, run key
        samples/step-000250-0.png

A checkpoint is written into a temporary folder, flushed and renamed into place when complete
(files.folder_transaction; a rename is atomic), so a crash or a full disk leaves the earlier
checkpoints as they were. Only the newest `keep` checkpoints are kept. Before a resume the newest
one is checked whole, every value finite, its EMA too (`checkpoint_problem`), so a damaged one is
named with an earlier good one before any model loads; a run at --steps without --output writes it.

The folder is ours or refused: a run writes only into a new or empty folder, or one an earlier run
marked as ours (`WORK_MARKER`), and only under the names above; a folder holding other files (a
train.json of some other program's, say) or a symbolic link is refused before any model loads, and
the lock is opened without following a link (files.open_no_follow).

The lock: a second run on the same folder (the same --output twice, say) refuses with one line
instead of mixing its checkpoints into the first one's. The file is held with flock(2) while the
run lasts, so the kernel releases it when the process dies however it dies; the next run finds
the file (pid, host, start time), takes the lock, and says that it took over a stale lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checks import is_int
from ..errors import FluxKleinError, Notice
from ..files import (
    broken_link,
    check_owned_folder,
    check_writable,
    claim_folder,
    folder_transaction,
    is_temporary_file,
    open_no_follow,
    write_exclusive,
    write_replacing,
)
from ..lora import layouts
from ..weights import read_safetensors, safetensors_table, save_safetensors_streaming
from .adapters import CHECKPOINT_LAYOUTS
from .settings import differences

_CHECKPOINT = re.compile(r"^checkpoint-(\d{6,})$")
# The temporary folders of files.folder_transaction for checkpoints (files: files.is_temporary_file).
_TEMPORARY_CHECKPOINT = re.compile(r"^checkpoint-\d+\.(tmp|old)-[0-9a-f]{8}$")
LOCK_NAME = "train.lock"
EMA_FILE = "ema.safetensors"  # a checkpoint's moving average of the adapters (train/evaluation.py), with --ema
WORK_MARKER = ".flux_klein_mlx-train"
# Every name a run writes at the top of its work folder (and its own temporaries).
_WORK_FILES = {LOCK_NAME, "train.json", "loss.png", "samples"}


# --- the work folder, checked before anything runs --------------------------------------------------


def check_work_dir(work_dir: Path, data, controls=()) -> None:
    """Refuse a work folder that cannot hold the run's files (FluxKleinError, one line): a symbolic
    link that loops or leads nowhere, a file, a missing parent, the data or a control folder (or a
    folder inside one: a dataset never gains loss.png or train.json), a folder that cannot be written.
    Writes nothing that stays (a probe file is created and removed)."""
    wd = Path(work_dir)
    for p in (wd.parent, wd):
        if trouble := broken_link(p):
            raise FluxKleinError(
                f"--work-dir {wd}: {p} is a symbolic link that {trouble}; remove it or choose another --work-dir"
            )
    if wd.exists() and not wd.is_dir():
        raise FluxKleinError(f"--work-dir {wd} is a file; give a folder (it is created if missing)")
    if not wd.parent.is_dir():
        raise FluxKleinError(f"--work-dir {wd}: its parent folder {wd.parent} does not exist; create it first")
    _refuse_inside_data(wd, [("--data", data)] + [("--control", c) for c in controls])
    check_owned_folder(wd, WORK_MARKER, is_work_file, "--work-dir")
    probe_in = wd if wd.is_dir() else wd.parent
    check_writable(probe_in, f"--work-dir {wd}")


def is_work_file(name: str) -> bool:
    """Whether `name` at the top of a work folder is one a run writes (a file, a checkpoint or a temporary)."""
    return (
        name in _WORK_FILES
        or bool(_CHECKPOINT.match(name) or _TEMPORARY_CHECKPOINT.match(name))
        or (is_temporary_file(name))
    )


def claim_work_dir(work_dir: Path) -> None:
    """Create the work folder (if missing) and mark it as this program's, after `check_work_dir`."""
    try:
        claim_folder(work_dir, WORK_MARKER, "a work folder of flux_klein_mlx train: its runs write here\n")
    except OSError as e:
        raise FluxKleinError(
            f"cannot write in the work folder {work_dir} ({e.strerror}); free some space or choose another --work-dir"
        ) from None


def _refuse_inside_data(wd: Path, folders: list[tuple[str, object]]) -> None:
    try:
        where = wd.resolve()
    except (OSError, RuntimeError):  # a loop further up: the probe write says what is wrong
        return
    for option, folder in folders:
        try:
            f = Path(folder).expanduser().resolve()
        except (OSError, RuntimeError, TypeError):
            continue
        if where == f or f in where.parents:
            raise FluxKleinError(
                f"the work folder {wd} is inside the {option} folder {folder}: its checkpoints, loss.png and "
                "train.json would mix with the images; give --work-dir outside it (or an --output outside it)"
            )


# --- the lock: one run per work folder ------------------------------------------------------------


@dataclass
class RunLock:
    """The work folder's lock, held (flock) by this process until `release()`."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)  # first: a run that opens the name from now on makes a new file
        except OSError:
            pass
        os.close(self.fd)  # releases the flock
        self.fd = -1


def _holder(text: str) -> dict | None:
    """The run a lock file names ({"pid", "host", "started"}), or None (empty or not ours)."""
    try:
        h = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(h, dict) and isinstance(h.get("pid"), int) and isinstance(h.get("host"), str)
    return h if ok else None


def _describe_holder(h: dict | None) -> str:
    return (
        "a run that left no details" if h is None else f"pid {h['pid']} on {h['host']}, started {h.get('started', '?')}"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _try_flock(fd: int, holder: dict | None, mode: int = fcntl.LOCK_EX) -> bool:
    """Take the lock on `fd` without waiting: True when no live run holds it. Where the volume has
    no locks (some network shares), the pid decides, on this host; another host's lock is kept."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    return holder_gone(holder)


def holder_gone(holder: dict | None) -> bool:
    """Whether the run a lock names is known to be gone (on a volume without locks): it ran on this
    host and its pid no longer runs (or the lock names no run). Another host's run cannot be checked."""
    if holder is None:
        return True
    return holder["host"] == socket.gethostname() and not _pid_alive(holder["pid"])


def _busy(path: Path, holder: dict | None) -> FluxKleinError:
    return FluxKleinError(
        f"the work folder {path.parent} is in use by another training run ({_describe_holder(holder)}); "
        f"wait for it to end, or give this run another --output or --work-dir (if that run is gone, delete {path})"
    )


def check_not_locked(work_dir: Path) -> None:
    """Refuse (one line) when a live run holds `work_dir`'s lock; changes nothing (a stale lock is
    taken over by `acquire_lock` when the run starts)."""
    path = Path(work_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock (or one we cannot read: acquire_lock says so)
    try:
        holder = _holder(os.read(fd, 4096).decode("utf-8", "replace"))
        if not _try_flock(fd, holder, fcntl.LOCK_SH):  # shared: a read-only descriptor may take it anywhere
            raise _busy(path, holder)
    finally:
        os.close(fd)  # also releases the probe's flock


def acquire_lock(work_dir: Path) -> RunLock:
    """Lock `work_dir` for this run (FluxKleinError when a live run holds it); a lock left by a run
    that was killed is taken over with a `Notice` naming it."""
    path = Path(work_dir) / LOCK_NAME
    for _ in range(10):  # a run releasing the lock between our open and flock: try the new file
        try:
            fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise FluxKleinError(f"cannot create the lock {path} ({e.strerror}); choose another --work-dir") from None
        holder = _holder(os.read(fd, 4096).decode("utf-8", "replace"))
        if not _try_flock(fd, holder):
            os.close(fd)
            raise _busy(path, holder)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except OSError:
            same = False
        if not same:  # the name was unlinked by the run that held it: lock the file there now
            os.close(fd)
            continue
        if holder is not None:
            warnings.warn(
                f"taking over the lock of an earlier run in {path.parent} that no longer runs "
                f"({_describe_holder(holder)})",
                Notice,
                stacklevel=2,
            )
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + "\n").encode(), 0)
        except OSError as e:  # a full disk: no empty lock stays behind (we hold its flock: the file is ours)
            RunLock(path, fd).release()
            raise FluxKleinError(
                f"cannot write the lock {path} ({e.strerror}); free some space and run again"
            ) from None
        return RunLock(path, fd)
    raise _busy(path, None)


def checkpoints(work_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoint folders in `work_dir`, oldest first, as (step, folder) (`checkpoint_problem` checks one)."""
    found = []
    for p in work_dir.iterdir() if work_dir.is_dir() else []:
        m = _CHECKPOINT.match(p.name)
        if m and p.is_dir():  # written whole or not at all: a folder here with a file missing is damaged
            found.append((int(m.group(1)), p))
    return sorted(found)


def remove_temporaries(work_dir: Path) -> None:
    """Delete what an interrupted write of ours left behind (our own temporary names only)."""
    for p in work_dir.iterdir() if work_dir.is_dir() else []:
        if _TEMPORARY_CHECKPOINT.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
        elif is_temporary_file(p.name):
            p.unlink(missing_ok=True)


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


def _optimizer_problem(table: dict, lora_shapes: list[tuple[int, ...]]) -> str | None:
    """AdamW's state: its step count and two moments (m, v) shaped like each adapter tensor."""
    if "step" not in table:
        return "optimizer.safetensors has no step count"
    moments = sorted(shape for name, (_, shape) in table.items() if name.rsplit(".", 1)[-1] in ("m", "v"))
    if moments != sorted(lora_shapes * 2):
        return f"optimizer.safetensors holds {len(moments)} moments, this run's adapters need {2 * len(lora_shapes)}"
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
    if why := _optimizer_problem(optimizer, trained):
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
    Samples write the same bytes to try it."""
    layout = CHECKPOINT_LAYOUTS[adapters.kind]
    return layouts.adapter_file(adapters.terms(), layout, adapters.params, what="the checkpoint", dtype=mx.float32)


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
    diffs = differences(state["run_key"], key)
    if state.get("data") != data:
        diffs.append("data: the images, captions or controls differ from the checkpoint's")
    if diffs:
        raise FluxKleinError(
            f"--resume: {folder} is from a run with other settings ({'; '.join(diffs[:3])}); give the same "
            "settings, or start anew in another --work-dir"
        )
