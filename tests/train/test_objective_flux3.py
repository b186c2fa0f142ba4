"""LoRA training on FLUX 3 Image Klein Base (issue 37), judged by the references:

- the loss and every adapter's gradient against torch autograd through diffusers' Flux3Transformer2DModel with
  peft adapters on the same inputs (tiny random model, float32): text to image, and an edit LoRA with two
  references as their own stream (RoPE l = -1, -2), and a batch whose captions have windows of different
  lengths (each keeps its own window; one pass per window); --low-memory's checkpointing gives the same;
- the `shift` noise levels against diffusers' FLUX 3 scheduler (`Flux3SetTimestepsStep`'s shift 6.93);
- `--targets` presets of FLUX 3's blocks (image, text, reference, single), refusing what FLUX 3 has not.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from peft_pair import lora_pair
from refs import rel_err, to_np
from tiny_flux3 import shared_tiny_flux3_snapshot

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.family import FLUX3
from flux_klein_mlx.run.components import load_component
from flux_klein_mlx.run.loading import describe
from flux_klein_mlx.train.step.adapters import parse_targets
from flux_klein_mlx.train.step.objective import batch_loss, sigmas_from_draws

RANK, ALPHA = 4, 8.0  # scale 2: a wrong alpha / rank shows


@pytest.fixture(scope="module")
def base3(tmp_path_factory):
    return shared_tiny_flux3_snapshot(tmp_path_factory, distilled=False)


@pytest.fixture(scope="module")
def pair3(base3):
    """The same random LoRA (non-zero B) on every block Linear of our FLUX 3 and of diffusers' (peft)."""
    from diffusers import Flux3Transformer2DModel

    return lora_pair(base3, Flux3Transformer2DModel, rank=RANK, alpha=ALPHA)


