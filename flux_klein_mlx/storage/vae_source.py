"""A VAE from elsewhere than the model (`--vae`), e.g. black-forest-labs/FLUX.2-small-decoder.

BFL's small decoder (Apache-2.0) is a whole FLUX.2 VAE whose decoder is narrower: its repo root
holds a diffusers `AutoencoderKLFlux2` config.json with `block_out_channels` (128, 256, 512, 512)
for the encoder and `decoder_block_out_channels` (96, 192, 384, 384) for the decoder (27.9 M parameters instead
of 49.6 M; 6.0 TFLOP instead of 10.5 at 1024², flops.py), its weights as `diffusion_pytorch_model.safetensors`
(diffusers names) and again as `full_encoder_small_decoder.safetensors` (BFL/ComfyUI names). The encoder
is the full one; the latent space and its BatchNorm statistics are the model's.

`loading.describe(model, vae=...)` resolves the source and calls into here. This module only
reasons about configs and (lazy) weights under our names; it reads no file:

- `infer_vae_config`: a single file has no config, so its tensors' shapes give the widths,
  levels, latent channels and optional layers; what shapes cannot say (GroupNorm groups, eps)
  comes from the model's own VAE config;
- `decoder_only`: a source without `encoder.*` tensors replaces just the decoder; the encoder,
  `quant_conv` and the latent statistics stay the model's (references are encoded and latents
  normalised exactly as before): `merge_decoder` builds that weight set, `decoder_config` its
  config. A whole VAE replaces the whole VAE, as diffusers'
  `Flux2KleinPipeline(vae=AutoencoderKLFlux2.from_pretrained(...))` does.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx

from ..errors import FluxKleinError
from ..models.config import AutoEncoderConfig
from ..models.vae import check_flux2, sanitize_vae_weights


def vae_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A VAE checkpoint (diffusers or BFL names, or ours) under our module names, refused unless FLUX.2's
    (a whole VAE or a decoder: the checks that apply to what is there)."""
    weights = sanitize_vae_weights(weights)
    check_flux2(None, weights)
    return weights


def is_decoder_key(key: str) -> bool:
    """Whether a VAE tensor belongs to the decoder, under diffusers, BFL or our names
    (diffusers keeps `post_quant_conv` at the top level; BFL and we put it in the decoder)."""
    return key.startswith(("decoder.", "post_quant_conv."))


def decoder_only(weights: dict[str, mx.array]) -> bool:
    """A decoder without an encoder (our names): it replaces only the model's decoder."""
    return not any(k.startswith("encoder.") for k in weights) and any(k.startswith("decoder.") for k in weights)


def _indices(weights: dict, prefix: str) -> list[int]:
    """The N of the numbered children `prefix.N.` (the levels of a VAE half, the resnets of one block), sorted."""
    return sorted({int(m.group(1)) for k in weights if (m := re.match(re.escape(prefix) + r"\.(\d+)\.", k))})


def infer_vae_config(weights: dict[str, mx.array], base: dict, where: str) -> dict:
    """A VAE config from its tensors' shapes (our names, NHWC), `base` filling what they cannot tell.

    Works for a whole VAE and for a decoder only (then the encoder's fields stay `base`'s)."""
    dec_levels = _indices(weights, "decoder.up_blocks")
    if not dec_levels or "decoder.conv_in.weight" not in weights:
        raise FluxKleinError(
            f"{where} holds no VAE decoder weights (no decoder.up_blocks / decoder.conv_in); pass a FLUX.2 VAE"
        )
    # Conv weights are (O, kh, kw, I) under our names. Up-block i produces the channels of level
    # (n - 1 - i): reversed, they are the decoder's widths.
    widths = tuple(reversed([weights[f"decoder.up_blocks.{i}.resnets.0.conv1.weight"].shape[0] for i in dec_levels]))
    decoder_layers = len(_indices(weights, "decoder.up_blocks.0.resnets")) - 1  # one more ResBlock than the encoder
    latent = int(weights["decoder.conv_in.weight"].shape[-1])
    out = dict(
        base,
        latent_channels=latent,
        out_channels=weights["decoder.conv_out.weight"].shape[0],
        use_post_quant_conv="decoder.post_quant_conv.weight" in weights,
        mid_block_add_attention=any(k.startswith("decoder.mid_block.attentions.") for k in weights),
    )
    if "bn.running_mean" in weights:
        p = math.isqrt(int(weights["bn.running_mean"].shape[0]) // latent)
        out["patch_size"] = (p, p)
    enc_levels = _indices(weights, "encoder.down_blocks")
    if enc_levels:
        out.update(
            block_out_channels=tuple(
                weights[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"].shape[0] for i in enc_levels
            ),
            layers_per_block=len(_indices(weights, "encoder.down_blocks.0.resnets")),
            in_channels=int(weights["encoder.conv_in.weight"].shape[-1]),
            use_quant_conv="encoder.quant_conv.weight" in weights,
        )
    if decoder_layers != out["layers_per_block"]:
        raise FluxKleinError(
            f"{where} has {decoder_layers + 1} ResBlocks per decoder level, the model's VAE "
            f"{out['layers_per_block'] + 1}; flux_klein_mlx runs FLUX.2 VAEs with one layer count"
        )
    out["decoder_block_out_channels"] = None if widths == tuple(out["block_out_channels"]) else widths
    return out


def decoder_config(model_config: dict, source_config: dict, where: str) -> dict:
    """The config of the model's VAE with the decoder of `source_config` (a decoder-only source):
    the decoder's widths and layers must fit the model's latent space and layer count."""
    model = AutoEncoderConfig.from_dict(model_config)
    source = AutoEncoderConfig.from_dict(source_config)
    widths = source.decoder_block_out_channels or source.block_out_channels
    checks = [
        (name, getattr(source, name), getattr(model, name))
        for name in ("latent_channels", "layers_per_block", "mid_block_add_attention")
    ]
    for name, theirs, ours in [*checks, ("level count", len(widths), len(model.block_out_channels))]:
        if theirs != ours:
            raise FluxKleinError(
                f"the decoder in {where} has {name} {theirs}, the model's VAE {ours}; "
                "it does not decode this model's latents"
            )
    return dict(
        model_config,
        decoder_block_out_channels=list(widths),
        use_post_quant_conv=source.use_post_quant_conv,
        out_channels=source.out_channels,
    )


def merge_decoder(model: dict[str, mx.array], decoder: dict[str, mx.array]) -> dict[str, mx.array]:
    """The model's VAE weights with the decoder taken from `decoder` (both under our names, lazy).
    The latent statistics (`bn.*`) stay the model's: they define the latent space both sides share."""
    kept = {k: v for k, v in model.items() if not k.startswith("decoder.")}
    return {**kept, **{k: v for k, v in decoder.items() if k.startswith("decoder.")}}
