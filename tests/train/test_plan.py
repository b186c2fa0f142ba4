"""Issue 29, first part: learning-rate schedules, several resolutions, a config file, the memory plan.

- every step's lr against diffusers' `get_scheduler` stepping a torch optimizer, and the lr driving
  the optimizer (a step at lr 0 changes nothing);
- several resolutions: one example per image and size, batches within one size, resume bit-exact
  with a cosine schedule (bf16, the default dtype);
- `--config` (TOML and a previous run's train.json) gives the flags run's file bit for bit; an
  override changes the setting it names and nothing else;
- the memory model against the rows that benchmarks/train_step.py measured, and the remedies it names; the
  plan's weights of each family's released Base model, diffusers' transformer's parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from command_line import run_cli
from PIL import Image

import flux_klein_mlx
from flux_klein_mlx.models.flux2.config import FluxKleinParams
from flux_klein_mlx.train import memory
from flux_klein_mlx.train.data.dataset import epoch_batches, scan_data
from flux_klein_mlx.train.step.objective import SCHEDULES, lr_at_step
from flux_klein_mlx.train.trainer import StepFinished, TrainStarted

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def snap(base):
    return base


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Three captioned images: two square, one tall (two buckets at each size)."""
    d = tmp_path_factory.mktemp("plan-data") / "photos"
    d.mkdir()
    g = np.random.default_rng(7)
    for i, (h, w) in enumerate([(64, 64), (96, 64), (64, 64)]):
        Image.fromarray((g.random((h, w, 3)) * 255).astype(np.uint8)).save(d / f"im{i}.png")
        (d / f"im{i}.txt").write_text("a test card")
    return d


def diffusers_lrs(name: str, lr: float, warmup: int, steps: int) -> list[float]:
    """The lr of each optimizer step, as diffusers' training scripts run it: step, then scheduler.step()."""
    from diffusers.optimization import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    sched = get_scheduler(name, optimizer=opt, num_warmup_steps=warmup, num_training_steps=steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


CASES = [
    (name, warmup, steps)
    for name in SCHEDULES
    for warmup, steps in [(0, 1), (0, 7), (3, 10), (10, 10), (4, 9)]
    if not (name == "constant" and warmup)
]  # constant with a warmup is refused (test_settings.py)


@pytest.mark.parametrize("name, warmup, steps", CASES)
def test_every_steps_lr_equals_diffusers_get_scheduler(name, warmup, steps):
    ours = [lr_at_step(name, base_lr=3e-4, step=k, warmup=warmup, total=steps) for k in range(1, steps + 1)]
    ref = diffusers_lrs(name, 3e-4, warmup, steps)
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) <= 1e-12, (ours, ref)


def run(**kw) -> list:
    return list(flux_klein_mlx.train_lora(**kw))


def test_the_schedule_drives_the_optimizer_and_the_events(snap, photos, tmp_path):
    """StepFinished.lr is diffusers' value, and the optimizer runs at it: a warmup's first step (lr 0)
    leaves the LoRA as initialised (B = 0), a constant schedule's does not."""
    common = dict(model=snap, data=photos, rank=4, resolution=64, save_every=None, dtype="float32")
    # (a warmup as long as the run is refused, issue 38: the first step's checkpoint shows it)
    warm = dict(common, save_every=1, work_dir=tmp_path / "w.train")
    evs = run(output=tmp_path / "w.safetensors", steps=2, lr_scheduler="constant_with_warmup", warmup_steps=1, **warm)
    assert [e.lr for e in evs if isinstance(e, StepFinished)] == [0.0, 1e-4]
    first = tmp_path / "w.train" / "checkpoint-000001" / "lora.safetensors"
    b = [v for k, v in mx.load(str(first)).items() if "lora_B" in k]
    assert all(not np.any(np.array(v)) for v in b)
    run(output=tmp_path / "c.safetensors", steps=1, **common)
    b = [v for k, v in mx.load(str(tmp_path / "c.safetensors")).items() if "lora_B" in k]
    assert any(np.any(np.array(v)) for v in b)


def test_several_resolutions_make_one_example_per_size_and_batches_of_one_size(photos):
    items = scan_data(photos, resolution=(64, 96))
    assert [(it.stem, it.bucket) for it in items] == [
        ("im0", (64, 64)),
        ("im0", (96, 96)),
        ("im1", (48, 80)),
        ("im1", (80, 112)),
        ("im2", (64, 64)),
        ("im2", (96, 96)),
    ]
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(5):
        for batch in epoch_batches(items, 2, rng):
            assert len({items[i].bucket for i in batch}) == 1
            seen.append(tuple(batch))
    again = np.random.default_rng(0)
    assert [tuple(b) for _ in range(5) for b in epoch_batches(items, 2, again)] == seen  # drawn from the seed


