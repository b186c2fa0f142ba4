"""Each family's transformer equals diffusers', written once for both families (issue 45): FLUX.2 [klein]'s
against `Flux2Transformer2DModel`, FLUX 3 Image Klein's against `Flux3Transformer2DModel` (Base and flow map),
through the kit's `transformer` (tests/support/tiny_transformers.py: the tiny references, the pipelines' own
inputs and ids, the BFL names, the released sizes, the tolerance). 0, 1 and 2 references; ids from our own RoPE
helpers; diffusers' and BFL's names; the params from the config and the shapes; the released sizes without
allocating; the paths computed once per image, low memory and checkpointing; bf16; 4/8-bit.

What only one family has: tests/models/test_transformer_loading.py (FLUX.2's checkpoints, ids, RoPE and
attention) and tests/models/test_flow_map.py (FLUX 3's flow map, reference stream and name table)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from families import KITS
from mlx.utils import tree_flatten
from refs import rel_err, to_mx
from tiny_transformers import load_weights, reference_bf16

from flux_klein_mlx.family import FAMILIES
from flux_klein_mlx.models.quantize import dequantize_model, quantize_model

CASES = [
    (f, v, k) for f in sorted(KITS) for v in KITS[f].transformer.variants for k in range(len(KITS[f].transformer.cases))
]
VARIANTS = [(f, v) for f in sorted(KITS) for v in KITS[f].transformer.variants]
RELEASED = [(f, r[0]) for f in sorted(KITS) for r in KITS[f].transformer.released]
QUANTIZED = [(f, q[0]) for f in sorted(KITS) for q in KITS[f].transformer.quantization]


def ids(cases):
    return ["-".join(map(str, c)) for c in cases]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(name, variant) -> (the family's twin, diffusers' reference, our model loaded from it), each built once."""
    built = {}

    def pair(name, variant):
        if (name, variant) not in built:
            twin = KITS[name].transformer
            reference = twin.reference(variant)
            ours = twin.load(reference, tmp_path_factory.mktemp(f"{name}-{variant}") / "transformer", mx.float32)
            built[name, variant] = twin, reference, ours
        return built[name, variant]

    return pair


def sorted_params(model: nn.Module) -> list[tuple[str, mx.array]]:
    return sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])


@pytest.mark.parametrize("name, variant, case", CASES, ids=ids(CASES))
def test_matches_diffusers(pairs, name, variant, case):
    twin, reference, ours = pairs(name, variant)
    B, grid, refs, t, target = twin.cases[case]
    x = twin.inputs(reference, B, grid, refs, seed=B + len(refs))
    mine, theirs = twin.ours(ours, x, t, target), twin.theirs(reference, x, t, target)
    assert mine.shape == (B, x.img.shape[1], reference.config.in_channels) and mine.dtype == mx.float32
    assert rel_err(mine, theirs) <= twin.tolerance, rel_err(mine, theirs)
    # ids built by our own RoPE helpers (and the family's reference ids) give the same answer
    again = twin.ours(ours, x, t, target, ids=twin.our_ids(ours, x))
    assert np.array_equal(np.array(again), np.array(mine))


def test_paths_computed_once_per_image_and_low_memory_equal_the_plain_call(family, pairs):
    """Cached RoPE tables, what the pipeline hoists out of the step loop (FLUX.2's text projection, FLUX 3
    Base's text and reference modes), block-by-block evaluation, a scalar timestep: the same function."""
    twin, reference, ours = pairs(family.name, family.transformer.cached_variant)
    x = twin.inputs(reference, 2, (3, 5), [(2, 3), (2, 2)], seed=5)
    rope = twin.rope(ours, x)
    mx.eval(rope)
    for t in ([0.9, 0.2], [0.1, 0.1]):
        plain = twin.ours(ours, x, t)
        per_step = twin.with_rope(ours, x, t, None, rope)
        assert float(mx.abs(per_step - plain).max()) <= twin.cached_tolerance
        for what, cached in twin.cached_paths(ours, x, t, None, rope).items():
            assert float(mx.abs(cached - per_step).max()) <= twin.cached_tolerance, what
        low = twin.with_rope(ours, x, t, None, rope, low_memory=True)
        assert float(mx.abs(low - per_step).max()) <= 1e-6
        assert rel_err(low, twin.theirs(reference, x, t)) <= twin.tolerance
    same_t = twin.with_rope(ours, x, 0.7, None, rope)  # a scalar timestep broadcasts over the batch
    assert np.array_equal(np.array(same_t[0]), np.array(twin.with_rope(ours, x, [0.7, 0.3], None, rope)[0]))


