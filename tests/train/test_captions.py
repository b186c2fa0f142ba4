"""Issue 39: what `train` says is true, and captions train as written.

- the caption counts of the log agree with what is encoded (texts, from the prompt cache or not);
- loss.png never claims an "average over 1 step"; a run of several processes says how many train;
- the low-learning-rate warning never names a bound below an --lr it warns about;
- `--trigger` is not prepended to a caption that holds it as a word; `[trigger]` without `--trigger` is
  refused in one line before any model loads, nothing written; the log shows one caption as it trains.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from command_line import run_cli
from test_settings import base_args, make_images, no_models, refused  # noqa: F401

from flux_klein_mlx.train.command import describe_event
from flux_klein_mlx.train.data.dataset import scan_data, with_trigger
from flux_klein_mlx.train.report.evaluation import average_window, loss_plot, plot_title
from flux_klein_mlx.train.report.events import TrainStarted
from flux_klein_mlx.train.settings import lr_underflow


def captioned(folder: Path, captions: list[str]) -> Path:
    make_images(folder, n=len(captions))
    for i, text in enumerate(captions):
        (folder / f"im{i}.txt").write_text(text)
    return folder


def said(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("step ")]


def test_caption_counts_agree_with_what_is_encoded(capsys, base, tmp_path):
    """A first run encodes its 2 captions; a second with --caption-dropout finds them in the prompt
    cache and encodes only the empty caption: both lines count the same texts (not "encoding 2
    captions ... (2 of 3 texts from the prompt cache)" then "1 texts encoded")."""
    data = captioned(tmp_path / "data", ["a striped card", "sks, a dotted card"])
    args = base_args(base, data, tmp_path / "a.safetensors") + ["--steps", "1"]
    rc, _, err = run_cli(capsys, "train", *args)
    lines = said(err)
    assert rc == 0, err
    assert "encoding 2 captions with the text encoder ..." in lines
    assert any(line.startswith("captions: 2 texts encoded, text encoder released") for line in lines), err
    assert "a caption as it trains (2 image(s)): 'a striped card'" in lines, err
    args = base_args(base, data, tmp_path / "b.safetensors") + ["--steps", "1", "--caption-dropout", "0.5"]
    rc, _, err = run_cli(capsys, "train", *args)
    lines = said(err)
    assert rc == 0, err
    assert (
        "encoding 1 of 3 texts with the text encoder (2 captions + the empty caption; 2 from the prompt cache) ..."
        in lines
    ), err
    assert any(line.startswith("captions: 1 text encoded, text encoder released") for line in lines), err


def test_loss_plot_of_a_short_run_draws_and_claims_no_average():
    """Under 40 steps the window is 1 step: the title says there is no average and no blue line is drawn;
    from 40 steps the title names the window and the blue line is there."""
    blue = np.array([30, 80, 220])
    losses = [0.5, 0.3, 0.4, 0.2]
    assert average_window(39) == 1 and average_window(40) == 2
    assert "average over" not in plot_title(1) and "no average" in plot_title(1)
    assert plot_title(2).startswith("training loss per step (grey) and its average over the last 2 steps (blue)")
    for window, drawn in ((1, False), (2, True)):
        img = np.asarray(loss_plot(losses, window=window))
        assert bool(np.all(img == blue, axis=-1).any()) == drawn, window


def started(**kw) -> TrainStarted:
    return TrainStarted(
        total_steps=10, first_step=1, resumed_from=None, images=2, buckets={"64x64": 2}, adapters=4, parameters=1000,
        work_dir=Path("w"), layers=2, caption="sks, a fox", **kw,
    )  # fmt: skip


def test_a_run_of_several_processes_says_how_many_train():
    """The start line of an mlx.launch run names its processes and the global batch; one process says nothing."""
    two = describe_event(started(processes=2, batch_size=3))
    assert "; 2 processes train (mlx.launch), each 3 of every batch of 6" in two.splitlines()[0]
    assert "processes" not in describe_event(started())
    assert describe_event(started()).splitlines()[1] == "a caption as it trains (2 image(s)): 'sks, a fox'"


def test_the_low_lr_warning_never_names_a_bound_below_the_lr_it_warns_about():
    """Rounded down, rank 2's bound 2.38e-8 read "at least 2e-08" while warning about --lr 2.3e-08."""
    for rank in (1, 2, 3, 4, 8, 16, 32, 64, 128):
        bound = math.sqrt(2 / math.pi) / rank * 2.0**-24
        for lr in (bound * 0.999, bound * 0.9, bound * 0.5):
            text = lr_underflow(lr, rank)
            shown = float(text.split("at least ")[1].split(")")[0])
            assert shown > lr and shown >= bound, (rank, lr, text)
            assert "would stay as it starts" not in text
        assert lr_underflow(bound * 1.001, rank) is None


def test_a_caption_holding_the_trigger_as_a_word_is_not_prefixed(tmp_path):
    assert with_trigger("a fox, sks style", "sks") == "a fox, sks style"
    assert with_trigger("sks. a fox", "sks") == "sks. a fox"
    assert with_trigger("a sksx fox", "sks") == "sks, a sksx fox"  # a word, not a part of one
    assert with_trigger("a fox in ohwx man style", "ohwx man") == "a fox in ohwx man style"
    assert with_trigger("a photo of [trigger]", "sks") == "a photo of sks"
    data = captioned(tmp_path / "data", ["a fox, sks style", "a fox"])
    assert [it.caption for it in scan_data(data, resolution=64, trigger="sks")] == ["a fox, sks style", "sks, a fox"]


@pytest.mark.parametrize("where", ["file", "--caption"])
def test_trigger_slot_without_trigger_is_refused(capsys, base, tmp_path, no_models, where):  # noqa: F811
    data = make_images(tmp_path / "data", captions=where == "file")
    if where == "file":
        (data / "im1.txt").write_text("a photo of [trigger] in snow")
    extra = ["--caption", "[trigger] dog"] if where == "--caption" else []
    named = "im1.txt" if where == "file" else "--caption"
    refused(
        capsys, tmp_path, base_args(base, data, tmp_path / "o.safetensors") + extra, named, "[trigger]", "--trigger"
    )
    assert not (tmp_path / "o.train").exists()
