"""FLUX 3 Image Klein LoRAs: diffusers/PEFT, BFL (ComfyUI / ai-toolkit) and kohya files read by our lora/ machinery
and applied to our Flux3, judged by diffusers' Flux3Transformer2DModel carrying the same adapter through its own
FLUX 3 loader; two LoRAs at once with scales; the side path on a 4-bit model; the cross-family and Base refusals;
`lora info` / `lora convert` on FLUX 3 files.

The adapters are made by peft on the diffusers model (LoraConfig on every Linear, rank 4, alpha 8, random B) and
saved by diffusers (`Flux3LoraLoaderMixin.save_lora_weights`). The BFL and kohya files are the same adapter under
the inverse name table: BFL `diffusion_model.<ours>.lora_A/B.weight` with alpha / rank folded into B (ComfyUI's
convention: no alpha), kohya `lora_unet_<ours, underscored>.lora_down/up.weight` + `.alpha`; the final layer's up
rows rolled from diffusers' [scale ; shift] to BFL's [shift ; scale].
"""

from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch
from command_line import run_cli
from diffusers import Flux3Transformer2DModel
from diffusers.loaders import Flux3LoraLoaderMixin
from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from refs import randomize_, rel_err, to_mx
from safetensors.torch import save_file

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.lora.apply import apply_loras, load_loras, remove_loras
from flux_klein_mlx.lora.convert import convert_lora, describe_lora
from flux_klein_mlx.lora.layers import LoRALinear
from flux_klein_mlx.models.flux3.config import Flux3Params
from flux_klein_mlx.models.flux3.transformer import (
    Flux3,
    flux3_name,
    infer_flux3_params,
    linear_shapes,
    sanitize_flux3_weights,
)
from flux_klein_mlx.models.quantize import dequantize_model, quantize_model
from flux_klein_mlx.storage.weights import load_into

# flux3.md section 4's group-64-safe tiny config: D 64 = 2 heads x 32
CONFIG = dict(in_channels=32, cond_in_channels=32, num_layers=2, num_single_layers=2, attention_head_dim=32,
              num_attention_heads=2, joint_attention_dim=128, timestep_channels=256, axes_dims_rope=(8, 8, 8, 8),
              mlp_ratio=3.0, rope_theta=10000, eps=1e-6)  # fmt: skip
RANK, ALPHA = 4, 8.0


def reference_model(flow_map: bool) -> Flux3Transformer2DModel:
    torch.manual_seed(0)
    return randomize_(Flux3Transformer2DModel(**CONFIG, flow_map=flow_map), seed=3 + flow_map).eval()


