"""FLUX 3 Image Klein Base's training runs with the options FLUX 3 shares with FLUX.2 (issue 37): LoKr, 4- and 8-bit,
--low-memory, EMA, validation, several sizes, caption dropout, a trigger, a schedule finish, and their files load
on the distilled model as their kind. The files `train --format` writes, read by each family's diffusers loader,
are tests/lora/test_lora_files.py's (written once for both families); the options' effects are judged on FLUX.2
in tests/train.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from train_batch import card_folders

import flux_klein_mlx
from flux_klein_mlx.train.trainer import StepFinished


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Four 64 x 64 images, captions of two window lengths, and a control folder for them."""
    return card_folders(tmp_path_factory.mktemp("flux3-data"))


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
