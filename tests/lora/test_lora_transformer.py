"""LoRAs on each family's transformer, written once for both families (issue 45): diffusers/PEFT, BFL (ComfyUI /
ai-toolkit, with or without `model.`, blocks only) and kohya files of one peft adapter read by our lora/
machinery and applied to our model, judged by diffusers' transformer carrying the same adapter through the
family's own LoRA loader (`Flux2LoraLoaderMixin`, `Flux3LoraLoaderMixin`); two LoRAs at once with scales; the
side path on a 4-bit model; LoKr against numpy; the other family's LoRAs refused naming both; `lora info` /
`lora convert`.

The files: tests/support/tiny_loras.py (the kit's `lora`); the models: tests/support/tiny_transformers.py's g64
(FLUX.2 [klein] hidden 64; FLUX 3 Image Klein Base and flow map). FLUX.2's images through the whole pipeline, its
other trainers' files and every refusal are tests/lora/test_lora.py's; FLUX 3's distilled-only LoRAs are
tests/lora/test_lora_flow_map.py's.
"""

from __future__ import annotations

import copy
import re

import mlx.core as mx
import numpy as np
import pytest
import torch
from families import KITS
from mlx.utils import tree_flatten
from refs import rel_err
from safetensors.torch import load_file, save_file
from tiny_loras import (
    ALPHA,
    JUDGE,
    RANK,
    Rand,
    diffusers_with,
    linear_names,
    peft_adapter,
    save_bfl,
    save_diffusers,
    save_kohya,
)

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.family import FAMILIES
from flux_klein_mlx.lora.apply import apply_loras, load_loras, remove_loras
from flux_klein_mlx.lora.convert import convert_lora, describe_lora
from flux_klein_mlx.lora.layers import LoRALinear
from flux_klein_mlx.models.quantize import dequantize_model, quantize_model

VARIANTS = [(f, v) for f in sorted(KITS) for v in KITS[f].lora.variants]
T, TARGET = [0.7, 0.3], [0.55, 0.1]


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def setup(request, tmp_path_factory):
    """(family name, twin, reference, our model, its inputs, {layout: file} of one adapter, a second adapter's
    diffusers file, diffusers' outputs by the files it loaded)."""
    name, variant = request.param
    twin, loras = KITS[name].transformer, KITS[name].lora
    reference = twin.reference(variant, seed=loras.seed)
    folder = tmp_path_factory.mktemp(f"lora-{name}-{variant}")
    sd, config = peft_adapter(reference, seed=11)
    (folder / "a").mkdir()
    (folder / "b").mkdir()
    bfl = loras.bfl(sd)
    files = {
        "diffusers": save_diffusers(loras.mixin, folder / "a", sd, config),
        "bfl": save_bfl(folder / "bfl.safetensors", bfl),
        "bfl-model-prefix": save_bfl(folder / "bflm.safetensors", bfl, prefix="model.diffusion_model."),
        "bfl-blocks": save_bfl(folder / "bflb.safetensors", bfl, blocks_only=True),
        "kohya": save_kohya(folder / "kohya.safetensors", bfl),
    }
    second = save_diffusers(loras.mixin, folder / "b", *peft_adapter(reference, seed=12))
    x = twin.inputs(reference, 2, (3, 5), [(2, 3)], seed=5)
    ours = twin.load(reference, folder / "transformer", mx.float32)
    return name, twin, reference, ours, x, files, second, {}


def theirs(setup, files=None):
    """diffusers' output with `files` [(path, scale)] loaded (None: the reference as it is), once per setup."""
    name, twin, reference, _, x, _, _, memo = setup
    key = repr(files)
    if key not in memo:
        model = reference if files is None else diffusers_with(KITS[name].lora.mixin, reference, files)
        memo[key] = twin.theirs(model, x, T, TARGET)
    return memo[key]


def ours_with(setup, files, model=None):
    _, twin, _, ours, x, _, _, _ = setup
    model = model or ours
    apply_loras(model, load_loras(files, model.params))
    try:
        return twin.ours(model, x, T, TARGET)
    finally:
        remove_loras(model)


def test_every_linear_is_adapted(setup):
    name, _, reference, ours, _, files, _, _ = setup
    lora = load_loras([files["diffusers"]], ours.params)[0]
    assert lora.format == "diffusers"
    assert {t.layer for t in lora.terms} == set(FAMILIES[name].linear_shapes(ours.params))
    assert len(lora.terms) == len(linear_names(reference))


@pytest.mark.parametrize("layout", [k for k in JUDGE if k != "lokr"])  # LoKr: test_lokr_fused_update_equals_numpy
def test_layout_matches_diffusers(setup, layout):
    name, _, reference, _, _, files, _, _ = setup
    want, base = theirs(setup, [(files[JUDGE[layout]], 1.0)]), theirs(setup)
    got = ours_with(setup, [(files[layout], 1.0)])
    effect = float((want - base).abs().max() / base.abs().max())
    err = rel_err(got, want)
    print(f"{name} {layout}: LoRA effect {effect:.2f}, ours vs diffusers rel {err:.1e}")
    assert effect > 0.05  # the LoRA changes the output
    assert err <= 2e-5


def test_two_loras_with_scales_match_set_adapters(setup):
    name, _, _, _, _, files, second, _ = setup
    want = theirs(setup, [(files["diffusers"], 0.7), (second, 1.3)])
    got = ours_with(setup, [(files["kohya"], 0.7), (second, 1.3)])  # mixed layouts too
    err = rel_err(got, want)
    print(f"{name} two LoRAs 0.7 + 1.3: rel {err:.1e}")
    assert err <= 2e-5


