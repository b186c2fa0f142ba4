"""FLUX.2 [klein]'s own LoRA namings on the tiny klein snapshot: every format against diffusers' own LoRA loading,
other Mac trainers' files, LoKr against a numpy delta, the quantized side path (low memory's row blocks included)
against the fused float path, and every refusal. What both families share through the pipeline (two LoRAs at
once, quantized, unfusing, low memory, `generate --lora`, `convert --lora`) is tests/lora/test_lora_pipeline.py's.

The LoRA files are random and written here in each format's exact key layout. diffusers
(`Flux2KleinPipeline.load_lora_weights` + `set_adapters`) is the judge, except where it is known
wrong or silent: its Flux2 converter maps BFL `final_layer.adaLN_modulation.1` onto `norm_out.linear`
without swapping the shift/scale halves, and its kohya converter drops the modulation layers; those
updates are merged into the reference's weights here, by hand, in diffusers' row order.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from refs import diffusers_image, diffusers_pipeline_for_loras, diffusers_prompt_embeds, rel_err
from safetensors.torch import save_file
from tiny_loras import LORAS, Rand, swap_halves
from tiny_model import LATENT_CHANNELS, TRANSFORMER

import flux_klein_mlx
from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.lora.apply import apply_loras, load_loras, remove_loras
from flux_klein_mlx.lora.layers import LoRALinear
from flux_klein_mlx.models.flux2.config import FluxKleinParams
from flux_klein_mlx.models.quantize import dequantize_model

C = 4 * LATENT_CHANNELS
PARAMS = FluxKleinParams.from_dict(TRANSFORMER)
D, M = PARAMS.hidden_size, PARAMS.mlp_hidden  # 64, 192
H, W = 64, 64
STEPS = 2
PROMPT = "a lighthouse at dusk"


@pytest.fixture(scope="module")
def ref_pipe(snapshot):
    """One diffusers pipeline for the module (the session's components, a transformer of its own), its prompt
    encoded once; each reference runs on a fresh copy of its transformer. Images are memoised by the bytes of the
    LoRA files and the merges."""
    pipe = diffusers_pipeline_for_loras(snapshot)
    return pipe, copy.deepcopy(pipe.transformer), diffusers_prompt_embeds(pipe, PROMPT), {}


@pytest.fixture(scope="module")
def our_pipe(snapshot):
    """One pipeline for the module (its prompt embeddings cached); tests change LoRAs with set_loras."""
    return flux_klein_mlx.load(snapshot, dtype="float32")


@pytest.fixture(scope="module")
def lat():
    return np.random.default_rng(5).standard_normal((1, C, H // 16, W // 16)).astype(np.float32)


# --- the reference --------------------------------------------------------------------------------------


def reference(ref_pipe, lat, files=(), weights=None, merge=()):
    """diffusers' image with `files` loaded as adapters (and `set_adapters(weights)`), plus `merge`:
    (diffusers module, delta in diffusers' row order) added to the base weights first."""
    import hashlib

    pipe, base, embeds, memo = ref_pipe
    key = hashlib.sha256(repr(weights).encode())
    for f in files:
        key.update(f.read_bytes())
    for m, d in merge:
        key.update(m.encode() + np.ascontiguousarray(d, np.float32).tobytes())
    key = key.hexdigest()
    if key in memo:
        return memo[key]
    pipe.transformer = copy.deepcopy(base)
    with torch.no_grad():
        for module, delta in merge:
            pipe.transformer.get_submodule(module).weight += torch.as_tensor(delta, dtype=torch.float32)
    names = [f"l{i}" for i in range(len(files))]
    for f, name in zip(files, names, strict=True):
        pipe.load_lora_weights(str(f), adapter_name=name)
    if weights is not None:
        pipe.set_adapters(names, weights)
    memo[key] = diffusers_image(pipe, embeds, lat, H, STEPS)
    return memo[key]


def ours(pipe, lat, loras):
    pipe.set_loras(loras)
    return pipe.generate(PROMPT, width=W, height=H, steps=STEPS, latents=lat, output_type="np"), pipe


# --- LoRA files in each format --------------------------------------------------------------------------


def lora_a(path, rng, *, bare=False, r=4, alpha=8.0):
    """diffusers/PEFT names, alpha from `lora_adapter_metadata`; q/k/v split, fused single projection, globals."""
    shapes = {
        "transformer_blocks.0.attn.to_q": (D, D),
        "transformer_blocks.0.attn.to_k": (D, D),
        "transformer_blocks.0.attn.to_v": (D, D),
        "transformer_blocks.1.attn.add_k_proj": (D, D),
        "transformer_blocks.0.attn.to_out.0": (D, D),
        "transformer_blocks.1.attn.to_add_out": (D, D),
        "transformer_blocks.0.ff.linear_in": (2 * M, D),
        "transformer_blocks.1.ff_context.linear_out": (D, M),
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj": (3 * D + 2 * M, D),
        "single_transformer_blocks.1.attn.to_out": (D, D + M),
        "x_embedder": (D, C),
        "context_embedder": (D, 3 * 32),
        "time_guidance_embed.timestep_embedder.linear_1": (D, 256),
        "double_stream_modulation_img.linear": (6 * D, D),
        "single_stream_modulation.linear": (3 * D, D),
        "norm_out.linear": (2 * D, D),
        "proj_out": (C, D),
    }
    sd = {}
    for name, (out, inp) in shapes.items():
        down, up = rng.pair(out, inp, r)
        key = name if bare else f"transformer.{name}"
        suffix = ".default.weight" if bare else ".weight"
        sd[f"{key}.lora_A{suffix}"], sd[f"{key}.lora_B{suffix}"] = down, up
    prefix = "" if bare else "transformer."
    meta = {f"{prefix}r": r, f"{prefix}lora_alpha": alpha, f"{prefix}target_modules": sorted(shapes)}
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(meta)})
    return path


