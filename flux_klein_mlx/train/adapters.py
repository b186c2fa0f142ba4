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

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from .. import __version__
from ..errors import FluxKleinError
from ..lora.apply import layers_by_path
from ..lora.formats import Term, target_table
from ..lora.layers import ROLE_LISTS, LoRALinear, TrainableTerm
from ..lora.layouts import TrainedRun, file_metadata, layout_pairs, layout_tensors, training_header
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
    def count(self) -> int:
        """How many adapters: one per diffusers module."""
        return len(self.slots)

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
            raise FluxKleinError(
                f"{what} does not hold this run's adapters ({missing[0]}, ...); it is from another run"
            )
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
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": [s.name for s in self.slots],
            "init_lora_weights": "gaussian",
            "lora_dropout": 0.0,
            "bias": "none",
            "use_dora": False,
            "use_rslora": False,
            "fan_in_fan_out": False,
            "alpha_pattern": {},
            "rank_pattern": {},
            "peft_type": "LORA",
        }
        prefixed = {f"transformer.{k}": v for k, v in config.items()}
        return {"format": "pt", "lora_adapter_metadata": json.dumps(prefixed, indent=2, sort_keys=True)}


def lora_terms(lora: TrainableLoRA) -> list[Term]:
    """The adapters as updates of our layers (`factor · B @ A` on each slot's rows), as `parse_lora` reads files."""
    terms = []
    for s in lora.slots:
        a, b = lora.pair(s.name)
        terms.append(Term(s.layer, s.rows, lora.alpha / lora.rank, down=a, up=b, key=s.name))
    return terms


def file_header(s, info, items, steps: int, started_at: float) -> dict[str, str]:
    """The adapter file's header for run settings `s` on model `info` with data `items`, after `steps` steps:
    our keys, kohya's `ss_*` and `modelspec.*` (lora/layouts.py), each what the run did (its adapter kind,
    schedule, sizes and trigger). The base model by repo id when given one, else by its name (a local path
    would name the user's folders). The settings hash is over the run key (the settings that decide the
    numbers) with the model as given."""
    key = json.dumps(s.run_key(), sort_keys=True, default=str).encode()
    base = str(s.model) if not Path(str(s.model)).expanduser().exists() else info.name
    return training_header(
        TrainedRun(
            name=s.output.stem,
            adapter=s.adapter,
            lokr_factor=s.lokr_factor if s.adapter == "lokr" else None,
            rank=s.rank,
            alpha=s.alpha,
            base_model=base,
            variant=info.variant,
            trigger=s.trigger,
            settings_hash=hashlib.sha256(key).hexdigest(),
            resolutions=s.resolutions,
            max_steps=s.steps,
            steps=steps,
            lr=s.lr,
            lr_scheduler=s.lr_scheduler,
            warmup_steps=s.warmup_steps,
            captions=list({it.stem: it.caption for it in items}.values()),  # several sizes: an item per size
            dataset=Path(s.data).name,
            seed=s.seed,
            batch_size=s.batch_size,
            grad_accum=s.grad_accum,
            dtype=s.dtype,
            started=started_at,
            finished=time.time(),
            version=__version__,
        )
    )


def write_lora_file(
    path: Path, lora, dtype, layout: str = "diffusers", params=None, header: dict[str, str] | None = None
) -> None:
    """The LoRA file of `lora` at `path` in `layout` (lora/layouts.py; tensors in `dtype`), its header
    `header` (the training's keys) plus the layout's own. diffusers is the file diffusers' trainer writes
    (PEFT's LoraConfig in `lora_adapter_metadata`); comfyui and kohya need the model's `params`.
    A `TrainableLoKr` writes itself, in the comfyui or diffusers layout."""
    if isinstance(lora, TrainableLoKr):
        metadata = {**(header or {}), **lora.metadata(), "flux_klein_mlx.format": layout}
        save_safetensors_streaming(path, lora.file_arrays(dtype, layout), metadata=metadata)
        return
    if layout == "diffusers":
        metadata = {**(header or {}), **lora.metadata(), "flux_klein_mlx.format": "diffusers"}
        save_safetensors_streaming(path, lora.file_arrays(dtype), metadata=metadata)
        return
    pairs = layout_pairs(lora_terms(lora), layout, params, Path(path).name)
    save_safetensors_streaming(
        path, layout_tensors(pairs, layout, dtype), metadata=file_metadata(pairs, layout, header)
    )


