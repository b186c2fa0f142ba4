"""Outpainting on the page (issue 40), in a headless Chromium against the real server (the tiny distilled
model in the default dtype, bfloat16): "outpaint" on a result or a history item opens its canvas; dragging
its edges (ActionChains: a mouse, and a touch) adds the px dragged, shown rounded to 16 as the server
rounds them (`outpaint.round_pads`); "outpaint" sends them with the form's prompt, seed and steps.

The judges are on the server's side: the result's size and record (the pads as run), the source image's
pixels kept bit for bit where the method keeps them (`outpaint_canvas`'s alpha 0), and the image equal to
the Python pipeline's `generate(init_image=..., outpaint=pads)` with the same seed and dtype (exact). A
canvas past 4096 px is one line on the page and no job reaches the server; reset returns to zero pads.
"""

from __future__ import annotations

import io
import math
import re
import time

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("openai")
pytest.importorskip("starlette")

from browsing import browser, fill, last_record, needs_chromium, page_bytes, run_and_wait  # noqa: E402
from serving import start_server  # noqa: E402

import flux_klein_mlx  # noqa: E402
from flux_klein_mlx.inputs.outpaint import outpaint_canvas, round_pads  # noqa: E402

pytestmark = needs_chromium
SIDES = ("left", "top", "right", "bottom")


@pytest.fixture(scope="module")
def served(snapshot, tmp_path_factory):
    """`serve` as a new user starts it: the default dtype (bfloat16)."""
    yield from start_server(snapshot, ["--model-id", "klein-tiny"], tmp_path_factory)


