"""Issue 34, stale facts: a trained file's header says what its run did, read back from the written file.

- a cosine run's header names cosine and its warmup, and diffusers' `get_scheduler` given those keys
  replays the lrs the run stepped at;
- a run at several sizes lists each as kohya writes one, `(W, H)`, the sizes the run's buckets had;
- the trigger is the one the captions were trained with;
- the adapter kind: kohya's `networks.lora` and `.../lora` for a LoRA, LyCORIS' `lycoris.kohya` with
  `algo=lokr` and the factor and `.../lokr` for a LoKr;
- a LoKr run's memory plan counts the LoKr's own trainable values: the trainer's count and the values
  of the factors in the written file, printed on the plan's line.

Two runs of the tiny Base model (64 px, rank 4, 1-2 steps), shared by the tests of this module.
"""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import flux_klein_mlx
from flux_klein_mlx.train.command import describe_event
from flux_klein_mlx.train.memory import MemoryPlanned
from flux_klein_mlx.train.trainer import StepFinished, TrainStarted


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Two square captioned images, one caption text (each distinct caption costs a text-encoder run)."""
    d = tmp_path_factory.mktemp("header-data") / "cards"
    d.mkdir()
    g = np.random.default_rng(11)
    for i in range(2):
        Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(d / f"im{i}.png")
        (d / f"im{i}.txt").write_text("a test card")
    return d


def train(base, photos, output, **settings) -> list:
    common = dict(model=base, data=photos, output=output, rank=4, save_every=None, dtype="float32")
    return list(flux_klein_mlx.train_lora(**common, **settings))


def header(path) -> dict[str, str]:
    with safe_open(str(path), "np") as f:
        return f.metadata()


def first(events: list, kind):
    return next(e for e in events if isinstance(e, kind))


@pytest.fixture(scope="module")
def cosine_run(base, photos, tmp_path_factory):
    """A LoRA: cosine with one warmup step, 2 steps, at 64 and 80 px, trigger sks."""
    out = tmp_path_factory.mktemp("cosine") / "cosine.safetensors"
    events = train(
        base, photos, out, steps=2, lr=3e-4, lr_scheduler="cosine", warmup_steps=1, resolution=(64, 80), trigger="sks"
    )
    return out, events


@pytest.fixture(scope="module")
def lokr_run(base, photos, tmp_path_factory):
    """A LoKr (factor 4), 1 constant step at 64 px, in the ComfyUI layout (LyCORIS' keys)."""
    out = tmp_path_factory.mktemp("lokr") / "lokr.safetensors"
    events = train(base, photos, out, steps=1, resolution=64, adapter="lokr", lokr_factor=4, format="comfyui")
    return out, events


def test_a_cosine_runs_header_says_cosine_and_its_warmup(cosine_run):
    from diffusers.optimization import get_scheduler

    out, events = cosine_run
    meta = header(out)
    assert meta["ss_lr_scheduler"] == "cosine" and meta["ss_lr_warmup_steps"] == "1"
    # the header's keys are enough to replay the run's lrs with diffusers' own scheduler
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=float(meta["ss_learning_rate"]))
    sched = get_scheduler(
        meta["ss_lr_scheduler"],
        optimizer=opt,
        num_warmup_steps=int(meta["ss_lr_warmup_steps"]),
        num_training_steps=int(meta["ss_max_train_steps"]),
    )
    replayed = []
    for _ in range(int(meta["ss_steps"])):
        replayed.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ran = [e.lr for e in events if isinstance(e, StepFinished)]
    assert len(ran) == 2 and np.allclose(ran, replayed, rtol=0, atol=1e-12), (ran, replayed)


def test_a_multi_resolution_runs_header_lists_its_sizes_as_kohya_writes_one(cosine_run):
    out, events = cosine_run
    meta = header(out)
    assert meta["ss_resolution"] == "(64, 64), (80, 80)"
    trained = {tuple(int(n) for n in key.split("x")) for key in first(events, TrainStarted).buckets}
    assert set(ast.literal_eval(meta["ss_resolution"])) == trained == {(64, 64), (80, 80)}
    assert meta["modelspec.resolution"] == "80x80"  # the spec's one size: the largest trained
    # images, not examples: an image trained at two sizes is one image with one caption
    assert meta["ss_num_train_images"] == "2"
    assert json.loads(meta["ss_tag_frequency"]) == {"cards": {"sks": 2, "a test card": 2}}


def test_the_header_names_the_trigger_the_captions_were_trained_with(cosine_run):
    out, _ = cosine_run
    meta = header(out)
    trained = json.loads((out.with_name("cosine.train") / "train.json").read_text())["data"]
    assert {item["caption"] for item in trained} == {"sks, a test card"}
    assert meta["flux_klein_mlx.trigger"] == meta["modelspec.trigger_phrase"] == "sks"


def test_a_lora_runs_header_names_lora_and_its_plan_counts_its_parameters(cosine_run):
    out, events = cosine_run
    meta = header(out)
    assert meta["ss_network_module"] == "networks.lora" and "ss_network_args" not in meta
    assert meta["modelspec.architecture"].endswith("/lora")
    assert first(events, MemoryPlanned).trainable == first(events, TrainStarted).parameters


def test_a_lokr_runs_header_names_lokr(lokr_run):
    out, _ = lokr_run
    meta = header(out)
    assert meta["ss_network_module"] == "lycoris.kohya"
    assert json.loads(meta["ss_network_args"]) == {"algo": "lokr", "factor": "4"}
    assert meta["modelspec.architecture"].endswith("/lokr")
    assert meta["ss_lr_scheduler"] == "constant" and meta["ss_lr_warmup_steps"] == "0"
    assert meta["ss_resolution"] == "(64, 64)" and meta["modelspec.resolution"] == "64x64"
    assert "flux_klein_mlx.trigger" not in meta and "modelspec.trigger_phrase" not in meta  # no trigger given


def test_a_lokr_runs_memory_plan_counts_the_lokr_factors_and_prints_the_count(lokr_run, base):
    from flux_klein_mlx.run.loading import describe
    from flux_klein_mlx.train.step.adapters import adapter_parameters, parse_targets

    out, events = lokr_run
    plan, started = first(events, MemoryPlanned), first(events, TrainStarted)
    with safe_open(str(out), "np") as f:  # the factors as written: w1, w2 (or w2's pair); no alpha
        written = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys() if ".lokr_" in k)
    assert plan.trainable == started.parameters == written
    params = describe(base).params
    lora_count = adapter_parameters(parse_targets("all", params), params, adapter="lora", rank=4, lokr_factor=4)
    assert plan.trainable != lora_count  # the count a LoRA of this rank would have (what the plan said before)
    line = describe_event(plan)
    assert line.startswith("memory plan: a step peaks at about ") and f"{written:,} trainable parameters" in line
