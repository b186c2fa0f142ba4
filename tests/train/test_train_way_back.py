"""Issue 38: every failure after work is done names the way back, and the way back works.

Each case reproduces the failure as the issue gives it (a tmpfs-sized disk where root may mount one,
else a writer patched to fail with ENOSPC; NaN written into a checkpoint's bytes; an EMA file
removed or cut short), then asserts the one line, the exit status, that nothing of the user's
changed, and follows the advice the line gives.
"""

from __future__ import annotations

import pytest
from test_train_bad_input import base_args, make_images, refused

import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.train.objective import check_schedule


@pytest.fixture(scope="module")
def snap(base):
    return base  # the session's tiny Base snapshot (conftest.py)


@pytest.fixture
def no_models(monkeypatch):
    def recorder(info, name, *a, **k):
        raise AssertionError(f"the {name} was loaded before the failure was named")

    monkeypatch.setattr(train_module, "load_component", recorder)


# --- case 9: a warmup as long as the run ------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, scheduler, words",
    [
        ("1", "constant_with_warmup", ["--warmup-steps 1 equals --steps 1", "all zero", "give --warmup-steps 0"]),
        ("3", "cosine", ["--warmup-steps 3 equals --steps 3", "below --lr", "give --warmup-steps at most 2"]),
    ],
)
def test_a_warmup_as_long_as_the_run_is_refused_up_front(capsys, snap, tmp_path, no_models, steps, scheduler, words):
    """1 and 1 ran its only step at lr 0 and wrote an all-zero LoRA, exit 0; now one line before any
    model loads, and the value it names runs."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    args = base_args(snap, data, out) + ["--steps", steps, "--lr-scheduler", scheduler, "--warmup-steps", steps]
    refused(capsys, tmp_path, args, *words)
    assert not out.exists() and not (tmp_path / "out.train").exists()
    check_schedule(scheduler, int(steps) - 1, int(steps))  # the advice, followed, passes the check