def test_quantized_side_path_equals_dequantized_fused(setup, tmp_path):
    """4-bit group 64: the quantized layers keep their packed weights and get the LoRA as a side path; equal to
    the same dequantized weights with the LoRA fused (kernel rounding), close to the float model's LoRA output."""
    _, twin, reference, ours, x, files, second, _ = setup
    loras = load_loras([(files["bfl"], 0.9), (second, 1.1)], ours.params)
    model = twin.load(reference, tmp_path / "transformer", mx.float32)
    record = quantize_model(model, 4, group_size=64)
    apply_loras(model, loras)
    wrapped = {p for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert len(wrapped) >= 20 and wrapped == set(record["layers"]) & {t.layer for lora in loras for t in lora.terms}
    fused = copy.deepcopy(model)
    remove_loras(fused)
    dequantize_model(fused)
    apply_loras(fused, loras)
    got, want = twin.ours(model, x, T, TARGET), twin.ours(fused, x, T, TARGET)
    apply_loras(ours, loras)
    float_fused = twin.ours(ours, x, T, TARGET)
    remove_loras(ours)
    err, drift = rel_err(got, want), rel_err(got, float_fused)
    print(f"4-bit side path vs dequantized+fused: rel {err:.1e}; vs the float model + LoRA: rel {drift:.2e}")
    assert err <= 1e-5
    assert drift <= 0.25  # the 4-bit error itself (tests/models/test_transformer.py: 0.13 / 0.15 without a LoRA)


def released_params(name):
    family = FAMILIES[name]
    released = KITS[name].lora.released
    return getattr(family.params_type, released)() if released else family.params_type()


def test_lora_for_the_other_family_is_refused_naming_both(setup, tmp_path):
    name, _, _, ours, _, files, _, _ = setup
    (other,) = set(KITS) - {name}
    title, other_title = (re.escape(FAMILIES[n].title) for n in (name, other))
    foreign = tmp_path / "other.safetensors"
    (key, (out, inp)), *_ = KITS[other].lora.foreign.items()
    save_file({f"{key}.lora_A.weight": torch.zeros(4, inp), f"{key}.lora_B.weight": torch.zeros(out, 4)}, foreign)
    with pytest.raises(FluxKleinError, match=rf"is for {other_title}.*the model is {title}") as e:
        load_loras([foreign], ours.params)
    assert "\n" not in str(e.value)
    for layout in ("diffusers", "bfl", "kohya"):
        with pytest.raises(FluxKleinError, match=rf"is for {title}.*the model is {other_title}"):
            load_loras([files[layout]], released_params(other))


def test_lora_info_names_the_family_and_convert_round_trips_through_diffusers(setup, tmp_path):
    """`lora info` reads the family from the keys; `lora convert` writes the family's files through the same
    tables: diffusers layout -> comfyui -> kohya -> diffusers, each read by us as the same LoRA, the last one
    loaded by diffusers' own loader to the source's output; where diffusers' converter reads only a comfyui
    file's block names (FLUX 3), it reads it as the BFL block-only file of the same adapter."""
    name, _, reference, _, _, files, _, _ = setup
    flow_map = reference.config.get("flow_map", False)
    for layout in ("diffusers", "bfl", "kohya"):
        d = describe_lora(files[layout])
        assert d["model"].startswith(f"a {FAMILIES[name].title} transformer of hidden size 64"), d["model"]
        ranks = sorted({v.shape[0] for k, v in load_file(files[layout]).items() if re.search(r"lora_(A|down)\.", k)})
        assert ("distilled" in d["model"]) == flow_map and d["ranks"] == ranks
        assert d["alphas"] == (ranks if layout == "bfl" else [r * ALPHA / RANK for r in ranks])  # bfl: folded in B
    chain, source = [], files["diffusers"]
    for layout in ("comfyui", "kohya", "diffusers"):
        source = str(convert_lora(source, tmp_path / f"{layout}.safetensors", layout))
        chain.append(source)
    want = theirs(setup, [(files["diffusers"], 1.0)])
    for path in chain:
        assert rel_err(ours_with(setup, [(path, 1.0)]), want) <= 2e-5, path
    assert rel_err(theirs(setup, [(chain[-1], 1.0)]), want) <= 1e-6
    judge = KITS[name].lora.comfyui_judge
    if judge is not None:
        assert rel_err(theirs(setup, [(chain[0], 1.0)]), theirs(setup, [(files[judge], 1.0)])) <= 1e-6


def test_lokr_fused_update_equals_numpy(setup, tmp_path):
    """LyCORIS LoKr in the family's namings (whole and factorised factors, alpha scaling only a decomposed one):
    the fused update of each layer equals numpy's kron x the scale, in our row order (fused rows, the final
    layer's halves swapped); every other weight is untouched."""
    name, _, _, ours, _, _, _, _ = setup
    path = tmp_path / "lokr.safetensors"
    expected = KITS[name].lora.lokr(path, Rand(21), ours.params)
    before = {k: np.array(v) for k, v in tree_flatten(ours.parameters())}
    lora = load_loras([(path, 0.5)], ours.params)[0]
    assert lora.format == "lokr"
    apply_loras(ours, [lora])
    try:
        after = dict(tree_flatten(ours.parameters()))
        for k, b in before.items():
            layer = k.removesuffix(".weight")
            want = b + 0.5 * expected[layer] if layer in expected else b
            assert np.abs(np.array(after[k]) - want).max() <= 1e-6, k
    finally:
        remove_loras(ours)
    assert all(np.array_equal(np.array(v), before[k]) for k, v in tree_flatten(ours.parameters()))
