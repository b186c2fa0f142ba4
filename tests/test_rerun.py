"""`generate --from IMAGE` reads untrusted input (issue 46, section 2): a damaged or forged record is one
line that names --from, the file and the field, before any model loads; a record never chooses the model.

The round trip of a whole record (ours and A1111's, bit for bit) is tests/test_a1111.py's; the property
here is that any JSON value as the record, and any bytes as the PNG text, become settings that
`RunSettings.check` takes, or one FluxKleinError line, never another exception.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from command_line import assert_one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, PngImagePlugin
from PIL.PngImagePlugin import PngInfo

from flux_klein_mlx.checks import check_prompt_given
from flux_klein_mlx.dtypes import DTYPES
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.inputs.rerun import FIELDS, record_options
from flux_klein_mlx.inputs.settings import RunSettings
from flux_klein_mlx.record.a1111 import split_lora_tags
from flux_klein_mlx.record.output import model_name, read_record

RECORD = {"prompt": "a fox", "seed": 1, "steps": 1, "width": 64, "height": 64, "noise": "torch", "dtype": "float32"}


def png_with(path, *, record=None, parameters=None, zip_record=False):
    """A 64x64 PNG whose `flux_klein_mlx` chunk is `record` (JSON unless it is already str / bytes)."""
    info = PngInfo()
    if record is not None:
        text = record if isinstance(record, (str, bytes)) else json.dumps(record)
        info.add_text("flux_klein_mlx", text, zip=zip_record)
    if parameters is not None:
        info.add_text("parameters", parameters)
    Image.new("RGB", (64, 64)).save(path, pnginfo=info)
    return path


LONG = "x" * (PngImagePlugin.MAX_TEXT_CHUNK + 1)  # a zTXt chunk that inflates past PIL's limit
CASES = {  # case: (the record's text or fields, words the line must hold beside --from and the file)
    "list": ([RECORD], ["its record is a list"]),
    "string": ("a fox", ["is not valid JSON"]),
    "json-string": (json.dumps("a fox"), ["its record is a string"]),
    "loras-string": ({**RECORD, "loras": "style"}, ["its record's loras"]),
    "loras-no-name": ({**RECORD, "loras": [{"scale": 1}]}, ["its record's loras", "LoRA 1 must have a name"]),
    "loras-scale-x": ({**RECORD, "loras": [{"name": "s", "scale": "x"}]}, ["its record's loras", "finite number"]),
    "outpaint-5": ({**RECORD, "outpaint": 5, "init_image": "c" * 12}, ["its record's outpaint"]),
    "references-5": ({**RECORD, "references": 5}, ["its record's references"]),
    "bad-json": ('{"prompt": "a fox",', ["is not valid JSON"]),
    "dtype": ({**RECORD, "dtype": "float64"}, ["its record's dtype", "float64"]),
    "width": ({**RECORD, "width": 99999}, ["its record's width", "above the maximum"]),
    "steps-2.5": ({**RECORD, "steps": 2.5}, ["its record's steps", "2.5"]),
    "guidance-huge": ({**RECORD, "guidance": 10**400}, ["its record's guidance", "finite"]),
    "seed-text": ({**RECORD, "seed": "1"}, ["its record's seed"]),
    "quantize": ({**RECORD, "quantize": 3}, ["its record's quantize"]),
    "noise": ({**RECORD, "noise": "perlin"}, ["its record's noise"]),
    "prompt-surrogate": ({**RECORD, "prompt": "a \ud800 fox"}, ["its record's prompt", "lone surrogate"]),
    "prompt-bad-tag": ({**RECORD, "prompt": "a <lora::1>"}, ["its record's prompt", "names no LoRA"]),
    "lora-name-bracket": ({**RECORD, "loras": [{"name": "a>b", "scale": 1}]}, ["its record's loras"]),
    "strength": ({**RECORD, "init_image": "c" * 12, "strength": 2}, ["its record's strength"]),
    "strength-no-init": ({**RECORD, "strength": 0.5}, ["its record's strength", "init_image"]),
    "model-lines": ({**RECORD, "model": "a\nb"}, ["its record's model"]),
    "a1111-steps": (None, ["its A1111 text's Steps", "'2.5' is not a whole number"]),
    "a1111-size": (None, ["its A1111 text's Size", "above the maximum"]),
    "a1111-cfg": (None, ["its A1111 text's CFG scale", "finite"]),
    "past-chunk-limit": (LONG, ["PIL refuses", "MAX_TEXT_CHUNK"]),
}
A1111 = {"a1111-steps": "Steps: 2.5", "a1111-size": "Size: 99999x64", "a1111-cfg": "CFG scale: inf"}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_record_is_one_line_naming_from_the_file_and_the_field(cli, snapshot, tmp_path, no_models, case):
    record, words = CASES[case]
    src, out = tmp_path / f"{case}.png", tmp_path / "out.png"
    if case in A1111:
        png_with(src, parameters=f"a fox\n{A1111[case]}, Sampler: Euler, Seed: 1")
    else:
        png_with(src, record=record, zip_record=case == "past-chunk-limit")
    code, _, err = cli("generate", "--from", src, "--model", snapshot, "-o", out)
    assert_one_line_error(code, err, "--from", str(src), *words)
    assert not out.exists() and not no_models


def test_a_record_names_its_model_and_the_run_uses_model(cli, snapshot, tmp_path):
    """A record's `model` (a repo id here) is said, never loaded: --model runs, and the image is its own."""
    src, again = png_with(tmp_path / "src.png", record={**RECORD, "model": "someone/else"}), tmp_path / "again.png"
    code, out, err = cli("generate", "--from", src, "--model", snapshot, "-o", again)
    assert code == 0, err
    assert f"--from {src}: it was made with someone/else; this run uses {snapshot}" in err
    assert read_record(again)["model"] == model_name(snapshot) and read_record(again)["steps"] == 1
    theirs = png_with(tmp_path / "a1111.png", parameters='a fox\nSteps: 2, Seed: 3, Model: "sdxl, v1", Size: 64x64')
    note = record_options(theirs).model_note(snapshot)
    assert note == f"--from {theirs}: it was made with sdxl, v1; this run uses {snapshot} (--model chooses)"
    assert record_options(again).model_note(str(snapshot)) is None  # the same model (a folder, by name): no note


