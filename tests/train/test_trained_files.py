"""The files `train` writes on FLUX 3 Image Klein Base (issue 37), judged by diffusers' own FLUX 3 loader (FLUX.2's
files in diffusers' loader: tests/lora/test_lora_files.py, tests/train/test_objective.py):

- `train --format comfyui | diffusers | kohya`: the file diffusers' FLUX 3 loader reads
  (`Flux3LoraLoaderMixin.lora_state_dict` + `load_lora_into_transformer`) with no key left over and no module
  missing, and diffusers' Base pipeline with it gives our image with it (1e-3, float32); diffusers reads no
  kohya FLUX 3 names, so the kohya file is judged through `lora convert` to the diffusers layout;
- runs with the options FLUX 3 shares with FLUX.2 (LoKr, 4- and 8-bit, --low-memory, EMA, validation, several
  sizes, caption dropout, a trigger, a schedule) finish, and their files load on the distilled model as their kind.
"""

from __future__ import annotations

import copy
import logging

import mlx.core as mx
import numpy as np
import pytest
from flux3_refs import flux3_pipeline, flux3_reference
from PIL import Image

import flux_klein_mlx
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.lora.convert import convert_lora
from flux_klein_mlx.train.trainer import StepFinished

SHORT = "a striped test card"
LONG = "a striped test card on a wooden easel in a quiet room, " * 12  # past 80 tokens: a window of 160


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Four 64 x 64 images, captions of two window lengths, and a control folder for them."""
    root = tmp_path_factory.mktemp("flux3-data")
    d, c = root / "photos", root / "before"
    d.mkdir(), c.mkdir()
    g = np.random.default_rng(0)
    yy, xx = np.mgrid[0:64, 0:64]
    for i in range(4):
        base = np.stack([xx * 4 % 256, yy * 4 % 256, (xx + yy) * 2 % 256], -1).astype(np.uint8)
        Image.fromarray(np.roll(base, 9 * i, axis=1)).save(d / f"im{i}.png")
        (d / f"im{i}.txt").write_text(LONG if i % 2 else SHORT)
        Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(c / f"im{i}.png")
    return d, c


def latents(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 32, 4, 4)).astype(np.float32)


@pytest.mark.parametrize("layout", ["comfyui", "diffusers", "kohya"])
def test_flux3_train_writes_each_format_that_diffusers_loads_and_gives_our_image(base3, data, tmp_path, layout, caplog):
    from diffusers.loaders import Flux3LoraLoaderMixin

    out = tmp_path / f"{layout}.safetensors"
    args = ["train", "--model", str(base3), "--data", str(data[0]), "--output", str(out), "--format", layout]
    args += ["--steps", "3", "--rank", "4", "--lr", "2e-2", "--resolution", "64", "--dtype", "float32"]
    assert main(args + ["--save-dtype", "float32", "--targets", "image,text,single"]) == 0
    pipe = flux3_pipeline(base3)
    judge = out
    if layout == "kohya":  # diffusers 0.42.1 reads no kohya FLUX 3 names: it judges our `lora convert` of the file
        assert all(k.startswith("lora_unet_") for k in mx.load(str(out)))
        judge = convert_lora(out, tmp_path / "judge.safetensors", "diffusers")
    # diffusers' loader, its two steps, on a copy: every key lands on a module, every module we trained gets one
    caplog.set_level(logging.WARNING)
    model = copy.deepcopy(pipe.transformer)
    sd, meta = Flux3LoraLoaderMixin.lora_state_dict(str(judge), return_lora_metadata=True)
    Flux3LoraLoaderMixin.load_lora_into_transformer(sd, transformer=model, adapter_name="judge", metadata=meta)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "key" in r.getMessage().lower()]
    adapted = {n for n, m in model.named_modules() if "judge" in getattr(m, "lora_A", {})}
    record = __import__("json").loads((tmp_path / f"{layout}.train" / "train.json").read_text())
    assert adapted == set(record["targets"]) and len(adapted) == (2 + 2 + 2) * 6
    lat = latents(5)
    pipe.load_lora_weights(str(judge), adapter_name="judge")
    try:
        theirs = flux3_reference(base3, prompt=SHORT, latents=lat, steps=2)
    finally:
        pipe.unload_lora_weights()
    plain = flux3_reference(base3, prompt=SHORT, latents=lat, steps=2)
    ours = flux_klein_mlx.load(base3, dtype="float32", cache=False, loras=[out]).generate(
        SHORT, steps=2, latents=lat, width=64, height=64, output_type="np"
    )
    assert np.abs(ours - theirs).max() <= 1e-3
    assert np.abs(theirs - plain).max() > 1e-2  # the trained LoRA does something


def run(**kw) -> list:
    return list(flux_klein_mlx.train_lora(**kw))


@pytest.mark.parametrize(
    "options",
    [
        dict(adapter="lokr", quantize=4, low_memory=True, format="comfyui"),
        dict(
            ema=0.9,
            validation=True,
            resolution="64,96",
            quantize=8,
            caption_dropout=0.5,
            trigger="sks",
            lr_scheduler="cosine",
            warmup_steps=1,
            timesteps="logit-normal",
            save_dtype="float32",
        ),
    ],
    ids=["lokr-4bit-low-memory", "ema-validation-sizes-8bit-dropout-trigger-schedule"],
)
def test_flux3_runs_with_the_other_options_and_its_file_loads(base3, distilled3, data, tmp_path, options):
    """The options FLUX 3 shares with FLUX.2 (their effect is judged on FLUX.2 in tests/train): a run with them
    finishes on FLUX 3 Base, its loss finite, and its file loads on the distilled FLUX 3 as the kind it is."""
    out = tmp_path / "o.safetensors"
    options = {"resolution": 64, **options}
    if options.get("validation"):  # one held-out image with a caption of its own
        held = tmp_path / "held"
        held.mkdir()
        Image.open(data[1] / "im0.png").save(held / "h.png")
        (held / "h.txt").write_text("a held-out card")
        options["validation"] = held
    evs = run(model=base3, data=data[0], output=out, steps=3, rank=4, batch_size=2, save_every=3, **options)
    losses = [e.loss for e in evs if isinstance(e, StepFinished)]
    assert len(losses) == 3 and all(np.isfinite(losses))
    if options.get("validation"):
        assert [type(e).__name__ for e in evs].count("ValidationFinished") == 1
    kind = "lokr" if options.get("adapter") == "lokr" else "diffusers"
    assert flux_klein_mlx.load(distilled3, loras=[out]).loras[0].format == kind
