"""Every write that must never leave half a file: the one home of temporary names, renames and links.

Three ways to write, each named for what a reader of the disk may see:

- `write_exclusive(path, write)`: a new file that never replaces one (images, LoRAs, benchmark
  results): written under a temporary name, then hard-linked to the first free name, which fails
  if the name exists, so a name is taken by exactly one writer and is complete when it appears.
  `check_output_file` says before the work whether such a file can be created at all.
- `write_replacing(path, write)`: a file this program owns (a work folder's, a cache's) replaced
  whole: written under a temporary name, then renamed over `path`; readers see the old file or
  the new one.
- `folder_transaction(output)`: a whole folder (a converted model, a checkpoint) written next to
  its destination and renamed into place; an existing folder is replaced only then.

A folder a command keeps writing into (a training run's work folder) is ours or refused:
`check_owned_folder` refuses one that holds files we did not write (no marker file of ours) or a
symbolic link under a name we write, and `claim_folder` marks a new or empty one as ours.
`open_no_follow` opens a file we write in place (a lock) without following a link at its name.

Temporary names: a file's is `.NAME.XXXXXXXX.tmp` beside it (`temporary_name`, recognised by
`is_temporary_file`), a folder's `NAME.tmp-XXXXXXXX` holding a marker with its writer's pid (a
later run removes it once that process is gone). `file_sha256` is the one hash of a whole file.
This module imports only `errors`.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import FluxKleinError, first_few

# Room left in a file name for the "-N" that `write_exclusive` may add.
_SUFFIX_ROOM = 8
_TEMPORARY_FILE = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")
TMP_MARKER = ".flux_klein_mlx-writing"  # in `<output>.tmp-XXXXXXXX` while it is written: the writer's pid
_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{8}$")


# --- reading --------------------------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    """The sha256 (hex) of a file's bytes, read 1 MiB at a time (LoRAs in records, training images)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- temporary files ----------------------------------------------------------------------------------


