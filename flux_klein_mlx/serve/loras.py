"""The LoRAs a request may name: the `.safetensors` files directly in the server's --lora-dir, each
named by its file name without the suffix, exactly as `/v1/status` and the page list it (spaces,
accents, parentheses and colons included: Civitai's usual names).

A name is looked up in that listing, never joined into a path, so no name reaches a file outside the
folder; names that would (`..`, `/`, an absolute path) are refused with one line before the lookup.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import FluxKleinError
from ..lora.apply import parse_lora_spec
from ..record.a1111 import find_lora, lora_files, resolve_lora_tags
from .forms import MAX_LORAS, ApiError


def escapes_folder(name: str) -> bool:
    """True for a name that is a path rather than a file name: '..', '.', any '/', a NUL, or empty."""
    return name in ("", ".", "..") or "/" in name or "\0" in name


def split_spec(item: str, files: dict[str, Path]) -> tuple[str, float]:
    """A request's "name" or "name:scale" -> (name, scale); a listed name is taken whole even when it
    ends in ":NUMBER" (the file "mix:2" is "mix:2" at 1.0, "mix:2:0.5" the same file at 0.5)."""
    if not escapes_folder(item) and find_lora(item, files) is not None:
        return item, 1.0
    try:
        name, scale = parse_lora_spec(item, files=False)  # never looks at the file system
    except FluxKleinError as e:
        raise ApiError(400, e.worded("http"), "loras") from None
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


def prompt_loras(prompt: str, lora_dir: Path | None) -> tuple[str, tuple]:
    """A prompt's `<lora:NAME:W>` tags -> (the prompt without them, ((file in --lora-dir, weight), ...)); an
    unknown name is a 404 that names the folder as the server's (never its path)."""
    try:
        clean, tags = resolve_lora_tags(prompt, lora_dir, "the server's LoRA folder (GET /v1/status lists them)")
    except FluxKleinError as e:
        words = str(e).replace("give the folder of LoRAs with --lora-dir", "this server has no --lora-dir")
        raise ApiError(404 if "no LoRA named" in words else 400, words, "prompt") from None
    return clean, tuple((str(path.resolve()), weight) for path, weight in tags)


def merge_loras(named: tuple, tagged: tuple) -> tuple:
    """A request's `loras` then its prompt's tags; one file given both ways is refused in one line."""
    twice = {path for path, _ in named} & {path for path, _ in tagged}
    if twice:
        raise ApiError(
            400,
            f"LoRA {Path(next(iter(twice))).stem!r} is named in loras and in a <lora:...> tag; give it once",
            "prompt",
        )
    return named + tagged
