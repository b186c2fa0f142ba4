"""The next step from every result (issue 40), in a headless Chromium against the real server (the tiny
distilled model, a --lora-dir): the mask brush paints the mask the server receives, a PNG dropped on the
page (ours, A1111's, an iTXt one) fills the form, "edit this" / "img2img" take a result back in, and
Ctrl+Enter generates. Bad input (a dropped non-image, a PNG without settings, a mask of the wrong size)
is one line on the page and nothing runs.

The judges: the record of each result names its images by the content hash of their prepared pixels
(`inputs.content_hash`); here the same hash is computed from the bytes the page holds (the painted mask,
the result PNG) through `prepare_init_image` / `preprocess_reference`, as the server prepares them.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

pytest.importorskip("openai")
pytest.importorskip("starlette")

from browsing import browser, fill, last_record, needs_chromium, page_bytes, run_and_wait  # noqa: E402
from refs import flux2_reference_pixels, picture  # noqa: E402
from serving import start_server  # noqa: E402

from flux_klein_mlx.inputs.images import prepare_init_image  # noqa: E402
from flux_klein_mlx.inputs.settings import content_hash  # noqa: E402

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def served(snapshot, tmp_path_factory):
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("loras")
    rng = np.random.default_rng(5)
    key = "transformer.transformer_blocks.0.attn.to_q"
    save_file(
        {
            f"{key}.lora_A.weight": rng.normal(0, 0.3, (4, 64)).astype(np.float32),
            f"{key}.lora_B.weight": rng.normal(0, 0.3, (64, 4)).astype(np.float32),
        },
        str(folder / "style.safetensors"),
    )
    yield from start_server(snapshot, ["--lora-dir", str(folder), "--model-id", "klein-tiny"], tmp_path_factory)


def open_page(served, tmp_path, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(served.url + "/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "status").text.endswith(" ready"))
    wait.until(lambda d: d.find_element(By.ID, "lora-box").is_displayed())
    return wait


def drop(driver, name: str, data: bytes, mime: str):
    """A file dropped on the page's body (a real DragEvent carrying a DataTransfer)."""
    driver.execute_script(
        "const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));"
        "const dt = new DataTransfer(); dt.items.add(new File([bytes], arguments[1], {type: arguments[2]}));"
        "document.querySelector('main').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true,"
        " cancelable: true}));",
        base64.b64encode(data).decode(),
        name,
        mime,
    )


