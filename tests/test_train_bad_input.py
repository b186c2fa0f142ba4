"""`train` refuses bad input with one line, before any model loads, changing nothing (issue 20).

Each case runs the command (or the Python API) with `train.load_component` replaced by a recorder that
fails the test if a model is loaded, and hashes the folder before and after: no file is created,
none is changed. The full disk is a real one where the test may mount a small tmpfs (Linux, root),
else the checkpoint writer is made to fail with ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import flux_klein_mlx
import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.train import state as train_state
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.loading import describe
from flux_klein_mlx.train.trainer import CheckpointSaved, TrainFinished, data_key, plan_run, run_key
from flux_klein_mlx.train.data import bucket_size, scan_data
from flux_klein_mlx.train.settings import TrainSettings


@pytest.fixture(scope="module")
def snap(base):
    return base  # the session's tiny Base snapshot (conftest.py)


def make_images(folder: Path, n: int = 2, captions: bool = True, suffix: str = ".png") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(n)
    for i in range(n):
        Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(folder / f"im{i}{suffix}")
        if captions:
            (folder / f"im{i}.txt").write_text("a test card")
    return folder


@pytest.fixture
def no_models(monkeypatch):
    def recorder(info, name, *a, **k):
        raise AssertionError(f"the {name} was loaded before the bad input was refused")

    monkeypatch.setattr(train_module, "load_component", recorder)


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def refused(capsys, root: Path, args: list[str], *words: str) -> str:
    """Run `train args`; assert exit 1, one `error:` line holding `words`, and nothing changed under root."""
    before = tree_hash(root)
    rc = main(["train", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, (w, err)
    assert tree_hash(root) == before
    return err


def base_args(snap, data, out) -> list[str]:
    return ["--model", str(snap), "--data", str(data), "--output", str(out), "--resolution", "64", "--rank", "4"]


@pytest.mark.parametrize("layout, words", [
    ("missing", ["does not exist"]),
    ("file", ["is a file"]),
    ("empty", ["holds no images"]),
    ("corrupt", ["im1.png"]),
    ("uncaptioned", ["no caption", "im0.png", "--caption"]),
    ("control-missing", ["--control", "im1"]),
    ("tiny-image", ["im0.png", "at least 64 px"]),
])  # fmt: skip
def test_bad_data_refused_naming_the_file(capsys, snap, tmp_path, no_models, layout, words):
    data = tmp_path / "data"
    extra = []
    if layout == "file":
        data.write_text("not a folder")
    elif layout == "empty":
        data.mkdir()
        (data / "notes.txt").write_text("no images here")
    elif layout != "missing":
        make_images(data, captions=layout != "uncaptioned")
    if layout == "corrupt":
        (data / "im1.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
    if layout == "control-missing":
        control = make_images(tmp_path / "control", n=1, captions=False)
        extra = ["--control", str(control)]
    if layout == "tiny-image":
        Image.new("RGB", (40, 64)).save(data / "im0.png")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + extra, *words)


@pytest.mark.parametrize("option, value, words", [
    ("--rank", "0", ["rank", "[1, 1024]"]), ("--rank", "5000", ["rank"]), ("--steps", "0", ["steps"]),
    ("--lr", "0", ["lr"]), ("--lr", "-1e-4", ["lr"]), ("--lr", "nan", ["lr"]), ("--lr", "2", ["lr"]),
    ("--alpha", "0", ["alpha"]), ("--batch-size", "0", ["batch-size"]), ("--grad-accum", "0", ["grad-accum"]),
    ("--resolution", "32", ["resolution"]), ("--weight-decay", "-1", ["weight-decay"]),
    ("--max-grad-norm", "0", ["max-grad-norm"]), ("--save-every", "0", ["save-every"]),
    ("--keep-checkpoints", "0", ["keep-checkpoints"]), ("--seed", "-1", ["seed"]),
    ("--sample-every", "5", ["--sample-prompt"]), ("--targets", "double:0-9", ["--targets", "2 double blocks"]),
    ("--targets", "to_nowhere", ["--targets to_nowhere", "matches no layer"]), ("--caption", " ", ["--caption"]),
])  # fmt: skip
def test_out_of_range_settings_refused(capsys, snap, tmp_path, no_models, option, value, words):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + [option, value], *words)


def test_existing_output_is_never_overwritten(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "mine.safetensors"
    out.write_bytes(b"precious")
    refused(capsys, tmp_path, base_args(snap, data, out), "exists", "never overwritten")
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("name, words", [("lora.ckpt", [".safetensors"]), ("nowhere/lora.safetensors", ["does not exist"])])
def test_output_name_and_folder_checked(capsys, snap, tmp_path, no_models, name, words):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / name), *words)


def fake_checkpoint(work: Path, settings: TrainSettings, step: int = 2) -> Path:
    """A checkpoint folder whose state.json says what run it belongs to (all that --resume reads first)."""
    folder = work / f"checkpoint-{step:06d}"
    folder.mkdir(parents=True)
    items = scan_data(settings.data, settings.caption, settings.controls, settings.resolution)
    state = {"step": step, "run_key": run_key(settings.check(), describe(settings.model)), "data": data_key(items)}
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def test_resume_refuses_another_runs_checkpoints_naming_the_differences(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    fake_checkpoint(tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=8))
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume"], "other settings", "rank: 8 there, 4 now")
    (data / "im0.txt").write_text("another caption")
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume", "--rank", "8"], "data")


def test_work_folder_with_checkpoints_needs_resume_and_resume_needs_checkpoints(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume"], "no checkpoint")
    fake_checkpoint(tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=4))
    refused(capsys, tmp_path, base_args(snap, data, out), "--resume", "step 2")
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume", "--steps", "1"], "past --steps 1")


def linked_snapshot(snap: Path, dst: Path, **index) -> Path:
    """The snapshot's folders linked under `dst` with a changed model_index.json."""
    dst.mkdir()
    for p in snap.iterdir():
        if p.name != "model_index.json":
            (dst / p.name).symlink_to(p)
    (dst / "model_index.json").write_text(json.dumps({**json.loads((snap / "model_index.json").read_text()), **index}))
    return dst