def bfl_modules():
    """BFL module -> (out, in, rank): fused qkv with ranks 6 (divisible by 3, dense up) and 3, globals."""
    return {
        "double_blocks.0.img_attn.qkv": (3 * D, D, 6),
        "double_blocks.1.txt_attn.qkv": (3 * D, D, 3),
        "double_blocks.0.txt_attn.proj": (D, D, 4),
        "double_blocks.1.img_mlp.0": (2 * M, D, 4),
        "double_blocks.0.txt_mlp.2": (D, M, 4),
        "single_blocks.0.linear1": (3 * D + 2 * M, D, 5),
        "single_blocks.1.linear2": (D, D + M, 4),
        "img_in": (D, C, 4),
        "txt_in": (D, 96, 4),
        "time_in.in_layer": (D, 256, 4),
        "time_in.out_layer": (D, D, 2),
        "double_stream_modulation_txt.lin": (6 * D, D, 4),
        "single_stream_modulation.lin": (3 * D, D, 4),
        "final_layer.linear": (C, D, 4),
        "final_layer.adaLN_modulation.1": (2 * D, D, 4),
    }


def lora_bfl(path, rng, *, prefix="diffusion_model.", names=("lora_A", "lora_B"), skip=()):
    """BFL names (B: `diffusion_model.`, C: `base_model.model.`, bare: ""); alpha = rank (no alpha keys).
    Returns {module: (down, up)} so a test can skip modules for the reference."""
    factors = {}
    sd = {}
    for name, (out, inp, r) in bfl_modules().items():
        down, up = rng.pair(out, inp, r)
        factors[name] = (down, up)
        if name in skip:
            continue
        sd[f"{prefix}{name}.{names[0]}.weight"], sd[f"{prefix}{name}.{names[1]}.weight"] = down, up
    save_file(sd, str(path))
    return factors


def lora_kohya(path, rng):
    """kohya/musubi: underscore names, `.alpha` keys (1.0 = musubi's default), block-diagonal and dense fused qkv.
    Returns the updates diffusers' kohya converter drops, as (diffusers module, delta in its row order)."""
    sd = {}
    dropped = []

    def put(name, down, up, alpha=None):
        sd[f"lora_unet_{name}.lora_down.weight"], sd[f"lora_unet_{name}.lora_up.weight"] = down, up
        if alpha is not None:
            sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)

    # rank 6, up block-diagonal (diffusers splits the down matrix in three)
    down, up = rng.pair(3 * D, D, 6)
    mask = torch.zeros(3 * D, 6)
    for j in range(3):
        mask[j * D : (j + 1) * D, 2 * j : 2 * j + 2] = 1
    put("double_blocks_0_img_attn_qkv", down, up * mask, alpha=1.0)
    put("double_blocks_1_img_attn_qkv", *rng.pair(3 * D, D, 6), alpha=3.0)  # rank 6, dense up
    put("double_blocks_0_txt_attn_qkv", *rng.pair(3 * D, D, 4))  # no alpha: alpha = rank
    put("double_blocks_1_txt_attn_proj", *rng.pair(D, D, 4), alpha=2.0)
    put("double_blocks_0_img_mlp_0", *rng.pair(2 * M, D, 4), alpha=1.0)
    put("double_blocks_1_txt_mlp_2", *rng.pair(D, M, 4), alpha=8.0)
    put("single_blocks_0_linear1", *rng.pair(3 * D + 2 * M, D, 4), alpha=1.0)
    put("single_blocks_1_linear2", *rng.pair(D, D + M, 4), alpha=4.0)
    put("img_in", *rng.pair(D, C, 4), alpha=2.0)
    put("time_in_in_layer", *rng.pair(D, 256, 4), alpha=4.0)
    put("final_layer_linear", *rng.pair(C, D, 4), alpha=1.0)
    # Not converted by diffusers: merged into the reference by hand.
    down, up = rng.pair(6 * D, D, 4)
    put("double_stream_modulation_img_lin", down, up, alpha=2.0)
    dropped.append(("double_stream_modulation_img.linear", (up @ down).numpy() * 2.0 / 4))
    save_file(sd, str(path))
    return dropped


