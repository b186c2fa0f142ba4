"""Prompt embeddings cached on disk, so that a prompt seen before never loads the text encoder.

An entry is the (1, 512, C) embeddings of one prompt, stored bit for bit in the dtype they were
produced in. Its key is a digest of everything that decides those numbers:

- the text encoder's weight files: resolved path, size, mtime_ns and a digest of each file's
  safetensors header (tens of KB that name every tensor, its dtype, shape and offsets; never the
  gigabytes behind it). Header digests are remembered in the cache folder under the file's full
  stat identity (device, inode, size, mtime_ns, ctime_ns): while a file is untouched its header
  is not read again, so a run whose prompts are all cached opens none of the encoder's files.
  Any rewrite or replacement of a file changes its ctime (which nobody can set), so its header
  is read again;
- the chat template text, the max length and the exact prompt;
- `settings`: whatever else changes the numbers (dtype, quantization of the encoder), plus the
  versions of MLX and of this package, since a release may compute differently.

Entries live in the `embeddings/` subfolder of `default_folder()`. Deleting the folder clears the
cache; nothing else refers to it.

Robustness, by design rather than by luck:
- an entry is written to a temporary file in the same folder and renamed into place
  (`files.write_replacing`), so readers see a whole entry or none; two processes writing the same
  entry each rename a whole file, the last one wins and both are valid;
- every entry carries its key and a digest of its bytes: a damaged, truncated or foreign file is
  ignored (and removed), never used, never a traceback; the next `put` writes it again;
- bounded: least recently used entries (a hit refreshes the mtime) are removed before a write so
  that the entries, the one being written included, stay within `max_bytes`, and again after
  the rename in case another process wrote meanwhile;
- a folder that cannot be written (read-only, full, no permission) turns writing off with one
  `CacheWarning` (the library never prints); reading what is there still works, and a run never
  fails because of the cache.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import __version__
from ..errors import FluxKleinError
from ..models.tokenizer import MAX_LENGTH, chat_template_source
from .files import is_temporary_file, write_replacing
from .weights import SAFETENSORS_DTYPES, safetensors_header_bytes

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB: ~130 klein-4B prompts in bf16 (7.9 MB each), ~80 for klein-9B
ENTRY_FORMAT = "flux_klein_mlx.embeddings"
KEY_VERSION = 1  # bump when the key's recipe or the entry layout changes
SUBFOLDER = "embeddings"
HEADERS_FILE = "headers.json"  # stat identity -> header digest of the encoder's weight files
MAX_REMEMBERED_HEADERS = 256
STALE_TEMP_SECONDS = 3600  # a temporary file this old belongs to a writer that died

# safetensors name -> dtype of the embeddings an entry may hold, and the unsigned integer of the same
# width that carries their bits.
_BY_NAME = {SAFETENSORS_DTYPES[d]: d for d in (mx.float32, mx.bfloat16, mx.float16)}
_CARRIER = {2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32)}


class CacheWarning(UserWarning):
    """The prompt cache could not do something (it then does less; the run goes on)."""


def default_folder(env: Mapping[str, str] | None = None) -> Path:
    """The package's cache folder: `$FLUX_KLEIN_CACHE`, else `$XDG_CACHE_HOME/flux_klein_mlx`,
    else `~/.cache/flux_klein_mlx`. (The XDG spec says a relative `XDG_CACHE_HOME` is ignored.)"""
    env = os.environ if env is None else env
    if env.get("FLUX_KLEIN_CACHE"):
        return Path(env["FLUX_KLEIN_CACHE"]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "flux_klein_mlx"
    home = env.get("HOME")
    return (Path(home) if home else Path.home()) / ".cache" / "flux_klein_mlx"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (K, M, G, T: powers of 1000; any case)"


def parse_size(text: str | int) -> int:
    """`--cache-size` text ("1GB", "500M", "2GiB", "0", 1000000) -> bytes; 0 turns caching off."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise FluxKleinError(
            f"cache size must be a number of bytes with an optional unit (e.g. 1GB, 500MB, 0 for none), not {text!r}"
            + (f"; the units are {UNIT_NAMES}" if m else "")
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Entry(NamedTuple):
    path: Path
    size: int
    mtime_ns: int


