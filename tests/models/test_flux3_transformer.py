"""Parity of the MLX FLUX 3 Image Klein transformer with diffusers' Flux3Transformer2DModel (Base and flow map),
from the diffusers state dict and from BFL's names, plus bf16, the Base early-stage reuse, quantization,
checkpointing, the name tables and bad inputs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from diffusers import Flux3Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
from mlx.utils import tree_flatten
from refs import randomize_, rel_err, to_mx

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.models.flux3.config import Flux3Params
from flux_klein_mlx.models.flux3.transformer import (
    Flux3,
    flux3_diffusers_name,
    flux3_name,
    infer_flux3_params,
    linear_shapes,
    sanitize_flux3_weights,
)
from flux_klein_mlx.models.quantize import dequantize_model, quantize_model
from flux_klein_mlx.storage.weights import load_into

# flux3.md section 4's tiny configs: "small" (2 heads of 16, text width 24) and "g64", whose every Linear but
# the 32-wide input projections has an input width that is a multiple of 64 (4-bit group-64 quantization).
CONFIGS = {
    "small": dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=24, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)),
    "g64": dict(in_channels=32, cond_in_channels=32, num_layers=2, num_single_layers=2, attention_head_dim=32,
                num_attention_heads=2, joint_attention_dim=128, timestep_channels=256, axes_dims_rope=(8, 8, 8, 8)),
}  # fmt: skip
LT = 10  # text tokens: any length (the pipeline pads to a multiple of 80)


def reference_model(name: str, flow_map: bool) -> Flux3Transformer2DModel:
    torch.manual_seed(0)
    config = dict(CONFIGS[name], mlp_ratio=3.0, rope_theta=10000, eps=1e-6, flow_map=flow_map)
    return randomize_(Flux3Transformer2DModel(**config), seed=1 + flow_map).eval()


@pytest.fixture(
    scope="module", params=[(n, f) for n in CONFIGS for f in (False, True)], ids=lambda p: f"{p[0]}-fm{p[1]:d}"
)
def pair(request):
    """(diffusers reference, its state dict as MLX arrays, our model loaded strictly from it)."""
    reference = reference_model(*request.param)
    state = {k: to_mx(v) for k, v in reference.state_dict().items()}
    return reference, state, load_ours(sanitize_flux3_weights(state))


def load_ours(weights: dict[str, mx.array], dtype=None) -> Flux3:
    """Our model through the real steps: params from the shapes, strict load (every name and shape)."""
    model = Flux3(infer_flux3_params(weights))
    load_into(model, weights, "transformer", dtype=dtype)
    return model


def bfl_state(reference: Flux3Transformer2DModel) -> dict[str, torch.Tensor]:
    """The reference's weights under BFL's names (as our sanitizer names them), checked by diffusers' own BFL
    converter mapping them back to the diffusers state dict exactly, with a training-only REPA head added."""
    ours = sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()})
    bfl = {k: torch.from_numpy(np.array(v)) for k, v in ours.items()}
    bfl["repa_projectors.0.weight"] = torch.ones(3, 4)
    back = convert_flux3_transformer_checkpoint_to_diffusers(dict(bfl))
    expected = reference.state_dict()
    assert back.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(back[k], v), k
    return bfl


def make_inputs(B: int, grid: tuple[int, int], refs: list[tuple[int, int]], channels: int, ctx: int, seed: int):
    """Random tokens and the modular pipeline's own ids: image (0, y/2, x/2, 0), reference k at l = -(k+1)."""
    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(B, LT, ctx, generator=g)
    txt_ids = Flux3TextRoPEInputsStep._prepare_text_ids(txt)  # (LT, 4)
    img_ids = _prepare_image_ids(*grid, 0.5)
    img = torch.randn(B, img_ids.shape[0], channels, generator=g)
    if not refs:
        return img, txt, img_ids, txt_ids, None, None
    ref_ids = torch.cat([_prepare_image_ids(h, w, 0.5, l_coord=-(1 + k)) for k, (h, w) in enumerate(refs)])
    return img, txt, img_ids, txt_ids, torch.randn(B, ref_ids.shape[0], channels, generator=g), ref_ids


