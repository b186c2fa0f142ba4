"""The page's layout-box editor (issue 36), in a headless Chromium against the real server: a tiny FLUX 3
Image Klein model in its default dtype (bfloat16), and a tiny FLUX.2 one, where the editor is hidden.

Boxes are drawn with real mouse drags (ActionChains) on the canvas and named in their rows. The judges are on
the server's side: the PNG record's `boxes` (upsample/boxes.check_boxes of what was sent), the server's job
count, and the image, equal bit for bit to the Python pipeline's with the same boxes. The boxes' coordinates
are checked against the drag's own screen points (the canvas's box read from the browser).
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
from serving import start_server  # noqa: E402
from test_page_next import drop  # noqa: E402
from tiny_flux3 import shared_tiny_flux3_snapshot  # noqa: E402

import flux_klein_mlx  # noqa: E402
from flux_klein_mlx.upsample.boxes import canvas_rows, check_boxes, layout_prompt  # noqa: E402

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def flux3(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="module")
def served(flux3, tmp_path_factory):
    yield from start_server(flux3, ["--model-id", "flux3-tiny"], tmp_path_factory)


@pytest.fixture(scope="module")
def pipe(flux3):
    return flux_klein_mlx.load(flux3, cache=False)  # the default dtype, as the server's


def open_page(server, driver, boxes_shown=True):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(server.url + "/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "status").text.endswith(" ready"))
    if boxes_shown:
        wait.until(lambda d: d.find_element(By.ID, "boxes-box").is_displayed())
    return wait


def draw(driver, frm: tuple[float, float], to: tuple[float, float]) -> list[float]:
    """A mouse drag on the box canvas from one point to another (fractions of the canvas); the screen points
    the drag went through, as [x0, y0, x1, y1] fractions of the canvas (the box the page should make)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = driver.find_element(By.ID, "boxes-canvas")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    r = driver.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.left, r.top, r.width, r.height]", canvas
    )
    left, top, w, h = r
    # Selenium aims at the whole pixel at the centre of the element's box, then moves by whole pixels.
    cx, cy = int(left + w / 2), int(top + h / 2)
    ax, ay = round(frm[0] * w + left) - cx, round(frm[1] * h + top) - cy
    bx, by = round(to[0] * w + left) - cx - ax, round(to[1] * h + top) - cy - ay
    ActionChains(driver).move_to_element_with_offset(canvas, ax, ay).click_and_hold().move_by_offset(
        bx, by
    ).release().perform()
    xs = sorted([(cx + ax - left) / w, (cx + ax + bx - left) / w])
    ys = sorted([(cy + ay - top) / h, (cy + ay + by - top) / h])
    return [xs[0], ys[0], xs[1], ys[1]]


def page_boxes(driver) -> list[dict]:
    return driver.execute_script("return flux.layout.boxes")


def rows(driver) -> list[tuple[str, str]]:
    """Each row's (name, coordinates shown)."""
    from selenium.webdriver.common.by import By

    return [
        (
            row.find_element(By.CLASS_NAME, "box-name").get_attribute("value"),
            row.find_element(By.CLASS_NAME, "box-coords").text,
        )
        for row in driver.find_elements(By.CSS_SELECTOR, "#boxes-list .box-row")
    ]


def canvas_aspect(driver) -> float:
    return driver.execute_script(
        "const r = document.getElementById('boxes-canvas').getBoundingClientRect(); return r.width / r.height"
    )


