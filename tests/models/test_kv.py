"""FLUX.2 [klein] 9B-KV: the reference K/V cache against diffusers' `Flux2KleinKVPipeline`.

The tiny KV snapshot is written by diffusers' own KV pipeline (`tiny_kv_model`). diffusers runs the
transformer with its KV attention processors in `kv_cache_mode="extract"` (references before the
target tokens, attending only to themselves, modulated at timestep 0) and `"cached"`; we run
`FluxKlein.reference_kv` + `forward_with_rope(..., reference_kv=...)`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from refs import diffusers_pipeline, load_one, noise, picture, rel_err, to_mx, to_np
from tiny_kv_model import shared_tiny_kv_snapshot
from tiny_model import LATENT_CHANNELS, QWEN_HIDDEN

from flux_klein_mlx.models.kv_cache import cache_nbytes
from flux_klein_mlx.models.rope import image_ids, text_ids

C = 4 * LATENT_CHANNELS  # transformer token channels
CTX = 3 * QWEN_HIDDEN
LT = 9  # text tokens: the model must not assume 512


@pytest.fixture(scope="module")
def kv_snapshot(tmp_path_factory):
    return shared_tiny_kv_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def kv_reference(kv_snapshot):
    """diffusers' KV pipeline (float32), whose constructor installs the KV attention processors."""
    return diffusers_pipeline(kv_snapshot, "kv")


@pytest.fixture(scope="module")
def kv_transformer(kv_snapshot):
    return load_one("transformer", kv_snapshot / "transformer", dtype=mx.float32)


def _inputs(grid, refs, seed=0):
    from diffusers import Flux2KleinKVPipeline as P

    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(1, LT, CTX, generator=g)
    img = torch.randn(1, grid[0] * grid[1], C, generator=g)
    ref = torch.randn(1, sum(h * w for h, w in refs), C, generator=g)
    ids = dict(
        txt=P._prepare_text_ids(txt),
        img=P._prepare_latent_ids(torch.zeros(1, C, *grid)),
        ref=P._prepare_image_ids([torch.zeros(1, C, h, w) for h, w in refs]),
    )
    return txt, img, ref, ids


@pytest.mark.parametrize("grid, refs", [((3, 5), [(4, 4)]), ((4, 3), [(2, 3), (5, 4)])])
def test_transformer_extract_and_cached_match_diffusers(kv_reference, kv_transformer, grid, refs):
    tr = kv_reference.transformer
    txt, img, ref, ids = _inputs(grid, refs, seed=len(refs))
    n_ref = ref.shape[1]
    t0, t1 = torch.tensor([1.0]), torch.tensor([0.45])
    with torch.no_grad():
        # diffusers' extract step: [refs ; target] tokens, references first
        v0, cache = tr(
            hidden_states=torch.cat([ref, img], 1),
            encoder_hidden_states=txt,
            timestep=t0,
            img_ids=torch.cat([ids["ref"], ids["img"]], 1),
            txt_ids=ids["txt"],
            return_dict=False,
            kv_cache_mode="extract",
            num_ref_tokens=n_ref,
        )
        v1 = tr(
            hidden_states=img,
            encoder_hidden_states=txt,
            timestep=t1,
            img_ids=ids["img"],
            txt_ids=ids["txt"],
            return_dict=False,
            kv_cache=cache,
            kv_cache_mode="cached",
        )[0]

    model = kv_transformer
    our_ref_ids = mx.concatenate([image_ids(h, w, t=10 * (k + 1)) for k, (h, w) in enumerate(refs)], axis=0)
    assert np.array_equal(np.array(our_ref_ids), ids["ref"][0].numpy())
    ours_cache = model.reference_kv(to_mx(ref), our_ref_ids)
    rope = model.compute_rope(text_ids(LT), image_ids(*grid))
    o0 = model.forward_with_rope(to_mx(img), to_mx(txt), to_mx(t0), rope, reference_kv=ours_cache)
    o1 = model.forward_with_rope(to_mx(img), to_mx(txt), to_mx(t1), rope, reference_kv=ours_cache)
    assert v0.shape == v1.shape == (1, img.shape[1], C) == o0.shape
    e0, e1 = rel_err(o0, v0), rel_err(o1, v1)
    assert e0 <= 1e-4 and e1 <= 1e-4, (e0, e1)
    # the cached keys/values, block by block: diffusers (B, Lr, H, hd), ours (B, H, Lr, hd)
    assert ours_cache.num_tokens == n_ref
    assert len(ours_cache.double) == len(cache.double_block_caches) and len(ours_cache.single) == len(
        cache.single_block_caches
    )
    theirs_kv = [(c.k_ref, c.v_ref) for c in cache.double_block_caches + cache.single_block_caches]
    worst = 0.0
    for (k, v), (tk, tv) in zip(ours_cache.double + ours_cache.single, theirs_kv, strict=True):
        worst = max(worst, rel_err(k.transpose(0, 2, 1, 3), tk), rel_err(v.transpose(0, 2, 1, 3), tv))
    assert worst <= 1e-4, worst
    # the cache really matters: without it the answer is different
    assert rel_err(model.forward_with_rope(to_mx(img), to_mx(txt), to_mx(t1), rope), v1) > 1e-2


