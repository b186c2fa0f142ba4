"""Training on several processes (issue 29): two processes under `mlx.launch --backend ring -n 2`
(CPU, this machine) with --batch-size 1 train what one process trains with --batch-size 2.

One story, three runs: one process straight through 4 steps (batch 2, 2 micro-batches per step);
two processes that lose rank 1 at step 4 (one line, the step-2 checkpoint kept, nothing else
written); the same two processes resuming to step 4. The two-process file equals the one-process
file to float tolerance, and only rank 0 printed and wrote. On FLUX 3 Image Klein, an edit LoRA (the
references as their own stream) with captions of two window lengths: two processes equal one as well.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from command_line import assert_one_line_error, run_cli
from PIL import Image

import flux_klein_mlx
from flux_klein_mlx.train.step.distributed import World, example_draws

ROOT = Path(__file__).resolve().parents[2]
LONG_CAPTION = "a striped test card on a wooden easel in a quiet room, " * 12  # past 80 tokens: a window of 160

# rank 1 dies (as a killed process would: no cleanup) when it starts step DIE_AT
RANK_DIES = """
import os, sys
import flux_klein_mlx.train.trainer as t
from flux_klein_mlx.__main__ import main
step = t.Trainer.train_step
def dying_step(self):
    if self.world.rank == 1 and self.step_no + 1 == int(os.environ["DIE_AT"]):
        os._exit(9)
    return step(self)
t.Trainer.train_step = dying_step
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    """The first of two free ports for the ring (rank r listens on port + r): both are tried, since the suite's
    other worker starts servers on ports of its own meanwhile."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000 and port_is_free(port + 1):
            return port


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(args: list[str], die_at: int = 0) -> subprocess.CompletedProcess:
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "--backend", "ring", "-n", "2", "-p", str(free_port()), "--python", sys.executable]
    command += ["-c", RANK_DIES] if die_at else ["-m", "flux_klein_mlx"]
    # one BLAS thread per process: two processes share this machine's cores
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "DIE_AT": str(die_at),
        "OPENBLAS_NUM_THREADS": "1",
    }
    return subprocess.run(command + ["train", *args], capture_output=True, text=True, env=env, timeout=500, cwd=ROOT)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three captioned images in two buckets at resolution 64 (64x64 x2, 48x80 x1): with a global batch
    of 2, the 48x80 image makes a batch of one, which leaves rank 1 without an example. The second caption
    is long (FLUX 3: a window of 160 tokens beside the first's 80, in one batch)."""
    d = tmp_path_factory.mktemp("dist-data")
    g = np.random.default_rng(0)
    for i, (h, w) in enumerate([(64, 64), (64, 64), (96, 64)]):
        Image.fromarray((g.random((h, w, 3)) * 255).astype(np.uint8)).save(d / f"im{i}.png")
        (d / f"im{i}.txt").write_text(LONG_CAPTION if i == 1 else "a striped test card")
    return d


@pytest.fixture(scope="module")
def controls(data, tmp_path_factory):
    """A control image for each of `data`'s (an edit LoRA's references)."""
    c = tmp_path_factory.mktemp("dist-controls")
    g = np.random.default_rng(1)
    for path in sorted(data.glob("*.png")):
        w, h = Image.open(path).size
        Image.fromarray((g.random((h, w, 3)) * 255).astype(np.uint8)).save(c / path.name)
    return c


