"""Issue 38: every failure after work is done names the way back, and the way back works.

Each case reproduces the failure as the issue gives it (a tmpfs-sized disk where root may mount one,
else a writer patched to fail with ENOSPC; NaN written into a checkpoint's bytes; an EMA file
removed or cut short), then asserts the one line, the exit status, that nothing of the user's
changed, and follows the advice the line gives.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from command_line import assert_one_line_error, run_cli
from test_settings import base_args, make_images, refused, small_disk, tree_hash

import flux_klein_mlx.train.report.samples as samples_module
import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.storage.files import is_temporary_file
from flux_klein_mlx.train import state as train_state
from flux_klein_mlx.train import workdir
from flux_klein_mlx.train.step.objective import check_schedule


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


# --- case 12: a full disk under the work folder, at the lock and at a sample point ------------------


def fill(path: Path) -> None:
    """Write into `path` until its file system is full (unbuffered: closing the file writes nothing more)."""
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("earlier", [False, True], ids=["new-folder", "folder-of-an-earlier-run"])
def test_a_full_disk_at_the_lock_is_one_line_and_leaves_nothing(capsys, snap, tmp_path, monkeypatch, earlier):
    """A full disk made the lock a traceback and left an empty train.lock (and, in a new folder, an
    empty marker): now one line, the disk as it was, and the same command runs once space is freed."""
    data = make_images(tmp_path / "data")
    out, disk = tmp_path / "out.safetensors", tmp_path / "disk"
    real = small_disk(disk, "1m")
    work = disk / "run"
    if earlier:
        workdir.claim_work_dir(work)  # the folder a run that ended wrote (its mark, nothing else)
    args = base_args(snap, data, out) + ["--work-dir", work, "--steps", "1", "--dtype", "float32"]
    try:
        with monkeypatch.context() as m:
            if real:
                fill(disk)
            else:  # the writes of the mark and the lock fail as on a full disk
                m.setattr(os, "write", no_space)
                m.setattr(os, "pwrite", no_space)
            before = tree_hash(tmp_path)
            code, _, err = run_cli(capsys, "train", *args)
        what = "the lock" if earlier else "in the work folder"
        assert_one_line_error(code, err, f"cannot write {what}", "No space left on device", "free some space")
        assert tree_hash(tmp_path) == before and not (work / "train.lock").exists()
        assert sorted(os.listdir(work)) == [workdir.WORK_MARKER] if earlier else not work.exists()
        (disk / "filler").unlink(missing_ok=True)  # the advice, followed: the same command
        code, _, err = run_cli(capsys, "train", *args)
        assert code == 0, err
        assert out.is_file() and not (work / "train.lock").exists()
    finally:
        if real:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # -l: a file still open


def test_a_full_disk_at_a_sample_point_is_one_line_and_leaves_no_temporary(
    capsys, snap, distilled, tmp_path, monkeypatch
):
    """The sample LoRA's write on a full disk was a traceback that left a .sample-lora.*.tmp: now one
    line naming the last good checkpoint, no temporary, and --resume finishes the run."""
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "out.safetensors", tmp_path / "disk"
    real = small_disk(work)
    original = samples_module.save_safetensors_streaming

    def writer(path, *a, **k):  # the disk fills just before the first sample's LoRA
        monkeypatch.setattr(samples_module, "save_safetensors_streaming", original)
        if real:
            fill(work)
            return original(path, *a, **k)
        Path(path).write_bytes(b"\0" * 64)  # a part of the file, then the disk is full
        no_space()

    monkeypatch.setattr(samples_module, "save_safetensors_streaming", writer)
    args = base_args(snap, data, out) + ["--work-dir", work, "--steps", "2", "--save-every", "1"]
    args += ["--dtype", "float32", "--sample-every", "1", "--sample-prompt", "a fox", "--sample-model", distilled]
    args += ["--sample-steps", "1", "--sample-size", "64"]
    try:
        code, _, err = run_cli(capsys, "train", *args)
        last = err.strip().splitlines()[-1]
        assert code == 1 and "Traceback" not in err and err.count("error: ") == 1, err
        assert last.startswith("error: cannot write ") and "samples/step-000001.safetensors" in last, last
        for words in ("No space left on device", "the last good checkpoint is", "checkpoint-000001", "--resume"):
            assert words in last, (words, last)
        assert not list(work.glob(".sample-lora.*")) and not out.exists()
        (work / "filler").unlink(missing_ok=True)  # the advice, followed
        code, _, err = run_cli(capsys, "train", *args, "--resume")
        assert code == 0, err
        assert out.is_file() and not list(work.glob(".sample-lora.*"))
    finally:
        if real:
            subprocess.run(["umount", "-l", str(work)], capture_output=True)  # -l: a file still open


# --- cases 7 and 8: NaN in a checkpoint, a missing or damaged ema.safetensors -----------------------


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory):
    """`trained_run`'s runs, made once for this module (extra arguments -> the folder it ran in): each test damages
    and resumes a copy of its own."""
    return {}, tmp_path_factory


def trained_run(capsys, snap, tmp_path, trained_runs, *extra) -> list[str]:
    """A 3-step run with a checkpoint at each step (all kept) in tmp_path/work (a copy of the module's run with
    these `extra` arguments: its data, work folder and first.safetensors); returns the arguments that resume it
    for a 4th step."""
    made, factory = trained_runs
    if extra not in made:
        root = factory.mktemp("trained-run")
        data = make_images(root / "data")
        common = ["--work-dir", root / "work", "--save-every", "1", "--keep-checkpoints", "3", "--dtype", "float32"]
        first = base_args(snap, data, root / "first.safetensors") + common + ["--steps", "3", *extra]
        code, _, err = run_cli(capsys, "train", *first)
        assert code == 0, err
        made[extra] = root
    shutil.copytree(made[extra], tmp_path, dirs_exist_ok=True)  # the run's folders, moved: resume reads no paths
    common = ["--work-dir", tmp_path / "work", "--save-every", "1", "--keep-checkpoints", "3", "--dtype", "float32"]
    return (
        base_args(snap, tmp_path / "data", tmp_path / "out.safetensors") + common + ["--steps", "4", "--resume", *extra]
    )


def poison(path: Path, value: float) -> str:
    """Write `value` over the first number of the file's first float32 tensor, in place; returns its name."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name, entry = next((k, v) for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32")
    with open(path, "r+b") as f:
        f.seek(8 + n + entry["data_offsets"][0])
        f.write(struct.pack("<f", value))
    return name


