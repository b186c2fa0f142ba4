"""The whole chain, prompt upsampler then FLUX 3, against diffusers' `Flux3DistilledAutoBlocks` with the upsampler
kept (tiny models); the caption cache measured by the files a second run opens; the doors' one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from file_opens import FileOpens  # noqa: E402
from flux3_refs import flux3_canvas, flux3_upsampled_run  # noqa: E402
from refs import noise, picture  # noqa: E402
from tiny_flux3 import shared_tiny_flux3_snapshot  # noqa: E402
from tiny_model import shared_tiny_snapshot  # noqa: E402
from tiny_pup import processors_built_once, pup_reference, shared_tiny_pup  # noqa: E402

import flux_klein_mlx  # noqa: E402
from flux_klein_mlx.errors import FluxKleinError  # noqa: E402
from flux_klein_mlx.upsample.runtime import Upsampler  # noqa: E402

C = 32  # the tiny FLUX 3 transformer's token channels
TOKENS = 20  # the caption's cap on both sides


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=True)


@pytest.fixture(scope="module")
def pup(tmp_path_factory):
    return shared_tiny_pup(tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def one_processor_per_folder():
    yield from processors_built_once()  # the upsampler's processor, built once for this module's many loads


def ours(snapshot, pup, prompt, cache=False, **settings):
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", cache=cache)
    pipe.upsampler = Upsampler(pup, max_new_tokens=TOKENS)
    return pipe.generate(prompt, output_type="np", upsample=True, **settings), pipe


@pytest.mark.parametrize("edit", [False, True], ids=["t2i", "edit"])
def test_the_chain_equals_diffusers_with_its_upsampler(snapshot, pup, edit):
    images = [picture(72, 40, seed=5)] if edit else None
    width, height = flux3_canvas(images[0])[:2] if edit else (80, 64)
    lat = noise(height, width, seed=4, channels=C)
    theirs, caption = flux3_upsampled_run(
        snapshot, pup_reference(pup), prompt="a fox", latents=lat, steps=2, images=images, max_new_tokens=TOKENS
    )
    size = {} if edit else dict(width=80, height=64)
    image, pipe = ours(snapshot, pup, "a fox", steps=2, latents=lat, images=images, **size)
    record = pipe.last_metadata
    assert record["prompt"] == "a fox" and record["revised_prompt"] == caption != "a fox"
    assert image.shape == theirs.image.shape
    assert np.abs(image - theirs.image).max() <= 1e-3
    assert pipe.last_stats.upsample_seconds > 0


def test_a_second_identical_request_loads_no_upsampler(snapshot, pup, monkeypatch):
    box = ["0.1,0.2,0.6,0.9:a fox"]
    first, pipe = ours(snapshot, pup, "a fox", cache=True, steps=1, width=64, height=64, seed=1, boxes=box)
    watched = sorted(pup.glob("*.safetensors")) + [pup / "config.json", pup / "tokenizer.json"]
    with FileOpens(watched, monkeypatch) as opens:
        again = pipe.generate("a fox", output_type="np", upsample=True, steps=1, width=64, height=64, seed=1, boxes=box)
    assert opens.opened == []  # the caption came from the cache: the upsampler was never loaded
    assert np.array_equal(first, again)
    assert pipe.last_metadata["revised_prompt"].endswith("]")  # the layout table closes the caption
    assert pipe.last_metadata["boxes"] == [{"bbox": [0.2, 0.1, 0.9, 0.6], "desc": "a fox"}]
    resident = []  # at each upsampler load: whether the transformer was still in memory
    real_load = Upsampler.load
    monkeypatch.setattr(Upsampler, "load", lambda up: (real_load(up), resident.append(pipe.is_loaded("transformer"))))
    # another box (64 x 64, not the default 1024 x 1024: the size is not the point), or the same box with a reference
    for other in (
        {"boxes": ["0.1,0.2,0.6,0.8:a fox"], "width": 64, "height": 64},
        {"boxes": box, "images": [picture(64, 64, seed=9)]},
    ):
        assert pipe.is_loaded("transformer")  # from the image before
        with FileOpens(watched, monkeypatch) as opens:
            pipe.generate("a fox", output_type="np", upsample=True, steps=1, seed=1, **other)
        assert any(p.suffix == ".safetensors" for p in opens.opened)  # another request: a miss, the model loads
    assert resident == [False, False]  # the transformer was dropped before the upsampler loaded


def test_boxes_without_the_upsampler_are_written_into_the_prompt(snapshot):
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", cache=False)
    pipe.generate("a cat", output_type="np", steps=1, width=64, height=64, boxes=["0.1,0.5,0.45,0.95:cat"])
    record = pipe.last_metadata
    assert record["prompt"] == "a cat"
    assert record["revised_prompt"] == 'a cat <obj_1> [{"id": "obj_1", "bbox": [500, 100, 950, 450], "desc": "cat"}]'


def test_upsample_on_flux2_is_one_line_saying_what_it_is_for(tmp_path_factory):
    pipe = flux_klein_mlx.load(shared_tiny_snapshot(tmp_path_factory), dtype="float32", cache=False)
    with pytest.raises(
        FluxKleinError, match="upsample=True is for FLUX 3 Image Klein: it rewrites a short prompt"
    ) as e:
        pipe.generate("a fox", upsample=True, steps=1, width=64, height=64)
    assert "\n" not in str(e.value)
    with pytest.raises(FluxKleinError, match="boxes= is for FLUX 3"):
        pipe.generate("a fox", boxes=["0,0,1,1:fox"], steps=1, width=64, height=64)


def test_a_damaged_upsampler_folder_is_one_line(snapshot, pup, tmp_path, tmp_path_factory):
    import shutil

    broken = tmp_path / "pup"
    shutil.copytree(pup, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", cache=False, upsampler=broken)
    with pytest.raises(FluxKleinError, match="prompt upsampler folder .* is damaged or incomplete .*truncated") as e:
        pipe.generate("a fox", upsample=True, steps=1, width=64, height=64)
    assert "\n" not in str(e.value)
    # a whole image model given as the upsampler is said to be one, not "damaged ... download it again"
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", cache=False, upsampler=shared_tiny_snapshot(tmp_path_factory))
    with pytest.raises(FluxKleinError, match="is a diffusers Flux2KleinPipeline folder .*, not a FLUX 3 prompt") as e:
        pipe.generate("a fox", upsample=True, steps=1, width=64, height=64)
    assert "damaged" not in str(e.value) and "\n" not in str(e.value)


def test_mlx_vlm_missing_is_one_line_saying_how_to_install(snapshot, pup, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # import mlx_vlm now raises ImportError
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", cache=False, upsampler=pup)
    with pytest.raises(FluxKleinError, match=r'needs mlx-vlm, which is not installed: pip install -e "\.\[upsample\]"'):
        pipe.generate("a fox", upsample=True, steps=1, width=64, height=64)
