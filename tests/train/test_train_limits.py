"""Issue 46, section 1, in `train`: every count it reads has the bound of limits.py's table, refused in one
line before any model loads, nothing written: a kohya repeat folder's N (it built a list of 10^9 draws an
epoch), N x --repeats, the steps --epochs makes, --sample-steps, and paths past the OS's limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from command_line import assert_one_line_error, run_cli, tree_hash
from PIL import Image

import flux_klein_mlx
import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx import limits
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.train.data.dataset import scan_data


@pytest.fixture
def no_models(monkeypatch):
    def recorder(info, name, *a, **k):
        raise AssertionError(f"the {name} was loaded before the bad input was refused")

    monkeypatch.setattr(train_module, "load_component", recorder)


def images(folder: Path, n: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(n)
    for i in range(n):
        Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(folder / f"im{i}.png")
        (folder / f"im{i}.txt").write_text("a test card")
    return folder


def refused(capsys, root: Path, args: list, *words: str) -> None:
    before = tree_hash(root)
    code, _, err = run_cli(capsys, "train", *args)
    assert_one_line_error(code, err, *words)
    assert tree_hash(root) == before


def train_args(base, data, out, *extra) -> list:
    return ["--model", base, "--data", data, "--output", out, "--resolution", "64", "--rank", "4", *extra]


@pytest.mark.parametrize(
    "folder, extra, words",
    [
        ("999999999_fox", [], ["999999999_fox repeats its images 999999999 times", "the limit is 10,000"]),
        ("9" * 250 + "_fox", [], ["repeats its images 999999999999... times"]),  # a name's longest
        ("10001_fox", [], ["10001_fox", "name it 10000_fox or fewer"]),
        ("101_fox", ["--repeats", "100"], ["101 times --repeats 100", "10,100 times an epoch"]),
    ],
)
def test_repeat_folders_past_the_bound_refused(capsys, base, tmp_path, no_models, folder, extra, words):
    data = tmp_path / "data"
    images(data / folder)
    refused(capsys, tmp_path, train_args(base, data, tmp_path / "o.safetensors", *extra), *words)


def test_scan_data_takes_the_bound_and_refuses_past_it(tmp_path):
    data = tmp_path / "data"
    images(data / "100_fox", n=1)
    (item,) = scan_data(data, repeats=limits.MAX_REPEATS // 100, resolution=64)
    assert item.repeats == limits.MAX_REPEATS
    with pytest.raises(FluxKleinError, match="10,100 times an epoch"):
        scan_data(data, repeats=limits.MAX_REPEATS // 100 + 1, resolution=64)


def test_epochs_that_make_too_many_steps_refused(capsys, base, tmp_path, no_models):
    """--epochs 1000 of 20,000 batches (2 images x --repeats 10,000) would be 2*10^7 steps."""
    data = images(tmp_path / "data")
    args = train_args(base, data, tmp_path / "o.safetensors", "--epochs", "1000", "--repeats", "10000")
    refused(capsys, tmp_path, args, "--epochs 1000 of 20000 batches is 20,000,000 steps", "give at most 500 epochs")


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("--sample-steps", "100000", ["sample-steps must be a whole number in [1, 1000]"]),
        ("--sample-steps", "1001", ["sample-steps", "1001"]),
        ("--epochs", "1000001", ["epochs must be a whole number in [1, 1000000]"]),
        ("--steps", "10000001", ["steps must be a whole number in [1, 10000000]"]),
    ],
)
def test_counts_past_the_table_refused(capsys, base, tmp_path, no_models, option, value, words):
    data = images(tmp_path / "data")
    refused(capsys, tmp_path, train_args(base, data, tmp_path / "o.safetensors", option, value), *words)


@pytest.mark.parametrize("option", ["--data", "--output", "--control", "--work-dir"])
def test_paths_past_the_os_limits_are_one_line(capsys, base, tmp_path, no_models, option):
    data = images(tmp_path / "data")
    args = train_args(base, data, tmp_path / "o.safetensors")
    long = tmp_path / ("a" * 300 + (".safetensors" if option == "--output" else ""))
    if option in ("--data", "--output"):
        args[args.index(option) + 1] = long
    else:
        args += [option, long]
    refused(capsys, tmp_path, args, "is too long for a path", "255 a name")


def test_python_api_meets_the_same_bounds(base, tmp_path, no_models):
    data = images(tmp_path / "data")
    out = tmp_path / "o.safetensors"
    for kw, words in (
        ({"sample_steps": 5000}, r"sample-steps must be a whole number in \[1, 1000\]"),
        ({"data": "x" * 2000}, "is too long for a path"),
        ({"controls": ["a\0b"]}, "NUL"),
    ):
        with pytest.raises(FluxKleinError, match=words):
            flux_klein_mlx.train_lora(model=base, **{"data": data, "output": out, "resolution": 64, **kw})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