def attach_lora(
    model: nn.Module, slots: list[Slot], rank: int, alpha: float, rng: np.random.Generator
) -> TrainableLoRA:
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


# --- LoKr: LyCORIS' Kronecker adapters on whole layers -------------------------------------------------

# diffusers' names for our fused layers once `fuse_qkv_projections` has run (its LoKr loader fuses them)
FUSED_QKV_NAMES = {"img_attn.qkv": "attn.to_qkv", "txt_attn.qkv": "attn.to_added_qkv"}


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of a width into m · n with m <= n: m = `factor` where it divides the width, else
    the most nearly square split whose smaller side is at most `factor` (any side for -1)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
    else:
        limit = dimension if factor < 0 else factor
        m, n = 1, dimension
        while m < n:
            next_m = m + 1
            while dimension % next_m:
                next_m += 1
            next_n = dimension // next_m
            if next_m + next_n > m + n or next_m > limit:
                break
            m, n = next_m, next_n
    return (m, n) if m <= n else (n, m)


def kaiming_uniform(rng: np.random.Generator, shape: tuple[int, int]) -> mx.array:
    """torch's `kaiming_uniform_(a=sqrt(5))`, LyCORIS' init of w1 and w2_a: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / np.sqrt(shape[1])
    return mx.array(rng.uniform(-bound, bound, size=shape).astype(np.float32))


@dataclass(frozen=True)
class LoKrShape:
    """One layer's factorization: (out, in) = (a·c, b·d), w1 (a, b), w2 (c, d) whole or (c, r) @ (r, d)."""

    w1: tuple[int, int]
    w2: tuple[int, int]
    rank: int | None  # the rank of w2's low-rank pair; None: w2 whole

    @classmethod
    def of(cls, out_dims: int, in_dims: int, rank: int, factor: int) -> LoKrShape:
        (a, c), (b, d) = factorization(out_dims, factor), factorization(in_dims, factor)
        # LyCORIS (and peft) keep w2 whole when the rank is not well below its sides
        return cls((a, b), (c, d), None if rank >= max(c, d) / 2 else rank)

    def scale(self, alpha: float) -> float:
        """LyCORIS applies alpha / rank only to a low-rank factor; whole factors are used as they are."""
        return 1.0 if self.rank is None else alpha / self.rank

    @property
    def num_parameters(self) -> int:
        """Trainable values: w1 (a, b), and w2 (c, d) whole or its pair (c, r) + (r, d)."""
        (a, b), (c, d) = self.w1, self.w2
        return a * b + (c * d if self.rank is None else self.rank * (c + d))


def adapter_parameters(slots: list[Slot], params, *, adapter: str, rank: int, lokr_factor: int) -> int:
    """The trainable values of a run's adapters from the shapes alone (the memory plan, before any model
    loads), as the trainer's adapters count them: LoRA r · (in + out) per slot, LoKr its factors per layer."""
    if adapter == "lokr":
        shapes = linear_shapes(params)
        return sum(LoKrShape.of(*shapes[p], rank, lokr_factor).num_parameters for p in lokr_layers(slots, params))
    return sum(rank * (s.in_dims + s.out_dims) for s in slots)


