"""lora/ is the one writer of adapter files (issue 34): the trainer's output in every layout it accepts
is, byte for byte in its tensors, what `lora convert` writes from the same terms.

LoRA (diffusers, comfyui, kohya) and LoKr (comfyui, diffusers) are trained 2 steps on the tiny Base
snapshot (resolution 64, rank 4, alpha 8: a factor 2 that a misplaced alpha shows; float32). Each
run's file is compared with `lora convert --format <its layout>` of (a) the run's own last checkpoint
(lora.safetensors: the same terms, read back through the reader the trainer resumes with) and (b) the
file of the run in the adapter's checkpoint layout (same seed and data: the same terms). Keys, dtypes
and tensor bytes must be equal; the header must be the trainer's, less the run's time and name stamps
(and `converted_from`, which convert adds). diffusers' own loader reading these layouts is proven in
test_lora_files.py and test_adapters.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

import flux_klein_mlx
from flux_klein_mlx.__main__ import main

RUNS = [("lora", "diffusers"), ("lora", "comfyui"), ("lora", "kohya"), ("lokr", "comfyui"), ("lokr", "diffusers")]
# a run's file that keeps the trained terms as they are: kohya's for LoRA (alpha apart from B, as in the
# checkpoint; the diffusers file folds it since issue 39), the checkpoint layout for LoKr
CANONICAL = {"lora": "kohya", "lokr": "comfyui"}
# Header keys that name the run's file or time (they differ between two runs of the same terms)
STAMPS = ("ss_output_name", "modelspec.title", "ss_training_started_at", "ss_training_finished_at", "modelspec.date",
          "flux_klein_mlx.settings_sha256", "flux_klein_mlx.converted_from")  # fmt: skip


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    """Each (adapter, layout) trained 2 steps with the same seed and data -> its output file."""
    from PIL import Image

    tmp = tmp_path_factory.mktemp("one-writer")
    data = tmp / "data"
    data.mkdir()
    yy, xx = np.mgrid[0:64, 0:64]
    for i in range(2):
        img = np.stack([xx * 4 % 256, yy * 4 % 256, (xx + yy) * 2 % 256], -1).astype(np.uint8)
        Image.fromarray(np.roll(img, 9 * i, axis=1)).save(data / f"im{i}.png")
        (data / f"im{i}.txt").write_text("a striped test card")
    out = {}
    for adapter, layout in RUNS:
        path = tmp / f"{adapter}-{layout}.safetensors"
        settings = dict(resolution=64, rank=4, alpha=8.0, steps=2, lr=5e-2, dtype="float32", save_every=2)
        list(flux_klein_mlx.train_lora(model=base, data=data, output=path, adapter=adapter, format=layout, **settings))
        out[adapter, layout] = path
    return out


def read(path):
    """(name -> (dtype, shape, bytes), header) of a safetensors file."""
    with safe_open(str(path), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        header = f.metadata() or {}
    return {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in tensors.items()}, header


@pytest.mark.parametrize("source", ["checkpoint", "canonical run"])
@pytest.mark.parametrize("adapter, layout", RUNS)
def test_trainer_file_is_lora_convert_of_the_same_terms(runs, adapter, layout, source, tmp_path):
    trained = runs[adapter, layout]
    if source == "checkpoint":
        src = trained.parent / f"{trained.stem}.train" / "checkpoint-000002" / "lora.safetensors"
    else:
        src = runs[adapter, CANONICAL[adapter]]
    converted = tmp_path / "converted.safetensors"
    assert main(["lora", "convert", str(src), "-o", str(converted), "--format", layout]) == 0
    (ours, header), (theirs, converted_header) = read(trained), read(converted)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k] == theirs[k] for k in ours), [k for k in ours if ours[k] != theirs[k]][:3]
    assert all(dtype == "float32" for dtype, _, _ in ours.values())
    kept = {k: v for k, v in converted_header.items() if k not in STAMPS}
    if source == "checkpoint":  # a checkpoint has no training header: its layout keys are the trainer's
        assert kept == {k: header[k] for k in kept}
    else:
        assert kept == {k: v for k, v in header.items() if k not in STAMPS}
    assert header["flux_klein_mlx.format"] == layout


def test_the_runs_hold_what_they_should(runs):
    """The comparison means something: trained (non-zero) updates, alpha where each layout keeps it,
    LoKr's two kinds of w2 (whole, and LyCORIS' low-rank pair with its alpha) in the checkpoint layout."""
    files = {run: read(path)[0] for run, path in runs.items()}
    for run, tensors in files.items():
        ups = [k for k in tensors if k.endswith(("lora_B.weight", "lora_up.weight", "lokr_w2", "lokr_w2_b"))]
        assert ups and any(np.frombuffer(tensors[k][2], np.float32).any() for k in ups), run
    assert any(k.endswith(".alpha") for k in files["lora", "kohya"])
    lokr = files["lokr", "comfyui"]
    assert any(k.endswith(".lokr_w2") for k in lokr) and any(k.endswith(".lokr_w2_b") for k in lokr)
    assert any(k.endswith(".alpha") for k in lokr)
    diffusers = files["lokr", "diffusers"]  # LyCORIS' factors, scale 1 (the factor in w1), no alpha
    assert any(k.endswith(".lokr_w2_b") for k in diffusers) and not any(k.endswith(".alpha") for k in diffusers)
