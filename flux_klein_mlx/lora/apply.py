"""Applying LoRAs to a klein transformer: fused into float weights, or a side path beside quantized ones.

The effective update of one LoRA on one layer is `scale · (alpha / rank) · up @ down` (LoKr:
`scale · factor · kron(w1, w2)`); several LoRAs add. On a float layer (nn.Linear, bf16/fp16/fp32)
the sum is fused into the weight once (computed in float32, rounded once) and the original weight is
kept, so removing or changing LoRAs restores it bit for bit. A quantized layer (nn.QuantizedLinear)
is never dequantized: it becomes a `layers.LoRALinear`, the same packed weights plus a low-rank
side path `x @ down.T @ up.T` per update (LoKr: `w1 · X · w2.T` on x reshaped to (b, d)), so the
memory added is the LoRA's own tensors.

Everything is validated before the model is touched (`load_loras`): a LoRA that does not fit is
refused with one line and the model is left as it was.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import FluxKleinError, first_few
from ..storage.weights import read_lora_file, resolve_lora
from .formats import Term, parse_lora
from .layers import LoRALinear, dense_update
from .layouts import autov3


@dataclass(kw_only=True)
class Lora:
    """One LoRA file parsed, checked against a model's shapes, with the user's strength."""

    name: str  # file name
    sha256: str  # first 12 hex digits of the file's sha256
    scale: float
    format: str  # "diffusers" (PEFT), "bfl", "peft_bfl" (PEFT-wrapped BFL), "kohya", "lokr" (LyCORIS LoKr)
    terms: list[Term]
    path: str = ""
    autov3: str = ""  # A1111's / Civitai's hash of the file (its tensor data), first 12 hex digits

    @property
    def nbytes(self) -> int:
        """Bytes of the LoRA tensors held in memory."""
        return sum(a.nbytes for t in self.terms for a in (t.down, t.up, t.w1, t.w2) if a is not None)

    def record(self) -> dict:
        """What PNG metadata and config.json store about this LoRA."""
        record = {"name": self.name, "sha256": self.sha256, "scale": self.scale}
        return {**record, "autov3": self.autov3} if self.autov3 else record


def parse_lora_spec(item, files: bool = True) -> tuple[object, float]:
    """A LoRA as a user writes it -> (source, scale): "file", "file:0.8", Path, ("file", 0.8) or ("file",).

    A string's last ":NUMBER" is its scale unless the whole string names an existing file (a file
    may have a colon in its name; `files=False` never looks at the file system, for names from a
    client); `owner/name:file.safetensors` keeps its colon (no number).
    """
    if isinstance(item, (str, Path)):
        source, scale = item, 1.0
        head, _, tail = str(item).rpartition(":")  # head is "" without a colon
        if isinstance(item, str) and head and not (files and Path(item).expanduser().is_file()):
            try:
                source, scale = head, float(tail)
            except ValueError:
                pass  # a colon that is part of the name
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        source, scale = item
    elif isinstance(item, (tuple, list)) and len(item) == 1:
        raise FluxKleinError(f"LoRA {item[0]} has no scale value; give (path, scale) or just the path for 1.0")
    else:
        raise FluxKleinError(f"a LoRA must be a path, 'PATH:SCALE' or (path, scale), not {item!r}")
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise FluxKleinError(f"LoRA {source}: scale {scale!r} is not a number") from None
    if not math.isfinite(scale):
        raise FluxKleinError(f"LoRA {source}: scale {scale} is not finite; use a number such as 0.8")
    return source, scale


def load_lora(source, params, scale: float = 1.0, partial: bool = False) -> Lora:
    """Read one LoRA file (a path, `owner/name` or `owner/name:file.safetensors`) and map it onto a
    transformer with hyper-parameters `params`.

    Refuses (FluxKleinError, one line) damaged files, LoRAs for other models, and keys that match
    no layer: all of them, or some of them unless `partial`.
    """
    _, scale = parse_lora_spec((source, scale))
    path = resolve_lora(source)
    tensors, metadata, sha = read_lora_file(path)
    what = path.name
    parsed = parse_lora(tensors, metadata, params, what)
    n = parsed.n_modules
    miss = parsed.unmatched
    head = first_few(miss)
    if not parsed.terms:
        raise FluxKleinError(
            f"LoRA {what} matches no layer of the model: none of its {n} modules ({head}) is a klein "
            "transformer layer; it was made for another model"
        )
    if miss and not partial:
        raise FluxKleinError(
            f"LoRA {what}: {len(miss)} of its {n} modules match no layer of {params.describe()} ({head}); "
            "load the rest anyway with --lora-partial (partial=True)"
        )
    check_magnitude(parsed.terms, scale, what)
    _warn_about_alpha(parsed.terms, what)
    return Lora(
        name=what,
        sha256=sha[:12],
        scale=scale,
        format=parsed.format,
        terms=parsed.terms,
        path=str(path),
        autov3=autov3(path),
    )


# The largest update a LoRA may make to one weight: float16's largest number. Weights are about 0.1 and
# real LoRA updates far below 1; anything near this is a broken file, alpha or scale, and beyond it
# the weight overflows in float16 (and soon after in bfloat16/float32).
MAX_UPDATE = 65504.0


def _peak_bound(t: Term) -> mx.array:
    """An upper bound of max |up @ down| (Cauchy-Schwarz: largest row norm of up x largest column norm
    of down), exact max |kron(w1, w2)| for LoKr; rescaled by the largest entry so that float32 never overflows."""
    if t.down is None:
        return mx.abs(t.w1).max().astype(mx.float32) * mx.abs(t.w2).max().astype(mx.float32)
    bound = mx.array(1.0)
    for m, axis in ((t.up, 1), (t.down, 0)):  # up (rows, r): norm along r; down (r, in): norm along r
        m = m.astype(mx.float32)
        top = mx.maximum(mx.abs(m).max(), mx.array(1e-30))
        bound = bound * top * mx.sqrt(((m / top) ** 2).sum(axis=axis)).max()
    return bound


def check_magnitude(terms: list[Term], scale: float, what: str) -> None:
    """Refuse a LoRA whose update `scale · alpha/rank · up @ down` exceeds MAX_UPDATE anywhere (from
    the factors, the alpha or the scale), before any model is touched. A cheap bound per term; the
    exact float32 maximum only for the rare low-rank term whose bound is over the limit."""
    bounds = [_peak_bound(t) for t in terms]
    mx.eval(bounds)
    for t, bound in zip(terms, bounds, strict=True):
        factor = abs(scale * t.factor)
        peak = factor * bound.item()  # exact for LoKr
        if peak <= MAX_UPDATE or factor == 0:
            continue
        if t.down is not None:  # exact, each factor rescaled so that the product itself cannot overflow
            mu, md = mx.abs(t.up).max().item(), mx.abs(t.down).max().item()
            exact = (t.up.astype(mx.float32) / mu) @ (t.down.astype(mx.float32) / md)
            peak = mx.abs(exact).max().item() * mu * md * factor
        if peak > MAX_UPDATE:
            raise FluxKleinError(
                f"LoRA {what}: its update of {t.key} reaches {peak:.3g} (scale {scale:g} x alpha/rank {t.factor:g} x "
                f"its factors), beyond {MAX_UPDATE:g}, which no weight survives; the file, its alpha or the scale "
                "is wrong"
            )


def _warn_about_alpha(terms: list[Term], what: str) -> None:
    """An alpha of 0 makes a module do nothing; a negative one subtracts its update (as diffusers applies it)."""
    n = len(terms)
    for test, says in (
        (lambda f: f == 0, "alpha 0, which changes nothing"),
        (lambda f: f < 0, "a negative alpha, which subtracts its update"),
    ):
        hit = [t.key for t in terms if test(t.factor)]
        if hit:
            names = first_few(hit)
            which = "every module" if len(hit) == n else f"{len(hit)} of its {n} modules ({names})"
            warnings.warn(f"LoRA {what} has {says}, in {which}", stacklevel=3)


def pair_scales(sources, scales) -> list[tuple[object, float]]:
    """LoRA sources and strengths given separately (as on the command line) -> (source, scale) pairs.

    Scales go by position; LoRAs without one get 1.0; more scales than LoRAs is an error.
    """
    sources = list(sources)
    scales = list(scales)
    if len(scales) > len(sources):
        raise FluxKleinError(
            f"--lora-scale is given {len(scales)} times but --lora {len(sources)} times; give one scale per LoRA, "
            "in order"
        )
    return [(s, scales[i] if i < len(scales) else 1.0) for i, s in enumerate(sources)]


def load_loras(loras, params, partial: bool = False) -> list[Lora]:
    """`["a.safetensors", ("b.safetensors", 0.8)]` -> validated `Lora`s, all read before any is applied."""
    loras = [loras] if isinstance(loras, (str, Path)) else loras or []
    return [load_lora(source, params, scale, partial) for source, scale in map(parse_lora_spec, loras)]


# --- applying and removing ------------------------------------------------------------------------------


class LoraState:
    """What `apply_loras` changed on a model: original float weights and the wrapped quantized layers."""

    def __init__(self, loras: list[Lora]):
        self.loras = loras
        self.originals: dict[str, mx.array] = {}  # layer path -> original float weight
        self.fused: list[str] = []  # float layers with updates fused in
        self.wrapped: list[str] = []  # layer paths now LoRALinear (quantized base, side path)


def layers_by_path(model: nn.Module) -> dict[str, nn.Module]:
    """The model's leaf modules (the layers LoRAs land on) by dotted path, as `tree_unflatten` takes them."""
    return dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))


