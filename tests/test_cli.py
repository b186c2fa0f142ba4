"""`python -m flux_klein_mlx generate` on a tiny model: PNG + metadata, reproducibility, the hub
cache path of a new user (offline), and one-line errors that leave no file behind; the doors each family
goes through alike (its repo id in the hub cache, Base's negative prompt, a missing text encoder, a size out
of range) once for both, and `train` on the distilled FLUX 3 refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from command_line import assert_one_line_error, hub_cache, tree_hash
from PIL import Image
from refs import flux2_reference_pixels, picture

import flux_klein_mlx
from flux_klein_mlx.inputs.settings import content_hash
from flux_klein_mlx.record.output import read_record

REPO = Path(__file__).resolve().parents[1]


def test_generate_writes_png_with_metadata_and_never_overwrites(snapshot, tmp_path, cli):
    out = tmp_path / "fox.png"
    args = [
        "--model",
        str(snapshot),
        "--prompt",
        "a red fox",
        "--seed",
        "42",
        "--width",
        "96",
        "--height",
        "64",
        "--dtype",
        "float32",
        "--output",
        str(out),
    ]
    code, stdout, stderr = cli("generate", *args)
    assert code == 0, stderr
    assert stdout.strip() == str(out) and out.is_file()
    assert "denoising" in stderr and "s/step" in stderr and "peak" in stderr
    with Image.open(out) as im:
        assert im.size == (96, 64)
        meta = json.loads(im.text["flux_klein_mlx"])
        a1111 = im.text["parameters"]
        first = np.asarray(im.convert("RGB"))
    assert meta["prompt"] == "a red fox" and meta["seed"] == 42 and meta["steps"] == 4
    assert meta["width"] == 96 and meta["height"] == 64 and meta["model"] == snapshot.name
    assert meta["guidance"] is None
    # A1111 / Forge text, which Civitai, InvokeAI and ComfyUI's importer parse; no chunk named "prompt".
    assert a1111.startswith("a red fox\nSteps: 4, Sampler: Euler, ") and "CFG scale: 1, Seed: 42, Size: 96x64" in a1111
    assert "prompt" not in im.text

    # Same seed again: the existing file is kept, a new name is chosen and printed, same pixels.
    code, stdout, stderr = cli("generate", *args)
    second_path = tmp_path / "fox-1.png"
    assert code == 0 and stdout.strip() == str(second_path) and "exists" in stderr
    with Image.open(second_path) as im:
        assert np.array_equal(np.asarray(im.convert("RGB")), first)
    with Image.open(out) as im:
        assert np.array_equal(np.asarray(im.convert("RGB")), first)


def test_generate_num_images_counts_seeds_up(snapshot, tmp_path, cli):
    out = tmp_path / "many.png"
    code, stdout, _ = cli(
        "generate",
        "--model",
        str(snapshot),
        "-p",
        "x",
        "--seed",
        "5",
        "-n",
        "2",
        "-W",
        "64",
        "-H",
        "64",
        "--dtype",
        "float32",
        "-o",
        str(out),
    )
    assert code == 0
    paths = stdout.split()
    assert paths == [str(tmp_path / "many-0.png"), str(tmp_path / "many-1.png")]
    seeds = [read_record(p)["seed"] for p in paths]
    assert seeds == [5, 6]


def test_editing_with_reference_image(snapshot, tmp_path, cli):
    ref = tmp_path / "ref.png"
    Image.fromarray((np.random.default_rng(0).random((72, 100, 3)) * 255).astype(np.uint8)).save(ref)
    out = tmp_path / "edit.png"
    code, _, stderr = cli(
        "generate",
        "--model",
        str(snapshot),
        "-p",
        "make it blue",
        "--image",
        str(ref),
        "--seed",
        "1",
        "--dtype",
        "float32",
        "-o",
        str(out),
    )
    assert code == 0, stderr
    with Image.open(out) as im:
        assert im.size == (96, 64)  # the reference's size, floored to multiples of 16 and centre-cropped
        # references are named by the content hash of their prepared pixels (the same from every door)
        assert json.loads(im.text["flux_klein_mlx"])["references"] == [content_hash(flux2_reference_pixels(ref))]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--width", "100"], "width 100 is not a multiple of 16; use e.g. 96 or 112"),
        (["--height", "8192"], "height 8192 is above the maximum of 4096 px"),
        (["--image", "/no/such.png"], "reference image not found: /no/such.png"),
        (["--model", "/no/such/folder"], "model '/no/such/folder' not found"),
        (["--model", "nobody/no-such-model"], "is not in the local Hugging Face cache"),
        (["--output", "/no/such/dir/x.png"], "output folder /no/such/dir does not exist"),
        (["--quantize", "4", "--output", "x.gif"], "--output must end in .png, .jpg, .jpeg, .webp, not 'x.gif'"),
    ],
)
def test_bad_input_one_line_error_and_no_file(snapshot, tmp_path, cli, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--model", str(snapshot), "-p", "x", "--dtype", "float32", "-o", str(tmp_path / "out.png"), *extra]
    code, stdout, stderr = cli("generate", *args)
    assert code != 0
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert list(tmp_path.glob("*.png")) == []


def test_small_or_extreme_reference_and_unsupported_model(snapshot, tmp_path, cli):
    small = tmp_path / "small.png"
    Image.new("RGB", (40, 80)).save(small)
    wide = tmp_path / "wide.png"
    Image.new("RGB", (640, 64)).save(wide)
    for path, message in ((small, "both sides must be at least 64 px"), (wide, "the limit is 8:1")):
        code, _, stderr = cli(
            "generate",
            "--model",
            str(snapshot),
            "-p",
            "x",
            "--image",
            str(path),
            "--dtype",
            "float32",
            "-o",
            str(tmp_path / "o.png"),
        )
        assert code == 1 and message in stderr and len(stderr.strip().splitlines()) == 1
    dev = tmp_path / "dev"
    shutil.copytree(snapshot, dev)
    index = json.loads((dev / "model_index.json").read_text())
    index["_class_name"] = "Flux2Pipeline"
    (dev / "model_index.json").write_text(json.dumps(index))
    code, _, stderr = cli("generate", "--model", str(dev), "-p", "x", "-o", str(tmp_path / "o.png"))
    assert code == 1 and "holds a Flux2Pipeline model" in stderr
    assert list(tmp_path.glob("o*.png")) == []


def test_non_finite_weights_stop_with_message_and_no_file(snapshot, tmp_path, cli):
    import mlx.core as mx

    bad = tmp_path / "bad"
    shutil.copytree(snapshot, bad)
    f = bad / "transformer" / "diffusion_pytorch_model.safetensors"
    w = mx.load(str(f))
    w["proj_out.weight"] = mx.full(w["proj_out.weight"].shape, float("inf"))
    mx.save_safetensors(str(f), w)
    code, _, stderr = cli(
        "generate",
        "--model",
        str(bad),
        "-p",
        "x",
        "-W",
        "64",
        "-H",
        "64",
        "--dtype",
        "float32",
        "-o",
        str(tmp_path / "nan.png"),
    )
    assert code == 1 and "non-finite values appeared at denoising step 1" in stderr
    assert not (tmp_path / "nan.png").exists()


def test_first_run_of_a_new_user_from_the_hub_cache_offline(snapshot, tmp_path):
    """`--model owner/name` resolves through huggingface_hub's cache with HF_HUB_OFFLINE=1, in a real process."""
    cache = tmp_path / "hub"
    hub_cache(snapshot, cache, "black-forest-labs/FLUX.2-klein-4B")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out = tmp_path / "first.png"
    # The default --model is the klein-4B repo id: exactly what a new user types.
    cmd = [
        sys.executable,
        "-m",
        "flux_klein_mlx",
        "generate",
        "--prompt",
        "a lighthouse",
        "--seed",
        "3",
        "--width",
        "64",
        "--height",
        "64",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.is_file() and read_record(out)["model"] == "black-forest-labs/FLUX.2-klein-4B"

    # An id that is not in the cache: one line, exit 1, no traceback.
    proc = subprocess.run(
        cmd[:-1] + [str(tmp_path / "second.png"), "--model", "someone/missing-model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith(
        "error: model 'someone/missing-model' is not in the local Hugging Face "
        f"cache ({cache}) and HF_HUB_OFFLINE is set"
    )
    assert not (tmp_path / "second.png").exists()


def test_generate_from_the_hub_cache_in_the_default_dtype(family, family_distilled, tmp_path, cli, monkeypatch):
    """Each family's released repo id, laid out in huggingface_hub's cache, runs offline in this process in
    bfloat16; the record names the id and the model. Two references from files: the first one's size."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    hub_cache(family_distilled, cache, family.repo_id)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "fox.png"
    args = ["generate", "--model", family.repo_id, "--prompt", "a fox", "--seed", "1", "--steps", "2", "--no-cache"]
    code, _, err = cli(*args, "--width", "64", "--height", "64", "--output", out)
    assert code == 0, err
    record = read_record(out)
    assert record["model"] == family.repo_id and record["variant"] == family.title and record["dtype"] == "bfloat16"
    assert record["steps"] == 2 and Image.open(out).size == (64, 64)
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    picture(80, 64, seed=1).save(a)
    picture(64, 96, seed=2).save(b)
    edit = tmp_path / "edit.png"
    code, _, err = cli(*args, "--image", a, "--image", b, "--output", edit)
    assert code == 0, err
    assert Image.open(edit).size == (80, 64) and len(read_record(edit)["references"]) == 2


def test_base_takes_a_negative_prompt_and_the_distilled_model_says_it_ignores_one(
    family, family_base, family_distilled, tmp_path, cli
):
    out = tmp_path / "base.png"
    code, _, err = cli(
        "generate", "--model", family_base, "--prompt", "a fox", "--negative-prompt", "snow", "--steps", "2",
        "--width", "64", "--height", "64", "--dtype", "float32", "--seed", "4", "--output", out, "--no-cache",
    )  # fmt: skip
    assert code == 0, err
    assert read_record(out)["negative_prompt"] == "snow" and read_record(out)["guidance"] == family.defaults[1][1]
    with pytest.warns(UserWarning, match="negative_prompt is ignored"):
        flux_klein_mlx.load(family_distilled, dtype="float32", cache=False).prepare(
            "a fox", negative_prompt="snow", steps=1, width=64, height=64, seed=1
        )


def test_a_folder_missing_its_text_encoder_is_one_line(family_distilled, tmp_path, cli):
    broken = tmp_path / "broken"
    shutil.copytree(family_distilled, broken)
    shutil.rmtree(broken / "text_encoder")
    before = tree_hash(broken)
    code, _, err = cli("generate", "--model", broken, "--prompt", "p", "--output", tmp_path / "x.png")
    assert_one_line_error(code, err, "text_encoder")
    assert tree_hash(broken) == before and not (tmp_path / "x.png").exists()


def test_a_size_out_of_range_is_one_line(family_distilled, tmp_path, cli):
    args = ("--prompt", "p", "--width", "40", "--output", tmp_path / "x.png")
    code, _, err = cli("generate", "--model", family_distilled, *args)
    assert_one_line_error(code, err, "width 40")


def test_training_the_distilled_flux3_is_refused_in_one_line_and_base_trains(distilled3, base3, tmp_path, cli):
    """Issue 37 lifted the refusal of FLUX 3 Base (tests/train/test_objective.py and
    tests/lora/test_lora_files.py judge its training); the distilled flow map stays refused, naming the Base."""
    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        picture(64, 64, seed=k).save(data / f"{k}.png")
        (data / f"{k}.txt").write_text("a fox")
    out = tmp_path / "fox.safetensors"
    args = ("--data", data, "--output", out, "--steps", "1", "--resolution", "64", "--rank", "4")
    code, _, err = cli("train", "--model", distilled3, *args)
    assert_one_line_error(code, err, "is the distilled FLUX 3 Image Klein")
    assert "flux-3-image-klein-base" in err and not out.exists() and not (tmp_path / "fox.train").exists()
    code, _, err = cli("train", "--model", base3, *args)
    assert code == 0 and out.is_file(), err


def offline_hub(monkeypatch, cache: Path, endpoint: str = "http://127.0.0.1:9") -> None:
    """huggingface_hub online, its hub at `endpoint` (port 9 on this machine: connection refused at once)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def test_an_unreachable_hub_says_so_with_the_size_the_cache_and_the_way_out(tmp_path, cli, monkeypatch):
    """A new user's first run with no network: not "neither a folder nor a repo id" (a typo's message),
    but that the hub cannot be reached, how big the download is, where it goes and `--model DIR`."""
    offline_hub(monkeypatch, tmp_path / "hub")
    code, _, stderr = cli("generate", "--prompt", "a fox", "-o", str(tmp_path / "x.png"))  # the default model
    assert code == 1 and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith(
        "error: cannot reach the Hugging Face hub (ConnectError) to download "
        f"'black-forest-labs/FLUX.2-klein-4B' (about 16 GB, into {tmp_path / 'hub'})"
    )
    assert "--model DIR" in stderr and not (tmp_path / "x.png").exists()


def test_a_large_download_is_announced_before_it_starts(snapshot, tmp_path, capsys, monkeypatch, cli):
    """One line, before the download: its size (the files the pipeline reads, nothing cached yet), the
    cache folder, the way out. The hub's answers are stood in for (no network here)."""
    from types import SimpleNamespace

    import huggingface_hub

    offline_hub(monkeypatch, tmp_path / "hub")
    sizes = {
        "transformer/diffusion_pytorch_model.safetensors": 7_750_000_000,
        "vae/config.json": 800,
        "text_encoder/model-00001-of-00002.safetensors": 8_000_000_000,
        "README.md": 9_000,
        "flux-2-klein-4b.safetensors": 7_750_000_000,
    }  # the BFL single file is not downloaded
    info = SimpleNamespace(sha="0" * 40, siblings=[SimpleNamespace(rfilename=k, size=v) for k, v in sizes.items()])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, files_metadata=False: info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: str(snapshot))
    foreign = tmp_path / "out"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, stderr = cli("convert", "-m", "black-forest-labs/FLUX.2-klein-4B", "-o", str(foreign))
    lines = stderr.strip().splitlines()
    assert lines[0] == (
        f"downloading black-forest-labs/FLUX.2-klein-4B: 15.8 GB into {tmp_path / 'hub'} (once; "
        "Ctrl-C stops it, and --model DIR uses a copy you already have)"
    ), stderr
    assert code == 1 and len(lines) == 2 and lines[1].startswith("error: ")  # the folder is not ours: refused


def test_version(cli):
    code, out, err = cli("--version")
    assert code == 0 and re.fullmatch(r"flux_klein_mlx \d+\.\d+\.\d+\n", out)


def _commands():
    """Every command (and sub-command) the CLI runs, by its full name: `lora convert`, ..."""
    import importlib

    import click

    from flux_klein_mlx.__main__ import COMMANDS

    found = {}
    for name, (module, attr) in COMMANDS.items():
        command = getattr(importlib.import_module(module), attr)
        subs = command.commands if isinstance(command, click.Group) else {"": command}
        found.update({f"{name} {sub}".strip(): c for sub, c in subs.items()})
    return found


def test_the_shared_options_are_declared_once_for_every_command():
    """Issue 45: --model, --quantize, --dtype and --lora come from cli's option groups in every command, with
    one type and one refusal: --quantize is an int checked by `cli.as_bits` (4 or 8, one line), --dtype one of
    the dtypes' names, --lora says what it takes in the same words."""
    from flux_klein_mlx.cli import LORA_SOURCES, as_bits
    from flux_klein_mlx.dtypes import DTYPES

    seen = set()
    for name, command in _commands().items():
        for p in command.params:
            if "--quantize" in p.opts:
                assert p.opts == ["--quantize", "-q"] and p.type.name == "integer" and p.callback is as_bits, name
            elif "--dtype" in p.opts:
                assert list(p.type.choices) == list(DTYPES), name
            elif "--lora" in p.opts:
                assert p.multiple and LORA_SOURCES in p.help, name
            elif "--model" in p.opts:
                assert p.opts == ["--model", "-m"], name
            else:
                continue
            seen.add((name, p.opts[0]))
    for name in ("generate", "serve", "convert", "train", "benchmark"):
        assert {(name, "--quantize"), (name, "--dtype"), (name, "--model")} <= seen, name
    assert {("generate", "--lora"), ("serve", "--lora"), ("convert", "--lora")} <= seen


@pytest.mark.parametrize("command", ["generate", "convert", "serve", "train", "benchmark"])
def test_a_quantize_of_three_bits_is_one_line_before_anything_runs(cli, tmp_path, command):
    """The same refusal, in one line, from every command that takes --quantize (it was click's usage error in
    four of them and convert's own line in the fifth)."""
    args = {"convert": ["-m", str(tmp_path / "none"), "-o", str(tmp_path / "out")]}.get(command, [])
    code, _, err = cli(command, *args, "--quantize", "3")
    assert_one_line_error(code, err, "cannot quantize to 3 bits; choose 4 or 8")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["benchmark", "--trials", "0"], ["'--trials': 0 is not in the range 1<=x<=1000", "benchmark --help"]),
        (["benchmark", "--seed", str(10**23)], ["'--seed'", "0<=x<=4294967295"]),  # was a traceback in mx.random.key
        (["serve", "--port", "99999999"], ["'--port'", "1<=x<=65535", "serve --help"]),
        (["generate", "--stpes", "3"], ["No such option '--stpes'", "--steps", "generate --help"]),
        (["lora", "convert"], ["Missing argument 'SOURCE'", "lora convert --help"]),
        (["nope"], ["No such command 'nope'", "flux_klein_mlx --help"]),
    ],
)
def test_clicks_own_refusals_are_one_line_too(cli, args, words):
    """Issue 46: an option out of its range, a misspelt option or command, a missing argument: click printed its
    usage (three lines, exit 2); now one line that says what and where the options are, exit 1 (and bench's
    --seed has a bound: 10^23 was a TypeError traceback)."""
    code, _, err = cli(*args)
    assert_one_line_error(code, err, *words)
