"""`vae=` / `--vae`: BFL's small decoder (black-forest-labs/FLUX.2-small-decoder) and other VAEs
in place of the model's, against diffusers' `AutoencoderKLFlux2`, which holds the small
decoder's shape itself (`decoder_block_out_channels`).

The tiny small-decoder VAE keeps the real one's proportions: a full encoder, a decoder 3/4 as
wide. It is laid out like the hub repo (config.json + diffusion_pytorch_model.safetensors at
the root, and the same weights under BFL names as full_encoder_small_decoder.safetensors).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import mlx.core as mx
import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2
from refs import randomize_, rel_err, to_bfl, to_mx, vae_reference_decode, vae_reference_tokens
from safetensors.torch import save_file
from tiny_model import VAE, shared_tiny_snapshot

from flux_klein_mlx.bench.flops import flops_of_vae_decoder
from flux_klein_mlx.bench.measure import bytes_to_load
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.config import AutoEncoderConfig
from flux_klein_mlx.run.components import load_component, read_component
from flux_klein_mlx.run.loading import describe, with_vae

SMALL = dict(VAE, block_out_channels=(32, 32, 64, 64), decoder_block_out_channels=(24, 24, 48, 48))
NARROW_DECODER = dict(VAE, decoder_block_out_channels=(8, 8, 24, 24))  # the tiny snapshot's encoder (16, 16, 32, 32)
H, W = 64, 48


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return shared_tiny_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The tiny small-decoder VAE, in the hub repo's layout, and a decoder-only file."""
    root = tmp_path_factory.mktemp("small-decoder")
    ref = randomize_(AutoencoderKLFlux2(**SMALL), seed=5).eval()
    ref.save_pretrained(root)  # config.json + diffusion_pytorch_model.safetensors
    save_file(to_bfl(ref.state_dict(), 4), str(root / "full_encoder_small_decoder.safetensors"))
    narrow = randomize_(AutoencoderKLFlux2(**NARROW_DECODER), seed=6).eval()
    decoder = {
        k: v.contiguous() for k, v in narrow.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))
    }
    save_file(decoder, str(root / "decoder_only.safetensors"))
    return SimpleNamespace(root=root, ref=ref, narrow=narrow, bfl=root / "full_encoder_small_decoder.safetensors")


