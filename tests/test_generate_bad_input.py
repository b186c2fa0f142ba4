"""Issue 12: every bad input to a run fails fast with one clear line; nothing lost, nothing silent.

The run's own settings and inputs, refused by inputs.py alike for the CLI and the Python API: ranges and
types, prompts that are not text, references, masks and latents that cannot be used; and the values a
run must never return silently (non-finite stages, pipeline.py). Each kind: exit code 1 (or the
documented outcome), a one-line message naming the problem, no traceback, no file written. The
fast-failure kinds also assert that no model was loaded (`no_models`, conftest.py: a run that gets past
the checks fails loudly instead of loading). What a run writes is test_files.py's; the model itself,
test_loading.py's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from command_line import assert_one_line_error, default_args, gen_args
from PIL import Image
from refs import flux2_reference_pixels

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.inputs.images import open_image
from flux_klein_mlx.run.pipeline import load

# --- no silent wrong results ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,words",
    [
        (["-W", "0"], "width 0 is below the minimum"),
        (["--steps", "0"], "steps must be a whole number in [1, 1000]"),
        (["--guidance", "nan"], "guidance must be a finite number"),
        (["--guidance", "-5"], "guidance must be a finite number >= 0"),
        (["--guidance", "inf"], "guidance must be a finite number"),
    ],
)
def test_ranges_refused_by_cli_before_any_model(cli, base, tmp_path, no_models, extra, words):
    code, _, err = cli(*gen_args(base, tmp_path / "x.png", *extra))
    assert_one_line_error(code, err, words)
    assert list(tmp_path.iterdir()) == []


def test_ranges_and_types_refused_by_the_python_api_alike(base, no_models):
    pipe = load(base)
    for kwargs, words in [
        (dict(width=0), "width 0 is below the minimum"),
        (dict(steps=0), "steps must be"),
        (dict(guidance=float("nan")), "guidance must be a finite number"),
        (dict(guidance=-5.0), "guidance must be"),
        (dict(seed="42"), "seed must be a whole number"),
        (dict(seed=1.5), "seed must be a whole number"),
        (dict(steps=2.5), "steps must be"),
        (dict(width="64"), "width must be a whole number"),
        (dict(negative_prompt=["x"]), "negative_prompt must be a string"),
    ]:
        with pytest.raises(FluxKleinError, match=words.replace("(", r"\(")):
            pipe.generate("a fox", **kwargs)
    with pytest.raises(FluxKleinError, match="prompt must be a string, not list"):
        pipe.generate(["a fox", "a cat"])
    assert no_models == []


def test_prompt_that_is_not_text_refused_alike_by_cli_and_api(cli, base, tmp_path, no_models):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates (surrogateescape); the
    Python API and the server (JSON `\\ud800`) can pass lone surrogates themselves. One rule: an error that says
    so, before any model (the server's 400 is in test_serve)."""
    out = tmp_path / "x.png"
    for extra, words in (
        (
            ["-p", "caf\udce9"],
            "the prompt is not valid text: character 4 is a lone surrogate U+DCE9 (byte 0xE9 that is not UTF-8",
        ),
        (["--negative-prompt", "a\udcff", "--guidance", "4"], "the negative prompt is not valid text"),
    ):
        code, _, err = cli(*gen_args(base, out, *extra))
        assert_one_line_error(code, err, words)
    pipe = load(base)
    with pytest.raises(
        FluxKleinError, match=r"the prompt is not valid text: character 3 is a lone surrogate U\+D800; "
    ):
        pipe.generate("a \ud800 fox", width=64, height=64)
    assert no_models == [] and not out.exists()


def test_empty_prompt_refused_before_any_model(cli, snapshot, tmp_path, no_models):
    """An empty prompt (the server's rule too): one line, before any model, nothing written."""
    code, _, err = cli("generate", "--model", snapshot, "-p", " ", "-o", tmp_path / "x.png")
    assert_one_line_error(code, err, "the prompt is empty")
    assert no_models == [] and list(tmp_path.iterdir()) == []


def test_seeds_wrap_like_torch_in_cli_and_api(cli, snapshot, tmp_path):
    """Documented: torch noise uses seed mod 2**32 (negative seeds wrap, as in torch); the CLI and
    the API accept any seed torch takes alike (its largest, 2**64 - 1, is 2**32 - 1's noise; past it, test_limits)."""
    pipe = load(snapshot, dtype="float32")
    x = pipe.generate("a fox", width=64, height=64, steps=1, seed=-1, output_type="np")
    y = pipe.generate("a fox", width=64, height=64, steps=1, seed=2**32 - 1, output_type="np")
    assert np.array_equal(x, y)
    out = tmp_path / "big.png"
    code, _, err = cli(*gen_args(snapshot, out, "--seed", 2**64 - 1))
    assert code == 0 and "Traceback" not in err, err
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.round(y * 255).astype(np.uint8))