def refused_before_any_model(capsys, monkeypatch, root: Path, args: list, *words: str) -> str:
    with monkeypatch.context() as m:
        m.setattr(train_module, "load_component", no_model_loads)
        return refused(capsys, root, args, *words)


def no_model_loads(info, name, *a, **k):
    raise AssertionError(f"the {name} was loaded before the damaged checkpoint was named")


def resumed(capsys, args: list, out: Path) -> None:
    """The advice, followed: the resume runs its step and writes the output."""
    code, _, err = run_cli(capsys, "train", *args)
    assert code == 0, err
    assert out.is_file()


@pytest.mark.parametrize("how", ["nan-in-lora", "inf-in-moments-and-an-earlier-one"])
def test_nan_in_a_checkpoint_is_named_before_any_model_loads(capsys, snap, tmp_path, monkeypatch, trained_runs, how):
    """NaN or infinity in a checkpoint resumed, then failed with "lower --lr": now its bytes are read
    with its headers, and the line names it and the newest earlier checkpoint that is whole."""
    args = trained_run(capsys, snap, tmp_path, trained_runs)
    work = tmp_path / "work"
    if how == "nan-in-lora":
        name = poison(work / "checkpoint-000003" / "lora.safetensors", float("nan"))
        todo = "delete that folder to continue from checkpoint-000002 with --resume"
        gone = ["checkpoint-000003"]
    else:
        name = poison(work / "checkpoint-000003" / "optimizer.safetensors", float("inf"))
        poison(work / "checkpoint-000002" / "lora.safetensors", float("-inf"))
        todo = "delete that folder and checkpoint-000002 (damaged too) to continue from checkpoint-000001 with --resume"
        gone = ["checkpoint-000003", "checkpoint-000002"]
    err = refused_before_any_model(
        capsys, monkeypatch, tmp_path, args, "checkpoint-000003", "is damaged", "NaN or infinite", name, todo
    )
    assert "lower --lr" not in err and "download" not in err
    for folder in gone:
        shutil.rmtree(work / folder)
    resumed(capsys, args, tmp_path / "out.safetensors")