def diffusers_flux3_loss(transformer, x0, noise, sigma, ctxs, conds):
    """The flow-matching objective (diffusers' FLUX.2 klein trainer's, D-kt) through diffusers' FLUX 3 call as its
    modular pipeline makes it: tokens (B, L, C), the image at `timestep` sigma, the references as
    `image_cond_hidden_states` with `_prepare_image_ids(..., l_coord=-(k + 1))`, each caption with its own
    `txt_ids`. Captions of different lengths cannot share a call: each example runs alone, the loss is their mean."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    h, w = GRID
    losses = []
    for i, ctx in enumerate(ctxs):
        s = sigma[i : i + 1].view(-1, 1, 1)
        xt = (1.0 - s) * x0[i : i + 1] + s * noise[i : i + 1]
        kwargs = {}
        if conds:
            kwargs["image_cond_hidden_states"] = torch.cat([c[i : i + 1] for c in conds], 1)
            kwargs["image_cond_ids"] = torch.cat(
                [_prepare_image_ids(h, w, 0.5, l_coord=-(1 + k)) for k in range(len(conds))], 0
            )
        pred = transformer(
            hidden_states=xt,
            encoder_hidden_states=ctx,
            timestep=sigma[i : i + 1],
            img_ids=_prepare_image_ids(h, w, 0.5),
            txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(ctx),
            return_dict=False,
            **kwargs,
        )[0]
        target = noise[i : i + 1] - x0[i : i + 1]
        losses.append(torch.mean((pred.float() - target.float()) ** 2))
    return torch.stack(losses).mean()


GRID = (4, 3)  # h, w of the target's token grid (a 48 x 64 px image)


def flux3_batch(case: str, seed: int = 3):
    """x0, noise (B, L, C); sigma (B,) on the training grid; one caption (1, Lt, E) per example; references."""
    g = np.random.default_rng(seed)
    B, C, E = 2, 32, 128
    L = GRID[0] * GRID[1]
    x0, noise = g.standard_normal((2, B, L, C)).astype(np.float32)
    windows = (80, 160) if case == "windows" else (80, 80)
    ctxs = [g.standard_normal((1, n, E)).astype(np.float32) for n in windows]
    sigma = sigmas_from_draws("uniform", np.array([0.2345, 0.9], dtype=np.float32), L)
    conds = [g.standard_normal((B, L, C)).astype(np.float32) for _ in range(2 if case == "edit" else 0)]
    return x0, noise, sigma, ctxs, conds


def our_flux3_loss_and_grads(model, x0, noise, sigma, ctxs, conds, checkpoint=False):
    refs = mx.concatenate([mx.array(c) for c in conds], axis=1) if conds else None
    rope = lambda n: FLUX3.training_rope(model, GRID, len(conds), n)  # noqa: E731
    f = nn.value_and_grad(
        model,
        lambda: batch_loss(
            model,
            mx.array(x0),
            mx.array(noise),
            sigma=mx.array(sigma),
            ctx=[mx.array(c) for c in ctxs],
            rope=rope,
            refs=refs,
            checkpoint=checkpoint,
        ),
    )
    loss, grads = f()
    return loss, dict(tree_flatten(grads))


@pytest.mark.parametrize("case", ["text-to-image", "edit", "windows"])
def test_flux3_loss_and_every_gradient_equal_diffusers_peft_and_autograd(pair3, case):
    model, lora, ref = pair3
    x0, noise, sigma, ctxs, conds = flux3_batch(case)
    loss, grads = our_flux3_loss_and_grads(model, x0, noise, sigma, ctxs, conds)
    ref.zero_grad()
    t = torch.from_numpy
    ref_loss = diffusers_flux3_loss(ref, t(x0), t(noise), t(sigma), [t(c) for c in ctxs], [t(c) for c in conds])
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    loss_ckpt, grads_ckpt = our_flux3_loss_and_grads(model, x0, noise, sigma, ctxs, conds, checkpoint=True)
    assert abs(loss_ckpt.item() - loss.item()) <= 1e-6 * abs(loss.item())
    assert all(rel_err(grads_ckpt[k], grads[k]) <= 1e-5 for k in grads)
    checked = set()
    for name, (pa, pb) in lora.paths().items():
        m = ref.get_submodule(name)
        for ours, theirs in (
            (grads[pa], m.lora_A["default"].weight.grad),
            (grads[pb], m.lora_B["default"].weight.grad),
        ):
            if theirs is None or not theirs.abs().max():  # a block this case never runs (references without any)
                assert not np.abs(to_np(ours)).max(), name
                continue
            o, r = to_np(ours).ravel(), theirs.numpy().ravel()
            assert rel_err(ours, theirs) <= 1e-4, name
            assert o @ r / (np.linalg.norm(o) * np.linalg.norm(r)) >= 0.99999, name
            checked.add(name)
    modes = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("mode_blocks") else "") for n in checked}
    want = {"mode_blocks.image", "txt_mode_blocks", "single_transformer_blocks"}
    assert modes == (want | {"mode_blocks.image_cond"} if case == "edit" else want), modes


def test_flux3_shift_noise_levels_are_the_flux3_scheduler_shift_of_a_logit_normal_draw():
    """`--timesteps shift` on FLUX 3: sigma = s t / (1 + (s - 1) t), t = sigmoid(N(0, 1)), s the constant shift of
    FLUX 3's sampling schedule at every size; judged by diffusers' scheduler as Flux3SetTimestepsStep builds it."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep

    shift = Flux3SetTimestepsStep().shift
    assert FLUX3.train_shift == shift == 6.93
    n = torch.normal(0.0, 1.0, size=(2000,), generator=torch.Generator().manual_seed(3))
    t = torch.sigmoid(n).numpy().astype(np.float64)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(sigmas=list(t))
    ref = sched.sigmas[:-1].numpy()
    for tokens in (16, 1024, 4096):  # the same at every size
        ours = sigmas_from_draws("shift", n.numpy(), tokens, FLUX3.train_shift)
        assert np.abs(ours - ref).max() <= 1e-6


def test_flux3_targets_presets_name_its_blocks_and_refuse_what_it_has_not(base3):
    params = describe(base3).params
    names = lambda t, **kw: [s.name for s in parse_targets(t, params, **kw)]  # noqa: E731
    every = names("all")
    assert len(every) == (3 * 2 + 2) * 6  # 3 modes x 2 blocks + 2 single blocks: q, k, v, out, ff in and out
    assert names("image") == [n for n in every if n.startswith("mode_blocks.image.")]
    assert names("reference:1") == [n for n in every if n.startswith("mode_blocks.image_cond.1.")]
    assert names("text") == [n for n in every if n.startswith("txt_mode_blocks.")]
    assert names("single:0-0") == [n for n in every if n.startswith("single_transformer_blocks.0.")]
    assert len(names("attention")) == 8 * 4  # q, k, v, out of every block
    assert names("q_proj") == names("to_q")  # our (BFL) name or diffusers'
    # without control images the reference blocks never run: `all` leaves them out, naming them is refused
    assert names("all", references=False) == [n for n in every if "image_cond" not in n]
    with pytest.raises(FluxKleinError, match="--targets reference adapts only the reference blocks"):
        parse_targets("reference", params, references=False)
    for bad in ("double", "single:0-5", "ref_time_in.in_layer", "target_timestep_embedder.linear_1"):
        with pytest.raises(FluxKleinError, match="--targets"):
            parse_targets(bad, params)


