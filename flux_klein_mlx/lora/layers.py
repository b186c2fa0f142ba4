"""The one LoRA layer: a frozen Linear or QuantizedLinear with updates added to row ranges of its output.

    y = base(x) + sum over terms t of  factor_t · x @ delta_t.T   on the rows [r0, r1) of t
    LoRA  delta = up @ down        down (r, in), up (rows, r): computed as (x @ down.T) @ up.T
    LoKr  delta = kron(w1, w2)     w1 (a, b), w2 (c, d), w2 whole or a low-rank pair w2_a @ w2_b:
                                   computed as w1 · X · w2.T with X = x reshaped (b, d)
Neither the (rows, in) nor the (a·c, b·d) matrix is ever built, and the base layer is never
dequantized: the memory added is the terms' own tensors.

Inference and training use the same layer (`LoRALinear`); its terms are held in one of two ways:
- frozen terms (inference: LoRA files beside quantized weights, `lora.apply`) sit outside the
  module tree, so `parameters()`, saving and strict loads see exactly the base layer's arrays;
- trainable terms (training: `train.adapters`) are float32 parameters in lists named after the
  file roles (`lora_A.i`, `lora_B.i`, `lokr_w1.i`, ...): the paths `trainable_parameters()`,
  AdamW's state and the checkpoints are keyed by.
Either way the side path runs in the activation dtype. The base layer's arrays are this layer's
own, under their own names (`weight`, `scales`, ...); `base` gives the original layer back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from .formats import Term

# A trainable factor's role -> the list of the layer that holds it (the name a LoRA file gives it).
ROLE_LISTS = {
    "down": "lora_A",
    "up": "lora_B",
    "w1": "lokr_w1",
    "w2": "lokr_w2",
    "w2_a": "lokr_w2_a",
    "w2_b": "lokr_w2_b",
}
# The roles a term may have: a LoRA pair, or a LoKr w1 with w2 whole or as a low-rank pair.
TERM_ROLES = ({"down", "up"}, {"w1", "w2"}, {"w1", "w2_a", "w2_b"})


@dataclass(frozen=True)
class TrainableTerm:
    """Where one trainable term's factors sit in its layer: role -> index in that role's list."""

    rows: tuple[int, int]
    factor: float
    places: dict[str, int]


def dense_update(t: Term) -> mx.array:
    """The term's dense update (rows, in) in float32, without its factor (for fusing into a weight)."""
    if t.down is not None:
        return t.up.astype(mx.float32) @ t.down.astype(mx.float32)
    d = mx.kron(t.w1.astype(mx.float32), t.w2.astype(mx.float32))
    return mx.roll(d, d.shape[0] // 2, axis=0) if t.swap else d  # rows [2D]: [scale ; shift] -> [shift ; scale]


def term_output(t: Term, x: mx.array, cols: tuple[int, int], rows: tuple[int, int]) -> mx.array:
    """factor · x @ delta[rows, cols].T for one term, x (..., cols width) -> (..., rows width), in x's dtype.

    `cols` and `rows` are relative to the term's own update (cols in the layer's input, rows in the term's)."""
    c0, c1 = cols
    r0, r1 = rows
    if t.down is not None:
        down = t.down if (c0, c1) == (0, t.down.shape[1]) else t.down[:, c0:c1]
        up = t.up if (r0, r1) == (0, t.up.shape[0]) else t.up[r0:r1]
        h = x @ down.astype(x.dtype).T  # (..., r)
        return (h @ up.astype(x.dtype).T) * t.factor
    d = t.w2.shape[1]
    if c0 % d == 0 and c1 % d == 0 and not t.swap:
        # kron(w1 (a, b), w2 (c, d)) x = vec(w1 · X · w2.T), X = x reshaped (b, d): no (a·c, b·d) matrix
        X = x.reshape(*x.shape[:-1], (c1 - c0) // d, d)
        y = mx.einsum("ij,...jl,kl->...ik", t.w1[:, c0 // d : c1 // d].astype(x.dtype), X, t.w2.astype(x.dtype))
        return y.reshape(*x.shape[:-1], -1)[..., r0:r1] * t.factor  # (..., a, c) -> (..., a·c)
    return (x @ dense_update(t)[r0:r1, c0:c1].astype(x.dtype).T) * t.factor


class LoRALinear(nn.Module):
    """A frozen nn.Linear / nn.QuantizedLinear plus LoRA or LoKr terms on row ranges of its output.

    `terms` are frozen (held outside the module tree); `add_trainable` adds trainable ones.
    """

    def __init__(self, base: nn.Linear | nn.QuantizedLinear, terms: list[Term] = ()):
        super().__init__()
        for name, value in base.items():  # weight (and scales, biases, bias): the same parameter names
            self[name] = value
        if isinstance(base, nn.QuantizedLinear):  # what the quantized matmul reads besides the arrays
            self.group_size = base.group_size
            self.bits = base.bits
            self.mode = base.mode
        self.freeze()
        # In a plain holder, not a parameter or child of this module: saving, strict loads and
        # `parameters()` never see the frozen terms or the wrapped layer.
        self._hidden = SimpleNamespace(base=base, terms=list(terms), trainable=[])

    @property
    def base(self) -> nn.Linear | nn.QuantizedLinear:
        return self._hidden.base

    @property
    def trainable(self) -> list[TrainableTerm]:
        return list(self._hidden.trainable)

    def add_trainable(self, rows: tuple[int, int], factor: float, factors: dict[str, mx.array]) -> TrainableTerm:
        """A trainable term on rows [r0, r1): `factors` by role (down + up, or w1 + w2, or w1 + w2_a + w2_b),
        kept as float32 parameters at the end of their roles' lists."""
        if set(factors) not in TERM_ROLES:
            raise ValueError(f"a term's factors are down + up, w1 + w2 or w1 + w2_a + w2_b, not {sorted(factors)}")
        places = {}
        for role, value in factors.items():
            name = ROLE_LISTS[role]
            if name not in self:
                self[name] = []
            places[role] = len(self[name])
            self[name].append(value.astype(mx.float32))
        term = TrainableTerm(tuple(rows), factor, places)
        self._hidden.trainable.append(term)
        return term

    def factor_path(self, term: TrainableTerm, role: str) -> str:
        """The path of one trainable factor below this layer, as `tree_flatten` spells it (`lora_A.0`)."""
        return f"{ROLE_LISTS[role]}.{term.places[role]}"

    def terms(self) -> list[Term]:
        """Every term, the trainable ones built from their current parameters (so gradients reach them)."""
        terms = list(self._hidden.terms)
        for t in self._hidden.trainable:
            f = {role: self[ROLE_LISTS[role]][i] for role, i in t.places.items()}
            if "down" in f:
                terms.append(Term("", t.rows, t.factor, down=f["down"], up=f["up"]))
            else:
                w2 = f["w2"] if "w2" in f else f["w2_a"] @ f["w2_b"]  # (c, r) @ (r, d), float32
                terms.append(Term("", t.rows, t.factor, w1=f["w1"], w2=w2))
        return terms

    def __call__(self, x: mx.array) -> mx.array:
        # The base layer's own forward, run on this layer's copies of its arrays and attributes
        # (the same names), so that an update of the model's parameters reaches it.
        y = type(self.base).__call__(self, x)
        return y + self.side_path(x)

    def side_path(self, x: mx.array, rows: slice = slice(None), cols: tuple = (0, None)) -> mx.array:
        """The terms' share of `x @ W[rows, c0:c1].T` (x holds only columns c0:c1); zeros where no term lands."""
        r0, r1, _ = rows.indices(self["weight"].shape[0])
        c0, c1 = cols[0], x.shape[-1] + cols[0]
        outputs: dict[tuple[int, int], list[mx.array]] = {}  # rows lo:hi -> outputs of the terms on them
        for t in self.terms():
            lo, hi = max(t.rows[0], r0), min(t.rows[1], r1)
            if lo < hi:
                outputs.setdefault((lo, hi), []).append(term_output(t, x, (c0, c1), (lo - t.rows[0], hi - t.rows[0])))
        whole = outputs.pop((r0, r1), [])  # terms over all rows r0:r1
        if outputs:
            # Row blocks (q, k, v of a fused qkv) are disjoint: concatenate them with zeros in the gaps.
            parts = []
            at = r0
            for (lo, hi), ys in sorted(outputs.items()):
                if lo > at:
                    parts.append(mx.zeros((*x.shape[:-1], lo - at), dtype=x.dtype))
                parts.append(reduce(mx.add, ys))
                at = hi
            if r1 > at:
                parts.append(mx.zeros((*x.shape[:-1], r1 - at), dtype=x.dtype))
            whole.append(mx.concatenate(parts, axis=-1))
        return reduce(mx.add, whole) if whole else mx.zeros((*x.shape[:-1], r1 - r0), dtype=x.dtype)
