"""The page's Train tab (issue 47), in a headless Chromium against a real `serve` of the tiny Base model with
--train-dir and --lora-dir: images and a caption file dropped, captions edited beside their thumbnails with the
trigger shown as `train` applies it, the memory plan before anything starts, "Start training" (the data zipped
in the browser, uploaded, a job made), the live loss plot and the samples, "use this LoRA" filling the
generate form; Cancel and Resume; a phone-sized window.

The judges: the captions as trained are `train/data/dataset.with_trigger`'s; the plot's points are the job's
own metrics events (read with the official `openai` client); the plan shown is the line the job's run prints;
the data uploaded is what was dropped and typed (read back from the server's folder); the generation with the
trained LoRA equals `load(model, loras=[(that file, 1)])`'s image. Settings `train` refuses are one line in
the plan and at Start, and no job is made.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("openai")
pytest.importorskip("starlette")

from browsing import browser, fill, last_record, needs_chromium, page_bytes, run_and_wait  # noqa: E402
from refs import picture  # noqa: E402
from serving import http, start_server  # noqa: E402

import flux_klein_mlx  # noqa: E402
from flux_klein_mlx.train.data.dataset import with_trigger  # noqa: E402

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("train-dir"), tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def served(base, folders, tmp_path_factory):
    train_dir, lora_dir = folders
    args = [
        "--dtype",
        "float32",
        "--train-dir",
        str(train_dir),
        "--lora-dir",
        str(lora_dir),
        "--model-id",
        "klein-base-tiny",
    ]
    yield from start_server(base, args, tmp_path_factory)


def png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    picture(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def open_train_tab(served, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(served.url + "/")
    wait = WebDriverWait(driver, 180, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "status").text.endswith(" ready"))
    driver.find_element(By.ID, "tab-train").click()
    wait.until(lambda d: d.find_element(By.ID, "train-start").is_displayed())
    wait.until(lambda d: d.execute_script("return document.getElementById('train-model').value") == "klein-base-tiny")
    assert not driver.find_element(By.ID, "prompt").is_displayed()  # the generate form is the other tab
    return wait


def drop_files(driver, files: list[tuple[str, bytes, str]]):
    """Files dropped on the Train tab's drop zone (a real DragEvent carrying a DataTransfer)."""
    driver.execute_script(
        "const dt = new DataTransfer();"
        "for (const [name, b64, type] of arguments[0]) dt.items.add(new File("
        "  [Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, {type}));"
        "document.getElementById('train-drop').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true,"
        " cancelable: true}));",
        [[name, base64.b64encode(data).decode(), mime] for name, data, mime in files],
    )


