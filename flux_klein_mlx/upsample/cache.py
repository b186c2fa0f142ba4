"""Captions cached on disk, so that a second image from the same request never loads the upsampler.

The cache is the prompt cache's machinery (`embedding_cache.EmbeddingCache`: bounded, least recently
used first, whole entries written by rename, a damaged or foreign entry ignored and removed, a folder
that cannot be written turning writing off with one warning) with entries of its own: a small JSON file
holding the key, the caption and a digest of it. It lives in `captions/` beside the prompt cache's
`embeddings/` and is on exactly when the prompt cache is.

The key is the prompt cache's recipe applied to the upsampler: its weight files (path, size, mtime, a
digest of each safetensors header, remembered so a cached run opens none of them), its chat template,
the token cap, and the request's identity (`UpsampleRequest.identity`: mode, prompt as typed, locked
boxes, the shown references' pixels), plus the runtime's version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from ..storage.embedding_cache import EmbeddingCache
from .request import UpsampleRequest
from .runtime import Progress, Upsampler, upsampler_folder

CAPTIONS_SUBFOLDER = "captions"
CAPTION_CACHE_BYTES = 64 << 20  # 64 MiB: tens of thousands of captions
CAPTION_FORMAT = "flux_klein_mlx.caption"


class CaptionCache(EmbeddingCache):
    """Captions under `folder`: `get(key)` -> str or None, `put(key, caption)`."""

    SUFFIX = ".json"

    @classmethod
    def beside(cls, prompts: EmbeddingCache | None) -> CaptionCache | None:
        """The caption cache next to a prompt cache (None when the prompt cache is off)."""
        if prompts is None:
            return None
        return cls(prompts.folder.parent / CAPTIONS_SUBFOLDER, min(prompts.max_bytes, CAPTION_CACHE_BYTES))

    def encode(self, value: str, key: str) -> list[bytes]:
        digest = hashlib.blake2b(value.encode(), digest_size=16).hexdigest()
        entry = {"format": CAPTION_FORMAT, "key": key, "caption": value, "blake2b": digest}
        return [json.dumps(entry, ensure_ascii=False).encode()]

    def decode(self, blob: bytes, key: str) -> str | None:
        try:
            entry = json.loads(blob)
            caption = entry["caption"]
            ok = entry["format"] == CAPTION_FORMAT and entry["key"] == key and isinstance(caption, str)
            ok = ok and hashlib.blake2b(caption.encode(), digest_size=16).hexdigest() == entry["blake2b"]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None
        return caption if ok else None


def chat_template_text(folder: Path) -> str:
    """The upsampler's chat template as its folder holds it (a file, or tokenizer_config's field)."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return (folder / name).read_text()
    try:
        return str(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def caption_key(cache: CaptionCache, folder: Path, request: UpsampleRequest, max_new_tokens: int) -> str | None:
    """The request's entry name, or None when the folder's weights cannot even be listed (the load says why)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        runtime = version("mlx-vlm")
    except PackageNotFoundError:
        runtime = None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    try:
        return cache.key(
            files,
            template=chat_template_text(folder),
            max_length=max_new_tokens,
            prompt=request.identity(),
            settings={"kind": "caption", "mlx-vlm": runtime},
        )
    except OSError:
        return None


def cached_caption(
    request: UpsampleRequest,
    folder: str | Path,
    cache: CaptionCache | None,
    *,
    on_progress: Callable[[Progress], None] | None = None,
    upsampler: Upsampler | None = None,
) -> tuple[str, float]:
    """(caption, seconds) for `request`: from the cache, else written by the upsampler in `folder` (loaded,
    run and released here, before anything else loads) and stored."""
    t0 = time.perf_counter()
    folder = Path(folder)
    up = upsampler or Upsampler(folder)
    key = None if cache is None else caption_key(cache, folder, request, up.max_new_tokens)
    caption = None if key is None else cache.get(key)
    if caption is None:
        with up:
            caption = up.caption(request, on_progress)
        if key is not None:
            cache.put(key, caption)
    return caption, time.perf_counter() - t0


def revise(prepared, source: str | Path | Upsampler, cache: CaptionCache | None, *, on_progress=None, make_room=None):
    """`prepared` (inputs.PreparedInputs with a pending `upsample` request) with the caption as its prompt;
    `source`: the upsampler's folder or repo id, or an `Upsampler` (its own token cap). `make_room()` runs
    only if the upsampler is about to load (a cache miss): the pipeline frees its transformer there."""
    up = source if isinstance(source, Upsampler) else Upsampler(upsampler_folder(source))
    up.make_room = make_room
    caption, seconds = cached_caption(prepared.upsample, up.folder, cache, on_progress=on_progress, upsampler=up)
    settings = dataclasses.replace(prepared.settings, prompt=caption)
    return dataclasses.replace(prepared, settings=settings, upsample=None, upsample_seconds=seconds)
