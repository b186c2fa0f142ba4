"""FLUX 3 Image Klein's LoRAs where FLUX.2 has no twin: a LoRA of the flow map's target-time embedder (ref_time_in)
was trained on the distilled model and is refused on the Base in every layout; `lora info` names the released
FLUX 3 (distilled when it adapts ref_time_in) and refuses its shapes on the tiny model naming FLUX 3's released
size. The LoRAs both families take are tests/lora/test_lora_transformer.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from command_line import run_cli
from safetensors.torch import save_file
from tiny_loras import LORAS, peft_adapter, save_bfl, save_diffusers, save_kohya
from tiny_transformers import TRANSFORMERS

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.lora.apply import load_loras
from flux_klein_mlx.models.flux3.config import Flux3Params

TWIN, LORA = TRANSFORMERS["flux3"], LORAS["flux3"]
TINY = dict(TWIN.CONFIGS["g64"], mlp_ratio=3.0, rope_theta=10000, eps=1e-6)  # the g64 model's config


def test_distilled_only_lora_on_the_base_is_refused(tmp_path):
    """A LoRA of the target-time embedder (ref_time_in) was trained on the distilled (flow-map) model: on the Base it
    is refused, saying so, in every layout; the distilled model takes it."""
    sd, config = peft_adapter(TWIN.reference("g64-fm1", seed=LORA.seed), seed=13)
    assert any(k.startswith("target_timestep_embedder.") for k in sd)
    (tmp_path / "d").mkdir()
    bfl = LORA.bfl(sd)
    paths = [save_diffusers(LORA.mixin, tmp_path / "d", sd, config), save_bfl(tmp_path / "b.safetensors", bfl)]
    paths.append(save_kohya(tmp_path / "k.safetensors", bfl))
    base = Flux3Params.from_dict({**TINY, "flow_map": False})
    for path in paths:
        with pytest.raises(FluxKleinError, match=r"adapts .*ref_time_in.* trained on the distilled model") as e:
            load_loras([path], base)
        assert "\n" not in str(e.value)
        assert load_loras([path], dataclasses.replace(base, flow_map=True))[0].terms


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
    tiny = Flux3Params.from_dict({**TINY, "flow_map": True})
    with pytest.raises(FluxKleinError, match=r"was made for FLUX 3 Image Klein \(hidden size 3072\), but the model"):
        load_loras([base], tiny)