def applied_loras(model: nn.Module) -> list[Lora]:
    """The LoRAs currently applied to `model` (empty when none)."""
    state = getattr(model, "lora_state", None)
    return list(state.loras) if state is not None else []


def remove_loras(model: nn.Module) -> None:
    """Undo `apply_loras`: original float weights back bit for bit, side paths dropped."""
    state = getattr(model, "lora_state", None)
    if state is None:
        return
    if state.fused and not state.originals:  # fused with keep_originals=False
        raise FluxKleinError(
            "these LoRAs were fused without keeping the original weights; reload the model to remove them"
        )
    layers = layers_by_path(model)
    for path, weight in state.originals.items():
        layers[path].weight = weight
    model.update_modules(tree_unflatten([(path, layers[path].base) for path in state.wrapped]))
    model.lora_state = None


def apply_loras(
    model: nn.Module,
    loras: list[Lora],
    *,
    keep_originals: bool = True,
    evaluate: bool = True,
    reread: Callable[[str], mx.array] | None = None,
) -> None:
    """Apply `loras` (from `load_loras`) to a klein transformer, replacing whatever was applied before.

    Float layers get the summed update fused into their weight (the original is kept for
    `remove_loras`, unless `keep_originals` is False: then the LoRAs cost only their own size but can
    only be removed by reloading the model); quantized layers get a side path. `reread(path)` gives a
    layer's original weight as a lazy array read from the model's files: kept instead of the weight
    itself, it costs no memory until the LoRAs are removed (the weight is then read from disk again). `evaluate=False`
    leaves the fused weights lazy (conversion writes them one at a time). Shapes were checked against the model's
    hyper-parameters when the LoRAs were read; a model with other shapes is refused here before
    anything changes.
    """
    by_layer: dict[str, list[Term]] = {}
    for lora in loras:
        for t in lora.terms:
            by_layer.setdefault(t.layer, []).append(replace(t, factor=t.factor * lora.scale))
    remove_loras(model)
    layers = layers_by_path(model)
    for path, terms in by_layer.items():  # check every layer before changing one
        if path not in layers:
            raise FluxKleinError(f"the model has no layer {path}; the LoRA was read for another model")
        out = layers[path].weight.shape[0]
        if any(t.rows[1] > out for t in terms):
            raise FluxKleinError(f"layer {path} has {out} outputs; the LoRA was read for another model")
    state = LoraState(list(loras))
    wrapped = []
    for path, terms in by_layer.items():
        layer = layers[path]
        if isinstance(layer, nn.QuantizedLinear):
            wrapped.append((path, LoRALinear(layer, terms)))
            state.wrapped.append(path)
            continue
        W = layer.weight  # (out, in)
        delta = mx.zeros(W.shape, dtype=mx.float32)
        for t in terms:
            delta = delta.at[t.rows[0] : t.rows[1]].add(t.factor * dense_update(t))
        state.fused.append(path)
        if keep_originals:
            state.originals[path] = W if reread is None else reread(path)
        layer.weight = (W.astype(mx.float32) + delta).astype(W.dtype)  # one rounding
    model.update_modules(tree_unflatten(wrapped))
    if evaluate:
        mx.eval([layers[path].weight for path in state.fused])
    model.lora_state = state if loras else None