def test_drawn_named_boxes_are_what_the_server_runs_in_bfloat16(served, pipe, tmp_path):
    """Two boxes drawn and named, upsampling off: the record holds exactly those boxes, the image equals the
    pipeline's with them (bf16, bit for bit); a click adds none; one deleted, an edit (multipart) carries
    the other alone and equals the pipeline's edit; "reuse" puts both back."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with browser(tmp_path) as driver:
        wait = open_page(served, driver)
        Select(driver.find_element(By.ID, "size-preset")).select_by_value("1344x768")
        assert canvas_aspect(driver) == pytest.approx(1344 / 768, abs=0.02)  # the canvas follows the size
        fill(driver, prompt="a cat and a dog", width=64, height=64, steps=2, seed=3)
        assert canvas_aspect(driver) == pytest.approx(1, abs=0.02)
        width = driver.execute_script("return document.getElementById('boxes-canvas').getBoundingClientRect().width")

        drags = []
        for row, (frm, to, name) in enumerate(
            (((0.1, 0.45), (0.45, 0.95), "a grey cat"), ((0.93, 0.97), (0.55, 0.35), "a brown dog"))  # any direction
        ):
            drags.append(draw(driver, frm, to))
            wait.until(lambda d, row=row: len(rows(d)) == row + 1)
            driver.switch_to.active_element.send_keys(name)  # the new box's name field has the focus
        draw(driver, (0.3, 0.7), (0.3 + 2 / width, 0.7 + 2 / width))  # a click, not a box: selects the first
        boxes = page_boxes(driver)
        assert len(boxes) == 2 and driver.execute_script("return flux.layout.selected") == 0
        for box, drag in zip(boxes, drags, strict=True):
            got = [box["x0"], box["y0"], box["x1"], box["y1"]]
            assert got == [round(v, 3) for v in got] and got[0] < got[2] and got[1] < got[3]
            assert got == pytest.approx(drag, abs=1.5 / width)  # where the mouse went, within a pixel
        assert rows(driver) == [(b["desc"], ",".join(f"{b[k]:.3f}" for k in ("x0", "y0", "x1", "y1"))) for b in boxes]

        specs = driver.execute_script("return flux.boxesForRequest()")
        run_and_wait(driver, wait)
        record = last_record(driver)
        assert record["boxes"] == [dict(b) for b in check_boxes(specs)]
        assert [b["desc"] for b in record["boxes"]] == ["a grey cat", "a brown dog"]
        assert record["prompt"] == "a cat and a dog" and record["dtype"] == "bfloat16"
        assert record["revised_prompt"] == layout_prompt("a cat and a dog", canvas_rows(check_boxes(specs)))
        png = Image.open(io.BytesIO(page_bytes(driver, "flux.state.history[0].blob")))
        ours = pipe.generate("a cat and a dog", width=64, height=64, seed=3, steps=2, boxes=specs)
        np.testing.assert_array_equal(np.asarray(png.convert("RGB")), np.asarray(ours))

        driver.find_elements(By.CSS_SELECTOR, "#boxes-list .box-delete")[0].click()
        assert [b["desc"] for b in page_boxes(driver)] == ["a brown dog"]
        ref = tmp_path / "ref.png"
        picture(64, 64, 4).save(ref)
        driver.find_element(By.ID, "refs-file").send_keys(str(ref))
        wait.until(lambda d: d.find_element(By.ID, "mode-note").text == "editing with 1 reference image(s)")
        fill(driver, prompt="the dog at night")
        [spec] = driver.execute_script("return flux.boxesForRequest()")
        run_and_wait(driver, wait)
        record = last_record(driver)
        assert record["boxes"] == [dict(b) for b in check_boxes([spec])] and record["references"]
        png = Image.open(io.BytesIO(page_bytes(driver, "flux.state.history[0].blob")))
        ours = pipe.generate("the dog at night", width=64, height=64, seed=3, steps=2, images=[ref], boxes=[spec])
        np.testing.assert_array_equal(np.asarray(png.convert("RGB")), np.asarray(ours))

        driver.find_element(By.ID, "boxes-clear").click()
        assert page_boxes(driver) == [] and rows(driver) == []
        driver.find_elements(By.CSS_SELECTOR, "#history .reuse")[1].click()  # the first run: both boxes back
        wait.until(lambda d: len(rows(d)) == 2)
        assert driver.execute_script("return flux.boxesForRequest()") == specs


def test_an_unnamed_box_sends_nothing_and_a_dropped_png_brings_its_boxes(served, tmp_path):
    """A box without a name is one line on the page, no request leaves it (the page's fetches and the server's
    job count); a PNG made with boxes, dropped on the page, puts them in the editor."""
    from selenium.webdriver.common.by import By

    specs = ["0.1,0.2,0.5,0.9:a lamp", "0.6,0.25,0.95,0.75:a bookshelf"]
    made = served.client().images.generate(
        prompt="a room", size="64x64", extra_body={"seed": 4, "steps": 1, "boxes": specs}
    )
    with browser(tmp_path) as driver:
        wait = open_page(served, driver)
        drop(driver, "room.png", base64.b64decode(made.data[0].b64_json), "image/png")
        wait.until(lambda d: len(rows(d)) == 2)
        assert rows(driver) == [("a lamp", "0.100,0.200,0.500,0.900"), ("a bookshelf", "0.600,0.250,0.950,0.750")]
        assert driver.execute_script("return flux.boxesForRequest()") == specs

        fill(driver, prompt="a room", width=64, height=64, steps=1)
        draw(driver, (0.2, 0.2), (0.4, 0.4))
        wait.until(lambda d: len(rows(d)) == 3)
        driver.execute_script(
            "window.__posts = 0; const f = window.fetch;"
            "window.fetch = (url, o) => { if (o && o.method === 'POST') window.__posts += 1; return f(url, o); };"
        )
        done = served.status()["completed"]
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: d.find_element(By.ID, "error").text)
        error = driver.find_element(By.ID, "error").text
        assert error == 'box 3 has no name: type what it holds (e.g. "a red car") or delete it'
        assert driver.switch_to.active_element.get_attribute("aria-label") == "box 3's name"
        assert driver.execute_script("return window.__posts") == 0
        assert driver.find_element(By.ID, "step-label").text == "idle"
        assert served.status()["completed"] == done


@pytest.fixture(scope="module")
def flux2(snapshot, tmp_path_factory):
    yield from start_server(snapshot, ["--model-id", "klein-tiny"], tmp_path_factory)


def test_a_flux2_server_hides_the_editor_and_sends_no_boxes(flux2, served, tmp_path):
    """FLUX.2 reads no layout: the section stays hidden, and boxes a dropped FLUX 3 PNG brings are not sent
    (the run succeeds; its record has none)."""
    from selenium.webdriver.common.by import By

    made = served.client().images.generate(
        prompt="a room", size="64x64", extra_body={"seed": 4, "steps": 1, "boxes": ["0.1,0.2,0.5,0.9:a lamp"]}
    )
    with browser(tmp_path) as driver:
        wait = open_page(flux2, driver, boxes_shown=False)
        assert not driver.find_element(By.ID, "boxes-box").is_displayed()
        drop(driver, "room.png", base64.b64decode(made.data[0].b64_json), "image/png")
        wait.until(lambda d: d.find_element(By.ID, "prompt").get_attribute("value") == "a room")
        assert not driver.find_element(By.ID, "boxes-box").is_displayed()
        assert driver.execute_script("return flux.boxesForRequest()") is None
        run_and_wait(driver, wait)
        record = last_record(driver)
        assert "boxes" not in record and record["prompt"] == "a room"
        assert record["variant"] != "FLUX 3 Image Klein"
