"""LoKr training (`--adapter lokr`, issue 29), judged by the references:

- the factorization, the factor shapes and the choice of a whole or low-rank w2 against peft's LoKr
  (LyCORIS' algorithm), and a trained layer's delta and gradients against peft's LoKr layer in torch;
- the written files, in the ComfyUI/ai-toolkit layout and in the diffusers layout, loaded by
  diffusers' own `load_lora_weights` (its BFL LoKr converter fuses q/k/v) giving our image;
- resume bit-exact; bad input refused before any model loads;
- FLUX 3 Image Klein (issue 37): LoKr on every block Linear (whole w2 on the 64-wide projections, low-rank on
  the MLP's), its factor shapes peft's LoKr's on diffusers' Flux3Transformer2DModel, the loss and every factor's
  gradient torch autograd's through it (an edit batch, two references as their own stream).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from families import KITS
from refs import diffusers_lighthouse, diffusers_pipeline_for_loras, our_lighthouse, rel_err, to_np
from train_batch import our_loss_and_grads, reference_loss, training_batch

import flux_klein_mlx
from flux_klein_mlx.lora.layers import ROLE_LISTS, LoRALinear
from flux_klein_mlx.run.components import load_component
from flux_klein_mlx.run.loading import describe
from flux_klein_mlx.train.state import read_checkpoint
from flux_klein_mlx.train.step.adapters import (
    LoKrShape,
    add_lokr_term,
    attach_lokr,
    factorization,
    parse_targets,
    write_lora_file,
)
from flux_klein_mlx.train.trainer import StepFinished

CAPTION = "a striped test card"


@pytest.mark.parametrize(
    "dimension, factor",
    [
        (64, -1),
        (192, -1),
        (576, -1),
        (3072, -1),
        (9216, -1),
        (127, -1),
        (256, 4),
        (192, 8),
        (27648, 16),
        (12288, 16),
        (100, 7),
    ],
)
def test_factorization_is_peft_and_lycoris(dimension, factor):
    from peft.tuners.lokr.layer import factorization as peft_factorization

    assert factorization(dimension, factor) == peft_factorization(dimension, factor)


def test_factorization_keeps_the_smaller_side_first_as_lycoris_does():
    """peft returns (factor, rest) even when the factor is the larger side; LyCORIS (whose files ComfyUI,
    ai-toolkit and diffusers read) swaps them: w1 is the small factor."""
    assert factorization(64, 16) == (4, 16)


@pytest.mark.parametrize(
    "out_dims, in_dims, rank, factor",
    [(192, 64, 4, -1), (192, 64, 8, -1), (576, 64, 4, -1), (64, 256, 16, -1), (384, 64, 2, 4)],
)
def test_factor_shapes_and_delta_and_gradients_equal_peft_lokr(out_dims, in_dims, rank, factor):
    """Our trainable LoKr term on a Linear against peft's LoKr Linear with the same factors: same shapes,
    the same output, and the same gradients of a loss by every factor."""
    from peft import LoKrConfig
    from peft.tuners.lokr.layer import Linear as PeftLoKr

    shape = LoKrShape.of(out_dims, in_dims, rank, factor)
    alpha = 2.0 * rank if shape.rank is not None else float(rank)  # LyCORIS' scale: alpha/r low-rank, 1 whole
    rng = np.random.default_rng(1)
    base = torch.nn.Linear(in_dims, out_dims, bias=False, dtype=torch.float64)
    torch.nn.init.normal_(base.weight, std=0.1)
    theirs = PeftLoKr(base, "default", LoKrConfig(r=rank, alpha=alpha, decompose_factor=factor), r=rank, alpha=alpha)
    theirs = theirs.double()
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = mx.array(base.weight.detach().numpy().astype(np.float32))
    model = nn.Module()
    model.layer = layer = LoRALinear(linear)
    term = add_lokr_term(layer, shape, alpha, rng)
    assert term.factor == pytest.approx(theirs.scaling["default"])
    # random factors everywhere (the init has a zero factor: a delta of 0 would prove nothing)
    for role, i in term.places.items():
        name = ROLE_LISTS[role]
        value = rng.standard_normal(layer[name][i].shape).astype(np.float32) * 0.2
        layer[name][i] = mx.array(value)
        getattr(theirs, name)["default"].data = torch.from_numpy(value.astype(np.float64))
        assert tuple(getattr(theirs, name)["default"].shape) == tuple(value.shape), name
    assert set(term.places) == ({"w1", "w2"} if shape.rank is None else {"w1", "w2_a", "w2_b"})
    x = rng.standard_normal((2, 3, in_dims)).astype(np.float32)
    y_t = theirs(torch.from_numpy(x.astype(np.float64)))
    (y_t**2).sum().backward()

    def loss(trainable):
        model.update(trainable)
        return (model.layer(mx.array(x)) ** 2).sum()

    value, grads = mx.value_and_grad(loss)(model.trainable_parameters())
    y = model.layer(mx.array(x))
    assert np.abs(to_np(y) - y_t.detach().numpy()).max() <= 1e-4 * np.abs(y_t.detach().numpy()).max()
    for role, i in term.places.items():
        name = ROLE_LISTS[role]
        g_t = getattr(theirs, name)["default"].grad.numpy()
        g = to_np(grads["layer"][name][i])
        assert np.abs(g - g_t).max() <= 1e-4 * np.abs(g_t).max(), name


# --- whole runs on the tiny Base snapshot ------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("lokr-data")
    yy, xx = np.mgrid[0:64, 0:64]
    for i in range(2):
        img = np.stack([xx * 4 % 256, yy * 4 % 256, (xx + yy) * 2 % 256], -1).astype(np.uint8)
        Image.fromarray(np.roll(img, 11 * i, axis=0)).save(d / f"im{i}.png")
        (d / f"im{i}.txt").write_text(CAPTION)
    return d


@pytest.fixture(scope="module")
def trained(base, data, tmp_path_factory):
    """A LoKr of rank 8 (whole w2 on the qkv layers, low-rank pairs elsewhere) trained 2 steps in bfloat16
    with an EMA, straight and as 1 step + a resume to 2; returns the run's work folder and the events."""
    tmp = tmp_path_factory.mktemp("lokr-runs")
    common = dict(
        model=base,
        data=data,
        adapter="lokr",
        rank=8,
        alpha=4.0,
        resolution=64,
        lr=5e-2,
        save_every=1,
        keep_checkpoints=5,
        ema=0.9,
    )  # the default dtype, bfloat16
    straight = list(flux_klein_mlx.train_lora(output=tmp / "straight.safetensors", steps=2, **common))
    first = list(
        flux_klein_mlx.train_lora(output=tmp / "first.safetensors", steps=1, work_dir=tmp / "resumed", **common)
    )
    second = list(
        flux_klein_mlx.train_lora(
            output=tmp / "second.safetensors", steps=2, work_dir=tmp / "resumed", resume=True, **common
        )
    )
    return tmp, straight, first, second