def wait_status(driver, wait, word: str) -> None:
    """Wait until the job's status line says `word`; a timeout shows the line and the tab's error."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By

    try:
        wait.until(lambda d: f" {word}" in d.find_element(By.ID, "train-status").text)
    except TimeoutException:
        said = [driver.find_element(By.ID, id_).text for id_ in ("train-status", "train-error")]
        raise AssertionError(f"the job is not {word}: {said}") from None


def settings(driver, **fields):
    """The Train tab's fields by their id's tail (steps, rank, lr, resolution, sample-every, prompts, trigger)."""
    fill(driver, **{f"train-{k.replace('_', '-')}": v for k, v in fields.items()})


def test_the_train_tab_from_dropped_files_to_a_lora_used_in_a_generation(served, folders, base, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    train_dir, lora_dir = folders
    client = served.client()
    with browser(tmp_path) as driver:
        wait = open_train_tab(served, driver)
        drop_files(
            driver,
            [
                ("red.png", png(64, 64, 1), "image/png"),
                ("red.txt", b"a red square", "text/plain"),
                ("blue.png", png(80, 64, 2), "image/png"),
                ("notes.pdf", b"%PDF-1.4", "application/pdf"),
            ],
        )
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#train-items .train-item")) == 2)
        assert "notes.pdf is not an image" in driver.find_element(By.ID, "train-error").text
        captions = driver.find_elements(By.CSS_SELECTOR, "#train-items textarea")
        assert [c.get_attribute("value") for c in captions] == ["a red square", ""]  # red.txt beside red.png
        captions[1].send_keys("a blue [trigger] circle")
        settings(driver, trigger="sks")
        shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#train-items .trains-as")]
        assert shown == [f"trains as: {with_trigger(c, 'sks')}" for c in ("a red square", "a blue [trigger] circle")]
        Select(driver.find_element(By.ID, "train-preset")).select_by_value("full")
        settings(
            driver,
            steps=2,
            rank=4,
            lr="0.0005",
            resolution=64,
            sample_every=2,
            sample_steps=2,
            prompts="a lighthouse, sks style",
        )
        wait.until(lambda d: "it fits" in d.find_element(By.ID, "train-plan").text)
        plan_line = driver.execute_script("return flux.state.train.plan.memory.description")

        driver.find_element(By.ID, "train-start").click()
        wait_status(driver, wait, "done")
        assert driver.find_element(By.ID, "train-error").text == ""
        job = client.fine_tuning.jobs.list().data[0]
        assert job.status == "succeeded" and job.fine_tuned_model
        # what was uploaded is what was dropped and typed
        (upload,) = client.files.list().data
        data = train_dir / "files" / upload.id / "data"
        assert (data / "red.png").read_bytes() == png(64, 64, 1) and (data / "blue.png").read_bytes() == png(80, 64, 2)
        assert (data / "blue.txt").read_text() == "a blue [trigger] circle" and not (data / "notes.pdf").exists()
        # the plot is the job's metrics events; the plan shown is the job's own
        events = client.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]
        metrics = [(e.data["step"], e.data["train_loss"]) for e in events if e.type == "metrics"]
        plotted = driver.execute_script("return flux.state.train.losses.map((p) => [p.step, p.loss])")
        assert [tuple(p) for p in plotted] == metrics and len(metrics) == 2
        points = driver.find_element(By.ID, "train-loss-line").get_attribute("points").split()
        assert len(points) == 2
        assert plan_line in [e.message for e in events]
        # the samples as the job wrote them
        samples = [name for e in events for name in (e.data or {}).get("samples", [])]
        assert samples and driver.execute_script("return flux.state.train.samples.length") == len(samples)
        shown_sample = page_bytes(driver, "flux.state.train.samples.at(-1).blob")
        code, served_sample = http("GET", f"{served.url}/v1/fine_tuning/jobs/{job.id}/samples/{samples[-1]}")
        assert code == 200 and shown_sample == served_sample

        driver.find_element(By.ID, "train-use").click()
        wait.until(lambda d: d.find_element(By.ID, "prompt").is_displayed())
        box = driver.find_element(By.ID, f"lora-{job.fine_tuned_model}")
        assert box.is_selected() and not driver.find_element(By.ID, "train-start").is_displayed()
        assert driver.find_element(By.ID, "prompt").get_attribute("value").startswith("sks")
        fill(driver, prompt="sks, a lighthouse", width=64, height=64, seed=3, steps=2)
        run_and_wait(driver, wait)
        record = last_record(driver)
        assert [lora["name"] for lora in record["loras"]] == [f"{job.fine_tuned_model}.safetensors"]
        got = np.asarray(Image.open(io.BytesIO(page_bytes(driver, "flux.state.history[0].blob"))).convert("RGB"))
    lora = lora_dir / f"{job.fine_tuned_model}.safetensors"
    pipe = flux_klein_mlx.load(base, dtype="float32", loras=[(lora, 1.0)])
    ours = pipe.generate("sks, a lighthouse", width=64, height=64, seed=3, steps=2)
    np.testing.assert_array_equal(got, np.asarray(ours))


def test_cancel_stops_the_job_and_resume_continues_it(served, tmp_path):
    """Cancel after the first checkpoint (step 2): the job says cancelled and offers Resume; Resume runs it from
    its last checkpoint to its last step, the plot holding each step once (those after the checkpoint the
    resumed run's, as its events give them)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    client = served.client()
    with browser(tmp_path) as driver:
        wait = open_train_tab(served, driver)
        drop_files(driver, [("one.png", png(64, 64, 3), "image/png"), ("one.txt", b"a green field", "text/plain")])
        Select(driver.find_element(By.ID, "train-preset")).select_by_value("full")
        settings(driver, steps=12, rank=2, resolution=64, save_every=2, suffix="cut")
        driver.execute_script("document.getElementById('train-prompts').value = ''")
        driver.find_element(By.ID, "train-start").click()
        wait.until(lambda d: d.execute_script("return flux.state.train.checkpoints") >= 1)
        driver.find_element(By.ID, "train-cancel").click()
        wait_status(driver, wait, "cancelled")
        job = client.fine_tuning.jobs.retrieve(driver.execute_script("return flux.state.train.job.id"))
        assert job.status == "cancelled" and job.trained_tokens < 12
        assert driver.find_element(By.ID, "train-resume").is_displayed()
        assert not driver.find_element(By.ID, "train-use").is_displayed()

        driver.find_element(By.ID, "train-resume").click()
        wait_status(driver, wait, "done")
        plotted = driver.execute_script("return flux.state.train.losses.map((p) => [p.step, p.loss])")
        events = client.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]
        by_step = {e.data["step"]: e.data["train_loss"] for e in events if e.type == "metrics"}  # the last run's
        assert [tuple(p) for p in plotted] == sorted(by_step.items()) and len(plotted) == 12
        assert client.fine_tuning.jobs.retrieve(job.id).status == "succeeded"


