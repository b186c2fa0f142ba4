"""Reading weight files: the only module that opens safetensors files or talks to the hub.

Loading is lazy: `mx.load` maps a safetensors file and reads a tensor's bytes only when it is
evaluated, so tensors that a caller drops (e.g. Qwen3 layers above 27) are never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

from .errors import FluxKleinError


def read_safetensors(path: str | Path) -> dict[str, mx.array]:
    """Lazily open one safetensors file; a damaged or foreign file raises a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FluxKleinError(f"weight file not found: {path}")
    try:
        return mx.load(str(path))
    except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
        raise FluxKleinError(
            f"{path} is damaged or not a safetensors file ({str(e).splitlines()[0][:120]}); "
            "download or convert it again"
        ) from None


def read_weight_files(
    files: Iterable[str | Path], keep: Callable[[str], bool] | None = None
) -> dict[str, mx.array]:
    """Merge several (sharded) safetensors files into one lazy dict, keeping only `keep(key)`."""
    weights: dict[str, mx.array] = {}
    for f in files:
        for k, v in read_safetensors(f).items():
            if keep is None or keep(k):
                weights[k] = v
    return weights


def component_files(folder: str | Path) -> list[Path]:
    """The safetensors files of one component folder (diffusers/transformers layout).

    A `*.safetensors.index.json` names the shards (and only those are read); otherwise every
    `*.safetensors` in the folder is a shard.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FluxKleinError(f"missing folder {folder}: the model snapshot is incomplete")
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise FluxKleinError(f"{indexes[0]} is damaged ({e}); download it again") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FluxKleinError(
                f"{folder} is incomplete: missing shard(s) {', '.join(missing[:3])} named in {indexes[0].name}"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FluxKleinError(f"no .safetensors weights in {folder}: the model snapshot is incomplete")
    return files


def read_json(path: str | Path) -> dict:
    """Read a config file, with a clear error when it is missing or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise FluxKleinError(f"missing {path}: the model snapshot is incomplete")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise FluxKleinError(f"{path} is not valid JSON ({e}); download it again") from None


def load_into(model, weights: dict[str, mx.array], what: str, dtype=None) -> None:
    """Strictly load `weights` into `model`: every parameter must be present with its shape.

    `what` names the component for the error message ("transformer", "VAE", ...). Missing and
    unexpected keys are listed (first few) with their count, so a wrong or partial checkpoint
    never loads silently. Floating tensors are cast to `dtype` when given.
    """
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
        if unexpected:
            parts.append(
                f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''})"
            )
        raise FluxKleinError(f"{what} weights do not match the model: {'; '.join(parts)}")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise FluxKleinError(
                f"{what} weight {k} has shape {tuple(v.shape)}, the model expects {tuple(expected[k].shape)}"
            )
    if dtype is not None:
        # Floating tensors (incl. quantization scales/biases) take the compute dtype; packed
        # integer weights keep theirs.
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
