"""The work folder of a training run: checked up front, marked as ours, locked while a run uses it, and
the names of what a run keeps there (the checkpoints themselves: state.py).

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
import os
import re
import shutil
import socket
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import FluxKleinError, Notice
from ..storage.files import (
    check_owned_folder,
    check_writable,
    claim_folder,
    is_temporary_file,
    open_no_follow,
    pid_alive,
    refuse_broken_links,
)
from .report.metrics import METRICS_FILE, TENSORBOARD_FOLDER

_CHECKPOINT = re.compile(r"^checkpoint-(\d{6,})$")
# The temporary folders of files.folder_transaction for checkpoints (files: files.is_temporary_file).
_TEMPORARY_CHECKPOINT = re.compile(r"^checkpoint-\d+\.(tmp|old)-[0-9a-f]{8}$")
LOCK_NAME = "train.lock"
WORK_MARKER = ".flux_klein_mlx-train"
# Every name a run writes at the top of its work folder (and its own temporaries).
_WORK_FILES = {LOCK_NAME, "train.json", "loss.png", "samples", METRICS_FILE, TENSORBOARD_FOLDER}


# --- the work folder, checked before anything runs --------------------------------------------------


def check_work_dir(work_dir: Path, data, controls=()) -> None:
    """Refuse a work folder that cannot hold the run's files (FluxKleinError, one line): a symbolic
    link that loops or leads nowhere, a file, a missing parent, the data or a control folder (or a
    folder inside one: a dataset never gains loss.png or train.json), a folder that cannot be written.
    Writes nothing that stays (a probe file is created and removed)."""
    wd = Path(work_dir)
    refuse_broken_links(wd, f"--work-dir {wd}", instead="another --work-dir")
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
    return holder["host"] == socket.gethostname() and not pid_alive(holder["pid"])


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