def test_resume_bit_exact_with_several_resolutions_and_a_cosine_schedule(snap, photos, tmp_path):
    """bf16 (the default): a 4-step run stopped after its step-2 checkpoint and resumed == 4 steps
    straight, with lrs equal to diffusers' cosine. (A decay's values depend on --steps, so the stopped
    run was a 4-step run too.)"""
    common = dict(
        model=snap,
        data=photos,
        rank=4,
        resolution="64,96",
        batch_size=2,
        lr_scheduler="cosine",
        warmup_steps=1,
        save_every=2,
        keep_checkpoints=3,
        lr=1e-3,
    )
    straight = run(output=tmp_path / "s.safetensors", steps=4, **common)
    first = []
    for ev in flux_klein_mlx.train_lora(output=tmp_path / "a.safetensors", steps=4, work_dir=tmp_path / "r", **common):
        first.append(ev)
        if type(ev).__name__ == "CheckpointSaved":
            break  # stopped after step 2
    second = run(output=tmp_path / "b.safetensors", steps=4, work_dir=tmp_path / "r", resume=True, **common)
    steps = lambda evs: [(e.step, e.loss, e.lr) for e in evs if isinstance(e, StepFinished)]  # noqa: E731
    assert steps(first) + steps(second) == steps(straight)
    assert [lr for _, _, lr in steps(straight)] == pytest.approx(diffusers_lrs("cosine", 1e-3, 1, 4), abs=1e-12)
    started = next(e for e in straight if isinstance(e, TrainStarted))
    assert started.buckets == {"64x64": 2, "96x96": 2, "48x80": 1, "80x112": 1} and started.images == 3
    a, b = (mx.load(str(tmp_path / f"{n}.safetensors")) for n in "sb")
    f32 = lambda v: np.array(v.astype(mx.float32))  # noqa: E731  (bf16 files; float32 is exact for them)
    assert a.keys() == b.keys() and all(np.array_equal(f32(a[k]), f32(b[k])) for k in a)
    assert all(v.dtype == mx.bfloat16 for v in b.values())
    with pytest.raises(flux_klein_mlx.FluxKleinError, match="schedule_steps"):  # a decay's values depend on --steps
        flux_klein_mlx.train_lora(
            output=tmp_path / "c.safetensors", steps=6, work_dir=tmp_path / "r", resume=True, **common
        )


# --- config files ------------------------------------------------------------------------------------


def cli(capsys, *args) -> str:
    rc, _, err = run_cli(capsys, "train", *args)
    assert rc == 0, err
    return err


# The header keys that say when a file was made and under what name: all else must be identical.
RUN_STAMPS = (
    "ss_training_started_at",
    "ss_training_finished_at",
    "ss_output_name",
    "modelspec.title",
    "modelspec.date",
)


def same_run_contents(path) -> tuple:
    """A LoRA file's tensors (bytes) and header, less the keys that stamp when and as what it was written."""
    import json as json_module
    import struct

    data = Path(path).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]  # safetensors: 8-byte header length, the JSON header, the tensors
    header = json_module.loads(data[8 : 8 + n])
    stamps = {k: v for k, v in header.pop("__metadata__", {}).items() if k not in RUN_STAMPS}
    return header, stamps, data[8 + n :]


def test_config_toml_and_train_json_give_the_flags_runs_file_and_overrides_change_only_what_they_name(
    snap, photos, tmp_path, capsys
):
    flags = [
        "--rank",
        "4",
        "--resolution",
        "64,80",
        "--steps",
        "2",
        "--lr-scheduler",
        "linear",
        "--warmup-steps",
        "1",
        "--lr",
        "1e-3",
        "--save-every",
        "2",
        "--targets",
        "attention",
        "--seed",
        "3",
        "--dtype",  # float32: faster than bf16 on a CPU; what reaches the run is what is checked
        "float32",
    ]
    err = cli(capsys, "--model", snap, "--data", photos, "--output", tmp_path / "flags.safetensors", *flags)
    assert "memory plan: a step peaks at about" in err and " lr 0 " in err  # step 1 of a warmup runs at lr 0
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'model = "{snap}"\ndata = "{photos}"\noutput = "{tmp_path / "toml.safetensors"}"\nrank = 4\n'
        'resolution = [64, 80]\nsteps = 2\nlr_scheduler = "linear"\nwarmup_steps = 1\nlr = 1e-3\n'
        'save_every = 2\ntargets = "attention"\nseed = 3\ndtype = "float32"\n'
    )
    cli(capsys, "--config", toml)
    record = tmp_path / "flags.train" / "train.json"
    cli(capsys, "--config", record, "--output", tmp_path / "json.safetensors")
    files = [same_run_contents(tmp_path / f"{n}.safetensors") for n in ("flags", "toml", "json")]
    assert files[0] == files[1] == files[2]
    cli(capsys, "--config", record, "--output", tmp_path / "more.safetensors", "--steps", "3")
    old, new = (json.loads((tmp_path / f"{n}.train" / "train.json").read_text())["settings"] for n in ("flags", "more"))
    assert sorted(k for k in old if old[k] != new[k]) == ["output", "steps", "work_dir"]
    assert new["steps"] == 3 and new["resolution"] == [64, 80] and new["lr_scheduler"] == "linear"


