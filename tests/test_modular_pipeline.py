"""Our pipeline against diffusers' FLUX 3 modular pipeline where FLUX 3 Image Klein runs otherwise than FLUX.2:
one reference on its own canvas, cropped back; Base's text and references run once per image. The judge is
tests/support/flux3_refs.py (the modular pipeline with the prompt upsampler popped); what both families share is
judged once for both in tests/test_pipeline.py (LoRAs: tests/lora/test_lora_pipeline.py).
"""

from __future__ import annotations

import numpy as np
from flux3_refs import flux3_canvas, flux3_reference
from refs import noise, picture

import flux_klein_mlx


def ours(path, prompt, **settings):
    pipe = flux_klein_mlx.load(path, dtype=settings.pop("dtype", "float32"), cache=False)
    return pipe.generate(prompt, output_type="np", **settings), pipe


def test_one_odd_sized_reference_runs_on_its_canvas_and_is_cropped_back(distilled3):
    ref = picture(72, 40, seed=3)
    width, height, box = flux3_canvas(ref)
    assert (width, height) != ref.size  # the canvas is padded to the token grid
    lat = noise(height, width, seed=2)
    theirs = flux3_reference(distilled3, prompt="the fox at night", latents=lat, steps=2, images=[ref])
    image, pipe = ours(distilled3, "the fox at night", steps=2, latents=lat, images=[ref])
    assert image.shape == theirs.shape == (40, 72, 3)  # the reference's own size
    assert np.abs(image - theirs).max() <= 1e-3
    record = pipe.last_metadata  # the run's canvas, and the box the image was cropped back to
    assert (record["width"], record["height"], record["crop"]) == (width, height, list(box))


def test_base_once_per_image_text_and_references_equal_the_per_step_path(base3):
    from flux_klein_mlx.family.flux3.family import Flux3Steps

    ref = picture(64, 48, seed=8)
    pipe = flux_klein_mlx.load(base3, dtype="float32", cache=False)
    job = pipe.prepare("a fox", images=[ref], steps=3, guidance=3.0, negative_prompt="snow", seed=1)
    model = pipe.component("transformer")
    hoisted = Flux3Steps(model, job, low_memory=False)
    assert hoisted.txt_early is not None and hoisted.ref_early is not None
    per_step = Flux3Steps(model, job, low_memory=False)
    per_step.txt_early = per_step.ref_early = None  # every mode recomputed inside each pass
    for i in range(3):
        a, b = hoisted.velocity(job.x, i), per_step.velocity(job.x, i)
        assert float(np.abs(np.array(a) - np.array(b)).max()) <= 1e-5
