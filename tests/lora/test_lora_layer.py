"""The one LoRA layer (lora/layers.py) on its own: trainable LoRA and LoKr terms on row ranges of a
float or quantized layer, judged against torch (the dense update, autograd), and the frozen terms'
invisibility to the parameter tree."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

from flux_klein_mlx.lora.formats import Term
from flux_klein_mlx.lora.layers import ROLE_LISTS, LoRALinear

OUT, IN = 96, 64  # a fused qkv of D = 32: row blocks [0:32], [32:64], [64:96]


def factors(rng):
    """A LoRA pair on k's rows, a LoKr term (w2 a low-rank pair) on v's rows, a whole-w2 LoKr on all rows."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.3  # noqa: E731
    return [
        ((32, 64), 0.5, {"down": f(4, IN), "up": f(32, 4)}),
        ((64, 96), 2.0, {"w1": f(4, 8), "w2_a": f(8, 2), "w2_b": f(2, 8)}),  # kron (4, 8) x (8, 8) -> (32, 64)
        ((0, 96), 1.0, {"w1": f(3, 4), "w2": f(32, 16)}),  # kron (3, 4) x (32, 16) -> (96, 64)
    ]


def torch_reference(W, x, terms):
    """y = x @ (W + sum factor · delta on its rows).T and the gradients of sum(y^2) by every factor."""
    ts = [{k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in fs.items()} for _, _, fs in terms]
    full = torch.tensor(W, dtype=torch.float64).clone()
    for (rows, factor, _), t in zip(terms, ts, strict=True):
        if "down" in t:
            delta = t["up"] @ t["down"]
        else:
            delta = torch.kron(t["w1"], t["w2"] if "w2" in t else t["w2_a"] @ t["w2_b"])
        pad = torch.zeros(OUT, IN, dtype=torch.float64)
        pad[rows[0] : rows[1]] = delta
        full = full + factor * pad
    y = torch.tensor(x, dtype=torch.float64) @ full.T
    (y**2).sum().backward()
    return y.detach().numpy(), [{k: v.grad.numpy() for k, v in t.items()} for t in ts]


@pytest.mark.parametrize(
    "quantized, dtype, tol", [(False, mx.float32, 1e-4), (True, mx.float32, 1e-4), (False, mx.bfloat16, 3e-2)]
)
def test_trainable_lora_and_lokr_terms_match_torch(quantized, dtype, tol):
    """Float32 masters, the side path in the activation dtype (bfloat16 rounds it: the looser bound)."""
    rng = np.random.default_rng(0)
    base = nn.Linear(IN, OUT, bias=False)
    base.weight = mx.array(rng.standard_normal((OUT, IN)).astype(np.float32) * 0.1)
    if quantized:
        base = nn.QuantizedLinear.from_linear(base, group_size=32, bits=8)
    else:
        base.set_dtype(dtype)
    W = np.array(
        mx.dequantize(base.weight, base.scales, base.biases, 32, 8) if quantized else base.weight.astype(mx.float32)
    )
    x = rng.standard_normal((2, 5, IN)).astype(np.float32)
    terms = factors(rng)
    layer = LoRALinear(base)
    for rows, factor, fs in terms:
        layer.add_trainable(rows, factor, {k: mx.array(v) for k, v in fs.items()})
    want, grads = torch_reference(W, x, terms)

    def loss(params):
        layer.update(params)
        return (layer(mx.array(x).astype(dtype)).astype(mx.float32) ** 2).sum()

    value, got = mx.value_and_grad(loss)(layer.trainable_parameters())
    flat = dict(tree_flatten(got))
    assert set(flat) == {f"{n}.0" for n in ("lora_A", "lora_B", "lokr_w1", "lokr_w2_a", "lokr_w2_b", "lokr_w2")} | {
        "lokr_w1.1"
    }
    assert abs(value.item() - (want**2).sum()) / (want**2).sum() < tol
    for term, g in zip(layer.trainable, grads, strict=True):
        for role, ref in g.items():
            ours = np.array(flat[layer.factor_path(term, role)])
            assert layer.trainable_parameters()[ROLE_LISTS[role]][term.places[role]].dtype == mx.float32
            err = np.abs(ours - ref).max() / np.abs(ref).max()
            print(f"quantized={quantized} {dtype} {role}: rel {err:.1e}")
            assert err < tol, role


def test_frozen_terms_are_not_parameters_and_base_comes_back():
    rng = np.random.default_rng(1)
    base = nn.QuantizedLinear.from_linear(nn.Linear(IN, OUT, bias=False), group_size=32, bits=4)
    term = Term(
        "x",
        (0, 32),
        1.0,
        down=mx.array(rng.standard_normal((4, IN)).astype(np.float32)),
        up=mx.array(rng.standard_normal((32, 4)).astype(np.float32)),
    )
    layer = LoRALinear(base, [term])
    assert {k for k, _ in tree_flatten(layer.parameters())} == {k for k, _ in tree_flatten(base.parameters())}
    assert not tree_flatten(layer.trainable_parameters()) and layer.base is base
    x = mx.array(rng.standard_normal((3, IN)).astype(np.float32))
    want = base(x) + mx.pad((x @ term.down.T) @ term.up.T, [(0, 0), (0, OUT - 32)])
    assert mx.allclose(layer(x), want, atol=1e-5).item()