def test_transformer_low_memory_reference_pass_is_the_same(kv_transformer):
    txt, img, ref, ids = _inputs((3, 4), [(4, 5)], seed=7)
    model = kv_transformer
    ref_ids = image_ids(4, 5, t=10)
    fast, slow = model.reference_kv(to_mx(ref), ref_ids), model.reference_kv(to_mx(ref), ref_ids, low_memory=True)
    for a, b in zip(fast.arrays(), slow.arrays(), strict=True):
        assert np.abs(to_np(a) - to_np(b)).max() <= 1e-5
    rope = model.compute_rope(text_ids(LT), image_ids(3, 4))
    args = (to_mx(img), to_mx(txt), mx.array([0.6]), rope)
    a = model.forward_with_rope(*args, reference_kv=fast)
    b = model.forward_with_rope(*args, reference_kv=slow, low_memory=True)
    assert np.abs(to_np(a) - to_np(b)).max() <= 1e-5
    assert fast.nbytes == (2 + 2) * 2 * 20 * 64 * 4  # blocks x (K, V) x tokens x hidden x float32
    assert fast.nbytes == cache_nbytes(2 + 2, 20, 64, bytes_per_value=4)
    # the README's memory row: klein-9B (8 + 24 blocks, hidden 4096), one 1024^2 reference, bf16
    assert cache_nbytes(8 + 24, 64 * 64, 4096) == 2_147_483_648


# --- the pipeline against diffusers' Flux2KleinKVPipeline ------------------------------------------------


@pytest.fixture(scope="module")
def kv_pipe(kv_snapshot):
    import flux_klein_mlx

    return flux_klein_mlx.load(kv_snapshot, dtype="float32")


@pytest.mark.parametrize(
    "images, size",
    [
        ([(100, 72, 1)], (64, 96)),  # one reference, cropped to 96x64 by both pipelines; output takes its size
        ([(64, 80, 2), (112, 64, 3)], (64, 64)),  # two references of different sizes
        ([], (64, 80)),  # no reference: runs like klein-9B
    ],
    ids=["one-reference", "two-references", "no-reference"],
)
def test_image_matches_diffusers_kv_pipeline(kv_reference, kv_pipe, images, size):
    refs = [picture(w, h, s) for w, h, s in images]
    h, w = size
    lat = noise(h, w, seed=len(refs))
    given = {} if len(refs) == 1 else dict(width=w, height=h)
    with torch.no_grad():
        theirs = kv_reference(
            image=refs or None,
            prompt="the cat in the room",
            num_inference_steps=4,
            output_type="np",
            latents=torch.from_numpy(lat),
            **given,
        ).images[0]
    ours = kv_pipe.generate("the cat in the room", images=refs, latents=lat, output_type="np", **given)
    assert ours.shape == theirs.shape == (h, w, 3)
    err = np.abs(ours - theirs).max()
    assert err <= 1e-3, err
    assert theirs.std() > 0.01  # a real image, not a constant
    stats = kv_pipe.last_stats
    assert (stats.reference_kv_bytes is not None) == bool(refs)


