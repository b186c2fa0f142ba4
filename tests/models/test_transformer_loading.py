"""FLUX.2 [klein]'s transformer where FLUX 3 has no twin (the parity both families share is test_transformer.py):
the pipeline's position ids and RoPE tables, attention past the backend's score limit, a sharded folder, a whole
snapshot, a BFL single file (params from the shapes), extra or missing keys named, the released configs, and the
checkpoints refused (FLUX.1, FLUX.2-dev, a VAE, damaged files) with the klein size named."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed
from refs import config_snapshot, load_one, rel_err, to_mx
from safetensors.torch import save_file
from tiny_transformers import LT, TRANSFORMERS

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models import attention
from flux_klein_mlx.models.attention import attend
from flux_klein_mlx.models.flux2.config import FluxKleinParams
from flux_klein_mlx.models.flux2.transformer import infer_params, sanitize_flux2_klein_weights
from flux_klein_mlx.models.rope import image_ids, rope_tables, text_ids
from flux_klein_mlx.run.loading import describe

TWIN = TRANSFORMERS["flux2"]  # the tiny reference, its inputs and ids (tests/support/tiny_transformers.py)
CONFIG = TWIN.CONFIG  # 3 heads of 16 (axes 4x4), 2 double + 2 single blocks, text width 24
D, C, CTX, HD = 48, 16, 24, 16
M = 3 * D


@pytest.fixture(scope="module")
def reference():
    return TWIN.reference("tiny")


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    """The reference saved as diffusers saves it (single file)."""
    path = tmp_path_factory.mktemp("snap") / "transformer"
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ours(folder):
    return load_one("transformer", folder, dtype=mx.float32)


def run_both(reference, model, x, t):
    return TWIN.ours(model, x, t), TWIN.theirs(reference, x, t)


# --- position ids and RoPE ---------------------------------------------------------------------------


def test_ids_match_reference_pipeline():
    g = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(1, C, 3, 5))[0]
    assert np.array_equal(np.array(image_ids(3, 5)), g.numpy())
    r = Flux2KleinPipeline._prepare_image_ids([torch.zeros(1, C, 2, 3), torch.zeros(1, C, 4, 2)])[0]
    ours_r = mx.concatenate([image_ids(2, 3, t=10), image_ids(4, 2, t=20)], axis=0)
    assert np.array_equal(np.array(ours_r), r.numpy())
    tx = Flux2KleinPipeline._prepare_text_ids(torch.zeros(1, 512, 3))[0]
    assert np.array_equal(np.array(text_ids()), tx.numpy())


def test_rope_tables_match_diffusers():
    ids = mx.concatenate([text_ids(512), image_ids(64, 64), image_ids(8, 8, t=20)], axis=0)
    cos_ref, sin_ref = Flux2PosEmbed(theta=2000, axes_dim=[32, 32, 32, 32])(torch.from_numpy(np.array(ids)))
    cos, sin = rope_tables(ids)
    assert cos.shape == (512 + 4096 + 64, 64) and cos.dtype == mx.float32
    # diffusers repeats each value for the two dims of a pair
    assert np.abs(np.repeat(np.array(cos), 2, axis=1) - cos_ref.numpy()).max() < 1e-6
    assert np.abs(np.repeat(np.array(sin), 2, axis=1) - sin_ref.numpy()).max() < 1e-6
    # batched ids use element 0
    cos_b, _ = rope_tables(mx.stack([ids, ids * 0]))
    assert np.array_equal(np.array(cos_b), np.array(cos))


# --- attention past the backend's score limit (issue 38) ------------------------------------------------


def counting_sdpa(monkeypatch) -> list[int]:
    """Record the query length of every mx.fast.scaled_dot_product_attention call from now on."""
    calls, sdpa = [], mx.fast.scaled_dot_product_attention

    def counted(q, *args, **kw):
        calls.append(q.shape[2])
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("B, H, L, Lr, hd", [(1, 2, 37, 16, 16), (2, 3, 64, 0, 32)])
def test_attention_in_chunks_equals_one_call_and_torch(monkeypatch, B, H, L, Lr, hd):
    g = torch.Generator().manual_seed(L)
    q, k, v, rk, rv = (torch.randn(B, H, n, hd, generator=g) for n in (L, L, L, Lr, Lr))  # Lr: cached reference K/V
    want = torch.nn.functional.scaled_dot_product_attention(q, torch.cat([k, rk], 2), torch.cat([v, rv], 2))
    want = want.transpose(1, 2).reshape(B, L, H * hd)  # (B, L, H·hd), scale hd^-0.5
    args = (*map(to_mx, (q, k, v)), (to_mx(rk), to_mx(rv)))
    calls = counting_sdpa(monkeypatch)
    whole = attend(*args)
    assert calls == [L] and rel_err(whole, want) <= 1e-5  # under the limit: the one call as before
    monkeypatch.setattr(attention, "SCORE_LIMIT", B * H * (L + Lr) * 5)  # 5 queries per call, the last shorter
    calls.clear()
    chunked = attend(*args)
    assert calls == [5] * (L // 5) + [L % 5] * (L % 5 > 0)
    assert np.abs(np.array(chunked) - np.array(whole)).max() <= 1e-6 and rel_err(chunked, want) <= 1e-5


def test_model_with_attention_in_chunks_matches_diffusers(reference, ours, monkeypatch):
    x = TWIN.inputs(reference, 2, (5, 3), [(2, 3)], seed=3)
    calls = counting_sdpa(monkeypatch)
    monkeypatch.setattr(attention, "SCORE_LIMIT", 2 * 3 * (LT + 15 + 6) * 5)  # B·H·Lk·5: 5 queries per call
    mine, theirs = run_both(reference, ours, x, [0.7, 0.7])
    assert set(calls) == {5, (LT + 15 + 6) % 5} and rel_err(mine, theirs) <= 1e-4


def test_sharded_folder_matches_diffusers(reference, tmp_path):
    path = tmp_path / "transformer"
    reference.save_pretrained(path, max_shard_size="20KB")
    assert (path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    model = load_one("transformer", path, dtype=mx.float32)
    mine, theirs = run_both(reference, model, TWIN.inputs(reference, 2, (3, 5), [(2, 2)], seed=7), [0.7, 0.3])
    assert rel_err(mine, theirs) <= 1e-4


def test_whole_snapshot_folder_is_accepted(reference, folder):
    # `folder` is <snap>/transformer; its parent has no config.json but a transformer/ subfolder
    model = load_one("transformer", folder.parent, dtype=mx.float32)
    assert model.params.hidden_size == D


# --- BFL single-file format ----------------------------------------------------------------------------


def bfl_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the BFL names and layouts of spec §3.1, at the tiny sizes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "img_in.weight": (D, C),
        "txt_in.weight": (D, CTX),
        "time_in.in_layer.weight": (D, 256),
        "time_in.out_layer.weight": (D, D),
        "double_stream_modulation_img.lin.weight": (6 * D, D),
        "double_stream_modulation_txt.lin.weight": (6 * D, D),
        "single_stream_modulation.lin.weight": (3 * D, D),
        "final_layer.adaLN_modulation.1.weight": (2 * D, D),  # rows [shift ; scale]
        "final_layer.linear.weight": (C, D),
    }
    for i in range(2):
        for s in ("img", "txt"):
            shapes[f"double_blocks.{i}.{s}_attn.qkv.weight"] = (3 * D, D)
            shapes[f"double_blocks.{i}.{s}_attn.norm.query_norm.scale"] = (HD,)
            shapes[f"double_blocks.{i}.{s}_attn.norm.key_norm.scale"] = (HD,)
            shapes[f"double_blocks.{i}.{s}_attn.proj.weight"] = (D, D)
            shapes[f"double_blocks.{i}.{s}_mlp.0.weight"] = (2 * M, D)
            shapes[f"double_blocks.{i}.{s}_mlp.2.weight"] = (D, M)
        shapes[f"single_blocks.{i}.linear1.weight"] = (3 * D + 2 * M, D)
        shapes[f"single_blocks.{i}.linear2.weight"] = (D, D + M)
        shapes[f"single_blocks.{i}.norm.query_norm.scale"] = (HD,)
        shapes[f"single_blocks.{i}.norm.key_norm.scale"] = (HD,)
    out = {}
    for k, shape in shapes.items():
        r = torch.randn(shape, generator=g)
        out[k] = 1 + 0.1 * r if len(shape) == 1 else r / shape[1] ** 0.5
    return out


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_bfl_file_matches_diffusers(tmp_path, prefix):
    bfl = bfl_weights(seed=1)
    path = tmp_path / "flux-2-klein-tiny.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in bfl.items()}, str(path))
    reference = Flux2Transformer2DModel(**CONFIG).eval()
    converted = convert_flux2_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in bfl.items()})
    reference.load_state_dict(converted, strict=True)

    model = load_one("transformer", path, dtype=mx.float32)  # params inferred from the shapes
    assert model.params.num_heads == 3 and model.params.axes_dim == (4, 4, 4, 4)
    mine, theirs = run_both(reference, model, TWIN.inputs(reference, 2, (3, 5), [(2, 3), (3, 3)], seed=11), [0.9, 0.4])
    assert rel_err(mine, theirs) <= 1e-4


# --- sanitize and strict loading -----------------------------------------------------------------------


def test_extra_or_missing_key_is_named(tmp_path):
    bfl = bfl_weights()
    extra = dict(bfl, **{"double_blocks.0.img_attn.bogus.weight": torch.zeros(2, 2)})
    path = tmp_path / "extra.safetensors"
    save_file(extra, str(path))
    with pytest.raises(FluxKleinError, match=r"1 unexpected \(double_blocks\.0\.img_attn\.bogus\.weight\)"):
        load_one("transformer", path, dtype=mx.float32)
    missing = {k: v for k, v in bfl.items() if not k.startswith("single_blocks.1.norm")}
    path = tmp_path / "missing.safetensors"
    save_file(missing, str(path))
    with pytest.raises(FluxKleinError, match=r"2 missing \(single_blocks\.1\.norm\.key_norm\.scale"):
        load_one("transformer", path, dtype=mx.float32)


# --- bad inputs ----------------------------------------------------------------------------------------


def stand_in(hidden: int, depth: int, depth_single: int) -> dict[str, torch.Tensor]:
    """A few small tensors whose shapes and key counts imply a given real variant."""
    w = {"img_in.weight": torch.zeros(hidden, 128, dtype=torch.float16)}
    for i in range(depth):
        w[f"double_blocks.{i}.img_attn.norm.query_norm.scale"] = torch.ones(128)
    for i in range(depth_single):
        w[f"single_blocks.{i}.norm.query_norm.scale"] = torch.ones(128)
    return w


def test_variant_is_named_from_the_shapes(folder):
    # A single file's variant comes from its shapes (what `describe` reports for BFL files).
    nine = infer_params(
        sanitize_flux2_klein_weights({k: mx.array(v.numpy()) for k, v in stand_in(4096, 8, 24).items()})
    )
    assert nine.describe() == "klein-9B (hidden 4096, 8 double / 24 single blocks)"
    four = infer_params(
        sanitize_flux2_klein_weights({k: mx.array(v.numpy()) for k, v in stand_in(3072, 5, 20).items()})
    )
    assert four.describe() == "klein-4B (hidden 3072, 5 double / 20 single blocks)"
    custom = FluxKleinParams.from_dict(json.loads((folder / "config.json").read_text()))
    assert custom.describe().startswith("a custom FLUX.2 transformer (hidden 48, 2 double / 2 single")


def test_flux1_checkpoints_rejected(tmp_path):
    bfl1 = {
        "img_in.weight": torch.zeros(3072, 64),
        "vector_in.in_layer.weight": torch.zeros(4, 4),
        "double_blocks.0.img_mod.lin.weight": torch.zeros(4, 4),
    }
    path = tmp_path / "flux1-dev.safetensors"
    save_file(bfl1, str(path))
    with pytest.raises(FluxKleinError, match=r"not a FLUX.2 \[klein\] checkpoint: it is a FLUX.1"):
        load_one("transformer", path)
    diffusers1 = {
        "x_embedder.weight": mx.zeros((3072, 64)),
        "time_text_embed.timestep_embedder.linear_1.weight": mx.zeros((4, 4)),
        "transformer_blocks.0.norm1.linear.weight": mx.zeros((4, 4)),
    }
    with pytest.raises(FluxKleinError, match=r"not a FLUX.2 \[klein\] checkpoint: it is a FLUX.1"):
        sanitize_flux2_klein_weights(diffusers1)
    with pytest.raises(FluxKleinError, match=r"FLUX.1"):
        sanitize_flux2_klein_weights({"img_in.weight": mx.zeros((3072, 64))})


def test_flux2_dev_rejected(tmp_path):
    w = dict(stand_in(6144, 8, 48), **{"guidance_in.in_layer.weight": torch.zeros(4, 4)})
    path = tmp_path / "flux2-dev.safetensors"
    save_file(w, str(path))
    with pytest.raises(FluxKleinError, match=r"not a klein checkpoint: it is FLUX.2-dev"):
        load_one("transformer", path)
    with pytest.raises(FluxKleinError, match=r"FLUX.2-dev"):
        sanitize_flux2_klein_weights({"time_guidance_embed.guidance_embedder.linear_1.weight": mx.zeros((4, 4))})
    # A diffusers snapshot is refused from its config alone, before any weight is read.
    qwen = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 28, "num_attention_heads": 2}
    root = config_snapshot(tmp_path / "dev", dict(CONFIG, guidance_embeds=True), qwen)
    with pytest.raises(FluxKleinError, match=r"FLUX.2-dev"):
        describe(root)


def test_not_a_transformer_file(tmp_path):
    path = tmp_path / "vae.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4)}, str(path))
    with pytest.raises(FluxKleinError, match=r"not a FLUX.2 \[klein\] transformer"):
        load_one("transformer", path)


def test_damaged_files_are_named(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(bfl_weights(), str(good))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(FluxKleinError, match=r"truncated\.safetensors is damaged"):
        load_one("transformer", truncated, dtype=mx.float32)
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a weight file\n")
    with pytest.raises(FluxKleinError, match=r"notes\.safetensors is damaged"):
        load_one("transformer", text)
    with pytest.raises(FluxKleinError, match=r"not found"):
        load_one("transformer", tmp_path / "absent.safetensors")


# --- configs --------------------------------------------------------------------------------------------


def test_params_from_real_configs():
    (_, four, *_), (_, nine, *_) = TWIN.released  # the released config.json files
    p4, p9 = FluxKleinParams.from_dict(four), FluxKleinParams.from_dict(nine)
    assert p4 == FluxKleinParams.klein_4b() and p4.variant == "klein-4b"
    assert p9 == FluxKleinParams.klein_9b() and p9.variant == "klein-9b"
    assert p4.head_dim == 128 and p4.mlp_hidden == 9216 and p9.mlp_hidden == 12288
    assert FluxKleinParams.from_dict(CONFIG).variant == "other"


def test_generate_takes_attention_in_chunks_past_the_score_limit(cli, snapshot, tmp_path, monkeypatch):
    """Issue 38: past MLX's CPU limit (a head's Lq·Lk reaching 2^31 crashed the process at 4096x4096)
    the queries go in chunks; the image is the one a single call gives. The limit is lowered here so
    a 128x128 image takes that path in seconds."""
    from command_line import gen_args
    from PIL import Image

    assert cli(*gen_args(snapshot, tmp_path / "whole.png", "-W", "128", "-H", "128"))[0] == 0
    monkeypatch.setattr(attention, "SCORE_LIMIT", 4096)  # B·H·Lk is 2·(512 + 64) here: 3 queries per call
    code, _, err = cli(*gen_args(snapshot, tmp_path / "chunked.png", "-W", "128", "-H", "128"))
    assert code == 0 and "Traceback" not in err, err
    whole, chunked = (np.asarray(Image.open(tmp_path / f), np.int16) for f in ("whole.png", "chunked.png"))
    assert whole.shape == (128, 128, 3) and np.abs(whole - chunked).max() <= 1  # float rounding at most