def temporary_name(path: Path) -> Path:
    """`.NAME.XXXXXXXX.tmp` in the folder of `path`: the same file system, so a rename or link is atomic."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def is_temporary_file(name: str) -> bool:
    """Whether a file name is one `temporary_name` gives (left behind only by a writer that died)."""
    return bool(_TEMPORARY_FILE.match(name))


def write_replacing(path: Path, write: Callable[[Path], None]) -> None:
    """Write a file this program owns (a work folder's, a cache's) whole: `write(tmp)` to a temporary
    name in the same folder, then a rename over `path`. OSError passes to the caller; no temporary stays."""
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- folders a command keeps writing into ------------------------------------------------------------


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags)` that refuses (FluxKleinError, one line) where `path` is a symbolic link, instead
    of opening, truncating or writing the file it points to (O_NOFOLLOW)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise FluxKleinError(
                f"{path} is a symbolic link; nothing is ever written through a link: remove it and run again"
            ) from None
        raise


def check_owned_folder(folder: Path, marker: str, is_ours: Callable[[str], bool], option: str) -> None:
    """Refuse (FluxKleinError, one line naming them) a folder we would write into that holds entries we did
    not write: all of them when `marker` (the file `claim_folder` writes) is missing, else those whose
    names `is_ours` rejects; and any entry that is a symbolic link. Nothing is written; a missing or
    empty folder passes."""
    if not folder.is_dir():
        return
    names = sorted(os.listdir(folder))
    links = [n for n in names if os.path.islink(folder / n)]
    if links:
        raise FluxKleinError(
            f"{option} {folder}: {first_few(links)} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'}"
            f"; nothing is ever written through a link: remove {'it' if len(links) == 1 else 'them'} or choose "
            f"another {option}"
        )
    foreign = [n for n in names if n != marker and not is_ours(n)] if marker in names else names
    if foreign:
        raise FluxKleinError(
            f"{option} {folder} holds files this program did not write ({first_few(foreign)}); they are never "
            f"written over: give a new or empty folder as {option}"
        )


def claim_folder(folder: Path, marker: str, text: str) -> None:
    """Create `folder` if missing and mark it as ours: `marker` holding `text`, created once (an existing
    marker is kept; a link at its name is refused, see `open_no_follow`). Call `check_owned_folder` first.
    An OSError (a full disk) passes to the caller and leaves neither the marker nor a folder made here."""
    created = not folder.is_dir()
    folder.mkdir(exist_ok=True)
    try:
        fd = open_no_follow(folder / marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return
    try:
        os.write(fd, text.encode())
    except OSError:
        os.unlink(folder / marker)
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        os.close(fd)


# --- files that are never written twice ---------------------------------------------------------------


MIN_FREE_BYTES = 1 << 20  # below this a disk counts as full: one small image (or JSON, or preview) must fit


def check_writable(folder: Path, what: str) -> None:
    """The real test of permissions (a read-only folder or volume, ACLs, root squash): create and remove
    a file in `folder`; one line naming `what` (the option and its value) when that fails. The probe has one of
    our temporary names: another process of the same run (mlx.launch's ranks check one --work-dir together)
    that lists the folder meanwhile counts it as ours, never as a stranger's file."""
    probe = temporary_name(Path(folder) / "flux_klein_mlx-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        probe.unlink(missing_ok=True)  # missing: a cleaner of our temporaries took it first
    except OSError as e:
        raise FluxKleinError(
            f"{what}: cannot write in {folder} ({e.strerror}); choose a folder you can write to"
        ) from None


def check_output_file(path: str | Path, option: str = "--output") -> Path:
    """Raise FluxKleinError unless a new file can be created at `path` (or next to it, if taken)."""
    path = Path(path).expanduser()
    parent = path.parent
    refuse_broken_links(path, f"{option} {path}")
    if parent.exists() and not parent.is_dir():
        raise FluxKleinError(f"{option} {path}: {parent} is a file, not a folder; choose another path")
    if not parent.is_dir():
        raise FluxKleinError(f"{option} {path}: output folder {parent} does not exist; create it first")
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = 255
    if len(os.fsencode(path.name)) + _SUFFIX_ROOM > name_max:
        raise FluxKleinError(
            f"{option} file name is {len(os.fsencode(path.name))} bytes; this file system allows {name_max} "
            f"(keep it under {name_max - _SUFFIX_ROOM}); choose a shorter name"
        )
    if path.is_dir():
        raise FluxKleinError(f"{option} {path} is a folder; give a file name inside it, e.g. {path / 'image.png'}")
    check_writable(parent, f"{option} {path}")
    free = shutil.disk_usage(parent).free  # an empty probe fits on a full disk; an image does not
    if free < MIN_FREE_BYTES:
        raise FluxKleinError(
            f"{option} {path}: the disk of {parent} is full ({free} bytes free); free some space "
            "or choose a folder on another disk"
        )
    return path


def broken_link(path: Path) -> str | None:
    """What is wrong with `path` when it is a symbolic link that leads nowhere ("loops" or "points to
    nothing"), else None (we never write through a link, so such a name would only be skipped)."""
    try:
        os.stat(path)
    except OSError as e:
        if os.path.islink(path):  # not for no such name (or one too long: said below)
            return "loops" if e.errno == errno.ELOOP else "points to nothing"
    return None


def refuse_broken_links(path: Path, what: str, instead: str = "another path") -> None:
    """`path`, or the folder it is in, as a symbolic link that loops or leads nowhere: one line naming
    `what` ("--output x.png") before anything is read (`Path.resolve` would raise RuntimeError on a loop)."""
    for p in (path.parent, path):
        if trouble := broken_link(p):
            raise FluxKleinError(f"{what}: {p} is a symbolic link that {trouble}; remove it or choose {instead}")


def numbered_name(path: Path, n: int) -> Path:
    """`stem-n.suffix`: the name of image n of a batch."""
    return path.with_name(f"{path.stem}-{n}{path.suffix}")


def _link_to_free_name(tmp: Path, path: Path, first: int | None) -> Path:
    """Give the finished `tmp` the first free name `path`, `stem-1.suffix`, ... (or `stem-first.suffix`,
    `stem-(first+1).suffix`, ...); never replaces a file."""
    n = first or 0
    while True:
        final = path if first is None and n == 0 else numbered_name(path, n)
        try:
            os.link(tmp, final)
            return final
        except FileExistsError:
            n += 1
        except OSError:  # no hard links here (some network/FAT volumes): exclusive create + copy
            try:
                dst = open(final, "xb")
            except FileExistsError:
                n += 1
                continue
            try:
                with dst, open(tmp, "rb") as src:
                    shutil.copyfileobj(src, dst)
            except BaseException:
                os.unlink(final)  # never a half-written file under the final name
                raise
            return final


def write_exclusive(path: str | Path, write: Callable[[Path], None], first: int | None = None) -> Path:
    """Write a new file at `path`, or at the first free `stem-N.suffix`; never replaces a file.

    `write(tmp)` writes the whole content to `tmp` (a name in the same folder); it is then
    hard-linked to the final name, which fails if the name exists, so a name is taken by exactly
    one writer and is complete when it appears. With `first`, only numbered names are used: the
    first free `stem-N.suffix` with N >= first (the images of a batch continue the numbering
    after files that exist, so no name ever carries two numbers). Returns the name written; any
    error (a full disk, a removed or read-only folder) is one FluxKleinError and leaves no file.
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        return _link_to_free_name(tmp, path, first)
    except OSError as e:
        raise FluxKleinError(f"cannot write {path} ({e.strerror}); nothing was written") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# --- whole folders, crash-safe ------------------------------------------------------------------------


def check_disk_space(output: Path, needed: int, what: str = "the output") -> None:
    """Refuse before writing when the volume of `output` lacks `needed` bytes (plus 1 % + 64 MB)."""
    probe = output.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed * 1.01 + (64 << 20):
        raise FluxKleinError(
            f"not enough disk space for {output}: {what} needs about {needed / 1e9:.2f} GB "
            f"and {free / 1e9:.2f} GB are free; free some space or choose another --output"
        )


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _writer_alive(folder: Path) -> bool:
    try:
        return pid_alive(int((folder / TMP_MARKER).read_text().strip()))
    except (OSError, ValueError):
        return False


def remove_stale_temporaries(output: Path) -> None:
    """Remove `<output>.tmp-XXXXXXXX` folders left by an earlier run that was killed (SIGKILL, power loss).

    Only folders that are ours are removed: empty ones, and ones whose marker file names a process
    that no longer runs (a write still running keeps its folder).
    """
    for cand in output.parent.glob(f"{glob.escape(output.name)}.tmp-*"):
        if not _TMP_NAME.search(cand.name[len(output.name) :]) or cand.is_symlink() or not cand.is_dir():
            continue
        if any(cand.iterdir()) and (not (cand / TMP_MARKER).is_file() or _writer_alive(cand)):
            continue  # not ours, or its writer still runs
        shutil.rmtree(cand, ignore_errors=True)


def _fresh_sibling(output: Path, tag: str) -> Path:
    """Create and return an empty folder `<output>.<tag>-XXXXXXXX` next to `output` (umask permissions)."""
    while True:
        path = output.with_name(f"{output.name}.{tag}-{secrets.token_hex(4)}")
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            return path


def _move_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished folder to `output`; an existing output is moved aside first and deleted
    only once the new one is in place (restored if the rename fails)."""
    if not output.exists():
        os.rename(tmp, output)
        return
    old = _fresh_sibling(output, "old")
    os.rmdir(old)
    os.rename(output, old)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') bytes to the disk, so a power loss cannot undo a rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def folder_transaction(output: Path, durable: bool = False) -> Iterator[Path]:
    """Write a folder whole or not at all: yields an empty `<output>.tmp-XXXXXXXX` next to `output`,
    renamed to `output` when the block ends (an existing `output` is replaced only then); on any error
    or interruption the temporary folder is removed and `output` is as it was. Folders of earlier
    writers that were killed are cleaned up first (only ours, see `remove_stale_temporaries`).
    `durable`: the files are flushed to the disk before the rename, and the rename after it."""
    if output.parent.exists() and not output.parent.is_dir():
        raise FluxKleinError(f"{output}: {output.parent} is a file, not a folder; choose another path")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(output)
        tmp = _fresh_sibling(output, "tmp")
    except OSError as e:
        raise FluxKleinError(f"cannot write next to {output} ({e.strerror}); choose another path") from None
    try:
        # Marks the folder as ours while it is being written: a later run removes it if this process is gone.
        (tmp / TMP_MARKER).write_text(f"{os.getpid()}\n")
        yield tmp
        (tmp / TMP_MARKER).unlink()
        if durable:
            for f in tmp.iterdir():
                fsync_path(f)
        _move_into_place(tmp, output)
        if durable:
            fsync_path(output.parent)
    except BaseException:  # also KeyboardInterrupt: never leave a partial folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
