"""Issue 28: samples on the model the LoRA will run on, and captions (--trigger, --caption-dropout).

- a sample at step N is what `generate` makes on the sample model with the checkpoint's LoRA at N
  (the command its PNG record carries, run as it is; 2/255), the baseline what generate makes
  without a LoRA; training on the tiny Base snapshot, sampling on the tiny distilled one, bfloat16;
- `--trigger` trains exactly as captions written with the trigger; `--caption-dropout 1` trains
  exactly alike whatever the captions say; the dropout draw is the same on resume;
- the default sample model of a Base hub repo, on either family, is its distilled sibling;
- bad sample and caption settings: one line, exit 1, before any model loads, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image
from refs import to_np
from safetensors import safe_open
from test_settings import base_args, linked_snapshot, make_images, no_models, refused  # noqa: F401

import flux_klein_mlx
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.lora.layouts import autov3
from flux_klein_mlx.record.output import RECORD_KEY
from flux_klein_mlx.train.data.dataset import dropped_captions, with_trigger
from flux_klein_mlx.train.report.samples import SamplesSaved, sample_source, sibling_model
from flux_klein_mlx.train.settings import TrainSettings
from flux_klein_mlx.train.trainer import StepFinished

PROMPT = "a red lighthouse"


def captioned(folder: Path, captions: list[str]) -> Path:
    """64 x 64 striped images with the given captions (the same pictures for the same count)."""
    folder.mkdir(parents=True)
    yy, xx = np.mgrid[0:64, 0:64]
    for i, text in enumerate(captions):
        img = np.stack([xx * 4 % 256, yy * 4 % 256, (xx + yy + 40 * i) * 2 % 256], -1).astype(np.uint8)
        Image.fromarray(img).save(folder / f"im{i}.png")
        (folder / f"im{i}.txt").write_text(text)
    return folder


def record_of(path: Path) -> dict:
    return json.loads(Image.open(path).text[RECORD_KEY])


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def run_recorded_command(record: dict, out: Path, capsys) -> np.ndarray:
    """Run the `generate` command a sample's record carries, as it is, into `out`."""
    args = shlex.split(record["training_sample"]["generate"])
    assert args[:4] == ["python", "-m", "flux_klein_mlx", "generate"]
    rc = main(args[3:] + ["--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    return pixels(out)


def test_sample_at_step_n_is_generate_on_the_sample_model_with_the_lora_it_keeps(base, distilled, tmp_path, capsys):
    """bf16 training on Base, samples on the distilled model at its defaults (4 steps, no CFG); step 1 is a
    sample point without a checkpoint, step 2 has both: each sample point keeps its LoRA beside the images
    (samples/step-N.safetensors, the output's layout and dtype, bf16 here), its record names that file (sha256)
    and its `generate` command reproduces the sample; the last sample is what generate gives with the output
    file (issue 39: before, step 1's record named a checkpoint that was never written)."""
    data = captioned(tmp_path / "data", ["a striped test card", "a striped test card"])
    out = tmp_path / "s.safetensors"
    events = list(
        flux_klein_mlx.train_lora(
            model=base,
            data=data,
            output=out,
            steps=2,
            rank=4,
            lr=5e-3,
            resolution=64,
            save_every=None,
            sample_every=1,
            sample_prompts=[PROMPT],
            sample_seed=7,
            sample_model=distilled,
            sample_strengths="0.5,1",
        )
    )
    samples = [e for e in events if isinstance(e, SamplesSaved)]
    assert [e.step for e in samples] == [0, 1, 2]
    first_step = next(i for i, e in enumerate(events) if isinstance(e, StepFinished))
    assert events.index(samples[0]) < first_step  # the baseline is written before step 1
    work = tmp_path / "s.train" / "samples"
    assert sorted(p.name for p in work.iterdir()) == [
        "step-000000-0.png",
        "step-000001-0-x0.5.png",
        "step-000001-0.png",
        "step-000001.safetensors",
        "step-000002-0-x0.5.png",
        "step-000002-0.png",
        "step-000002.safetensors",
    ]
    assert samples[2].strengths == [0.5, 1.0] and all(c > 0 for c in samples[2].changes)
    assert samples[2].added_memory is not None and samples[2].peak_memory > 0
    checkpoint = tmp_path / "s.train" / "checkpoint-000002" / "lora.safetensors"
    for step in (1, 2):
        kept = work / f"step-{step:06d}.safetensors"
        sha = hashlib.sha256(kept.read_bytes()).hexdigest()[:12]
        assert {str(v.dtype) for v in mx.load(str(kept)).values()} == {"mlx.core.bfloat16"}  # the output's dtype
        for name, strength in ((f"step-{step:06d}-0.png", 1.0), (f"step-{step:06d}-0-x0.5.png", 0.5)):
            rec = record_of(work / name)
            assert rec["loras"] == [
                {"name": f"samples/{kept.name}", "sha256": sha, "scale": strength, "autov3": autov3(kept)}
            ]
            assert rec["steps"] == 4 and rec["guidance"] is None and rec["dtype"] == "bfloat16"
            assert rec["quantize"] is None and rec["width"] == rec["height"] == 64
            assert rec["training_sample"]["lora"] == str(kept)
            assert rec["training_sample"]["checkpoint_written"] == (step == 2)
            ours, theirs = (
                pixels(work / name),
                run_recorded_command(rec, tmp_path / f"gen-{step}-{strength}.png", capsys),
            )
            assert np.abs(ours - theirs).max() <= 2, name
            assert record_of(tmp_path / f"gen-{step}-{strength}.png")["loras"][0]["sha256"] == sha
    # the kept LoRA of step 2 is the checkpoint's adapters, in the output's dtype; and it is the output
    final, check = lora_tensors(work / "step-000002.safetensors")[0], lora_tensors(checkpoint)[0]
    delivered = lora_tensors(out)[0]
    assert final.keys() == check.keys() == delivered.keys()
    assert all(np.array_equal(final[k], delivered[k]) for k in final)
    assert all(np.array_equal(final[k], to_np(mx.array(check[k]).astype(mx.bfloat16))) for k in final)
    last = record_of(work / "step-000002-0.png")
    last["training_sample"]["generate"] = last["training_sample"]["generate"].replace(
        shlex.quote(str(work / "step-000002.safetensors")), shlex.quote(str(out))
    )
    assert shlex.quote(str(out)) in last["training_sample"]["generate"]
    with_output = run_recorded_command(last, tmp_path / "with-output.png", capsys)
    assert np.abs(pixels(work / "step-000002-0.png") - with_output).max() <= 2
    baseline = record_of(work / "step-000000-0.png")
    assert baseline["loras"] == [] and baseline["training_sample"]["baseline"]
    assert (
        np.abs(pixels(work / "step-000000-0.png") - run_recorded_command(baseline, tmp_path / "b.png", capsys)).max()
        <= 2
    )
    # the change the event reports is the mean |difference| from the baseline PNG
    change = np.abs(pixels(work / "step-000002-0.png") - pixels(work / "step-000000-0.png")).mean()
    assert samples[2].changes[1] == pytest.approx(change, abs=1e-3)
    assert not list((tmp_path / "s.train").glob(".*.tmp")) and not list(work.glob(".*"))


def test_default_sample_model_is_the_distilled_sibling_of_a_base_repo(family, family_base):
    for repo, sibling in family.training.sibling_repos.items():  # a distilled repo has none
        assert sibling_model(repo) == sibling, repo
    assert sibling_model(family_base) is None  # a local folder: no sibling
    assert sample_source(TrainSettings()) == "black-forest-labs/FLUX.2-klein-4B"  # the default --model's sibling
    assert sample_source(TrainSettings(model=family_base)) == str(family_base)
    assert sample_source(TrainSettings(model=family_base, sample_model="x/y")) == "x/y"


def lora_tensors(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "np") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if "trigger" not in k}  # the header may name the trigger
    return {k: to_np(v) for k, v in mx.load(str(path)).items()}, meta


def same_lora(a: Path, b: Path) -> bool:
    """The same adapters: tensors bit for bit and the same PEFT config (the rest of the header records the
    run itself: its times, output name, captions' tag counts)."""
    (ta, ma), (tb, mb) = lora_tensors(a), lora_tensors(b)
    same_config = ma.get("lora_adapter_metadata") == mb.get("lora_adapter_metadata")
    return same_config and ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


def short_run(base, data, out, **kw) -> list:
    common = dict(steps=2, rank=4, lr=1e-3, resolution=64, save_every=None, dtype="float32")
    return list(flux_klein_mlx.train_lora(model=base, data=data, output=out, **{**common, **kw}))


def test_trigger_trains_as_captions_written_with_it(base, tmp_path):
    assert with_trigger("a fox", "sks") == "sks, a fox"
    assert with_trigger("a photo of [trigger] in snow", "sks") == "a photo of sks in snow"
    plain = captioned(tmp_path / "plain", ["a striped card", "a photo of [trigger] card"])
    written = captioned(tmp_path / "written", ["sks, a striped card", "a photo of sks card"])
    short_run(base, plain, tmp_path / "t.safetensors", trigger="sks")
    short_run(base, written, tmp_path / "w.safetensors")
    assert same_lora(tmp_path / "t.safetensors", tmp_path / "w.safetensors")
    record = json.loads((tmp_path / "t.train" / "train.json").read_text())
    assert record["settings"]["trigger"] == "sks"
    assert [d["caption"] for d in record["data"]] == ["sks, a striped card", "a photo of sks card"]
    # and without the trigger the LoRA is another one: the captions reach the training (a literal
    # [trigger] without --trigger is refused since issue 39, so the bare captions are written out)
    with pytest.raises(FluxKleinError, match=r"im1.txt hold\(s\) \[trigger\] but no --trigger"):
        short_run(base, plain, tmp_path / "n.safetensors")
    bare = captioned(tmp_path / "bare", ["a striped card", "a photo of card"])
    short_run(base, bare, tmp_path / "n.safetensors")
    assert not same_lora(tmp_path / "n.safetensors", tmp_path / "w.safetensors")


def test_caption_dropout_one_makes_captions_irrelevant_and_the_draw_survives_resume(base, tmp_path):
    one = captioned(tmp_path / "one", ["a striped card", "a blue ocean at night"])
    other = captioned(tmp_path / "other", ["completely different words", "x"])
    short_run(base, one, tmp_path / "a.safetensors", caption_dropout=1.0)
    short_run(base, other, tmp_path / "b.safetensors", caption_dropout=1.0)
    assert same_lora(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert json.loads((tmp_path / "a.train" / "train.json").read_text())["settings"]["caption_dropout"] == 1.0
    # P = 0.5: resuming the straight run's step-1 checkpoint gives its step 2 (the draw is keyed by seed and batch)
    kw = dict(caption_dropout=0.5, batch_size=2, save_every=1)
    straight = short_run(base, one, tmp_path / "s.safetensors", **kw)
    shutil.copytree(tmp_path / "s.train", tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "checkpoint-000002")
    resumed = short_run(base, one, tmp_path / "r2.safetensors", work_dir=tmp_path / "r", resume=True, **kw)
    losses = lambda evs: [e.loss for e in evs if isinstance(e, StepFinished)]  # noqa: E731
    assert losses(straight)[1:] == losses(resumed)
    assert same_lora(tmp_path / "s.safetensors", tmp_path / "r2.safetensors")
    draws = [d for e in range(200) for d in dropped_captions(0, e, position=1, n=4, p=0.25)]
    assert 0.18 < np.mean(draws) < 0.32 and dropped_captions(3, 1, position=2, n=8, p=0.5) == dropped_captions(
        3, 1, position=2, n=8, p=0.5
    )
    assert (
        dropped_captions(0, 1, position=1, n=3, p=0.0) == [False] * 3
        and dropped_captions(0, 1, position=1, n=3, p=1.0) == [True] * 3
    )


# --- bad input -----------------------------------------------------------------------------------


def resized_snapshot(snap: Path, dst: Path) -> Path:
    """The snapshot with a transformer config of other widths (3 heads: hidden 96, not 64)."""
    dst.mkdir()
    for p in snap.iterdir():
        if p.name != "transformer":
            (dst / p.name).symlink_to(p)
    (dst / "transformer").mkdir()
    for p in (snap / "transformer").iterdir():
        if p.name != "config.json":
            (dst / "transformer" / p.name).symlink_to(p)
    config = json.loads((snap / "transformer" / "config.json").read_text())
    (dst / "transformer" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    return dst


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--caption-dropout", "1.5"], ["caption-dropout", "[0.0, 1.0]"]),
        (["--caption-dropout", "-0.1"], ["caption-dropout"]),
        (["--caption-dropout", "nan"], ["caption-dropout"]),
        (["--trigger", " "], ["--trigger"]),
        (["--sample-size", "100"], ["sample-size", "multiple of 16"]),
        (["--sample-size", "32"], ["sample-size"]),
        (["--sample-strengths", "a,1"], ["sample-strengths"]),
        (["--sample-strengths", "0"], ["sample-strengths"]),
        (["--sample-strengths", "1,1"], ["sample-strengths"]),
        (["--sample-strengths", ""], ["sample-strengths"]),
        (["--sample-model", "MISSING"], ["--sample-model", "not found"]),
        (["--sample-model", "NOT_KLEIN"], ["--sample-model", "FluxPipeline"]),
        (["--sample-model", "WIDER"], ["--sample-model", "hidden 96", "hidden 64", "same size"]),
    ],
)
def test_bad_sample_and_caption_settings_refused(capsys, base, tmp_path, no_models, extra, words):  # noqa: F811
    data = make_images(tmp_path / "data")
    extra = list(extra)
    if "NOT_KLEIN" in extra:
        extra[1] = str(linked_snapshot(base, tmp_path / "flux1", _class_name="FluxPipeline"))
    elif "WIDER" in extra:
        extra[1] = str(resized_snapshot(base, tmp_path / "wider"))
    elif "MISSING" in extra:
        extra[1] = str(tmp_path / "no-such-model")
    args = base_args(base, data, tmp_path / "o.safetensors") + ["--sample-every", "1", "--sample-prompt", "x"] + extra
    refused(capsys, tmp_path, args, *words)


def test_python_api_refuses_bad_sample_quantize(base, tmp_path, no_models):  # noqa: F811
    from flux_klein_mlx.errors import FluxKleinError

    data = make_images(tmp_path / "data")
    for value in (3, True, "4"):
        with pytest.raises(FluxKleinError, match="sample-quantize must be 4, 8 or None"):
            flux_klein_mlx.train_lora(
                model=base, data=data, output=tmp_path / "o.safetensors", resolution=64, sample_quantize=value
            )
    assert list(tmp_path.iterdir()) == [data]


def test_sample_quantize_is_recorded_and_a_lora_that_changes_nothing_is_warned_about(base, distilled, tmp_path):
    """--sample-quantize 4: the record and its generate command say 4 bits; a LoRA trained with a
    negligible learning rate barely moves the samples, and the run says so."""
    data = captioned(tmp_path / "data", ["a striped test card"])
    with pytest.warns(UserWarning, match="barely changes the samples"):
        events = list(
            flux_klein_mlx.train_lora(
                model=base,
                data=data,
                output=tmp_path / "q.safetensors",
                steps=1,
                rank=4,
                lr=1e-8,
                resolution=64,
                save_every=None,
                sample_every=1,
                sample_prompts=[PROMPT],
                sample_model=distilled,
                sample_quantize=4,
                sample_steps=1,
                sample_size=80,
            )
        )
    last = [e for e in events if isinstance(e, SamplesSaved)][-1]
    assert last.step == 1 and last.changes[0] < 1.0
    rec = record_of(tmp_path / "q.train" / "samples" / "step-000001-0.png")
    assert rec["quantize"] == 4 and rec["width"] == 80 and rec["steps"] == 1
    assert "--quantize 4" in rec["training_sample"]["generate"] and "--width 80" in rec["training_sample"]["generate"]