def test_checkpointed_gradients_equal_plain_ones(family, pairs):
    """`checkpoint=True` (training) recomputes each block in the backward pass: same loss, same gradients."""
    twin, reference, model = pairs(family.name, family.transformer.cached_variant)
    x = twin.inputs(reference, 1, (2, 3), [(2, 2)], seed=9)
    rope = twin.rope(model, x)
    original = model.trainable_parameters()

    def loss(checkpoint):
        def f(params):
            model.update(params)
            return mx.sum(twin.with_rope(model, x, [0.4], None, rope, checkpoint=checkpoint) ** 2)

        return mx.value_and_grad(f)(original)

    (l0, g0), (l1, g1) = loss(False), loss(True)
    model.update(original)
    assert abs(float(l0) - float(l1)) <= 1e-5 * abs(float(l0))
    for (k, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1), strict=True):
        assert float(mx.abs(a - b).max()) <= 1e-5 * max(float(mx.abs(a).max()), 1e-6), k


@pytest.mark.parametrize("name, variant", VARIANTS, ids=ids(VARIANTS))
def test_bfl_names_load_to_the_same_model(pairs, name, variant):
    """BFL's names (checked by diffusers' own BFL converter mapping them back to the diffusers state dict
    exactly), under each prefix BFL's files and ComfyUI use, load to our model of diffusers' names; training-only
    heads are dropped; our own names pass through unchanged."""
    twin, reference, ours = pairs(name, variant)
    bfl, back = twin.bfl_state(reference)
    expected = reference.state_dict()
    assert back.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(back[k], v), k
    family = FAMILIES[name]
    for prefix in ("", "model.diffusion_model.", "diffusion_model."):
        weights = family.sanitize_transformer({prefix + k: to_mx(v) for k, v in bfl.items()})
        assert not set(twin.bfl_extra) & set(weights)
        model = load_weights(name, weights)
        assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(*map(sorted_params, (model, ours)), strict=True))
    assert family.sanitize_transformer(dict(tree_flatten(ours.parameters()))).keys() == dict(sorted_params(ours)).keys()


@pytest.mark.parametrize("name, variant", VARIANTS, ids=ids(VARIANTS))
def test_params_from_config_and_shapes(pairs, name, variant):
    twin, reference, ours = pairs(name, variant)
    family, config = FAMILIES[name], reference.config
    params = family.params(dict(config))
    assert params == ours.params
    assert params.theta == config.rope_theta and getattr(params, "flow_map", False) == config.get("flow_map", False)
    # linear_shapes is every Linear of the model, with the checkpoint's shapes; the shapes alone give the params
    weights = family.sanitize_transformer({k: to_mx(v) for k, v in reference.state_dict().items()})
    shapes = family.linear_shapes(params)
    assert {f"{p}.weight" for p in shapes} == {k for k in weights if not k.endswith(".scale")}
    assert all(tuple(weights[f"{p}.weight"].shape) == s for p, s in shapes.items())
    assert family.infer_params(weights).shape_key() == params.shape_key()


