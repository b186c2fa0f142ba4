"""A headless Chromium for the page's tests (tests/serve/): `browser` opens one with its own profile,
`fill` types into fields by id; `needs_chromium` skips where Chromium or its driver is not installed;
`run_and_wait` presses Generate and waits for its result, `page_bytes` reads a Blob the page holds and
`last_record` the record of the newest history image."""

from __future__ import annotations

import atexit
import base64
import contextlib
import io
import json
import shutil
import tempfile
from urllib.parse import urlsplit

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


def start_chromium(profile, width, height):
    """A headless Chromium with its profile in `profile`, its window `width` x `height` as given on the command
    line (a window sized afterwards differs: the flag's 390 px window is 500 px wide inside, a resized one 390)."""
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
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.set_page_load_timeout(30)
    atexit.register(driver.quit)
    return driver


def forget(driver) -> None:
    """Back to a fresh profile's state: one blank tab, and no storage (localStorage, IndexedDB, cache) left for
    any origin a tab went to (a later server may get the same port, hence the same origin)."""
    origins = set()
    for handle in driver.window_handles:
        driver.switch_to.window(handle)
        history = driver.execute_cdp_cmd("Page.getNavigationHistory", {})["entries"]
        origins |= {f"{u.scheme}://{u.netloc}" for u in map(urlsplit, (e["url"] for e in history)) if u.netloc}
    for handle in driver.window_handles[1:]:
        driver.switch_to.window(handle)
        driver.close()
    driver.switch_to.window(driver.window_handles[0])
    driver.get("about:blank")
    for origin in origins:
        driver.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": "all"})
    driver.execute_cdp_cmd("Network.clearBrowserCache", {})


# The Chromium each window size has in this test process, started by the first test that asks for that size.
STARTED: dict[tuple[int, int], object] = {}


@contextlib.contextmanager
def browser(tmp_path, width=1280, height=900):
    """A headless Chromium as a fresh profile is (storage survives reloads within a test, none is left from
    another). Each test process starts one per window size and lends it out, forgetting what a test left (a
    start and quit cost ~2 s a test; `tmp_path`, once its profile's folder, is unused); a test that fails ends
    its loan, so the next test of that size starts a new one."""
    pytest.importorskip("selenium")
    key = (width, height)
    if key not in STARTED:
        profile = tempfile.mkdtemp(prefix="chromium-")
        atexit.register(shutil.rmtree, profile, ignore_errors=True)  # runs after the quit registered below
        STARTED[key] = start_chromium(profile, width, height)
    driver = STARTED.pop(key)
    yield driver  # a failed test raises here: its Chromium is never lent again (it is quit at exit)
    forget(driver)
    STARTED[key] = driver


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
