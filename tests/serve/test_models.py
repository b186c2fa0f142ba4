"""Several models on one server (issue 40): `serve --model A --model B`, loaded one at a time.

The judge for images is `load(model).generate` run here on the same request (float32: exact). The worker's
switch is also checked in this process: after a request for B, A's components are released and B's loaded.
"""

from __future__ import annotations

import base64
import io
import json
import threading

import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from browsing import browser, fill, needs_chromium  # noqa: E402
from command_line import assert_one_line_error  # noqa: E402
from serving import start_server  # noqa: E402

import flux_klein_mlx  # noqa: E402


@pytest.fixture(scope="module")
def named(snapshot, base, tmp_path_factory):
    """The tiny distilled and Base snapshots under the names the server will give them (the last part)."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "klein-fast").symlink_to(snapshot, target_is_directory=True)
    (folder / "klein-base").symlink_to(base, target_is_directory=True)
    return folder / "klein-fast", folder / "klein-base"


@pytest.fixture(scope="module")
def two(named, tmp_path_factory):
    fast, slow = named
    yield from start_server(fast, ["--model", str(slow), "--dtype", "float32"], tmp_path_factory)


def image_of(res) -> tuple[np.ndarray, dict]:
    im = Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json)))
    return np.asarray(im.convert("RGB")), json.loads(im.text["flux_klein_mlx"])


def test_requests_pick_the_model_and_get_its_image(two, named):
    """/v1/models lists both; a request naming the Base model gets exactly its image (and the status says it is
    the one loaded now), one without a model stays on it, one naming the first switches back; an unknown name
    is a 404 naming both."""
    fast, slow = named
    client = two.client()
    assert [m.id for m in client.models.list().data] == ["klein-fast", "klein-base"]
    st = two.status()
    assert st["model"] == "klein-fast" and [m["id"] for m in st["models"]] == ["klein-fast", "klein-base"]
    assert [m["distilled"] for m in st["models"]] == [True, False]
    assert [m["upsampler"] for m in st["models"]] == [False, False]  # FLUX.2: no upsample, no boxes
    kw = dict(prompt="a red fox", size="64x64", extra_body={"seed": 3, "steps": 2})
    got, record = image_of(client.images.generate(model="klein-base", **kw))
    ours = flux_klein_mlx.load(slow, dtype="float32").generate("a red fox", width=64, height=64, seed=3, steps=2)
    np.testing.assert_array_equal(got, np.asarray(ours))
    assert record["model"] == "klein-base" and two.status()["model"] == "klein-base"
    again, _ = image_of(client.images.generate(**kw))  # no model named: the one loaded now
    np.testing.assert_array_equal(again, got)
    back, record = image_of(client.images.generate(model="klein-fast", **kw))
    ours = flux_klein_mlx.load(fast, dtype="float32").generate("a red fox", width=64, height=64, seed=3, steps=2)
    np.testing.assert_array_equal(back, np.asarray(ours))
    assert record["model"] == "klein-fast" and two.status()["model"] == "klein-fast"
    with pytest.raises(openai.NotFoundError, match="serves 'klein-fast', 'klein-base'"):
        client.images.generate(model="klein-9b", **kw)


def test_the_worker_holds_one_model_at_a_time(named):
    """In this process: a request for the other model releases the first's components before the second's load."""
    from flux_klein_mlx.inputs.settings import RunSettings
    from flux_klein_mlx.serve.jobs import EndEvent, ImageRequest, Worker

    pipes = {name: flux_klein_mlx.load(path, dtype="float32") for name, path in zip(("a", "b"), named, strict=True)}
    worker = Worker(lambda: pipes["a"], max_queue=2, model_id="a", switch=lambda name: pipes[name])
    worker.start()
    try:
        assert worker.wait_ready(60)
        for name in ("a", "b"):
            done = threading.Event()
            ends = []
            req = ImageRequest(settings=RunSettings("a fox", width=64, height=64, steps=1, seed=1), model=name)
            worker.submit(req, lambda e, ends=ends, done=done: isinstance(e, EndEvent) and (ends.append(e), done.set()))
            assert done.wait(120) and ends[0].kind == "done", ends
            other = pipes["a" if name == "b" else "b"]
            assert pipes[name].is_loaded("transformer") and not other.is_loaded("transformer")
            assert not other.is_loaded("vae") and worker.status()["model"] == name
    finally:
        worker.stop()


def test_several_models_need_their_own_names(cli, named, tmp_path):
    fast, _ = named
    code, _, err = cli("serve", "--model", fast, "--model", fast, "--port", "1")
    assert_one_line_error(code, err, "--model klein-fast is given twice")
    code, _, err = cli("serve", "--model", fast, "--model", named[1], "--model-id", "x", "--port", "1")
    assert_one_line_error(code, err, "--model-id names the one --model")


@needs_chromium
def test_the_page_picks_a_model_and_the_header_says_the_switch(two, tmp_path):
    """The picker lists both; picking the Base model shows its guidance fields; a run on it switches the server,
    and the header names it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with browser(tmp_path) as driver:
        driver.get(two.url + "/")
        wait = WebDriverWait(driver, 60, poll_frequency=0.1)
        wait.until(lambda d: d.find_element(By.ID, "status").text.endswith(" ready"))
        current = two.status()["model"]
        other = "klein-base" if current == "klein-fast" else "klein-fast"
        picker = Select(driver.find_element(By.ID, "model-pick"))
        assert [o.text for o in picker.options] == ["klein-fast", "klein-base"]
        assert picker.first_selected_option.text == current
        picker.select_by_visible_text(other)
        assert driver.find_element(By.ID, "base-only").is_displayed() == (other == "klein-base")
        fill(driver, prompt="a fox", width=64, height=64, steps=1, seed=1)
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: d.find_element(By.ID, "step-label").text.startswith(("done", "failed")))
        assert driver.find_element(By.ID, "error").text == ""
        wait.until(
            lambda d: (
                d.find_element(By.ID, "status").text.startswith(f"{other} (")
                and "ready" in d.find_element(By.ID, "status").text
            )
        )
        assert two.status()["model"] == other
