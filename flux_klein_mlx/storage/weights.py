"""Reading weight files: the only module that opens safetensors files or talks to the hub.

Loading is lazy: `mx.load` maps a safetensors file and reads a tensor's bytes only when it is
evaluated, so tensors that a caller drops (e.g. Qwen3 layers above 27) are never read.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import FluxKleinError, Notice, first_few
from .files import file_sha256


def read_safetensors(path: str | Path) -> dict[str, mx.array]:
    """Lazily open one safetensors file; a damaged or foreign file raises a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FluxKleinError(f"weight file not found: {path}")
    try:
        return mx.load(str(path))
    except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
        raise FluxKleinError(
            f"{path} is damaged or not a safetensors file ({str(e).splitlines()[0][:120]}); "
            "download or convert it again"
        ) from None


_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def safetensors_table(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    """name -> (dtype, shape) of a safetensors file from its header alone (no tensor is read), and the
    bytes the file needs to hold every tensor the header lists. OSError when the file cannot be read;
    ValueError saying what is wrong with the header ("no valid JSON header", a tensor without offsets)."""
    raw = safetensors_header_bytes(path)
    try:
        header = json.loads(raw)
    except ValueError:  # not JSON (UnicodeDecodeError included)
        header = None
    if not isinstance(header, dict):
        raise ValueError("no valid JSON header")
    header.pop("__metadata__", None)
    tensors = {}
    end = 0
    for name, entry in header.items():
        try:
            dtype, shape, (_, hi) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            end = max(end, int(hi))
        except (TypeError, KeyError, ValueError, IndexError):
            raise ValueError(f"tensor {name!r} has no dtype/shape/offsets") from None
        tensors[name] = (str(dtype), shape)
    return tensors, 8 + len(raw) + end


def check_safetensors_file(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Check one safetensors file from its header alone (no tensor is read): the 8-byte length and
    the JSON header parse, and the file is long enough for every tensor the header lists (a
    truncated download is caught here, not when the tensor is first used). Returns name ->
    (dtype, shape)."""
    path = Path(path)
    if not path.is_file():
        raise FluxKleinError(f"weight file not found: {path}")
    try:
        tensors, needed = safetensors_table(path)
    except OSError as e:
        raise FluxKleinError(f"cannot read {path} ({e.strerror}); check the file's permissions") from None
    except ValueError as e:  # no header, or a tensor without its entries
        raise FluxKleinError(
            f"{path} is damaged or not a safetensors file ({e}); download or convert it again"
        ) from None
    size = path.stat().st_size
    if needed > size:
        raise FluxKleinError(
            f"{path} is truncated: {size} bytes, its header needs {needed}; download or convert it again"
        )
    return tensors


def safetensors_header_bytes(path: str | Path) -> bytes:
    """The raw JSON header of a safetensors file (its first 8 + n bytes, never the tensors), for
    fingerprints: the header names every tensor with its dtype, shape and offsets, so a re-saved
    or re-quantized file has another. Raises OSError when unreadable, ValueError when no header."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or n > _MAX_HEADER:
            raise ValueError(f"{path} has no safetensors header")
        header = f.read(n)
    if len(header) != n:
        raise ValueError(f"{path} is shorter than its safetensors header")
    return header


def safetensors_tensor_spans(path: str | Path) -> dict[str, tuple[int, int]]:
    """name -> (first byte, end byte) of each tensor's data in the file, from the header alone:
    what a lazy load of that tensor will read."""
    raw = safetensors_header_bytes(path)
    header = json.loads(raw)
    base = 8 + len(raw)
    return {
        name: (base + int(entry["data_offsets"][0]), base + int(entry["data_offsets"][1]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


def read_weight_files(files: Iterable[str | Path], keep: Callable[[str], bool] | None = None) -> dict[str, mx.array]:
    """Merge several (sharded) safetensors files into one lazy dict, keeping only `keep(key)`."""
    return {k: v for f in files for k, v in read_safetensors(f).items() if keep is None or keep(k)}


def component_files(folder: str | Path) -> list[Path]:
    """The safetensors files of one component folder (diffusers/transformers layout).

    A `*.safetensors.index.json` names the shards (and only those are read); otherwise every
    `*.safetensors` in the folder is a shard.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FluxKleinError(f"missing folder {folder}: the model snapshot is incomplete")
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        return index_shards(indexes[0], "download it again")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FluxKleinError(f"no .safetensors weights in {folder}: the model snapshot is incomplete")
    return files


def index_shards(index: Path, fix: str) -> list[Path]:
    """The shards a Hugging Face `*.safetensors.index.json` names, each checked to exist; `fix` ends the errors."""
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as e:
        raise FluxKleinError(f"{index} is damaged ({e}); {fix}") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise FluxKleinError(
            f"{index.parent} is incomplete: missing shard(s) {first_few(missing)} named in {index.name}; {fix}"
        )
    return [index.parent / n for n in names]


def read_json(path: str | Path) -> dict:
    """Read a config file, with a clear error when it is missing or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise FluxKleinError(f"missing {path}: the model snapshot is incomplete; download (or convert) it again")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise FluxKleinError(f"{path} is not valid JSON ({e}); download it again") from None


def load_into(model, weights: dict[str, mx.array], what: str, dtype=None) -> None:
    """Strictly load `weights` into `model`: every parameter must be present with its shape.

    `what` names the component for the error message ("transformer", "VAE", ...). Missing and
    unexpected keys are listed (first few) with their count, so a wrong or partial checkpoint
    never loads silently. Floating tensors are cast to `dtype` when given.
    """
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    parts = [
        f"{len(keys)} {kind} ({first_few(keys, 4)})"
        for kind, keys in (("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    if parts:
        raise FluxKleinError(f"{what} weights do not match the model: {'; '.join(parts)}")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise FluxKleinError(
                f"{what} weight {k} has shape {tuple(v.shape)}, the model expects {tuple(expected[k].shape)}"
            )
    if dtype is not None:
        # Floating tensors (incl. quantization scales/biases) take the compute dtype; packed
        # integer weights keep theirs.
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)


# --- writing ---------------------------------------------------------------------------------------

# safetensors dtype names (the one table of them: the prompt cache's entries use it too); the bytes of
# every dtype are written through an unsigned view of equal width.
SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32", mx.float32: "F32",
    mx.uint64: "U64", mx.int64: "I64",
}  # fmt: skip
_UNSIGNED = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def _tensor_bytes(a: mx.array):
    """The evaluated array's bytes in C order, without an extra copy when it is contiguous."""
    import numpy as np

    if a.dtype == mx.bool_:
        a = a.astype(mx.uint8)
    return memoryview(np.ascontiguousarray(np.asarray(a.view(_UNSIGNED[a.dtype.size])))).cast("B")


def save_safetensors_streaming(
    path: str | Path,
    tensors: dict[str, mx.array],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
) -> None:
    """Write `tensors` to one safetensors file, evaluating and writing one tensor at a time.

    The header only needs shapes and dtypes, which lazy arrays know, so the file is written
    sequentially and peak memory stays near the largest tensor (plus whatever it is computed from)
    instead of the whole file, as `mx.save_safetensors` needs. The dict is consumed: each tensor is
    popped before it is evaluated so nothing keeps it alive after it is written. `on_tensor(name,
    nbytes)` is called after each tensor.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "mlx"})}
    offset = 0
    for name, a in tensors.items():
        if a.dtype not in SAFETENSORS_DTYPES:
            raise FluxKleinError(f"cannot store {name}: dtype {a.dtype} has no safetensors equivalent")
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in list(tensors):
            a = tensors.pop(name)  # the last reference: the next one replaces it before its own evaluation
            mx.eval(a)
            f.write(_tensor_bytes(a))
            if on_tensor is not None:
                on_tensor(name, a.nbytes)


def plan_shards(tensors: dict[str, mx.array], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    size = 0
    for name, a in tensors.items():
        if not shards or (size + a.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += a.nbytes
    return shards


def save_safetensors_sharded(
    weights: dict[str, mx.array],
    folder: str | Path,
    *,
    prefix: str,
    max_shard_bytes: int = 5 << 30,
    on_tensor: Callable[[str, int], None] | None = None,
) -> list[Path]:
    """Write `weights` as `prefix.safetensors`, or as `prefix-0000i-of-0000n.safetensors` shards
    plus `prefix.safetensors.index.json` (Hugging Face's index format) when larger than one shard.

    Streams like `save_safetensors_streaming` and consumes `weights`. Returns the files written.
    """
    folder = Path(folder)
    total = sum(a.nbytes for a in weights.values())
    shards = plan_shards(weights, max_shard_bytes) or [[]]  # no tensors: one empty file
    files = []
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        stem = prefix if len(shards) == 1 else f"{prefix}-{i:05d}-of-{len(shards):05d}"
        files.append(folder / f"{stem}.safetensors")
        save_safetensors_streaming(files[-1], {n: weights.pop(n) for n in names}, on_tensor=on_tensor)
        weight_map.update(dict.fromkeys(names, files[-1].name))
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def prefixed_files(folder: str | Path, prefix: str) -> list[Path]:
    """The safetensors files of one component of a converted folder: `prefix.safetensors`, or the
    shards named by `prefix.safetensors.index.json`."""
    folder = Path(folder)
    index = folder / f"{prefix}.safetensors.index.json"
    if index.is_file():
        return index_shards(index, "convert the model again")
    single = folder / f"{prefix}.safetensors"
    if single.is_file():
        return [single]
    raise FluxKleinError(f"{folder} has no {prefix} weights ({single.name}); convert the model again")


# --- the hub ---------------------------------------------------------------------------------------

# What the pipeline reads from a hub repo: the diffusers components, or a converted (MLX) folder.
# The BFL single file at the root of the official repos duplicates transformer/ and is skipped.
HUB_PATTERNS = [
    "model_index.json", "modular_model_index.json", "scheduler/*", "transformer/*", "text_encoder/*", "tokenizer/*",
    "vae/*",
    "config.json", "transformer*.safetensors*", "text_encoder*.safetensors*", "vae.safetensors",
]  # fmt: skip


LARGE_DOWNLOAD = 100 << 20  # bytes: a download at least this big is announced before it starts


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve_model(
    model: str | Path,
    allow_patterns: list[str] = HUB_PATTERNS,
    cache_dir: str | Path | None = None,
    size_hint: Callable[[], int | None] | None = None,
) -> Path:
    """A local folder or file as a Path; otherwise a Hugging Face repo id, downloaded into (or found
    in) the hub cache with `allow_patterns` (default: the files the pipeline needs).

    Offline (HF_HUB_OFFLINE=1) a repo id resolves only when it is already cached. Anything that
    is neither an existing path nor a reachable repo raises FluxKleinError; an unreachable hub is
    told apart from an unknown repo. A large download is announced first (a `Notice`).
    `size_hint()` estimates the download in bytes for the message when the hub cannot be reached.
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    text = str(model)
    if text.startswith((".", "/", "~")) or text.count("/") != 1 or text.endswith(".safetensors"):  # not owner/name
        raise FluxKleinError(
            f"model '{text}' not found: no such folder or file, and it is not a Hugging Face repo id (owner/name)"
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = hub_offline()
    cache = str(cache_dir or constants.HF_HUB_CACHE)  # the folder huggingface_hub downloads into
    if not offline:
        announce_download(text, allow_patterns, cache)
    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=allow_patterns, cache_dir=cache_dir))
    except GatedRepoError:
        raise FluxKleinError(
            f"model '{text}' is gated on Hugging Face: accept its licence on the model page, log in with "
            "`hf auth login`, and retry"
        ) from None
    except RepositoryNotFoundError:
        raise FluxKleinError(
            f"there is no model '{text}' on the Hugging Face hub (or it is private): check the repo id's spelling; "
            "a private repo needs `hf auth login`"
        ) from None
    except LocalEntryNotFoundError as e:
        raise _not_found_locally(text, e, offline=offline, cache=cache, size_hint=size_hint) from None
    except (HFValidationError, EntryNotFoundError, ValueError, OSError) as e:
        raise FluxKleinError(
            f"model '{text}' is neither a local folder nor a downloadable Hugging Face repo id ({type(e).__name__}); "
            "check the path or the repo id, and your network"
        ) from None


def _not_found_locally(text: str, e: Exception, *, offline: bool, cache: str, size_hint) -> FluxKleinError:
    """The one line for a repo that is not cached: offline on purpose, or the hub not reached."""
    if offline:
        return FluxKleinError(
            f"model '{text}' is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: unset it "
            "to download, check the repo id, or give a local folder instead"
        )
    # The hub was not reached (no network, a proxy, the hub down) and the cache lacks the repo.
    size = size_hint and size_hint()
    about = f"about {size / 1e9:.0f} GB, " if size else ""
    why = type(e.__cause__).__name__ if e.__cause__ is not None else "no connection"
    return FluxKleinError(
        f"cannot reach the Hugging Face hub ({why}) to download '{text}' ({about}into {cache}), and no complete "
        "copy is cached there: check your network (proxy, HF_ENDPOINT), or download it elsewhere and give its "
        "folder instead (--model DIR)"
    )


def announce_download(repo: str, patterns: list[str], cache: str) -> None:
    """Say how much is about to be downloaded and where (a `Notice`), when it is large.

    One hub call lists the files with their sizes; the files already cached are not counted. Any
    failure here is left to the download itself, which says what is wrong.
    """
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.utils import filter_repo_objects

    try:
        info = HfApi().model_info(repo, files_metadata=True)
        files = {s.rfilename: s.size or 0 for s in info.siblings or []}
        wanted = filter_repo_objects(list(files), allow_patterns=patterns)
        need = sum(
            files[f]
            for f in wanted
            if not isinstance(try_to_load_from_cache(repo, f, cache_dir=cache, revision=info.sha), str)
        )
    except Exception:  # unreachable, unknown, gated, an older huggingface_hub: the download says it
        return
    if need >= LARGE_DOWNLOAD:
        warnings.warn(
            f"downloading {repo}: {need / 1e9:.1f} GB into {cache} (once; Ctrl-C stops it, "
            "and --model DIR uses a copy you already have)",
            Notice,
            stacklevel=2,
        )


# --- LoRA files ------------------------------------------------------------------------------------


# The safetensors dtypes MLX's loader reads (mlx/io/safetensors.cpp); it refuses F64 and the F8s.
MLX_DTYPES = {"F32", "F16", "BF16", "BOOL", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}


def read_lora_file(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str], str]:
    """One LoRA safetensors file -> (tensors, header metadata, sha256 hex of the file's bytes).

    The tensors are evaluated (LoRAs are small, and the file may be gone or replaced later); a
    missing, damaged or non-safetensors file raises FluxKleinError.
    """
    path = Path(path)
    if not path.is_file():
        raise FluxKleinError(f"LoRA file not found: {path}")
    try:
        header = check_safetensors_file(path)
    except FluxKleinError:
        header = {}  # damaged: mx.load below says so in the LoRA's own words
    unread = next(((k, d) for k, (d, _) in header.items() if d.upper() not in MLX_DTYPES), None)
    if unread:  # a whole file of a type MLX does not load (fp8, float64): not damaged, and said so
        kind = "fp8" if unread[1].upper().startswith("F8") else "float64" if unread[1].upper() == "F64" else "such"
        raise FluxKleinError(
            f"LoRA {path.name} stores {kind} tensors ({unread[1]}, e.g. {unread[0]}), which flux_klein_mlx does not "
            "read; use a bf16, fp16 or fp32 export of it"
        )
    try:
        tensors, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
        mx.eval(tensors)
    except Exception as e:  # mlx words its parse errors itself
        raise FluxKleinError(
            f"LoRA {path.name} is damaged or not a safetensors file ({str(e).splitlines()[0][:120]}); download it again"
        ) from None
    # every door that reads a LoRA (--lora, the server, --init-lora) refuses NaN or inf before it is used
    bad = [k for k, v in tensors.items() if mx.issubdtype(v.dtype, mx.floating) and not mx.all(mx.isfinite(v)).item()]
    if bad:
        raise FluxKleinError(
            f"LoRA {path.name} holds non-finite values (in {bad[0]}); the file is damaged, download it again"
        )
    return tensors, dict(metadata or {}), file_sha256(path)


def resolve_lora(spec: str | Path) -> Path:
    """A LoRA given as a local file, `owner/name` (the repo's single .safetensors) or `owner/name:file.safetensors`.

    Hub files resolve through the Hugging Face cache (offline with HF_HUB_OFFLINE=1 when cached).
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve()
    text = str(spec)
    if not text.strip():
        raise FluxKleinError("a LoRA was given as an empty name; give a .safetensors file or a Hugging Face repo id")
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.safetensors"))
        inside = f"it holds {first_few(found)}" if found else "it holds no LoRA"
        raise FluxKleinError(
            f"LoRA '{text}' is a folder, not a LoRA file ({inside}); give the .safetensors file itself"
        )
    repo, _, filename = text.partition(":")
    if (
        path.exists()
        or text.startswith((".", "/", "~"))
        or repo.count("/") != 1
        or (not filename and text.endswith(".safetensors"))
    ):
        raise FluxKleinError(
            f"LoRA '{text}' not found: no such file, and not a Hugging Face repo id (owner/name[:file])"
        )
    from huggingface_hub import hf_hub_download, list_repo_files, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError

    offline = hub_offline()
    try:
        if filename:
            return Path(hf_hub_download(repo_id=repo, filename=filename))
        if offline:
            folder = Path(snapshot_download(repo_id=repo, allow_patterns=["*.safetensors"]))
            names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.safetensors"))
        else:
            names = sorted(n for n in list_repo_files(repo) if n.endswith(".safetensors"))
        if len(names) != 1:
            listed = first_few(names, 4)
            raise FluxKleinError(
                f"LoRA repo {repo} has {len(names)} .safetensors files ({listed or 'none'}); "
                f"name one as {repo}:FILE.safetensors"
            )
        return Path(hf_hub_download(repo_id=repo, filename=names[0]))
    except GatedRepoError:
        raise FluxKleinError(
            f"LoRA repo {repo} is gated: accept its licence on Hugging Face and `hf auth login`"
        ) from None
    except (HFValidationError, ValueError, OSError) as e:
        hint = "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if offline else type(e).__name__
        raise FluxKleinError(
            f"LoRA '{text}' could not be found on the Hugging Face hub ({hint}); check the name"
        ) from None
