"""Reading a component's weights before it is loaded, so that its load finds them in the page cache.

MLX loads a safetensors tensor lazily: when it is first evaluated, `pread()` copies its bytes
from the file into the array's own buffer (mlx `io/load.cpp`, `ParallelFileReader`). Our loader
evaluates layer by layer, so a cold load is a long series of synchronous reads in model order,
during which nothing computes. `ReadAhead` reads the byte ranges the load will read, in file
order, on background threads, while something else computes (the text encoder encoding, the
last denoising steps), so that the load's preads find the bytes in the OS page cache and become
memory copies. Python threads suffice: `mx.eval` and file reads both release the GIL.

Why a read-ahead cannot double what is resident (page cache vs MLX arrays):
- It allocates no MLX array and keeps nothing: each of its `readers` (4) threads has one reused
  buffer of `chunk_bytes` (8 MiB), into which each chunk is read and overwritten. The process's
  own memory (MLX's allocations, `mx.get_peak_memory()`, anonymous RSS) grows by those 32 MiB only.
- What it fills is the page cache: clean, file-backed pages owned by the kernel. The load itself
  reads through the same page cache (buffered `pread`), so the very same pages are cached after
  a load with or without read-ahead; the read-ahead only changes *when* they arrive. Both with and
  without it, a loaded component exists once as MLX arrays plus, transiently, as reclaimable
  cache pages; that is the existing cost of buffered loading, not a new copy.
- Clean cache pages are dropped by the kernel under memory pressure without any write-back or
  swap. The only risk of reading ahead too early is that the pages are evicted before the load
  (the read was wasted; the load reads again): a cost in time, never in peak memory.

Measuring it (benchmarks/cold_start.py, with `bench.measure`'s page-cache drop and storage byte
counts): the same cold load with and without read-ahead, each in a fresh process reporting
`mx.get_peak_memory()` over the load and the peak RSS (VmHWM / ru_maxrss); they must agree to
within the read buffers (on the Linux VM: identical MLX peak, RSS +4 MB). The page cache's share is
visible separately (`free`, or Activity Monitor's "Cached Files") and is the same after both.

The library never prints: a failed read-ahead is a warning when it is stopped or waited for.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..models.text_encoder import keeps_key
from .vae_source import is_decoder_key
from .weights import safetensors_tensor_spans

CHUNK_BYTES = 8 << 20
READERS = 4  # requests in flight (MLX's loader uses a pool of 4 too)
MERGE_GAP = 1 << 20  # reading a gap this small is cheaper than skipping it (one sequential stream)


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of one file."""

    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def merge_spans(spans: Iterable[Span], gap: int = MERGE_GAP) -> list[Span]:
    """Sorted by file and offset; spans of one file closer than `gap` bytes joined into one."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: (str(s.path), s.start)):
        if out and out[-1].path == s.path and s.start - out[-1].end <= gap:
            out[-1] = Span(s.path, out[-1].start, max(out[-1].end, s.end))
        else:
            out.append(s)
    return out


def tensor_spans(
    files: Iterable[str | Path], keep: Callable[[str], bool] | None = None, merge: bool = True
) -> list[Span]:
    """The data of the tensors `keep(name)` selects (all by default), from the files' headers;
    merged (`merge_spans`) for reading, or one span per tensor."""
    spans = [
        Span(Path(f), start, end)
        for f in files
        for name, (start, end) in safetensors_tensor_spans(f).items()
        if keep is None or keep(name)
    ]
    return merge_spans(spans) if merge else spans


def component_spans(info, name: str, merge: bool = True) -> list[Span]:
    """What `components.load_component(info, name)` reads: every tensor of the component's files but
    those it drops unread (the text encoder's layers above 27, final norm and LM head; the VAE's
    BatchNorm step counter)."""
    files = info.files.get(name, [])
    if name != "vae":
        return tensor_spans(files, keeps_key if name == "text_encoder" else None, merge)
    used = lambda k: not k.endswith("num_batches_tracked")  # noqa: E731
    decoder = getattr(info, "decoder_files", None) or []
    # A decoder-only `vae=`: the model's VAE without its decoder, and the other file's decoder.
    spans = tensor_spans(files, lambda k: used(k) and not (decoder and is_decoder_key(k)), False)
    spans += tensor_spans(decoder, lambda k: used(k) and is_decoder_key(k), False)
    return merge_spans(spans) if merge else spans


def limit_spans(spans: Sequence[Span], max_bytes: int) -> list[Span]:
    """The first `max_bytes` of `spans`, in their order (the last one cut short)."""
    out = []
    left = max(0, int(max_bytes))
    for s in spans:
        if left <= 0:
            break
        out.append(s if s.nbytes <= left else Span(s.path, s.start, s.start + left))
        left -= out[-1].nbytes
    return out


# ---- reading ----------------------------------------------------------------------------------------


@dataclass
class ReadStats:
    bytes: int = 0
    seconds: float = 0.0
    spans: int = 0
    error: str | None = None  # why it stopped early, if it did
    stopped: bool = False  # stopped on request before the end

    @property
    def rate(self) -> float:
        """Bytes per second (0 when nothing was read)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def read_spans(
    spans: Sequence[Span], chunk_bytes: int = CHUNK_BYTES, stop: threading.Event | None = None, readers: int = READERS
) -> ReadStats:
    """Read `spans` with `readers` threads taking the next chunk in file order, each into its own
    reused buffer; the bytes are dropped, the page cache keeps them. Several requests in flight
    (as MLX's own loader issues) are what an SSD needs for its rate: on our development VM one reader
    got 0.8-1.4 GB/s, four 1.1-2.3 GB/s, and posix_fadvise(WILLNEED) made one reader slower.

    Errors end the read and are returned in `stats.error`, never raised.
    """
    stats = ReadStats(spans=len(spans))
    lock = threading.Lock()
    fds = {}
    failures = []
    # (file, offset, length) of every chunk, in file order
    chunks = ((s.path, o, min(chunk_bytes, s.end - o)) for s in spans for o in range(s.start, s.end, chunk_bytes))
    stop = stop or threading.Event()
    t0 = time.perf_counter()

    def reader() -> None:
        view = memoryview(bytearray(chunk_bytes))
        while not stop.is_set():
            with lock:
                chunk = next(chunks, None)
            if chunk is None:
                return
            path, offset, length = chunk
            try:
                n = _read_exactly(fds[path], view[:length], offset, path)
            except Exception as e:  # a reader must never die silently: reported in stats.error
                failures.append(e)
                stop.set()
                return
            with lock:
                stats.bytes += n

    try:
        for path in dict.fromkeys(s.path for s in spans):
            fds[path] = os.open(path, os.O_RDONLY)
        threads = [
            threading.Thread(target=reader, name="flux_klein_mlx-read", daemon=True) for _ in range(max(1, readers))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except OSError as e:
        failures.append(e)
    finally:
        for fd in fds.values():
            os.close(fd)
    if failures:
        e = failures[0]
        stats.error = f"{getattr(e, 'filename', None) or ''}: {getattr(e, 'strerror', None) or e}".lstrip(": ")
    stats.stopped = stop.is_set() and not failures and stats.bytes < sum(s.nbytes for s in spans)
    stats.seconds = time.perf_counter() - t0
    return stats


def _read_exactly(fd: int, view: memoryview, offset: int, path: Path) -> int:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):  # straight into the buffer, no bytes object per chunk
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            data = os.pread(fd, len(view) - done, offset + done)
            n = len(data)
            view[done : done + n] = data
        if n <= 0:
            raise OSError(f"{path} ended at byte {offset + done}, before {offset + len(view)}")
        done += n
    return done