def test_the_record_fills_only_the_options_it_holds(tmp_path):
    """Every field's value reaches its option: the record of a whole run becomes the same options."""
    record = {**RECORD, "guidance": 2.5, "negative_prompt": "blur", "quantize": 8, "model": "o/m"}
    record.update(loras=[{"name": "style", "scale": 0.5}], references=["a" * 12], init_image="b" * 12)
    record.update(strength=0.6, mask="c" * 12)
    rerun = record_options(png_with(tmp_path / "r.png", record=record))
    assert rerun.options == {
        "prompt": "a fox <lora:style:0.5>", "negative_prompt": "blur", "seed": 1, "steps": 1, "guidance": 2.5,
        "width": 64, "height": 64, "noise": "torch", "strength": 0.6, "dtype": "float32", "quantize": "8",
    }  # fmt: skip
    assert rerun.needs == {"--image": 1, "--init-image": 1, "--mask": 1} and rerun.model == "o/m"
    outpaint = record_options(png_with(tmp_path / "o.png", record={**record, "outpaint": [0, 0, 16, 0]}))
    assert outpaint.options["outpaint"] == "0,0,16,0" and "width" not in outpaint.options
    assert outpaint.needs == {"--image": 1, "--init-image": 1}  # an outpaint's mask is made from its pads


def assert_settings_or_one_line(path) -> None:
    """`record_options(path)` gives options `RunSettings.check` takes (with the images it needs given), or
    raises FluxKleinError with one line naming --from; never another exception."""
    try:
        rerun = record_options(path)
    except FluxKleinError as e:
        assert "\n" not in str(e) and str(e).startswith(f"--from {path}: "), str(e)
        return
    options = dict(rerun.options)
    prompt = options.pop("prompt", "a fox")
    check_prompt_given(prompt)
    assert options.pop("dtype", "bfloat16") in DTYPES and options.pop("quantize", "4") in ("4", "8")
    given = {"--image": ("images", ["given"] * rerun.needs.get("--image", 0))}
    given.update({"--init-image": ("init_image", "given"), "--mask": ("mask", "given")})
    options.update(given[option] for option in rerun.needs)
    RunSettings(split_lora_tags(prompt)[0], **options).check()
    assert rerun.model is None or rerun.model.isprintable()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
NEAR = {  # values near what each field takes, so that deep checks are reached
    "width": st.sampled_from([64, 80, 4096, 4112, 63, 10**400, 64.0]),
    "loras": st.lists(st.fixed_dictionaries({"name": st.text(max_size=6), "scale": JSON}), max_size=3),
    "outpaint": st.lists(st.integers(-1, 5000), max_size=5),
    "dtype": st.sampled_from([*DTYPES, "float64"]),
    "quantize": st.sampled_from([4, 8, 4.0, "4", True]),
}
RECORDS = st.dictionaries(
    st.sampled_from([*FIELDS, "extra"]),
    st.one_of(JSON, *NEAR.values(), st.integers(0, 9), st.floats(0, 1), st.sampled_from(["torch", "mlx", "latents"])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=st.one_of(JSON, RECORDS))
def test_any_json_record_is_settings_or_one_line(record):
    with tempfile.TemporaryDirectory() as folder:
        assert_settings_or_one_line(png_with(Path(folder) / "r.png", record=json.dumps(record)))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), key=st.sampled_from(["flux_klein_mlx", "parameters"]))
def test_any_bytes_as_the_text_chunk_are_settings_or_one_line(data, key):
    """Any bytes in the chunk (PIL reads tEXt as Latin-1); A1111's text too, with a settings line after them."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.png"
        info = PngInfo()
        info.add_text(key, data + (b"\nSteps: 2, Seed: 3, Size: 64x64" if key[0] == "p" else b""))
        Image.new("RGB", (8, 8)).save(path, pnginfo=info)
        assert_settings_or_one_line(path)


def test_an_image_past_pils_pixel_limit_is_one_line(tmp_path, monkeypatch):
    """A forged header's size past PIL's decompression-bomb bound: one line, not PIL's exception."""
    path = png_with(tmp_path / "big.png", record=RECORD)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 // 4)
    with pytest.raises(FluxKleinError, match="PIL refuses to read it"):
        record_options(path)
