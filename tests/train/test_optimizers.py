"""Issue 39: `--optimizer adamw|adafactor|lion|prodigy`, each equal to its torch reference on the same gradients
(train/step/optimizers.py): torch.optim.AdamW, torch.optim.Adafactor (torch 2.5+), lion-pytorch's Lion and
prodigyopt's Prodigy (the packages the trainers use; `pip install lion-pytorch prodigyopt`, in the test
extras). Each runs five steps of the same clipped gradients, at a learning rate that changes every step
(the lr schedule sets it before each step; Prodigy's first step at lr 0, a warmup's, which its reference
skips), on LoRA-shaped parameters, one of them starting at zero as a LoRA's B does. An unknown optimizer
is one line before any model loads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from test_settings import base_args, make_images, no_models, refused  # noqa: F401

from flux_klein_mlx.train.settings import TrainSettings
from flux_klein_mlx.train.step.objective import optimizer_step
from flux_klein_mlx.train.step.optimizers import make_optimizer

SHAPES = [(4, 24), (40, 4), (64,)]  # a LoRA's A, its B (zero at the start), a vector


def problem():
    g = np.random.default_rng(11)
    start = [g.standard_normal(s).astype(np.float32) * 0.1 for s in SHAPES]
    start[1][:] = 0.0
    grads = [[(g.standard_normal(s) * k).astype(np.float32) for s in SHAPES] for k in (2.0, 0.01, 1.0, 0.3, 5.0)]
    return start, grads


def reference(name: str, params, lr: float, weight_decay: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    if name == "lion":
        lion = pytest.importorskip("lion_pytorch", reason="the reference: pip install lion-pytorch")
        return lion.Lion(params, lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)
    prodigyopt = pytest.importorskip("prodigyopt", reason="the reference: pip install prodigyopt")
    return prodigyopt.Prodigy(params, lr=lr, weight_decay=weight_decay)


@pytest.mark.parametrize(
    "name, lrs, weight_decay",
    [
        ("adamw", [1e-3, 2e-3, 1e-3, 5e-4, 1e-3], 1e-2),
        ("adafactor", [1e-2, 2e-2, 1e-2, 5e-3, 1e-2], 1e-2),
        ("lion", [1e-4, 2e-4, 1e-4, 5e-5, 1e-4], 1e-1),
        ("prodigy", [0.0, 1.0, 1.0, 0.5, 1.0], 1e-2),
    ],
)
def test_each_optimizer_equals_its_torch_reference_for_five_steps(name, lrs, weight_decay):
    start, grads = problem()

    class Params(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = [mx.array(a) for a in start]

    ours = Params()
    opt = make_optimizer(TrainSettings(lr=max(lrs), weight_decay=weight_decay, optimizer=name))
    theirs = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in start]
    topt = reference(name, theirs, max(lrs), weight_decay)
    for step, (gs, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        opt.learning_rate = lr  # as the trainer does before each step
        optimizer_step(opt, ours, {"p": [mx.array(x) for x in gs]}, 1.0)
        mx.eval(ours.parameters(), opt.state)
        for group in topt.param_groups:
            group["lr"] = lr
        for p, x in zip(theirs, gs, strict=True):
            p.grad = torch.from_numpy(x.copy())
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        topt.step()
        for a, b, a0 in zip(ours.p, theirs, start, strict=True):
            a, b = np.array(a), b.detach().numpy()
            moved = np.abs(b - a0).max()
            assert np.abs(a - b).max() <= 1e-6 * max(1.0, np.abs(b).max()), (name, step)
            # the updates themselves agree (a wrong step size or weight decay is far outside this)
            assert np.abs((a - a0) - (b - a0)).max() <= 2e-3 * moved + 1e-12, (name, step)
        if name == "prodigy":  # the estimate of d itself, at every step
            d = topt.param_groups[0]["d"]
            assert float(opt.state["prodigy"]["d"]) == pytest.approx(d, rel=1e-4), step
    assert any(np.abs(np.array(a) - a0).max() > 0 for a, a0 in zip(ours.p, start, strict=True))


def test_an_unknown_optimizer_is_one_line_before_any_model(capsys, tmp_path, no_models):  # noqa: F811
    data = make_images(tmp_path / "data")
    args = base_args(tmp_path / "model", data, tmp_path / "o.safetensors")
    refused(capsys, tmp_path, [*args, "--optimizer", "sgd"], "optimizer must be one of", "adamw", "prodigy")


@pytest.mark.parametrize("name", ["prodigy", "adafactor"])
def test_a_resume_continues_each_optimizer_bit_for_bit(base, tmp_path, name):
    """2 steps, then a resume to 3, give the LoRA of 3 steps straight: the checkpoint holds the optimizer's
    whole state (Prodigy's run-wide estimate of d too; Adafactor's factored moments)."""
    import flux_klein_mlx

    data = make_images(tmp_path / "data")
    common = dict(model=base, data=data, rank=4, resolution=64, optimizer=name, lr=1.0 if name == "prodigy" else 1e-2)
    list(flux_klein_mlx.train_lora(output=tmp_path / "straight.safetensors", steps=3, **common))
    list(flux_klein_mlx.train_lora(output=tmp_path / "a.safetensors", steps=2, save_every=1, **common))
    list(
        flux_klein_mlx.train_lora(
            output=tmp_path / "b.safetensors", steps=3, resume=True, work_dir=tmp_path / "a.train", **common
        )
    )
    straight, resumed = mx.load(str(tmp_path / "straight.safetensors")), mx.load(str(tmp_path / "b.safetensors"))
    assert straight.keys() == resumed.keys()
    assert all(mx.array_equal(straight[k], resumed[k]).item() for k in straight)
    assert any(mx.any(v != 0).item() for k, v in straight.items() if "lora_B" in k or "lora_up" in k)