def load_ours(reference: Flux3Transformer2DModel) -> Flux3:
    weights = sanitize_flux3_weights({k: to_mx(v) for k, v in reference.state_dict().items()})
    model = Flux3(infer_flux3_params(weights))
    load_into(model, weights, "transformer")
    return model


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def peft_adapter(reference: Flux3Transformer2DModel, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A random LoRA on every Linear made by peft on a copy of the reference: (diffusers' state dict, its config)."""
    model = copy.deepcopy(reference)
    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=linear_names(model), init_lora_weights=False)
    model.add_adapter(config)
    with torch.no_grad():  # peft's B is random with init_lora_weights=False; make A and B O(1/sqrt(fan_in))
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    return get_peft_model_state_dict(model), config.to_dict()


def save_diffusers(folder, sd, config) -> str:
    """What diffusers' training scripts write: `save_lora_weights` with the adapter's config as metadata."""
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    Flux3LoraLoaderMixin.save_lora_weights(folder, sd, transformer_lora_adapter_metadata=config)
    return str(folder / "pytorch_lora_weights.safetensors")


def roll_final(name: str, up: torch.Tensor) -> torch.Tensor:
    """diffusers' norm_out rows [scale ; shift] -> BFL's [shift ; scale]."""
    return torch.roll(up, up.shape[0] // 2, 0) if name == "norm_out.linear" else up


def save_bfl(path, sd, *, prefix="diffusion_model.", blocks_only=False) -> str:
    """ComfyUI / ai-toolkit: BFL names, alpha / rank folded into B (no alpha key: alpha = rank)."""
    out = {}
    for key, value in sd.items():
        name, role = key.rsplit(".lora_", 1)
        if blocks_only and "blocks." not in name:
            continue
        value = roll_final(name, value) * ALPHA / RANK if role.startswith("B") else value
        out[f"{prefix}{flux3_name(name)}.lora_{role}"] = value.contiguous()
    save_file(out, path)
    return str(path)


def save_kohya(path, sd) -> str:
    """kohya / musubi-tuner: `lora_unet_` + our names with underscores, lora_down / lora_up, alpha per module."""
    out = {}
    for key, value in sd.items():
        name, role = key.rsplit(".lora_", 1)
        stem = "lora_unet_" + flux3_name(name).replace(".", "_")
        up = role.startswith("B")
        out[f"{stem}.lora_{'up' if up else 'down'}.weight"] = (roll_final(name, value) if up else value).contiguous()
        out[f"{stem}.alpha"] = torch.tensor(ALPHA)
    save_file(out, path)
    return str(path)


def inputs(seed=5):
    """Batch 2 with different t, one reference (l = -1), a non-square target grid."""
    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(2, 10, CONFIG["joint_attention_dim"], generator=g)
    img_ids, ref_ids = _prepare_image_ids(3, 5, 0.5), _prepare_image_ids(2, 3, 0.5, l_coord=-1)
    img = torch.randn(2, img_ids.shape[0], 32, generator=g)
    ref = torch.randn(2, ref_ids.shape[0], 32, generator=g)
    return img, txt, Flux3TextRoPEInputsStep._prepare_text_ids(txt), img_ids, ref, ref_ids


def theirs(model, x, flow_map):
    img, txt, txt_ids, img_ids, ref, ref_ids = x
    target = torch.tensor([0.55, 0.1]) if flow_map else None
    with torch.no_grad():
        return model(img, txt, torch.tensor([0.7, 0.3]), img_ids, txt_ids, ref, ref_ids, target, return_dict=False)[0]


def mine(model, x):
    img, txt, txt_ids, img_ids, ref, ref_ids = (to_mx(a) for a in x)
    target = mx.array([0.55, 0.1]) if model.params.flow_map else None
    return model(img, txt, mx.array([0.7, 0.3]), img_ids, txt_ids, ref, ref_ids, target)


def diffusers_with(reference, files: list[tuple[str, float]]):
    """diffusers' FLUX 3 LoRA loading, as `Flux3ModularPipeline.load_lora_weights` does it (its two steps:
    `Flux3LoraLoaderMixin.lora_state_dict`, which converts BFL names, then `load_lora_into_transformer`), then
    `set_adapters` with the scales."""
    model = copy.deepcopy(reference)
    names = []
    for i, (path, _) in enumerate(files):
        sd, metadata = Flux3LoraLoaderMixin.lora_state_dict(path, return_lora_metadata=True)
        assert all("lora" in k for k in sd)  # load_lora_weights' own check
        Flux3LoraLoaderMixin.load_lora_into_transformer(sd, transformer=model, adapter_name=f"a{i}", metadata=metadata)
        names.append(f"a{i}")
    model.set_adapters(names, weights=[s for _, s in files])
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["base", "flowmap"])
def setup(request, tmp_path_factory):
    """(reference, our model, its inputs, {layout: file} of one adapter, a second adapter's diffusers file)."""
    flow_map = request.param
    reference = reference_model(flow_map)
    folder = tmp_path_factory.mktemp(f"f3lora{flow_map:d}")
    sd, config = peft_adapter(reference, seed=11)
    (folder / "a").mkdir()
    (folder / "b").mkdir()
    files = {
        "diffusers": save_diffusers(folder / "a", sd, config),
        "bfl": save_bfl(folder / "bfl.safetensors", sd),
        "bfl-model-prefix": save_bfl(folder / "bflm.safetensors", sd, prefix="model.diffusion_model."),
        "bfl-blocks": save_bfl(folder / "bflb.safetensors", sd, blocks_only=True),
        "kohya": save_kohya(folder / "kohya.safetensors", sd),
    }
    second = save_diffusers(folder / "b", *peft_adapter(reference, seed=12))
    return reference, load_ours(reference), inputs(), files, second


def ours_with(model, files: list[tuple[str, float]]):
    apply_loras(model, load_loras(files, model.params))
    try:
        return mine(model, inputs())
    finally:
        remove_loras(model)


def test_every_linear_is_adapted(setup):
    reference, ours, _, files, _ = setup
    lora = load_loras([files["diffusers"]], ours.params)[0]
    assert lora.format == "diffusers"
    assert {t.layer for t in lora.terms} == set(linear_shapes(ours.params))
    assert len(lora.terms) == len(linear_names(reference))


# which file diffusers loads for each of our files (the same adapter): diffusers reads diffusers/PEFT files and
# BFL block names itself; kohya FLUX 3 names and BFL's non-block names (time_in, final_layer, ...) it does not
# convert (`_convert_non_diffusers_flux3_lora_to_diffusers` maps only block linears), so those are judged
# against diffusers with the diffusers file of the same adapter.
JUDGE = {"diffusers": "diffusers", "bfl-blocks": "bfl-blocks", "bfl": "diffusers", "bfl-model-prefix": "diffusers",
         "kohya": "diffusers"}  # fmt: skip


@pytest.mark.parametrize("layout", list(JUDGE))
def test_layout_matches_diffusers(setup, layout):
    reference, ours, x, files, _ = setup
    flow_map = reference.config.flow_map
    want = theirs(diffusers_with(reference, [(files[JUDGE[layout]], 1.0)]), x, flow_map)
    base = theirs(reference, x, flow_map)
    got = ours_with(ours, [(files[layout], 1.0)])
    effect = float((want - base).abs().max() / base.abs().max())
    err = rel_err(got, want)
    print(f"{layout} (flow_map {flow_map}): LoRA effect {effect:.2f}, ours vs diffusers rel {err:.1e}")
    assert effect > 0.05  # the LoRA changes the output
    assert err <= 2e-5


def test_two_loras_with_scales_match_set_adapters(setup):
    reference, ours, x, files, second = setup
    flow_map = reference.config.flow_map
    want = theirs(diffusers_with(reference, [(files["diffusers"], 0.7), (second, 1.3)]), x, flow_map)
    got = ours_with(ours, [(files["kohya"], 0.7), (second, 1.3)])  # mixed layouts too
    err = rel_err(got, want)
    print(f"two LoRAs 0.7 + 1.3 (flow_map {flow_map}): rel {err:.1e}")
    assert err <= 2e-5


def test_quantized_side_path_equals_dequantized_fused(setup):
    """4-bit group 64: the quantized layers keep their packed weights and get the LoRA as a side path; equal to
    the same dequantized weights with the LoRA fused (kernel rounding), close to the float model's LoRA output."""
    reference, ours, x, files, second = setup
    loras = load_loras([(files["bfl"], 0.9), (second, 1.1)], ours.params)
    model = load_ours(reference)
    quantize_model(model, 4, group_size=64)
    apply_loras(model, loras)
    wrapped = [p for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) >= 50
    fused = copy.deepcopy(model)
    remove_loras(fused)
    dequantize_model(fused)
    apply_loras(fused, loras)
    got, want = mine(model, x), mine(fused, x)
    apply_loras(ours, loras)
    float_fused = mine(ours, x)
    remove_loras(ours)
    err, drift = rel_err(got, want), rel_err(got, float_fused)
    print(f"4-bit side path vs dequantized+fused: rel {err:.1e}; vs the float model + LoRA: rel {drift:.2e}")
    assert err <= 1e-5
    assert drift <= 0.25  # the 4-bit error itself (tests/models/test_transformer.py: 0.15 without a LoRA)


def test_lora_for_the_other_family_is_refused_naming_both(setup, tmp_path):
    from flux_klein_mlx.models.flux2.config import FluxKleinParams

    _, ours, _, files, _ = setup
    flux2 = tmp_path / "flux2.safetensors"
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4),
        },
        flux2,
    )
    with pytest.raises(FluxKleinError, match=r"is for FLUX\.2 \[klein\].*the model is FLUX 3 Image Klein") as e:
        load_loras([flux2], ours.params)
    assert "\n" not in str(e.value)
    for layout in ("diffusers", "bfl", "kohya"):
        with pytest.raises(FluxKleinError, match=r"is for FLUX 3 Image Klein.*the model is FLUX\.2 \[klein\]"):
            load_loras([files[layout]], FluxKleinParams.klein_4b())


