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

import mlx.core as mx
import numpy as np
import pytest
from command_line import run_cli
from families import KITS
from PIL import Image

import flux_klein_mlx
import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.__main__ import main
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.run.loading import describe
from flux_klein_mlx.train import state as train_state
from flux_klein_mlx.train import workdir
from flux_klein_mlx.train.data.dataset import bucket_size, scan_data
from flux_klein_mlx.train.plan import data_key, plan_run, run_key
from flux_klein_mlx.train.settings import RUN_KEY_VERSION, TrainSettings
from flux_klein_mlx.train.step.adapters import adapter_file_shapes, parse_targets
from flux_klein_mlx.train.trainer import CheckpointSaved, TrainFinished


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
    rc, _, err = run_cli(capsys, "train", *args)
    err = err.strip()
    assert rc == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, (w, err)
    assert tree_hash(root) == before
    return err


def base_args(snap, data, out) -> list[str]:
    return ["--model", str(snap), "--data", str(data), "--output", str(out), "--resolution", "64", "--rank", "4"]


@pytest.mark.parametrize(
    "layout, words",
    [
        ("missing", ["does not exist"]),
        ("file", ["is a file"]),
        ("empty", ["holds no images"]),
        ("corrupt", ["im1.png"]),
        ("uncaptioned", ["no caption", "im0.png", "--caption"]),
        ("control-missing", ["--control", "im1"]),
        ("tiny-image", ["im0.png", "at least 64 px"]),
    ],
)
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


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("--rank", "0", ["rank", "[1, 1024]"]),
        ("--rank", "5000", ["rank"]),
        ("--steps", "0", ["steps"]),
        ("--lr", "0", ["lr"]),
        ("--lr", "-1e-4", ["lr"]),
        ("--lr", "nan", ["lr"]),
        ("--lr", "2", ["lr"]),
        ("--alpha", "0", ["alpha"]),
        ("--batch-size", "0", ["batch-size"]),
        ("--grad-accum", "0", ["grad-accum"]),
        ("--resolution", "32", ["resolution"]),
        ("--weight-decay", "-1", ["weight-decay"]),
        ("--max-grad-norm", "0", ["max-grad-norm"]),
        ("--save-every", "0", ["save-every"]),
        ("--keep-checkpoints", "0", ["keep-checkpoints"]),
        ("--seed", "-1", ["seed"]),
        ("--sample-every", "5", ["--sample-prompt"]),
        ("--caption", " ", ["--caption"]),
    ],
)
def test_out_of_range_settings_refused(capsys, snap, tmp_path, no_models, option, value, words):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + [option, value], *words)


def test_targets_the_model_has_not_refused_in_one_line(capsys, family, family_base, tmp_path, no_models):
    """`--targets` naming what the family's Base model has not (FLUX.2: more double blocks than it has, a module
    of no name; FLUX 3: FLUX.2's `double`, the distilled model's `ref_time_in`, the reference blocks without
    --control): one line each before any model loads, nothing written."""
    data = make_images(tmp_path / "data")
    for value, words in family.training.cli_bad_targets:
        args = base_args(family_base, data, tmp_path / "out.safetensors") + ["--targets", value]
        refused(capsys, tmp_path, args, *words)


def test_the_distilled_flow_map_and_a_flux2_checkpoint_refused_on_flux3_in_one_line(
    capsys, base, base3, distilled3, tmp_path
):
    """FLUX 3's distilled model (a flow map) cannot be trained: one line naming the Base repo, from the command
    and from `train_lora`; a real FLUX.2 run's checkpoint resumed on FLUX 3 Base names both families."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "x.safetensors"
    args = base_args(distilled3, data, out) + ["--steps", "1"]
    refused(capsys, tmp_path, args, "distilled FLUX 3 Image Klein", "flux-3-image-klein-base")
    with pytest.raises(FluxKleinError, match="distilled FLUX 3"):
        flux_klein_mlx.train_lora(model=distilled3, data=data, output=tmp_path / "y.safetensors")
    work = tmp_path / "w"
    flux2 = base_args(base, data, tmp_path / "f2.safetensors") + ["--steps", "1", "--work-dir", str(work)]
    assert main(["train", *flux2]) == 0
    capsys.readouterr()
    args = base_args(base3, data, out) + ["--steps", "1", "--work-dir", str(work), "--resume"]
    refused(capsys, tmp_path, args, "is a checkpoint of FLUX.2 [klein]'s adapters", "model is FLUX 3 Image Klein's")


def test_existing_output_is_never_overwritten(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "mine.safetensors"
    out.write_bytes(b"precious")
    refused(capsys, tmp_path, base_args(snap, data, out), "exists", "never overwritten")
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize(
    "name, words", [("lora.ckpt", [".safetensors"]), ("nowhere/lora.safetensors", ["does not exist"])]
)
def test_output_name_and_folder_checked(capsys, snap, tmp_path, no_models, name, words):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / name), *words)


def fake_checkpoint(work: Path, settings: TrainSettings, step: int = 2) -> Path:
    """A whole checkpoint of `settings`' run (zero adapters and moments, a real RNG state), written by
    the trainer's own writer: all that --resume checks before any model loads."""
    s = settings.check()
    info = describe(s.model)
    items = scan_data(s.data, caption=s.caption, controls=s.controls, resolution=s.resolution)
    shapes = adapter_file_shapes(parse_targets(s.targets, info.params), info.params, adapter="lora", rank=s.rank)
    lora = {k: mx.zeros(shape) for k, shape in shapes.items()}
    optimizer = {"step": mx.array(step), "learning_rate": mx.array(s.lr)}
    for i, shape in enumerate(shapes.values()):
        optimizer[f"p{i}.m"], optimizer[f"p{i}.v"] = mx.zeros(shape), mx.zeros(shape)
    state = {
        "step": step,
        "epoch": 1,
        "batches": [[i] for i in range(len(items))],
        "position": 1,
        "rng": np.random.default_rng(0).bit_generator.state,
        "losses": [0.5] * step,
        "run_key": run_key(s, info),
        "data": data_key(items),
    }
    work.parent.mkdir(parents=True, exist_ok=True)
    workdir.claim_work_dir(work)  # as a run does before its first checkpoint
    return train_state.write_checkpoint(
        work, step, lora=(lora, {"format": "pt"}), optimizer=optimizer, state=state, keep=100
    )


