"""`generate --from IMAGE`: the settings an image's record holds, as `generate`'s options.

The record is ours (`output.record_text`: the PNG chunk, or XMP in a JPEG / WebP) or, failing that,
A1111's / Forge's `parameters` text (a PNG chunk) read by `a1111.parse_parameters`. Our record gives
back the prompt with a `<lora:NAME:W>` tag per LoRA (`output.a1111_prompt`, resolved against
--lora-dir as typed tags are), seed, steps, guidance, size, noise, strength, outpaint, dtype and
quantization; A1111's text gives what it holds (its `Model` is another program's checkpoint).

A record is untrusted input (a picture from the web carries what anyone wrote): the image is read once,
and every field passes `FIELDS`, the checks the typed option meets (`RunSettings.check` for a run's
settings: each bound has one home), before it becomes an option; a bad one is one line naming --from,
the file and the field. A record never chooses the model: `Rerun.model_note` says which one it was made
with, and --model (or its default) runs. Images are named by hash only: a record made from images asks
for them again (--image, --init-image, --mask), in one line. Options given beside --from override it.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from ..checks import check_choice, is_finite, is_int
from ..dtypes import DTYPES
from ..errors import FluxKleinError
from ..models.quantize import BITS
from ..record.a1111 import parse_parameters, split_lora_tags
from ..record.output import RECORD_KEY, a1111_prompt, model_name, record_text
from .settings import RunSettings

SHOWN = 300  # characters of a refusal's reason shown: a forged value can be a megabyte long
GIVEN = "(given beside --from)"  # what stands for an image the record names by hash, in a check


@dataclass
class Rerun:
    """What --from IMAGE gives `generate`: `options` (option -> value, each checked as the typed option
    is), `needs` (the images the original run used, {option: count}) and the `model` it was made with."""

    path: str
    options: dict
    needs: dict = field(default_factory=dict)
    model: str | None = None

    def check_given(self, given: dict) -> None:
        """One line when the record's run used images not given beside --from (`given`: option -> count)."""
        for option, count in self.needs.items():
            if given.get(option, 0) < count:
                raise FluxKleinError(
                    f"--from {self.path}: it was made with {count} {option} image(s), which its record names only "
                    f"by hash; give them with {option}"
                )

    def model_note(self, model: str) -> str | None:
        """The line that says which model the record names when this run uses another (`model`)."""
        if self.model is None or self.model == model_name(model):
            return None
        return f"--from {self.path}: it was made with {self.model}; this run uses {model} (--model chooses)"


def record_options(path: str | Path) -> Rerun:
    """IMAGE -> its settings as `generate`'s options (only what the record holds); one line when it holds
    none, or a field that is not what the option takes."""
    raw, text = read_texts(path)
    if raw is not None:
        return ours(parse_record(raw, path), path)
    if text:
        return theirs(parse_parameters(text), path)
    raise FluxKleinError(
        f"--from {path}: the image holds no record (neither ours nor A1111's 'parameters' text); "
        "give the settings as options instead"
    )


def read_texts(path) -> tuple[str | None, str | None]:
    """(our record's JSON text, A1111's `parameters` text) of the image at `path`, either None."""
    try:
        with Image.open(path) as im:
            return record_text(im), getattr(im, "text", {}).get("parameters") or im.info.get("parameters")
    except FileNotFoundError:
        raise FluxKleinError(f"--from {path}: no such file") from None
    except (ValueError, Image.DecompressionBombError) as e:  # PIL's bounds: MAX_TEXT_CHUNK, MAX_IMAGE_PIXELS
        raise FluxKleinError(f"--from {path}: PIL refuses to read it ({e}); give the settings as options") from None
    except (OSError, SyntaxError, EOFError):
        raise FluxKleinError(f"--from {path}: not an image this can read (PNG, JPEG or WebP)") from None