def test_distilled_only_lora_on_the_base_is_refused(tmp_path):
    """A LoRA of the target-time embedder (ref_time_in) was trained on the distilled (flow-map) model: on the Base it
    is refused, saying so, in every layout; the distilled model takes it."""
    sd, config = peft_adapter(reference_model(True), seed=13)
    assert any(k.startswith("target_timestep_embedder.") for k in sd)
    (tmp_path / "d").mkdir()
    paths = [save_diffusers(tmp_path / "d", sd, config), save_bfl(tmp_path / "b.safetensors", sd)]
    paths.append(save_kohya(tmp_path / "k.safetensors", sd))
    base = Flux3Params.from_dict({**CONFIG, "flow_map": False})
    for path in paths:
        with pytest.raises(FluxKleinError, match=r"adapts .*ref_time_in.* trained on the distilled model") as e:
            load_loras([path], base)
        assert "\n" not in str(e.value)
        assert load_loras([path], dataclasses.replace(base, flow_map=True))[0].terms


def test_lora_info_says_flux3_and_convert_round_trips_through_diffusers(setup, tmp_path):
    """`lora info` reads the family from the keys; `lora convert` writes FLUX 3 files through the same tables:
    diffusers layout -> comfyui -> kohya -> diffusers, each read by us as the same LoRA, the last one loaded by
    diffusers' own loader to the source's output; the comfyui file's block names read by diffusers' converter
    (which drops its other names: `.lin`, `time_in`, ...) as the BFL block-only file of the same adapter."""
    reference, ours, x, files, _ = setup
    flow_map = reference.config.flow_map
    for layout in ("diffusers", "bfl", "kohya"):
        d = describe_lora(files[layout])
        assert d["model"].startswith("a FLUX 3 Image Klein transformer of hidden size 64"), d["model"]
        assert ("distilled" in d["model"]) == flow_map and d["ranks"] == [RANK]
        assert d["alphas"] == [RANK if layout == "bfl" else ALPHA]  # ComfyUI's: alpha / rank folded into B
    chain, source = [], files["diffusers"]
    for layout in ("comfyui", "kohya", "diffusers"):
        source = str(convert_lora(source, tmp_path / f"{layout}.safetensors", layout))
        chain.append(source)
    want = theirs(diffusers_with(reference, [(files["diffusers"], 1.0)]), x, flow_map)
    for path in chain:
        assert rel_err(ours_with(ours, [(path, 1.0)]), want) <= 2e-5, path
    assert rel_err(theirs(diffusers_with(reference, [(chain[-1], 1.0)]), x, flow_map), want) <= 1e-6
    blocks = theirs(diffusers_with(reference, [(files["bfl-blocks"], 1.0)]), x, flow_map)
    assert rel_err(theirs(diffusers_with(reference, [(chain[0], 1.0)]), x, flow_map), blocks) <= 1e-6