def nan_pipeline(snapshot, stage, dtype="float32"):
    """A real tiny pipeline whose VAE encode or decode returns NaN."""
    pipe = load(snapshot, dtype=dtype)
    vae = pipe.component("vae")
    name = "decode_tokens" if stage == "decode" else "encode_to_tokens"
    real = getattr(vae, name)
    setattr(vae, name, lambda *a, **k: real(*a, **k) * float("nan"))
    return pipe


@pytest.mark.parametrize(
    "stage,dtype,words", [("decode", "float32", "VAE decode"), ("encode", "bfloat16", "VAE encoding of the reference")]
)
def test_non_finite_values_end_the_run_naming_the_stage(snapshot, tmp_path, stage, dtype, words):
    ref = tmp_path / "ref.png"
    Image.new("RGB", (64, 64), (120, 30, 200)).save(ref)
    pipe = nan_pipeline(snapshot, stage, dtype)
    with pytest.raises(FluxKleinError, match=words) as e:
        pipe.generate("a fox", width=64, height=64, steps=1, seed=0, images=[ref] if stage == "encode" else None)
    message = str(e.value)
    assert "\n" not in message
    # float32 already: no advice to use float32; bfloat16: the advice is given.
    assert ("--dtype float32" in message) == (dtype != "float32")


def test_non_finite_prompt_embeddings_named(snapshot):
    pipe = load(snapshot, dtype="float32")
    te = pipe.component("text_encoder")  # loaded now, poisoned in place; the run encodes with it
    te.model.embed_tokens.weight = te.model.embed_tokens.weight * float("nan")
    with pytest.raises(FluxKleinError, match="non-finite values in the text encoder") as e:
        pipe.generate("a fox", width=64, height=64, steps=1, seed=0)
    assert "--dtype float32" not in str(e.value)


# --- reference images, masks and latents ----------------------------------------------------------------


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (64, 128), (0, 0, 0))
    im.paste((255, 255, 255), (0, 0, 64, 16))  # a white band at the top
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "phone.jpg"
    im.save(path, exif=exif.tobytes(), quality=95)
    shown = open_image(path, "reference image")
    assert shown.size == (128, 64)  # what a photo viewer shows
    assert flux2_reference_pixels(path).shape == (64, 128, 3)


def test_16_bit_grey_converted_by_value(tmp_path):
    path = tmp_path / "grey16.png"
    Image.fromarray(np.full((64, 64), 32768, dtype=np.uint16)).save(path)
    x = flux2_reference_pixels(path)  # [-1, 1]
    assert abs(float(x.mean())) < 0.01  # 50% grey, not white


def test_float_images_read_by_value(tmp_path):
    """32-bit float pictures by value ([0, 1], or [0, 255] when a value exceeds 1; a float TIFF too)."""
    half = np.full((64, 64), 0.5, np.float32)
    tiff = tmp_path / "half.tif"
    Image.fromarray(half).save(tiff)
    for image in (Image.fromarray(half), tiff, Image.fromarray(half * 255)):
        x = flux2_reference_pixels(image)  # [-1, 1]
        assert abs(float(x.mean())) < 0.01, image  # 50% grey, not black


def test_closed_images_and_latents_of_a_wrong_dtype_refused(base, no_models):
    """A closed PIL image and latents of dtype object or complex: one FluxKleinError each."""
    pipe = load(base)  # bfloat16
    closed = Image.new("RGB", (64, 64))
    closed.close()
    for kwargs, words in (
        (dict(images=[closed]), "reference image is a closed PIL image"),
        (dict(init_image=closed), "init image is a closed PIL image"),
        (dict(latents=np.zeros((1, 32, 4, 4), object)), "not numpy dtype object"),
        (dict(latents=np.zeros((1, 32, 4, 4), complex)), "not numpy dtype complex128"),
    ):
        with pytest.raises(FluxKleinError, match=words):
            pipe.generate("a fox", width=64, height=64, **kwargs)
    assert no_models == []


def test_animated_reference_warns_first_frame(tmp_path):
    path = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (64, 64), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    with pytest.warns(UserWarning, match="2 frames; the first one is used"):
        x = flux2_reference_pixels(path)
    assert x[..., 0].mean() > 0.9 and x[..., 1].mean() < -0.9


def test_decompression_bomb_refused_in_one_line(cli, snapshot, tmp_path, no_models, monkeypatch):
    path = tmp_path / "huge.png"
    Image.new("L", (400, 400)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 100)  # 400x400 is then "over 2x the limit"
    code, _, err = cli(*gen_args(snapshot, tmp_path / "x.png", "--image", path))
    assert_one_line_error(code, err, "more pixels than PIL decodes safely")