# --- the memory plan -----------------------------------------------------------------------------------


def measured() -> dict:
    return json.loads((ROOT / "benchmarks" / "train_step.json").read_text())


def test_memory_model_reproduces_the_measured_training_rows():
    """Within 3 % of every full-depth peak benchmarks/train_step.py measured or fitted (README's table)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    results = measured()
    from flux_klein_mlx.train.step.adapters import parse_targets

    params = FluxKleinParams()
    trainable = sum(16 * (s.in_dims + s.out_dims) for s in parse_targets("all", params))
    for size, _, bits, ckpt in train_step.MEMORY_CONFIGS:
        fitted, resident = train_step.fitted_peak(results, size, "bfloat16", bits, ckpt)
        ours, weights = memory.step_peak(params, trainable, resolution=size, bits=bits, low_memory=ckpt)
        assert abs(weights + 12 * trainable - resident) / resident < 0.01, (size, bits, ckpt)
        assert abs(ours - fitted) / fitted < 0.03, (size, bits, ckpt, ours, fitted)
    for r in results["memory"]:
        if (r["depth"], r["depth_single"]) == (5, 20):
            ours, _ = memory.step_peak(
                params, trainable, resolution=r["size"], bits=r["bits"], low_memory=r["checkpoint"]
            )
            assert abs(ours - r["peak"]) / r["peak"] < 0.03


def test_memory_plan_names_what_makes_it_fit(monkeypatch):
    from flux_klein_mlx.train.settings import TrainSettings
    from flux_klein_mlx.train.step.adapters import parse_targets

    params = FluxKleinParams()
    trainable = sum(16 * (s.in_dims + s.out_dims) for s in parse_targets("all", params))
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * 10**9, "test"))
    s = TrainSettings(resolution=1024, rank=16)
    plan = memory.plan_memory(s, params=params, trainable=trainable)
    assert not plan.fits and plan.peak > 33e9
    assert plan.remedies == ["--low-memory (13.2 GB)", "--resolution 384 (13.9 GB)"]  # README: 13.2 GB
    assert memory.plan_memory(
        TrainSettings(resolution=(512, 1024), quantize=4, low_memory=True), params=params, trainable=trainable
    ).fits
    monkeypatch.setattr(memory, "machine_memory", lambda: (6 * 10**9, "test"))
    plan = memory.plan_memory(TrainSettings(resolution=512), params=params, trainable=trainable)
    assert plan.remedies == [
        "--quantize 4 --low-memory (4.2 GB)",
        "--resolution 384 --quantize 4 --low-memory (3.7 GB)",
    ]
    plan = memory.plan_memory(
        TrainSettings(resolution=(512, 768, 1024), low_memory=True), params=params, trainable=trainable
    )
    assert plan.remedies == ["--resolution 512,768 --quantize 4 --low-memory (5.7 GB)"]


def test_memory_plan_counts_the_released_base_weights(family):
    """The plan's weights for the family's released Base model at full size are diffusers' transformer's
    parameters (built on the meta device, nothing allocated) at 2 bytes; 4-bit counts less than a third of that."""
    kit = family.training
    with torch.device("meta"):
        count = sum(p.numel() for p in family.reference_transformer_class()(**kit.released_config).parameters())
    low, high = kit.released_count
    assert low <= count <= high
    params = kit.released_params
    assert memory.weight_bytes(params, None) == 2 * count
    assert memory.weight_bytes(params, 4) < 0.3 * 2 * count
    peak = lambda m: memory.step_peak(params, 10**7, resolution=512, bits=None, low_memory=m)[0]  # noqa: E731
    assert 2 * count < peak(True) < peak(False)  # the weights, then activations; keeping every block's costs more


def test_loss_plot_draws_the_learning_rate_and_config_keys_are_the_long_option_names():
    from flux_klein_mlx.train.command import train
    from flux_klein_mlx.train.config_file import option_names
    from flux_klein_mlx.train.report.evaluation import loss_plot

    losses = [1.0 - 0.01 * k for k in range(40)]
    lrs = [lr_at_step("cosine", base_lr=1e-4, step=k, warmup=5, total=40) for k in range(1, 41)]
    lr_colour = lambda img: int(np.sum(np.all(np.array(img) == (230, 120, 20), axis=-1)))  # noqa: E731  (orange)
    assert lr_colour(loss_plot(losses, window=2)) == 0 and lr_colour(loss_plot(losses, window=2, lrs=lrs)) > 300
    names = option_names(train)
    assert names["control"] == "controls" and names["sample_prompt"] == "sample_prompts"
    assert names["lr_scheduler"] == "lr_scheduler" and names["low_memory"] == "low_memory" and "config" not in names
