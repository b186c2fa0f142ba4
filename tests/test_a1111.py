"""A1111's habits (issue 40): `<lora:NAME:W>` tags, `Model hash`, `Lora hashes`, `Denoising strength`, `--from`.

The judges are not our code: the `parameters` text is read back with A1111's own two expressions
(`infotext_utils.re_param` for the settings line, `extra_networks.re_extra_net` for the prompt's tags),
`Model hash` is A1111's AutoV2 (`hashes.calculate_sha256(file)[0:10]`) and a LoRA's hash its AutoV3
(sha256 of the safetensors file after its header, 12 digits: `sd_models.model_hash`'s addnet hash),
computed here from the files' bytes. Images are compared pixel for pixel (float32 and the default
bfloat16 alike: a rerun is the same computation).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct

import numpy as np
import pytest
from command_line import assert_one_line_error, gen_args
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from PIL.PngImagePlugin import PngInfo
from refs import picture

import flux_klein_mlx
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.record.a1111 import LORA_TAG, split_lora_tags
from flux_klein_mlx.record.output import read_record

RE_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')  # A1111's infotext_utils
RE_EXTRA_NET = re.compile(r"<(\w+):([^>]+)>")  # A1111's extra_networks


def a1111_read(text: str) -> tuple[str, dict, list[list[str]]]:
    """(prompt, settings, the prompt's LoRA tags as [name, weight]) the way A1111 reads `parameters`."""
    *prompt, last = text.strip().split("\n")
    settings = {k.strip(): v.strip().strip('"') for k, v in RE_PARAM.findall(last)}
    prompt = "\n".join(line for line in prompt if not line.startswith("Negative prompt:"))
    tags = [body.split(":") for kind, body in RE_EXTRA_NET.findall(prompt) if kind == "lora"]
    return prompt, settings, tags


def autov2(files) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def autov3(path) -> str:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return hashlib.sha256(data[8 + n :]).hexdigest()[:12]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A folder with a random PEFT LoRA `style` on the tiny transformer's first double block."""
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("loras")
    rng = np.random.default_rng(5)
    tensors = {}
    for name, (out, inp) in {"attn.to_q": (64, 64), "ff.linear_in": (384, 64)}.items():
        key = f"transformer.transformer_blocks.0.{name}"
        tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.3, (4, inp)).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.3, (out, 4)).astype(np.float32)
    save_file(tensors, str(folder / "style.safetensors"))
    return folder


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_a_tag_is_the_same_image_as_lora_with_that_scale_and_the_text_reads_back(cli, snapshot, lora_dir, tmp_path):
    """`<lora:style:0.8>` in the prompt = `--lora style.safetensors --lora-scale 0.8` on the prompt without it,
    bit for bit and record for record; A1111's expressions read the tag, Model hash and Lora hashes back."""
    tagged, plain = tmp_path / "tagged.png", tmp_path / "plain.png"
    args = gen_args(snapshot, tagged, "--lora-dir", lora_dir)
    args[args.index("a fox")] = "a fox <lora:style:0.8>, in snow"
    code, _, err = cli(*args)
    assert code == 0, err
    args = gen_args(snapshot, plain, "--lora", lora_dir / "style.safetensors", "--lora-scale", "0.8")
    args[args.index("a fox")] = "a fox, in snow"
    code, _, err = cli(*args)
    assert code == 0, err
    assert np.array_equal(pixels(tagged), pixels(tmp_path / "plain.png"))
    record = read_record(tagged)
    assert record == {**read_record(plain), "prompt": "a fox, in snow"}
    prompt, settings, tags = a1111_read(Image.open(tagged).text["parameters"])
    assert prompt == "a fox, in snow <lora:style:0.8>" and tags == [["style", "0.8"]]
    transformer = sorted((snapshot / "transformer").glob("*.safetensors"))
    assert settings["Model hash"] == autov2(transformer) == record["model_hash"]
    assert settings["Lora hashes"] == f"style: {autov3(lora_dir / 'style.safetensors')}"


