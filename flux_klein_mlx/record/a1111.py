"""A1111's habits: `<lora:NAME:WEIGHT>` tags in a prompt, the AutoV2 model hash, and its `parameters` text read back.

- A tag names a `.safetensors` file of a LoRA folder by its name without the suffix (the listing
  `lora_files` gives, the server's --lora-dir and `generate --lora-dir` alike); the tag is removed
  from the prompt the model sees (with the spaces before it) and the LoRA applied at that weight.
  `<lora:NAME>` is weight 1. A1111's `<lora:NAME:TE:UNET>` has no text-encoder part here: one weight.
- `model_hash` is A1111's AutoV2 of the transformer: the first 10 hex digits of the sha256 of the
  whole file. A transformer in several files (diffusers' shards, a converted folder) is hashed as its
  files' bytes one after another, in name order (no A1111 hash exists for it; Civitai lists files).
- `parse_parameters` reads the `parameters` text A1111, Forge and `output.a1111_parameters` write:
  the prompt, `Negative prompt: ...`, and the last line of `Key: value` pairs (quoted when they hold a
  comma, colon or quote), as A1111's `infotext_utils.parse_generation_parameters` splits them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import unicodedata
from pathlib import Path

from ..errors import FluxKleinError, first_few, quoted

LORA_TAG = re.compile(r"\s*<lora:([^<>]*)>")  # A1111's extra-network syntax, for LoRAs
PARAMETER = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')  # A1111's re_param
HASH_DIGITS = 10  # AutoV2


def lora_files(lora_dir: Path | None) -> dict[str, Path]:
    """name -> file of every LoRA in `lora_dir` (files only, sorted by name); {} without a folder."""
    if lora_dir is None:
        return {}
    return {p.stem: p for p in sorted(Path(lora_dir).glob("*.safetensors")) if p.is_file()}


def find_lora(name: str, files: dict[str, Path]) -> Path | None:
    """The file listed as `name`, or as the same text in another Unicode form (a client sends "é" as one
    code point where the file system may keep e + U+0301)."""
    if name in files:
        return files[name]
    wanted = unicodedata.normalize("NFC", name)
    return next((p for n, p in files.items() if unicodedata.normalize("NFC", n) == wanted), None)


def split_lora_tags(prompt: str, listed=()) -> tuple[str, list[tuple[str, float]]]:
    """A prompt -> (the prompt without its `<lora:...>` tags, [(name, weight), ...] in order). A name in
    `listed` is taken whole even when it ends in ":NUMBER"; a weight that is not a finite number, an
    empty name and a name given twice are one-line errors."""
    tags: list[tuple[str, float]] = []
    for body in LORA_TAG.findall(prompt):
        name, weight, tag = body.strip(), 1.0, quoted(f"<lora:{body}>")
        head, colon, tail = name.rpartition(":")
        if colon and name not in listed:
            try:
                name, weight = head.strip(), float(tail)
            except ValueError:
                raise FluxKleinError(
                    f"{tag}: the weight {tail.strip()!r:.40} is not a number; write <lora:NAME:0.8>"
                ) from None
            if not math.isfinite(weight):
                raise FluxKleinError(f"{tag}: the weight must be a finite number, such as 0.8")
        if not name:
            raise FluxKleinError(f"{tag} names no LoRA; write <lora:NAME:0.8>")
        if any(name == seen for seen, _ in tags):
            raise FluxKleinError(f"the prompt names LoRA {quoted(name)} twice; give each <lora:...> tag once")
        tags.append((name, weight))
    clean = LORA_TAG.sub("", prompt).strip()
    if LORA_TAG.search(clean):  # "<lora:<lora:a>>": taking the inner tag out leaves a tag
        raise FluxKleinError("the prompt holds a <lora:...> tag inside another; write each tag as <lora:NAME:0.8>")
    return clean, tags


def resolve_lora_tags(prompt: str, lora_dir, folder_words: str | None = None) -> tuple[str, list[tuple[Path, float]]]:
    """A prompt with `<lora:NAME:W>` tags -> (the prompt the model sees, [(file, weight), ...]) from the
    LoRA folder `lora_dir`; an unknown name (or tags without a folder) is one line naming the folder
    (`folder_words`: how to name it instead of its path, e.g. "the server's LoRA folder")."""
    if lora_dir is not None and not Path(lora_dir).is_dir():
        raise FluxKleinError(f"the LoRA folder {lora_dir} is not a folder; give the folder your LoRA files are in")
    if "<lora:" not in prompt:
        return prompt, []
    files = lora_files(lora_dir)
    clean, tags = split_lora_tags(prompt, listed=files)
    if tags and lora_dir is None:
        raise FluxKleinError(
            f"the prompt names LoRA {tags[0][0]!r} by a <lora:...> tag; give the folder of LoRAs with --lora-dir"
        )
    where = folder_words or f"the LoRA folder {lora_dir}"
    out = []
    for name, weight in tags:
        path = find_lora(name, files)
        if path is None:
            held = f"it holds {first_few(list(files))}" if files else "it holds no .safetensors file"
            raise FluxKleinError(f"<lora:{name}:...>: no LoRA named {name!r} in {where} ({held})")
        out.append((path, weight))
    return clean, out


def model_hash(files: list[Path]) -> str | None:
    """AutoV2: the first 10 hex digits of the sha256 of the transformer's bytes (its files in name order);
    None for a model without files (a random model built in memory)."""
    if not files:
        return None
    key = tuple((str(p), *_stamp(p)) for p in sorted(files))
    if key not in _HASHES:
        digest = hashlib.sha256()
        for path in sorted(files):
            with open(path, "rb") as f:
                for chunk in iter(lambda f=f: f.read(1 << 22), b""):
                    digest.update(chunk)
        _HASHES[key] = digest.hexdigest()[:HASH_DIGITS]
    return _HASHES[key]


_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns) of each file -> hash: once per process and file


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def unquote(value: str) -> str:
    """A value A1111 quoted (JSON string syntax) -> its text."""
    if len(value) > 1 and value[0] == '"' and value[-1] == '"':
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def parse_parameters(text: str) -> dict[str, str]:
    """A1111's `parameters` text -> {"Prompt": ..., "Negative prompt": ..., "Steps": "4", ...} (values as text)."""
    *lines, last = text.strip().split("\n")
    if len(PARAMETER.findall(last)) < 3:  # a prompt without a settings line
        lines.append(last)
        last = ""
    prompt, negative, in_negative = [], [], False
    for line in lines:
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[len("Negative prompt:") :].strip()
        (negative if in_negative else prompt).append(line)
    out = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in PARAMETER.findall(last):
        out[key.strip()] = unquote(value.strip())
    return out