def test_flux3_lokr_factors_loss_and_gradients_equal_peft_lokr(base3):
    """LoKr on every block Linear of FLUX 3 (whole w2 on the 64-wide projections, low-rank w2 on the MLP's):
    the factor shapes are peft's LoKr's on diffusers' Flux3Transformer2DModel, and with the same random factors
    the loss and every factor's gradient equal torch autograd through it (an edit batch, two references)."""
    from diffusers import Flux3Transformer2DModel
    from peft import LoKrConfig

    from flux_klein_mlx.lora.layers import ROLE_LISTS
    from flux_klein_mlx.models.flux3.transformer import flux3_diffusers_name
    from flux_klein_mlx.train.step.adapters import attach_lokr

    rank = alpha = 4  # alpha / r = 1: LyCORIS' whole-w2 scale (1) and peft's scaling agree on every layer
    model = load_component(describe(base3), "transformer", mx.float32)
    slots = parse_targets("all", model.params)
    lokr = attach_lokr(
        model, slots, params=model.params, rank=rank, alpha=alpha, factor=-1, rng=np.random.default_rng(1)
    )
    ref = Flux3Transformer2DModel.from_pretrained(base3 / "transformer", dtype=torch.float32).eval()
    ref.add_adapter(LoKrConfig(r=rank, alpha=alpha, target_modules=[s.name for s in slots]))
    g = np.random.default_rng(4)
    values, kinds = {}, set()
    for path, (_, term, shape) in lokr.where.items():
        theirs = ref.get_submodule(flux3_diffusers_name(path))
        for role in term.places:
            name = ROLE_LISTS[role]
            assert tuple(getattr(theirs, name)["default"].shape) == shape.factor_shapes()[role], (path, role)
            value = (0.2 * g.standard_normal(shape.factor_shapes()[role])).astype(np.float32)
            values[f"{path}.{role}"] = mx.array(value)
            getattr(theirs, name)["default"].data = torch.from_numpy(value)
        kinds.add(shape.rank is None)
    assert kinds == {True, False}  # both a whole and a low-rank w2
    lokr.load(values, "test values")
    x0, noise, sigma, ctxs, conds = flux3_batch("edit")
    loss, grads = our_flux3_loss_and_grads(model, x0, noise, sigma, ctxs, conds)
    t = torch.from_numpy
    ref_loss = diffusers_flux3_loss(ref, t(x0), t(noise), t(sigma), [t(c) for c in ctxs], [t(c) for c in conds])
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for path, (_, term, _) in lokr.where.items():
        theirs = ref.get_submodule(flux3_diffusers_name(path))
        for role, i in term.places.items():
            name = ROLE_LISTS[role]
            assert rel_err(grads[f"{path}.{name}.{i}"], getattr(theirs, name)["default"].grad) <= 1e-4, (path, role)


def test_flux3_memory_plan_counts_the_released_flux3_base_weights():
    """The plan's weights for FLUX 3 Base at full size are diffusers' Flux3Transformer2DModel's parameters (built
    on the meta device, nothing allocated) at 2 bytes; 4-bit counts less than a third of that."""
    from diffusers import Flux3Transformer2DModel

    from flux_klein_mlx.models.flux3.config import Flux3Params
    from flux_klein_mlx.train.memory import step_peak, weight_bytes

    with torch.device("meta"):
        count = sum(p.numel() for p in Flux3Transformer2DModel().parameters())
    assert 5.5e9 < count < 5.6e9
    assert weight_bytes(Flux3Params(), None) == 2 * count
    assert weight_bytes(Flux3Params(), 4) < 0.3 * 2 * count
    low, kept = (step_peak(Flux3Params(), 10**7, resolution=512, bits=None, low_memory=m)[0] for m in (True, False))
    assert 2 * count < low < kept  # the weights, then activations; keeping every block's costs more
