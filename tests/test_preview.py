"""Step previews: the latent -> RGB map, its channel order against diffusers, the fit script,
the denoised estimate the pipeline yields, and `generate --preview-dir`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image
from tiny_model import LATENT_CHANNELS

import flux_klein_mlx
from flux_klein_mlx.record.output import FLUX2_RGB_FACTORS, LatentPreview, flux2_preview, preview_for, unpatchify_tokens

ROOT = Path(__file__).resolve().parents[1]


def test_token_channel_order_matches_diffusers_patchify():
    from diffusers import Flux2KleinPipeline

    z = torch.randn(1, 32, 6, 10)  # raw VAE latent (B, C, 2h, 2w)
    packed = Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(z))  # (1, h*w, 128)
    ours = unpatchify_tokens(packed.numpy(), 3, 5)  # (2h, 2w, C)
    np.testing.assert_array_equal(ours, z[0].permute(1, 2, 0).numpy())


def test_published_flux2_map_renders_uint8_at_latent_resolution():
    p = flux2_preview()
    assert p.factors.shape == (32, 3) and p.bias.shape == (3,) and len(FLUX2_RGB_FACTORS) == 32
    tokens = np.random.default_rng(0).standard_normal((1, 4 * 6, 128)).astype(np.float32)
    img = p.render(tokens, 4, 6)
    assert img.shape == (8, 12, 3) and img.dtype == np.uint8
    # rgb = lat @ F + b, mapped from [-1, 1] to [0, 255]: check one pixel by hand.
    lat = unpatchify_tokens(tokens, 4, 6)
    expected = np.clip(np.round((lat[3, 5] @ p.factors + p.bias + 1) * 127.5), 0, 255)
    np.testing.assert_array_equal(img[3, 5], expected)
    with pytest.raises(ValueError, match="takes 32 latent channels"):
        p.render(np.zeros((1, 4, 64), np.float32), 2, 2)


def test_render_takes_bfloat16_mlx_tokens():
    """The default dtype: every step preview of a bf16 run is a bf16 MLX array (issue 21: this crashed)."""
    import mlx.core as mx

    tokens = mx.array(np.random.default_rng(1).standard_normal((1, 4 * 6, 128)).astype(np.float32)).astype(mx.bfloat16)
    p = flux2_preview()
    np.testing.assert_array_equal(p.render(tokens, 4, 6), p.render(np.array(tokens.astype(mx.float32)), 4, 6))


def test_fit_script_on_the_tiny_vae_beats_a_constant_colour(snapshot, capsys):
    spec = importlib.util.spec_from_file_location("fit_preview", ROOT / "benchmarks" / "fit_preview.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--vae", str(snapshot / "vae"), "--images", "8", "--noise", "2", "--size", "64"]) == 0
    out = capsys.readouterr().out
    held_out = float(re.search(r"held-out pictures (-?[\d.]+)", out).group(1))
    assert held_out > 0.0  # better than predicting the mean colour, on pictures it never saw
    rows = re.findall(r"^    \((.*)\),$", out, re.M)
    assert len(rows) == LATENT_CHANNELS and all(len(r.split(",")) == 3 for r in rows)
    assert re.search(r"^RGB_BIAS = \(.*\)$", out, re.M)


def test_pipeline_denoised_estimate_and_fitted_map(snapshot):
    pipe = flux_klein_mlx.load(snapshot, dtype="float32")
    events = list(pipe.stream("a fox", width=64, height=96, seed=2, steps=3, output_type="np"))
    steps = [e for e in events if e.stage == "denoise"]
    assert all(e.grid == (6, 4) and e.denoised.shape == (1, 24, 4 * LATENT_CHANNELS) for e in steps)
    # After the last step the clean-latent estimate is the final latent: decoding it gives the image.
    vae = pipe.component("vae")
    decoded = np.array(mx.clip(vae.decode_tokens(steps[-1].denoised, 6, 4)[0] / 2 + 0.5, 0, 1))
    np.testing.assert_allclose(decoded, events[-1].image, atol=1e-5)
    preview = preview_for(vae)  # 8 latent channels: fitted to this VAE at load
    assert isinstance(preview, LatentPreview) and preview.channels == LATENT_CHANNELS
    img = preview.render(steps[-1].denoised, 6, 4)
    assert img.shape == (12, 8, 3) and img.std() > 0


def test_generate_writes_step_previews(snapshot, tmp_path):
    from flux_klein_mlx.__main__ import main

    previews = tmp_path / "previews"
    previews.mkdir()
    out = tmp_path / "fox.png"
    args = [
        "generate",
        "-p",
        "a fox",
        "-m",
        str(snapshot),
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "3",
        "--seed",
        "1",
        "--dtype",
        "float32",
        "-o",
        str(out),
        "--preview-dir",
        str(previews),
    ]
    assert main(args) == 0
    files = sorted(p.name for p in previews.iterdir())
    assert files == ["fox-step01.png", "fox-step02.png", "fox-step03.png"]
    assert Image.open(previews / files[0]).size == (8, 8)


def test_generate_preview_dir_must_exist(snapshot, tmp_path, capsys):
    from flux_klein_mlx.__main__ import main

    args = [
        "generate",
        "-p",
        "x",
        "-m",
        str(snapshot),
        "-o",
        str(tmp_path / "x.png"),
        "--preview-dir",
        str(tmp_path / "missing"),
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --preview-dir") and "create it first" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()