def lokr_layers(slots: list[Slot], params) -> list[str]:
    """The layers a LoKr run trains, in model order. LoKr factorizes a whole layer (a fused qkv's q, k
    and v together: a Kronecker product does not split into row blocks), so each must be chosen whole."""
    widths = {path: out for path, (out, _) in linear_shapes(params).items()}
    covered: dict[str, list[Slot]] = {}
    for s in slots:
        covered.setdefault(s.layer, []).append(s)
    for layer, group in covered.items():
        if sum(s.out_dims for s in group) < widths[layer]:
            raise FluxKleinError(
                f"--adapter lokr trains whole layers, and --targets names only part of {layer} "
                f"({', '.join(s.name for s in group)}); name the whole layer ({layer.split('.', 2)[-1]}) "
                "or use all, attention, double or single"
            )
    return list(covered)


def diffusers_layer_name(layer: str, slots: list[Slot]) -> str:
    """Our layer -> diffusers' module of the same rows: its one slot, or the fused `to_qkv` / `to_added_qkv`."""
    block, _, inner = layer.partition(".")[2].partition(".")
    if inner in FUSED_QKV_NAMES:
        return f"transformer_blocks.{block}.{FUSED_QKV_NAMES[inner]}"
    (slot,) = [s for s in slots if s.layer == layer]
    return slot.name


class TrainableLoKr:
    """LoKr adapters attached to a model: per layer w1 and w2 (or w2's pair), and the files they make.

    Checkpoints hold the factors as trained (`diffusion_model.<layer>.lokr_w1`, ..., `.alpha`): the
    ComfyUI/ai-toolkit layout, which resumes bit for bit and loads anywhere.
    """

    def __init__(self, slots, rank: int, alpha: float, where: dict[str, tuple[LoRALinear, TrainableTerm, LoKrShape]]):
        self.slots, self.rank, self.alpha = slots, rank, alpha
        self.where = where  # our layer -> (its LoRA layer, its term, its factorization)

    @property
    def count(self) -> int:
        """How many adapters: one per layer."""
        return len(self.where)

    @property
    def num_parameters(self) -> int:
        return sum(shape.num_parameters for _, _, shape in self.where.values())

    def arrays(self, dtype=mx.float32) -> dict[str, mx.array]:
        """`<layer>.lokr_w1` (a, b), `.lokr_w2` (c, d) or `.lokr_w2_a` (c, r) + `.lokr_w2_b` (r, d), as trained."""
        out = {}
        for path, (layer, term, _) in self.where.items():
            for role in term.places:
                out[f"{path}.{ROLE_LISTS[role]}"] = layer[ROLE_LISTS[role]][term.places[role]].astype(dtype)
        return out

    def load(self, arrays: dict[str, mx.array], what: str) -> None:
        """Set every factor from a checkpoint's tensors (the keys of `file_arrays`); shapes and names checked."""
        arrays = {k.removeprefix("diffusion_model."): v for k, v in arrays.items() if not k.endswith(".alpha")}
        want = self.arrays()
        if set(arrays) != set(want):
            odd = sorted(set(want) ^ set(arrays))
            raise FluxKleinError(
                f"{what} does not hold this run's LoKr adapters ({odd[0]}, ...); it is from another run"
            )
        for path, (layer, term, _) in self.where.items():
            for role, i in term.places.items():
                key, dest = f"{path}.{ROLE_LISTS[role]}", layer[ROLE_LISTS[role]]
                if arrays[key].shape != dest[i].shape:
                    raise FluxKleinError(f"{what}: {key} has shape {arrays[key].shape}, not {dest[i].shape}")
                dest[i] = arrays[key].astype(mx.float32)

    def file_arrays(self, dtype, layout: str = "comfyui") -> dict[str, mx.array]:
        """The LoKr file's tensors in `layout`:
        comfyui    `diffusion_model.<BFL layer>.lokr_*` (+ `.alpha` where w2 is a low-rank pair): what
                   ComfyUI, ai-toolkit and diffusers' BFL LoKr converter read;
        diffusers  `transformer.<diffusers module>.lokr_*` on diffusers' fused `to_qkv` / `to_added_qkv`,
                   the scale folded into w1 (diffusers runs peft's LoKr with alpha = rank: scale 1)."""
        out = {}
        for path, (layer, term, shape) in self.where.items():
            factors = {ROLE_LISTS[r]: layer[ROLE_LISTS[r]][i] for r, i in term.places.items()}
            if layout == "comfyui":
                out.update({f"diffusion_model.{path}.{k}": v.astype(dtype) for k, v in factors.items()})
                if shape.rank is not None:
                    out[f"diffusion_model.{path}.alpha"] = mx.array(self.alpha, dtype=dtype)
                continue
            name = diffusers_layer_name(path, self.slots)
            factors["lokr_w1"] = factors["lokr_w1"] * term.factor  # float32 masters, one rounding below
            out.update({f"transformer.{name}.{k}": v.astype(dtype) for k, v in factors.items()})
        return out

    def metadata(self) -> dict[str, str]:
        return {"format": "pt"}


