"""Issue 39: the trainer keeps every good step, and its new options refuse bad input in one line.

- every sample point keeps the LoRA it sampled (samples/step-N.safetensors) in the precision of the
  delivered file (`--save-dtype`) and, under `--ema`, as the delivered average: the last kept file is
  the output, tensor for tensor (the images themselves: test_samples.py);
- `train --resume DIR` (or `--resume --work-dir DIR`) alone continues a run with its own options
  (bit for bit); a flag beside it that changes what a step computes is refused naming the difference;
- an edit LoRA's samples edit a reference (--sample-image, else the first held-out one): the record
  names it and its generate command (with --image) reproduces the sample;
- each new option's bad value is one line before any model loads, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from command_line import run_cli
from PIL import Image
from safetensors import safe_open
from test_samples import pixels, record_of, run_recorded_command
from test_settings import base_args, make_images, no_models, refused  # noqa: F401

import flux_klein_mlx
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.train.plan import plan_run
from flux_klein_mlx.train.report.samples import SamplesSaved
from flux_klein_mlx.train.settings import TrainSettings


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
    args += ["--dtype", "float32"]  # bf16 is emulated on a CPU (slower); train.json's options are what is checked
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
    args = base_args(base, data, out) + ["--steps", "1", "--save-every", "1", "--dtype", "float32"]  # fast on a CPU
    rc, _, err = run_cli(capsys, "train", *args)
    assert rc == 0, err

    def no_model(info, name, *a, **k):
        raise AssertionError(f"the {name} was loaded before the bad input was refused")

    monkeypatch.setattr(train_module, "load_component", no_model)
    more = ["--resume", str(work), "--steps", "2", "--output", str(tmp_path / "o2.safetensors")]
    refused(capsys, tmp_path, more + ["--lr", "0.5"], "other settings", "lr: 0.0001 there, 0.5 now")
    refused(capsys, tmp_path, more + ["--rank", "8"], "other settings", "rank: 4 there, 8 now")
    refused(capsys, tmp_path, ["--resume", str(work)], "already at step 1 of 1", "raise --steps")


# --- an edit LoRA's samples are edits ------------------------------------------------------------


def edit_data(root: Path) -> tuple[Path, Path, Path, Path]:
    """data/ + before/ (its references, same names), held/ + held_before/ (a held-out pair), 64 px."""
    g = np.random.default_rng(11)
    folders = [root / name for name in ("data", "before", "held", "held_before")]
    for folder in folders:
        folder.mkdir(parents=True)
    for folder, names in ((folders[0], ("im0", "im1")), (folders[2], ("h0",))):
        for name in names:
            target = (g.random((64, 64, 3)) * 255).astype(np.uint8)
            Image.fromarray(target).save(folder / f"{name}.png")
            (folder / f"{name}.txt").write_text("make it a striped card")
            reference = folders[1] if folder == folders[0] else folders[3]
            Image.fromarray(np.ascontiguousarray(target[:, ::-1])).save(reference / f"{name}.png")
    return tuple(folders)


def test_an_edit_loras_samples_are_edits_of_their_references(base, distilled, tmp_path, capsys):
    """--control: the samples edit the first held-out reference by default, or --sample-image (one per
    prompt): each record names its references, its generate command (with --image) reproduces it (2/255,
    bf16), and the reference changes the image (it is not text-to-image)."""
    data, before, held, held_before = edit_data(tmp_path)
    common = dict(model=base, data=data, controls=[before], steps=1, rank=4, lr=5e-3, resolution=64, save_every=None)
    common |= dict(sample_every=1, sample_model=distilled, sample_steps=1, sample_seed=3)
    prompts = ["make it a striped card", "make it blue"]
    list(
        flux_klein_mlx.train_lora(
            output=tmp_path / "a.safetensors",
            sample_prompts=prompts,
            validation=held,
            validation_controls=[held_before],
            **common,
        )
    )
    samples = tmp_path / "a.train" / "samples"
    for name in ("step-000000-0.png", "step-000001-0.png", "step-000001-1.png"):
        rec = record_of(samples / name)
        assert rec["training_sample"]["references"] == [str(held_before / "h0.png")], name
        assert f"--image {held_before / 'h0.png'}" in rec["training_sample"]["generate"]
    rec = record_of(samples / "step-000001-0.png")
    ours = pixels(samples / "step-000001-0.png")
    assert np.abs(ours - run_recorded_command(rec, tmp_path / "gen.png", capsys)).max() <= 2
    plain = dict(rec, training_sample=dict(rec["training_sample"]))
    plain["training_sample"]["generate"] = rec["training_sample"]["generate"].replace(
        f" --image {held_before / 'h0.png'}", ""
    )
    assert np.abs(ours - run_recorded_command(plain, tmp_path / "plain.png", capsys)).mean() > 1  # an edit
    chosen = [str(before / "im1.png"), str(held_before / "h0.png")]  # one per prompt
    list(
        flux_klein_mlx.train_lora(
            output=tmp_path / "b.safetensors", sample_prompts=prompts, sample_images=chosen, **common
        )
    )
    for k in (0, 1):
        rec = record_of(tmp_path / "b.train" / "samples" / f"step-000001-{k}.png")
        assert rec["training_sample"]["references"] == [chosen[k]]
    assert (
        np.abs(
            pixels(tmp_path / "b.train" / "samples" / "step-000001-1.png")
            - run_recorded_command(rec, tmp_path / "gen-b.png", capsys)
        ).max()
        <= 2
    )


@pytest.mark.usefixtures("no_models")
def test_sample_image_bad_input_is_one_line_before_any_model(capsys, base, tmp_path):
    data, before, _, _ = edit_data(tmp_path / "in")
    out = tmp_path / "o.safetensors"
    args = base_args(base, data, out) + ["--sample-every", "1", "--sample-prompt", "a", "--sample-model", str(base)]
    image = str(before / "im0.png")
    refused(capsys, tmp_path, args + ["--sample-image", image], "--sample-image", "needs --control")
    args += ["--control", str(before)]
    refused(capsys, tmp_path, args + ["--sample-image", image] * 3, "--sample-image", "give 1 image(s)", "not 3")
    refused(capsys, tmp_path, args + ["--sample-image", str(tmp_path / "gone.png")], "gone.png", "not a file")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    refused(capsys, tmp_path, args + ["--sample-image", str(tmp_path / "bad.png")], "bad.png")
    no_sampling = base_args(base, data, out) + ["--control", str(before), "--sample-image", image]
    refused(capsys, tmp_path, no_sampling, "--sample-image needs --sample-every")
    with pytest.warns(UserWarning, match=r"edit im0.png, the reference of training image im0.png"):
        plan = plan_run(TrainSettings(model=base, data=data, output=out, controls=[before], resolution=64,
                                      sample_every=1, sample_prompts=["a"], sample_model=base))  # fmt: skip
    assert plan.sample_references == [[before / "im0.png"]]
    assert not out.exists() and not (tmp_path / "o.train").exists()
