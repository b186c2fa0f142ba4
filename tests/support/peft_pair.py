"""The same random LoRA on our transformer and on diffusers' with peft's adapters: the pair the training
tests judge the loss and every adapter's gradient by, written once for every family (issue 45)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import torch

from flux_klein_mlx.run.components import load_component
from flux_klein_mlx.run.loading import describe
from flux_klein_mlx.train.step.adapters import attach_lora, parse_targets


def lora_pair(snapshot, reference_class, *, rank: int, alpha: float):
    """(our float32 transformer, its LoRA on every Linear, diffusers' `reference_class` with peft's LoRA of the
    same values): A ~ N(0, 1/in), B ~ 0.3 N(0, 1/rank) (non-zero, so the gradients of A show)."""
    from peft import LoraConfig

    model = load_component(describe(snapshot), "transformer", mx.float32)
    slots = parse_targets("all", model.params)
    lora = attach_lora(model, slots, rank=rank, alpha=alpha, rng=np.random.default_rng(1))
    ref = reference_class.from_pretrained(snapshot / "transformer", dtype=torch.float32).eval()
    ref.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=[s.name for s in slots])
    )
    g = np.random.default_rng(2)
    values = {}
    for s in slots:
        a = (g.standard_normal((rank, s.in_dims)) / math.sqrt(s.in_dims)).astype(np.float32)
        b = (0.3 * g.standard_normal((s.out_dims, rank)) / math.sqrt(rank)).astype(np.float32)
        values[f"{s.name}.down"], values[f"{s.name}.up"] = mx.array(a), mx.array(b)
        m = ref.get_submodule(s.name)
        m.lora_A["default"].weight.data.copy_(torch.from_numpy(a))
        m.lora_B["default"].weight.data.copy_(torch.from_numpy(b))
    lora.load(values, "test values")
    return model, lora, ref