def single_split_file(path, rng):
    """diffusers-style separate k and MLP-in LoRAs for a single block (diffusers' klein model has only the fused
    `to_qkv_mlp_proj`, so the judge is numpy): rows D..2D and 3D..3D+2M of our fused linear1. No metadata:
    alpha = rank. Returns {our layer: delta}."""
    sd, delta = {}, np.zeros(_shape("single_blocks.0.linear1"), np.float32)
    for name, rows, r in (("attn.to_k", (D, 2 * D), 3), ("proj_mlp", (3 * D, 3 * D + 2 * M), 5)):
        down, up = rng.pair(rows[1] - rows[0], D, r)
        sd[f"transformer.single_transformer_blocks.0.{name}.lora_A.weight"] = down
        sd[f"transformer.single_transformer_blocks.0.{name}.lora_B.weight"] = up
        delta[rows[0] : rows[1]] += (up @ down).numpy()
    save_file(sd, str(path))
    return {"single_blocks.0.linear1": delta}


def _shape(layer):
    from flux_klein_mlx.models.flux2.transformer import linear_shapes

    return linear_shapes(PARAMS)[layer]


# --- parity with diffusers ------------------------------------------------------------------------------


def check(ours_img, theirs, base=None):
    err = float(np.abs(ours_img - theirs).max())
    print(f"max abs vs diffusers {err:.2e}")
    assert err <= 1e-3, err
    if base is not None:  # the LoRA changed the image: the comparison is not vacuous
        assert np.abs(theirs - base).max() > 0.02


@pytest.fixture(scope="module")
def base_image(ref_pipe, lat):
    return reference(ref_pipe, lat)


@pytest.mark.parametrize("bare", [False, True], ids=["prefixed", "bare-default"])
def test_format_a_peft_matches_diffusers(ref_pipe, our_pipe, lat, tmp_path, base_image, bare):
    """q/k/v onto our fused qkv, the fused single projection, norm_out (row order), alpha 8 != rank 4 from metadata.
    diffusers loads nothing from bare keys, so its reference is the prefixed twin of the same factors."""
    f = lora_a(tmp_path / "a.safetensors", Rand(1), bare=bare)
    twin = lora_a(tmp_path / "twin.safetensors", Rand(1)) if bare else f
    img, pipe = ours(our_pipe, lat, [f])
    assert pipe.loras[0].format == "diffusers"
    check(img, reference(ref_pipe, lat, [twin]), base_image)


@pytest.mark.parametrize(
    "prefix, names",
    [
        ("diffusion_model.", ("lora_A", "lora_B")),
        ("", ("lora_down", "lora_up")),
        ("base_model.model.", ("lora_A", "lora_B")),
    ],
    ids=["B-prefixed", "B-bare-down-up", "C-peft-wrapped"],
)
def test_bfl_names_match_diffusers_with_final_layer_swapped_right(
    ref_pipe, our_pipe, lat, tmp_path, base_image, prefix, names
):
    """B and C: fused-qkv ranks 6 (dense up) and 3, single linear1/linear2, every global. The final layer's
    modulation goes into the reference by hand (diffusers' converter forgets the swap), as does the whole
    LoRA for bare down/up keys (diffusers loads nothing from them: its reference is the prefixed twin)."""
    f = tmp_path / "b.safetensors"
    factors = lora_bfl(f, Rand(2), prefix=prefix, names=names)
    ref_file = tmp_path / "ref.safetensors"
    final = "final_layer.adaLN_modulation.1"
    lora_bfl(ref_file, Rand(2), prefix="diffusion_model." if prefix == "" else prefix, skip=(final,))
    down, up = factors[final]
    delta = (up @ down).numpy()  # BFL rows [shift; scale], alpha = rank
    img, pipe = ours(our_pipe, lat, [f])
    assert pipe.loras[0].format == ("peft_bfl" if prefix.startswith("base_model") else "bfl")
    check(img, reference(ref_pipe, lat, [ref_file], merge=[("norm_out.linear", swap_halves(delta))]), base_image)


def test_kohya_matches_diffusers(ref_pipe, our_pipe, lat, tmp_path, base_image):
    """D: `.alpha` (1.0 as musubi writes it, and others) and alpha = rank without; a rank-6 fused qkv with a
    block-diagonal up matrix and one with a dense up matrix; the modulation diffusers drops is merged by hand."""
    f = tmp_path / "kohya.safetensors"
    dropped = lora_kohya(f, Rand(3))
    img, pipe = ours(our_pipe, lat, [f])
    assert pipe.loras[0].format == "kohya"
    check(img, reference(ref_pipe, lat, [f], merge=dropped), base_image)


# --- files other Mac trainers write ----------------------------------------------------------------------


def with_twin(theirs, rng, prefix):
    """Rank-4 factors under a trainer's names (`prefix` + name) and the same factors under diffusers' names."""
    sd, twin = {}, {}
    for name, (diffusers_name, out, inp) in theirs.items():
        down, up = rng.pair(out, inp, 4)
        sd[f"{prefix}{name}.lora_A.weight"], sd[f"{prefix}{name}.lora_B.weight"] = down, up
        twin[f"transformer.{diffusers_name}.lora_A.weight"], twin[f"transformer.{diffusers_name}.lora_B.weight"] = (
            down,
            up,
        )
    return sd, twin