def open_page(served, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(served.url + "/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "status").text.endswith(" ready"))
    return wait


def drag(driver, side: str, travel: int, touch: bool = False) -> int:
    """Drag one edge's handle `travel` screen px outwards; the px the page should ask for on that side
    (outpaint.js: Math.round(before + travel / scale), the scale the canvas had when the drag began)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions import interaction
    from selenium.webdriver.common.actions.pointer_input import PointerInput
    from selenium.webdriver.common.by import By

    driver.execute_script("document.getElementById('outpaint-frame').scrollIntoView({block: 'center'})")
    scale = float(driver.find_element(By.ID, "outpaint-area").get_attribute("data-scale"))
    before = int(driver.find_element(By.ID, f"outpaint-{side}").get_attribute("value"))
    handle = driver.find_element(By.CSS_SELECTOR, f"#outpaint-area .op-handle[data-side={side}]")
    dx, dy = {"left": (-travel, 0), "top": (0, -travel), "right": (travel, 0), "bottom": (0, travel)}[side]
    devices = [PointerInput(interaction.POINTER_TOUCH, "finger")] if touch else None
    ActionChains(driver, devices=devices).move_to_element(handle).click_and_hold().move_by_offset(
        dx // 2, dy // 2
    ).move_by_offset(dx - dx // 2, dy - dy // 2).release().perform()
    return max(0, math.floor(before + travel / scale + 0.5))


def shown(driver) -> dict:
    from selenium.webdriver.common.by import By

    return {side: driver.find_element(By.ID, f"outpaint-amount-{side}").text for side in SIDES}


def test_dragged_edges_are_the_pads_the_server_outpaints(served, snapshot, tmp_path):
    """Right and bottom dragged by amounts that are not multiples of 16: the page shows each rounded up to
    16 and says so, the fields follow; the server's result is the canvas of those pads (size and record), the
    source image's pixels outside the seam bit for bit, and exactly the pipeline's outpaint (bfloat16)."""
    from selenium.webdriver.common.by import By

    with browser(tmp_path) as driver:
        wait = open_page(served, driver)
        fill(driver, prompt="a fox", width=80, height=64, steps=1, seed=3)
        run_and_wait(driver, wait)
        source = Image.open(io.BytesIO(page_bytes(driver, "flux.state.history[0].blob"))).convert("RGB")
        driver.find_element(By.CSS_SELECTOR, "#results button[data-use=outpaint]").click()
        wait.until(lambda d: d.find_element(By.ID, "outpaint-box").is_displayed())
        assert driver.find_element(By.ID, "mode-note").text.startswith("outpainting")
        assert shown(driver) == {side: f"{side} 0" for side in SIDES}
        scale = float(driver.find_element(By.ID, "outpaint-area").get_attribute("data-scale"))
        right = drag(driver, "right", round(37 * scale))
        wait.until(lambda d: d.find_element(By.ID, "outpaint-right").get_attribute("value") == str(right))
        scale = float(driver.find_element(By.ID, "outpaint-area").get_attribute("data-scale"))  # refit after a drag
        bottom = drag(driver, "bottom", round(21 * scale))
        wait.until(lambda d: d.find_element(By.ID, "outpaint-bottom").get_attribute("value") == str(bottom))
        pads, _ = round_pads((0, 0, right, bottom), 80, 64)
        assert right % 16 and bottom % 16 and pads[2] > right and pads[3] > bottom  # so rounding shows
        assert shown(driver) == {
            "left": "left 0",
            "top": "top 0",
            "right": f"right +{pads[2]} ({right} rounded to 16)",
            "bottom": f"bottom +{pads[3]} ({bottom} rounded to 16)",
        }
        width, height = 80 + pads[2], 64 + pads[3]
        assert driver.find_element(By.ID, "outpaint-size").text == f"canvas {width} × {height} px (the image 80 × 64)"
        fill(driver, prompt="a fox on a wide field")
        run_and_wait(driver, wait, button="outpaint-send")
        record = last_record(driver)
        result = np.asarray(Image.open(io.BytesIO(page_bytes(driver, "flux.state.history[0].blob"))).convert("RGB"))
        meta = driver.find_element(By.CSS_SELECTOR, "#results figure .meta").text.splitlines()
    assert record["outpaint"] == list(pads) and f"outpaint: {', '.join(map(str, pads))}" in meta
    assert (record["width"], record["height"]) == (width, height) and result.shape == (height, width, 3)
    assert (record["seed"], record["steps"], record["dtype"]) == (3, 1, "bfloat16")
    _, _, kept = outpaint_canvas(source, pads)
    keep = kept.alpha == 0
    assert keep.sum() >= 48 * 32 and np.array_equal(result[keep], kept.original[keep])  # the source, bit for bit
    pipe = flux_klein_mlx.load(snapshot)  # the default dtype, as served
    ours = pipe.generate("a fox on a wide field", init_image=source, outpaint=pads, seed=3, steps=1)
    assert pipe.last_metadata["dtype"] == "bfloat16"
    np.testing.assert_array_equal(result, np.asarray(ours.convert("RGB")))


def test_past_4096_px_is_one_line_and_nothing_runs_and_reset_returns_to_zero(served, tmp_path):
    """From a history item: a touch drag on the left edge adds px there, reset clears it; the right edge
    dragged until the canvas passes 4096 px: one line under the canvas, "outpaint" puts it in the page's
    error line and no job reaches the server; after reset the canvas is the image again (zero pads), and
    an outpaint of nothing is refused too."""
    from selenium.webdriver.common.by import By

    with browser(tmp_path) as driver:
        wait = open_page(served, driver)
        fill(driver, prompt="a hill", width=64, height=64, steps=1, seed=5)
        run_and_wait(driver, wait)
        driver.find_element(By.CSS_SELECTOR, "#history button[data-use=outpaint]").click()
        wait.until(lambda d: d.find_element(By.ID, "outpaint-box").is_displayed())
        left = drag(driver, "left", 30, touch=True)
        assert left > 0
        wait.until(lambda d: d.find_element(By.ID, "outpaint-left").get_attribute("value") == str(left))
        driver.find_element(By.ID, "outpaint-reset").click()
        assert shown(driver) == {side: f"{side} 0" for side in SIDES}
        for _ in range(10):  # each drag at the scale that fits the canvas so far: it grows several-fold
            drag(driver, "right", 400)
            if driver.find_element(By.ID, "outpaint-warn").text:
                break
        warn = driver.find_element(By.ID, "outpaint-warn").text
        m = re.fullmatch(
            r"the canvas would be (\d+) × 64 px, past the server's 4096 px a side: drag an edge back \(or reset\)", warn
        )
        assert m and int(m.group(1)) > 4096, warn
        jobs = served.status()
        driver.find_element(By.ID, "outpaint-send").click()
        wait.until(lambda d: d.find_element(By.ID, "error").text == warn)
        time.sleep(0.5)  # a request, had one been sent, would be queued or running by now
        after = served.status()
        assert after["completed"] == jobs["completed"] and not after["running"] and not after["waiting"]
        assert driver.execute_script("return flux.state.history.length") == 1
        driver.find_element(By.ID, "outpaint-reset").click()
        assert shown(driver) == {side: f"{side} 0" for side in SIDES}
        assert [driver.find_element(By.ID, f"outpaint-{s}").get_attribute("value") for s in SIDES] == ["0"] * 4
        assert driver.find_element(By.ID, "outpaint-size").text == "canvas 64 × 64 px (the image 64 × 64)"
        assert driver.find_element(By.ID, "outpaint-warn").text == ""
        driver.find_element(By.ID, "outpaint-send").click()
        wait.until(lambda d: d.find_element(By.ID, "error").text.startswith("drag an edge of the image"))
        assert served.status()["completed"] == jobs["completed"]