def test_kv_model_is_recognised_as_distilled(kv_pipe):
    info = kv_pipe.info
    assert info.reference_kv and info.is_distilled
    assert info.default_steps == 4 and info.default_guidance is None
    assert info.name == "FLUX.2 [klein] (custom size) KV"  # the tiny model has no table row
    lat = noise(64, 64)
    plain = kv_pipe.generate("x", latents=lat, width=64, height=64, output_type="np")
    with pytest.warns(UserWarning, match="negative_prompt is ignored"):
        neg = kv_pipe.generate("x", latents=lat, width=64, height=64, negative_prompt="blurry", output_type="np")
    assert np.array_equal(plain, neg)


def test_variant_table_row():
    from flux_klein_mlx.models.flux2.config import (
        KV_PIPELINE_CLASS,
        PIPELINE_CLASSES,
        VARIANTS,
        FluxKleinParams,
        variant_for,
    )

    row = VARIANTS["klein-9b-kv"]
    assert row.reference_kv and row.distilled and row.steps == 4 and row.guidance is None
    assert row.pipeline_class == KV_PIPELINE_CLASS and KV_PIPELINE_CLASS in PIPELINE_CLASSES
    assert row.transformer.shape_key() == FluxKleinParams.klein_9b().shape_key()
    assert variant_for(FluxKleinParams.klein_9b(), True, reference_kv=True).title == "FLUX.2 [klein] 9B-KV"
    assert variant_for(FluxKleinParams.klein_9b(), True).name == "klein-9b"  # plain klein-9B stays plain
    assert not any(v.reference_kv for k, v in VARIANTS.items() if k != "klein-9b-kv")


def test_other_pipeline_classes_are_still_refused(kv_snapshot, tmp_path):
    import json
    import shutil

    import flux_klein_mlx
    from flux_klein_mlx.errors import FluxKleinError

    folder = tmp_path / "snap"
    shutil.copytree(kv_snapshot, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(index | {"_class_name": "Flux2KVPipeline"}))
    with pytest.raises(FluxKleinError, match="holds a Flux2KVPipeline model"):
        flux_klein_mlx.load(folder)


class _Spy:
    """Counts `reference_kv` calls and records which cache each forward received."""

    def __init__(self, monkeypatch):
        from flux_klein_mlx.models.flux2.transformer import FluxKlein

        self.extracts, self.forwards = 0, []
        real_ref, real_fwd = FluxKlein.reference_kv, FluxKlein.forward_with_rope

        def reference_kv(model, *a, **k):
            self.extracts += 1
            return real_ref(model, *a, **k)

        def forward_with_rope(model, img, *a, **k):
            self.forwards.append((img.shape[1], k.get("reference_kv")))
            return real_fwd(model, img, *a, **k)

        monkeypatch.setattr(FluxKlein, "reference_kv", reference_kv)
        monkeypatch.setattr(FluxKlein, "forward_with_rope", forward_with_rope)


def test_cache_lives_for_one_image(kv_pipe, monkeypatch):
    spy = _Spy(monkeypatch)
    ref = picture(64, 64, 5)
    a = kv_pipe.generate("x", images=[ref], seed=1, output_type="np")
    b = kv_pipe.generate("x", images=[ref], seed=1, output_type="np")
    assert np.array_equal(a, b)  # seeds reproduce
    assert spy.extracts == 2  # one reference pass per image, never reused across images
    assert [n for n, _ in spy.forwards] == [16] * 8  # the references never enter the sequence
    caches = [c for _, c in spy.forwards]
    assert all(c is caches[0] for c in caches[:4]) and all(c is caches[4] for c in caches[4:])
    assert caches[0] is not caches[4]
    held = [v for v in vars(kv_pipe).values() if type(v).__name__ == "ReferenceKV"]
    assert not held
    assert kv_pipe.last_stats.reference_kv_bytes == (2 + 2) * 2 * 16 * 64 * 4


