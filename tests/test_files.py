"""What a run writes, and where: nothing existing lost or replaced, nothing partial left (issues 12, 21, 30).

files.py's safe writes (a folder is built as a temporary and swapped in; a picture is created exclusively;
a signal removes the temporary) and its output-path checks (a path that cannot be written is refused in
one line before any model loads), and output.py's files (formats, records, batch names).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from command_line import assert_one_line_error, default_args, gen_args, tree_hash
from PIL import Image

from flux_klein_mlx import convert as convert_module
from flux_klein_mlx.record.output import read_record, save_image
from flux_klein_mlx.storage.files import TMP_MARKER

REPO = Path(__file__).resolve().parents[1]


# --- data loss ------------------------------------------------------------------------------------------


def test_overwrite_refuses_a_folder_convert_did_not_write(cli, snapshot, converted_snapshot, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (photos / "config.json").write_text('{"some": "other tool"}')
    before = tree_hash(photos)
    for cmd in (["convert", "-m", snapshot], ["quantize", "-m", converted_snapshot, "-b", "4"]):
        code, _, err = cli(*cmd, "-o", photos, "--overwrite")
        assert_one_line_error(code, err, str(photos))
        assert tree_hash(photos) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]  # no .tmp-* / .old-* left


def test_symlinked_output_replaces_its_target_and_leaves_no_stray(cli, snapshot, tmp_path):
    real = tmp_path / "real"
    code, _, err = cli("convert", "-m", snapshot, "-o", real, "--dtype", "float32")
    assert code == 0, err
    link = tmp_path / "link"
    link.symlink_to(real)
    code, _, err = cli("convert", "-m", snapshot, "-o", link, "--dtype", "bfloat16", "--overwrite")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert json.loads((real / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no *.old-* link, no .tmp-*


def test_sighup_is_handled_like_sigint():
    with pytest.raises(KeyboardInterrupt):
        with convert_module.interrupt_on_termination():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)  # the handler raises here
    assert signal.getsignal(signal.SIGHUP) is not None


@pytest.mark.parametrize("sig", ["SIGTERM"])
def test_termination_signal_removes_the_temporary_folder(snapshot, tmp_path, sig):
    out = tmp_path / "out"
    # A child converts with tensor writes slowed down; the signal arrives mid-write.
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from flux_klein_mlx.storage import weights
real = weights._tensor_bytes
def slow(a):
    time.sleep(0.05)
    return real(a)
weights._tensor_bytes = slow
from flux_klein_mlx.__main__ import main
sys.exit(main(["convert", "-m", {str(snapshot)!r}, "-o", {str(out)!r}, "--dtype", "float32"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 60
    while not list(tmp_path.glob("out.tmp-*/transformer*")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("out.tmp-*")), "the conversion never started writing"
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err  # as for Ctrl-C ("aborted")
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "aborted"
    assert list(tmp_path.iterdir()) == []


def test_a_later_run_removes_stale_temporaries_of_its_own_only(cli, snapshot, tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / "out.tmp-0123abcd"  # a run killed with SIGKILL: marker names a pid that is gone
    dead.mkdir()
    (dead / TMP_MARKER).write_text("999999999\n")
    (dead / "transformer.safetensors").write_bytes(b"half")
    empty = tmp_path / "out.tmp-00000000"
    empty.mkdir()
    alive = tmp_path / "out.tmp-11111111"  # a conversion still running (this process): kept
    alive.mkdir()
    (alive / TMP_MARKER).write_text(f"{os.getpid()}\n")
    foreign = tmp_path / "out.tmp-22222222"  # someone else's folder with that name: kept
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = cli("convert", "-m", snapshot, "-o", out, "--dtype", "float32")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp-11111111", "out.tmp-22222222"]
    assert (foreign / "notes.txt").read_text() == "mine"
    assert not (out / TMP_MARKER).exists()


def test_png_is_created_exclusively_never_replacing(tmp_path):
    img = Image.new("RGB", (8, 8), (10, 20, 30))
    target = tmp_path / "x.png"
    # A name taken between the free-name check and the write (another process) is not replaced.
    written = [save_image(img, target, {"seed": i}) for i in range(3)]
    assert written == [target, tmp_path / "x-1.png", tmp_path / "x-2.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-1.png", "x-2.png", "x.png"]  # no temporaries
    assert read_record(tmp_path / "x-2.png")["seed"] == 2


def test_volume_without_hard_links_copies_exclusively(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_link)  # some network / FAT volumes
    img = Image.new("RGB", (8, 8), (10, 20, 30))
    written = [save_image(img, tmp_path / "x.png", {"seed": i}) for i in range(2)]
    assert written == [tmp_path / "x.png", tmp_path / "x-1.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-1.png", "x.png"]  # no temporaries
    assert [read_record(p)["seed"] for p in written] == [0, 1]


# --- output paths refused before the work ---------------------------------------------------------------


def test_output_checked_before_any_model(cli, snapshot, tmp_path, no_models):
    afile = tmp_path / "afile"
    afile.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    cases = [
        (tmp_path / "missing" / "x.png", "does not exist"),
        (afile / "x.png", "is a file, not a folder"),
        (tmp_path / ("n" * 300 + ".png"), "file name is"),
        (tmp_path, "must end in .png"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((ro / "x.png", "cannot write"))
    for out, words in cases:
        code, _, err = cli(*gen_args(snapshot, out))
        assert_one_line_error(code, err, words)
    assert no_models == [] and list(ro.iterdir()) == [] and afile.read_text() == "x"
    code, _, err = cli("benchmark", "--random-weights", "--json", afile / "r.json")
    assert_one_line_error(code, err, "is a file, not a folder")


def test_output_folder_given_where_a_png_is_expected(cli, snapshot, tmp_path, no_models):
    folder = tmp_path / "shots.png"
    folder.mkdir()
    code, _, err = cli(*gen_args(snapshot, folder))
    assert_one_line_error(code, err, "is a folder")


def test_output_that_is_a_symlink_loop_refused_before_any_model(cli, snapshot, tmp_path, no_models):
    """A symbolic-link loop as --output: one line, before any model, nothing written."""
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    code, _, err = cli(*default_args(snapshot, loop))
    assert_one_line_error(code, err, "is a symbolic link that loops")
    assert no_models == [] and sorted(p.name for p in tmp_path.iterdir()) == ["loop.png"]


def half_written_then_disk_full(monkeypatch, folder: Path) -> None:
    """Saving a picture into `folder` writes part of it, then fails as a full disk does (ENOSPC)."""
    real = Image.Image.save

    def save(self, fp, *args, **kwargs):
        if isinstance(fp, (str, Path)) and Path(fp).parent == folder:
            Path(fp).write_bytes(b"\x89PNG\r\n\x1a\n partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)


def test_a_full_disk_for_previews_is_one_line_and_leaves_no_partial_file(cli, snapshot, tmp_path, monkeypatch):
    previews = tmp_path / "previews"
    previews.mkdir()
    half_written_then_disk_full(monkeypatch, previews)
    code, _, err = cli(*default_args(snapshot, tmp_path / "x.png", "--preview-dir", previews, "--steps", "1"))
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err and last.startswith("error: cannot write "), err
    assert last.endswith("x-step01.png (No space left on device); nothing was written")
    assert list(previews.iterdir()) == [] and not (tmp_path / "x.png").exists()


def test_convert_into_a_link_loop_benchmark_json_into_a_folder_and_a_full_disk(
    cli, snapshot, tmp_path, no_models, monkeypatch
):
    """`convert`/`quantize --output` into a symbolic-link loop (itself or the folder it is in), `benchmark --json`
    naming a folder (the suggestion is a JSON name, not an image's), and a full disk under `--output`,
    `--preview-dir` or `--json`: one line each, before any model, nothing written (issue 30)."""
    import shutil as shutil_module

    from flux_klein_mlx.storage import files as files_module

    loop, converted = tmp_path / "loop", tmp_path / "conv"
    loop.symlink_to(loop)
    reports, full = tmp_path / "reports", tmp_path / "full"
    reports.mkdir()
    full.mkdir()
    cases = [
        (["convert", "-m", snapshot, "-o", loop], f"--output {loop}: {loop} is a symbolic link that loops"),
        (["convert", "-m", snapshot, "-o", loop / "inner"], f"{loop} is a symbolic link that loops"),
        (["quantize", "-m", snapshot, "-b", "4", "-o", loop], f"{loop} is a symbolic link that loops"),
        (
            ["benchmark", "--model", snapshot, "--json", reports],
            f"--json {reports} is a folder; give a file name inside it, e.g. {reports / 'benchmark.json'}",
        ),
        (default_args(snapshot, full / "x.png"), f"the disk of {full} is full (0 bytes free)"),
        (default_args(snapshot, tmp_path / "x.png", "--preview-dir", full), f"the disk of {full} is full"),
        (["benchmark", "--model", snapshot, "--json", full / "b.json"], f"the disk of {full} is full"),
    ]
    real = shutil_module.disk_usage

    def usage(path):  # the volume of `full` has no byte left, as a full disk reports it
        got = real(path)
        return got._replace(free=0) if Path(path) == full else got

    monkeypatch.setattr(files_module.shutil, "disk_usage", usage)
    before = tree_hash(tmp_path)
    for args, words in cases:
        code, _, err = cli(*args)
        assert_one_line_error(code, err, words)
        assert "Traceback" not in err
    assert no_models == [] and tree_hash(tmp_path) == before and not converted.exists()


# --- what leaves the door (issue 21) --------------------------------------------------------------------


def test_jpeg_webp_progress_lines_summary_and_batch_names(cli, snapshot, tmp_path):
    """`-o many.jpg -n 2` in the default dtype, `many-0.jpg` taken: A1111's own reader (piexif's
    UserComment, what A1111 and Forge read from JPEG and WebP) gets the `parameters` text and our JSON
    record comes back from XMP (a WebP from `save_image` too); stderr that is not a terminal gets one
    line per step; the summary gives load time apart, the total and `image i/N`; the batch continues
    the numbering after the taken name (never `many-0-1.jpg`)."""
    pytest.importorskip("piexif")
    import piexif
    import piexif.helper

    from flux_klein_mlx.record.output import a1111_parameters

    taken = tmp_path / "many-0.jpg"
    taken.write_bytes(b"mine")
    code, out, err = cli(*default_args(snapshot, tmp_path / "many.jpg", "-n", "2"))
    assert code == 0, err
    assert out.split() == [str(tmp_path / "many-1.jpg"), str(tmp_path / "many-2.jpg")]
    assert taken.read_bytes() == b"mine"
    for i in (1, 2):
        assert f"image {i}/2: denoising step 1/2: " in err and f"image {i}/2: denoising step 2/2: " in err
    sums = re.findall(
        r"^image (\d)/2, seed (\d): load \d+\.\d s, encode \d+\.\d s \(peak .*\), denoise \d+\.\d s = "
        r"\d+\.\d\d s/step .* total \d+\.\d s$",
        err,
        re.M,
    )
    assert sums == [("1", "1"), ("2", "2")], err
    jpg = Path(out.split()[1])
    record = read_record(jpg)
    assert record["prompt"] == "a fox" and record["dtype"] == "bfloat16" and record["seed"] == 2
    with Image.open(jpg) as im:
        assert im.format == "JPEG" and im.size == (64, 64)
        webp = save_image(im.convert("RGB"), tmp_path / "fox.webp", record)
    for path, fmt in ((jpg, "JPEG"), (webp, "WEBP")):
        with Image.open(path) as im:
            assert im.format == fmt
            comment = piexif.load(im.info["exif"])["Exif"][piexif.ExifIFD.UserComment]
        assert piexif.helper.UserComment.load(comment) == a1111_parameters(record)
        assert read_record(path) == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fox.webp", "many-0.jpg", "many-1.jpg", "many-2.jpg"]


def test_the_writable_probe_counts_as_ours_while_another_process_checks_the_folder(tmp_path, monkeypatch):
    """mlx.launch's ranks check one --work-dir together: one rank's probe file, listed by the other between its
    creation and removal, once made `check_owned_folder` refuse the folder as holding a stranger's file. The
    probe now has one of our temporary names (`is_temporary_file`), and nothing of it stays."""
    from flux_klein_mlx.storage import files
    from flux_klein_mlx.train.workdir import WORK_MARKER, check_work_dir, is_work_file

    work = tmp_path / "work"
    work.mkdir()
    (work / WORK_MARKER).write_text("a work folder\n")
    seen = []
    real_open = os.open

    def open_and_check(path, flags, *args):  # the other rank lists the folder while the probe exists
        fd = real_open(path, flags, *args)
        if "probe" in str(path):
            seen.append(Path(path).name)
            files.check_owned_folder(work, WORK_MARKER, is_work_file, "--work-dir")  # raises if it is a stranger's
        return fd

    monkeypatch.setattr(files.os, "open", open_and_check)
    check_work_dir(work, data=tmp_path / "data")
    assert seen and files.is_temporary_file(seen[0]) and is_work_file(seen[0])
    assert sorted(p.name for p in work.iterdir()) == [WORK_MARKER]
