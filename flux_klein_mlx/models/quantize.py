"""Group-wise affine weight quantization (4 or 8 bits) and the record that rebuilds it.

This is the only module that calls `nn.quantize` (the `quantize` command lives in convert.py).
`quantize_model` turns the `nn.Linear` layers whose input width is a multiple of the group size
into `nn.QuantizedLinear` (all other layers, norm scales and every VAE convolution stay as they
are) and returns a JSON-able record of what it did. A converted folder stores that record in its
config.json; `apply_quantization` replays it on a freshly built (unquantized) model so that the
stored quantized tensors load strictly, with every name and shape checked, like mlx-lm's
`quantize_model` / `load_model`.

Storage per quantized weight: `bits` per value plus one scale and one bias (16-bit in a bf16
model) per `group_size` values, i.e. bits + 32 / group_size bits per weight: 4.5 for 4-bit g64,
8.5 for 8-bit g64.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import FluxKleinError, first_few

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MODE = "affine"


def check_bits(bits: int) -> None:
    """Refuse a bit width we do not support, naming the choices (every command's --quantize, `quantize --bits`)."""
    if bits not in BITS:
        raise FluxKleinError(f"cannot quantize to {bits} bits; choose 4 or 8")


def check_quantization(bits: int, group_size: int) -> None:
    """Refuse bit widths and group sizes we do not support, with a message naming the choices."""
    check_bits(bits)
    if group_size not in GROUP_SIZES:
        raise FluxKleinError(f"group size {group_size} is not supported; choose 32, 64 or 128")


def quantized_bits(model: nn.Module) -> int | None:
    """The bits of the model's first quantized layer, or None when nothing in it is quantized."""
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return next((m.bits for _, m in model.named_modules() if isinstance(m, quantized)), None)


def is_quantized(model: nn.Module) -> bool:
    return quantized_bits(model) is not None


def already_quantized(what: str, bits: int, instead: str) -> FluxKleinError:
    """The one refusal of quantizing what is quantized already, at every door (load, `quantize`, train's
    samples, this module): `what` as the door names it, `instead` what to do."""
    return FluxKleinError(f"{what} is already quantized to {bits} bits; {instead}")


def quantize_model(model: nn.Module, bits: int, group_size: int = 64) -> dict:
    """Quantize `model` in place (affine mode, the layers the module docstring names) and return the
    record `{"bits", "group_size", "mode", "layers": [module paths]}`.

    Lazy: weights that are not evaluated yet are quantized when they are evaluated, so a caller can
    quantize a model whose weights are still on disk and evaluate it layer by layer.
    """
    check_quantization(bits, group_size)
    if (done := quantized_bits(model)) is not None:
        raise already_quantized("the model", done, "quantize the unquantized weights instead")

    def fits(_, module: nn.Module) -> bool:  # (out, in) weight; groups run along the input axis
        return isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size, bits, mode=MODE, class_predicate=fits)
    return {"bits": bits, "group_size": group_size, "mode": MODE, "layers": sorted(_quantized_layers(model))}


def _quantized_layers(model: nn.Module) -> set[str]:
    return {path for path, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}


def check_record(record: dict, what: str = "model") -> None:
    """Validate a quantization record read from a config.json."""
    try:
        bits, group_size, mode, layers = record["bits"], record["group_size"], record["mode"], record["layers"]
    except (TypeError, KeyError) as e:
        raise FluxKleinError(
            f"the {what} quantization record in config.json is damaged (no {e}); convert again"
        ) from None
    if mode != MODE or not isinstance(layers, list):
        raise FluxKleinError(f"the {what} quantization record in config.json is not affine/by-layer; convert again")
    check_quantization(bits, group_size)


def apply_quantization(model: nn.Module, record: dict, what: str = "model") -> nn.Module:
    """Rebuild the quantized skeleton described by `record` on an unquantized `model` (in place).

    Afterwards the model's parameters have the names and shapes of the stored quantized weights,
    so a strict load checks them all. A record naming a layer the model does not have (or one that
    is not a Linear) raises FluxKleinError.
    """
    check_record(record, what)
    wanted = set(record["layers"])

    def named(path: str, module: nn.Module) -> bool:
        return path in wanted and isinstance(module, nn.Linear)

    nn.quantize(model, record["group_size"], record["bits"], mode=MODE, class_predicate=named)
    if missing := sorted(wanted - _quantized_layers(model)):
        raise FluxKleinError(
            f"the {what} quantization record names {len(missing)} layer(s) the model does not have "
            f"({first_few(missing)}); the folder does not match its config.json, convert again"
        )
    return model


def evaluate_by_layer(model: nn.Module) -> None:
    """Evaluate a lazily loaded (and lazily quantized) model one leaf module at a time.

    After `quantize_model` on weights still on disk, this holds one layer's unquantized weights at
    a time instead of the whole model's: the peak is the quantized model plus its largest layer.
    """
    for _, leaf in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        mx.eval(leaf.parameters())
    mx.eval(model.parameters())  # arrays held by non-leaf modules, if any


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every QuantizedLinear by an nn.Linear holding MLX's dequantized weight (in place).

    The result computes with exactly the values the quantized model represents; tests compare the
    two to separate quantization error from kernel rounding.
    """
    layers = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weight = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits, mode=module.mode
            )  # (out, in)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.weight = weight
            if "bias" in module:
                linear.bias = module.bias
            layers.append((path, linear))
    model.update_modules(tree_unflatten(layers))
    return model