def mflux_file(path, rng):
    """mflux's `save_lora_adapter`: `transformer.` + mflux's own module paths (double-block `attn.to_out` without
    diffusers' `.0`, `time_guidance_embed.linear_1`), lora_A (r, in) / lora_B (out, r) after its transpose, no
    alpha (its LoRALinear scale is 1: alpha = rank), written by `mx.save_safetensors` with its metadata.
    Returns the diffusers name of each module, for the twin diffusers loads."""
    theirs = {
        "transformer_blocks.0.attn.to_out": ("transformer_blocks.0.attn.to_out.0", D, D),
        "transformer_blocks.1.attn.to_q": ("transformer_blocks.1.attn.to_q", D, D),
        "transformer_blocks.0.ff.linear_in": ("transformer_blocks.0.ff.linear_in", 2 * M, D),
        "time_guidance_embed.linear_1": ("time_guidance_embed.timestep_embedder.linear_1", D, 256),
        "norm_out.linear": ("norm_out.linear", 2 * D, D),
        "single_transformer_blocks.1.attn.to_qkv_mlp_proj": (
            "single_transformer_blocks.1.attn.to_qkv_mlp_proj",
            3 * D + 2 * M,
            D,
        ),
    }
    sd, twin = with_twin(theirs, rng, "transformer.")
    mx.save_safetensors(
        str(path),
        {k: mx.array(v.numpy()) for k, v in sd.items()},
        metadata={"mflux_version": "0.17.0", "model": "flux2-klein-4b"},
    )
    return twin, {}


def swift_file(path, rng):
    """flux-2-swift-mlx's `getLoRAParameters` + `saveLoRAWeights`: no prefix, `ff.activation.proj` for linear_in,
    single `attn.to_qkv_mlp`, and alpha / rank as top-level metadata (its scale is lora_alpha / lora_rank)."""
    theirs = {
        "transformer_blocks.0.attn.to_k": ("transformer_blocks.0.attn.to_k", D, D),
        "transformer_blocks.1.attn.to_out.0": ("transformer_blocks.1.attn.to_out.0", D, D),
        "transformer_blocks.1.ff.activation.proj": ("transformer_blocks.1.ff.linear_in", 2 * M, D),
        "transformer_blocks.0.ff_context.activation.proj": ("transformer_blocks.0.ff_context.linear_in", 2 * M, D),
        "single_transformer_blocks.0.attn.to_qkv_mlp": (
            "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
            3 * D + 2 * M,
            D,
        ),
        "single_transformer_blocks.1.attn.to_out": ("single_transformer_blocks.1.attn.to_out", D, D + M),
    }
    sd, twin = with_twin(theirs, rng, "")
    save_file(
        sd,
        str(path),
        metadata={"lora_rank": "4", "lora_alpha": "6.0", "format": "diffusers", "software": "flux2-swift-mlx"},
    )
    config = {
        "transformer.r": 4,
        "transformer.lora_alpha": 6.0,
        "transformer.target_modules": sorted(d for d, _, _ in theirs.values()),
    }
    return twin, {"lora_adapter_metadata": json.dumps(config)}


def lycoris_file(path, rng):
    """SimpleTuner's LyCORIS LoKr: `lycoris_` + diffusers paths with underscores, whole and decomposed factors
    (shaped as LyCORIS factorises with factor 4, so that diffusers can rebuild its config), `.alpha` (scaling
    only decomposed factors). diffusers reads this file itself: no twin."""
    sd = {}
    w = "lycoris_transformer_blocks_0_attn_to_q"
    sd |= {f"{w}.lokr_w1": rng.mat(4, 4), f"{w}.lokr_w2": rng.mat(16, 16, s=0.1), f"{w}.alpha": torch.tensor(3.0)}
    w = "lycoris_transformer_blocks_1_ff_linear_in"
    sd |= {
        f"{w}.lokr_w1": rng.mat(4, 4),
        f"{w}.lokr_w2_a": rng.mat(96, 2, s=0.3),
        f"{w}.lokr_w2_b": rng.mat(2, 16, s=0.3),
        f"{w}.alpha": torch.tensor(4.0),
    }
    w = "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj"
    sd |= {f"{w}.lokr_w1": rng.mat(4, 4), f"{w}.lokr_w2": rng.mat(144, 16, s=0.1)}
    save_file(sd, str(path))
    return None, {}


@pytest.mark.parametrize("writer", [mflux_file, swift_file, lycoris_file], ids=["mflux", "flux-2-swift-mlx", "lycoris"])
def test_other_mac_trainers_files_match_diffusers(ref_pipe, our_pipe, lat, tmp_path, base_image, writer):
    """mflux and flux-2-swift-mlx files are judged by diffusers loading their diffusers-named twin (same factors,
    alpha in PEFT's metadata), which is what those names mean in the trainers' own models; SimpleTuner's LyCORIS
    LoKr is loaded by diffusers itself."""
    f = tmp_path / "theirs.safetensors"
    twin, meta = writer(f, Rand(20))
    ref_file = f
    if twin is not None:
        ref_file = tmp_path / "twin.safetensors"
        save_file({k: v.contiguous() for k, v in twin.items()}, str(ref_file), metadata=meta or None)
    img, pipe = ours(our_pipe, lat, [f])
    assert pipe.loras[0].format == ("lokr" if writer is lycoris_file else "diffusers")
    check(img, reference(ref_pipe, lat, [ref_file]), base_image)


