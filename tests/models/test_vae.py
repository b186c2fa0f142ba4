"""The VAE and the latent path against diffusers' AutoencoderKLFlux2 and Flux2KleinPipeline.

A tiny random VAE with 4 levels (size multiple 16 and 128 token channels, as the real one) is
saved in the Hugging Face `vae/` layout and, renamed to BFL's keys, as a single `ae.safetensors`;
both are loaded through `load_vae` and compared in float32 with the reference pipeline's own
encode and decode steps.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2, Flux2KleinPipeline
from mlx.utils import tree_flatten
from refs import load_one, randomize_, rel_err, to_bfl, to_mx
from refs import vae_reference_decode as reference_decode
from refs import vae_reference_tokens as reference_tokens
from safetensors.torch import save_file

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.inputs.settings import check_image_size
from flux_klein_mlx.models.config import AutoEncoderConfig
from flux_klein_mlx.models.vae import (
    AutoEncoder,
    pack,
    patchify,
    sanitize_vae_weights,
    unpack,
    unpatchify,
)

TINY = dict(
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    latent_channels=32,
    norm_num_groups=32,
    sample_size=64,
)
SIZES = [(64, 64), (48, 80)]  # (H, W), multiples of 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(reference VAE, diffusers folder, BFL file) for one tiny random VAE."""
    torch.manual_seed(0)
    ref = randomize_(AutoencoderKLFlux2(**TINY), seed=0).eval()
    root = tmp_path_factory.mktemp("vae")
    ref.save_pretrained(root / "vae")
    bfl = to_bfl(ref.state_dict(), len(TINY["block_out_channels"]))
    save_file(bfl, str(root / "ae.safetensors"))
    return SimpleNamespace(ref=ref, folder=root / "vae", bfl_file=root / "ae.safetensors", root=root)


def load(tiny, fmt: str, dtype=mx.float32) -> AutoEncoder:
    if fmt == "diffusers":
        return load_one("vae", tiny.folder, dtype=dtype)
    config = AutoEncoderConfig.from_dict(json.loads((tiny.folder / "config.json").read_text()))
    return load_one("vae", tiny.bfl_file, dtype=dtype, config=config)


def nchw(a: mx.array) -> mx.array:
    return a.transpose(0, 3, 1, 2)


# ------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("fmt", ["diffusers", "bfl"])
def test_encode_and_decode_match_the_klein_pipeline(tiny, fmt, monkeypatch):
    model = load(tiny, fmt)
    for i, (H, W) in enumerate(SIZES):
        if i == 1:  # exercise the chunked-query attention path (mid block has 6*10 positions)
            monkeypatch.setattr(type(model.decoder.mid_block.attentions[0]), "query_chunk", 7)
        g = torch.Generator().manual_seed(i)
        images = torch.rand(2, 3, H, W, generator=g) * 2 - 1
        want = reference_tokens(tiny.ref, images)
        got = model.encode_to_tokens(to_mx(images).transpose(0, 2, 3, 1))
        assert got.shape == (2, H * W // 256, 128)
        assert rel_err(got, want) <= 1e-4, (fmt, H, W, rel_err(got, want))

        h, w = H // 16, W // 16
        tokens = torch.randn(2, h * w, 128, generator=g)  # the sampler's normalised token space
        want = reference_decode(tiny.ref, tokens, h, w)
        got = model.decode_tokens(to_mx(tokens), h, w)
        assert got.shape == (2, H, W, 3)
        assert rel_err(nchw(got), want) <= 1e-4, (fmt, H, W, rel_err(nchw(got), want))


def test_latent_path_functions_match_the_pipeline():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 32, 6, 10, generator=g)  # (B, C, H, W), VAE latents
    want = Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(z))
    ours = pack(patchify(to_mx(z).transpose(0, 2, 3, 1)))
    assert rel_err(ours, want) == 0.0
    back = unpatchify(unpack(ours, 3, 5))
    assert rel_err(nchw(back), z) == 0.0
    with pytest.raises(FluxKleinError, match="4x4 grid"):
        unpack(ours, 4, 4)


def test_tiled_decode_equals_untiled_on_smooth_latents(tiny):
    model = load(tiny, "diffusers")
    g = torch.Generator().manual_seed(5)
    low = torch.randn(1, 32, 4, 6, generator=g)  # smooth: random at 1/4 resolution, upsampled
    z = torch.nn.functional.interpolate(low, size=(16, 24), mode="bilinear", align_corners=False)
    untiled = model.decode(to_mx(z).transpose(0, 2, 3, 1))
    for tile_pixels in (1, 500, 3000):  # one row per band, many bands, a few bands
        tiled = model.decode(to_mx(z).transpose(0, 2, 3, 1), tiled=True, tile_pixels=tile_pixels)
        assert float(mx.abs(tiled - untiled).max()) <= 1e-2  # the brief's bound; we see ~5e-5
        assert rel_err(tiled, untiled) <= 1e-4, (tile_pixels, rel_err(tiled, untiled))
    with torch.no_grad():
        want = tiny.ref.decode(z).sample
    assert rel_err(nchw(tiled), want) <= 1e-4
    # and through the token API, on the pipeline's own decode path
    tokens = torch.randn(2, 2 * 3, 128, generator=g)
    got = model.decode_tokens(to_mx(tokens), 2, 3, tiled=True, tile_pixels=200)
    assert rel_err(nchw(got), reference_decode(tiny.ref, tokens, 2, 3)) <= 1e-4