def run_both(reference, model, inputs, t, target):
    """(ours, diffusers') outputs for the same inputs; `model` None: only diffusers'."""
    img, txt, img_ids, txt_ids, ref, ref_ids = inputs
    t, target = torch.tensor(t), None if target is None else torch.tensor(target)
    with torch.no_grad():
        theirs = reference(img, txt, t, img_ids, txt_ids, ref, ref_ids, target, return_dict=False)[0]
    if model is None:
        return None, theirs
    mx_or_none = [None if x is None else to_mx(x) for x in (ref, ref_ids, target)]
    mine = model(to_mx(img), to_mx(txt), to_mx(t), to_mx(img_ids), to_mx(txt_ids), *mx_or_none)
    return mine, theirs


# (B, grid, references, t, target t): t2i; batch 2 with different t and one reference; two references of
# different grids at l = -1, -2 on a non-square target.
CASES = [
    (1, (4, 6), [], [0.7], [0.55]),
    (2, (3, 5), [(2, 3)], [0.9, 0.3], [0.8, 0.0]),
    (2, (5, 3), [(2, 3), (4, 2)], [0.05, 0.6], [0.0, 0.45]),
]


@pytest.mark.parametrize("B, grid, refs, t, target", CASES)
def test_matches_diffusers(pair, B, grid, refs, t, target):
    reference, _, ours = pair
    cfg = reference.config
    inputs = make_inputs(B, grid, refs, cfg.in_channels, cfg.joint_attention_dim, seed=B + len(refs))
    mine, theirs = run_both(reference, ours, inputs, t, target if cfg.flow_map else None)
    assert mine.shape == (B, grid[0] * grid[1], cfg.in_channels) and mine.dtype == mx.float32
    # measured 1.3e-6 .. 8.6e-6 (abs 3e-5 on outputs ~4): MLX's float32 exp is 1 ulp off torch's on most of the
    # timestep frequencies, which t x 1000 amplifies; diffusers' own float32 is 3.5e-7 from its float64
    assert rel_err(mine, theirs) <= 2e-5, rel_err(mine, theirs)


def test_references_change_the_output_as_in_diffusers(pair):
    """The reference stream is not a no-op: its effect on the image is the reference's effect."""
    reference, _, ours = pair
    cfg = reference.config
    target = [0.4] if cfg.flow_map else None
    with_ref = make_inputs(1, (3, 4), [(2, 2)], cfg.in_channels, cfg.joint_attention_dim, seed=7)
    without = (*with_ref[:4], None, None)
    (m1, t1), (m0, t0) = (run_both(reference, ours, x, [0.6], target) for x in (with_ref, without))
    assert float((t1 - t0).abs().max()) > 1e-3
    assert rel_err(m1 - m0, t1 - t0) <= 1e-4


def test_bfl_names_load_to_the_same_model(pair):
    reference, state, ours = pair
    bfl = bfl_state(reference)
    for prefix in ("", "model.diffusion_model.", "diffusion_model."):
        weights = sanitize_flux3_weights({prefix + k: to_mx(v) for k, v in bfl.items()})
        assert "repa_projectors.0.weight" not in weights
        model = load_ours(weights)
        assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(*map(sorted_params, (model, ours)), strict=True))
    # our own names pass through unchanged
    assert sanitize_flux3_weights(dict(tree_flatten(ours.parameters()))).keys() == dict(sorted_params(ours)).keys()


def sorted_params(model: nn.Module) -> list[tuple[str, mx.array]]:
    return sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])


def test_params_from_config_and_shapes(pair):
    reference, state, ours = pair
    params = Flux3Params.from_dict(dict(reference.config))
    assert params == ours.params
    assert params.flow_map == reference.config.flow_map and params.theta == 10000.0
    # linear_shapes is every Linear of the model, with the checkpoint's shapes
    weights = sanitize_flux3_weights(state)
    shapes = linear_shapes(params)
    assert {f"{p}.weight" for p in shapes} == {k for k in weights if not k.endswith(".scale")}
    assert all(tuple(weights[f"{p}.weight"].shape) == s for p, s in shapes.items())


@pytest.mark.parametrize("flow_map", [False, True])
def test_released_size_matches_diffusers_parameter_count(flow_map):
    """The full-size model's layers (built lazily: nothing is allocated) count as diffusers' 5.5B do."""
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Flux3Transformer2DModel(flow_map=flow_map).parameters())
    params = Flux3Params(flow_map=flow_map)
    norms = (3 * params.depth + params.depth_single) * 2 * params.head_dim  # QK-norm scales per block
    assert sum(o * i for o, i in linear_shapes(params).values()) + norms == theirs
    assert theirs == (5_548_681_984 if flow_map else 5_538_458_368)
    assert params.describe() == "FLUX 3 Image Klein (hidden 3072, 5 mode / 28 single blocks)"


