"""Which of some files a block of code opens, for tests that say "never opens".

On Linux the kernel reports every open (inotify IN_OPEN), whoever makes it: Python, or MLX's C++
loader. Elsewhere the Python-level doors are watched instead (`open`, `io.open`, `os.open` and
`mx.load`, through which our loaders read every safetensors file).
"""

from __future__ import annotations

import builtins
import ctypes
import io
import os
import struct
import sys
from pathlib import Path

import mlx.core as mx

IN_OPEN = 0x20
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class FileOpens:
    """`with FileOpens(paths, monkeypatch) as opens: ...`, then `opens.opened`: the paths opened."""

    def __init__(self, paths, monkeypatch):
        self.paths = [Path(p).resolve() for p in paths]
        self.monkeypatch = monkeypatch
        self.opened: list[Path] = []
        self._fd = None
        self._watches: dict[int, Path] = {}

    def __enter__(self) -> FileOpens:
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            self._fd = libc.inotify_init1(os.O_NONBLOCK)
            for p in self.paths:
                self._watches[libc.inotify_add_watch(self._fd, str(p).encode(), IN_OPEN)] = p
            assert self._fd >= 0 and all(w >= 0 for w in self._watches), "inotify unavailable"
        else:
            self._patch_python()
        return self

    def _patch_python(self) -> None:
        watched = {str(p) for p in self.paths}

        def recorder(real):
            def wrapper(file, *a, **k):
                if isinstance(file, (str, os.PathLike)) and str(Path(file).resolve()) in watched:
                    self.opened.append(Path(file).resolve())
                return real(file, *a, **k)

            return wrapper

        for owner, name in ((builtins, "open"), (io, "open"), (os, "open"), (mx, "load")):
            self.monkeypatch.setattr(owner, name, recorder(getattr(owner, name)))

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            while True:
                try:
                    data = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    break
                offset = 0
                while offset < len(data):
                    wd, mask, _, length = _EVENT.unpack_from(data, offset)
                    offset += _EVENT.size + length
                    if mask & IN_OPEN:
                        self.opened.append(self._watches[wd])
        finally:
            os.close(self._fd)