def check_parity(model, ref, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(2, 3, H, W, generator=g) * 2 - 1
    got = model.encode_to_tokens(to_mx(images).transpose(0, 2, 3, 1))
    assert rel_err(got, vae_reference_tokens(ref, images)) <= 1e-4
    h, w = H // 16, W // 16
    tokens = torch.randn(2, h * w, 4 * VAE["latent_channels"], generator=g)  # (B, h*w, 2x2 patch of latents)
    got = model.decode_tokens(to_mx(tokens), h, w)  # (B, H, W, 3)
    assert rel_err(got.transpose(0, 3, 1, 2), vae_reference_decode(ref, tokens, h, w)) <= 1e-4


@pytest.mark.parametrize("source", ["folder", "bfl_file"])
def test_small_decoder_equals_diffusers(snapshot, small, source):
    """The repo root (diffusers file chosen over the BFL duplicate beside it) and the single BFL file."""
    vae = small.root if source == "folder" else small.bfl
    info = describe(snapshot, vae=vae)
    config = AutoEncoderConfig.from_dict(info.configs["vae"])
    assert tuple(config.decoder_block_out_channels) == (24, 24, 48, 48) and tuple(config.block_out_channels) == (
        32,
        32,
        64,
        64,
    )
    assert info.files["vae"] == (
        [small.root / "diffusion_pytorch_model.safetensors"] if source == "folder" else [small.bfl]
    )
    assert info.vae_source == str(vae) and info.decoder_files is None
    model = load_component(info, "vae", mx.float32)
    assert model.decoder.conv_in.weight.shape == (48, 3, 3, 8)  # (O, kh, kw, I): the narrow decoder was built
    check_parity(model, small.ref)


def test_decoder_only_source_keeps_the_models_encoder_and_latent_statistics(snapshot, small):
    info = describe(snapshot, vae=small.root / "decoder_only.safetensors")
    assert info.decoder_files == [small.root / "decoder_only.safetensors"]
    assert info.files["vae"] == describe(snapshot).files["vae"]
    # The reference: the model's own VAE with the narrow decoder (and its post_quant_conv) put in.
    own = AutoencoderKLFlux2.from_pretrained(snapshot / "vae").eval()
    ref = AutoencoderKLFlux2(**NARROW_DECODER).eval()
    merged = {k: v for k, v in own.state_dict().items() if not k.startswith(("decoder.", "post_quant_conv."))}
    merged.update(
        {k: v for k, v in small.narrow.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
    )
    ref.load_state_dict(merged)
    check_parity(load_component(info, "vae", mx.float32), ref, seed=2)
    # Read-ahead plans the bytes this load reads: the model's encoder + statistics, the file's decoder.
    loaded = sum(v.nbytes for v in read_component(info, "vae").values())
    assert bytes_to_load(info, "vae") == loaded


def test_default_dtype_loads_and_decodes(snapshot, small):
    model = load_component(describe(snapshot, vae=small.root), "vae")  # as stored (float32) ...
    bf16 = load_component(describe(snapshot, vae=small.root), "vae", mx.bfloat16)  # ... and the default dtype
    tokens = mx.random.normal((1, 12, 32), key=mx.random.key(0))
    assert rel_err(bf16.decode_tokens(tokens, 4, 3), model.decode_tokens(tokens, 4, 3)) < 5e-2


def test_repo_id_through_the_hub_cache(snapshot, small, tmp_path, monkeypatch):
    """The path a user's `--vae black-forest-labs/FLUX.2-small-decoder` takes, offline from the cache."""
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--black-forest-labs--FLUX.2-small-decoder"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    os.symlink(small.root, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    info = describe(snapshot, vae="black-forest-labs/FLUX.2-small-decoder")
    assert info.configs["vae"]["decoder_block_out_channels"] == [24, 24, 48, 48]
    with pytest.raises(
        FluxKleinError, match="VAE: 'black-forest-labs/FLUX.2-nothing' is not in the local Hugging Face cache"
    ):
        describe(snapshot, vae="black-forest-labs/FLUX.2-nothing")


def test_decoder_flops_equal_torchs_count():
    """flops.py's decoder count against torch's FlopCounterMode on diffusers' small decoder
    (math attention, so that QK^T and AV are counted as matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    ref = AutoencoderKLFlux2(**SMALL).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        ref.decode(torch.zeros(1, VAE["latent_channels"], 6, 10))
    ours = flops_of_vae_decoder(AutoEncoderConfig.from_dict(SMALL), 80, 48)
    assert ours.total == counter.get_total_flops()
    real = AutoEncoderConfig.flux2()
    small_real = AutoEncoderConfig.from_dict({**vars(real), "decoder_block_out_channels": (96, 192, 384, 384)})
    ratio = flops_of_vae_decoder(small_real, 1024, 1024).total / flops_of_vae_decoder(real, 1024, 1024).total
    assert 0.55 < ratio < 0.58  # convs scale with width squared: 0.75^2, attention with width


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_vae_sources_are_one_clear_line(snapshot, small, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    flux1 = tmp_path / "flux1"
    randomize_(
        AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(32, 32),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=32,
        ),
        seed=1,
    ).save_pretrained(flux1)
    other_latent = tmp_path / "latent4"
    AutoencoderKLFlux2(**dict(VAE, latent_channels=4)).save_pretrained(other_latent)
    deep = tmp_path / "deep.safetensors"
    save_file(
        {
            k: v.contiguous()
            for k, v in AutoencoderKLFlux2(**dict(VAE, layers_per_block=2)).state_dict().items()
            if k.startswith("decoder.")
        },
        str(deep),
    )
    cases = [
        (tmp_path / "missing", "VAE: '.*missing' not found"),
        (tmp_path / "empty", "has no VAE: expected a config.json"),
        (tmp_path / "notes.txt", "not a .safetensors file"),
        (snapshot / "transformer" / "diffusion_pytorch_model.safetensors", "holds no VAE decoder weights"),
        (flux1, r"FLUX\.1 VAE \(16 latent channels\)"),
        (other_latent, "the transformer reads 32 latent channels but the VAE in .* makes 16"),
        (deep, "3 ResBlocks per decoder level, the model's VAE 2"),
    ]
    for source, message in cases:
        with pytest.raises(FluxKleinError, match=message):
            describe(snapshot, vae=source)
    info = describe(snapshot)
    with pytest.raises(FluxKleinError, match="has no VAE"):
        with_vae(info, tmp_path / "empty")


# ---- convert --vae ------------------------------------------------------------------------------


def test_convert_writes_the_small_decoder(snapshot, small, tmp_path, capsys):
    from mlx.utils import tree_flatten

    from flux_klein_mlx import __main__ as cli

    out = tmp_path / "mlx"
    assert cli.main(["convert", "-m", str(snapshot), "-o", str(out), "--vae", str(small.root)]) == 0  # default bf16
    info = describe(out)
    assert info.configs["vae"]["decoder_block_out_channels"] == [24, 24, 48, 48]
    assert info.original["vae"] == str(small.root)
    written = dict(tree_flatten(load_component(info, "vae").parameters()))
    direct = dict(tree_flatten(load_component(describe(snapshot, vae=small.root), "vae", mx.bfloat16).parameters()))
    assert written.keys() == direct.keys()
    assert all(written[k].dtype == mx.bfloat16 and mx.array_equal(written[k], direct[k]).item() for k in written)

    capsys.readouterr()
    bad = tmp_path / "bad"
    assert cli.main(["convert", "-m", str(snapshot), "-o", str(bad), "--vae", str(tmp_path / "no-such-vae")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: VAE: ") and err.count("\n") == 1 and not bad.exists()


def test_generate_with_another_decoder_names_it_in_the_record(snapshot, small, tmp_path):
    """`generate --vae FILE` in the default dtype: the image is made and its record says which VAE."""
    from PIL import Image

    from flux_klein_mlx.__main__ import main
    from flux_klein_mlx.record.output import read_record

    out = tmp_path / "x.png"
    args = [
        "generate",
        "-m",
        str(snapshot),
        "--vae",
        str(small.root / "decoder_only.safetensors"),
        "-p",
        "a fox",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "--seed",
        "1",
        "-o",
        str(out),
    ]
    assert main(args) == 0
    assert read_record(out)["vae"] == "decoder_only.safetensors"
    assert "VAE: decoder_only.safetensors" in Image.open(out).info["parameters"]
