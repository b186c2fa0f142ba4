"""Trainable LoRA and LoKr adapters on a frozen klein transformer, held as terms (no file keys here:
`terms()` is what lora/layouts' one writer writes, `load_terms` what its reader gives back).

An adapter is one (A, B) pair on one module as diffusers names it: A (r, in), B (out, r), and the
module's output gains `(alpha / r) · x @ A.T @ B.T`. Our fused layers hold several diffusers
modules: `img_attn.qkv` is diffusers' `attn.to_q`, `to_k`, `to_v` (row blocks [0:D], [D:2D],
[2D:3D]), so it gets three independent adapters, exactly as PEFT puts three on diffusers' model;
`single_blocks.j.linear1` is diffusers' single `attn.to_qkv_mlp_proj` and gets one. The mapping is
read off `transformer.py`'s public name tables (through `lora/formats`), never restated.

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
Blocks are counted from the model (klein-4B has 5 + 20, klein-9B 8 + 24). The block groups are the
family's (`Family.target_groups`): FLUX 3 Image Klein has `image`, `reference`, `text` (its modes' own
blocks) and `single` instead of `double` / `single`; without control images `all` leaves out its
reference blocks, which would never run (docs/training.md#flux-3-image-klein).
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

from ... import __version__
from ...errors import FluxKleinError
from ...family import family_of
from ...lora.apply import layers_by_path
from ...lora.formats import Term
from ...lora.layers import ROLE_LISTS, LoRALinear, TrainableTerm
from ...lora.layouts import TrainedRun, file_shapes, training_header, write_adapter
from ...lora.names import diffusers_modules, layer_shapes, target_table

PRESETS = ("all", "attention")  # and each family's block groups (family/: FLUX.2 double single, FLUX 3 image ...)
# The layout of a run's checkpoint and EMA files (lora/layouts writes and reads them): LoRA pairs per
# diffusers module as diffusers' trainer writes them, LoKr factors as LyCORIS writes them.
CHECKPOINT_LAYOUTS = {"lora": "diffusers", "lokr": "comfyui"}
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
    table, shapes = target_table(params), layer_shapes(params)
    names = diffusers_modules(params, blocks_only=True)
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


def parse_targets(targets, params, *, references: bool = True) -> list[Slot]:
    """`--targets` (a string, comma-separated, or a list of strings) -> the slots to train, in model order.
    `references` False (a run without control images): `all` leaves out the blocks only references run
    through (FLUX 3's reference mode), and naming them is refused (they would train nothing)."""
    tokens = [targets] if isinstance(targets, str) else list(targets or [])
    tokens = [t.strip() for item in tokens for t in str(item).split(",") if t.strip()]
    family = family_of(params)
    presets = ", ".join([*PRESETS, *family.target_groups]) + ", single:0-3"
    if not tokens:
        raise FluxKleinError(f"--targets is empty; use {presets} or module names")
    slots = block_slots(params)
    groups = {name: prefix for name, (prefix, _) in family.target_groups.items()}
    unused = groups.get(family.reference_group) if not references else None
    chosen: set[str] = set()
    for token in tokens:
        hit = _token_slots(token, slots, params, family)
        if not hit:
            raise FluxKleinError(
                f"--targets {token} matches no layer of {params.describe()}; use {presets} or diffusers module "
                f"names such as {slots[0].name}"
            )
        if unused and token != "all" and all(name.startswith(unused + ".") for name in hit):
            raise FluxKleinError(
                f"--targets {token} adapts only the reference blocks ({unused}), which a run without --control "
                "never runs; give --control, or choose other targets"
            )
        chosen.update(name for name in hit if not (unused and token == "all" and name.startswith(unused + ".")))
    return [slot for slot in slots if slot.name in chosen]


def _token_slots(token: str, slots: list[Slot], params, family) -> list[str]:
    """The slot names one --targets token names: a preset, a block group with an optional range, a module."""
    kind = token.partition(":")[0]
    if token == "all":
        return [slot.name for slot in slots]
    if token == "attention":
        return [slot.name for slot in slots if _ATTENTION.search(slot.name)]
    if kind in family.target_groups:
        prefix, field = family.target_groups[kind]
        blocks = {f"{prefix}.{i}." for i in _block_range(token, kind, getattr(params, field))}
        return [slot.name for slot in slots if any(slot.name.startswith(b) for b in blocks)]
    return [slot.name for slot in slots if _matches(token, slot)]


class TrainedAdapters:
    """What both kinds of trainable adapters share: every trained tensor under one key (`arrays()`), where it
    lives (`places()`), and setting them all from such arrays, checked."""

    title = "adapters"  # what a refusal calls them

    def __init__(self, slots: list[Slot], *, rank: int, alpha: float, where: dict, params):
        self.slots, self.rank, self.alpha, self.params = slots, rank, alpha, params
        self.where = where  # the kind's own: where each adapter's term is (TrainableLoRA, TrainableLoKr)

    def places(self) -> dict[str, tuple[list, int]]:
        """key -> (the list of its LoRA layer that holds the float32 master, its index there)."""
        raise NotImplementedError

    def arrays(self, dtype=mx.float32) -> dict[str, mx.array]:
        """Every trained tensor by key (the kind says which): the trained values (EMA, broadcast), not a file."""
        return {key: dest[i].astype(dtype) for key, (dest, i) in self.places().items()}

    def load(self, arrays: dict[str, mx.array], what: str) -> None:
        """Set every tensor from `arrays` (the keys of `arrays()`), float32; shapes and names checked."""
        places = self.places()
        if set(arrays) != set(places):
            missing = sorted(set(places) - set(arrays)) or sorted(set(arrays) - set(places))
            raise FluxKleinError(
                f"{what} does not hold this run's {self.title} ({missing[0]}, ...); it is from another run"
            )
        for key, (dest, i) in places.items():
            if arrays[key].shape != dest[i].shape:
                raise FluxKleinError(f"{what}: {key} has shape {arrays[key].shape}, not {dest[i].shape}")
            dest[i] = arrays[key].astype(mx.float32)


class TrainableLoRA(TrainedAdapters):
    """The adapters attached to a model: which slot each (A, B) pair is, and the terms its files hold.
    `arrays()`: `{slot}.down` (r, in) and `{slot}.up` (out, r)."""

    kind = "lora"
    # where: slot name -> (its layer, its term there)

    @property
    def count(self) -> int:
        """How many adapters: one per diffusers module."""
        return len(self.slots)

    @property
    def num_parameters(self) -> int:
        return sum(self.rank * (slot.in_dims + slot.out_dims) for slot in self.slots)

    def paths(self) -> dict[str, tuple[str, str]]:
        """slot name -> the paths of its A and B in the model's parameter tree (as `tree_flatten` spells them)."""
        out = {}
        for slot in self.slots:
            layer, term = self.where[slot.name]
            out[slot.name] = (
                f"{slot.layer}.{layer.factor_path(term, 'down')}",
                f"{slot.layer}.{layer.factor_path(term, 'up')}",
            )
        return out

    def places(self) -> dict[str, tuple[list, int]]:
        out = {}
        for slot in self.slots:
            layer, term = self.where[slot.name]
            for role in ("down", "up"):
                out[f"{slot.name}.{role}"] = (layer[ROLE_LISTS[role]], term.places[role])
        return out

    def terms(self) -> list[Term]:
        """The adapters as updates of our layers (`factor · B @ A` on each slot's rows): what lora/ writes."""
        masters = self.arrays()  # float32: the masters themselves
        terms = []
        for slot in self.slots:
            a, b = masters[f"{slot.name}.down"], masters[f"{slot.name}.up"]
            terms.append(Term(slot.layer, slot.rows, self.alpha / self.rank, down=a, up=b, key=slot.name))
        return terms

    def load_terms(self, terms: list[Term], what: str) -> None:
        """Set every pair from a file's terms (lora/layouts.read_adapter of a checkpoint or EMA file)."""
        by_place = {(t.layer, t.rows): t for t in terms if t.down is not None}
        arrays = {}
        for slot in self.slots:
            if t := by_place.get((slot.layer, slot.rows)):
                arrays[f"{slot.name}.down"], arrays[f"{slot.name}.up"] = t.down, t.up
        self.load(arrays, what)


def file_header(settings, info, *, items, steps: int, started_at: float) -> dict[str, str]:
    """The adapter file's header for run `settings` on model `info` with data `items`, after `steps` steps:
    our keys, kohya's `ss_*` and `modelspec.*` (lora/layouts.py), each what the run did (its adapter kind,
    schedule, sizes and trigger). The base model by repo id when given one, else by its name (a local path
    would name the user's folders). The settings hash is over the run key (the settings that decide the
    numbers) with the model as given."""
    key = json.dumps(settings.run_key(), sort_keys=True, default=str).encode()
    base = str(settings.model) if not Path(str(settings.model)).expanduser().exists() else info.name
    return training_header(
        TrainedRun(
            name=settings.output.stem,
            adapter=settings.adapter,
            lokr_factor=settings.lokr_factor if settings.adapter == "lokr" else None,
            rank=settings.rank,
            alpha=settings.alpha,
            base_model=base,
            variant=info.variant,
            trigger=settings.trigger,
            settings_hash=hashlib.sha256(key).hexdigest(),
            resolutions=settings.resolutions,
            max_steps=settings.steps,
            steps=steps,
            lr=settings.lr,
            lr_scheduler=settings.lr_scheduler,
            warmup_steps=settings.warmup_steps,
            captions=list({it.stem: it.caption for it in items}.values()),  # several sizes: an item per size
            dataset=Path(settings.data).name,
            seed=settings.seed,
            batch_size=settings.batch_size,
            grad_accum=settings.grad_accum,
            dtype=settings.dtype,
            started=started_at,
            finished=time.time(),
            version=__version__,
        )
    )


def write_lora_file(
    path: Path, lora, *, dtype, layout: str = "diffusers", params=None, header: dict[str, str] | None = None
) -> None:
    """The file of `lora` (a TrainableLoRA or TrainableLoKr) at `path` in `layout`, tensors in `dtype`, its
    header `header` (the training's keys) plus the layout's own: lora/layouts' one writer."""
    write_adapter(path, lora.terms(), layout, params or lora.params, what=Path(path).name, dtype=dtype, header=header)


def adapter_file_shapes(slots: list[Slot], params, *, adapter: str, rank: int, factor: int = -1) -> dict:
    """The tensors of a run's checkpoint file (lora.safetensors), name -> shape, as lora/'s writer would
    write this run's adapters: zero terms of the run's shapes, never computed (MLX is lazy)."""
    if adapter == "lokr":
        terms = []
        for path in lokr_layers(slots, params):
            shape = LoKrShape.of(*layer_shapes(params)[path], rank, factor)
            zeros = {"w2": mx.zeros(shape.w2), **{role: mx.zeros(slot) for role, slot in shape.factor_shapes().items()}}
            terms.append(Term(path, (0, shape.w1[0] * shape.w2[0]), 1.0, **zeros))
    else:
        zeros = [(mx.zeros((rank, slot.in_dims)), mx.zeros((slot.out_dims, rank))) for slot in slots]
        terms = [
            Term(slot.layer, slot.rows, 1.0, down=down, up=up) for slot, (down, up) in zip(slots, zeros, strict=True)
        ]
    return file_shapes(terms, CHECKPOINT_LAYOUTS[adapter], params)


def attach_lora(
    model: nn.Module, slots: list[Slot], *, rank: int, alpha: float, rng: np.random.Generator
) -> TrainableLoRA:
    """Freeze `model` and put trainable adapters on `slots` (PEFT's init: A ~ N(0, (1/r)^2), B = 0).

    A is drawn from `rng` slot by slot in model order, so a seed gives the same start every time.
    """
    model.freeze()
    by_layer: dict[str, list[Slot]] = {}
    for slot in slots:
        by_layer.setdefault(slot.layer, []).append(slot)
    layers, wrapped, where = layers_by_path(model), {}, {}
    for path, group in by_layer.items():
        layer = wrapped[path] = LoRALinear(layers[path])
        for slot in sorted(group, key=lambda slot: slot.rows):
            down = mx.array((rng.standard_normal((rank, slot.in_dims)) / rank).astype(np.float32))  # (r, in)
            up = mx.zeros((slot.out_dims, rank), dtype=mx.float32)  # (rows, r)
            where[slot.name] = (layer, layer.add_trainable(slot.rows, alpha / rank, {"down": down, "up": up}))
    model.update_modules(tree_unflatten(list(wrapped.items())))
    return TrainableLoRA(slots, rank=rank, alpha=alpha, where=where, params=model.params)


# --- LoKr: LyCORIS' Kronecker adapters on whole layers -------------------------------------------------


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
        return sum(rows * cols for rows, cols in self.factor_shapes().values())

    def factor_shapes(self) -> dict[str, tuple[int, int]]:
        """role -> shape of each trained factor: w1, and w2 or its pair w2_a, w2_b."""
        if self.rank is None:
            return {"w1": self.w1, "w2": self.w2}
        return {"w1": self.w1, "w2_a": (self.w2[0], self.rank), "w2_b": (self.rank, self.w2[1])}


def adapter_parameters(slots: list[Slot], params, *, adapter: str, rank: int, lokr_factor: int) -> int:
    """The trainable values of a run's adapters from the shapes alone (the memory plan, before any model
    loads), as the trainer's adapters count them: LoRA r · (in + out) per slot, LoKr its factors per layer."""
    if adapter == "lokr":
        shapes = layer_shapes(params)
        return sum(LoKrShape.of(*shapes[p], rank, lokr_factor).num_parameters for p in lokr_layers(slots, params))
    return sum(rank * (slot.in_dims + slot.out_dims) for slot in slots)


def lokr_layers(slots: list[Slot], params) -> list[str]:
    """The layers a LoKr run trains, in model order. LoKr factorizes a whole layer (a fused qkv's q, k
    and v together: a Kronecker product does not split into row blocks), so each must be chosen whole."""
    widths = {path: out for path, (out, _) in layer_shapes(params).items()}
    covered: dict[str, list[Slot]] = {}
    for slot in slots:
        covered.setdefault(slot.layer, []).append(slot)
    for layer, group in covered.items():
        if sum(slot.out_dims for slot in group) < widths[layer]:
            raise FluxKleinError(
                f"--adapter lokr trains whole layers, and --targets names only part of {layer} "
                f"({', '.join(slot.name for slot in group)}); name the whole layer ({layer.split('.', 2)[-1]}) "
                "or use all, attention, double or single"
            )
    return list(covered)


class TrainableLoKr(TrainedAdapters):
    """LoKr adapters attached to a model: per layer w1 and w2 (or w2's pair), and the terms its files hold.
    `arrays()`: `<layer>.w1` (a, b), `.w2` (c, d) or `.w2_a` (c, r) + `.w2_b` (r, d).

    Checkpoints hold the factors as trained, in LyCORIS' encoding (lora/layouts, the ComfyUI layout):
    it resumes bit for bit and loads anywhere.
    """

    kind = "lokr"
    title = "LoKr adapters"
    # where: our layer -> (its LoRA layer, its term, its factorization)

    @property
    def count(self) -> int:
        """How many adapters: one per layer."""
        return len(self.where)

    @property
    def num_parameters(self) -> int:
        return sum(shape.num_parameters for _, _, shape in self.where.values())

    def places(self) -> dict[str, tuple[list, int]]:
        return {
            f"{path}.{role}": (layer[ROLE_LISTS[role]], i)
            for path, (layer, term, _) in self.where.items()
            for role, i in term.places.items()
        }

    def terms(self) -> list[Term]:
        """The adapters as updates of whole layers (`factor · kron(w1, w2)`): what lora/ writes."""
        masters = self.arrays()  # float32: the masters themselves
        terms = []
        for path, (_, term, _) in self.where.items():
            f = {role: masters[f"{path}.{role}"] for role in term.places}  # w1, w2 or w2_a and w2_b
            w2 = f["w2"] if "w2" in f else f["w2_a"] @ f["w2_b"]  # (c, r) @ (r, d), float32
            pair = {"w2_a": f.get("w2_a"), "w2_b": f.get("w2_b")}
            terms.append(Term(path, term.rows, term.factor, w1=f["w1"], w2=w2, key=path, **pair))
        return terms

    def load_terms(self, terms: list[Term], what: str) -> None:
        """Set every factor from a file's terms (lora/layouts.read_adapter of a checkpoint or EMA file)."""
        by_layer = {t.layer: t for t in terms if t.w1 is not None}
        arrays = {}
        for path, (_, term, _) in self.where.items():
            t = by_layer.get(path)
            arrays.update(
                {f"{path}.{role}": getattr(t, role) for role in term.places if t and getattr(t, role) is not None}
            )
        self.load(arrays, what)


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
    model: nn.Module, slots: list[Slot], *, params, rank: int, alpha: float, factor: int, rng: np.random.Generator
) -> TrainableLoKr:
    """Freeze `model` and put a trainable LoKr term on each whole layer `slots` cover, drawn from `rng`
    layer by layer in model order, so a seed gives the same start every time."""
    model.freeze()
    layers, shapes, wrapped, where = layers_by_path(model), layer_shapes(params), {}, {}
    for path in lokr_layers(slots, params):
        shape = LoKrShape.of(*shapes[path], rank, factor)
        layer = wrapped[path] = LoRALinear(layers[path])
        where[path] = (layer, add_lokr_term(layer, shape, alpha, rng), shape)
    model.update_modules(tree_unflatten(list(wrapped.items())))
    return TrainableLoKr(slots, rank=rank, alpha=alpha, where=where, params=params)