@pytest.mark.parametrize("how", ["missing", "cut-short", "nan"])
def test_a_damaged_ema_file_is_named_with_the_checkpoint(capsys, snap, tmp_path, monkeypatch, trained_runs, how):
    """A missing ema.safetensors got advice (resume without --ema) that was itself refused; a damaged
    one was found after the model loaded, with "download it again": now both are named with the
    checkpoint, before any model loads, and the advice resumes."""
    args = trained_run(capsys, snap, tmp_path, trained_runs, "--ema", "0.9")
    ema = tmp_path / "work" / "checkpoint-000003" / "ema.safetensors"
    if how == "missing":
        ema.unlink()
        words = ["ema.safetensors is missing"]
    elif how == "cut-short":
        ema.write_bytes(ema.read_bytes()[:-64])
        words = ["ema.safetensors is cut short"]
    else:
        words = ["ema.safetensors holds NaN or infinite values", poison(ema, float("nan"))]
    todo = "delete that folder to continue from checkpoint-000002 with --resume"
    err = refused_before_any_model(capsys, monkeypatch, tmp_path, args, "checkpoint-000003", *words, todo)
    assert "download" not in err and "without --ema" not in err
    shutil.rmtree(ema.parent)
    resumed(capsys, args, tmp_path / "out.safetensors")


# --- case 4: a full disk at the final write ------------------------------------------------------


@pytest.mark.parametrize("asked", [[], ["--format", "comfyui", "--ema", "0.9"], ["--format", "kohya"]])
def test_a_full_disk_at_the_final_write_names_the_command_that_finishes_the_run(
    capsys, snap, tmp_path, monkeypatch, asked
):
    """The final write on a full disk said "nothing was written", and --resume was then refused
    ("already at step 2 of 2"); with --format or --ema the checkpoint's file is not the result asked
    for. Now the line names the checkpoint and the command, and that command writes the output a
    straight run writes (the asked layout, the EMA), without training."""
    data = make_images(tmp_path / "data")
    disk = tmp_path / "disk"
    real = small_disk(disk, "1m")
    out = disk / "out.safetensors"
    common = ["--steps", "2", "--dtype", "float32", *asked]
    code, _, err = run_cli(capsys, "train", *base_args(snap, data, tmp_path / "straight.safetensors"), *common)
    assert code == 0, err
    original = train_module.write_lora_file

    def writer(path, *a, **k):  # the disk fills just before the output is written
        monkeypatch.setattr(train_module, "write_lora_file", original)
        if real:
            fill(disk)
            return original(path, *a, **k)
        no_space()

    monkeypatch.setattr(train_module, "write_lora_file", writer)
    args = base_args(snap, data, out) + ["--work-dir", tmp_path / "work", *common]
    try:
        before = tree_hash(data)
        code, _, err = run_cli(capsys, "train", *args)
        last = err.strip().splitlines()[-1]
        assert code == 1 and "Traceback" not in err and err.count("error: ") == 1, err
        for words in ("No space left on device", "checkpoint-000002 (step 2)", "with --resume", "without training"):
            assert words in last, (words, last)
        assert sorted(os.listdir(disk)) == (["filler"] if real else []) and tree_hash(data) == before
        (disk / "filler").unlink(missing_ok=True)  # the advice, followed: no training, the output written
        monkeypatch.setattr(train_module, "optimizer_step", no_training)
        code, stdout, err = run_cli(capsys, "train", *args, "--resume")
        assert code == 0, err
        assert "no training" in stdout + err
        straight, finished = (mx.load(str(p)) for p in (tmp_path / "straight.safetensors", out))
        assert straight.keys() == finished.keys()
        assert all(np.array_equal(np.array(straight[k]), np.array(finished[k])) for k in straight)
        refused(capsys, tmp_path, args + ["--resume"], "already at step 2 of 2", "is written to")  # done: said so
    finally:
        if real:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # -l: a file still open


def no_training(*a, **k):
    raise AssertionError("a finished run trained again")


def test_a_full_disk_before_the_first_checkpoint_says_to_run_again(capsys, snap, tmp_path, monkeypatch):
    """train.json on a full disk said "continue with --resume", which finds no checkpoint and is refused:
    before the first checkpoint the line says to run the same command again, and that runs."""
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "out.safetensors", tmp_path / "work"
    args = base_args(snap, data, out) + ["--work-dir", work, "--steps", "1", "--dtype", "float32"]
    with monkeypatch.context() as m:
        m.setattr(train_state, "write_replacing", no_space)
        code, _, err = run_cli(capsys, "train", *args)
    assert_one_line_error(code, err, "train.json", "No space left on device", "run the same command again")
    assert "--resume" not in err and sorted(os.listdir(work)) == [workdir.WORK_MARKER]
    code, _, err = run_cli(capsys, "train", *args)  # the advice, followed
    assert code == 0, err
    assert out.is_file()


# --- issue 46: Ctrl-C at the checkpoint stage --------------------------------------------------------