def test_folder_given_as_image(cli, snapshot, tmp_path, no_models):
    code, _, err = cli(*gen_args(snapshot, tmp_path / "x.png", "--image", tmp_path))
    assert_one_line_error(code, err, "is a folder, not an image")
    code, _, err = cli(*gen_args(snapshot, tmp_path / "x.png", "--init-image", "/dev/null"))
    assert_one_line_error(code, err, "is not a regular file")


def test_width_alone_with_a_reference_takes_the_references_height(snapshot, tmp_path):
    ref = tmp_path / "ref.png"
    Image.new("RGB", (128, 96), (30, 60, 90)).save(ref)
    pipe = load(snapshot, dtype="float32")
    out = pipe.generate("a fox", width=64, steps=1, seed=0, images=[ref])
    assert out.size == (64, 96)  # not 64x1024
    assert pipe.last_metadata["height"] == 96


def test_masks_in_openai_convention():
    """A mask with transparency: transparent = repaint (OpenAI's convention), the same mask as white on
    black; an opaque RGBA mask is read by brightness."""
    from flux_klein_mlx.inputs.images import prepare_init_image

    init = Image.fromarray((np.random.default_rng(1).random((64, 64, 3)) * 255).astype(np.uint8))
    grey = Image.new("L", (64, 64), 0)
    grey.paste(255, (0, 0, 32, 48))  # repaint the top-left block
    openai_mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    openai_mask.paste((255, 255, 255, 0), (0, 0, 32, 48))  # transparent there (its colour does not matter)
    opaque = grey.convert("RGBA")
    palette = openai_mask.convert("P")  # a palette PNG with a transparent index
    palette.info["transparency"] = palette.getpixel((0, 0))
    expected = prepare_init_image(init, 0.8, grey).mask
    assert expected.any() and not expected.all()
    for mask in (openai_mask, opaque, palette):
        np.testing.assert_array_equal(prepare_init_image(init, 0.8, mask).mask, expected)


def test_masks_that_miss_every_cell_refused_by_the_api_and_the_cli(cli, snapshot, tmp_path, no_models):
    """White that misses every 16-px cell is refused: by the API, and by the CLI before any model."""
    from flux_klein_mlx.inputs.images import prepare_init_image

    init = Image.fromarray((np.random.default_rng(1).random((64, 64, 3)) * 255).astype(np.uint8))
    tiny = Image.new("L", (64, 64), 0)
    tiny.putpixel((0, 0), 255)  # bilinear taps of a 16x downscale sit at pixels 7 and 8 of each cell
    with pytest.raises(FluxKleinError, match=r"misses every 16x16-px cell .*; enlarge it"):
        prepare_init_image(init, 0.8, tiny)
    init.save(tmp_path / "init.png")
    tiny.save(tmp_path / "tiny.png")
    code, _, err = cli(
        *default_args(
            snapshot, tmp_path / "x.png", "--init-image", tmp_path / "init.png", "--mask", tmp_path / "tiny.png"
        ),
    )
    assert_one_line_error(code, err, "enlarge it")
    assert no_models == [] and not (tmp_path / "x.png").exists()


def test_a_size_this_machine_cannot_decode_is_refused_before_any_model(cli, snapshot, tmp_path, no_models, monkeypatch):
    """Issue 38: even in bands, klein's decode at 4096x4096 holds W·H·(c_1 + 3 c_0) bf16 values (21.5 GB,
    limits.py) and MLX's CPU backend segfaults when an allocation fails. A size past MEMORY_SHARE of the
    machine is refused up front with one line naming the need, the machine and the size that fits; the
    machine is pinned at 16 GB so the test holds on any host."""
    from flux_klein_mlx import limits
    from flux_klein_mlx.inputs.settings import check_image_size

    monkeypatch.setattr(limits, "machine_memory", lambda: (16 * 10**9, "a 16 GB test machine"))
    code, _, err = cli(*gen_args(snapshot, tmp_path / "big.png", "-W", "4096", "-H", "4096"))
    assert_one_line_error(code, err, "4096x4096 is too large", "21.5 GB", "16.0 GB (a 16 GB test machine", "at most")
    assert no_models == [] and not (tmp_path / "big.png").exists()
    with pytest.raises(FluxKleinError, match="4096x4096 is too large") as refused:
        load(snapshot).generate("x", width=4096, height=4096)
    side = int(re.search(r"at most about (\d+)x", str(refused.value)).group(1))
    check_image_size(side, side)  # the advice given passes, and 16 px more does not
    with pytest.raises(FluxKleinError, match="too large"):
        check_image_size(side + 16, side + 16)