def test_shares_cover_the_global_batch_and_draws_do_not_depend_on_the_split():
    for n in range(0, 7):
        for size in (1, 2, 3):
            parts = [World(None, r, size).share(n) for r in range(size)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    whole = example_draws(5, 3, indices=range(0, 4), scheme="shift", shape=(6, 2))
    halves = [example_draws(5, 3, indices=range(a, b), scheme="shift", shape=(6, 2)) for a, b in ((0, 2), (2, 4))]
    assert np.array_equal(whole[0], np.concatenate([h[0] for h in halves]))
    assert np.array_equal(whole[1], np.concatenate([h[1] for h in halves]))
    assert not np.array_equal(
        whole[1], example_draws(5, 4, indices=range(0, 4), scheme="shift", shape=(6, 2))[1]
    )  # another step
    uniform = example_draws(5, 3, indices=range(0, 4), scheme="uniform", shape=(6, 2))[0]
    assert ((uniform >= 0) & (uniform < 1)).all() and not np.array_equal(uniform, whole[0])


@pytest.fixture(scope="module")
def one_process(base, data, tmp_path_factory):
    """One process straight through 4 steps at batch 2 (2 micro-batches per step), float32, a checkpoint every 2
    steps: its folder, holding one.safetensors and its work folder one.train (checkpoints 2 and 4). The two-process
    runs are judged by it, and its checkpoint is the one a two-process --resume refuses (one run for both tests)."""
    folder = tmp_path_factory.mktemp("one-process")
    list(
        flux_klein_mlx.train_lora(
            model=base,
            data=data,
            output=folder / "one.safetensors",
            resolution=64,
            rank=4,
            dtype="float32",
            steps=4,
            grad_accum=2,
            lr=1e-3,
            save_every=2,
            keep_checkpoints=5,
            batch_size=2,
        )
    )
    return folder


def test_two_processes_equal_one_with_twice_the_batch_survive_a_dead_rank_and_resume(base, data, one_process):
    tmp_path = one_process  # the two-process run writes beside the one-process run's files
    common = [
        "--model",
        str(base),
        "--data",
        str(data),
        "--resolution",
        "64",
        "--rank",
        "4",
        "--dtype",
        "float32",
        "--steps",
        "4",
        "--grad-accum",
        "2",
        "--lr",
        "1e-3",
        "--save-every",
        "2",
        "--keep-checkpoints",
        "5",
    ]
    one = tmp_path / "one.safetensors"  # the module's one-process run, with the settings of `common` at batch 2
    two, work = tmp_path / "two.safetensors", tmp_path / "two.train"
    args = common + ["--batch-size", "1", "--output", str(two), "--work-dir", str(work)]

    died = launch(args, die_at=4)  # rank 0 has written checkpoint 2 and its plot before step 3 could end
    ours = [
        line for line in (died.stdout + died.stderr).splitlines() if not line.startswith(("[ring]", "\x1b[33m[WARN]"))
    ]
    errors = [line for line in ours if line.startswith("error:")]
    assert len(errors) == 1, died.stderr
    # rank 0 is stopped in step 3's last work (after its all-reduce) or waiting in step 4: either is the truth
    assert re.search(r"stopped this one at step [34];", errors[0]), errors[0]
    assert "checkpoint-000002" in errors[0] and "--resume" in errors[0]
    assert sum(line.startswith("captions:") for line in ours) == 1  # rank 0 alone prints
    assert sorted(p.name for p in work.iterdir() if p.name != "tensorboard") == [  # tensorboard/: tensorboardX's
        ".flux_klein_mlx-train",
        "checkpoint-000002",
        "loss.png",
        "metrics.jsonl",  # issue 39: the metrics log
        "train.json",
    ]
    assert not two.exists()

    resumed = launch(args + ["--resume"])
    out = resumed.stdout + resumed.stderr
    assert sum(line.startswith("wrote ") for line in out.splitlines()) == 1, out
    assert "resuming from" in out and "at step 3" in out
    a, b = mx.load(str(one)), mx.load(str(two))
    assert a.keys() == b.keys()
    scale = max(float(mx.abs(v).max()) for v in a.values())
    # AdamW turns float noise in near-zero gradient entries into steps of up to lr: 1e-4 of the weights' scale
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a) <= 1e-4 * scale
    # the losses of every step (state.json) agree too: the same examples, noise and noise levels
    import json

    la = json.loads((tmp_path / "one.train" / "checkpoint-000004" / "state.json").read_text())["losses"]
    lb = json.loads((work / "checkpoint-000004" / "state.json").read_text())["losses"]
    assert np.allclose(la, lb, rtol=1e-5, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors") == [
        "one.safetensors",
        "two.safetensors",
    ]