def test_plain_klein_never_caches(tmp_path_factory, monkeypatch):
    from tiny_model import shared_tiny_snapshot

    import flux_klein_mlx

    pipe = flux_klein_mlx.load(shared_tiny_snapshot(tmp_path_factory, distilled=True), dtype="float32")
    assert not pipe.info.reference_kv
    spy = _Spy(monkeypatch)
    pipe.generate("x", images=[picture(64, 64, 5)], seed=1, output_type="np")
    assert spy.extracts == 0
    assert [n for n, _ in spy.forwards] == [32] * 4  # [target ; reference] tokens every step
    assert all(c is None for _, c in spy.forwards)
    assert pipe.last_stats.reference_kv_bytes is None


def test_low_memory_kv_gives_the_same_image(kv_snapshot, kv_pipe):
    import flux_klein_mlx

    lat, ref = noise(64, 64), picture(64, 64, 6)
    a = kv_pipe.generate("x", images=[ref], latents=lat, output_type="np")
    b = flux_klein_mlx.load(kv_snapshot, dtype="float32", low_memory=True).generate(
        "x", images=[ref], latents=lat, output_type="np"
    )
    assert np.abs(a - b).max() <= 1e-5


# --- quantization and converted folders ---------------------------------------------------------------------


def test_converted_and_quantized_kv_folders_keep_the_kv_identity(kv_snapshot, kv_pipe, tmp_path):
    import json

    import flux_klein_mlx
    from flux_klein_mlx.convert import convert_model, quantize_folder

    lat, ref = noise(64, 64), picture(80, 64, 7)
    # 2 steps: the extract step and a cached one
    run = dict(images=[ref], latents=lat, width=64, height=64, steps=2, output_type="np")
    want = kv_pipe.generate("a boat", **run)
    out = tmp_path / "kv-mlx"
    convert_model(kv_snapshot, out, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["reference_kv"] is True and config["is_distilled"] is True
    pipe = flux_klein_mlx.load(out, dtype="float32")
    assert pipe.info.reference_kv and pipe.info.is_distilled
    got = pipe.generate("a boat", **run)
    assert np.abs(got - want).max() <= 1e-5

    q4 = tmp_path / "kv-q4"
    quantize_folder(out, q4, bits=4)
    config = json.loads((q4 / "config.json").read_text())
    assert config["reference_kv"] is True and config["is_distilled"] is True
    assert config["transformer"]["quantization"]["bits"] == 4
    pipe = flux_klein_mlx.load(q4, dtype="float32")
    assert pipe.info.reference_kv
    got = pipe.generate("a boat", **run)
    assert pipe.last_stats.reference_kv_bytes is not None
    assert 0 < np.abs(got - want).max() <= 0.5


def test_quantize_at_load_kv_bf16_stays_close(kv_snapshot, kv_pipe):
    """4-bit weights and bf16 activations (what a Mac runs) against the float32 image."""
    import flux_klein_mlx

    lat, ref = noise(64, 64), picture(64, 64, 8)
    run = dict(images=[ref], latents=lat, steps=2, output_type="np")  # 2 steps: the extract one and a cached one
    want = kv_pipe.generate("a boat", **run)
    pipe = flux_klein_mlx.load(kv_snapshot, dtype="bfloat16", quantize=4)
    got = pipe.generate("a boat", **run)
    assert pipe.info.reference_kv and pipe.quantization["bits"] == 4
    assert pipe.last_stats.reference_kv_bytes is not None
    err = np.abs(got - want).max()
    assert 0 < err <= 0.5, err


# --- the benchmark: first (extract) step and cached steps apart --------------------------------------------


def _tiny_variant(kv: bool):
    import dataclasses

    from flux_klein_mlx.models.config import AutoEncoderConfig, Qwen3Config
    from flux_klein_mlx.models.flux2.config import VARIANTS, FluxKleinParams

    return dataclasses.replace(
        VARIANTS["klein-9b-kv" if kv else "klein-9b"],
        name="tiny",
        transformer=FluxKleinParams(
            hidden_size=64, num_heads=2, axes_dim=(8,) * 4, depth=1, depth_single=1, context_in_dim=96
        ),
        text_encoder=Qwen3Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=27,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rope_theta=1e6,
            vocab_size=1000,
        ),
        vae=AutoEncoderConfig(block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=32),
    )