def test_every_img2img_and_inpaint_records_its_denoising_strength(cli, snapshot, tmp_path):
    """The default strength (0.8) is recorded too: an inpaint without --strength says `Denoising strength: 0.8`."""
    init, mask = tmp_path / "init.png", tmp_path / "mask.png"
    picture(64, 64, 3).save(init)
    m = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(m).rectangle((0, 0, 63, 31), fill=255)
    m.save(mask)
    for extra, strength in ((["--mask", mask], "0.8"), (["--strength", "0.5"], "0.5")):
        out = tmp_path / f"{strength}.png"
        args = gen_args(snapshot, out, "--init-image", init, *extra)
        for side in ("-W", "-H"):
            del args[args.index(side) : args.index(side) + 2]
        code, _, err = cli(*args)
        assert code == 0, err
        assert a1111_read(Image.open(out).text["parameters"])[1]["Denoising strength"] == strength
        assert read_record(out)["strength"] == float(strength)


def test_from_reruns_an_image_exactly_ours_and_a1111s(cli, base, lora_dir, tmp_path):
    """`--from IMAGE` gives the image again bit for bit in its own dtype (bfloat16, a Base model's CFG and
    negative prompt, a tag's LoRA), an option beside it overrides, and an A1111 PNG's text reruns as the
    same command typed out."""
    first, again, other = tmp_path / "first.png", tmp_path / "again.png", tmp_path / "other.png"
    common = ["--model", base, "-W", "64", "-H", "64", "--lora-dir", lora_dir]
    code, _, err = cli(
        "generate", *common, "-p", "a fox <lora:style:0.5>", "--steps", "2", "--seed", "4", "--guidance", "2.5",
        "--negative-prompt", "blurry", "-o", first,
    )  # fmt: skip
    assert code == 0, err
    code, _, err = cli("generate", "--from", first, "--model", base, "--lora-dir", lora_dir, "-o", again)
    assert code == 0, err
    assert np.array_equal(pixels(first), pixels(again))
    assert read_record(again) == read_record(first)
    assert read_record(first)["dtype"] == "bfloat16"
    code, _, err = cli("generate", "--from", first, "--model", base, "--lora-dir", lora_dir, "--seed", "9", "-o", other)
    assert code == 0, err
    assert read_record(other)["seed"] == 9 and not np.array_equal(pixels(first), pixels(other))

    theirs, typed, rerun = tmp_path / "a1111.png", tmp_path / "typed.png", tmp_path / "rerun.png"
    info = PngInfo()
    info.add_text(
        "parameters",
        "a cat, <lora:style:0.7> on a sofa\nNegative prompt: dark\nSteps: 2, Sampler: DPM++ 2M, "
        'CFG scale: 3, Seed: 11, Size: 64x80, Model hash: 0123456789, Model: "sdxl, v1", Version: v1.10.1',
    )
    Image.new("RGB", (64, 80)).save(theirs, pnginfo=info)
    code, _, err = cli("generate", "--from", theirs, "--model", base, "--lora-dir", lora_dir, "-o", rerun)
    assert code == 0, err
    code, _, err = cli(
        "generate", "--model", base, "-p", "a cat, <lora:style:0.7> on a sofa", "--negative-prompt", "dark",
        "--steps", "2", "--guidance", "3", "--seed", "11", "-W", "64", "-H", "80", "--lora-dir", lora_dir, "-o", typed,
    )  # fmt: skip
    assert code == 0, err
    assert np.array_equal(pixels(rerun), pixels(typed))
    assert read_record(rerun)["prompt"] == "a cat, on a sofa"


def test_python_resolves_tags_and_refuses_them_unresolved(snapshot, lora_dir):
    prompt, loras = flux_klein_mlx.resolve_lora_tags("a fox <lora:style:0.8>", lora_dir)
    assert prompt == "a fox" and loras == [(lora_dir / "style.safetensors", 0.8)]
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", loras=loras)
    with pytest.raises(FluxKleinError, match="resolve_lora_tags"):
        pipe.generate("a fox <lora:style:0.8>", width=64, height=64, steps=1, seed=1)


