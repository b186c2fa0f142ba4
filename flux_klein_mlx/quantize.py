"""Group-wise affine weight quantization (4 or 8 bits) and the record that rebuilds it.

This is the only module that calls `nn.quantize`; the `quantize` CLI command at the bottom only
parses options and calls `convert.quantize_folder`. `quantize_model` turns the `nn.Linear` layers
whose input width is a multiple of the group size into `nn.QuantizedLinear` (all other layers,
norm scales and every VAE convolution stay as they are) and returns a JSON-able record of what it
did. A converted folder stores that record in its config.json; `apply_quantization` replays it on
a freshly built (unquantized) model so that the stored quantized tensors load strictly, with
every name and shape checked, like mlx-lm's `quantize_model` / `load_model`.

Storage per quantized weight: `bits` per value plus one scale and one bias (16-bit in a bf16
model) per `group_size` values, i.e. bits + 32 / group_size bits per weight: 4.5 for 4-bit g64,
8.5 for 8-bit g64.
"""

from __future__ import annotations

import click
import mlx.core as mx
import mlx.nn as nn

from .errors import FluxKleinError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MODE = "affine"


def check_quantization(bits: int, group_size: int) -> None:
    """Refuse bit widths and group sizes we do not support, with a message naming the choices."""
    if bits not in BITS:
        raise FluxKleinError(f"cannot quantize to {bits} bits; choose 4 or 8")
    if group_size not in GROUP_SIZES:
        raise FluxKleinError(f"group size {group_size} is not supported; choose 32, 64 or 128")


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of `model` is already quantized."""
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def quantize_model(model: nn.Module, bits: int, group_size: int = 64) -> dict:
    """Quantize `model` in place and return the record of what was quantized.

    Every `nn.Linear` whose input width is a multiple of `group_size` becomes an
    `nn.QuantizedLinear` (affine mode); other layers stay as they are. Lazy: weights that are not
    evaluated yet are quantized when they are evaluated, so a caller can quantize a model whose
    weights are still on disk and evaluate it layer by layer. The record is
    `{"bits", "group_size", "mode", "layers": [module paths]}`.
    """
    check_quantization(bits, group_size)
    if is_quantized(model):
        raise FluxKleinError("the model is already quantized; quantize the unquantized weights instead")
    layers: list[str] = []

    def predicate(path: str, module: nn.Module) -> bool:
        # (out, in) weight; groups run along the input axis.
        if isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size == 0:
            layers.append(path)
            return True
        return False

    nn.quantize(model, group_size, bits, mode=MODE, class_predicate=predicate)
    return {"bits": bits, "group_size": group_size, "mode": MODE, "layers": sorted(layers)}


def check_record(record: dict, what: str = "model") -> None:
    """Validate a quantization record read from a config.json."""
    try:
        bits, group_size, mode, layers = record["bits"], record["group_size"], record["mode"], record["layers"]
    except (TypeError, KeyError) as e:
        raise FluxKleinError(f"the {what} quantization record in config.json is damaged (no {e}); convert again") from None
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
    wanted, found = set(record["layers"]), set()

    def predicate(path: str, module: nn.Module) -> bool:
        if path in wanted and isinstance(module, nn.Linear):
            found.add(path)
            return True
        return False

    nn.quantize(model, record["group_size"], record["bits"], mode=MODE, class_predicate=predicate)
    if found != wanted:
        missing = sorted(wanted - found)
        raise FluxKleinError(
            f"the {what} quantization record names {len(missing)} layer(s) the model does not have "
            f"({', '.join(missing[:3])}); the folder does not match its config.json, convert again"
        )
    return model


def infer_record(model: nn.Module, weights: dict[str, mx.array]) -> dict | None:
    """The quantization record implied by pre-quantized `weights` for an unquantized `model`.

    A Linear at path p is quantized when `p.scales` is present; bits and group size follow from
    the shapes (packed uint32 weight (out, in·bits/32), scales (out, in/group_size)). Returns None
    when nothing is quantized.
    """
    layers, settings = [], set()
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or f"{path}.scales" not in weights:
            continue
        in_dims = module.weight.shape[-1]
        packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
        bits = packed.shape[-1] * 32 // in_dims
        group_size = in_dims // scales.shape[-1]
        settings.add((bits, group_size))
        layers.append(path)
    if not layers:
        return None
    if len(settings) > 1:
        raise FluxKleinError(f"the weights mix quantization settings {sorted(settings)}; convert them again")
    (bits, group_size), = settings
    record = {"bits": bits, "group_size": group_size, "mode": MODE, "layers": sorted(layers)}
    check_record(record)
    return record


def evaluate_by_layer(model: nn.Module) -> None:
    """Evaluate a lazily loaded (and lazily quantized) model one leaf module at a time.

    After `quantize_model` on weights still on disk, this holds one layer's unquantized weights at
    a time instead of the whole model's: the peak is the quantized model plus its largest layer.
    """
    from mlx.utils import tree_flatten

    for _, leaf in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        mx.eval(leaf.parameters())
    mx.eval(model.parameters())  # arrays held by non-leaf modules, if any


def quantize_weight(weight: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """One (out, in) weight -> (packed uint32 weight, scales, biases), as QuantizedLinear stores them."""
    return mx.quantize(weight, group_size, bits, mode=MODE)


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every QuantizedLinear by an nn.Linear holding MLX's dequantized weight (in place).

    The result computes with exactly the values the quantized model represents; tests compare the
    two to separate quantization error from kernel rounding.
    """
    layers = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            out_dims = module.weight.shape[0]
            in_dims = module.weight.shape[1] * 32 // module.bits
            linear = nn.Linear(in_dims, out_dims, bias="bias" in module)
            linear.weight = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits, mode=module.mode
            )
            if "bias" in module:
                linear.bias = module.bias
            layers.append((path, linear))
    if layers:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(layers))
    return model


def load_quantized_flux_klein(weights: dict[str, mx.array], params, record: dict | None = None):
    """A quantized FluxKlein from pre-quantized weights (our names, as written by `convert`).

    The quantization settings come from `record` when given, else from the weights' shapes. The
    load is strict: every layer must be present, quantized as the record says.
    """
    from .transformer import FluxKlein
    from .weights import load_into

    model = FluxKlein(params)
    record = record or infer_record(model, weights)
    if record is None:
        raise FluxKleinError("these transformer weights are not quantized; load them with load_flux_klein")
    apply_quantization(model, record, "transformer")
    load_into(model, weights, "transformer")
    return model


# --- CLI: `python -m flux_klein_mlx quantize` (the work is convert.quantize_folder) ---------------------

@click.command("quantize")
@click.option("--model", "-m", required=True, help="A folder written by `convert` (unquantized).")
@click.option("--bits", "-b", type=int, required=True, help="4 or 8.")
@click.option("--group-size", type=int, default=64, show_default=True, help="Values sharing one scale and bias: 32, 64 or 128.")
@click.option("--output", "-o", required=True, type=click.Path(), help="The quantized MLX folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def quantize_command(model, bits, group_size, output, overwrite):
    """Quantize a converted MLX folder's transformer and text encoder to 4 or 8 bits."""
    from .convert import ProgressBars, quantize_folder, summary

    bars = ProgressBars()
    try:
        config = quantize_folder(model, output, bits, group_size, overwrite=overwrite, progress=bars)
    finally:
        bars.close()
    click.echo(summary(output, config))


def main(argv=None) -> int:
    """`quantize` as a program: FluxKleinError -> one line on stderr, exit status 1."""
    from .__main__ import run_command

    return run_command(quantize_command, argv)