def test_a_phone_sized_window_has_no_sideways_scroll_and_every_control_in_reach(served, tmp_path):
    """390 x 844: the tab, the drop zone, a caption, the options and Start training lie within the width, the page
    does not scroll sideways (a long file name included), and Start without data says so in one line."""
    from selenium.webdriver.common.by import By

    with browser(tmp_path, width=390, height=844) as driver:
        wait = open_train_tab(served, driver)
        driver.find_element(By.ID, "train-start").click()
        assert driver.find_element(By.ID, "train-error").text.startswith("drop the training images first")
        drop_files(
            driver,
            [("a-rather-long-file-name-that-goes-on-and-on-and-on-and-on-for-ever.png", png(64, 64, 4), "image/png")],
        )
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#train-items .train-item")) == 1)
        width = driver.execute_script("return document.documentElement.clientWidth")
        assert driver.execute_script("return document.documentElement.scrollWidth") <= width
        for id_ in (
            "tab-generate",
            "tab-train",
            "train-drop",
            "train-trigger",
            "train-model",
            "train-preset",
            "train-steps",
            "train-rank",
            "train-lr",
            "train-resolution",
            "train-prompts",
            "train-start",
        ):
            el = driver.find_element(By.ID, id_)
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
            box = driver.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.left, r.right]", el)
            assert 0 <= box[0] and box[1] <= width and el.is_displayed(), (id_, box, width)
        caption = driver.find_element(By.CSS_SELECTOR, "#train-items textarea")
        caption.send_keys("a tiny cat")
        driver.find_element(By.ID, "train-start").click()  # a caption, a model: nothing is refused here
        assert driver.find_element(By.ID, "train-error").text in ("", "uploading the data…")
        wait.until(lambda d: d.find_element(By.ID, "train-status").text.startswith("ftjob-"))
        served.client().fine_tuning.jobs.cancel(driver.execute_script("return flux.state.train.job.id"))


def test_the_plan_says_what_train_refuses_in_one_line_and_nothing_starts(served, tmp_path):
    """The plan is the job's own checks (a dry run): an image without a caption, then steps 0, are one line each
    under the settings; Start with steps 0 is refused in one line and makes no job."""
    from selenium.webdriver.common.by import By

    client = served.client()
    jobs_before = len(client.fine_tuning.jobs.list(limit=100).data)
    with browser(tmp_path) as driver:
        wait = open_train_tab(served, driver)
        drop_files(driver, [("lone.png", png(64, 64, 6), "image/png")])
        plan = lambda d: d.find_element(By.ID, "train-plan")  # noqa: E731
        wait.until(lambda d: "lone" in plan(d).text and "bad" in plan(d).get_attribute("class"))
        assert "\n" not in plan(driver).text
        driver.find_element(By.CSS_SELECTOR, "#train-items textarea").send_keys("a lone tree")
        wait.until(lambda d: "it fits" in plan(d).text)
        settings(driver, steps=0)
        wait.until(lambda d: "steps" in plan(d).text and "bad" in plan(d).get_attribute("class"))
        said = plan(driver).text
        assert "\n" not in said and "Traceback" not in said
        driver.find_element(By.ID, "train-start").click()
        wait.until(lambda d: d.find_element(By.ID, "train-error").text)
        assert driver.find_element(By.ID, "train-error").text == said.split(" · ")[-1]
    assert len(client.fine_tuning.jobs.list(limit=100).data) == jobs_before


def test_a_dropped_zip_is_read_in_the_browser_and_uploaded_as_train_reads_it(served, folders, tmp_path):
    """A zip made by Python (deflated, a kohya repeat folder, a caption beside each image) becomes thumbnails with
    their captions; the plan counts its images; what the server unpacks is the zip's images and captions."""
    import zipfile

    from selenium.webdriver.common.by import By

    train_dir, _ = folders
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("3_cat/a.png", png(64, 64, 7))
        z.writestr("3_cat/a.txt", "a grey cat, é")
        z.writestr("3_cat/b.png", png(64, 80, 8))
        z.writestr("3_cat/b.txt", "a black cat")
    with browser(tmp_path) as driver:
        wait = open_train_tab(served, driver)
        drop_files(driver, [("cats.zip", buf.getvalue(), "application/zip")])
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#train-items .train-item")) == 2)
        captions = [c.get_attribute("value") for c in driver.find_elements(By.CSS_SELECTOR, "#train-items textarea")]
        assert captions == ["a grey cat, é", "a black cat"]
        wait.until(lambda d: "it fits" in d.find_element(By.ID, "train-plan").text)
        assert driver.execute_script("return flux.state.train.plan.images") == 2
        file_id = driver.execute_script("return flux.state.train.upload.id")
    data = train_dir / "files" / file_id / "data" / "3_cat"
    assert (data / "a.png").read_bytes() == png(64, 64, 7) and (data / "b.png").read_bytes() == png(64, 80, 8)
    assert (data / "a.txt").read_text(encoding="utf-8") == "a grey cat, é"
