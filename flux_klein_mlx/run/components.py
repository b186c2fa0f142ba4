"""How a described model's components become modules: read, sanitized, checked, strictly loaded.

`describe` (loading.py) decides what a model on disk is, reading configs only; this module turns one
of its components into an evaluated MLX module, config -> module -> sanitize -> quantization record ->
strict load, shaped like mlx-lm's `utils.load_model`:

    model = load_component(info, "transformer", mx.bfloat16, quantize=4)

`check_weights` runs the same steps on headers only, before any model runs; `convert` uses
`assemble_component` without evaluating. Model files only build modules and sanitize names; all reading
happens here and in `weights.py`.
"""

from __future__ import annotations

import warnings
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..dtypes import as_dtype
from ..errors import FluxKleinError
from ..family import Family
from ..models.config import AutoEncoderConfig, Qwen3Config
from ..models.quantize import apply_quantization, evaluate_by_layer, quantize_model
from ..models.text_encoder import Qwen3TextEncoder, keeps_key, sanitize_qwen3_weights
from ..models.vae import AutoEncoder
from ..storage.vae_source import merge_decoder, vae_weights
from ..storage.weights import check_safetensors_file, load_into, read_weight_files
from .loading import COMPONENTS, WHAT, ModelInfo, check_for_loading


def check_for_training(info: ModelInfo, quantize: int | None, weights=COMPONENTS) -> None:
    """`train`'s checks of a model: the 9B-KV model and a distilled FLUX 3 (a flow map) are refused, then
    `check_for_loading` and the weight files of `weights` (`check_weights`; the trainer checks the VAE's
    itself, unless its latents are all cached); a distilled FLUX.2 is trained but warned about (its Base
    model is named)."""
    if info.reference_kv:
        raise FluxKleinError(
            f"{info.name} caches reference keys/values and cannot be trained; train on "
            "black-forest-labs/FLUX.2-klein-base-9B and use the LoRA with the KV model"
        )
    if info.is_distilled and not info.family.trains_distilled:
        raise FluxKleinError(
            f"{info.name} is the distilled {info.family.title} (a flow map, trained on its own schedule) and is not "
            "trained here; train on its Base, black-forest-labs/flux-3-image-klein-base, and use the LoRA with either"
        )
    check_for_loading(info, quantize)
    check_weights(info, weights)
    if info.is_distilled:
        size = {"klein-4b": "4B", "klein-9b": "9B"}.get(info.variant, "4B")
        warnings.warn(
            f"{info.name} is a distilled model: training a LoRA on it is not recommended (it breaks the "
            f"distillation); train on the Base model black-forest-labs/FLUX.2-klein-base-{size} instead",
            stacklevel=2,
        )


def read_component(info: ModelInfo, name: str) -> dict[str, mx.array]:
    """A component's weights under our names, lazily (only the tensors the model uses are listed)."""
    if name == "vae" and info.vae_source is not None:
        # Sources of any format: sanitize is idempotent on weights already under our names.
        weights = vae_weights(read_weight_files(info.files["vae"]))
        if info.decoder_files:
            weights = merge_decoder(weights, vae_weights(read_weight_files(info.decoder_files)))
        return weights
    family = info.family
    keep = partial(keeps_key, num_layers=max(family.text_taps)) if name == "text_encoder" else None
    weights = read_weight_files(info.files[name], keep=keep)
    return weights if info.format == "mlx" else sanitize(name, weights, family)  # converted folders have our names


def build_module(name: str, config: dict, family: Family) -> nn.Module:
    """An unloaded (lazily initialised, so free) module for one component's config (`name` checked by callers)."""
    if name == "transformer":
        return family.build_transformer(family.params(config))
    if name == "text_encoder":
        return Qwen3TextEncoder(Qwen3Config.from_dict(config), family.text_taps)
    return AutoEncoder(AutoEncoderConfig.from_dict(config))


def sanitize(name: str, weights: dict[str, mx.array], family: Family) -> dict[str, mx.array]:
    """A component's checkpoint (diffusers, transformers or BFL names) under our module names."""
    if name == "transformer":
        return family.sanitize_transformer(weights)
    if name == "text_encoder":
        return sanitize_qwen3_weights(weights, max(family.text_taps))
    return vae_weights(weights)


def assemble(
    name: str,
    config: dict,
    *,
    weights: dict[str, mx.array],
    family: Family,
    dtype=None,
    record: dict | None = None,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[nn.Module, dict | None]:
    """Module + sanitized weights -> a strictly loaded, lazy module and its quantization record.

    `record` rebuilds a stored quantization before the strict load; `bits` quantizes an
    unquantized transformer or text encoder after it (the VAE is never quantized). Nothing is
    evaluated: tensors are read when the caller evaluates them.
    """
    module = build_module(name, config, family)
    if record is not None:
        apply_quantization(module, record, WHAT[name])
    load_into(module, weights, WHAT[name], dtype=as_dtype(dtype))
    if bits and record is None and name != "vae":
        record = quantize_model(module, bits, group_size)
    return module, record


def assemble_component(
    info: ModelInfo, name: str, dtype=None, *, bits: int | None = None, group_size: int = 64
) -> tuple[nn.Module, dict | None]:
    """`assemble` of one component of a described model, its weights read (lazily) from its files."""
    return assemble(
        name,
        info.configs[name],
        weights=read_component(info, name),
        family=info.family,
        dtype=dtype,
        record=info.quantization[name],
        bits=bits,
        group_size=group_size,
    )


def check_weights(info: ModelInfo, names=COMPONENTS) -> None:
    """Check every weight file of `names` before any model runs, reading headers only.

    Each file's safetensors header must parse and the file must hold all the bytes it lists
    (a truncated file is caught here); the component's tensors, under our names, must be exactly
    the parameters its config (and stored quantization) asks for, with their shapes.
    """
    for name in names:
        for f in info.files[name]:
            check_safetensors_file(f)
        assemble_component(info, name)


def load_component(
    info: ModelInfo, name: str, dtype=None, *, quantize: int | None = None, group_size: int = 64
) -> nn.Module:
    """Load one component of a described model, evaluated layer by layer.

    `dtype` casts floating tensors (None: as stored); `quantize` 4 or 8 quantizes an unquantized
    transformer or text encoder while loading, so the unquantized model is never whole in memory.
    """
    if name not in COMPONENTS:
        raise ValueError(f"unknown component {name!r}; expected one of {COMPONENTS}")
    # No name may hold the read weights while the layers are evaluated: a cast or quantized layer would
    # keep its source tensors alive (evaluated) until the load returns, the whole model twice at its end.
    module, _ = assemble_component(info, name, dtype, bits=quantize, group_size=group_size)
    evaluate_by_layer(module)
    return module
