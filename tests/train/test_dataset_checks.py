"""`train` says what it does with the input it is given (issue 38): the batch that runs, images far
smaller than the training size, held-out images that are the training images, captions edited since a
recorded run, texts that are not UTF-8, and links, folders and files in the wrong place, each in one
line, before any model loads, changing nothing.

The helpers are those of test_settings.py: `refused` runs the command and asserts exit status 1,
one `error:` line holding the words and an unchanged folder; `no_models` fails a test that loads one.
"""

from __future__ import annotations

import pytest
from command_line import run_cli
from test_settings import base_args, make_images, no_models, refused  # noqa: F401

from flux_klein_mlx.train.memory import step_peak
from flux_klein_mlx.train.plan import plan_run
from flux_klein_mlx.train.settings import TrainSettings


@pytest.mark.usefixtures("no_models")
def test_a_batch_larger_than_the_buckets_is_said_and_planned_as_it_runs(capsys, base, tmp_path, monkeypatch):
    """Case 5 and 16: --batch-size 64 with 2 images runs batches of 2 (a batch never mixes buckets):
    the user is told, and the memory plan sizes 2, so a machine that fits 2 is not refused."""
    from flux_klein_mlx.train import memory

    data = make_images(tmp_path / "data")
    kw = dict(model=base, data=data, output=tmp_path / "o.safetensors", resolution=64, rank=4)
    two = plan_run(TrainSettings(**kw, batch_size=2)).memory
    monkeypatch.setattr(memory, "machine_memory", lambda: (two.peak + 1000, "a test machine"))
    with pytest.warns(UserWarning, match=r"--batch-size 64 is more than the 2 image\(s\) of the largest bucket"):
        plan = plan_run(TrainSettings(**kw, batch_size=64))
    assert plan.memory.fits and plan.memory.peak == two.peak
    params, trainable = plan.info.params, plan.memory.trainable
    assert two.peak == step_peak(params, trainable, resolution=64, bits=None, low_memory=False, batch=2)[0]
    assert step_peak(params, trainable, resolution=64, bits=None, low_memory=False, batch=64)[0] > two.peak + 1000
    assert list(tmp_path.iterdir()) == [data]
    monkeypatch.setattr(memory, "machine_memory", lambda: (1000, "a test machine"))  # the command says it too
    rc, _, err = run_cli(capsys, "train", *base_args(base, data, tmp_path / "o.safetensors"), "--batch-size", "64")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 2 and lines[0].startswith("warning: --batch-size 64 is more than the 2"), err
    assert lines[1].startswith("error: memory plan") and list(tmp_path.iterdir()) == [data]


@pytest.mark.parametrize("option", ["--trigger", "--caption", "--sample-prompt"])
def test_text_that_is_not_utf8_refused_in_one_line(capsys, base, tmp_path, no_models, option):  # noqa: F811
    """Case 11: `--trigger $'\\xff'` reaches Python as a lone surrogate (surrogateescape): one line, no work folder."""
    data = make_images(tmp_path / "data")
    extra = [option, "sks\udcff"] + (["--sample-every", "1"] if option == "--sample-prompt" else [])
    refused(
        capsys, tmp_path, base_args(base, data, tmp_path / "out.safetensors") + extra, option, "not valid text", "0xFF"
    )
    assert not (tmp_path / "out.train").exists()


@pytest.mark.usefixtures("no_models")
def test_images_far_smaller_than_the_training_size_are_named_with_their_size(base, tmp_path):
    """Case 13: 64 px images at --resolution 512,768 are stretched 12x: a warning (the run may go on, pixel
    art may be meant) names them and their size, before any model loads; at --resolution 64 nothing is said."""
    import warnings

    data = make_images(tmp_path / "data")
    kw = dict(model=base, data=data, output=tmp_path / "o.safetensors", rank=4)
    with pytest.warns(UserWarning, match=r"2 image\(s\) are upscaled more than 2x") as said:
        plan_run(TrainSettings(**kw, resolution=(512, 768)))
    text = " | ".join(str(w.message) for w in said)
    assert "im0.png (64x64 px, 12x)" in text and "im1.png (64x64 px, 12x)" in text, text
    assert "smaller --resolution" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_run(TrainSettings(**kw, resolution=64))
    assert list(tmp_path.iterdir()) == [data]


@pytest.mark.usefixtures("no_models")
def test_config_from_train_json_names_an_edited_or_added_caption(capsys, base, tmp_path):
    """Case 14: a train.json replayed on captions edited since (or a caption file added to an image that
    trained on --caption) is refused naming them, as changed images are; the advice (give --data) works."""
    from test_settings import recorded_run

    from flux_klein_mlx.train.command import train
    from flux_klein_mlx.train.config_file import check_recorded_data, option_names, read_config

    data = make_images(tmp_path / "data")
    record = recorded_run(base, data, tmp_path)
    args = ["--config", str(record), "--output", str(tmp_path / "new.safetensors")]
    (data / "im1.txt").write_text("an edited caption")
    refused(capsys, tmp_path, args, "caption(s) im1.txt", "changed since", "give --data")
    (data / "im1.txt").write_text("a test card")  # restored: the same captions pass the check
    check_recorded_data(read_config(record, option_names(train)), data)
    (data / "im0.txt").write_text("")  # an empty caption file: that image has no caption now
    refused(capsys, tmp_path, args + ["--caption", "a card"], "caption(s) im0.txt", "changed since")


