"""`generate --from IMAGE`: the settings an image's record holds, as `generate`'s options.

The record is ours (`output.read_record`: the PNG chunk, or XMP in a JPEG / WebP) or, failing that,
A1111's / Forge's `parameters` text (a PNG chunk) read by `a1111.parse_parameters`. Our record gives
back the prompt with a `<lora:NAME:W>` tag per LoRA (`output.a1111_prompt`, resolved against
--lora-dir as typed tags are), seed, steps, guidance, size, noise, strength, dtype and quantization;
A1111's text gives what it holds (its `Model` is another program's checkpoint, never loaded here).
Images are named by hash only: a record made from images asks for them again (--image, --init-image,
--mask), in one line. Options given beside --from override what the record says.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from ..errors import FluxKleinError
from .a1111 import parse_parameters
from .output import a1111_prompt, read_record


def record_options(path: str | Path) -> dict:
    """IMAGE -> {option name: value} of `generate` (only what the record holds); one line when it holds none."""
    try:
        record = read_record(path)
        with Image.open(path) as im:
            text = getattr(im, "text", {}).get("parameters") or im.info.get("parameters")
    except FileNotFoundError:
        raise FluxKleinError(f"--from {path}: no such file") from None
    except (OSError, ValueError):
        raise FluxKleinError(f"--from {path}: not an image this can read (PNG, JPEG or WebP)") from None
    if record is not None:
        return ours(record, path)
    if text:
        return theirs(parse_parameters(text), path)
    raise FluxKleinError(
        f"--from {path}: the image holds no record (neither ours nor A1111's 'parameters' text); "
        "give the settings as options instead"
    )


def ours(record: dict, path) -> dict:
    if record.get("noise") == "latents":
        raise FluxKleinError(f"--from {path}: it was made from given latents (Python), which its record does not hold")
    options = {
        "prompt": a1111_prompt(record),
        "negative_prompt": record.get("negative_prompt"),
        "seed": record.get("seed"),
        "steps": record.get("steps"),
        "guidance": record.get("guidance"),
        "width": record.get("width"),
        "height": record.get("height"),
        "noise": record.get("noise"),
        "dtype": record.get("dtype"),
        "quantize": None if record.get("quantize") is None else str(record["quantize"]),
        "strength": record.get("strength"),
        "outpaint": ",".join(map(str, record["outpaint"])) if record.get("outpaint") else None,
        "needs": needs(  # an outpaint's mask is its own, made from the pads
            len(record.get("references") or []),
            bool(record.get("init_image")),
            bool(record.get("mask")) and not record.get("outpaint"),
        ),
    }
    if record.get("outpaint"):  # the canvas's size is the image's and its pads'
        options["width"] = options["height"] = None
    model = str(record.get("model") or "")
    if model.count("/") == 1 and not Path(model).exists():  # a repo id; a local folder is named only by its name
        options["model"] = model
    return {k: v for k, v in options.items() if v is not None}


def theirs(fields: dict, path) -> dict:
    """A1111's fields -> options; a value that is not what A1111 writes is one line naming it."""
    options = {"prompt": fields["Prompt"], "negative_prompt": fields["Negative prompt"] or None}
    for key, option, kind in (("Seed", "seed", int), ("Steps", "steps", int), ("CFG scale", "guidance", float)):
        if key in fields:
            options[option] = number(fields[key], kind, key, path)
    if "Size" in fields:
        w, _, h = fields["Size"].partition("x")
        options["width"], options["height"] = number(w, int, "Size", path), number(h, int, "Size", path)
    if "Denoising strength" in fields:
        options["strength"] = number(fields["Denoising strength"], float, "Denoising strength", path)
        options["needs"] = needs(0, True, False)
    return {k: v for k, v in options.items() if v is not None}


def number(text: str, kind, key: str, path):
    try:
        return kind(text)
    except ValueError:
        raise FluxKleinError(f"--from {path}: its A1111 text has {key}: {text!r}, not a number") from None


def needs(references: int, init_image: bool, mask: bool) -> dict:
    """Which images the original run had ({option: count}): a rerun must be given them again."""
    return {k: v for k, v in (("--image", references), ("--init-image", int(init_image)), ("--mask", int(mask))) if v}


def check_images_given(path, wanted: dict, given: dict) -> None:
    """One line when the record's run used images that are not given beside --from (`given`: option -> count)."""
    for option, count in wanted.items():
        if given.get(option, 0) < count:
            raise FluxKleinError(
                f"--from {path}: it was made with {count} {option} image(s), which its record names only by hash; "
                f"give them with {option}"
            )