def write_record_png(path, record=None, parameters=None):
    info = PngInfo()
    if record is not None:
        info.add_text("flux_klein_mlx", json.dumps(record))
    if parameters is not None:
        info.add_text("parameters", parameters)
    Image.new("RGB", (64, 64)).save(path, pnginfo=info)
    return path


@pytest.mark.parametrize(
    "case,words",
    [
        ("unknown", ["no LoRA named 'nope'", "the LoRA folder", "it holds style"]),
        ("weight", ["<lora:style:heavy>", "is not a number"]),
        ("nan", ["weight must be a finite number"]),
        ("empty", ["names no LoRA"]),
        ("twice", ["names LoRA 'style' twice"]),
        ("no-dir", ["give the folder of LoRAs with --lora-dir"]),
        ("dir-is-file", ["is not a folder"]),
        ("from-missing", ["--from", "no such file"]),
        ("from-text", ["--from", "not an image"]),
        ("from-bare", ["holds no record (neither ours nor A1111's"]),
        ("from-refs", ["made with 2 --image image(s)", "give them with --image"]),
        ("from-init", ["made with 1 --init-image image(s)"]),
        ("from-latents", ["given latents"]),
        ("from-a1111-seed", ["Seed: 'abc' is not a whole number"]),
    ],
)
def test_bad_tags_and_from_are_one_line_before_any_model(cli, snapshot, lora_dir, tmp_path, no_models, case, words):
    out = tmp_path / "out.png"
    args = gen_args(snapshot, out, "--lora-dir", lora_dir)
    prompt = {
        "unknown": "a <lora:nope:1>",
        "weight": "a <lora:style:heavy>",
        "nan": "a <lora:style:nan>",
        "empty": "a <lora::1>",
        "twice": "<lora:style:1> a <lora:style:0.5>",
        "no-dir": "a <lora:style>",
        "dir-is-file": "a fox",
    }
    if case in prompt:
        args[args.index("a fox")] = prompt[case]
    if case == "no-dir":
        del args[args.index("--lora-dir") : args.index("--lora-dir") + 2]
    if case == "dir-is-file":
        args[args.index("--lora-dir") + 1] = lora_dir / "style.safetensors"
    record = {"prompt": "a", "seed": 1, "steps": 1, "width": 64, "height": 64, "noise": "torch", "references": []}
    sources = {
        "from-missing": tmp_path / "none.png",
        "from-text": tmp_path / "notes.png",
        "from-bare": write_record_png(tmp_path / "bare.png"),
        "from-refs": write_record_png(tmp_path / "r.png", {**record, "references": ["a" * 12, "b" * 12]}),
        "from-init": write_record_png(tmp_path / "i.png", {**record, "init_image": "c" * 12, "strength": 0.5}),
        "from-latents": write_record_png(tmp_path / "l.png", {**record, "noise": "latents"}),
        "from-a1111-seed": write_record_png(tmp_path / "a.png", parameters="a\nSteps: 2, Seed: abc, Size: 64x64"),
    }
    (tmp_path / "notes.png").write_text("not an image")
    if case in sources:
        args += ["--from", sources[case]]
    code, _, err = cli(*args)
    assert_one_line_error(code, err, *words)
    assert not out.exists() and not no_models


# --- Hypothesis: any prompt's tags split into names and weights, or one line (issue 46) ----------------

TAG_TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from(list("<>:.\n 0123456789e-+naif")), max_size=30)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(TAG_TEXT, TAG_TEXT.map(lambda t: f"<lora:{t}>")), max_size=5), st.lists(TAG_TEXT, max_size=2))
def test_any_prompt_splits_or_is_one_line(parts, listed):
    prompt = " ".join(parts)
    try:
        clean, tags = split_lora_tags(prompt, listed=listed)
    except FluxKleinError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) < 300
        return
    assert LORA_TAG.search(clean) is None  # the model never sees a tag
    names = [name for name, _ in tags]
    assert len(set(names)) == len(names) and all(name for name in names)
    assert all(math.isfinite(weight) for _, weight in tags)