def test_cli_lora_info_names_the_released_flux3_and_a_foreign_size(tmp_path, capsys):
    """A released-size FLUX 3 file: `lora info` prints FLUX 3 Image Klein (distilled when it adapts ref_time_in);
    on the tiny FLUX 3 model its shapes are refused naming FLUX 3's released size, not FLUX.2's 3072."""
    D = Flux3Params().hidden_size
    base = tmp_path / "base.safetensors"
    pair = {"diffusion_model.content_mode_blocks.image.1.q_proj.lora_A.weight": torch.zeros(1, D),
            "diffusion_model.content_mode_blocks.image.1.q_proj.lora_B.weight": torch.zeros(D, 1)}  # fmt: skip
    save_file(pair, str(base))
    distilled = tmp_path / "distilled.safetensors"
    save_file({**pair, "lora_unet_ref_time_in_in_layer.lora_down.weight": torch.zeros(1, 256),
               "lora_unet_ref_time_in_in_layer.lora_up.weight": torch.zeros(D, 1)}, str(distilled))  # fmt: skip
    for path, model in (
        (base, "FLUX 3 Image Klein"),
        (distilled, "FLUX 3 Image Klein (distilled: it adapts ref_time_in)"),
    ):
        code, out, err = run_cli(capsys, "lora", "info", path)
        assert code == 0, err
        assert f"model:      {model}\n" in out, out
    tiny = Flux3Params.from_dict({**CONFIG, "flow_map": True})
    with pytest.raises(FluxKleinError, match=r"was made for FLUX 3 Image Klein \(hidden size 3072\), but the model"):
        load_loras([base], tiny)


