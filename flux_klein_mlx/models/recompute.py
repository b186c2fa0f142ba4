"""Gradient checkpointing for training: a module's activations recomputed in the backward pass.

Used by `FluxKlein.forward_with_rope(checkpoint=True)` (the trainer's `--low-memory`), one call per
block. MLX's `nn.utils.checkpoint` recomputes too, but leaves the order of evaluation to MLX, which
ran every block's recomputation before the parameter gradients that consume them: on a stack of
single blocks it saved no memory. Here the order is pinned with `mx.depends`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


def checkpointed(module: nn.Module):
    """`module(*args)` with gradient checkpointing, for training under `mx.grad`: only the inputs are
    kept; the module's activations are recomputed in the backward pass.

    Unlike `nn.utils.checkpoint`, the recomputation waits for the output's cotangent and the input
    gradients wait for the parameter gradients (`mx.depends`), so MLX runs one block's backward at a
    time. With `nn.utils.checkpoint` every block's recomputed activations stayed alive until the last
    parameter gradient was computed, and a stack of single blocks saved no memory at all.
    """

    def inner(params, *args):
        module.update(params)
        return module(*args)

    @mx.custom_function
    def run(params, *args):
        return inner(params, *args)

    @run.vjp
    def run_vjp(primals, cotangents, outputs):
        cots = list(cotangents) if isinstance(cotangents, (list, tuple)) else [cotangents]
        keys, values = zip(*tree_flatten(list(primals)), strict=True)  # the trainable parameters first
        n_params = len(tree_flatten(primals[0]))

        def flat(*arrays):
            out = inner(*tree_unflatten(list(zip(keys, arrays, strict=True))))
            return list(out) if isinstance(out, (list, tuple)) else [out]

        _, vjps = mx.vjp(flat, mx.depends(list(values), cots), cots)
        if n_params:
            vjps = vjps[:n_params] + list(mx.depends(vjps[n_params:], vjps[:n_params]))
        return tuple(tree_unflatten(list(zip(keys, vjps, strict=True))))

    return lambda *args: run(module.trainable_parameters(), *args)
