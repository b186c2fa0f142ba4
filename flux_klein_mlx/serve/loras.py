"""The LoRAs a request may name: the `.safetensors` files directly in the server's --lora-dir, each
named by its file name without the suffix, exactly as `/v1/status` and the page list it (spaces,
accents, parentheses and colons included: Civitai's usual names).

A name is looked up in that listing, never joined into a path, so no name reaches a file outside the
folder; names that would (`..`, `/`, an absolute path) are refused with one line before the lookup.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from ..errors import FluxKleinError
from ..lora.apply import parse_lora_spec
from .forms import MAX_LORAS, ApiError


def lora_files(lora_dir: Path | None) -> dict[str, Path]:
    """name -> file of every LoRA in `lora_dir` (files only, sorted by name); {} without a folder."""
    if lora_dir is None:
        return {}
    return {p.stem: p for p in sorted(lora_dir.glob("*.safetensors")) if p.is_file()}


def escapes_folder(name: str) -> bool:
    """True for a name that is a path rather than a file name: '..', '.', any '/', a NUL, or empty."""
    return name in ("", ".", "..") or "/" in name or "\0" in name


def find_lora(name: str, files: dict[str, Path]) -> Path | None:
    """The file listed as `name`, or as the same text in another Unicode form (a client sends "é" as one
    code point where the file system may keep e + U+0301)."""
    if name in files:
        return files[name]
    wanted = unicodedata.normalize("NFC", name)
    return next((p for n, p in files.items() if unicodedata.normalize("NFC", n) == wanted), None)


def split_spec(item: str, files: dict[str, Path]) -> tuple[str, float]:
    """A request's "name" or "name:scale" -> (name, scale); a listed name is taken whole even when it
    ends in ":NUMBER" (the file "mix:2" is "mix:2" at 1.0, "mix:2:0.5" the same file at 0.5)."""
    if not escapes_folder(item) and find_lora(item, files) is not None:
        return item, 1.0
    try:
        name, scale = parse_lora_spec(item, files=False)  # never looks at the file system
    except FluxKleinError as e:
        raise ApiError(400, str(e), "loras") from None
    return str(name), scale


def resolve_loras(value, lora_dir: Path | None) -> tuple:
    """A request's `loras` (names, optionally "name:scale") -> ((file in --lora-dir, scale), ...)."""
    if value in (None, ""):
        return ()
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_LORAS:
        raise ApiError(400, f"{len(items)} LoRAs named; a request may name at most {MAX_LORAS}", "loras")
    files = lora_files(lora_dir)
    out = {}  # file -> (file, scale)
    for item in items:
        if not isinstance(item, str):
            raise ApiError(400, f"loras must be names (strings), not {type(item).__name__}", "loras")
        name, scale = split_spec(item, files)
        if escapes_folder(name):
            raise ApiError(
                400,
                f"LoRA {item!r} is not a name: give the name of a file in the server's "
                "--lora-dir as GET /v1/status lists it (without .safetensors), never a path",
                "loras",
            )
        if lora_dir is None:
            raise ApiError(400, "this server was started without --lora-dir, so requests cannot name LoRAs", "loras")
        path = find_lora(name, files)
        if path is None:
            raise ApiError(
                404, f"no LoRA named {name!r} in the server's LoRA folder; GET /v1/status lists them", "loras"
            )
        if path in out:
            raise ApiError(
                400, f"LoRA {name!r} is named twice; name each LoRA once (name:scale sets its strength)", "loras"
            )
        out[path] = (str(path.resolve()), scale)
    return tuple(out.values())
