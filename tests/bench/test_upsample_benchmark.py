"""benchmarks/upsample_memory.py measures the released upsampler's size: its random Qwen3.5-9B has transformers'
parameter count for the same config.json, 18.8 GB in bfloat16 as the hub's, and keys and values on 8 of its 32
layers; FLUX 3 reads a window sized for the caption."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

from flux_klein_mlx.bench.random_model import RandomTokens  # noqa: E402
from flux_klein_mlx.models.tokenizer import FLUX3_WINDOW  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_upsample_memory", ROOT / "benchmarks" / "upsample_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_random_upsampler_has_the_released_size(tmp_path):
    import torch
    from mlx.utils import tree_flatten
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    bench = _script()
    bench.write_hub_files(tmp_path, None, None)
    model, config = bench.lazy_upsampler(tmp_path)  # built lazily: nothing is allocated
    ours = sum(v.size for _, v in tree_flatten(model.parameters()))
    with torch.device("meta"):
        reference = Qwen3_5ForConditionalGeneration(Qwen3_5Config.from_pretrained(tmp_path))
    assert ours == sum(p.numel() for p in reference.parameters())
    assert round(2 * ours / 1e9, 1) == 18.8  # BFL's card: 18.8 GB in bfloat16
    # state_bytes counts keys and values on the config's attention layers: mlx-vlm's caches, one per layer, agree
    caches = [type(c).__name__ for c in model.language_model.make_cache()]
    assert config["text_config"]["layer_types"].count("full_attention") == caches.count("KVCache") == 8
    assert len(caches) == 32


def test_random_tokens_take_the_length_they_are_given():
    tokens = RandomTokens(1000, 0, real_tokens=3593).tokens("a caption", FLUX3_WINDOW)
    assert tokens.ids.shape == (1, 3600)  # FLUX 3's window: the next multiple of 80
    assert int(tokens.mask.sum()) == 3593
