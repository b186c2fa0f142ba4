"""A tiny random FLUX.2 [klein] 9B-KV snapshot in the exact Hugging Face layout (test fixture).

Built with diffusers' own `Flux2KleinKVPipeline` from the components of `tiny_model` and written by
`save_pretrained`, so it is laid out like black-forest-labs/FLUX.2-klein-9b-kv: model_index.json with
`_class_name` Flux2KleinKVPipeline and no `is_distilled` key, and a transformer config without
any KV flag (the same transformer class as the plain klein models).
"""

from __future__ import annotations

import json
from pathlib import Path

from refs import qwen_tokenizer_dir
from tiny_model import SCHEDULER, make_tiny_components


def make_tiny_kv_snapshot(path: str | Path, *, seed: int = 3) -> Path:
    """Write a tiny random KV snapshot (diffusers layout, float32) to `path` and return it."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline
    from transformers import AutoTokenizer

    path = Path(path)
    transformer, text_encoder, vae = make_tiny_components(seed)
    pipe = Flux2KleinKVPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=AutoTokenizer.from_pretrained(qwen_tokenizer_dir()),
        transformer=transformer,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinKVPipeline" and "is_distilled" not in index, index
    return path


_SHARED: dict[int, Path] = {}


def shared_tiny_kv_snapshot(tmp_path_factory, *, seed: int = 3) -> Path:
    """`make_tiny_kv_snapshot` built once per test session; treat it as read-only."""
    if seed not in _SHARED:
        _SHARED[seed] = make_tiny_kv_snapshot(tmp_path_factory.mktemp(f"tiny-klein-kv-{seed}") / "snapshot", seed=seed)
    return _SHARED[seed]
