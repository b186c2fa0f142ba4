"""The reference harness itself: the tiny snapshots, the BFL file and diffusers' runs on them.

Each family kit's `reference_image` (tests/support/families.py) is the judge of the parity tests written once
for both families: here it is deterministic and follows the prompt on each family's tiny snapshot. FLUX 3's
harness has more to prove: tests/support/tiny_flux3.py writes its tiny snapshot with diffusers' own modular
pipeline and tests/support/flux3_refs.py runs that pipeline on it, so the files are the documented ones and
diffusers reads the index, the BFL file maps back through diffusers' own converter exactly, and the runs
(Base with CFG, one reference with canvas and crop-back) are deterministic and respond to what they are given.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flux3_refs import flux3_canvas, flux3_pipeline, flux3_reference, flux3_reference_run
from flux3_text import QWEN3_VL_TEMPLATE
from refs import noise, picture
from tiny_flux3 import REPA_KEY, SNAPSHOT_FILES, write_bfl_flux3_file


@pytest.mark.parametrize("variant", ["distilled3", "base3"])
def test_snapshot_holds_the_documented_files_and_diffusers_reads_its_index(variant, request):
    from diffusers.modular_pipelines import ModularPipeline

    folder = request.getfixturevalue(variant)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == sorted(SNAPSHOT_FILES)
    assert (folder / "text_encoder" / "chat_template.jinja").read_text() == QWEN3_VL_TEMPLATE

    index = json.loads((folder / "modular_model_index.json").read_text())
    is_distilled = variant == "distilled3"
    assert index["tokenizer"][2]["subfolder"] == "text_encoder"
    assert json.loads((folder / "transformer" / "config.json").read_text())["flow_map"] is is_distilled
    pipe = ModularPipeline.from_pretrained(str(folder))  # reads the index only: no component is loaded
    assert type(pipe).__name__ == ("Flux3DistilledModularPipeline" if is_distilled else "Flux3ModularPipeline")
    assert {n: pipe.get_component_spec(n).subfolder for n in ("transformer", "text_encoder", "tokenizer", "vae")} == {
        "transformer": "transformer",
        "text_encoder": "text_encoder",
        "tokenizer": "text_encoder",
        "vae": "vae",
    }


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("variant", ["distilled3", "base3"])
def test_bfl_file_maps_back_through_diffusers_converter(variant, prefix, request, tmp_path):
    from diffusers import Flux3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    folder = request.getfixturevalue(variant)
    sd = load_file(str(write_bfl_flux3_file(folder, tmp_path / "model.safetensors", prefix=prefix)))
    assert all(k.startswith(prefix) for k in sd)
    # diffusers 0.42.1's converter keeps a "model.diffusion_model." prefix (its from_single_file then
    # fails on such a file): the prefix is stripped first, as our sanitizer does.
    sd = {k[len(prefix) :]: v for k, v in sd.items()}
    assert REPA_KEY in sd and ("ref_time_in.in_layer.weight" in sd) is (variant == "distilled3")
    theirs = Flux3Transformer2DModel.from_pretrained(folder / "transformer").state_dict()
    mapped = convert_flux3_transformer_checkpoint_to_diffusers(dict(sd))
    assert sorted(mapped) == sorted(theirs)
    assert all(torch.equal(mapped[k], theirs[k]) for k in theirs)
    if not prefix:  # and diffusers' whole single-file path: detection (flux-3-image[-distilled]) and loading
        config = dict(config=str(folder), subfolder="transformer")
        loaded = Flux3Transformer2DModel.from_single_file(str(tmp_path / "model.safetensors"), **config).state_dict()
        assert all(torch.equal(loaded[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("variant", ["distilled3", "base3"])
def test_pipeline_reads_the_template_from_text_encoder_and_builds_the_scheduler(variant, request):
    pipe = flux3_pipeline(request.getfixturevalue(variant))
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "P"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n"  # Qwen3-VL-Instruct: no think block
    assert pipe.scheduler.config.shift == 6.93
    assert (getattr(pipe, "guider", None) is None) is (variant == "distilled3")


def test_each_familys_reference_image_is_deterministic_and_follows_the_prompt(family, family_distilled):
    """The kit's `reference_image` (diffusers' Flux2KleinPipeline, or FLUX 3's modular pipeline) on the tiny
    distilled snapshot: a real image in [0, 1], the same for the same latents, another for another prompt."""
    lat = noise(64, 64, seed=1)
    image = family.reference_image(family_distilled, prompt="a red fox in snow", latents=lat, steps=3)
    assert image.shape == (64, 64, 3) and image.dtype == np.float32
    assert 0.0 <= image.min() and image.max() <= 1.0 and image.std() > 0.05
    again = family.reference_image(family_distilled, prompt="a red fox in snow", latents=lat, steps=3)
    assert np.array_equal(image, again)
    other = family.reference_image(family_distilled, prompt="a blue car", latents=lat, steps=3)
    assert np.abs(other - image).max() > 1e-3


def test_flux3_run_gives_its_final_latents_deterministically(distilled3):
    lat = noise(64, 64, seed=1)
    run = flux3_reference_run(distilled3, prompt="a red fox in snow", latents=lat, steps=3)
    assert run.latents.shape == (1, 32, 4, 4)
    again = flux3_reference_run(distilled3, prompt="a red fox in snow", latents=lat, steps=3)
    assert np.array_equal(run.image, again.image) and np.array_equal(run.latents, again.latents)
    assert np.array_equal(run.image, flux3_reference(distilled3, prompt="a red fox in snow", latents=lat, steps=3))


def test_base_cfg_with_a_negative_prompt_is_deterministic_and_guided(base3):
    lat = noise(32, 48, seed=2)
    args = dict(prompt="a lighthouse", latents=lat, steps=2)
    image = flux3_reference(base3, negative_prompt="blurry", guidance=3.5, **args)
    assert image.shape == (32, 48, 3)
    assert np.array_equal(image, flux3_reference(base3, negative_prompt="blurry", guidance=3.5, **args))
    assert np.abs(flux3_reference(base3, negative_prompt="blurry", guidance=1.5, **args) - image).max() > 1e-3
    assert np.abs(flux3_reference(base3, negative_prompt="dark", guidance=3.5, **args) - image).max() > 1e-3


def test_one_odd_sized_reference_is_padded_to_its_canvas_and_cropped_back(distilled3):
    # 72 x 40 -> the 80 x 64 canvas (sides >= 64, 16-px grid), the reference centred at (4, 12, 76, 52).
    lat = noise(64, 80, seed=3)
    ref = picture(72, 40, seed=4)
    assert flux3_canvas(ref) == (80, 64, (4, 12, 76, 52))
    run = flux3_reference_run(distilled3, prompt="the same fox", images=[ref], latents=lat, steps=2)
    assert run.image.shape == (40, 72, 3) and run.latents.shape == (1, 32, 4, 5)
    canvas = flux3_reference(distilled3, prompt="the same fox", images=[ref], latents=lat, steps=2, width=80, height=64)
    assert canvas.shape == (64, 80, 3)
    assert np.array_equal(canvas[12:52, 4:76], run.image)
    other = flux3_reference(distilled3, prompt="the same fox", images=[picture(72, 40, seed=5)], latents=lat, steps=2)
    assert np.abs(other - run.image).max() > 1e-3