def lora_file_shapes(slots, rank: int) -> dict[str, tuple[int, int]]:
    """The tensors of a LoRA run's checkpoint file (its lora.safetensors): name -> shape."""
    shapes = {}
    for sl in slots:
        shapes[f"transformer.{sl.name}.lora_A.weight"] = (rank, sl.in_dims)
        shapes[f"transformer.{sl.name}.lora_B.weight"] = (sl.out_dims, rank)
    return shapes


def lokr_file_shapes(slots: list[Slot], params, rank: int, factor: int) -> dict[str, tuple[int, ...]]:
    """The tensors of a LoKr run's checkpoint file (the ComfyUI layout, `file_arrays`): name -> shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in lokr_layers(slots, params):
        shape, key = LoKrShape.of(*linear_shapes(params)[path], rank, factor), f"diffusion_model.{path}"
        shapes[f"{key}.lokr_w1"] = shape.w1
        if shape.rank is None:
            shapes[f"{key}.lokr_w2"] = shape.w2
        else:
            shapes[f"{key}.lokr_w2_a"] = (shape.w2[0], shape.rank)
            shapes[f"{key}.lokr_w2_b"] = (shape.rank, shape.w2[1])
            shapes[f"{key}.alpha"] = ()
    return shapes


def add_lokr_term(layer: LoRALinear, shape: LoKrShape, alpha: float, rng: np.random.Generator) -> TrainableTerm:
    """A trainable LoKr term over all of `layer`'s rows, initialised as LyCORIS does: w1 and w2_a
    kaiming-uniform, w2 or w2_b zero, so training starts from the model itself."""
    factors = {"w1": kaiming_uniform(rng, shape.w1)}
    if shape.rank is None:
        factors["w2"] = mx.zeros(shape.w2, dtype=mx.float32)
    else:
        factors["w2_a"] = kaiming_uniform(rng, (shape.w2[0], shape.rank))
        factors["w2_b"] = mx.zeros((shape.rank, shape.w2[1]), dtype=mx.float32)
    rows = (0, shape.w1[0] * shape.w2[0])
    return layer.add_trainable(rows, shape.scale(alpha), factors)


def attach_lokr(
    model: nn.Module, slots: list[Slot], params, rank: int, alpha: float, factor: int, rng: np.random.Generator
) -> TrainableLoKr:
    """Freeze `model` and put a trainable LoKr term on each whole layer `slots` cover, drawn from `rng`
    layer by layer in model order, so a seed gives the same start every time."""
    model.freeze()
    layers, shapes, wrapped, where = layers_by_path(model), linear_shapes(params), {}, {}
    for path in lokr_layers(slots, params):
        shape = LoKrShape.of(*shapes[path], rank, factor)
        layer = wrapped[path] = LoRALinear(layers[path])
        where[path] = (layer, add_lokr_term(layer, shape, alpha, rng), shape)
    model.update_modules(tree_unflatten(list(wrapped.items())))
    return TrainableLoKr(slots, rank, alpha, where)