def test_single_block_split_loras_land_on_their_rows(our_pipe, tmp_path):
    """E: separate k / MLP-in LoRAs of a single block land on their rows of linear1 (set_loras at scale 0.5);
    LoKr's kron deltas are tests/lora/test_lora_transformer.py's, for both families."""
    f = tmp_path / "single-split.safetensors"
    expected = single_split_file(f, Rand(6))
    pipe = our_pipe
    pipe.set_loras([])
    model = pipe.component("transformer")
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    pipe.set_loras([(f, 0.5)])
    assert pipe.loras[0].format == "diffusers"
    after = dict(tree_flatten(model.parameters()))
    worst = 0.0
    for k, b in before.items():
        want = b + 0.5 * expected[k[: -len(".weight")]] if k[: -len(".weight")] in expected else b
        worst = max(worst, float(np.abs(np.array(after[k]) - want).max()))
    print(f"single-split fused vs numpy delta: max abs {worst:.2e}")
    assert worst <= 1e-5


# --- quantized side path, unfusing ------------------------------------------------------------------------


@pytest.mark.parametrize("bits, tolerance", [(8, 0.05), (4, 0.5)])
def test_quantized_side_path(snapshot, our_pipe, lat, tmp_path, bits, tolerance):
    """A 4/8-bit model keeps every quantized layer packed and adds the LoRA beside it. Judged twice: the image
    against our float fused path within the quantize tests' tolerance, and the transformer against the same
    dequantized weights with the LoRA fused (kernel rounding only), also in low-memory mode."""
    a = lora_a(tmp_path / "a.safetensors", Rand(7))
    e = tmp_path / "e.safetensors"
    LORAS["flux2"].lokr(e, Rand(8), PARAMS)
    s = tmp_path / "s.safetensors"
    single_split_file(s, Rand(18))  # row blocks of linear1: the low-memory path splits exactly there
    loras = [(a, 0.9), (e, 1.0), (s, 1.1)]
    fused, _ = ours(our_pipe, lat, loras)
    pipe = flux_klein_mlx.load(snapshot, dtype="float32", quantize=bits, loras=loras)
    pipe.remember_prompt(PROMPT, our_pipe.encode_prompts([PROMPT]))  # the same embeddings: only the transformer differs
    img = pipe.generate(PROMPT, width=W, height=H, steps=STEPS, latents=lat, output_type="np")
    err = float(np.abs(img - fused).max())
    print(f"{bits}-bit + LoRA image vs float32 fused: max abs {err:.2e}")
    assert err < tolerance
    model = pipe.component("transformer")
    wrapped = [p for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) >= 10 and not any(
        type(m).__name__ == "Linear" and p in wrapped for p, m in model.named_modules()
    )
    ref = copy.deepcopy(model)
    remove_loras(ref)
    dequantize_model(ref)
    apply_loras(ref, pipe.loras)
    rng = np.random.default_rng(0)
    img_tok, txt = (
        mx.array(rng.standard_normal((1, 16, C), np.float32)),
        mx.array(rng.standard_normal((1, 7, 96), np.float32)),
    )
    from flux_klein_mlx.models.rope import image_ids, text_ids

    rope = model.compute_rope(text_ids(7), image_ids(4, 4))
    t = mx.array([0.6])
    want = ref.forward_with_rope(img_tok, txt, t, rope)
    for low_memory in (False, True):
        got = model.forward_with_rope(img_tok, txt, t, rope, low_memory=low_memory)
        err = rel_err(got, want)
        print(f"{bits}-bit side path vs dequantized+fused (low_memory={low_memory}): rel {err:.1e}")
        assert err < 1e-5


# --- refusals: one line, nothing applied ---------------------------------------------------------------


def write(path, sd, metadata=None):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def pair(name, out, inp, r=4, down="lora_A", up="lora_B"):
    rng = Rand(0)
    a, b = rng.pair(out, inp, r)
    return {f"{name}.{down}.weight": a, f"{name}.{up}.weight": b}


def refused(loras, match, params=PARAMS, **kw):
    with pytest.raises(FluxKleinError, match=match) as e:
        load_loras(loras, params, **kw)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_keys_that_match_nothing_are_refused_with_count_and_names(tmp_path):
    f = write(tmp_path / "x.safetensors", pair("transformer.foo.bar", D, D) | pair("transformer.encoder.layer_1", D, D))
    msg = refused([f], r"LoRA x.safetensors matches no layer of the model: none of its 2 modules")
    assert "encoder.layer_1" in msg and "foo.bar" in msg


