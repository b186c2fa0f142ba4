"""Trainable LoRA adapters on a frozen klein transformer, and the diffusers/PEFT file they become.

An adapter is one (A, B) pair on one module as diffusers names it: A (r, in), B (out, r), and the
module's output gains `(alpha / r) · x @ A.T @ B.T`. Our fused layers hold several diffusers
modules: `img_attn.qkv` is diffusers' `attn.to_q`, `to_k`, `to_v` (row blocks [0:D], [D:2D],
[2D:3D]), so it gets three independent adapters, exactly as PEFT puts three on diffusers' model;
`single_blocks.j.linear1` is diffusers' single `attn.to_qkv_mlp_proj` and gets one. The mapping is
read off `transformer.py`'s public name tables (through `lora_formats.target_table`), never restated.

The adapters are trainable terms of the one LoRA layer (`lora.layers.LoRALinear`, the layer inference
uses too): the frozen layer is kept as it is, an `nn.Linear` or an `nn.QuantizedLinear` (QLoRA: its
quantized matmul runs unchanged and the adapters are a side path; the weights are never dequantized).
Adapters are float32 master weights; the side path runs in the activation dtype.

Targets (`--targets`, comma-separated; see `parse_targets`):
    all            every Linear of every block, both streams (default)
    attention      every attention projection: double blocks' q/k/v/out of both streams, and the
                   single blocks' fused `to_qkv_mlp_proj` / `to_out` (they carry the MLP too)
    double[:a-b]   every Linear of the double blocks a..b (inclusive; all without a range): style
    single[:a-b]   every Linear of the single blocks a..b, e.g. single:0-12: structure / identity
    NAME           a diffusers module name or a suffix of one at a dot (`to_q`, `attn.to_out`,
                   `transformer_blocks.0.ff.linear_in`), or one of ours (`img_attn.qkv`, `linear1`)
Blocks are counted from the model (klein-4B has 5 + 20, klein-9B 8 + 24).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..errors import FluxKleinError
from ..lora.apply import layers_by_path
from ..lora.layers import LoRALinear, TrainableTerm
from ..lora.formats import target_table
from ..models.transformer import DIFFUSERS_DOUBLE, DIFFUSERS_SINGLE, QKV, linear_shapes
from ..weights import save_safetensors_streaming

PRESETS = ("all", "attention", "double", "single")
# diffusers module names (within a block) of the attention projections, for the `attention` preset
_ATTENTION = re.compile(r"\.attn\.(to_[qkv]|to_out(\.0)?|add_[qkv]_proj|to_add_out|to_qkv_mlp_proj)$")


@dataclass(frozen=True)
class Slot:
    """One diffusers module that can carry an adapter, and where it lives in our model."""

    name: str  # diffusers module name, e.g. "transformer_blocks.0.attn.to_q"
    layer: str  # our layer, e.g. "double_blocks.0.img_attn.qkv"
    rows: tuple[int, int]  # its rows [r0, r1) of the layer's output
    in_dims: int

    @property
    def out_dims(self) -> int:
        return self.rows[1] - self.rows[0]


def block_slots(params) -> list[Slot]:
    """Every Linear of every block as diffusers names it, in model order (blocks from `params`)."""
    table, shapes = target_table(params), linear_shapes(params)
    names = []
    for i in range(params.depth):
        for parts in QKV.values():
            names += [f"transformer_blocks.{i}.{p}" for p in parts]
        names += [f"transformer_blocks.{i}.{m}" for m in DIFFUSERS_DOUBLE if not m.endswith(".weight")]
    for j in range(params.depth_single):
        names += [f"single_transformer_blocks.{j}.{m}" for m in DIFFUSERS_SINGLE if not m.endswith(".weight")]
    return [Slot(n, table[n].layer, table[n].rows, shapes[table[n].layer][1]) for n in names]


def _block_range(token: str, kind: str, count: int) -> range:
    """`double`, `double:3`, `single:0-12` -> the block indices (inclusive range), checked against `count`."""
    _, _, spec = token.partition(":")
    if not spec:
        return range(count)
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec)
    if not m:
        raise FluxKleinError(f"--targets {token}: write a block range as {kind}:A-B (e.g. single:0-12) or {kind}:N")
    a, b = int(m.group(1)), int(m.group(2) or m.group(1))
    if a > b or b >= count:
        raise FluxKleinError(
            f"--targets {token}: the model has {count} {kind} blocks (0-{count - 1}); choose a range inside that"
        )
    return range(a, b + 1)


def _matches(token: str, slot: Slot) -> bool:
    """A module name: a diffusers name or one of ours, whole or as a suffix at a dot."""
    return any(full == token or full.endswith("." + token) for full in (slot.name, slot.layer))


def parse_targets(targets, params) -> list[Slot]:
    """`--targets` (a string, comma-separated, or a list of strings) -> the slots to train, in model order."""
    tokens = [targets] if isinstance(targets, str) else list(targets or [])
    tokens = [t.strip() for item in tokens for t in str(item).split(",") if t.strip()]
    if not tokens:
        raise FluxKleinError("--targets is empty; use all, attention, double, single:0-12 or module names")
    slots = block_slots(params)
    chosen: set[str] = set()
    for token in tokens:
        kind = token.partition(":")[0]
        if token == "all":
            hit = [s.name for s in slots]
        elif token == "attention":
            hit = [s.name for s in slots if _ATTENTION.search(s.name)]
        elif kind in ("double", "single"):
            count = params.depth if kind == "double" else params.depth_single
            prefix = "transformer_blocks" if kind == "double" else "single_transformer_blocks"
            blocks = {f"{prefix}.{i}." for i in _block_range(token, kind, count)}
            hit = [s.name for s in slots if any(s.name.startswith(b) for b in blocks)]
        else:
            hit = [s.name for s in slots if _matches(token, s)]
        if not hit:
            raise FluxKleinError(
                f"--targets {token} matches no layer of {params.describe()}; use all, attention, double, "
                "single:0-12 or diffusers module names such as transformer_blocks.0.attn.to_q"
            )
        chosen.update(hit)
    return [s for s in slots if s.name in chosen]


class TrainableLoRA:
    """The adapters attached to a model: which slot each (A, B) pair is, and the file they make."""

    def __init__(self, slots: list[Slot], rank: int, alpha: float, where: dict[str, tuple[LoRALinear, TrainableTerm]]):
        self.slots, self.rank, self.alpha = slots, rank, alpha
        self._where = where  # slot name -> (its layer, its term there)

    @property
    def num_parameters(self) -> int:
        return sum(self.rank * (s.in_dims + s.out_dims) for s in self.slots)

    def paths(self) -> dict[str, tuple[str, str]]:
        """slot name -> the paths of its A and B in the model's parameter tree (as `tree_flatten` spells them)."""
        out = {}
        for s in self.slots:
            layer, term = self._where[s.name]
            out[s.name] = (f"{s.layer}.{layer.factor_path(term, 'down')}", f"{s.layer}.{layer.factor_path(term, 'up')}")
        return out

    def pair(self, name: str) -> tuple[mx.array, mx.array]:
        layer, term = self._where[name]
        return layer.lora_A[term.places["down"]], layer.lora_B[term.places["up"]]

    def arrays(self, dtype=mx.float32) -> dict[str, mx.array]:
        """`{slot}.lora_A.weight` (r, in) and `{slot}.lora_B.weight` (out, r), diffusers' names without the prefix."""
        out = {}
        for s in self.slots:
            a, b = self.pair(s.name)
            out[f"{s.name}.lora_A.weight"] = a.astype(dtype)
            out[f"{s.name}.lora_B.weight"] = b.astype(dtype)
        return out

    def load(self, arrays: dict[str, mx.array], what: str) -> None:
        """Set every pair from `arrays` (the keys of `arrays()`), float32; shapes and names checked."""
        want = self.arrays()
        if set(arrays) != set(want):
            missing = sorted(set(want) - set(arrays)) or sorted(set(arrays) - set(want))
            raise FluxKleinError(f"{what} does not hold this run's adapters ({missing[0]}, ...); it is from another run")
        for s in self.slots:
            layer, term = self._where[s.name]
            for key, role in (("lora_A", "down"), ("lora_B", "up")):
                dest, i = layer[key], term.places[role]
                value = arrays[f"{s.name}.{key}.weight"]
                if value.shape != dest[i].shape:
                    raise FluxKleinError(f"{what}: {s.name}.{key} has shape {value.shape}, not {dest[i].shape}")
                dest[i] = value.astype(mx.float32)

    def file_arrays(self, dtype) -> dict[str, mx.array]:
        """The diffusers/PEFT file's tensors: `transformer.<module>.lora_A.weight` / `.lora_B.weight`."""
        return {f"transformer.{k}": v for k, v in self.arrays(dtype).items()}

    def metadata(self) -> dict[str, str]:
        """The safetensors header diffusers writes: `format` and PEFT's LoraConfig, keys prefixed `transformer.`."""
        config = {
            "r": self.rank, "lora_alpha": self.alpha, "target_modules": [s.name for s in self.slots],
            "init_lora_weights": "gaussian", "lora_dropout": 0.0, "bias": "none", "use_dora": False,
            "use_rslora": False, "fan_in_fan_out": False, "alpha_pattern": {}, "rank_pattern": {}, "peft_type": "LORA",
        }  # fmt: skip
        prefixed = {f"transformer.{k}": v for k, v in config.items()}
        return {"format": "pt", "lora_adapter_metadata": json.dumps(prefixed, indent=2, sort_keys=True)}