class ReadAhead:
    """Read spans (or whole files) on a background thread; see the module docstring.

        ahead = ReadAhead.of_component(info, "transformer").start()
        ...                              # the text encoder encodes meanwhile
        ahead.stop()                     # or wait(): before the load, which reads the rest itself
        model = load_component(info, "transformer")

    `spans` may be a callable returning them: it then runs on the thread too (header parsing).
    Nothing is raised or printed: a failed read ends the thread, and `stop()`/`wait()` warn once.
    """

    def __init__(
        self,
        spans: Sequence[Span] | Callable[[], Sequence[Span]],
        chunk_bytes: int = CHUNK_BYTES,
        readers: int = READERS,
    ):
        self._spans = spans
        self.chunk_bytes = chunk_bytes
        self.readers = readers
        self.stats = ReadStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flux_klein_mlx-readahead", daemon=True)
        self._reported = False

    @classmethod
    def of_files(cls, files: Iterable[str | Path], **kwargs) -> ReadAhead:
        files = [Path(f) for f in files]
        return cls(lambda: [Span(f, 0, f.stat().st_size) for f in files], **kwargs)

    @classmethod
    def of_component(cls, info, name: str, **kwargs) -> ReadAhead:
        return cls(lambda: component_spans(info, name), **kwargs)

    def start(self) -> ReadAhead:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            spans = self._spans() if callable(self._spans) else self._spans
            self.stats = read_spans(list(spans), self.chunk_bytes, self._stop, self.readers)
        except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged header: the load will say so
            self.stats = ReadStats(error=str(e).splitlines()[0][:200] or type(e).__name__)

    @property
    def done(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> ReadStats:
        """Wait until everything is read (or `timeout` seconds); the stats so far."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self.done and self.stats.error and not self._reported:
            self._reported = True
            warnings.warn(
                f"reading ahead stopped early ({self.stats.error}); loading reads the files itself", stacklevel=2
            )
        return self.stats

    def stop(self) -> ReadStats:
        """Stop after the current chunk and wait for the thread (at most one chunk's read)."""
        self._stop.set()
        return self.wait()

    def __enter__(self) -> ReadAhead:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Prefetch:
    """The read-aheads of one model's components, for a pipeline: at most one per component, started
    before its load (`start`), stopped once the load has run (`finish`). See the module docstring for
    why reading ahead cannot raise the process's peak memory.

    What it reads is capped so that the pages are likely still cached when the load reads them: at
    most `SHARE` of the RAM, less the memory the process already holds (`resident`: the models
    loaded now) and less the component's own size (its arrays will be resident beside the pages).
    Where that leaves nothing (a 16 GB Mac holding the bf16 text encoder while a 7.75 GB bf16
    transformer is next), nothing is read ahead: the pages would be evicted before their use, a
    wasted read competing with the load's own.
    """

    SHARE = 0.75  # the rest is the system's and other programs'

    def __init__(self, info, enabled: bool = True):
        self.info = info
        self.enabled = enabled
        self.running: dict[str, ReadAhead] = {}
        self.finished: dict[str, ReadStats] = {}  # component -> its last read-ahead's stats

    def start(self, name: str, resident: int = 0) -> bool:
        """Start reading `name`'s files ahead unless disabled, running, or without files; True if started."""
        files = (getattr(self.info, "files", None) or {}).get(name)
        if not self.enabled or name in self.running or not files:
            return False

        def spans() -> list[Span]:  # on the reading thread: the headers are parsed there
            wanted = component_spans(self.info, name)
            try:
                ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):  # the system does not say how much RAM there is
                return wanted
            return limit_spans(wanted, self.SHARE * ram - resident - sum(s.nbytes for s in wanted))

        self.running[name] = ReadAhead(spans).start()
        return True

    def finish(self, name: str) -> ReadStats | None:
        """Stop `name`'s read-ahead (at most one chunk's wait) once its load has run; its stats."""
        if (ahead := self.running.pop(name, None)) is None:
            return None
        self.finished[name] = ahead.stop()
        return self.finished[name]