def test_partial_match_is_refused_unless_asked(tmp_path):
    good = pair("transformer.transformer_blocks.0.attn.to_q", D, D) | pair("transformer.proj_out", C, D)
    extra = pair("transformer.transformer_blocks.7.attn.to_q", D, D)  # the tiny model has 2 double blocks
    f = write(tmp_path / "p.safetensors", good | extra)
    refused([f], r"1 of its 3 modules match no layer of .* \(transformer_blocks\.7\.attn\.to_q\); .*--lora-partial")
    (lora,) = load_loras([f], PARAMS, partial=True)
    assert sorted(t.layer for t in lora.terms) == ["double_blocks.0.img_attn.qkv", "final_layer.linear"]


def test_lora_for_another_klein_size_or_flux1_names_that_model(tmp_path):
    k4, k9 = FluxKleinParams.klein_4b(), FluxKleinParams.klein_9b()
    nine = write(tmp_path / "nine.safetensors", pair("diffusion_model.double_blocks.0.img_attn.qkv", 3 * 4096, 4096))
    four = write(tmp_path / "four.safetensors", pair("transformer.transformer_blocks.0.attn.to_out.0", 3072, 3072))
    refused([nine], r"was made for FLUX.2 \[klein\] 9B \(hidden size 4096\), but the model is klein-4B", params=k4)
    refused([four], r"was made for FLUX.2 \[klein\] 4B \(hidden size 3072\), but the model is klein-9B", params=k9)
    refused([four], r"made for FLUX.2 \[klein\] 4B \(hidden size 3072\), but the model is a custom FLUX.2 transformer")
    # FLUX.1: told by its names, or by its 4x GELU MLP when the names are shared
    flux1 = write(
        tmp_path / "f1.safetensors",
        pair("lora_unet_double_blocks_0_img_mod_lin", 6 * 3072, 3072, down="lora_down", up="lora_up"),
    )
    refused([flux1], r"was made for FLUX.1, not FLUX.2 \[klein\] \(module double_blocks_0_img_mod_lin\)", params=k4)
    mlp = write(tmp_path / "f1mlp.safetensors", pair("diffusion_model.double_blocks.0.img_mlp.0", 4 * 3072, 3072))
    refused([mlp], r"was made for FLUX.1 \(module double_blocks.0.img_mlp.0\), but the model is klein-4B", params=k4)
    sdxl = write(
        tmp_path / "sdxl.safetensors",
        pair("lora_unet_down_blocks_0_attentions_0_proj_in", 320, 320, down="lora_down", up="lora_up"),
    )
    refused([sdxl], r"was made for an SDXL / Stable Diffusion UNet, not FLUX.2 \[klein\]")


def test_damaged_incomplete_and_foreign_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    refused([junk], r"LoRA junk.safetensors is damaged or not a safetensors file")
    good = write(tmp_path / "good.safetensors", pair("transformer.proj_out", C, D))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    refused([cut], r"LoRA cut.safetensors is damaged")
    refused([tmp_path / "missing.safetensors"], r"LoRA '.*missing.safetensors' not found: no such file")
    half = write(tmp_path / "half.safetensors", {"transformer.proj_out.lora_A.weight": torch.zeros(4, D)})
    refused([half], r"LoRA half.safetensors is incomplete: proj_out has a down matrix but no up matrix")
    odd = {
        "transformer.proj_out.lora_A.weight": torch.zeros(4, D),
        "transformer.proj_out.lora_B.weight": torch.zeros(C, 3),
    }
    refused(
        [write(tmp_path / "odd.safetensors", odd)], r"proj_out has down \(4, 64\) and up \(32, 3\), which do not form"
    )
    nan = pair("transformer.proj_out", C, D)
    nan["transformer.proj_out.lora_B.weight"][0, 0] = float("nan")
    refused([write(tmp_path / "nan.safetensors", nan)], r"holds non-finite values \(in transformer.proj_out.lora_B")
    ckpt = write(tmp_path / "ckpt.safetensors", {"double_blocks.0.img_attn.qkv.weight": torch.zeros(3 * D, D)})
    refused([ckpt], r"1 key\(s\) that are not LoRA/LoKr weights \(double_blocks.0.img_attn.qkv.weight\)")
    dora = pair("transformer.proj_out", C, D) | {"transformer.proj_out.lora_magnitude_vector": torch.ones(C)}
    refused([write(tmp_path / "dora.safetensors", dora)], r"holds DoRA weights")
    bad_meta = write(tmp_path / "meta.safetensors", pair("transformer.proj_out", C, D), {"lora_adapter_metadata": "{"})
    refused([bad_meta], r"damaged lora_adapter_metadata header")


def kohya(name, out, inp, r=4, alpha=None, **scaled):
    sd = pair(f"lora_unet_{name}", out, inp, r, down="lora_down", up="lora_up")
    for role, s in scaled.items():
        sd[f"lora_unet_{name}.lora_{role}.weight"] *= s
    if alpha is not None:
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)
    return sd