def write_lora_file(path: Path, lora: TrainableLoRA, dtype) -> None:
    """The diffusers/PEFT LoRA file of `lora` at `path` (tensors in `dtype`, header metadata)."""
    save_safetensors_streaming(path, lora.file_arrays(dtype), metadata=lora.metadata())


def attach_lora(model: nn.Module, slots: list[Slot], rank: int, alpha: float, rng: np.random.Generator) -> TrainableLoRA:
    """Freeze `model` and put trainable adapters on `slots` (PEFT's init: A ~ N(0, (1/r)^2), B = 0).

    A is drawn from `rng` slot by slot in model order, so a seed gives the same start every time.
    """
    model.freeze()
    by_layer: dict[str, list[Slot]] = {}
    for s in slots:
        by_layer.setdefault(s.layer, []).append(s)
    layers, wrapped, where = layers_by_path(model), {}, {}
    for path, group in by_layer.items():
        layer = wrapped[path] = LoRALinear(layers[path])
        for s in sorted(group, key=lambda s: s.rows):
            down = mx.array((rng.standard_normal((rank, s.in_dims)) / rank).astype(np.float32))  # (r, in)
            up = mx.zeros((s.out_dims, rank), dtype=mx.float32)  # (rows, r)
            where[s.name] = (layer, layer.add_trainable(s.rows, alpha / rank, {"down": down, "up": up}))
    model.update_modules(tree_unflatten(list(wrapped.items())))
    return TrainableLoRA(slots, rank, alpha, where)