def test_lokr_resume_is_bit_exact(trained):
    tmp, straight, first, second = trained
    steps = lambda evs: [(e.step, e.loss) for e in evs if isinstance(e, StepFinished)]  # noqa: E731
    assert steps(first) + steps(second) == steps(straight) and len(steps(straight)) == 2
    a, b = (mx.load(str(tmp / f"{n}.safetensors")) for n in ("straight", "second"))
    assert a.keys() == b.keys() and all(np.array_equal(to_np(a[k]), to_np(b[k])) for k in a)
    assert any(k.endswith(".lokr_w2") for k in a) and any(k.endswith(".lokr_w2_b") for k in a)  # both kinds
    assert all(np.abs(to_np(a[k])).max() > 0 for k in a if ".lokr_w2" in k)  # trained away from the zero init


def test_lokr_ema_checkpoint_is_a_lokr_file_like_the_checkpoints_own(base, trained):
    """ema.safetensors holds the average in lora.safetensors' layout (ComfyUI LoKr): it resumes exactly
    and loads as a LoKr wherever the checkpoint's file does."""
    tmp, *_ = trained
    folders = [tmp / "straight.train" / "checkpoint-000002", tmp / "resumed" / "checkpoint-000002"]
    raw = mx.load(str(folders[0] / "lora.safetensors"))
    ema, resumed = (mx.load(str(f / "ema.safetensors")) for f in folders)
    assert raw.keys() == ema.keys() == resumed.keys() and all(k.startswith("diffusion_model.") for k in ema)
    assert all(np.array_equal(to_np(ema[k]), to_np(resumed[k])) for k in ema)
    assert any(np.abs(to_np(ema[k]) - to_np(raw[k])).max() > 0 for k in ema)  # an average, not the last weights
    assert flux_klein_mlx.load(base, loras=[folders[0] / "ema.safetensors"]).loras[0].format == "lokr"


@pytest.fixture(scope="module")
def lokr_pipe(base):
    """A diffusers Base pipeline with its own transformer (loading a BFL LoKr fuses its q/k/v projections)."""
    return diffusers_pipeline_for_loras(base, distilled=False)


