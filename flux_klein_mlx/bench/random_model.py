"""A pipeline with random weights of a variant's true shapes, for benchmarks: nothing is downloaded.

The pipeline is the real `FluxKleinPipeline`; only its loaders differ (they build each component
from the variant's config and fill it with random values), so a benchmark times exactly the code
that `generate` runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..family import family_of
from ..models.config import Variant
from ..models.quantize import evaluate_by_layer, quantize_model
from ..models.tokenizer import TextWindow, Tokens
from ..run.components import build_module
from ..run.loading import COMPONENTS, ModelInfo
from ..run.pipeline import FluxKleinPipeline

REAL_PROMPT_TOKENS = 40  # a typical prompt plus the chat template; the rest of the 512 is padding
# Each component's weights are drawn from `seed` plus its own offset, named here rather than taken
# from the position of a name in a tuple.
SEED_OFFSETS = {"text_encoder": 0, "transformer": 1, "vae": 2}


def randomize(model: nn.Module, dtype, seed: int) -> None:
    """Give every parameter of a freshly built (lazy) model random values in `dtype`.

    Matrices get N(0, 1/fan_in) so activations stay O(1) through the stack; vectors (norm scales,
    biases, statistics) get 1. Each block is generated and evaluated on its own, so the model's
    own lazy initialisers are never computed and the peak stays at the final weights' size. Quantized
    layers keep their values (their initialiser's, U(+-1/sqrt(fan_in)), quantized): their scales and
    biases are not matrices of a layer.
    """
    # Group parameters by block ("double_blocks.3", "decoder", ...): one evaluation per group.
    groups: dict[str, list[tuple[str, mx.array]]] = {}
    for name, v in tree_flatten(model.parameters()):
        m = re.match(r"^(.*?\.\d+)\.", name)
        groups.setdefault(m.group(1) if m else name.split(".")[0], []).append((name, v))
    key = mx.random.key(seed)
    for items in groups.values():
        new = []
        for name, v in items:
            key, k = mx.random.split(key)
            if not mx.issubdtype(v.dtype, mx.floating) or name.endswith((".scales", ".biases")):
                continue
            if v.ndim >= 2:
                new.append((name, mx.random.normal(v.shape, dtype=dtype, key=k) * math.prod(v.shape[1:]) ** -0.5))
            else:
                new.append((name, mx.ones(v.shape, dtype=dtype)))
        model.load_weights(new, strict=False)
        mx.eval([v for _, v in new])


class RandomTokens:
    """Stands in for the tokenizer: random ids, `real_tokens` real ones (a prompt and its chat template) and the rest
    padding."""

    def __init__(self, vocab_size: int, seed: int, real_tokens: int = REAL_PROMPT_TOKENS):
        self.vocab_size = vocab_size
        self.seed = seed
        self.real_tokens = real_tokens

    def tokens(self, prompts, window: TextWindow) -> Tokens:
        n = 1 if isinstance(prompts, str) else len(prompts)
        L = window.length(min(self.real_tokens, window.max_length))
        ids = mx.random.randint(0, self.vocab_size, (n, L), key=mx.random.key(self.seed))
        real, at = mx.arange(L) < self.real_tokens, mx.arange(L)
        positions = at if window.pad_position is None else mx.where(real, at, window.pad_position)
        rows = (ids, mx.broadcast_to(real, (n, L)), mx.broadcast_to(positions, (n, L)))
        return Tokens(*(a.astype(mx.int32) for a in rows))


def random_pipeline(
    variant: Variant,
    *,
    dtype=mx.float32,
    quantize: int | None = None,
    seed: int = 0,
    low_memory: bool = False,
    prompt_tokens: int = REAL_PROMPT_TOKENS,
) -> FluxKleinPipeline:
    """The pipeline of `variant` (a row of any family's `variants`) with random weights (`quantize` 4/8:
    transformer and text encoder, quantized from the random weights as `convert` would). The text encoder
    is built to the family's deepest tap only (FLUX 3: 32 of Qwen3-VL's 36 layers, no vision tower).
    `prompt_tokens`: how many tokens every prompt is taken to be (FLUX 3's window is sized by it)."""
    configs = {name: dataclasses.asdict(getattr(variant, name)) for name in COMPONENTS}
    family = family_of(variant.transformer)

    def make(name: str):
        module = build_module(name, configs[name], family)
        if quantize and name != "vae":
            # As a quantizing load does: each lazily initialised layer is made, cast, quantized and evaluated on
            # its own, so the unquantized model is never whole in memory (the load's peak is a real one).
            module.set_dtype(dtype)
            quantize_model(module, quantize)
            evaluate_by_layer(module)
        randomize(module, dtype, seed + SEED_OFFSETS[name])  # what quantization left as floats
        return module

    info = ModelInfo(
        source=f"random weights ({variant.name})",
        path=Path("."),
        format="random",
        is_distilled=variant.distilled,
        configs=configs,
        files={},
        quantization={n: None for n in COMPONENTS},
        tokenizer=Path("."),
        reference_kv=variant.reference_kv,
        family=family,
    )
    loaders = {name: functools.partial(make, name) for name in SEED_OFFSETS}
    loaders["tokenizer"] = functools.partial(RandomTokens, variant.text_encoder.vocab_size, seed, prompt_tokens)
    return FluxKleinPipeline(
        loaders,
        info,
        dtype=dtype,
        low_memory=low_memory,
        quantization={"bits": quantize, "group_size": 64} if quantize else None,
    )