def test_lokr_on_flux3_names_equals_numpy(setup, tmp_path):
    """LyCORIS LoKr on FLUX 3 names (BFL, diffusers' norm_out with its halves swapped, LyCORIS' underscored prefix with
    a low-rank w2 and alpha): the fused update of each layer equals numpy's kron, in our row order."""
    _, ours, _, _, _ = setup
    g = torch.Generator().manual_seed(21)

    def mat(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    w1, w2, n1, n2, v1, a, b = mat(4, 4), mat(96, 16), mat(2, 2), mat(64, 32), mat(4, 8), mat(16, 3), mat(3, 8)
    mlp, out = "content_mode_blocks.image_cond.1.mlp_in", "lycoris_single_blocks_0_attn_out"
    sd = {
        f"{mlp}.lokr_w1": w1,
        f"{mlp}.lokr_w2": w2,
        "norm_out.linear.lokr_w1": n1,
        "norm_out.linear.lokr_w2": n2,
        f"{out}.lokr_w1": v1,
        f"{out}.lokr_w2_a": a,
        f"{out}.lokr_w2_b": b,
        f"{out}.alpha": torch.tensor(1.5),
    }
    path = tmp_path / "lokr.safetensors"
    save_file(sd, str(path))
    final = np.kron(n1.numpy(), n2.numpy())
    expected = {
        "content_mode_blocks.image_cond.1.mlp_in": np.kron(w1.numpy(), w2.numpy()),
        "final_layer.image.adaLN_modulation.1": np.roll(final, final.shape[0] // 2, 0),  # [shift ; scale]
        "single_blocks.0.attn_out": 0.5 * np.kron(v1.numpy(), (a @ b).numpy()),  # alpha 1.5 / rank 3
    }
    layers = dict(ours.named_modules())
    before = {k: np.array(layers[k].weight) for k in expected}
    lora = load_loras([path], ours.params)[0]
    assert lora.format == "lokr"
    apply_loras(ours, [lora])
    try:
        for k, delta in expected.items():
            err = np.abs(np.array(layers[k].weight) - before[k] - delta).max()
            assert err <= 1e-6, (k, err)
    finally:
        remove_loras(ours)
