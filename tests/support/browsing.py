"""A headless Chromium for the page's tests (tests/serve/): `browser` opens one with its own profile,
`fill` types into fields by id; `needs_chromium` skips where Chromium or its driver is not installed."""

from __future__ import annotations

import contextlib
import shutil

import pytest


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
