"""What the cold-start benchmarks measure around a load: page cache, disk rate, storage bytes per stage.

Cold starts. `drop_from_page_cache(files)` evicts files with `posix_fadvise(POSIX_FADV_DONTNEED)`
on Linux (no root needed; clean pages only, which weight files are). macOS has no per-file
eviction for an unprivileged process: `sudo purge` empties the whole cache, and `F_NOCACHE` only
affects reads through the descriptor that sets it, so a Mac cold start is approximated by
`sudo purge` before the run, or by a reboot. `sequential_read_rate` measures the disk's rate on
the same files, and `storage_read_bytes` what this process fetched from storage (where it cannot
say, callers report `bytes_to_load`, the bytes the headers say the load reads, naming it as such).

Only the benchmarks (`benchmark --cold`, benchmarks/cold_start.py) use this; the pipeline's own
reading ahead is `readahead.Prefetch`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..storage.readahead import ReadStats, Span, component_spans, read_spans


def bytes_to_load(info, name: str) -> int:
    """The bytes a load of `name` reads from its files, from their headers (no tensor is read)."""
    return sum(s.nbytes for s in component_spans(info, name, merge=False))


def sequential_read_rate(spans: Sequence[Span]) -> ReadStats:
    """Read `spans` as `ReadAhead` does, for its rate: cold (after `drop_from_page_cache`) this is the
    disk's rate on these very files; warm, the page cache's copy rate."""
    return read_spans(spans)


def drop_from_page_cache(files: Iterable[str | Path]) -> str:
    """Evict `files` from the OS page cache; returns how (or why not), as one line for a report."""
    files = [Path(f) for f in files]
    if not hasattr(os, "posix_fadvise"):
        how = "sudo purge" if sys.platform == "darwin" else "dropping the page cache as root"
        return (
            f"not dropped: no per-file eviction on {sys.platform} without privileges "
            f"(approximate a cold start with {how})"
        )
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # DONTNEED drops clean pages only: a file just written may still be dirty
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return f"dropped {len(files)} file(s) with posix_fadvise(POSIX_FADV_DONTNEED)"


def storage_read_bytes() -> int | None:
    """Bytes this process (all its threads) has caused to be fetched from storage so far: Linux's
    `/proc/self/io` `read_bytes` (page-cache hits do not count). None where there is no such count."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return None


class StageMeter:
    """Wall time and storage bytes per stage of a run: `mark(stage)` closes the stage begun at the
    previous mark (or at construction). `source` says where the bytes come from."""

    def __init__(self):
        self.stages: dict[str, dict] = {}
        self._t = time.perf_counter()
        self._b = storage_read_bytes()

    @property
    def source(self) -> str:
        return "/proc/self/io read_bytes" if self._b is not None else "unavailable on this system"

    def mark(self, stage: str) -> dict:
        t, b = time.perf_counter(), storage_read_bytes()
        entry = {"seconds": t - self._t, "read_bytes": (b - self._b) if b is not None and self._b is not None else None}
        self.stages[stage] = entry
        self._t = t
        self._b = b
        return entry


def limit_seconds(read_bytes: float, read_rate: float, flops: float, peak_flops: float) -> float:
    """The physical floor of a run: the bytes that must be read at the disk's sequential rate
    (bytes/s) plus the FLOPs that must be done at the chip's rate (FLOP/s)."""
    return read_bytes / read_rate + flops / peak_flops