def test_resume_refuses_another_runs_checkpoints_naming_the_differences(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    fake_checkpoint(
        tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=8)
    )
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume"], "other settings", "rank: 8 there, 4 now")
    (data / "im0.txt").write_text("another caption")
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume", "--rank", "8"], "data")


def test_resume_of_another_familys_checkpoint_names_both_families(
    capsys, family, family_base, tmp_path, tmp_path_factory, no_models
):
    """Issue 46: a FLUX.2 run's work folder resumed with a FLUX 3 model was "from a run with other settings";
    the line names the checkpoint's family and the model's, by their titles (either way round)."""
    other = next(kit for kit in KITS.values() if kit is not family)
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    theirs = other.snapshot(tmp_path_factory, distilled=False)  # the session's own, built once
    capsys.readouterr()  # building it talks
    fake_checkpoint(
        tmp_path / "out.train", TrainSettings(model=str(theirs), data=data, output=out, resolution=64, rank=4)
    )
    line = refused(
        capsys,
        tmp_path,
        base_args(family_base, data, out) + ["--resume"],
        f"is a checkpoint of {other.training.title}'s adapters",
        f"this run's model is {family.training.title}'s",
    )
    assert "other settings" not in line


def test_resume_refuses_a_checkpoint_of_another_run_key_version(capsys, snap, tmp_path, no_models):
    """The run key is versioned (0.1.0 keeps no compatibility branches): a checkpoint whose run key has
    another version, or none (written before the key had one), is refused in one line before any model
    loads, even where every setting matches."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    settings = TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=4)
    folder = fake_checkpoint(tmp_path / "out.train", settings)
    state = json.loads((folder / "state.json").read_text())
    assert state["run_key"]["version"] == RUN_KEY_VERSION and state["run_key"]["processes"] == 1
    for version in (None, RUN_KEY_VERSION + 1):
        if version is None:
            del state["run_key"]["version"]
        else:
            state["run_key"]["version"] = version
        (folder / "state.json").write_text(json.dumps(state))
        refused(
            capsys,
            tmp_path,
            base_args(snap, data, out) + ["--resume"],
            f"run key version {version}",
            f"writes {RUN_KEY_VERSION}",
            "start anew",
        )


def test_work_folder_with_checkpoints_needs_resume_and_resume_needs_checkpoints(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume"], "no checkpoint")
    fake_checkpoint(
        tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=4)
    )
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
    refused(
        capsys, tmp_path, base_args(kv, data, tmp_path / "o.safetensors"), "cannot be trained", "FLUX.2-klein-base-9B"
    )
    distilled = linked_snapshot(snap, tmp_path / "distilled", is_distilled=True)
    with pytest.warns(UserWarning, match="not recommended.*black-forest-labs/FLUX.2-klein-base-4B"):
        plan_run(TrainSettings(model=distilled, data=data, output=tmp_path / "o.safetensors", resolution=64))


def test_train_and_load_refuse_a_single_file_in_the_same_words(snap, tmp_path, no_models):
    """The model refusals have one home (loading.check_for_loading): `train` says what `load()` says."""
    from tiny_model import write_bfl_transformer

    bfl = write_bfl_transformer(linked_snapshot(snap, tmp_path / "snap"))
    data = make_images(tmp_path / "data")
    with pytest.raises(FluxKleinError) as trained:
        plan_run(TrainSettings(model=bfl, data=data, output=tmp_path / "o.safetensors", resolution=64))
    with pytest.raises(FluxKleinError) as loaded:
        flux_klein_mlx.load(bfl)
    assert str(trained.value) == str(loaded.value)
    assert "is a single file, not a model folder" in str(trained.value) and "convert --model" in str(trained.value)


def test_check_changes_nothing_and_returns_the_resolved_copy(tmp_path):
    """TrainSettings.check, like RunSettings.check, only checks: derived values go into a copy."""
    s = TrainSettings(data="d", output="~/o.safetensors", rank=8, lr=1, controls="c", sample_prompts="a fox")
    before = repr(s)
    c = s.check()
    assert repr(s) == before and c is not s
    assert (c.alpha, c.lr, c.controls, c.sample_prompts) == (8.0, 1.0, ("c",), ("a fox",))
    assert c.output == Path("~/o.safetensors").expanduser() and c.work_dir == c.output.with_name("o.train")
    with pytest.raises(FluxKleinError, match=r"batch-size must be a whole number in \[1, 1024\], not 0"):
        TrainSettings(data="d", output="o.safetensors", batch_size=0).check()


def test_python_api_refuses_alike_before_anything_runs(snap, tmp_path, no_models):
    data = make_images(tmp_path / "data", captions=False)
    out = tmp_path / "o.safetensors"
    for kw, words in (
        ({"rank": 4.5}, "rank"),
        ({"rank": True}, "rank"),
        ({"steps": "10"}, "steps"),
        ({"timesteps": "cosmap"}, "timesteps"),
        ({"quantize": 3}, "4 or 8"),
        ({"wieght_decay": 0.1}, "unknown"),
        ({}, "no caption"),
    ):
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
        kw = dict(
            model=snap,
            data=data,
            output=out,
            work_dir=work,
            steps=3,
            save_every=1,
            rank=4,
            resolution=64,
            dtype="float32",
            keep_checkpoints=3,
        )
        message = r"cannot write checkpoint checkpoint-000002 .*checkpoint-000001 \(step 1\).*--resume"
        with pytest.raises(FluxKleinError, match=message):
            for ev in flux_klein_mlx.train_lora(**kw):
                if isinstance(ev, CheckpointSaved) and ev.step == 1:
                    fill(work) if real else full.append(True)
        assert sorted(
            p.name for p in work.iterdir() if p.name not in ("filler", "tensorboard")
        ) == [  # tensorboard/: tensorboardX's
            workdir.WORK_MARKER,
            "checkpoint-000001",
            "loss.png",
            "metrics.jsonl",  # issue 39: the metrics log (written before the disk filled)
            "train.json",
        ]
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


# --- issue 30: the work folder, the lock, damaged checkpoints, what is not read --------------------


@pytest.mark.parametrize("where", ["data", "inside-data", "control", "output-in-data"])
def test_work_folder_in_the_dataset_refused(capsys, snap, tmp_path, no_models, where):
    data = make_images(tmp_path / "data")
    control = make_images(tmp_path / "control", captions=False)
    out, extra = tmp_path / "out.safetensors", ["--control", str(control)]
    if where == "data":
        extra += ["--work-dir", str(data)]
    elif where == "inside-data":
        extra += ["--work-dir", str(data / "run")]
    elif where == "control":
        extra += ["--work-dir", str(control)]
    else:
        out = data / "out.safetensors"  # the default work folder data/out.train
    option = "--control" if where == "control" else "--data"
    refused(capsys, tmp_path, base_args(snap, data, out) + extra, f"inside the {option} folder", "--work-dir")


def test_unusable_work_folder_refused(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--work-dir", str(loop)], "symbolic link that loops")
    (tmp_path / "afile").write_text("x")
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--work-dir", str(tmp_path / "afile")], "is a file")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: a read-only volume instead
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], capture_output=True)
        if r.returncode != 0:
            pytest.skip("no read-only volume to test with")
    else:
        read_only.chmod(0o555)
    try:
        refused(
            capsys,
            tmp_path,
            base_args(snap, data, out) + ["--work-dir", str(read_only / "run")],
            "cannot write in",
            "choose a folder you can write to",
        )
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(read_only)], capture_output=True)
        read_only.chmod(0o755)


def test_a_lock_that_is_a_link_is_refused_and_its_target_never_written(capsys, snap, tmp_path, no_models):
    """Issue 38, case 1: a train.lock that links elsewhere is refused, never opened for writing or removed."""
    data = make_images(tmp_path / "data")
    out, work = tmp_path / "out.safetensors", tmp_path / "out.train"
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    workdir.claim_work_dir(work)  # a folder an earlier run wrote
    (work / "train.lock").symlink_to(victim)
    refused(capsys, tmp_path, base_args(snap, data, out), "train.lock is a symbolic link", "remove it")
    with pytest.raises(FluxKleinError, match="is a symbolic link; nothing is ever written through a link"):
        workdir.acquire_lock(work)  # the lock itself never follows the link either (O_NOFOLLOW)
    assert victim.read_text() == "the user's own file" and (work / "train.lock").is_symlink()
    (work / "train.lock").unlink()  # the advice, followed: the run goes ahead
    plan_run(TrainSettings(model=snap, data=data, output=out, rank=4, resolution=64))
    workdir.acquire_lock(work).release()
    assert victim.read_text() == "the user's own file"


def test_a_work_folder_of_other_files_is_refused_naming_them(capsys, snap, tmp_path, no_models):
    """Issue 38, case 2: an existing folder's own train.json and loss.png are never written over."""
    data = make_images(tmp_path / "data")
    out, theirs = tmp_path / "out.safetensors", tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train.json").write_text('{"their": "record"}')
    (theirs / "loss.png").write_bytes(b"their plot")
    args = base_args(snap, data, out) + ["--work-dir", str(theirs)]
    refused(
        capsys,
        tmp_path,
        args,
        f"--work-dir {theirs} holds files this program did not write (loss.png, train.json)",
        "new or empty folder",
    )
    ours = tmp_path / "ours"  # a folder of ours holding a file of the user's: named too
    workdir.claim_work_dir(ours)
    (ours / "notes.txt").write_text("mine")
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--work-dir", str(ours)], "did not write (notes.txt)")
    empty = tmp_path / "empty"  # the advice, followed
    empty.mkdir()
    plan_run(TrainSettings(model=snap, data=data, output=out, rank=4, resolution=64, work_dir=empty))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_two_runs_never_share_a_work_folder_and_a_stale_lock_is_taken_over(capsys, snap, tmp_path):
    import socket

    from flux_klein_mlx.errors import Notice

    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    kw = dict(model=snap, data=data, output=out, rank=4, resolution=64, steps=1)
    first = flux_klein_mlx.train_lora(**kw)
    assert type(next(first)).__name__ == "MemoryPlanned"  # the first run holds out.train now
    lock = json.loads((tmp_path / "out.train" / "train.lock").read_text())
    assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname() and lock["started"]
    refused(capsys, tmp_path, base_args(snap, data, out), "in use by another training run", f"pid {os.getpid()}")
    with pytest.raises(FluxKleinError, match="in use by another training run"):
        flux_klein_mlx.train_lora(**kw, work_dir=tmp_path / "out.train" / ".." / "out.train")
    first.close()  # the run ends: the folder is free, no lock stays
    assert not (tmp_path / "out.train" / "train.lock").exists()
    # another process holds the folder; killed (SIGKILL), it leaves its lock file behind, and the kernel drops its flock
    code = (
        "import sys; from pathlib import Path; from flux_klein_mlx.train.workdir import acquire_lock; "
        "acquire_lock(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(flux_klein_mlx.__file__).parents[1])}
    with subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "out.train")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as holder:
        try:
            assert holder.stdout.readline().strip() == "held"
            refused(capsys, tmp_path, base_args(snap, data, out), "in use by another training run", f"pid {holder.pid}")
        finally:
            holder.kill()
            holder.wait()
    assert json.loads((tmp_path / "out.train" / "train.lock").read_text())["pid"] == holder.pid
    plan_run(TrainSettings(**kw))  # the check before the run leaves the stale lock as it is
    with pytest.warns(Notice, match=f"taking over the lock of an earlier run.*pid {holder.pid}"):
        held = workdir.acquire_lock(tmp_path / "out.train")
    assert json.loads((tmp_path / "out.train" / "train.lock").read_text())["pid"] == os.getpid()
    held.release()
    assert not (tmp_path / "out.train" / "train.lock").exists()
    # where the volume has no locks, the pid decides: a pid that no longer runs on this host is stale
    stale = {"pid": dead_pid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00"}
    assert workdir.holder_gone(stale) and not workdir.holder_gone({**stale, "pid": os.getpid()})
    assert not workdir.holder_gone({**stale, "host": "another-mac.local"})  # cannot be checked from here


def damage(folder: Path, kind: str, other: Path) -> None:
    """Damage checkpoint `folder` one way; `other` is a checkpoint of another run (rank 8)."""
    state = json.loads((folder / "state.json").read_text())
    if kind == "truncated-lora":
        data = (folder / "lora.safetensors").read_bytes()
        (folder / "lora.safetensors").write_bytes(data[: len(data) - 100])
    elif kind == "missing-optimizer":
        (folder / "optimizer.safetensors").unlink()
    elif kind == "missing-state":
        (folder / "state.json").unlink()
    elif kind == "state-types":
        (folder / "state.json").write_text(json.dumps({**state, "position": "1"}))
    elif kind == "state-values":
        (folder / "state.json").write_text(json.dumps({**state, "losses": [0.5]}))
    elif kind == "state-not-json":
        (folder / "state.json").write_text('{"step": 4, ')
    elif kind == "another-runs-lora":
        shutil.copy(other / "lora.safetensors", folder / "lora.safetensors")
    elif kind == "another-runs-optimizer":
        shutil.copy(other / "optimizer.safetensors", folder / "optimizer.safetensors")


@pytest.mark.parametrize(
    "kind, why",
    [
        ("truncated-lora", "lora.safetensors is cut short"),
        ("missing-optimizer", "optimizer.safetensors is missing"),
        ("missing-state", "state.json is missing"),
        ("state-types", "position is '1'"),
        ("state-values", "losses is not a list of 4 numbers"),
        ("state-not-json", "state.json cannot be read"),
        ("another-runs-lora", "another run's file"),
        ("another-runs-optimizer", "this run's adapters need"),
    ],
)
def test_damaged_checkpoint_named_before_any_model_loads(capsys, snap, tmp_path, no_models, kind, why):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    settings = dict(model=str(snap), data=data, output=out, resolution=64, rank=4)
    fake_checkpoint(tmp_path / "out.train", TrainSettings(**settings), step=2)
    latest = fake_checkpoint(tmp_path / "out.train", TrainSettings(**settings), step=4)
    other = fake_checkpoint(tmp_path / "other", TrainSettings(**{**settings, "rank": 8}), step=4)
    damage(latest, kind, other)
    err = refused(
        capsys,
        tmp_path,
        base_args(snap, data, out) + ["--resume"],
        "checkpoint-000004",
        "is damaged",
        why,
        "delete that folder to continue from checkpoint-000002 with --resume",
    )
    assert "download" not in err
    shutil.rmtree(tmp_path / "out.train" / "checkpoint-000002")  # no earlier one: start anew
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume"], "is damaged", "start anew without --resume")


def test_resume_of_a_finished_run_says_so_and_writes_nothing(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    fake_checkpoint(
        tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=4)
    )
    out.write_bytes(b"the finished run's LoRA")  # (without its output, --resume writes it: issue 38, case 4)
    refused(
        capsys,
        tmp_path,
        base_args(snap, data, out) + ["--resume", "--steps", "2"],
        "already at step 2 of 2",
        "raise --steps",
    )


def test_model_file_refused_with_what_train_needs(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    transformer = next((snap / "transformer").glob("*.safetensors"))
    lora = tmp_path / "a_lora.safetensors"
    mx.save_safetensors(str(lora), {"transformer.x.lora_A.weight": mx.zeros((4, 8))})
    for file in (transformer, lora):
        args = base_args(snap, data, tmp_path / "out.safetensors")
        args[1] = str(file)
        refused(capsys, tmp_path, args, "single file", "klein Base model folder or repo id")


def test_control_folder_that_is_the_data_folder_refused(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    args = base_args(snap, data, tmp_path / "out.safetensors")
    refused(
        capsys,
        tmp_path,
        args + ["--control", str(tmp_path / "data" / ".." / "data")],
        "--control",
        "is the --data folder",
    )


def test_captions_bom_extension_and_what_is_not_read(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data", n=3)
    (data / "im0.txt").write_bytes("\ufeffa card with a BOM".encode("utf-8"))
    plan = plan_run(TrainSettings(model=snap, data=data, output=tmp_path / "o.safetensors", resolution=64))
    assert plan.items[0].caption == "a card with a BOM"
    # kohya's .caption files: not read by default (said), read with --caption-extension .caption
    for i in range(3):
        (data / f"im{i}.caption").write_text(f"caption {i}")
    make_images(data / "more", n=1)
    with pytest.warns(UserWarning) as said:
        plan_run(TrainSettings(model=snap, data=data, output=tmp_path / "o.safetensors", resolution=64))
    text = " | ".join(str(w.message) for w in said)
    assert "sub-folder(s) more are not read" in text and "3 .caption caption file(s) are not read" in text
    assert "--caption-extension .caption" in text
    with pytest.warns(UserWarning) as said:
        plan = plan_run(
            TrainSettings(
                model=snap, data=data, output=tmp_path / "o.safetensors", resolution=64, caption_extension=".caption"
            )
        )
    assert "3 .txt caption file(s) are not read" in " | ".join(str(w.message) for w in said)
    assert [it.caption for it in plan.items] == ["caption 0", "caption 1", "caption 2"]
    for i in range(3):
        (data / f"im{i}.txt").unlink()
    refused(
        capsys,
        tmp_path,
        base_args(snap, data, tmp_path / "o.safetensors"),
        "no caption",
        "<name>.txt",
        "the .caption files there are read with --caption-extension .caption",
    )
    for bad in ("txt", ".", ".png", "a/b"):
        refused(
            capsys,
            tmp_path,
            base_args(snap, data, tmp_path / "o.safetensors") + ["--caption-extension", bad],
            "--caption-extension",
        )


def test_repeat_folders_not_read_are_said_and_a_link_loop_ends(snap, tmp_path):
    """Issue 46: a kohya repeat folder that is a symbolic link, and one nested in another (2_x/3_y/), were
    left out without a word; links that loop (to the data folder itself) must not hang the scan."""
    data = make_images(tmp_path / "data", n=1)
    make_images(data / "2_x", n=1)
    make_images(data / "2_x" / "3_y", n=1)
    (data / "5_link").symlink_to(data / "2_x", target_is_directory=True)
    (data / "4_self").symlink_to(data, target_is_directory=True)  # a loop
    (data / "2_x" / "up").symlink_to(data, target_is_directory=True)  # another, one level down
    with pytest.warns(UserWarning) as said:
        plan = plan_run(TrainSettings(model=snap, data=data, output=tmp_path / "o.safetensors", resolution=64))
    text = " | ".join(str(w.message) for w in said)
    assert "the repeat folder(s) 4_self, 5_link are symbolic links, which are not followed" in text
    assert "the images in 2_x/3_y, 2_x/up are not read: a repeat folder's own sub-folders are not" in text
    assert sorted(it.stem for it in plan.items) == ["2_x/im0", "im0"]


def test_learning_rate_that_underflows_in_the_adapters_is_warned():
    """The warning's bound is the real one: below it, one AdamW step (gradients of 1: the largest
    step, lr) leaves most adapter values of a fresh LoRA as they were; at 1e-4 it moves them all."""
    import mlx.nn as nn

    from flux_klein_mlx.train.settings import lr_underflow
    from flux_klein_mlx.train.step.optimizers import make_optimizer

    rank = 16
    a0 = (np.random.default_rng(0).standard_normal((rank, 4096)) / rank).astype(np.float32)  # PEFT's init of A
    bound = float(lr_underflow(1e-30, rank).split("at least ")[1].split(")")[0])
    for lr, warned in ((bound / 2, True), (1e-4, False)):
        assert (lr_underflow(lr, rank) is not None) == warned

        class Params(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = mx.array(a0)

        model = Params()
        make_optimizer(TrainSettings(lr=lr)).update(model, {"a": mx.ones(a0.shape)})
        unchanged = float(np.mean(np.array(model.a) == a0))
        assert unchanged >= 0.5 if warned else unchanged == 0.0, (lr, unchanged)
    with pytest.warns(UserWarning, match="too small to change the float32 adapters"):
        TrainSettings(data="d", output="o.safetensors", lr=1e-12).check()


def test_python_api_wrong_types_name_the_argument_and_leave_nothing(snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    out = tmp_path / "o.safetensors"
    before = sorted(tmp_path.rglob("*"))
    for kw, words in (
        ({"data": 123}, "data must be a path"),
        ({"output": 5}, "output must be a path"),
        ({"targets": 3}, "targets must be"),
        ({"model": 3.5}, "model must be a path"),
        ({"controls": 7}, "controls must be"),
        ({"work_dir": 1}, "work_dir must be a path"),
        ({"validation": 123}, "validation must be a path"),
        ({"resume": "yes"}, "resume must be True or False"),
        ({"caption_extension": 1}, "caption_extension"),
    ):
        args = {"model": snap, "data": data, "output": out, "resolution": 64, **kw}
        with pytest.raises(FluxKleinError, match=words):
            flux_klein_mlx.train_lora(**args)
    assert sorted(tmp_path.rglob("*")) == before
    plan = plan_run(
        TrainSettings(
            model=snap,
            data=data,
            output=out,
            resolution=np.int64(64),
            rank=np.int32(4),
            steps=np.uint16(3),
            lr=np.float32(1e-4),
            quantize=np.int8(8),
        )
    )
    assert type(plan.settings.rank) is int and type(plan.settings.steps) is int and type(plan.settings.lr) is float
    assert type(plan.settings.quantize) is int
    json.dumps(plan.settings.record())  # train.json can hold them


# --- issue 30: the run talks ---------------------------------------------------------------------


def test_the_run_talks_ctrl_c_says_how_to_continue_and_one_loss_average_spans_the_resume(
    capsys, snap, tmp_path, monkeypatch
):
    """The command at its default dtype (bfloat16): what it is about to do before each heavy stage,
    Ctrl-C at step 3 names checkpoint-000002, and --resume reads the captions from the prompt cache
    (no text encoder) and prints the same loss average as loss.png draws, across both runs (a window
    of 3 steps here: a 4-step run would otherwise average 1)."""
    import re

    from flux_klein_mlx.train.report.evaluation import average_window, moving_average

    data = make_images(tmp_path / "data")
    out, work = tmp_path / "ink.safetensors", tmp_path / "ink.train"
    args = ["train", *base_args(snap, data, out), "--steps", "4", "--save-every", "2"]
    real_step = train_module.Trainer.train_step

    def stop_at_3(self):
        if self.step_no == 3:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(train_module.Trainer, "train_step", stop_at_3)
    monkeypatch.setattr(train_module, "average_window", lambda steps: 3)
    assert main(args) == 130
    first = capsys.readouterr().err.splitlines()
    assert first[-1] == (
        f"stopped at step 3; last checkpoint {work / 'checkpoint-000002'}: continue with the same command and --resume"
    )
    talk = [line for line in first if not line.startswith("step ")]
    assert talk.pop(0).startswith("memory plan: a step peaks at about ")  # before any model loads
    assert talk[0] == "encoding 1 caption with the text encoder ..." and talk[1].startswith("captions: ")
    assert talk[2] == "encoding 2 images with the VAE ..." and talk[4] == "loading the transformer ..."
    lora = flux_klein_mlx.load(snap, loras=[work / "checkpoint-000002" / "lora.safetensors"]).loras[0]
    counted = f"{len(lora.terms)} adapters on {len({t.layer for t in lora.terms})} layers"  # as generate counts
    assert counted in talk[6] and "trainable parameters" in talk[6], talk[6]
    assert not (work / "train.lock").exists() and not out.exists()
    monkeypatch.setattr(train_module.Trainer, "train_step", real_step)
    loaded, real_load = [], train_module.load_component
    monkeypatch.setattr(
        train_module,
        "load_component",
        lambda info, name, *a, **k: loaded.append(name) or real_load(info, name, *a, **k),
    )
    assert main(args + ["--resume"]) == 0
    second = capsys.readouterr().err.splitlines()
    assert "1 caption: all in the prompt cache, the text encoder is not loaded" in second
    assert "2 images: all in the latent cache, the VAE is not loaded" in second  # issue 39: the latent cache
    assert "text_encoder" not in loaded and loaded == ["transformer"]
    losses = json.loads((work / "checkpoint-000004" / "state.json").read_text())["losses"]
    plotted = moving_average(losses, 3)
    printed = [re.match(r"step (\d+)/4  loss (\S+) \(avg (\S+)\)", line) for line in first + second]
    printed = [(int(m[1]), float(m[2]), float(m[3])) for m in printed if m]
    assert [p[0] for p in printed] == [1, 2, 3, 3, 4]
    for step, loss, avg in printed:
        assert loss == pytest.approx(losses[step - 1], abs=5e-5) and avg == pytest.approx(plotted[step - 1], abs=5e-5)
    assert average_window(40) == 2 and Image.open(work / "loss.png").size == (900, 440)


def test_loss_plot_has_round_ticks_and_shows_a_varying_lr():
    from flux_klein_mlx.train.report.evaluation import loss_plot, nice_ticks

    assert nice_ticks(0.3123, 1.05, 5) == pytest.approx([0.4, 0.6, 0.8, 1.0])
    assert nice_ticks(1, 500, 8, whole=True) == [100, 200, 300, 400, 500]
    assert nice_ticks(1, 3, 8, whole=True) == [1, 2, 3]  # whole steps, never 1.5
    losses = list(np.linspace(1.0, 0.4, 120))
    orange = lambda img: int(np.all(np.asarray(img) == (230, 120, 20), axis=-1).sum())  # noqa: E731
    assert orange(loss_plot(losses, window=6, lrs=[1e-4] * 120)) == 0
    assert orange(loss_plot(losses, window=6, lrs=[1e-4 * (1 - i / 120) for i in range(120)])) > 100
    image = np.asarray(loss_plot(losses, window=6, lrs=[1e-4] * 120).convert("L"))
    assert (image[44:392, :70] < 128).sum() > 50  # loss tick labels left of the axis
    assert (image[398:420, 78:816] < 128).sum() > 50  # step tick labels under it


# --- issue 29: schedules, several resolutions, config files, the memory plan --------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--lr-scheduler", "cosmap"], ["lr-scheduler", "constant, constant_with_warmup, linear, cosine", "'cosmap'"]),
        (["--lr-scheduler", "cosine", "--warmup-steps", "-1"], ["warmup-steps", ">= 0"]),
        (
            ["--lr-scheduler", "cosine", "--warmup-steps", "11", "--steps", "10"],
            ["--warmup-steps 11", "past --steps 10"],
        ),
        (["--warmup-steps", "5"], ["no effect", "constant_with_warmup"]),
        (["--resolution", "512,500"], ["resolution", "multiple of 16", "500"]),
        (["--resolution", "512,x"], ["resolution", "'x'"]),
        (["--resolution", "64,64"], ["resolution", "each size once"]),
        (["--resolution", "32,64"], ["resolution", "[64, 4096]"]),
    ],
)
def test_bad_schedule_and_resolution_list_refused(capsys, snap, tmp_path, no_models, args, words):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + args, *words)


@pytest.mark.parametrize(
    "name, text, words",
    [
        (
            "run.toml",
            "rank = 4\nlr_schedule = 'cosine'\nwarmup = 3\n",
            ["unknown key(s) lr_schedule, warmup", "underscores"],
        ),
        ("run.toml", "rank = 4\nlr = [\n", ["not valid TOML"]),
        ("run.toml", "[rank]\nvalue = 4\n", ["rank is a table"]),
        ("run.toml", None, ["is not a file"]),
        ("run.yaml", "rank: 4\n", [".toml file", ".yaml"]),
        ("train.json", '{"steps": 3}', ['no "settings"']),
        ("train.json", '{"settings": {"rank": 4, "warmup": 1}}', ["unknown setting(s) warmup"]),
        ("train.json", "{not json", ["not valid JSON"]),
        ("run.toml", "lr_scheduler = 'cosine'\nwarmup_steps = 9999\n", ["--warmup-steps 9999", "past --steps 500"]),
        # a UTF-8 byte-order mark (Notepad's) before the keys: read, so the setting's own check speaks
        ("bom.toml", "\ufefflr_scheduler = 'cosine'\nwarmup_steps = 9999\n", ["--warmup-steps 9999"]),
    ],
)
def test_bad_config_refused(capsys, snap, tmp_path, no_models, name, text, words):
    data = make_images(tmp_path / "data")
    config = tmp_path / name
    if text is not None:
        config.write_text(text)
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + ["--config", str(config)], *words)


def recorded_run(snap, data: Path, tmp_path: Path) -> Path:
    """A train.json as a finished run writes it (the settings and data record of Trainer.record)."""
    plan = plan_run(
        TrainSettings(model=str(snap), data=data, output=tmp_path / "old.safetensors", resolution=64, rank=4)
    )
    record = {"settings": plan.settings.record(), "data": [it.record() for it in plan.items]}
    path = tmp_path / "old.train" / "train.json"
    path.parent.mkdir()
    path.write_text(json.dumps(record))
    (tmp_path / "old.safetensors").write_bytes(b"the LoRA of that run")
    return path


def test_config_from_train_json_names_a_changed_or_added_image(capsys, snap, tmp_path, no_models):
    data = make_images(tmp_path / "data")
    record = recorded_run(snap, data, tmp_path)
    args = ["--config", str(record), "--output", str(tmp_path / "new.safetensors")]
    refused(capsys, tmp_path, ["--config", str(record)], "old.safetensors exists and is never overwritten")
    Image.new("RGB", (64, 64), "red").save(data / "im1.png")
    refused(capsys, tmp_path, args, "im1.png changed since", "sha256")
    make_images(tmp_path / "data", n=3)  # im0, im1 as recorded; im2 added
    refused(capsys, tmp_path, args, "im2.png", "did not train on")
    (data / "im2.png").unlink()
    (data / "im0.png").unlink()
    refused(capsys, tmp_path, args, "im0.png is gone")


def test_a_step_that_will_not_fit_is_refused_naming_the_remedies_unless_forced(
    capsys, snap, tmp_path, no_models, monkeypatch
):
    from flux_klein_mlx.train import memory

    data = make_images(tmp_path / "data")
    monkeypatch.setattr(memory, "machine_memory", lambda: (1000, "a test machine"))
    refused(
        capsys,
        tmp_path,
        base_args(snap, data, tmp_path / "out.safetensors"),
        "memory plan: a step peaks at about",
        "of 0.0 GB (a test machine)",
        "will not fit",
        "--force",
    )
    plan = plan_run(
        TrainSettings(model=str(snap), data=data, output=tmp_path / "o.safetensors", resolution=64, force=True)
    )
    assert not plan.memory.fits and plan.memory.peak > 1000


# --- issue 29: --ema, --validation, the process count of a checkpoint ----------------------------


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.5", "nan"])
def test_ema_outside_zero_one_refused(capsys, snap, tmp_path, no_models, value):
    data = make_images(tmp_path / "data")
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + ["--ema", value], "ema", "(0, 1)")


@pytest.mark.parametrize(
    "layout, words",
    [
        ("empty", ["--validation", "holds no images"]),
        ("missing", ["--validation", "does not exist"]),
        ("uncaptioned", ["no caption", "im0.png"]),
        ("control", ["--validation with 1 --control folder(s) needs as many --validation-control", "not 0"]),
        ("control-short", ["--validation-control", "has no image for 1 image(s) of --validation (im1)"]),
        ("control-alone", ["--validation-control needs --validation"]),
    ],
)
def test_bad_validation_folder_refused(capsys, snap, tmp_path, no_models, layout, words):
    data = make_images(tmp_path / "data")
    held_out, extra = tmp_path / "held_out", []
    if layout == "empty":
        held_out.mkdir()
        (held_out / "notes.txt").write_text("no images here")
    elif layout == "uncaptioned":
        make_images(held_out, n=1, captions=False)
    elif layout.startswith("control"):
        make_images(held_out, n=2)
        extra = ["--control", str(make_images(tmp_path / "control", captions=False))]
    if layout in ("control-short", "control-alone"):  # references for one of the two held-out images
        extra += ["--validation-control", str(make_images(tmp_path / "held_control", n=1, captions=False))]
    validation = [] if layout == "control-alone" else ["--validation", str(held_out)]
    refused(capsys, tmp_path, base_args(snap, data, tmp_path / "out.safetensors") + validation + extra, *words)


def test_resume_with_another_process_count_refused(capsys, snap, tmp_path, no_models):
    """A checkpoint written by 2 processes (mlx.launch -n 2) continues only with 2: here 1 asks."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "out.safetensors"
    folder = fake_checkpoint(
        tmp_path / "out.train", TrainSettings(model=str(snap), data=data, output=out, resolution=64, rank=4)
    )
    state = json.loads((folder / "state.json").read_text())
    state["run_key"]["processes"] = 2
    (folder / "state.json").write_text(json.dumps(state))
    refused(
        capsys,
        tmp_path,
        base_args(snap, data, out) + ["--resume"],
        "trained by 2 process(es)",
        "this run has 1",
        "mlx.launch",
    )
    refused(capsys, tmp_path, base_args(snap, data, out) + ["--resume", "--ema", "0.9"], "trained by 2")


def test_ctrl_c_between_a_checkpoints_rename_and_its_line_names_it(capsys, snap, tmp_path, monkeypatch):
    """Issue 46: Ctrl-C while a checkpoint is being written (after its folder is complete, before the run
    reports it) said "no checkpoint yet: run the same command again to start over" with checkpoint-000002 on
    disk; the line names the newest complete checkpoint in the work folder."""
    import flux_klein_mlx.train.trainer as trainer_module

    data = make_images(tmp_path / "data")
    out, work = tmp_path / "ink.safetensors", tmp_path / "ink.train"
    real = trainer_module.write_checkpoint

    def written_then_interrupted(*args, **kwargs):
        real(*args, **kwargs)  # the folder is in place, whole
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "write_checkpoint", written_then_interrupted)
    assert main(["train", *base_args(snap, data, out), "--steps", "4", "--save-every", "2"]) == 130
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        f"stopped at step 2; last checkpoint {work / 'checkpoint-000002'}: continue with the same command and --resume"
    )
    assert not out.exists()