def bad_lora_files(folder):
    """(name, file or spec, scale, message) for every kind of LoRA file issue 21 lists."""
    import safetensors.torch

    meta = lambda alpha: {"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": alpha})}  # noqa: E731
    fp8 = {k: v.to(torch.float8_e4m3fn) for k, v in pair("transformer.proj_out", C, D).items()}
    safetensors.torch.save_file(fp8, str(folder / "fp8.safetensors"))
    zero = {
        "transformer.proj_out.lora_A.weight": torch.zeros(0, D),
        "transformer.proj_out.lora_B.weight": torch.zeros(C, 0),
    }
    lokr = {
        "double_blocks.0.img_attn.qkv.lokr_w1": torch.ones(4, 4),
        "double_blocks.0.img_attn.qkv.lokr_w2": torch.ones(48, 17),
    }
    return [
        ("rank 0", write(folder / "r0.safetensors", zero), 1.0, r"r0.safetensors: proj_out has rank 0"),
        (
            "alpha nan in metadata",
            write(folder / "an.safetensors", pair("transformer.proj_out", C, D), meta(float("nan"))),
            1.0,
            r"an.safetensors: its metadata gives lora_alpha = nan",
        ),
        (
            "alpha inf in .alpha",
            write(folder / "ai.safetensors", kohya("img_in", D, C, alpha=float("inf"))),
            1.0,
            r"ai.safetensors holds non-finite values \(in lora_unet_img_in.alpha\)",
        ),
        (
            "overflow: factors",
            write(folder / "of.safetensors", kohya("img_in", D, C, up=1e20)),
            1.0,
            r"of.safetensors: its update of img_in reaches .*e\+19 \(scale 1 x alpha/rank 1 x its factors\)",
        ),
        (
            "overflow: alpha",
            write(folder / "oa.safetensors", kohya("img_in", D, C, alpha=4e30)),
            1.0,
            r"oa.safetensors: its update of img_in reaches .* alpha/rank 1e\+30",
        ),
        (
            "overflow: scale",
            write(folder / "os.safetensors", pair("transformer.proj_out", C, D)),
            1e38,
            r"os.safetensors: its update of proj_out reaches .*\(scale 1e\+38",
        ),
        (
            "two namings of one layer",
            write(
                folder / "two.safetensors",
                pair("transformer.transformer_blocks.0.attn.to_k", D, D)
                | pair("diffusion_model.double_blocks.0.img_attn.qkv", 3 * D, D),
            ),
            1.0,
            r"two.safetensors updates double_blocks.0.img_attn.qkv twice: double_blocks.0.img_attn.qkv and "
            r"transformer_blocks.0.attn.to_k name the same weights",
        ),
        (
            "mflux and diffusers to_out",
            write(
                folder / "out.safetensors",
                pair("transformer.transformer_blocks.1.attn.to_out", D, D)
                | pair("transformer.transformer_blocks.1.attn.to_out.0", D, D),
            ),
            1.0,
            r"out.safetensors updates double_blocks.1.img_attn.proj twice",
        ),
        (
            "one key under two prefixes",
            write(
                folder / "dup.safetensors",
                pair("transformer.proj_out", C, D) | pair("proj_out", C, D, down="lora_A.default", up="lora_B.default"),
            ),
            1.0,
            r"dup.safetensors holds proj_out's (down|up) matrix twice \(\S*proj_out.lora_[AB]\S* and \S*proj_out",
        ),
        ("fp8", folder / "fp8.safetensors", 1.0, r"LoRA fp8.safetensors stores fp8 tensors \(F8_E4M3"),
        (  # a whole file, not damaged: said as what it is (it was "damaged ... download it again")
            "float64",
            write(folder / "f64.safetensors", {k: v.double() for k, v in pair("transformer.proj_out", C, D).items()}),
            1.0,
            r"LoRA f64.safetensors stores float64 tensors \(F64, e.g. transformer.proj_out.lora_[AB].weight\), which",
        ),
        (
            "a folder",
            folder,
            1.0,
            r"is a folder, not a LoRA file \(it holds ai.safetensors, al.safetensors, an.safetensors, ...\); give the",
        ),
        (
            "LoKr factors that do not fit",
            write(folder / "kr.safetensors", lokr),
            1.0,
            r"kr.safetensors: double_blocks.0.img_attn.qkv has LoKr factors 4x4 and 48x17, whose product is 192x68, "
            r"but double_blocks.0.img_attn.qkv takes 192x64",
        ),
        (
            "a pair for an unknown width",
            write(folder / "w.safetensors", pair("transformer.transformer_blocks.0.attn.to_q", D, 65)),
            1.0,
            r"w.safetensors: transformer_blocks.0.attn.to_q updates a 64x65 block, "
            r"but rows 0-64 of double_blocks.0.img_attn.qkv take 64x64",
        ),
        (
            "only .alpha keys",
            write(
                folder / "al.safetensors",
                {"lora_unet_img_in.alpha": torch.tensor(4.0), "lora_unet_txt_in.alpha": torch.tensor(4.0)},
            ),
            1.0,
            r"al.safetensors is incomplete: it holds 2 `.alpha` keys and no LoRA weights",
        ),
    ]