def test_bfloat16_load_runs_close_to_float32(tiny):
    z = mx.random.normal((1, 4, 4, 32), key=mx.random.key(0))
    ref = load(tiny, "diffusers").decode(z)
    model = load(tiny, "diffusers", dtype=mx.bfloat16)
    assert model.decoder.conv_in.weight.dtype == mx.bfloat16
    got = model.decode(z)
    assert got.dtype == mx.bfloat16
    assert rel_err(got, ref) <= 5e-2


# --------------------------------------------------------------------- weights and config


def test_sanitize_both_formats_agree_and_is_idempotent(tiny):
    sd = {k: to_mx(v) for k, v in tiny.ref.state_dict().items()}
    bfl = {k: to_mx(v) for k, v in to_bfl(tiny.ref.state_dict(), 4).items()}
    a, b = sanitize_vae_weights(sd), sanitize_vae_weights(bfl)
    assert sorted(a) == sorted(b)
    model = AutoEncoder(AutoEncoderConfig.from_dict(dict(tiny.ref.config)))
    assert sorted(a) == sorted(k for k, _ in tree_flatten(model.parameters()))  # nothing left over
    for k in a:
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k
    for once in (a, b):
        twice = sanitize_vae_weights(once)
        assert sorted(twice) == sorted(once)
        for k in once:
            assert twice[k].shape == once[k].shape and np.array_equal(np.array(twice[k]), np.array(once[k])), k
    assert a["encoder.conv_in.weight"].shape == (32, 3, 3, 3)  # (O, kh, kw, I)
    assert a["decoder.conv_in.weight"].shape == (64, 3, 3, 32)
    assert a["decoder.mid_block.attentions.0.to_q.weight"].shape == (64, 64)


def test_saved_ours_loads_again(tiny, tmp_path):
    """What `convert` writes (our names, NHWC) loads through the same path."""
    model = load(tiny, "bfl")
    mx.save_safetensors(str(tmp_path / "vae.safetensors"), dict(tree_flatten(model.parameters())))
    again = load_one("vae", tmp_path / "vae.safetensors", dtype=mx.float32, config=model.config)
    z = mx.random.normal((1, 2, 3, 32), key=mx.random.key(1))
    assert rel_err(again.decode(z), model.decode(z)) == 0.0


def test_config_from_hf_json(tiny):
    d = dict(json.loads((tiny.folder / "config.json").read_text()), some_future_key=1)
    c = AutoEncoderConfig.from_dict(d)
    assert c.block_out_channels == (32, 32, 64, 64) and c.latent_channels == 32
    assert (c.downscale, c.size_multiple, c.token_channels) == (8, 16, 128)
    real = AutoEncoderConfig.flux2()
    assert real.block_out_channels == (128, 256, 512, 512) and real.batch_norm_eps == 1e-4
    assert (real.downscale, real.size_multiple, real.token_channels) == (8, 16, 128)


def test_full_size_vae_has_the_published_parameter_count():
    model = AutoEncoder(AutoEncoderConfig.flux2())  # lazy: nothing is evaluated
    learnable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert learnable == 84_046_115
    # plus the BatchNorm statistics, loaded but not learnable: 250 tensors (+ num_batches_tracked = 251)
    params = dict(tree_flatten(model.parameters()))
    assert len(params) == 250 and params["bn.running_var"].shape == (128,)


def test_missing_weight_is_named(tiny, tmp_path):
    w = {k: v for k, v in to_bfl(tiny.ref.state_dict(), 4).items() if k != "bn.running_var"}
    save_file(w, str(tmp_path / "ae.safetensors"))
    with pytest.raises(FluxKleinError, match="bn.running_var"):
        load_one("vae", tmp_path / "ae.safetensors", dtype=mx.float32, config=load(tiny, "diffusers").config)


# ------------------------------------------------------------------------------ bad input


def test_image_size_errors_say_what_is_allowed():
    check_image_size(1024, 768)
    check_image_size(64, 64)
    with pytest.raises(FluxKleinError, match=r"width 1000 is not a multiple of 16; use e\.g\. 992 or 1008"):
        check_image_size(1000, 1024)
    with pytest.raises(FluxKleinError, match=r"height 48 is below the minimum of 64 px"):
        check_image_size(512, 48)
    with pytest.raises(FluxKleinError, match=r"height 70 is not a multiple of 16; use e\.g\. 64 or 80"):
        check_image_size(512, 70)
    with pytest.raises(FluxKleinError, match=r"above the maximum"):
        check_image_size(8192, 512)
    with pytest.raises(FluxKleinError, match="whole number"):
        check_image_size(512.0, 512)


def test_encode_rejects_sizes_that_do_not_patchify(tiny):
    model = load(tiny, "diffusers")
    with pytest.raises(FluxKleinError, match="not a multiple of 16"):
        model.encode_to_tokens(mx.zeros((1, 40, 64, 3)))


def _tiny_flux1_vae():
    return randomize_(
        AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(32, 32),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        seed=1,
    )


def test_flux1_vae_is_refused_clearly(tmp_path):
    flux1 = _tiny_flux1_vae()
    flux1.save_pretrained(tmp_path / "vae")
    with pytest.raises(FluxKleinError, match=r"FLUX\.1 VAE \(16 latent channels\).*FLUX\.2 VAE \(32 channels\)"):
        load_one("vae", tmp_path / "vae")
    save_file(to_bfl(flux1.state_dict(), 2), str(tmp_path / "ae.safetensors"))
    with pytest.raises(FluxKleinError, match=r"FLUX\.1 VAE"):
        load_one("vae", tmp_path / "ae.safetensors")


def test_missing_source_is_clear(tmp_path):
    with pytest.raises(FluxKleinError, match="not found"):
        load_one("vae", tmp_path / "nothing.safetensors")
