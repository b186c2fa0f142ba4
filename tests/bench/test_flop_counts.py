"""The benchmark's FLOP counts against torch's FLOP counter: FLUX 3 Image Klein's pass on diffusers'
Flux3Transformer2DModel (its mode blocks, flow map or not) and its text tower on transformers' Qwen3; Base's
once-per-image share; FLUX 3's released rows and a random FLUX 3 pipeline made through its family. The
`benchmark` command on both families' tiny snapshots is tested once for both in test_benchmark.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_flux3 import FLUX3_TRANSFORMER
from torch.utils import flop_counter

from flux_klein_mlx.bench import command as bm
from flux_klein_mlx.bench import flops
from flux_klein_mlx.bench.random_model import random_pipeline
from flux_klein_mlx.family import FLUX3, all_variants
from flux_klein_mlx.models.config import AutoEncoderConfig, Qwen3Config
from flux_klein_mlx.models.flux3.config import FLUX3_VARIANTS, Flux3Params
from flux_klein_mlx.models.flux3.transformer import linear_shapes

# MLX's CPU attention op is not in torch's table: count it as torch counts every other SDPA (4·B·H·Lq·Lk·hd).
CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def torch_flops(run) -> dict[str, int]:
    """torch's FLOP count of `run()` by module path (each path's total, its submodules included)."""
    with torch.no_grad(), flop_counter.FlopCounterMode(display=False, custom_mapping={CPU_SDPA: _sdpa_flops}) as c:
        run()
    return {name: sum(counts.values()) for name, counts in c.get_flop_counts().items()}


def module_total(counted: dict[str, int], path: str) -> int:
    """torch's count of module `path` and everything below it (a ModuleList or ModuleDict is never called, so
    it has no entry of its own: its called children are summed, each once)."""
    inside = [k for k in counted if k == path or k.startswith(path + ".")]
    return sum(counted[k] for k in inside if not any(k.startswith(o + ".") for o in inside))


@pytest.mark.parametrize("flow_map", [False, True])
@pytest.mark.parametrize("tokens", [(12, 10, 0), (20, 7, 6), (6, 30, 18)])  # (image, text, reference)
def test_flux3_pass_flops_equal_torch_counter_on_diffusers(flow_map, tokens):
    """Each part of our count equals torch's count of the same modules of diffusers' model, and the rest of
    diffusers' work is only the per-sample time embedders and modulation heads that the count leaves out."""
    from diffusers import Flux3Transformer2DModel

    N, T, R = tokens
    torch.manual_seed(0)
    model = Flux3Transformer2DModel(**FLUX3_TRANSFORMER, flow_map=flow_map).eval()
    C, ctx = FLUX3_TRANSFORMER["in_channels"], FLUX3_TRANSFORMER["joint_attention_dim"]
    refs = dict(image_cond_hidden_states=torch.randn(1, R, C), image_cond_ids=torch.zeros(R, 4)) if R else {}
    target = dict(target_timestep=torch.tensor([0.3])) if flow_map else {}
    counted = torch_flops(
        lambda: model(
            torch.randn(1, N, C),
            torch.randn(1, T, ctx),
            torch.tensor([0.5]),
            torch.zeros(N, 4),
            torch.zeros(T, 4),
            **refs,
            **target,
        )  # fmt: skip
    )

    def of(*names: str) -> int:
        return sum(module_total(counted, f"Flux3Transformer2DModel.{n}") for n in names)

    ours = flops.flux3_pass_flops(
        Flux3Params.from_dict({**FLUX3_TRANSFORMER, "flow_map": flow_map}),
        image_tokens=N,
        text_tokens=T,
        reference_tokens=R,
    )
    assert ours["text"].total == of("context_embedder", "txt_mode_blocks")
    assert ours["image"].total == of("x_embedders.image", "mode_blocks.image", "single_transformer_blocks", "proj_out")
    assert ours["references"].total == of("x_embedders.image_cond", "mode_blocks.image_cond")
    left_out = of(
        "timestep_embedder",
        "target_timestep_embedder",
        "early_stream_modulations",
        "single_stream_modulations",
        "norm_out",
    )
    assert sum(p.total for p in ours.values()) + left_out == counted["Global"]


