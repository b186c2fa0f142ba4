"""The batch the training tests judge the loss and its gradients by, on either family, and the two sides' losses
of it: ours (the trainer's `batch_loss`, the family's training RoPE) and the family's reference (families.py's
TrainingKit.loss, train_refs.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx.utils import tree_flatten

from flux_klein_mlx.family import family_of
from flux_klein_mlx.train.step.objective import batch_loss, sigmas_from_draws

GRID = (4, 3)  # h, w of the target's token grid (a 48 x 64 px image)
SHORT = "a striped test card"
LONG = "a striped test card on a wooden easel in a quiet room, " * 12  # past 80 tokens: FLUX 3's window of 160


def card_folders(root):
    """Four 64 x 64 striped cards with captions of two window lengths (photos/), and a control folder of noise
    pictures of the same names (before/): (photos, before)."""
    from PIL import Image

    d, c = root / "photos", root / "before"
    d.mkdir(), c.mkdir()
    g = np.random.default_rng(0)
    yy, xx = np.mgrid[0:64, 0:64]
    for i in range(4):
        base = np.stack([xx * 4 % 256, yy * 4 % 256, (xx + yy) * 2 % 256], -1).astype(np.uint8)
        Image.fromarray(np.roll(base, 9 * i, axis=1)).save(d / f"im{i}.png")
        (d / f"im{i}.txt").write_text(LONG if i % 2 else SHORT)
        Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(c / f"im{i}.png")
    return d, c


def training_batch(case: str, context_dim: int, seed: int = 3):
    """x0, noise (B, L, C); u (B,) float32 uniform draws; one caption (1, Lt, E) per example (windows of two
    lengths in the case "windows"); the references, each (B, L, C): two in the case "edit"."""
    g = np.random.default_rng(seed)
    B, C, L = 2, 32, GRID[0] * GRID[1]
    x0, noise = g.standard_normal((2, B, L, C)).astype(np.float32)
    ctxs = [
        g.standard_normal((1, n, context_dim)).astype(np.float32)
        for n in ((80, 160) if case == "windows" else (80, 80))
    ]
    u = np.array([0.6021, 0.05] if case == "edit" else [0.2345, 0.9], dtype=np.float32)
    conds = [g.standard_normal((B, L, C)).astype(np.float32) for _ in range(2 if case == "edit" else 0)]
    return x0, noise, u, ctxs, conds


def our_loss_and_grads(model, x0, noise, u, ctxs, conds, checkpoint=False):
    """The trainer's loss of the batch (each window its own pass) and the gradient of every trainable array."""
    family = family_of(model.params)
    rope = lambda n: family.training_rope(model, GRID, len(conds), n)  # noqa: E731
    f = nn.value_and_grad(
        model,
        lambda: batch_loss(
            model,
            mx.array(x0),
            mx.array(noise),
            sigma=mx.array(sigmas_from_draws("uniform", u, GRID[0] * GRID[1])),
            ctx=[mx.array(c) for c in ctxs],
            rope=rope,
            refs=mx.concatenate([mx.array(c) for c in conds], axis=1) if conds else None,
            checkpoint=checkpoint,
        ),
    )
    loss, grads = f()
    return loss, dict(tree_flatten(grads))


def reference_loss(kit, transformer, x0, noise, u, ctxs, conds, dtype=torch.float32):
    """The family kit's reference loss of the batch, its tensors in `dtype` (the draws u stay float32)."""
    t = lambda a: torch.from_numpy(a).to(dtype)  # noqa: E731
    return kit.training.loss(
        transformer, t(x0), t(noise), torch.from_numpy(u), [t(c) for c in ctxs], [t(c) for c in conds], GRID
    )