def test_bfloat16_within_a_bound_of_diffusers_bfloat16(tmp_path):
    """bf16 weights (as released) in bf16: ours against diffusers' `from_pretrained(torch_dtype=bfloat16)` (which
    keeps norm_q/norm_k in fp32; ours runs QK norm and RoPE in fp32 too), with the sigma cast before x 1000."""
    reference = reference_model("g64", True)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.bfloat16())  # bf16-representable weights, as released
    reference.save_pretrained(tmp_path)
    ref16 = Flux3Transformer2DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    assert ref16.single_transformer_blocks[0].attn.norm_q.weight.dtype == torch.float32
    cfg = reference.config
    inputs = make_inputs(2, (4, 3), [(2, 2)], cfg.in_channels, cfg.joint_attention_dim, seed=3)
    t, target = [0.7, 0.3], [0.55, 0.0]
    _, theirs32 = run_both(reference, None, inputs, t, target)
    ours16 = load_ours(sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()}), mx.bfloat16)
    assert ours16.dtype == mx.bfloat16
    img, txt, img_ids, txt_ids, ref, ref_ids = inputs
    inputs16 = (img.bfloat16(), txt.bfloat16(), img_ids, txt_ids, ref.bfloat16(), ref_ids)  # ids stay float32
    mine16, theirs16 = run_both(ref16, ours16, inputs16, t, target)
    assert mine16.dtype == mx.bfloat16
    # diffusers' own bf16 run is ~0.2 from its float32 one (mostly bf16(sigma) x 1000 moving the sinusoid)
    assert rel_err(to_mx(theirs16), theirs32) > 0.05
    assert rel_err(mine16, theirs16) <= 2e-2, rel_err(mine16, theirs16)  # measured 6.4e-3


def test_timestep_is_rounded_in_the_model_dtype():
    """diffusers embeds bf16(sigma) x 1000 rounded to bf16 (0.7 -> 700), not float32 700.0 or 699.2."""
    reference = reference_model("g64", False).to(torch.bfloat16)
    ours = load_ours(sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()}), mx.bfloat16)
    t = torch.tensor([0.7, 0.123])
    with torch.no_grad():
        theirs = reference.timestep_embedder(reference.time_proj(t.to(torch.bfloat16) * 1000).to(torch.bfloat16))
    vec, zero = ours.time_vectors(to_mx(t), None, 2)
    assert rel_err(vec, theirs) <= 1e-2, rel_err(vec, theirs)
    with torch.no_grad():
        theirs0 = reference.timestep_embedder(reference.time_proj(torch.zeros(1)).to(torch.bfloat16))
    assert rel_err(zero[:1], theirs0) <= 1e-2


def test_base_early_stages_equal_the_per_step_path():
    """Base: the text and reference mode stacks (t = 0) computed once give the same output as every step."""
    reference = reference_model("small", False)
    ours = load_ours(sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()}))
    img, txt, img_ids, txt_ids, ref, ref_ids = map(to_mx, make_inputs(2, (3, 4), [(2, 3), (2, 2)], 16, 24, seed=5))
    rope = ours.compute_rope(txt_ids, img_ids, ref_ids)
    txt_early, ref_early = ours.early_text(txt, rope), ours.early_references(ref, rope)
    for t in ([0.9, 0.2], [0.1, 0.1]):
        t = mx.array(t)
        per_step = ours.forward_with_rope(img, txt, t, rope, ref=ref)
        cached = ours.forward_with_rope(img, None, t, rope, txt_early=txt_early, ref_early=ref_early)
        low = ours.forward_with_rope(img, txt, t, rope, ref=ref, low_memory=True)
        assert float(mx.abs(cached - per_step).max()) <= 1e-6
        assert float(mx.abs(low - per_step).max()) <= 1e-6


def test_checkpointed_gradients_equal_plain_ones():
    """`checkpoint=True` (training) recomputes each block in the backward pass: same loss, same gradients."""
    reference = reference_model("small", False)
    model = load_ours(sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()}))
    img, txt, img_ids, txt_ids, ref, ref_ids = map(to_mx, make_inputs(1, (2, 3), [(2, 2)], 16, 24, seed=9))
    rope = model.compute_rope(txt_ids, img_ids, ref_ids)

    def loss(checkpoint):
        def f(params):
            model.update(params)
            return mx.sum(model.forward_with_rope(img, txt, mx.array([0.4]), rope, ref=ref, checkpoint=checkpoint) ** 2)

        return mx.value_and_grad(f)(model.trainable_parameters())

    (l0, g0), (l1, g1) = loss(False), loss(True)
    assert abs(float(l0) - float(l1)) <= 1e-5 * abs(float(l0))
    for (k, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1), strict=True):
        assert float(mx.abs(a - b).max()) <= 1e-5 * max(float(mx.abs(a).max()), 1e-6), k


