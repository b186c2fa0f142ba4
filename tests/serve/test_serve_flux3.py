"""The server with a FLUX 3 Image Klein model, in its default dtype (bfloat16): the OpenAI client's generate and
edit give exactly the pipeline's images, the status names the model, and a bad request leaves it serving."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from PIL import Image  # noqa: E402
from refs import picture  # noqa: E402
from serving import KEY, http, start_server  # noqa: E402
from tiny_flux3 import shared_tiny_flux3_snapshot  # noqa: E402

import flux_klein_mlx  # noqa: E402


@pytest.fixture(scope="module")
def flux3(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="module")
def server(flux3, tmp_path_factory):
    yield from start_server(flux3, ["--api-key", KEY, "--model-id", "flux3-tiny"], tmp_path_factory)


def decode(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()
    return im


def test_generate_and_edit_equal_the_pipeline_in_bfloat16(server, flux3):
    status = server.status()
    assert status["state"] == "ready" and status["variant"] == "FLUX 3 Image Klein" and status["distilled"]
    client = server.client()
    res = client.images.generate(
        model="flux3-tiny", prompt="a fox", size="64x64", response_format="b64_json", extra_body={"seed": 3, "steps": 2}
    )
    im = decode(res.data[0].b64_json)
    record = json.loads(im.text["flux_klein_mlx"])
    assert record["variant"] == "FLUX 3 Image Klein" and record["dtype"] == "bfloat16"
    pipe = flux_klein_mlx.load(flux3, cache=False)  # the default dtype, as the server's
    ours = pipe.generate("a fox", width=64, height=64, seed=3, steps=2)
    np.testing.assert_array_equal(np.asarray(im.convert("RGB")), np.asarray(ours))

    ref = picture(72, 40, seed=4)  # one odd-sized reference: its canvas, cropped back to it
    buf = io.BytesIO()
    ref.save(buf, format="PNG")
    res = client.images.edit(
        image=("r.png", buf.getvalue(), "image/png"), prompt="at night", extra_body={"seed": 5, "steps": 2}
    )
    edit = decode(res.data[0].b64_json)
    ours = pipe.generate("at night", seed=5, steps=2, images=[ref])
    assert edit.size == ours.size == (72, 40)
    np.testing.assert_array_equal(np.asarray(edit.convert("RGB")), np.asarray(ours))


def test_a_flux3_model_card_offers_the_upsampler_before_it_is_loaded(flux3, snapshot):
    """`serve --model A --model B`: the page shows the upsample checkbox and the box editor for a picked FLUX 3
    model from its card in /v1/status, before the switch loads it (a FLUX.2 card says no)."""
    from flux_klein_mlx.serve.command import model_card

    assert model_card(flux_klein_mlx.load(flux3, cache=False))["upsampler"] is True
    assert model_card(flux_klein_mlx.load(snapshot, cache=False))["upsampler"] is False


def test_a_bad_request_is_answered_and_the_next_one_runs(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({"prompt": "a fox", "size": "40x64"}).encode()
    code, answer = http("POST", server.url + "/v1/images/generations", body, auth)
    assert code == 400 and "40" in json.dumps(answer)
    body = json.dumps({"prompt": "a fox", "size": "64x64", "steps": 1, "seed": 1}).encode()
    code, answer = http("POST", server.url + "/v1/images/generations", body, auth, timeout=120)
    assert code == 200 and answer["data"][0]["b64_json"]