def tree_state(root):
    """Every path under `root`, and each file's modification time: nothing created, removed or written.
    (A folder's own time moves when the work-folder check probes that it can write there.)"""
    return sorted((p.relative_to(root), p.stat().st_mtime_ns if p.is_file() else None) for p in root.rglob("*"))


def test_two_processes_refuse_a_one_process_checkpoint_in_one_line(base, data, one_process):
    """The real two-process path of the refusal (rank 0 checks the work folder, rank 1 agrees): one line,
    before any model loads, nothing written. The one-process checkpoint is the module's run's."""
    tmp_path = one_process
    before = tree_state(tmp_path)
    args = [
        "--model",
        str(base),
        "--data",
        str(data),
        "--resolution",
        "64",
        "--rank",
        "4",
        "--steps",
        "2",
        "--batch-size",
        "1",
        "--output",
        str(tmp_path / "refused.safetensors"),  # not two.safetensors: the other test's output may be there
        "--work-dir",
        str(tmp_path / "one.train"),
        "--resume",
    ]
    refused = launch(args)
    lines = (refused.stdout + refused.stderr).splitlines()
    ours = [
        line for line in lines if line.strip() and not line.startswith("\x1b[33m[WARN]")
    ]  # mlx.launch may add a blank line
    assert len(ours) == 1 and ours[0].startswith("error: --resume:"), ours
    assert "trained by 1 process(es), this run has 2" in ours[0]
    assert tree_state(tmp_path) == before


def test_flux3_edit_lora_with_two_caption_windows_on_two_processes_equals_one(base3, data, controls, tmp_path):
    """FLUX 3, an edit LoRA (the references as their own stream) with captions of two window lengths:
    `mlx.launch --backend ring -n 2` at batch 1 trains what one process trains at batch 2 (the same examples,
    noise and noise levels; float tolerance)."""
    common = dict(resolution=64, rank=4, dtype="float32", steps=2, grad_accum=2, lr=1e-3, save_every=2)
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    list(flux_klein_mlx.train_lora(model=base3, data=data, controls=[controls], output=one, batch_size=2, **common))
    args = ["--model", str(base3), "--data", str(data), "--control", str(controls), "--output", str(two)]
    for key, value in common.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    done = launch(args + ["--batch-size", "1"])
    assert done.returncode == 0 and two.is_file(), done.stdout + done.stderr
    a, b = mx.load(str(one)), mx.load(str(two))
    assert a.keys() == b.keys() and any("image_cond" in k for k in a)
    scale = max(float(mx.abs(v).max()) for v in a.values())
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a) <= 1e-4 * scale
    losses = [
        json.loads((d / "checkpoint-000002" / "state.json").read_text())["losses"]
        for d in (tmp_path / "one.train", tmp_path / "two.train")
    ]
    assert np.allclose(losses[0], losses[1], rtol=1e-5, atol=0)


def test_a_ring_port_in_use_is_one_line(base, data, tmp_path, capsys, monkeypatch):
    """mlx.launch with a -p whose port another program holds: the rank that cannot bind said MLX's RuntimeError
    as a traceback (seen when this file's launches met the suite's servers); now one line naming -p."""

    def taken():
        raise RuntimeError("[ring] Couldn't bind socket (error: 98)")

    monkeypatch.setattr(mx.distributed, "init", taken)
    out = tmp_path / "o.safetensors"
    code, _, err = run_cli(capsys, "train", "--model", base, "--data", data, "--output", out)
    assert_one_line_error(code, err, "could not join the others", "error: 98", "another -p")
    assert not out.exists()