class EmbeddingCache:
    """Prompt embeddings on disk under `folder`, at most `max_bytes` of entries, LRU.

    A cache of another kind of value (the upsampler's captions: `upsample/cache.py`) keeps these rules and
    changes only its entries: `SUFFIX`, `encode` and `decode`.

    cache = EmbeddingCache.open_default()
    key = cache.key(info.files["text_encoder"], template=..., max_length=512, prompt=p,
                    settings={"dtype": "bfloat16", "quantize": None})
    emb = cache.get(key)              # (1, 512, C) mx.array, bit-identical, or None
    if emb is None: cache.put(key, encode(p))
    """

    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise FluxKleinError(f"the cache size must be a whole number of bytes >= 0, not {max_bytes!r}")
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.writable = max_bytes > 0  # turned off (with one warning) at the first failed write
        self.said_too_small = False  # whether an entry over `max_bytes` was said (once)
        self._headers: dict[str, str] | None = None  # the remembered header digests, loaded lazily

    SUFFIX = ".safetensors"  # an entry's file name is its key and this

    def encode(self, value, key: str) -> list[bytes]:
        """An entry's bytes (in parts) for `value` under `key`."""
        return encode_entry(value, key)

    def decode(self, blob: bytes, key: str):
        """The value of an entry's bytes, or None when anything about them is wrong."""
        return decode_entry(blob, key)

    @classmethod
    def open_default(cls, max_bytes: int = DEFAULT_MAX_BYTES, env: Mapping[str, str] | None = None) -> EmbeddingCache:
        return cls(default_folder(env) / SUBFOLDER, max_bytes)

    # ---- keys -----------------------------------------------------------------------------------

    def key(
        self,
        weight_files: Sequence[str | Path],
        *,
        template: str,
        max_length: int,
        prompt: str,
        settings: Mapping | None = None,
    ) -> str:
        """The entry name (64 hex digits) for one prompt encoded by the encoder in `weight_files`;
        `template` is the chat template text, `settings` the rest (JSON-able): see the module docstring."""
        return self.entry_key(
            weight_files, template=template, max_length=int(max_length), prompt=prompt, settings=dict(settings or {})
        )

    def entry_key(self, weight_files: Sequence[str | Path], **facts) -> str:
        """The entry name (64 hex digits) of what the model in `weight_files` computes from `facts` (JSON-able:
        the input and whatever else decides the numbers), under the rules of `key` (the files' identity, the
        versions). The trainer's latent cache (train/data/latents.py) keys its VAE latents with it."""
        recipe = {
            "version": KEY_VERSION,
            "encoder": [self._file_identity(Path(f)) for f in weight_files],
            **facts,
            "mlx": getattr(mx, "__version__", "?"),
            "flux_klein_mlx": __version__,
        }
        blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _file_identity(self, path: Path) -> dict:
        resolved = path.resolve()
        st = resolved.stat()  # a missing file raises here, as loading it would
        stat_id = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{resolved}"
        headers = self._remembered_headers()
        digest = headers.get(stat_id)
        if digest is None:
            try:
                digest = hashlib.blake2b(safetensors_header_bytes(resolved), digest_size=16).hexdigest()
            except (OSError, ValueError):
                digest = "unreadable"  # loading will say what is wrong; this key just never matches a good one
            else:
                headers[stat_id] = digest
                while len(headers) > MAX_REMEMBERED_HEADERS:  # oldest first (insertion order)
                    headers.pop(next(iter(headers)))
                if self.writable:
                    self._write_atomic(self.folder / HEADERS_FILE, [json.dumps(headers).encode()])
        return {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header": digest}

    def _remembered_headers(self) -> dict[str, str]:
        if self._headers is None:
            try:
                data = json.loads((self.folder / HEADERS_FILE).read_text())
                ok = isinstance(data, dict) and all(isinstance(v, str) for v in data.values())
                self._headers = data if ok else {}
            except (OSError, ValueError, UnicodeDecodeError):
                self._headers = {}  # none yet, or damaged: digests are recomputed
        return self._headers

    # ---- entries --------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.folder / f"{key}{self.SUFFIX}"

    def get(self, key: str) -> mx.array | None:
        """The stored embeddings for `key` (same dtype and bits as stored), or None.

        A damaged entry is removed and reported as a miss; a hit marks the entry recently used."""
        path = self.path_of(key)
        try:
            array = self.decode(path.read_bytes(), key)
        except OSError:
            return None
        if array is None:
            _remove(path)
            return None
        with contextlib.suppress(OSError):  # a read-only cache still serves its entries
            os.utime(path)  # LRU: a hit is a use
        return array

    def put(self, key: str, embeddings: mx.array) -> bool:
        """Store `embeddings` (evaluated here) under `key`; True when written. Never raises for
        I/O: a folder that cannot take the entry turns writing off with one CacheWarning."""
        path = self.path_of(key)
        parts = self.encode(embeddings, key)
        size = sum(len(p) for p in parts)
        if self.writable and size > self.max_bytes:  # a bound under one entry stores nothing: said once
            if not self.said_too_small:
                warnings.warn(
                    f"the prompt cache stores nothing: its bound, --cache-size {self.max_bytes} bytes, is smaller than "
                    f"one prompt's embeddings ({size} bytes); give a size of at least that (the default is 1GiB), or 0 "
                    "to turn the cache off",
                    CacheWarning,
                    stacklevel=2,
                )
            self.said_too_small = True
            return False
        if not self.writable:
            return False
        self.evict(room=size, keep=path)
        if not self._write_atomic(path, parts):
            return False
        self.evict(room=0, keep=path)  # another process may have written meanwhile
        return True

    def entries(self) -> list[_Entry]:
        """The entries on disk, least recently used first."""
        out = []
        scan = []
        with contextlib.suppress(OSError):  # no folder yet
            scan = list(os.scandir(self.folder))
        for e in scan:
            with contextlib.suppress(OSError):  # removed by another process meanwhile
                if e.name.endswith(self.SUFFIX) and not e.name.startswith("."):
                    st = e.stat()
                    out.append(_Entry(Path(e.path), st.st_size, st.st_mtime_ns))
                elif is_temporary_file(e.name) and time.time() - e.stat().st_mtime > STALE_TEMP_SECONDS:
                    os.unlink(e.path)  # a temporary file of a writer that died
        return sorted(out, key=lambda e: (e.mtime_ns, e.path.name))

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def evict(self, room: int = 0, keep: Path | None = None) -> None:
        """Remove least recently used entries until the rest plus `room` bytes fit `max_bytes`."""
        entries = self.entries()
        total = sum(e.size for e in entries if e.path != keep)
        for e in entries:
            if total + room <= self.max_bytes:
                break
            if e.path != keep and _remove(e.path):  # `keep` is being replaced: its old size is not counted above
                total -= e.size

    def clear(self) -> None:
        """Remove every entry (and the remembered header digests)."""
        for e in self.entries():
            _remove(e.path)
        _remove(self.folder / HEADERS_FILE)
        self._headers = None

    # ---- writing --------------------------------------------------------------------------------

    def _write_atomic(self, path: Path, parts: Iterable[bytes]) -> bool:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                f.writelines(parts)

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_replacing(path, write)
            return True
        except OSError as e:
            if self.writable:  # the first failure turns writing off, with one warning
                self.writable = False
                why = {
                    errno.ENOSPC: "the disk is full",
                    errno.EDQUOT: "the disk quota is exceeded",
                    errno.EROFS: "it is on a read-only file system",
                }.get(e.errno, e.strerror or type(e).__name__)
                warnings.warn(
                    f"prompt cache off for this run: cannot write to {self.folder} ({why}); prompts are "
                    "encoded every time (free space, set FLUX_KLEIN_CACHE to a writable folder, or turn the "
                    "cache off)",
                    CacheWarning,
                    stacklevel=2,
                )
            return False


# ---- the entry format: a safetensors file with one tensor and its key and digest ----------------


def encode_entry(embeddings: mx.array, key: str) -> list[bytes]:
    """(header, data) of an entry: safetensors layout, one tensor "embeddings", the key and a
    blake2b digest of the data in `__metadata__` (so any safetensors reader can open it)."""
    if embeddings.dtype not in _BY_NAME.values():
        raise TypeError(f"embeddings must be float32, bfloat16 or float16, not {embeddings.dtype}")
    mx.eval(embeddings)
    data = np.ascontiguousarray(np.asarray(embeddings.view(_CARRIER[embeddings.dtype.size][0]))).tobytes()
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    header = {
        "__metadata__": {"format": ENTRY_FORMAT, "key": key, "blake2b": digest},
        "embeddings": {
            "dtype": SAFETENSORS_DTYPES[embeddings.dtype],
            "shape": list(embeddings.shape),
            "data_offsets": [0, len(data)],
        },
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    return [len(blob).to_bytes(8, "little") + blob, data]


def decode_entry(blob: bytes, key: str) -> mx.array | None:
    """The array of an entry's bytes, or None when anything about it is wrong."""
    try:
        n = int.from_bytes(blob[:8], "little")
        if not 0 < n <= len(blob) - 8:
            return None
        header = json.loads(blob[8 : 8 + n])
        meta = header["__metadata__"]
        entry = header["embeddings"]
        dtype = _BY_NAME[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        lo, hi = (int(x) for x in entry["data_offsets"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    data = memoryview(blob)[8 + n :]
    if (
        meta.get("format") != ENTRY_FORMAT
        or meta.get("key") != key
        or (lo, hi) != (0, len(data))
        or int(np.prod(shape)) * dtype.size != len(data)
        or hashlib.blake2b(data, digest_size=16).hexdigest() != meta.get("blake2b")
    ):
        return None
    return mx.array(np.frombuffer(data, dtype=_CARRIER[dtype.size][1]).reshape(shape)).view(dtype)


def _remove(path: Path) -> bool:
    """Remove a file; True when it is gone (also when someone else removed it first)."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError:
        return False


# ---- the pipeline's use ------------------------------------------------------------------------------


def open_cache(cache, size: int | str = DEFAULT_MAX_BYTES) -> EmbeddingCache | None:
    """`load`'s `cache=` (True, False or an EmbeddingCache) and `cache_size=` -> the cache, or None (off)."""
    if isinstance(cache, EmbeddingCache):
        return cache
    if not isinstance(cache, bool):
        raise FluxKleinError(f"cache must be True, False or an EmbeddingCache, not {cache!r}")
    max_bytes = parse_size(size)
    return EmbeddingCache.open_default(max_bytes) if cache and max_bytes > 0 else None


def prompt_keys(
    cache: EmbeddingCache,
    encoder_files: Sequence[str | Path],
    *,
    tokenizer: str | Path,
    prompts: Sequence[str],
    settings: Mapping,
) -> dict[str, str | None]:
    """prompt -> key for a model's text encoder (`encoder_files`), its tokenizer folder's chat template
    (read without building the tokenizer), the 512-token length and `settings` (dtype, quantization).

    A weight file that cannot even be stat'ed gives None (not cached): the encoder's load then says
    what is wrong."""
    template = chat_template_source(tokenizer)
    try:
        return {
            p: cache.key(encoder_files, template=template, max_length=MAX_LENGTH, prompt=p, settings=settings)
            for p in prompts
        }
    except OSError:
        return {p: None for p in prompts}


def cached_embeddings(
    cache: EmbeddingCache | None, keys: Mapping[str, str | None], encode: Callable[[list[str]], list[mx.array]]
) -> dict[str, mx.array]:
    """prompt -> (1, L, C) embeddings for every prompt in `keys` (prompt -> cache key, None: not cached).

    Cached prompts are read; the others are encoded by `encode(missing)` -> one (1, L, C) per prompt,
    in one call (only then does the caller load its text encoder), and stored. `cache=None` encodes
    them all.
    """
    stored = {p: cache.get(k) for p, k in keys.items() if k is not None} if cache is not None else {}
    found = {p: hit for p, hit in stored.items() if hit is not None}
    missing = [p for p in keys if p not in found]
    if missing:
        emb = encode(missing)
        for i, prompt in enumerate(missing):
            found[prompt] = emb[i]
            if cache is not None and keys[prompt] is not None:
                cache.put(keys[prompt], found[prompt])
    return found
