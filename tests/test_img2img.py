"""Image-to-image and inpainting against diffusers' Flux2KleinInpaintPipeline, by seed alone.

diffusers' `latents=` argument is the noise and bypasses `scale_noise`, so both sides draw their
noise from the seed (torch's CPU generator there, our torch-compatible prior here). img2img is
that pipeline with an all-white mask. Images are float32 `output_type="np"`, compared to 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from refs import diffusers_pipeline, diffusers_prompt_embeds, picture
from tiny_model import LATENT_CHANNELS

import flux_klein_mlx
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.inputs.images import prepare_init_image
from flux_klein_mlx.inputs.settings import content_hash


@pytest.fixture(scope="module")
def pipes(distilled):
    """(ours, diffusers' inpaint pipeline) on the distilled tiny snapshot, float32."""
    return flux_klein_mlx.load(distilled, dtype="float32"), diffusers_pipeline(distilled, "inpaint", True)


def ellipse_mask(w, h):
    """White ellipse (repaint) on black (keep), with a grey anti-aliased-like band to binarise."""
    m = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(m)
    d.ellipse((w // 5, h // 4, 3 * w // 4, 7 * h // 8), fill=255)
    d.rectangle((0, 0, w // 6, h // 6), fill=140)  # >= 0.5 after /255: repainted
    d.rectangle((w - w // 6, 0, w - 1, h // 6), fill=120)  # < 0.5: kept
    return m


def compare(
    ours_pipe,
    ref_pipe,
    *,
    init,
    steps,
    strength,
    seed,
    mask=None,
    reference=None,
    guidance=None,
    prompt="a cat on a sofa",
):
    kw = dict(
        prompt_embeds=diffusers_prompt_embeds(ref_pipe, prompt),
        image=init,
        mask_image=mask if mask is not None else Image.new("L", init.size, 255),
        strength=strength,
        num_inference_steps=steps,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    if reference is not None:
        kw["image_reference"] = reference
    if guidance is not None:
        kw["guidance_scale"] = guidance
    with torch.no_grad():
        theirs = ref_pipe(**kw).images[0]
    ours = ours_pipe.generate(
        prompt,
        init_image=init,
        strength=strength,
        mask=mask,
        steps=steps,
        seed=seed,
        images=None if reference is None else [reference],
        guidance=guidance,
        output_type="np",
    )
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max()), ours, theirs


# steps x strength: t_start = int(steps - steps * strength), so e.g. 5 x 0.3 runs 2 steps (3.5 -> 3).
@pytest.mark.parametrize("steps, strength, runs", [(4, 1.0, 4), (4, 0.6, 3), (5, 0.3, 2), (3, 0.5, 2), (4, 0.05, 1)])
def test_img2img_matches_diffusers(pipes, steps, strength, runs):
    ours_pipe, ref_pipe = pipes
    init = picture(100, 72, seed=4)  # sides not multiples of 16: resized (not cropped) to 96x64
    err, ours, theirs = compare(ours_pipe, ref_pipe, init=init, steps=steps, strength=strength, seed=11)
    print(f"img2img steps {steps} strength {strength}: max abs {err:.2e}")
    assert ours.shape == (64, 96, 3) and err <= 1e-3
    assert ours_pipe.last_metadata["steps_run"] == runs and ours_pipe.last_metadata["mask"] is None


def test_img2img_with_a_reference_matches_diffusers(pipes):
    ours_pipe, ref_pipe = pipes
    err, _, _ = compare(
        ours_pipe,
        ref_pipe,
        init=picture(80, 64, seed=5),
        steps=4,
        strength=0.7,
        seed=3,
        reference=picture(100, 72, seed=6),
    )
    print(f"img2img + reference: max abs {err:.2e}")
    assert err <= 1e-3


@pytest.mark.parametrize("steps, strength", [(4, 0.75), (2, 1.0), (5, 0.5)])
def test_inpainting_matches_diffusers(pipes, steps, strength):
    ours_pipe, ref_pipe = pipes
    init = picture(120, 88, seed=7)  # -> 112x80
    err, ours, theirs = compare(
        ours_pipe, ref_pipe, init=init, mask=ellipse_mask(120, 88), steps=steps, strength=strength, seed=5
    )
    print(f"inpainting steps {steps} strength {strength}: max abs {err:.2e}")
    assert ours.shape == (80, 112, 3) and err <= 1e-3 and ours_pipe.last_metadata["mask"] is not None


def test_inpainting_with_a_reference_matches_diffusers(pipes):
    ours_pipe, ref_pipe = pipes
    err, _, _ = compare(
        ours_pipe,
        ref_pipe,
        init=picture(96, 64, seed=8),
        mask=ellipse_mask(96, 64),
        steps=4,
        strength=0.8,
        seed=9,
        reference=picture(64, 80, seed=10),
    )
    print(f"inpainting + reference: max abs {err:.2e}")
    assert err <= 1e-3


def test_inpainting_on_base_with_cfg_matches_diffusers(base):
    ours_pipe = flux_klein_mlx.load(base, dtype="float32")
    err, _, _ = compare(
        ours_pipe,
        diffusers_pipeline(base, "inpaint", False),
        init=picture(64, 64, seed=2),
        mask=ellipse_mask(64, 64),
        steps=3,
        strength=0.9,
        seed=1,
        guidance=4.0,
    )
    print(f"inpainting Base + CFG: max abs {err:.2e}")
    assert err <= 1e-3


def test_latents_are_the_noise_that_strength_mixes_in(pipes):
    """`latents=` replaces the seed's noise; strength still noises the init image with it."""
    from flux_klein_mlx.sampling import torch_randn

    ours, _ = pipes
    init = picture(96, 64, seed=3)
    by_seed = ours.generate("x", init_image=init, strength=0.5, seed=8, output_type="np")
    by_latents = ours.generate(
        "x", init_image=init, strength=0.5, latents=torch_randn((1, 4 * LATENT_CHANNELS, 4, 6), 8), output_type="np"
    )
    assert np.array_equal(by_seed, by_latents)


def test_preprocessing_matches_diffusers_for_large_images(pipes):
    """An init image above 1024^2 px is shrunk to that area, then resized to multiples of 16, and
    the mask goes to the token grid, exactly as the inpaint pipeline's processors do it."""
    import math

    _, ref = pipes
    init = picture(1100, 1000, seed=13)
    mask = ellipse_mask(1100, 1000)
    ours = prepare_init_image(init, 0.5, mask)
    # The pipeline's own steps (pipeline_flux2_klein_inpaint.py, __call__ 2. and prepare_mask_latents).
    scale = math.sqrt(1024 * 1024 / (1000 * 1100))
    shrunk = ref.image_processor.resize(init, int(1000 * scale), int(1100 * scale))
    H, W = shrunk.height // 16 * 16, shrunk.width // 16 * 16
    pixels = ref.image_processor.preprocess(shrunk, H, W)[0].permute(1, 2, 0).numpy()
    packed = ref.prepare_mask_latents(
        ref.mask_processor.preprocess(mask, height=H, width=W), 1, 1, H, W, torch.float32, "cpu"
    )[0].numpy()
    assert ours.pixels.shape == pixels.shape == (H, W, 3) and (W, H) == (1072, 976)
    assert np.abs(ours.pixels - pixels).max() <= 1e-6
    assert ours.mask.shape == packed.shape and np.abs(ours.mask - packed).max() <= 1e-6
    assert 0 < ours.mask.mean() < 1 and ((ours.mask > 0) & (ours.mask < 1)).any()  # fractional edges


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strength=0.0), r"strength must be in \(0, 1\]"),
        (dict(strength=1.5), r"strength must be in \(0, 1\]"),
        (dict(strength=-0.2), r"strength must be in \(0, 1\]"),
        (dict(strength=1e-18), "so small that none of the 4 steps runs; raise strength= or steps="),
        (dict(mask=Image.new("L", (96, 64), 255)), "the mask is 96x64 but the init image is 100x72"),
        (dict(mask=Image.new("L", (100, 72), 100)), "the mask has no white pixel"),
        (dict(init_image=None, mask=Image.new("L", (100, 72), 255)), "mask= needs an init image: give init_image="),
        (dict(init_image=None, strength=0.5), "strength= needs an init image: give init_image="),
        (dict(init_image=Image.new("RGB", (48, 96))), "init image is 48x96; both sides must be at least 64 px"),
        (dict(init_image=Image.new("RGB", (640, 64))), "the limit is 8:1"),
        (dict(init_image="/no/such/init.png"), "init image not found: /no/such/init.png"),
        (dict(mask="/no/such/mask.png"), "mask not found: /no/such/mask.png"),
        (dict(width=128), r"the output takes the init image's size \(96x64\)"),
        (dict(noise="numpy"), "noise must be one of torch, mlx"),
    ],
)
def test_bad_input_is_one_line_and_runs_no_model(distilled, kwargs, message):
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    args = dict(init_image=picture(100, 72), steps=4) | kwargs
    with pytest.raises(FluxKleinError, match=message) as info:
        pipe.generate("x", **args)
    assert "\n" not in str(info.value)
    assert not (pipe.is_loaded("transformer") or pipe.is_loaded("text_encoder") or pipe.is_loaded("vae"))


def test_unreadable_files(distilled, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    with pytest.raises(FluxKleinError, match="cannot read init image"):
        pipe.generate("x", init_image=broken)
    with pytest.raises(FluxKleinError, match="cannot read mask"):
        pipe.generate("x", init_image=picture(64, 64), mask=broken)


# ---- the CLI -------------------------------------------------------------------------------------


def test_cli_img2img_inpainting_and_noise_metadata(distilled, tmp_path, cli):
    import json

    init, mask = tmp_path / "init.png", tmp_path / "mask.png"
    picture(100, 72, seed=4).save(init)
    ellipse_mask(100, 72).save(mask)
    out = tmp_path / "edit.png"
    code, stdout, stderr = cli(
        "generate",
        "--model",
        str(distilled),
        "-p",
        "a cat",
        "--init-image",
        str(init),
        "--strength",
        "0.6",
        "--mask",
        str(mask),
        "--seed",
        "11",
        "--dtype",
        "float32",
        "-o",
        str(out),
    )
    assert code == 0, stderr
    with Image.open(out) as im:
        assert im.size == (96, 64)
        meta = json.loads(im.text["flux_klein_mlx"])
        cli_pixels = np.asarray(im.convert("RGB"))
    assert meta["noise"] == "torch" and meta["strength"] == 0.6 and meta["steps_run"] == 3
    prepared = prepare_init_image(init, 0.6, mask)  # images are named by the content hash of their pixels
    assert meta["init_image"] == content_hash(prepared.pixels) and meta["mask"] == content_hash(prepared.mask)
    # The same run through the Python API gives the same pixels.
    api = flux_klein_mlx.load(distilled, dtype="float32").generate(
        "a cat", init_image=init, strength=0.6, mask=mask, seed=11
    )
    assert np.array_equal(np.asarray(api), cli_pixels)

    code, stdout, stderr = cli(
        "generate",
        "--model",
        str(distilled),
        "-p",
        "x",
        "-W",
        "64",
        "-H",
        "64",
        "--seed",
        "1",
        "--noise",
        "mlx",
        "--dtype",
        "float32",
        "-o",
        str(tmp_path / "mlx.png"),
    )
    assert code == 0, stderr
    assert json.loads(Image.open(tmp_path / "mlx.png").text["flux_klein_mlx"])["noise"] == "mlx"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--strength", "0.5"], "--strength needs an init image: give --init-image"),
        (["--mask", "MASK"], "--mask needs an init image: give --init-image"),
        (["--init-image", "INIT", "--strength", "0"], "strength must be in (0, 1]"),
        (["--init-image", "INIT", "--strength", "1.01"], "strength must be in (0, 1]"),
        (
            ["--init-image", "INIT", "--strength", "1e-18", "--steps", "4"],
            "none of the 4 steps runs; raise --strength or --steps",
        ),
        (["--init-image", "INIT", "--mask", "SMALLMASK"], "the mask is 64x64 but the init image is 100x72"),
        (["--init-image", "INIT", "--mask", "BLACKMASK"], "the mask has no white pixel"),
        (["--init-image", "TINY"], "both sides must be at least 64 px"),
        (["--init-image", "BROKEN"], "cannot read init image"),
        (["--init-image", "INIT", "--mask", "BROKEN"], "cannot read mask"),
        (["--init-image", "/no/such.png"], "init image not found: /no/such.png"),
        (["--init-image", "INIT", "--width", "128"], "the output takes the init image's size (96x64)"),
    ],
)
def test_cli_bad_input_one_line_exit_1_no_file(distilled, tmp_path, cli, extra, message):
    files = {
        "INIT": picture(100, 72),
        "MASK": Image.new("L", (100, 72), 255),
        "SMALLMASK": Image.new("L", (64, 64), 255),
        "BLACKMASK": Image.new("L", (100, 72), 0),
        "TINY": Image.new("RGB", (40, 80)),
    }
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name, im in files.items():
        im.save(inputs / f"{name}.png")
    (inputs / "BROKEN.png").write_bytes(b"not a png")
    extra = [str(inputs / f"{a}.png") if a in files or a == "BROKEN" else a for a in extra]
    out = tmp_path / "out.png"
    code, _, stderr = cli(
        "generate", "--model", str(distilled), "-p", "x", "--dtype", "float32", "-o", str(out), *extra
    )
    assert code != 0 and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert not out.exists() and list(tmp_path.glob("*.png")) == []


def test_the_prompt_cache_serves_flux3_and_img2img_and_inpainting_run(distilled3, tmp_path):
    """A second run of the same prompt never loads the text encoder (its window and taps are in the key);
    img2img and inpainting take FLUX.2's math (docs/flux3.md): the output has the init image's size, and an
    inpaint keeps what the mask keeps closer to the init image than what it repaints."""
    from flux_klein_mlx.storage.embedding_cache import EmbeddingCache

    cache = EmbeddingCache(tmp_path / "cache")
    first = flux_klein_mlx.load(distilled3, dtype="float32", cache=cache)
    first.generate("a fox", steps=1, width=64, height=64, seed=1)
    again = flux_klein_mlx.load(distilled3, dtype="float32", cache=EmbeddingCache(tmp_path / "cache"))
    assert not again.check_text_encoder(again.inputs("a fox", {"steps": 1, "width": 64, "height": 64}))
    init = picture(64, 64, seed=9)
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))  # repaint the left half
    out = again.generate("a fox", init_image=init, strength=0.9, seed=2, steps=4, output_type="np")
    assert out.shape == (64, 64, 3)
    painted = again.generate("a fox", init_image=init, mask=mask, seed=2, steps=4, output_type="np")
    source = np.asarray(init, dtype=np.float32) / 255
    kept, repainted = np.abs(painted - source)[:, 40:].mean(), np.abs(painted - source)[:, :24].mean()
    assert kept < repainted
