"""Issue 39: `--init-lora FILE` (train/starting.py) starts a run from a LoRA file of any layout `--lora` reads:

- a trained LoRA written as diffusers, ComfyUI (fused qkv, block-diagonal) or kohya (alpha in the file)
  gives back the run's own pairs, exactly, and a fused qkv of one adapter (musubi's) each module's rows;
- from a ComfyUI file the run continues where the file left off: its image at step 0 is `generate` with
  the file, and the LoRA it keeps there holds the file's tensors;
- a rank, a module or a file that disagrees is one line before any model loads, nothing written.
"""

from __future__ import annotations

import shlex

import mlx.core as mx
import numpy as np
import pytest
from test_samples import pixels, record_of
from test_settings import base_args, make_images, no_models, refused  # noqa: F401

import flux_klein_mlx
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.lora.formats import Term
from flux_klein_mlx.lora.layouts import write_adapter
from flux_klein_mlx.train.plan import plan_run
from flux_klein_mlx.train.report.events import TrainStarted
from flux_klein_mlx.train.settings import TrainSettings
from flux_klein_mlx.train.starting import init_arrays
from flux_klein_mlx.train.step.adapters import write_lora_file
from flux_klein_mlx.train.trainer import Trainer


@pytest.fixture
def trained(base, tmp_path):
    """A Trainer's adapters with B drawn (not zero), rank 4, alpha 8: the pairs a file must give back."""
    data = make_images(tmp_path / "data")
    plan = plan_run(
        TrainSettings(model=base, data=data, output=tmp_path / "x.safetensors", rank=4, alpha=8, resolution=64)
    )
    trainer = Trainer(plan)
    trainer.load_model()
    g = np.random.default_rng(3)
    arrays = {
        k: mx.array(g.standard_normal(v.shape).astype(np.float32) * 0.1) for k, v in trainer.lora.arrays().items()
    }
    trainer.lora.load(arrays, "test")
    return plan, trainer.lora, arrays


@pytest.mark.parametrize("layout", ["diffusers", "comfyui", "kohya"])
def test_each_layout_gives_back_the_runs_own_pairs(trained, tmp_path, layout):
    plan, lora, arrays = trained
    path = tmp_path / f"{layout}.safetensors"
    write_lora_file(path, lora, dtype=mx.float32, layout=layout, params=plan.info.params)
    got = init_arrays(path, plan.slots, plan.info.params, rank=4, alpha=8.0)
    assert got.keys() == arrays.keys()
    for k in arrays:  # alpha 8 / rank 4: the diffusers file folds the scale 2 into up; we take it back out
        assert np.allclose(np.array(got[k]), np.array(arrays[k]), rtol=1e-6, atol=1e-7), k


def test_one_adapter_on_a_fused_qkv_gives_each_module_its_rows(trained, tmp_path):
    """musubi's fused qkv: one rank-4 pair on the whole layer; each of to_q, to_k, to_v takes its rows of up."""
    plan, lora, _ = trained
    g = np.random.default_rng(4)
    layer = "double_blocks.0.img_attn.qkv"
    slots = [s for s in plan.slots if s.layer == layer]
    rows = (slots[0].rows[0], slots[-1].rows[1])
    down = mx.array(g.standard_normal((4, slots[0].in_dims)).astype(np.float32))
    up = mx.array(g.standard_normal((rows[1] - rows[0], 4)).astype(np.float32))
    path = tmp_path / "fused.safetensors"
    write_adapter(
        path, [Term(layer, rows, 0.5, down=down, up=up)], "comfyui", plan.info.params, what="t", dtype=mx.float32
    )
    got = init_arrays(path, plan.slots, plan.info.params, rank=4, alpha=4.0)
    for s in slots:  # the run's scale is 1: B carries the file's 0.5
        assert np.array_equal(np.array(got[f"{s.name}.down"]), np.array(down))
        assert np.allclose(np.array(got[f"{s.name}.up"]), 0.5 * np.array(up[s.rows[0] : s.rows[1]]), rtol=1e-6)
    assert len(got) == 2 * len(slots)  # the modules the file does not hold start as a new run's


def test_a_run_from_a_comfyui_file_starts_with_its_image(base, distilled, tmp_path, capsys):
    """A 2-step LoRA written as ComfyUI (bf16); a run with --init-lora starts from it: the LoRA it keeps at
    step 0 holds the file's tensors, and its image there is `generate` with the file (2/255, bf16)."""
    data = make_images(tmp_path / "data")
    first = tmp_path / "first.safetensors"
    common = dict(model=base, data=data, rank=4, resolution=64)
    list(flux_klein_mlx.train_lora(output=first, steps=2, lr=5e-2, format="comfyui", **common))
    sampling = dict(sample_every=1, sample_prompts=["a fox"], sample_model=distilled, sample_steps=1)
    plan = plan_run(
        TrainSettings(
            output=tmp_path / "next.safetensors", steps=3, init_lora=first, format="comfyui", **common, **sampling
        )
    )
    trainer = Trainer(plan)
    run = trainer.run()
    for ev in run:
        if isinstance(ev, TrainStarted):
            break
    saved = trainer.samples()  # step 0, with the LoRA as --init-lora made it
    run.close()
    kept = tmp_path / "next.train" / "samples" / "step-000000.safetensors"
    ours, theirs = mx.load(str(kept)), mx.load(str(first))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    args = shlex.split(record_of(saved.paths[0])["training_sample"]["generate"])[3:]
    args[args.index("--lora") + 1] = str(first)
    assert main(args + ["--output", str(tmp_path / "g.png")]) == 0, capsys.readouterr().err
    assert np.abs(pixels(saved.paths[0]) - pixels(tmp_path / "g.png")).max() <= 2
    assert saved.changes[0] > 1.0  # and the file changes the image: its LoRA is there at step 0


def test_init_lora_that_disagrees_is_one_line_before_any_model(capsys, base, tmp_path, trained, no_models):  # noqa: F811
    plan, lora, _ = trained
    path = tmp_path / "r4.safetensors"
    write_lora_file(path, lora, dtype=mx.float32, layout="comfyui", params=plan.info.params)
    data = make_images(tmp_path / "data2")
    args = base_args(base, data, tmp_path / "o.safetensors")  # --rank 4
    refused(capsys, tmp_path, [*args, "--init-lora", str(path), "--rank", "8"], "rank 4, not --rank 8", "--rank 4")
    refused(capsys, tmp_path, [*args, "--init-lora", str(path), "--targets", "double"], "--targets does not train")
    refused(capsys, tmp_path, [*args, "--init-lora", str(tmp_path / "none.safetensors")], "is not a file")
    refused(capsys, tmp_path, [*args, "--init-lora", str(path), "--adapter", "lokr"], "--init-lora", "lokr")
    # NaN in the file: refused as --lora refuses it, not trained on and then blamed on --lr
    nan = {k: np.asarray(v) for k, v in mx.load(str(path)).items()}
    key = sorted(k for k in nan if nan[k].ndim == 2)[0]
    nan[key][0, 0] = np.nan
    mx.save_safetensors(str(tmp_path / "nan.safetensors"), {k: mx.array(v) for k, v in nan.items()})
    refused(capsys, tmp_path, [*args, "--init-lora", str(tmp_path / "nan.safetensors")], "non-finite values", key)