@pytest.mark.parametrize("name, release", RELEASED, ids=ids(RELEASED))
def test_released_sizes_match_diffusers_without_allocating(name, release):
    """The full-size model's layers (built lazily: nothing is allocated) count as diffusers' do on the meta device."""
    twin, family = KITS[name].transformer, FAMILIES[name]
    _, config, count, tensors, title = next(r for r in twin.released if r[0] == release)
    with torch.device("meta"):
        reference = KITS[name].reference_transformer_class()(**{k: v for k, v in config.items() if k[0] != "_"})
    assert sum(p.numel() for p in reference.parameters()) == count
    params = family.params(config)
    assert twin.count(params) == count and params.describe() == title
    before = mx.get_active_memory()
    flat = tree_flatten(family.build_transformer(params).parameters())  # lazy: no weight is materialised
    assert sum(v.size for _, v in flat) == count
    shapes = family.linear_shapes(params)
    assert {k.removesuffix(".weight"): tuple(v.shape) for k, v in flat if k.removesuffix(".weight") in shapes} == shapes
    assert tensors is None or len(flat) == tensors
    assert mx.get_active_memory() - before < 64 * 2**20


def test_bfloat16_within_a_bound_of_diffusers_bfloat16(family, tmp_path):
    """bf16 weights (as released) in bf16: ours against diffusers' `from_pretrained(torch_dtype=bfloat16)` (which
    keeps its `_keep_in_fp32_modules` in fp32; ours runs QK norm and RoPE in fp32 too)."""
    twin = family.transformer
    reference = twin.reference(twin.bf16_variant)
    ref16 = reference_bf16(reference, tmp_path / "reference")
    kept = type(ref16)._keep_in_fp32_modules or []
    assert all(p.dtype == torch.float32 for n, p in ref16.named_parameters() if set(n.split(".")) & set(kept))
    x = twin.inputs(reference, 2, (4, 3), [(2, 2)], seed=3)
    t, target = [0.7, 0.3], [0.55, 0.0]
    theirs32 = twin.theirs(reference, x, t, target)
    ours16 = twin.load(reference, tmp_path / "ours", mx.bfloat16)
    assert ours16.dtype == mx.bfloat16
    x16 = x._replace(img=x.img.bfloat16(), txt=x.txt.bfloat16(), ref=None if x.ref is None else x.ref.bfloat16())
    mine16, theirs16 = twin.ours(ours16, x16, t, target), twin.theirs(ref16, x16, t, target)
    assert mine16.dtype == mx.bfloat16
    assert rel_err(to_mx(theirs16), theirs32) > twin.bf16_apart  # the bound below is not the float32 one
    assert rel_err(mine16, theirs16) <= 2e-2, rel_err(mine16, theirs16)  # measured 7.2e-3 (FLUX.2), 6.4e-3


@pytest.mark.parametrize("name, bits", QUANTIZED, ids=ids(QUANTIZED))
def test_quantized_model_equals_its_dequantized_weights(name, bits, tmp_path):
    """4/8-bit: equal to MLX's dequantized model to kernel rounding (low memory too: its halves slice quantized
    weights on group boundaries), close to the float model; layers too narrow for a group stay float."""
    twin = KITS[name].transformer
    _, group, variant = next(q for q in twin.quantization if q[0] == bits)
    reference = twin.reference(variant)
    float_model, model = (twin.load(reference, tmp_path / n, mx.float32) for n in ("float", "quantized"))
    record = quantize_model(model, bits, group_size=group)
    assert twin.quantized_layer in record["layers"] and twin.float_layer not in record["layers"]
    assert isinstance(dict(model.named_modules())[twin.quantized_layer], nn.QuantizedLinear)
    x = twin.inputs(reference, 1, (3, 4), [(2, 2)], seed=11)
    out, rope = twin.ours(model, x, [0.6], [0.3]), twin.rope(model, x)
    assert model.dtype == mx.float32 and bool(mx.all(mx.isfinite(out)))
    low = twin.with_rope(model, x, [0.6], [0.3], rope, low_memory=True)
    assert rel_err(low, twin.with_rope(model, x, [0.6], [0.3], rope)) <= 1e-5
    assert rel_err(out, np.array(twin.ours(dequantize_model(model), x, [0.6], [0.3]))) <= 1e-5
    # the 4-bit error itself, measured 0.13 (FLUX.2) and 0.15 (FLUX 3); 8-bit 6e-3
    assert rel_err(out, np.array(twin.ours(float_model, x, [0.6], [0.3]))) <= 0.25
