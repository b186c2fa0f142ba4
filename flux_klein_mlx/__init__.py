"""FLUX.2 [klein] image generation on MLX.

    import flux_klein_mlx
    pipe = flux_klein_mlx.load("black-forest-labs/FLUX.2-klein-4B")
    image = pipe.generate("a red fox in fresh snow", seed=1)

The components mirror the model's parts: `FluxKlein` (flow transformer), `Qwen3TextEncoder`,
`Encoder`/`Decoder` (VAE), `FluxSampler`, and the `sanitize_*` weight converters. Names are
imported on first use so that `import flux_klein_mlx` stays fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load": "pipeline",
    "FluxKleinPipeline": "pipeline",
    "Progress": "pipeline",
    "FluxKlein": "transformer",
    "FluxKleinParams": "transformer",
    "load_flux_klein": "transformer",
    "sanitize_flux2_klein_weights": "transformer",
    "Qwen3Config": "text_encoder",
    "Qwen3TextEncoder": "text_encoder",
    "load_text_encoder": "text_encoder",
    "sanitize_qwen3_weights": "text_encoder",
    "PromptTokenizer": "tokenizer",
    "AutoEncoderConfig": "vae",
    "AutoEncoder": "vae",
    "Encoder": "vae",
    "Decoder": "vae",
    "load_vae": "vae",
    "sanitize_vae_weights": "vae",
    "FluxSampler": "sampler",
    "FluxSamplerConfig": "sampler",
    "quantize_model": "quantize",
    "load_quantized_flux_klein": "quantize",
    "FluxKleinError": "errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flux_klein_mlx' has no attribute {name!r}")