def parse_record(raw: str, path) -> dict:
    """Our record's text -> its fields; one line when it is not a JSON object."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # a decode error, an integer past Python's digit limit, deep nesting
        raise FluxKleinError(
            f"--from {path}: its record (the {RECORD_KEY} text) is not valid JSON; give the settings as options"
        ) from None
    if not isinstance(record, dict):
        kind = {list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(
            type(record), "a number"
        )
        raise FluxKleinError(f"--from {path}: its record is {kind}, not a JSON object of fields")
    return record


# --- the fields of our record: the check of each value, and the option it fills -------------------------


def setting(name: str, **beside):
    """The check `RunSettings` makes of setting `name` (`beside`: what it needs given with it)."""
    return lambda value: RunSettings(".", **beside, **{name: value}).check()


def text_field(name: str):
    """The check of a field that is text."""

    def check(value) -> None:
        if not isinstance(value, str):
            raise FluxKleinError(f"{name} must be text, not {value!r}")

    return check


def check_bits(value) -> None:
    if not (is_int(value) and value in BITS):
        raise FluxKleinError(f"quantize must be {' or '.join(map(str, BITS))} (bits) or null, not {value!r}")


def check_prompt(value) -> None:
    """Text whose <lora:NAME:W> tags read back, and whose rest is a prompt `RunSettings` takes."""
    text_field("prompt")(value)
    RunSettings(split_lora_tags(value)[0]).check()


def check_size(value) -> None:
    """(width, height) together: what this machine can decode."""
    RunSettings(".", width=value[0], height=value[1]).check()


def check_pads(value) -> None:
    if not isinstance(value, list):  # as the record writes them: [left, top, right, bottom]
        raise FluxKleinError(f"outpaint must be a list of four pads in px, not {value!r}")
    setting("outpaint", init_image=GIVEN)(value)


def check_hashes(value) -> None:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise FluxKleinError(f"references must be a list of image hashes, not {value!r}")


def check_loras(value) -> None:
    """A list of {"name": the file's name, "scale": a finite number}: what `a1111_prompt` makes tags of."""
    if not isinstance(value, list):
        raise FluxKleinError(f"loras must be a list of {{name, scale}}, not {value!r}")
    for n, lora in enumerate(value, 1):
        name, scale = (lora.get("name"), lora.get("scale")) if isinstance(lora, dict) else (None, None)
        if not isinstance(name, str) or not name or "<" in name or ">" in name:
            raise FluxKleinError(f"LoRA {n} must have a name (text without < or >), not {lora!r}")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not is_finite(scale):
            raise FluxKleinError(f"LoRA {n} ({name}) must have a scale that is a finite number, not {scale!r}")


def check_model(value) -> None:
    if not (isinstance(value, str) and value.isprintable()):
        raise FluxKleinError(f"model must be a model's name (one line of text), not {value!r}")


# field -> (its check, the option it fills; None: read below, not an option as it stands)
FIELDS = {
    "prompt": (text_field("prompt"), None),  # with revised_prompt and loras: the prompt and its <lora:> tags
    "revised_prompt": (text_field("revised_prompt"), None),
    "loras": (check_loras, None),
    "negative_prompt": (setting("negative_prompt"), "negative_prompt"),
    "seed": (setting("seed"), "seed"),
    "steps": (setting("steps"), "steps"),
    "guidance": (setting("guidance"), "guidance"),
    "width": (setting("width"), "width"),
    "height": (setting("height"), "height"),
    "noise": (setting("noise"), "noise"),
    "strength": (setting("strength", init_image=GIVEN), "strength"),
    "dtype": (lambda v: check_choice("dtype", v, DTYPES), "dtype"),
    "quantize": (check_bits, None),  # the option takes "4" / "8"
    "outpaint": (check_pads, None),  # the option takes "LEFT,TOP,RIGHT,BOTTOM"
    "references": (check_hashes, None),  # needs: --image, one each
    "init_image": (text_field("init_image"), None),  # needs: --init-image
    "mask": (text_field("mask"), None),  # needs: --mask
    "model": (check_model, None),  # said, never run in place of --model
}  # steps_run, model_hash, variant, vae, crop, boxes, software: what happened, not what to ask for


def checked(where: str, check, value) -> None:
    """`check(value)`, its refusal said as `where: reason` (the reason cut to SHOWN characters)."""
    try:
        check(value)
    except FluxKleinError as e:
        reason = str(e) if len(str(e)) <= SHOWN else str(e)[:SHOWN] + "..."
        raise FluxKleinError(f"{where}: {reason}") from None


def ours(record: dict, path) -> Rerun:
    """Our record's fields, each checked (`FIELDS`), as options."""
    where = f"--from {path}: its record's"
    if record.get("noise") == "latents":
        raise FluxKleinError(f"--from {path}: it was made from given latents (Python), which its record does not hold")
    for name, (check, _) in FIELDS.items():
        if record.get(name) is not None:
            checked(f"{where} {name}", check, record[name])
    r = record.get
    for name in ("strength", "mask", "outpaint"):
        if r(name) is not None and r("init_image") is None:
            raise FluxKleinError(f"{where} {name}: it needs an init_image, which the record does not name")
    options = {option: r(name) for name, (_, option) in FIELDS.items() if option}
    options["prompt"] = a1111_prompt(record) or None  # the text the model read, a <lora:NAME:W> tag per LoRA
    checked(f"{where} prompt", check_prompt, options["prompt"] or "")
    options["quantize"] = None if r("quantize") is None else str(r("quantize"))
    if r("outpaint"):  # the canvas's size is the image's and its pads'; its mask is its own, made from the pads
        options.update(outpaint=",".join(map(str, r("outpaint"))), width=None, height=None)
    elif r("width") is not None and r("height") is not None:
        checked(f"{where} width and height", check_size, (r("width"), r("height")))
    wanted = needs(len(r("references") or []), r("init_image") is not None, bool(r("mask")) and not r("outpaint"))
    return Rerun(str(path), {k: v for k, v in options.items() if v is not None}, wanted, r("model"))


# A1111's keys read, and the option each fills (its check: our field of that name in FIELDS)
A1111_FIELDS = (("Seed", "seed", int), ("Steps", "steps", int), ("CFG scale", "guidance", float),
                ("Denoising strength", "strength", float))  # fmt: skip


def theirs(fields: dict, path) -> Rerun:
    """A1111's fields -> options, each checked as ours are; a value that is not what A1111 writes is one line."""
    where = f"--from {path}: its A1111 text's"
    checked(f"{where} prompt", check_prompt, fields["Prompt"])
    checked(f"{where} negative prompt", FIELDS["negative_prompt"][0], fields["Negative prompt"])
    options = {"prompt": fields["Prompt"] or None, "negative_prompt": fields["Negative prompt"] or None}
    for key, option, kind in A1111_FIELDS:
        if key in fields:
            options[option] = number(fields[key], kind, f"{where} {key}")
            checked(f"{where} {key}", FIELDS[option][0], options[option])
    if "Size" in fields:
        w, _, h = fields["Size"].partition("x")
        options["width"], options["height"] = number(w, int, f"{where} Size"), number(h, int, f"{where} Size")
        checked(f"{where} Size", check_size, (options["width"], options["height"]))
    wanted = needs(0, True, False) if "strength" in options else {}
    if "Model" in fields:  # another program's checkpoint: said, as ours is
        checked(f"{where} Model", check_model, fields["Model"])
    return Rerun(str(path), {k: v for k, v in options.items() if v is not None}, wanted, fields.get("Model"))


def number(value: str, kind, where: str):
    try:
        return kind(value)
    except ValueError:
        raise FluxKleinError(f"{where}: {value!r} is not a {'whole ' if kind is int else ''}number") from None


def needs(references: int, init_image: bool, mask: bool) -> dict:
    """Which images the original run had ({option: count}): a rerun must be given them again."""
    return {k: v for k, v in (("--image", references), ("--init-image", int(init_image)), ("--mask", int(mask))) if v}