def test_kv_model_refused_and_distilled_model_warned(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    kv = linked_snapshot(snap, tmp_path / "kv", _class_name="Flux2KleinKVPipeline")
    refused(capsys, tmp_path, base_args(kv, data, tmp_path / "o.safetensors"), "cannot be trained", "FLUX.2-klein-base-9B")
    distilled = linked_snapshot(snap, tmp_path / "distilled", is_distilled=True)
    with pytest.warns(UserWarning, match="not recommended.*black-forest-labs/FLUX.2-klein-base-4B"):
        plan_run(TrainSettings(model=distilled, data=data, output=tmp_path / "o.safetensors", resolution=64))


def test_python_api_refuses_alike_before_anything_runs(snap, tmp_path, no_models):
    data = make_images(tmp_path / "data", captions=False)
    out = tmp_path / "o.safetensors"
    for kw, words in (({"rank": 4.5}, "rank"), ({"rank": True}, "rank"), ({"steps": "10"}, "steps"),
                      ({"timesteps": "cosmap"}, "timesteps"), ({"quantize": 3}, "4 or 8"), ({"wieght_decay": 0.1}, "unknown"),
                      ({}, "no caption")):  # fmt: skip
        with pytest.raises(FluxKleinError, match=words):
            flux_klein_mlx.train_lora(model=snap, data=data, output=out, resolution=64, **kw)
    plan = plan_run(TrainSettings(model=snap, data=data, output=out, caption="a trigger word", resolution=64))
    assert [it.caption_from for it in plan.items] == ["--caption", "--caption"]
    assert list(tmp_path.iterdir()) == [data]


def test_bucket_rule():
    assert bucket_size(1024, 1024, 512) == (512, 512)
    assert bucket_size(1536, 1024, 512) == (624, 416)  # 3:2 at ~512^2 area, sides multiples of 16
    assert bucket_size(1000, 3000, 1024) == (592, 1776)
    W, H = bucket_size(4000, 3000, 768)
    assert W % 16 == 0 and H % 16 == 0 and abs(W * H / 768**2 - 1) < 0.05 and abs(W / H - 4 / 3) < 0.03


# --- a disk that fills ---------------------------------------------------------------------------


def small_disk(path: Path, size: str = "8m") -> bool:
    """Mount a tmpfs of `size` at `path` (Linux, as root); False where that is not possible."""
    path.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def fill(path: Path) -> None:
    """Write into `path` until the file system is full."""
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_disk_that_fills_keeps_the_last_good_checkpoint_and_resume_continues(snap, tmp_path, monkeypatch):
    data = make_images(tmp_path / "data")
    work, out = tmp_path / "work", tmp_path / "out.safetensors"
    real = small_disk(work)
    full = []
    if not real:  # the writer itself reports ENOSPC once the disk "fills"
        original = train_state.save_safetensors_streaming

        def writer(path, *a, **k):
            if full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return original(path, *a, **k)

        monkeypatch.setattr(train_state, "save_safetensors_streaming", writer)
    try:
        kw = dict(model=snap, data=data, output=out, work_dir=work, steps=3, save_every=1, rank=4, resolution=64,
                  dtype="float32", keep_checkpoints=3)  # fmt: skip
        message = r"cannot write checkpoint checkpoint-000002 .*checkpoint-000001 \(step 1\).*--resume"
        with pytest.raises(FluxKleinError, match=message):
            for ev in flux_klein_mlx.train_lora(**kw):
                if isinstance(ev, CheckpointSaved) and ev.step == 1:
                    fill(work) if real else full.append(True)
        assert sorted(p.name for p in work.iterdir() if p.name != "filler") == ["checkpoint-000001", "loss.png", "train.json"]
        assert json.loads((work / "checkpoint-000001" / "state.json").read_text())["step"] == 1
        assert not out.exists()
        (work / "filler").unlink(missing_ok=True)
        full.clear()
        events = list(flux_klein_mlx.train_lora(**kw, resume=True))
        assert isinstance(events[-1], TrainFinished) and out.is_file()
        assert [p.name for p in sorted(work.glob("checkpoint-*"))] == [f"checkpoint-00000{i}" for i in (1, 2, 3)]
    finally:
        if real:
            subprocess.run(["umount", str(work)], capture_output=True)


# --- issue 29: --ema, --validation, the process count of a checkpoint ----------------------------


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.5", "nan"])
def test_ema_outside_zero_one_refused(capsys, snap, tmp_path, no_models, value):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + ["--ema", value], "ema", "(0, 1)")


