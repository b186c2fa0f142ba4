"""FLUX.2 [klein] image generation on MLX.

    import flux_klein_mlx
    pipe = flux_klein_mlx.load("black-forest-labs/FLUX.2-klein-4B")
    image = pipe.generate("a red fox in fresh snow", seed=1)

The components mirror the model's parts: `FluxKlein` (flow transformer), `Qwen3TextEncoder`,
`Encoder`/`Decoder` (VAE), and the `sanitize_*` weight converters; a run's settings are a
`RunSettings`, its events `Event`s with typed `Stats`, its memory choices a `MemoryPlan`. Names are
imported on first use so that `import flux_klein_mlx` stays fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# module -> the public names it holds (imported on first use)
_MODULES = {
    "run.pipeline": ("load", "FluxKleinPipeline"),
    "events": ("Event", "Stats", "MemoryPlan"),
    "inputs.settings": ("RunSettings", "PreparedInputs", "prepare_inputs"),
    "storage.embedding_cache": ("EmbeddingCache",),
    "record.output": ("save_image", "image_metadata"),
    "record.a1111": ("resolve_lora_tags",),
    "run.loading": ("describe", "ModelInfo"),
    "run.components": ("load_component",),
    "models.config": ("Qwen3Config", "AutoEncoderConfig"),
    "models.flux2.config": ("VARIANTS", "FluxKleinParams"),
    "models.flux2.transformer": ("FluxKlein", "sanitize_flux2_klein_weights"),
    "models.kv_cache": ("ReferenceKV",),
    "models.text_encoder": ("Qwen3TextEncoder", "sanitize_qwen3_weights"),
    "models.tokenizer": ("PromptTokenizer",),
    "models.vae": ("AutoEncoder", "Encoder", "Decoder", "sanitize_vae_weights"),
    "models.quantize": ("quantize_model",),
    "bench.flops": ("count_parameters",),
    "errors": ("FluxKleinError",),
    "train.trainer": ("train_lora",),
    "train.settings": ("TrainSettings",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["__version__", "preload_openblas", *_EXPORTS]


def preload_openblas() -> str:
    """Linux: make MLX's CPU backend use OpenBLAS instead of the slow BLAS its wheel bundles.

    fp32 matmuls are ~40x faster with it. It only works before `mlx.core` is first imported (the
    dynamic linker keeps the first definition of each BLAS symbol), so entry points call it first.
    Returns what happened ("openblas", "n/a" off Linux, or why not), for reports. Never raises.
    """
    import ctypes
    import ctypes.util
    import sys
    from pathlib import Path

    if sys.platform != "linux":
        return "n/a"
    if "mlx.core" in sys.modules:
        try:
            mapped = "openblas" in Path("/proc/self/maps").read_text()
        except OSError:
            mapped = False
        return "openblas" if mapped else "bundled reference BLAS (slow: import mlx after OpenBLAS)"
    name = ctypes.util.find_library("openblas")
    if not name:
        return "bundled reference BLAS (slow: apt-get install libopenblas0-pthread)"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return "bundled reference BLAS (OpenBLAS failed to load)"
    return "openblas"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flux_klein_mlx' has no attribute {name!r}")