def test_bad_lora_files_refused_naming_the_file(tmp_path):
    for name, f, scale, match in bad_lora_files(tmp_path):
        message = refused([(f, scale)], match)
        assert "hidden size" not in message, (name, message)


def test_alpha_zero_or_negative_loads_with_a_warning(tmp_path):
    zero = write(
        tmp_path / "zero.safetensors",
        pair("transformer.proj_out", C, D),
        {"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 0})},
    )
    with pytest.warns(UserWarning, match=r"LoRA zero.safetensors has alpha 0, which changes nothing, in every module"):
        (lora,) = load_loras([zero], PARAMS)
    assert [t.factor for t in lora.terms] == [0.0]
    neg = write(tmp_path / "neg.safetensors", kohya("img_in", D, C, alpha=-2.0) | kohya("txt_in", D, 96, alpha=2.0))
    with pytest.warns(
        UserWarning,
        match=r"LoRA neg.safetensors has a negative alpha, which subtracts its update, "
        r"in 1 of its 2 modules \(img_in\)",
    ):
        (lora,) = load_loras([neg], PARAMS)
    assert sorted(t.factor for t in lora.terms) == [-0.5, 0.5]


@pytest.mark.parametrize(
    "scale, match",
    [
        (float("nan"), "scale nan is not finite"),
        (float("inf"), "scale inf is not finite"),
        ("strong", "scale 'strong' is not a number"),
    ],
)
def test_bad_scales(tmp_path, scale, match):
    f = write(tmp_path / "s.safetensors", pair("transformer.proj_out", C, D))
    refused([(f, scale)], match)
    refused([(f,)], r"has no scale value")


def test_a_refused_lora_leaves_the_model_as_it_was(snapshot, our_pipe, tmp_path):
    good = lora_a(tmp_path / "a.safetensors", Rand(12))
    bad = write(tmp_path / "bad.safetensors", pair("transformer.transformer_blocks.9.attn.to_q", D, D))
    our_pipe.set_loras([good])
    before = {k: np.array(v) for k, v in tree_flatten(our_pipe.component("transformer").parameters())}
    with pytest.raises(FluxKleinError, match="matches no layer"):
        our_pipe.set_loras([(good, 0.5), bad])
    after = dict(tree_flatten(our_pipe.component("transformer").parameters()))
    assert all(np.array_equal(np.array(after[k]), v) for k, v in before.items())
    assert [(x.name, x.scale) for x in our_pipe.loras] == [("a.safetensors", 1.0)]
    with pytest.raises(FluxKleinError, match="matches no layer"):
        flux_klein_mlx.load(snapshot, loras=[bad])  # refused by load() itself, before any model is read


# --- the CLI ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lora", "A", "--lora-scale", "1", "--lora-scale", "2"], "--lora-scale is given 2 times but --lora 1 times"),
        (["--lora", "A", "--lora-scale", "nan"], "scale nan is not finite"),
        (["--lora", "missing.safetensors"], "LoRA 'missing.safetensors' not found"),
        (["--lora", "NOTHING"], "matches no layer of the model"),
        (["--lora", "PARTIAL"], "1 of its 2 modules match no layer"),
        (["--lora", "NINE"], r"was made for FLUX.2 \[klein\] 9B"),
    ],
)
def test_cli_bad_loras_one_line_exit_1_no_file(snapshot, tmp_path, cli, extra, message):
    files = {
        "A": lora_a(tmp_path / "a.safetensors", Rand(15)),
        "NOTHING": write(tmp_path / "n.safetensors", pair("unet.mid.proj", D, D)),
        "PARTIAL": write(
            tmp_path / "p.safetensors", pair("transformer.proj_out", C, D) | pair("transformer.x.y", D, D)
        ),
        "NINE": write(tmp_path / "9.safetensors", pair("diffusion_model.double_blocks.0.img_attn.proj", 4096, 4096)),
    }
    extra = [str(files.get(x, x)) for x in extra]
    out = tmp_path / "img.png"
    code, stdout, err = cli(
        "generate",
        "--model",
        str(snapshot),
        "--prompt",
        "x",
        "--width",
        "64",
        "--height",
        "64",
        "--output",
        str(out),
        *extra,
    )
    assert code == 1 and not out.exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert __import__("re").search(message, lines[0]), lines[0]


# --- convert --lora ------------------------------------------------------------------------------------


def test_convert_lora_bad_input_writes_nothing(snapshot, tmp_path, cli):
    bad = write(tmp_path / "bad.safetensors", pair("transformer.transformer_blocks.9.attn.to_q", D, D))
    for extra, message in (
        ([str(bad)], "matches no layer"),
        ([str(bad), "--lora-scale", "1", "--lora-scale", "2"], "--lora-scale is given 2 times"),
    ):
        out = tmp_path / "out"
        code, _, err = cli("convert", "--model", str(snapshot), "--output", str(out), "--lora", *extra)
        err = err.strip().splitlines()
        assert (
            code == 1 and not out.exists() and len(err) == 1 and err[0].startswith("error: ") and message in err[0]
        ), err
        assert not list(tmp_path.glob("out*"))
