"""A headless Chromium for the page's tests (tests/serve/): `browser` opens one with its own profile,
`fill` types into fields by id; `needs_chromium` skips where Chromium or its driver is not installed;
`run_and_wait` presses Generate and waits for its result, `page_bytes` reads a Blob the page holds and
`last_record` the record of the newest history image."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil

import pytest
from PIL import Image


def chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


needs_chromium = pytest.mark.skipif(
    chromium() is None,
    reason="headless Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does this)",
)


@contextlib.contextmanager
def browser(tmp_path, width=1280, height=900):
    """A headless Chromium with its own profile (so storage survives reloads within a test)."""
    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    path, driver_path = chromium()
    opts = webdriver.ChromeOptions()
    opts.binary_location = path
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--window-size={width},{height}",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def fill(driver, **fields):
    from selenium.webdriver.common.by import By

    for field, value in fields.items():
        el = driver.find_element(By.ID, field)
        el.clear()
        el.send_keys(str(value))


def page_bytes(driver, expression: str) -> bytes:
    """The bytes of a Blob or File the page holds (`expression` evaluates to it)."""
    b64 = driver.execute_async_script(
        f"const done = arguments[0]; const blob = {expression};"
        "const r = new FileReader(); r.onload = () => done(r.result.split(',')[1]); r.readAsDataURL(blob);"
    )
    return base64.b64decode(b64)


def last_record(driver) -> dict:
    png = page_bytes(driver, "flux.state.history[0].blob")
    return json.loads(Image.open(io.BytesIO(png)).text["flux_klein_mlx"])


def run_and_wait(driver, wait, ctrl_enter=False, button="generate"):
    """Generate (Ctrl+Enter, or a click on `button`), wait for its image in the history, and no error."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = driver.execute_script("return flux.state.history.length")
    if ctrl_enter:
        driver.find_element(By.ID, "prompt").send_keys(Keys.CONTROL, Keys.ENTER)
    else:
        driver.find_element(By.ID, button).click()
    wait.until(
        lambda d: (
            d.execute_script("return flux.state.history.length") == before + 1
            or d.find_element(By.ID, "step-label").text == "failed"
        )
    )
    wait.until(lambda d: d.find_element(By.ID, "step-label").text.startswith(("done", "failed")))
    assert driver.find_element(By.ID, "error").text == ""