@pytest.mark.parametrize("layout, words", [
    ("empty", ["--validation", "holds no images"]), ("missing", ["--validation", "does not exist"]),
    ("uncaptioned", ["no caption", "im0.png"]), ("control", ["--validation", "--control"]),
])  # fmt: skip
def test_bad_validation_folder_refused(capsys, snap, tmp_path, no_models, layout, words):
    data = make_images(tmp_path / "data")
    held_out, extra = tmp_path / "held_out", []
    if layout == "empty":
        held_out.mkdir()
        (held_out / "notes.txt").write_text("no images here")
    elif layout == "uncaptioned":
        make_images(held_out, n=1, captions=False)
    elif layout == "control":
        make_images(held_out, n=1)
        extra = ["--control", str(make_images(tmp_path / "control", captions=False))]
    args = base_args(snap, data, tmp_path / "out.safetensors") + ["--validation", str(held_out)] + extra
    refused(capsys, tmp_path, args, *words)


def test_resume_with_another_process_count_refused(capsys, snap, tmp_path, no_models):
    """A checkpoint written by 2 processes (mlx.launch -n 2) continues only with 2: here 1 asks."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    folder = fake_checkpoint(tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=4))
    state = json.loads((folder / "state.json").read_text())
    state["run_key"]["processes"] = 2
    (folder / "state.json").write_text(json.dumps(state))
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume"], "trained by 2 process(es)", "this run has 1", "mlx.launch")
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume", "--ema", "0.9"], "trained by 2")