def test_flux3_text_encoder_flops_equal_torch_counter_on_qwen3():
    """32 layers on an 80-token window: the linear part equals torch's count of transformers' Qwen3 layers;
    the attention part is half of torch's (a causal mask: only the lower triangle is work)."""
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3Model

    ours_config = Qwen3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, rope_theta=5e6,
    )  # fmt: skip
    hf = Qwen3Model(HFQwen3Config(**dataclasses.asdict(ours_config), attn_implementation="sdpa")).eval()
    counted = torch_flops(lambda: hf(input_ids=torch.zeros(1, 80, dtype=torch.long)))
    layers = [f"Qwen3Model.layers.{i}" for i in range(32)]
    products = [f"{layer}.mlp" for layer in layers] + [
        f"{layer}.self_attn.{p}_proj" for layer in layers for p in "qkvo"
    ]
    sdpa = module_total(counted, "Qwen3Model.layers") - sum(module_total(counted, m) for m in products)
    ours = flops.flops_of_text_encoder(ours_config, layers=max(FLUX3.text_taps), tokens=80)
    assert max(FLUX3.text_taps) == 32
    assert ours.linear == counted["Global"] - sdpa
    assert ours.attention == sdpa / 2


def test_base_counts_its_text_and_references_once_per_image():
    """Base: a step is the image's part of each pass (cond and uncond); the text of each window and the
    references once run once per image. The distilled flow map runs every part in every pass."""
    base, distilled = FLUX3_VARIANTS["flux3-klein-base"].transformer, FLUX3_VARIANTS["flux3-klein"].transformer
    shapes = dict(image_tokens=4096, reference_tokens=4096)
    cond, uncond = (flops.flux3_pass_flops(base, text_tokens=T, **shapes) for T in (160, 80))
    step, once = flops.denoise_flops("flux3", base, text_tokens=[160, 80], **shapes)
    assert step.total == pytest.approx(cond["image"].total + uncond["image"].total, rel=1e-12)
    assert once.total == pytest.approx(cond["text"].total + uncond["text"].total + cond["references"].total, rel=1e-12)
    step, once = flops.denoise_flops("flux3", distilled, text_tokens=[80], **shapes)
    parts = flops.flux3_pass_flops(distilled, text_tokens=80, **shapes)
    assert once.total == 0 and step.total == pytest.approx(sum(p.total for p in parts.values()), rel=1e-12)


def test_released_rows_have_the_published_sizes():
    """The rows of FLUX 3 Image Klein: 5.549 B (distilled, with its target-time embedder) and 5.538 B (Base)
    transformer parameters (docs/flux3.md), Qwen3-VL-4B's language tower, FLUX.2's VAE; both in the
    benchmark's table beside FLUX.2's."""
    rows = all_variants()
    for name, billions in (("flux3-klein", 5.549), ("flux3-klein-base", 5.538)):
        row = rows[name]
        count = sum(o * i for o, i in linear_shapes(row.transformer).values())
        assert count / 1e9 == pytest.approx(billions, abs=0.0015)  # the Linear weights: all but a few vectors
        assert row.transformer.flow_map == row.distilled == (name == "flux3-klein")
        assert (row.steps, row.guidance) == FLUX3.defaults(row.distilled)
    te = rows["flux3-klein"].text_encoder
    assert (te.hidden_size, te.intermediate_size, te.num_hidden_layers) == (2560, 9728, 36)
    assert (te.num_attention_heads, te.num_key_value_heads, te.head_dim, te.rope_theta) == (32, 8, 128, 5e6)
    assert te.vocab_size == 151936 and te.tie_word_embeddings
    assert rows["flux3-klein"].vae == AutoEncoderConfig() and "klein-4b" in rows


def test_random_flux3_pipeline_is_made_through_its_family():
    """A FLUX 3 row (here with tiny shapes) builds a FLUX 3 pipeline: its family, its window, its steps."""
    row = dataclasses.replace(
        FLUX3_VARIANTS["flux3-klein-base"],
        transformer=Flux3Params.from_dict(FLUX3_TRANSFORMER),  # its text input: 8 taps x the hidden 16 below
        text_encoder=Qwen3Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=1000,
            rope_theta=5e6,
        ),  # fmt: skip
        vae=AutoEncoderConfig(block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=8),
    )
    pipe = random_pipeline(row, quantize=4)
    assert pipe.info.family is FLUX3 and pipe.info.name == "FLUX 3 Image Klein Base"
    assert pipe.info.default_steps == 50
    r = bm.run_benchmark(pipe, width=64, height=64, steps=1, warmup=0, trials=1, decode=False)
    assert r["config"]["text_tokens_per_pass"] == [80, 80] and r["config"]["quantize"] == 4
    assert "once_per_image" in r["stages"]