def test_quantized_model_runs_and_stays_close():
    """4-bit group 64: equal to MLX's dequantized model to kernel rounding, close to the float one."""
    reference = reference_model("g64", True)
    state = sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()})
    float_model, model = load_ours(state), load_ours(state)
    record = quantize_model(model, 4, group_size=64)
    assert "single_blocks.0.mlp_out" in record["layers"] and "emb_in.image" not in record["layers"]
    inputs = make_inputs(1, (3, 4), [(2, 2)], 32, 128, seed=11)
    img, txt, img_ids, txt_ids, ref, ref_ids = map(to_mx, inputs)
    args = (img, txt, mx.array([0.6]), img_ids, txt_ids, ref, ref_ids, mx.array([0.3]))
    out = model(*args)
    assert model.dtype == mx.float32 and bool(mx.all(mx.isfinite(out)))
    dequantized = dequantize_model(model)(*args)
    assert rel_err(out, np.array(dequantized)) <= 1e-5
    assert rel_err(out, np.array(float_model(*args))) <= 0.25  # the 4-bit error itself, measured 0.15


def test_bad_inputs_say_what_is_wrong():
    base = Flux3(Flux3Params.from_dict(dict(CONFIGS["small"])))
    fm = Flux3(Flux3Params.from_dict(dict(CONFIGS["small"], flow_map=True)))
    img, txt, img_ids, txt_ids, ref, ref_ids = map(to_mx, make_inputs(1, (2, 2), [(2, 2)], 16, 24, seed=0))
    t = mx.array([0.5])
    with pytest.raises(ValueError, match="required by, and only by"):
        base(img, txt, t, img_ids, txt_ids, target_timesteps=t)
    with pytest.raises(ValueError, match="required by, and only by"):
        fm(img, txt, t, img_ids, txt_ids)
    with pytest.raises(ValueError, match="ref and ref_ids go together"):
        base(img, txt, t, img_ids, txt_ids, ref=ref)
    rope = base.compute_rope(txt_ids, img_ids)
    with pytest.raises(ValueError, match="go together"):
        base.forward_with_rope(img, txt, t, rope, ref=ref)
    with pytest.raises(ValueError, match="for Base"):
        fm.early_text(txt, rope)
    with pytest.raises(ValueError, match="for Base"):
        fm.forward_with_rope(img, None, t, rope, txt_early=mx.zeros((1, LT, 32)), target_timesteps=t)
    with pytest.raises(ValueError, match="RoPE tables cover"):
        base.forward_with_rope(img, txt[:, :3], t, rope)
    with pytest.raises(FluxKleinError, match="not a FLUX 3 Image Klein transformer"):
        infer_flux3_params({"img_in.weight": mx.zeros((4, 4))})
    with pytest.raises(FluxKleinError, match="RoPE axes"):
        Flux3Params(hidden_size=64, num_heads=2, axes_dim=(8, 8, 8, 4))


def test_name_table_reads_lora_module_paths(pair):
    """The one name table serves module paths too (what a diffusers/PEFT LoRA names), both ways."""
    reference, state, _ = pair
    for key in state:
        assert flux3_diffusers_name(flux3_name(key)) == key
    ours = linear_shapes(Flux3Params.from_dict(dict(reference.config)))
    for path, module in reference.named_modules():
        assert flux3_diffusers_name(flux3_name(path)) == path
        if isinstance(module, torch.nn.Linear):  # every diffusers Linear is one of ours, same (out, in)
            assert ours[flux3_name(path)] == tuple(module.weight.shape), path
    assert flux3_name("mode_blocks.image_cond.3.attn.to_out.0") == "content_mode_blocks.image_cond.3.attn_out"
    assert flux3_name("single_transformer_blocks.27.ff.linear_in") == "single_blocks.27.mlp_in"
    assert flux3_name("txt_mode_blocks.0.attn.norm_k.weight") == "txt_mode_blocks.0.norm.key_norm.scale"
    assert flux3_name("early_stream_modulations.txt.linear") == "early_stream_modulations.txt.lin"
    assert flux3_name("content_mode_blocks.image.0.q_proj") == "content_mode_blocks.image.0.q_proj"
