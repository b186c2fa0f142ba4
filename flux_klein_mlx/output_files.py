"""Output files that are checked before the work and never written twice.

`check_output_file` is called before any model runs, so that a read-only folder, a missing one,
a parent that is a file or a name too long for the file system is reported in one line instead
of losing a finished image. `write_exclusive` writes into a temporary file in the same folder and
hard-links it to the first free name: a name is never replaced, two processes never write the
same file, and a reader never sees half a file.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Callable

from .errors import FluxKleinError

# Room left in a file name for the "-N" that `free_name` may add.
_SUFFIX_ROOM = 8


def check_output_file(path: str | Path, option: str = "--output") -> Path:
    """Raise FluxKleinError unless a new file can be created at `path` (or next to it, if taken)."""
    path = Path(path).expanduser()
    parent = path.parent
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
    try:  # the real test of permissions (read-only folder or volume, ACLs): create and remove a file
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".flux_klein_mlx-probe-"):
            pass
    except OSError as e:
        raise FluxKleinError(
            f"{option} {path}: cannot write in {parent} ({e.strerror}); choose a folder you can write to"
        ) from None
    return path


def free_name(path: Path, n: int) -> Path:
    """`path` for n = 0, else `stem-n.suffix`."""
    return path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")


def write_exclusive(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write a new file at `path`, or at the first free `stem-N.suffix`; never replaces a file.

    `write(tmp)` writes the whole content to `tmp` (a name in the same folder); it is then
    hard-linked to the final name, which fails if the name exists, so a name is taken by exactly
    one writer and is complete when it appears. File systems without hard links get an exclusive
    create and a copy instead. Returns the name written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        n = 0
        while True:
            final = free_name(path, n)
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
                        dst.write(src.read())
                except BaseException:
                    os.unlink(final)  # never a half-written file under the final name
                    raise
                return final
    except OSError as e:
        raise FluxKleinError(f"cannot write {path} ({e.strerror}); nothing was written") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