class CtrlCInAFinalizer:
    """Sends Ctrl-C to this process from its finalizer: Python raises KeyboardInterrupt there and drops it
    ("Exception ignored in ..."), as it can on a loaded machine when the signal lands in a destructor."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100_000):  # the handler runs at the next bytecode check: in here
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one, as meant
@pytest.mark.parametrize("where", ["after the write", "in a finalizer"])
def test_ctrl_c_at_a_checkpoint_names_the_newest_one_on_disk(capsys, snap, tmp_path, monkeypatch, where):
    """A real SIGINT just as checkpoint-000002 is complete, before the run has said so, said "no checkpoint
    yet: run the same command again to start over"; one that landed in a finalizer was dropped and the
    run finished (exit 0). Both stop the run (130) with the line naming checkpoint-000002, which resumes."""
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "out.safetensors", tmp_path / "out.train"
    args = [*base_args(snap, data, out), "--steps", "4", "--save-every", "2", "--dtype", "float32"]
    real_write = train_module.write_checkpoint

    def write_then_ctrl_c(*a, **k):
        folder = real_write(*a, **k)
        if where == "after the write":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            CtrlCInAFinalizer()  # dropped at once: its finalizer runs here
        return folder

    with monkeypatch.context() as m:
        m.setattr(train_module, "write_checkpoint", write_then_ctrl_c)
        code, _, err = run_cli(capsys, "train", *args)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == (
        f"stopped at step 2; last checkpoint {work / 'checkpoint-000002'}: continue with the same command and --resume"
    )
    assert not out.exists() and not (work / "train.lock").exists()
    assert [p.name for p in sorted(work.glob("checkpoint-*"))] == ["checkpoint-000002"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command's handler is gone
    code, _, err = run_cli(capsys, "train", *args, "--resume")  # the advice, followed
    assert code == 0, err
    assert out.is_file()


def ctrl_c_then(run):
    """`run` that sends this process a real Ctrl-C first: the command's handler raises in here."""

    def interrupted_run(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return run(*a, **k)

    return interrupted_run


def ctrl_c_at_load(name):
    """`load_component` that is interrupted when it loads the component `name` (text_encoder, vae, transformer)."""
    real = train_module.load_component
    return lambda info, what, *a, **k: (ctrl_c_then(real) if what == name else real)(info, what, *a, **k)


STAGES = {  # stage -> (what to patch, its interrupted stand-in, the checkpoint the line names)
    "caption cache": (train_module, "load_component", lambda: ctrl_c_at_load("text_encoder"), None),
    "latent cache": (train_module, "load_component", lambda: ctrl_c_at_load("vae"), None),
    "model load": (train_module, "load_component", lambda: ctrl_c_at_load("transformer"), None),
    "first step": (train_module, "optimizer_step", lambda: ctrl_c_then(train_module.optimizer_step), None),
    "a sample": (
        samples_module.SampleImages,
        "sample",
        lambda: ctrl_c_then(samples_module.SampleImages.sample),
        "checkpoint-000002",
    ),
    "the output file": (
        train_module,
        "write_output",
        lambda: ctrl_c_then(train_module.write_output),
        "checkpoint-000004",
    ),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_ctrl_c_at_every_stage_stops_with_one_line_and_leaves_nothing_half_written(capsys, snap, tmp_path, stage):
    """Issue 46: a real SIGINT at each stage of a run (the caption and latent caches, the model load, a step, a
    sample, the output's write) stops it (130) with the line that names the newest checkpoint on disk, or says
    there is none; the lock is gone, no output and no temporary file is left, Python's Ctrl-C is back; the line's
    advice runs to the end."""
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "out.safetensors", tmp_path / "out.train"
    args = [*base_args(snap, data, out), "--steps", "4", "--save-every", "2", "--dtype", "float32"]
    if stage == "a sample":
        args += ["--sample-every", "2", "--sample-prompt", "x", "--sample-size", "64", "--sample-steps", "1"]
    owner, name, stand_in, named = STAGES[stage]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(owner, name, stand_in())
        code, _, err = run_cli(capsys, "train", *args)
    assert code == 130, err
    if named is None:
        line = "stopped at step 0; no checkpoint yet: run the same command again to start over"
    else:
        line = (
            f"stopped at step {named[-1]}; last checkpoint {work / named}: continue with the same command and --resume"
        )
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err
    assert not out.exists() and not (work / "train.lock").exists()
    assert not [p for p in tmp_path.rglob("*") if is_temporary_file(p.name) or ".tmp-" in p.name]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    code, _, err = run_cli(capsys, "train", *args, *(["--resume"] if named else []))  # the advice, followed
    assert code == 0, err
    assert out.is_file()
