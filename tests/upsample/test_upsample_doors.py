"""FLUX 3's upsampler through every door: `generate --upsample --box`, the `upsample` command, the hint, the
record and A1111's parameters, the server's `upsample` / `boxes` fields and `revised_prompt`. The upsampler is
tests/support/tiny_pup.py's `quick_pup` (one-token captions: the parity itself is test_upsampler.py's)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_vlm")

from command_line import assert_one_line_error, gen_args  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_flux3 import shared_tiny_flux3_snapshot  # noqa: E402
from tiny_pup import processors_built_once, quick_pup, shared_tiny_pup  # noqa: E402

import flux_klein_mlx  # noqa: E402

BOX = "0.1,0.2,0.6,0.9:a fox"


@pytest.fixture(scope="module")
def flux3(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="module", autouse=True)
def one_processor_per_folder():
    yield from processors_built_once()  # the in-process loads of one folder build its processor once (~2.6 s each)


@pytest.fixture(scope="module")
def pup(tmp_path_factory):
    return quick_pup(shared_tiny_pup(tmp_path_factory), tmp_path_factory.mktemp("quick"))


def test_generate_upsample_box_records_both_prompts_and_caches_the_caption(cli, flux3, pup, tmp_path):
    args = ["--upsample", "--upsampler", pup, "--box", BOX]
    code, out, err = cli(*gen_args(flux3, tmp_path / "a.png", *args))
    assert code == 0, err
    assert "prompt upsampler (t2i_bbox): writing the caption" in err and "upsample " in err.splitlines()[-1]
    image = Image.open(out.strip())
    record = json.loads(image.text["flux_klein_mlx"])
    caption = record["revised_prompt"]
    assert record["prompt"] == "a fox" and caption.endswith("]") and caption in err
    assert record["boxes"] == [{"bbox": [0.2, 0.1, 0.9, 0.6], "desc": "a fox"}]
    parameters = image.text["parameters"].splitlines()
    assert parameters[0] == caption and "Original prompt: a fox" in parameters[-1]
    code, out, err = cli(*gen_args(flux3, tmp_path / "b.png", *args))
    assert code == 0 and "from the caption cache" in err
    code, out, err = cli("upsample", "--prompt", "a fox", "--box", BOX, "--upsampler", pup)
    assert code == 0 and out.strip() == caption


def test_a_short_flux3_prompt_without_upsample_gets_one_hint(cli, flux3, distilled, tmp_path):
    code, _, err = cli(*gen_args(flux3, tmp_path / "a.png"))
    hints = [line for line in err.splitlines() if line.startswith("hint:")]
    assert code == 0 and len(hints) == 1 and "--upsample writes one" in hints[0] and "18.8 GB" in hints[0]
    code, _, err = cli(*gen_args(distilled, tmp_path / "b.png"))
    assert code == 0 and "hint:" not in err  # FLUX.2 reads prompts as written


def test_the_doors_refuse_in_one_line(cli, distilled, flux3, pup, tmp_path):
    code, _, err = cli(*gen_args(distilled, tmp_path / "a.png", "--upsample"))
    assert_one_line_error(code, err, "--upsample is for FLUX 3 Image Klein", "FLUX.2 [klein] reads your prompt")
    code, _, err = cli(*gen_args(flux3, tmp_path / "b.png", "--box", "0.5,0,0.4,1:x"))
    assert_one_line_error(code, err, "is empty: it needs x0 < x1")
    code, _, err = cli("upsample", "--prompt", "a fox", "--box", "0,0,1.5,1:x", "--upsampler", pup)
    assert_one_line_error(code, err, "lies outside the image")


def test_the_server_answers_upsample_with_revised_prompt(flux3, pup, tmp_path_factory):
    pytest.importorskip("starlette")
    from serving import KEY, http, start_server

    for server in start_server(flux3, ["--api-key", KEY, "--upsampler", str(pup)], tmp_path_factory):
        assert server.status()["upsampler"] is True
        body = {"prompt": "a fox", "size": "64x64", "seed": 2, "steps": 1, "upsample": True, "boxes": [BOX]}
        res = server.client().images.generate(model=server.status()["model"], prompt="a fox", extra_body=body)
        pipe = flux_klein_mlx.load(flux3, cache=False, upsampler=pup)
        pipe.generate("a fox", width=64, height=64, seed=2, steps=1, upsample=True, boxes=[BOX])
        assert res.data[0].revised_prompt == pipe.last_metadata["revised_prompt"]
        bad = dict(body, boxes=["1,0,0.5,1:x"])
        headers = {**server.auth, "Content-Type": "application/json"}
        status, reply = http("POST", f"{server.url}/v1/images/generations", json.dumps(bad).encode(), headers)
        assert status == 400 and "is empty: it needs x0 < x1" in json.dumps(reply)


def test_convert_and_quantize_write_a_4_or_8_bit_upsampler_that_runs(cli, pup, tmp_path):
    code, out, err = cli("convert", "--model", pup, "--output", tmp_path / "q8", "--quantize", "8", "--group-size", 32)
    assert code == 0, err
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["quantization"]["bits"] == 8
    assert not list(tmp_path.glob("q8.tmp-*"))  # written whole, through files.folder_transaction
    code, out, err = cli("upsample", "--prompt", "a fox", "--upsampler", tmp_path / "q8", "--no-cache")
    assert code == 0 and out.strip(), err
    code, _, err = cli("quantize", "--model", pup, "--bits", 4, "--group-size", 32, "--output", tmp_path / "q4")
    assert code == 0 and json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]["bits"] == 4
    code, _, err = cli("convert", "--model", pup, "--output", tmp_path / "q8", "--quantize", "8")
    assert_one_line_error(code, err, "exists; give another --output")