def test_benchmark_reports_the_kv_first_and_cached_steps_apart():
    from flux_klein_mlx.bench import command as bm
    from flux_klein_mlx.bench import flops
    from flux_klein_mlx.bench.random_model import random_pipeline

    row = _tiny_variant(kv=True)
    r = bm.run_benchmark(
        random_pipeline(row),
        width=64,
        height=64,
        steps=3,
        warmup=0,
        trials=2,
        text_encoder=False,
        decode=False,
        references=1,
    )
    c, st = r["config"], r["stages"]
    assert c["reference_kv"] and c["references"] == 1 and c["reference_tokens"] == 16 and c["blocks"] == "1+1"
    assert len(st["kv_reference_pass"]["times_s"]) == 2  # one reference pass per image
    assert len(st["kv_first_step"]["times_s"]) == 2 and len(st["kv_cached_step"]["times_s"]) == 2 * 2
    p = row.transformer
    cached = flops.flops_of_transformer(
        p, width=64, height=64, text_tokens=512, reference_tokens=16, cached_references=True
    ).total
    ref_pass = flops.reference_pass_flops(p, 16).total
    assert st["kv_cached_step"]["tflop"] == pytest.approx(cached / 1e12)
    assert st["kv_first_step"]["tflop"] == pytest.approx((cached + ref_pass) / 1e12)
    assert st["denoise"]["tflop"] == pytest.approx((3 * cached + ref_pass) / 1e12)
    assert st["kv_reference_pass"]["cache_gb"] == pytest.approx(2 * 2 * 16 * 64 * 4 / 1e9)
    table = bm.format_report(r)
    for label in ("KV reference pass", "KV first step", "KV cached step", "reference K/V cached"):
        assert label in table

    # plain klein-9B with the same reference: every step alike, the reference in the sequence
    r = bm.run_benchmark(
        random_pipeline(_tiny_variant(kv=False)),
        width=64,
        height=64,
        steps=2,
        warmup=0,
        trials=1,
        text_encoder=False,
        decode=False,
        references=1,
    )
    assert not r["config"]["reference_kv"] and not any(k.startswith("kv_") for k in r["stages"])
    uncached = flops.flops_of_transformer(p, width=64, height=64, text_tokens=512, reference_tokens=16).total
    assert r["stages"]["denoise_step"]["tflop"] == pytest.approx(uncached / 1e12)