def adapters_like_the_run(base, folder):
    """The run's LoKr adapters on a fresh model, set from its checkpoint's tensors."""
    info = describe(base)
    model = load_component(info, "transformer", mx.float32)
    lokr = attach_lokr(
        model,
        parse_targets("all", info.params),
        params=info.params,
        rank=8,
        alpha=4.0,
        factor=-1,
        rng=np.random.default_rng(0),
    )
    lokr.load_terms(read_checkpoint(folder, lokr)[0], "the checkpoint")
    return lokr


@pytest.mark.parametrize("layout", ["comfyui", "diffusers", "converted"])
def test_lokr_files_load_in_diffusers_and_give_our_image(base, trained, lokr_pipe, layout, tmp_path, caplog):
    """Each layout, written from the trained adapters, loads in diffusers' `load_lora_weights` with no key
    left over and gives the image our pipeline gives with the same file (1e-3, float32). "converted" is
    the diffusers-layout file through `lora convert --format comfyui` (w1 · alpha/rank, w2 whole)."""
    from flux_klein_mlx.__main__ import main

    tmp, *_ = trained
    lokr = adapters_like_the_run(base, tmp / "straight.train" / "checkpoint-000002")
    path = tmp_path / f"{layout}.safetensors"
    if layout == "converted":
        write_lora_file(tmp_path / "source.safetensors", lokr, dtype=mx.float32, layout="diffusers")
        assert (
            main(["lora", "convert", str(tmp_path / "source.safetensors"), "-o", str(path), "--format", "comfyui"]) == 0
        )
        assert not any(k.endswith((".alpha", "_a", "_b")) for k in mx.load(str(path)))  # factors whole, scale 1
    else:
        write_lora_file(path, lokr, dtype=mx.float32, layout=layout)
    keys = mx.load(str(path)).keys()
    prefix = "transformer." if layout == "diffusers" else "diffusion_model."
    assert all(k.startswith(prefix) for k in keys)
    lokr_pipe.load_lora_weights(str(path), adapter_name=layout)
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "key" in r.getMessage().lower()]
        theirs = diffusers_lighthouse(lokr_pipe)
        ours, pipe = our_lighthouse(base, [path])
        without, _ = our_lighthouse(base)
        assert pipe.loras[0].format == "lokr" and np.abs(ours - theirs).max() <= 1e-3
        assert np.abs(ours - without).max() > 1e-2  # the LoKr changes the image: the comparison means something
        if layout == "converted":  # the same update as the file it came from
            before, _ = our_lighthouse(base, [tmp_path / "source.safetensors"])
            assert np.abs(ours - before).max() <= 1e-4
    finally:
        lokr_pipe.delete_adapters(layout)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--adapter", "loha"], ["adapter must be one of lora, lokr", "'loha'"]),
        (["--adapter", "lokr", "--lokr-factor", "0"], ["lokr-factor", "-1"]),
        (["--adapter", "lokr", "--lokr-factor", "-2"], ["lokr-factor"]),
        (["--adapter", "lokr", "--targets", "to_q"], ["whole layers", "img_attn.qkv"]),
        (["--adapter", "lokr", "--format", "kohya"], ["comfyui or diffusers", "kohya"]),
    ],
)
def test_bad_lokr_options_are_one_line_before_any_model_loads(base, data, tmp_path, capsys, monkeypatch, args, words):
    import flux_klein_mlx.train.trainer as trainer
    from flux_klein_mlx.__main__ import main

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the bad option was refused")

    monkeypatch.setattr(trainer, "load_component", no_model)
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = main(["train", "--model", str(base), "--data", str(data), "--output", str(tmp_path / "x.safetensors"), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert all(w in err for w in words), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_flux3_lokr_factors_loss_and_gradients_equal_peft_lokr(base3):
    """LoKr on every block Linear of FLUX 3 (whole w2 on the 64-wide projections, low-rank w2 on the MLP's):
    the factor shapes are peft's LoKr's on diffusers' Flux3Transformer2DModel, and with the same random factors
    the loss and every factor's gradient equal torch autograd through it (an edit batch, two references)."""
    from diffusers import Flux3Transformer2DModel
    from peft import LoKrConfig

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
    x0, noise, u, ctxs, conds = training_batch("edit", model.params.context_in_dim)
    loss, grads = our_loss_and_grads(model, x0, noise, u, ctxs, conds)
    ref_loss = reference_loss(KITS["flux3"], ref, x0, noise, u, ctxs, conds)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for path, (_, term, _) in lokr.where.items():
        theirs = ref.get_submodule(flux3_diffusers_name(path))
        for role, i in term.places.items():
            name = ROLE_LISTS[role]
            assert rel_err(grads[f"{path}.{name}.{i}"], getattr(theirs, name)["default"].grad) <= 1e-4, (path, role)