@pytest.mark.parametrize("which", ["validation", "validation-control"])
def test_held_out_folder_that_is_a_training_folder_refused(capsys, base, tmp_path, no_models, which):  # noqa: F811
    """Case 15: --validation equal to --data (and --validation-control equal to --control) would measure
    the training images: one line, before any model loads; a copy of training images elsewhere is warned."""
    data = make_images(tmp_path / "data")
    args = base_args(base, data, tmp_path / "out.safetensors")
    if which == "validation":
        refused(capsys, tmp_path, args + ["--validation", str(tmp_path / "." / "data")], "is the --data folder")
        return
    control = make_images(tmp_path / "control", captions=False)
    held_out = make_images(tmp_path / "held_out", n=2)  # copies of the training images
    extra = ["--control", str(control), "--validation", str(held_out), "--validation-control", str(control)]
    refused(capsys, tmp_path, args + extra, "--validation-control", "is the --control folder", "held-out")
    with pytest.warns(UserWarning, match=r"2 held-out image\(s\) are also training images \(im0.png, im1.png\)"):
        plan_run(
            TrainSettings(model=base, data=data, output=tmp_path / "o.safetensors", resolution=64, validation=held_out)
        )


@pytest.mark.usefixtures("no_models")
def test_held_out_captions_are_read_with_the_training_caption_extension(base, tmp_path):
    """--caption-extension .caption reads the held-out folder's captions as it reads --data's: a kohya set
    captioned in .caption files throughout was refused as "no caption" in its validation folder."""
    data, held_out = make_images(tmp_path / "data", captions=False), make_images(tmp_path / "held_out", captions=False)
    for i, folder in enumerate([data, data, held_out, held_out]):
        (folder / f"im{i % 2}.caption").write_text(f"caption {i}")
    kw = dict(model=base, data=data, output=tmp_path / "o.safetensors", resolution=64, validation=held_out)
    plan = plan_run(TrainSettings(**kw, caption_extension=".caption"))
    assert [item.caption for item in plan.validation] == ["caption 2", "caption 3"]
    assert [item.caption for item in plan.items] == ["caption 0", "caption 1"]


@pytest.mark.parametrize(
    "layout, words",
    [
        ("image-loop", ["im1.png is a symbolic link that loops", "remove it"]),
        ("image-dangling", ["im1.png is a symbolic link that points to nothing"]),
        ("caption-folder", ["caption", "im1.txt is a folder, not a text file"]),
        ("caption-loop", ["caption", "im1.txt is a symbolic link that loops"]),
        ("control-missing", ["--control", "does not exist", "reference images"]),
    ],
)
def test_links_folders_and_missing_controls_said_as_they_are(capsys, base, tmp_path, no_models, layout, words):  # noqa: F811
    """Case 16: a link among the images that loops is not "not found", a caption "file" that is a folder is
    not "no caption", and a missing --control folder is not described as one of ".txt captions"."""
    data = make_images(tmp_path / "data")
    extra = []
    if layout.startswith("image-"):
        (data / "im1.png").unlink()
        (data / "im1.png").symlink_to(data / "im1.png" if layout == "image-loop" else tmp_path / "gone.png")
    elif layout.startswith("caption-"):
        (data / "im1.txt").unlink()
        (data / "im1.txt").mkdir() if layout == "caption-folder" else (data / "im1.txt").symlink_to(data / "im1.txt")
    else:
        extra = ["--control", str(tmp_path / "before")]
    err = refused(capsys, tmp_path, base_args(base, data, tmp_path / "out.safetensors") + extra, *words)
    assert "not found" not in err and "no caption" not in err and ".txt captions" not in err


def test_a_lora_given_as_the_model_is_named_as_a_lora_by_train_load_and_convert(capsys, base, tmp_path, no_models):  # noqa: F811
    """Case 16: a LoRA as `train --model` is said to be a LoRA, with what --model needs, and never sent to
    `convert`, which says the same instead of asking whether it is the text encoder or the VAE."""
    import mlx.core as mx
    from command_line import assert_one_line_error

    import flux_klein_mlx
    from flux_klein_mlx.errors import FluxKleinError

    data = make_images(tmp_path / "data")
    lora = tmp_path / "a_lora.safetensors"
    mx.save_safetensors(str(lora), {"transformer.x.lora_A.weight": mx.zeros((4, 8))})
    args = base_args(base, data, tmp_path / "out.safetensors")
    args[1] = str(lora)
    err = refused(capsys, tmp_path, args, "holding a LoRA, not a model", "klein Base model folder or repo id")
    assert "convert" not in err and f"generate --lora {lora}" in err
    with pytest.raises(FluxKleinError) as loaded:
        flux_klein_mlx.load(lora)
    assert str(loaded.value) == err.removeprefix("error: ")
    rc, _, said = run_cli(capsys, "convert", "--model", str(lora), "--output", str(tmp_path / "converted"))
    assert_one_line_error(rc, said, "holding a LoRA, not a model")
    assert "text encoder or the VAE" not in said and not (tmp_path / "converted").exists()


def test_toml_config_with_a_byte_order_mark_is_read(tmp_path):
    """F13: a TOML file saved with a UTF-8 BOM (as Windows editors do) reads as the same file without it."""
    from flux_klein_mlx.train.command import train
    from flux_klein_mlx.train.config_file import option_names, read_config

    text = "lr = 0.0002\nsteps = 7\n"
    plain, bom = tmp_path / "plain.toml", tmp_path / "bom.toml"
    plain.write_text(text, encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    names = option_names(train)
    assert read_config(bom, names).settings == read_config(plain, names).settings != {}