def test_kv_flop_model():
    from flux_klein_mlx.bench import flops
    from flux_klein_mlx.models.flux2.config import FluxKleinParams

    p = FluxKleinParams.klein_9b()
    plain = flops.flops_of_transformer(p, width=1024, height=1024)
    uncached = flops.flops_of_transformer(p, width=1024, height=1024, text_tokens=512, reference_tokens=4096)
    cached = flops.flops_of_transformer(
        p, width=1024, height=1024, text_tokens=512, reference_tokens=4096, cached_references=True
    )
    # cached: the blocks see 512 + 4096 queries (as without references) against 512 + 8192 keys
    assert cached.linear == plain.linear and cached.attention == pytest.approx(plain.attention * 8704 / 4608)
    assert cached.linear / uncached.linear == pytest.approx(4608 / 8704)
    assert cached.attention / uncached.attention == pytest.approx(4608 / 8704)
    ref = flops.reference_pass_flops(p, 4096)
    assert ref.attention == pytest.approx(32 * 4 * 4096**2 * 4096)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--random-weights", "--blocks", "1x2"], "--blocks must be DOUBLE+SINGLE"),
        (["--random-weights", "--blocks", "0+0"], "--blocks must be DOUBLE+SINGLE"),
        (["--random-weights", "--blocks", "1+a"], "--blocks must be DOUBLE+SINGLE"),
        (["--model", "x", "--blocks", "1+1"], "--blocks only applies to --random-weights"),
        (["--random-weights", "--references", "-1"], "--references"),
        (["--random-weights", "--references", "11"], "--references"),
    ],
)
def test_benchmark_bad_kv_options_are_one_line_errors(args, message, capsys):
    from flux_klein_mlx.bench import command as bm

    assert bm.main(args) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_cli_edits_with_the_kv_model(kv_snapshot, tmp_path, capsys):
    import json

    from PIL import Image

    from flux_klein_mlx import generate

    ref = tmp_path / "ref.png"
    picture(80, 64, 9).save(ref)
    out = tmp_path / "edit.png"
    code = generate.main(
        [
            "--model",
            str(kv_snapshot),
            "-p",
            "make it blue",
            "--image",
            str(ref),
            "--seed",
            "1",
            "--dtype",
            "float32",
            "--negative-prompt",
            "blurry",
            "-o",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "negative_prompt is ignored" in captured.err
    with Image.open(out) as im:
        meta = json.loads(im.text["flux_klein_mlx"])
        assert im.size == (80, 64) and meta["variant"].endswith("KV") and meta["steps"] == 4


# --- LoRAs ---------------------------------------------------------------------------------------------------


def _peft_lora(path, D=64, M=192, r=4, seed=11):
    """A PEFT/diffusers-named LoRA on attention, MLP and single-block layers of the tiny transformer."""
    import json
    import math

    from safetensors.torch import save_file

    shapes = {
        "transformer_blocks.0.attn.to_q": (D, D),
        "transformer_blocks.0.attn.to_k": (D, D),
        "transformer_blocks.0.attn.to_v": (D, D),
        "transformer_blocks.1.attn.add_k_proj": (D, D),
        "transformer_blocks.0.attn.to_out.0": (D, D),
        "transformer_blocks.1.ff.linear_in": (2 * M, D),
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj": (3 * D + 2 * M, D),
        "single_transformer_blocks.1.attn.to_out": (D, D + M),
        "double_stream_modulation_img.linear": (6 * D, D),
        "single_stream_modulation.linear": (3 * D, D),
    }
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out, inp) in shapes.items():
        sd[f"transformer.{name}.lora_A.weight"] = torch.randn(r, inp, generator=g) / math.sqrt(inp)
        sd[f"transformer.{name}.lora_B.weight"] = 0.5 * torch.randn(out, r, generator=g) / math.sqrt(r)
    meta = {"transformer.r": r, "transformer.lora_alpha": 8.0, "transformer.target_modules": sorted(shapes)}
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(meta)})
    return path


def test_lora_on_the_kv_model_matches_diffusers(kv_snapshot, tmp_path):
    """A LoRA also changes the reference pass (its K/V come from the adapted weights), as in diffusers."""
    from diffusers import Flux2KleinKVPipeline

    import flux_klein_mlx

    lora = _peft_lora(tmp_path / "lora.safetensors")
    lat, ref = noise(64, 64), picture(64, 64, 10)
    theirs_pipe = Flux2KleinKVPipeline.from_pretrained(kv_snapshot, dtype=torch.float32)
    theirs_pipe.set_progress_bar_config(disable=True)
    theirs_pipe.load_lora_weights(str(lora), adapter_name="l0")
    with torch.no_grad():
        theirs = theirs_pipe(
            image=[ref], prompt="a boat", num_inference_steps=4, output_type="np", latents=torch.from_numpy(lat)
        ).images[0]
    pipe = flux_klein_mlx.load(kv_snapshot, dtype="float32", loras=[lora])
    ours = pipe.generate("a boat", images=[ref], latents=lat, output_type="np")
    assert pipe.last_stats.reference_kv_bytes is not None
    err = np.abs(ours - theirs).max()
    assert err <= 1e-3, err
    pipe.set_loras([])
    plain = pipe.generate("a boat", images=[ref], latents=lat, output_type="np")
    assert np.abs(plain - theirs).max() > 1e-2  # the LoRA mattered
