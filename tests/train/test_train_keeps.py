"""Issue 39: the trainer keeps every good step, and its new options refuse bad input in one line.

- every sample point keeps the LoRA it sampled (samples/step-N.safetensors) in the precision of the
  delivered file (`--save-dtype`) and, under `--ema`, as the delivered average: the last kept file is
  the output, tensor for tensor (the images themselves: test_train_samples.py);
- `train --resume DIR` (or `--resume --work-dir DIR`) alone continues a run with its own options
  (bit for bit); a flag beside it that changes what a step computes is refused naming the difference;
- each new option's bad value is one line before any model loads, nothing written.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from command_line import run_cli
from safetensors import safe_open
from test_train_bad_input import base_args, make_images, no_models, refused  # noqa: F401

import flux_klein_mlx
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.train.samples import SamplesSaved


def tensors(path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


def test_kept_sample_loras_are_the_delivered_file_save_dtype_and_ema(base, distilled, tmp_path):
    """bf16 training, --save-dtype float32, --ema: each sample point keeps a float32 file of the average
    (the output's layout and dtype); the last one is the output bit for bit, step 2's is not the
    step's raw weights (at step 2 the average differs); the header says the step it was kept at."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "o.safetensors"
    events = list(
        flux_klein_mlx.train_lora(
            model=base,
            data=data,
            output=out,
            steps=2,
            rank=4,
            lr=5e-2,
            resolution=64,
            save_every=1,
            ema=0.5,
            save_dtype="float32",
            format="comfyui",
            sample_every=1,
            sample_prompts=["a fox"],
            sample_model=distilled,
            sample_steps=1,
        )
    )
    assert [e.step for e in events if isinstance(e, SamplesSaved)] == [0, 1, 2]
    samples = tmp_path / "o.train" / "samples"
    kept = {k: samples / f"step-00000{k}.safetensors" for k in (1, 2)}
    assert {str(v.dtype) for v in mx.load(str(out)).values()} == {"mlx.core.float32"}
    for path in kept.values():
        assert {str(v.dtype) for v in mx.load(str(path)).values()} == {"mlx.core.float32"}
        assert all(k.startswith("diffusion_model.") for k in mx.load(str(path)))  # --format comfyui
    last, delivered = tensors(kept[2]), tensors(out)
    assert last.keys() == delivered.keys() and all(np.array_equal(last[k], delivered[k]) for k in last)
    with safe_open(str(kept[1]), "np") as f:
        assert f.metadata()["ss_steps"] == "1" and f.metadata()["ss_max_train_steps"] == "2"
    assert flux_klein_mlx.load(distilled, loras=[kept[1]]).loras[0].format == "bfl"  # generate reads it
    # step 2 (the EMA's decay is 0 at step 1: there the average is the weights): the kept file is the average
    step2 = tmp_path / "o.train" / "checkpoint-000002"
    kept2, average, trained = (updates(p) for p in (kept[2], step2 / "ema.safetensors", step2 / "lora.safetensors"))
    assert kept2.keys() == average.keys() == trained.keys()
    scale = max(np.abs(v).max() for v in average.values())
    assert scale > 0 and all(np.abs(kept2[k] - average[k]).max() <= 1e-6 * scale for k in kept2)
    assert max(np.abs(kept2[k] - trained[k]).max() for k in kept2) > 1e-3 * scale  # not the raw weights


def updates(path) -> dict[str, np.ndarray]:
    """Our layer -> the file's whole update `factor * up @ down` (float64), whatever the layout."""
    from flux_klein_mlx.lora.convert import read_any_lora

    parts: dict[str, list] = {}
    for t in read_any_lora(path).parsed.terms:
        up, down = (np.array(m.astype(mx.float32), np.float64) for m in (t.up, t.down))
        parts.setdefault(t.layer, []).append((t.rows, t.factor * up @ down))
    out = {}
    for layer, pieces in parts.items():  # the rows of q, k and v (diffusers) or the fused qkv (ComfyUI) alike
        whole = np.zeros((max(r[1] for r, _ in pieces), pieces[0][1].shape[1]))
        for (start, end), delta in pieces:
            whole[start:end] += delta
        out[layer] = whole
    return out


@pytest.mark.usefixtures("no_models")
def test_save_dtype_bad_value_is_one_line_before_any_model(capsys, base, tmp_path):
    data = make_images(tmp_path / "data")
    out = tmp_path / "o.safetensors"
    refused(
        capsys, tmp_path, base_args(base, data, out) + ["--save-dtype", "float8"], "save-dtype must be one of", "float8"
    )
    with pytest.raises(FluxKleinError, match=r"save-dtype must be one of bfloat16, float16, float32, not 'fp8'"):
        flux_klein_mlx.train_lora(model=base, data=data, output=out, resolution=64, save_dtype="fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


# --- resume with one flag ------------------------------------------------------------------------


def test_resume_with_one_flag_reads_the_runs_train_json(capsys, base, tmp_path):
    """`train --resume DIR` (or `--resume --work-dir DIR`) alone continues the run of DIR with its own
    options, from its train.json: the file equals the straight run's, bit for bit."""
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "o.safetensors", tmp_path / "o.train"
    args = base_args(base, data, out) + ["--steps", "2", "--save-every", "1", "--lr", "5e-3", "--alpha", "2"]
    rc, _, err = run_cli(capsys, "train", *args)
    assert rc == 0, err
    straight = tensors(out)
    for one_flag in (["--resume", str(work)], ["--resume", "--work-dir", str(work)]):
        shutil.rmtree(work / "checkpoint-000002")
        out.unlink()
        rc, _, err = run_cli(capsys, "train", *one_flag)
        assert rc == 0, err
        assert f"resuming from {work / 'checkpoint-000001'} at step 2" in err, err
        resumed = tensors(out)
        assert resumed.keys() == straight.keys() and all(np.array_equal(resumed[k], straight[k]) for k in resumed)


@pytest.mark.usefixtures("no_models")
def test_resume_with_one_flag_refuses_what_disagrees_in_one_line(capsys, base, tmp_path):
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "o.safetensors", tmp_path / "o.train"
    work.mkdir()
    (work / "checkpoint-000001").mkdir()  # a run's folder, as far as the options go (refused before it is read)
    record = {"settings": {"model": str(base), "data": str(data), "output": str(out), "resolution": 64, "rank": 4}}
    (work / "train.json").write_text(json.dumps(record))
    refused(capsys, tmp_path, ["--resume", str(work), "--work-dir", str(tmp_path / "x")], "two folders")
    refused(capsys, tmp_path, ["--resume"], "--resume needs the run's work folder")
    (tmp_path / "empty").mkdir()
    refused(capsys, tmp_path, ["--resume", str(tmp_path / "empty")], "holds no train.json")
    shutil.rmtree(work)


def test_resume_with_one_flag_names_the_option_that_differs(capsys, base, tmp_path, monkeypatch):
    """A flag given beside `--resume DIR` that changes what a step computes is refused, naming the
    difference, before any model loads, nothing written; --steps and --output may change."""
    import flux_klein_mlx.train.trainer as train_module

    data = make_images(tmp_path / "data")
    out, work = tmp_path / "o.safetensors", tmp_path / "o.train"
    rc, _, err = run_cli(capsys, "train", *base_args(base, data, out), "--steps", "1", "--save-every", "1")
    assert rc == 0, err

    def no_model(info, name, *a, **k):
        raise AssertionError(f"the {name} was loaded before the bad input was refused")

    monkeypatch.setattr(train_module, "load_component", no_model)
    more = ["--resume", str(work), "--steps", "2", "--output", str(tmp_path / "o2.safetensors")]
    refused(capsys, tmp_path, more + ["--lr", "0.5"], "other settings", "lr: 0.0001 there, 0.5 now")
    refused(capsys, tmp_path, more + ["--rank", "8"], "other settings", "rank: 4 there, 8 now")
    refused(capsys, tmp_path, ["--resume", str(work)], "already at step 1 of 1", "raise --steps")