def test_the_brush_paints_the_mask_the_server_receives(served, tmp_path):
    """A stroke across the image, part of it erased: the page's mask is the image's size, white where painted,
    black elsewhere and where erased; the server's record names exactly that mask (and the image) by hash."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ref = tmp_path / "ref.png"
    picture(96, 64, 4).save(ref)
    with browser(tmp_path) as driver:
        wait = open_page(served, tmp_path, driver)
        driver.find_element(By.ID, "refs-file").send_keys(str(ref))
        wait.until(lambda d: d.find_element(By.ID, "brush-open").is_displayed())
        driver.find_element(By.ID, "brush-open").click()
        canvas = driver.find_element(By.ID, "brush")
        assert driver.execute_script("return [arguments[0].width, arguments[0].height]", canvas) == [96, 64]
        scale = canvas.size["width"] / 96  # screen px per image px
        driver.execute_script("document.getElementById('brush-size').value = 16")
        # Selenium aims at the centre of an element's visible part: the whole canvas in view first.
        centre = "arguments[0].scrollIntoView({block: 'center'})"
        driver.execute_script(centre, canvas)
        # A horizontal stroke along row 32 from x = 8 to x = 88 (offsets from the canvas's centre, on screen).
        ActionChains(driver).move_to_element_with_offset(canvas, int(-40 * scale), 0).click_and_hold().move_by_offset(
            int(80 * scale), 0
        ).release().perform()
        wait.until(lambda d: d.find_element(By.ID, "mode-note").text.startswith("inpainting"))
        driver.execute_script("window.__painted = flux.state.mask")
        driver.find_element(By.ID, "brush-erase").click()
        driver.execute_script(centre, canvas)  # the mask's thumbnail above it has moved it
        ActionChains(driver).move_to_element_with_offset(canvas, int(20 * scale), 0).click_and_hold().move_by_offset(
            int(20 * scale), 0
        ).release().perform()  # erase x = 68..88 (and the brush's radius around it)
        wait.until(lambda d: d.execute_script("return flux.state.mask !== window.__painted && flux.state.mask.painted"))
        mask = Image.open(io.BytesIO(page_bytes(driver, "flux.state.mask.file")))
        grey = np.asarray(mask.convert("L"))
        assert mask.size == (96, 64)
        assert (grey[28:37, 16:56] == 255).all() and grey[:20].max() == 0 and grey[46:].max() == 0
        assert grey[28:37, 80:].max() < 128  # erased
        fill(driver, prompt="a red ball", steps=1, seed=2)
        run_and_wait(driver, wait)
        record = last_record(driver)
        prepared = prepare_init_image(Image.open(ref), 0.8, mask)
        assert record["mask"] == content_hash(prepared.mask) and record["init_image"] == content_hash(prepared.pixels)
        assert record["strength"] == 0.8 and (record["width"], record["height"]) == (96, 64)


def test_edit_this_img2img_and_inpaint_take_a_result_back_with_ctrl_enter(served, tmp_path):
    """Ctrl+Enter generates; "edit this" on the result makes it the one reference (the next record names that
    PNG's pixels); "img2img" on a history item makes it the starting image at strength 0.6; "inpaint" opens the
    brush on it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with browser(tmp_path) as driver:
        wait = open_page(served, tmp_path, driver)
        fill(driver, prompt="a fox", width=64, height=80, steps=1, seed=3)
        run_and_wait(driver, wait, ctrl_enter=True)
        first = page_bytes(driver, "flux.state.history[0].blob")
        driver.find_element(By.CSS_SELECTOR, "#results button[data-use=edit]").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#refs img")) == 1)
        assert Select(driver.find_element(By.ID, "size-preset")).first_selected_option.get_attribute("value") == "auto"
        assert driver.find_element(By.ID, "mode-note").text == "editing with 1 reference image(s)"
        fill(driver, prompt="the fox in snow")
        run_and_wait(driver, wait, ctrl_enter=True)
        record = last_record(driver)
        assert record["references"] == [content_hash(flux2_reference_pixels(Image.open(io.BytesIO(first))))]
        assert record["init_image"] is None and (record["width"], record["height"]) == (64, 80)

        driver.find_elements(By.CSS_SELECTOR, "#history button[data-use=img2img]")[1].click()  # the first result
        wait.until(lambda d: d.find_element(By.ID, "mode-note").text.startswith("img2img"))
        assert driver.find_element(By.ID, "strength").get_attribute("value") == "0.6"
        run_and_wait(driver, wait)
        record = last_record(driver)
        start = prepare_init_image(Image.open(io.BytesIO(first)), 0.6)
        assert record["init_image"] == content_hash(start.pixels) and record["strength"] == 0.6

        driver.find_elements(By.CSS_SELECTOR, "#history button[data-use=inpaint]")[0].click()
        wait.until(lambda d: d.find_element(By.ID, "brush").is_displayed())
        assert driver.find_element(By.ID, "strength").get_attribute("value") == ""


def a1111_png(text: str, size=(64, 64)) -> bytes:
    info = PngInfo()
    info.add_text("parameters", text)
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def test_a_png_dropped_on_the_page_fills_the_form(served, tmp_path):
    """Our PNG (from the server, with a LoRA) and A1111's (tEXt; and iTXt for text outside latin-1) fill the
    form; a dropped text file, a PNG without settings and a mask of the wrong size are one line each, the
    form kept and nothing run."""
    from selenium.webdriver.common.by import By

    client = served.client()
    ours = client.images.generate(
        prompt="a heron", size="64x96", extra_body={"seed": 21, "steps": 2, "loras": ["style:0.7"]}
    )
    with browser(tmp_path) as driver:
        wait = open_page(served, tmp_path, driver)
        value = lambda field: driver.find_element(By.ID, field).get_attribute("value")  # noqa: E731
        drop(driver, "heron.png", base64.b64decode(ours.data[0].b64_json), "image/png")
        wait.until(lambda d: value("prompt") == "a heron")
        assert (value("seed"), value("steps"), value("width"), value("height")) == ("21", "2", "64", "96")
        assert driver.find_element(By.ID, "lora-style").is_selected()
        assert driver.find_element(By.CSS_SELECTOR, "#loras input[type=number]").get_attribute("value") == "0.7"
        assert "Settings read from heron.png (its record)" in driver.find_element(By.ID, "reuse-note").text

        text = "a cat <lora:style:0.6>\nNegative prompt: dark\nSteps: 7, Sampler: Euler a, CFG scale: 5, Seed: 123, "
        drop(driver, "a1111.png", a1111_png(text + 'Size: 512x768, Model: "sdxl, v1"'), "image/png")
        wait.until(lambda d: value("prompt") == "a cat <lora:style:0.6>")
        assert (value("seed"), value("steps"), value("width"), value("height")) == ("123", "7", "512", "768")
        assert (value("negative"), value("guidance")) == ("dark", "5")
        drop(driver, "forge.png", a1111_png("un café ☕\nSteps: 3, Seed: 9, Size: 64x64"), "image/png")  # iTXt
        wait.until(lambda d: value("prompt") == "un café ☕")
        assert "its A1111 parameters" in driver.find_element(By.ID, "reuse-note").text

        done = served.status()["completed"]
        for name, data, mime, words in (
            ("notes.txt", b"not an image", "text/plain", "notes.txt is not a PNG"),
            ("fake.png", b"GIF89a, not a PNG", "image/png", "fake.png is not a PNG"),
            ("bare.png", png_without_text(), "image/png", "bare.png holds no settings"),
        ):
            drop(driver, name, data, mime)
            wait.until(lambda d, words=words: words in d.find_element(By.ID, "error").text)
            assert value("prompt") == "un café ☕"

        ref, small = tmp_path / "ref.png", tmp_path / "small.png"
        picture(64, 64, 1).save(ref)
        Image.new("L", (32, 32), 255).save(small)
        driver.find_element(By.ID, "refs-file").send_keys(str(ref))
        driver.find_element(By.ID, "mask-file").send_keys(str(small))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#mask img")) == 1)
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "the mask is 32 × 32 but the image is 64 × 64" in d.find_element(By.ID, "error").text)
        assert served.status()["completed"] == done


def png_without_text() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()
