"""--ema and --validation (issue 29), judged by references outside our code.

- the EMA in every checkpoint and the output against diffusers' own `EMAModel` fed the raw weights
  of each step, and against the same recursion in a few lines of numpy;
- each validation loss against diffusers' transformer with the checkpoint's LoRA loaded, on latents
  from diffusers' VAE, with the documented fixed noise recomputed in numpy;
- resume bit-exact with both on, in bfloat16 (the default dtype).
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image
from refs import diffusers_pipeline, diffusers_pipeline_for_loras, diffusers_prompt_embeds
from train_refs import flux2_training_loss, vae_latents

import flux_klein_mlx
from flux_klein_mlx.train.report.evaluation import ValidationFinished

CAPTION = "a striped test card"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Training images (one bucket) and two held-out images (64x64 and 96x64 -> 48x80)."""
    root = tmp_path_factory.mktemp("eval-data")
    train, held = root / "train", root / "held"
    train.mkdir(), held.mkdir()
    g = np.random.default_rng(1)
    for folder, sizes in ((train, [(64, 64), (64, 64)]), (held, [(64, 64), (96, 64)])):
        for i, (h, w) in enumerate(sizes):
            Image.fromarray((g.random((h, w, 3)) * 255).astype(np.uint8)).save(folder / f"im{i}.png")
            (folder / f"im{i}.txt").write_text(CAPTION if folder is train else f"held out picture {i}")
    return train, held


def lora_arrays(path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


@pytest.fixture(scope="module")
def ema_run(base, folders, tmp_path_factory):
    """3 steps in float32 with --ema 0.9 and --validation, a checkpoint after every step:
    (events, output, work folder)."""
    out = tmp_path_factory.mktemp("ema-run") / "ema.safetensors"
    events = list(
        flux_klein_mlx.train_lora(
            model=base,
            data=folders[0],
            output=out,
            steps=3,
            rank=4,
            resolution=64,
            dtype="float32",
            lr=3e-3,
            save_every=1,
            keep_checkpoints=5,
            ema=0.9,
            validation=folders[1],
        )
    )
    return events, out, out.with_name("ema.train")


def test_ema_equals_diffusers_emamodel_and_numpy_on_every_checkpoint(base, ema_run):
    from diffusers.training_utils import EMAModel

    _, out, work = ema_run
    raw = [lora_arrays(work / f"checkpoint-00000{k}" / "lora.safetensors") for k in (1, 2, 3)]
    ema = [lora_arrays(work / f"checkpoint-00000{k}" / "ema.safetensors") for k in (1, 2, 3)]
    keys = sorted(raw[0])
    # numpy: d_1 = 0, d_k = min(0.9, k / (9 + k)); e <- e - (1 - d)(e - w), float32
    e = {k: raw[0][k].copy() for k in keys}
    params = [torch.nn.Parameter(torch.from_numpy(raw[0][k].copy())) for k in keys]
    reference = EMAModel(params, decay=0.9)
    for step in (1, 2, 3):
        d = 0.0 if step == 1 else min(0.9, step / (9 + step))
        e = {k: (e[k] - np.float32(1 - d) * (e[k] - raw[step - 1][k])).astype(np.float32) for k in keys}
        for p, k in zip(params, keys, strict=True):
            p.data.copy_(torch.from_numpy(raw[step - 1][k]))
        reference.step(params)
        for k, shadow in zip(keys, reference.shadow_params, strict=True):
            assert np.abs(ema[step - 1][k] - e[k]).max() <= 1e-6 * max(1.0, np.abs(e[k]).max()), (step, k)
            assert np.abs(ema[step - 1][k] - shadow.numpy()).max() <= 1e-6 * max(1.0, np.abs(e[k]).max()), (step, k)
    assert any(np.abs(ema[2][k] - raw[2][k]).max() > 1e-4 for k in keys)  # the average is not the last weights
    written = lora_arrays(out)
    assert all(np.array_equal(written[k], ema[2][k]) for k in keys)  # float32 run: the EMA itself is the output
    assert flux_klein_mlx.load(base, loras=[out]).loras[0].format == "diffusers"


def tokens(latents: torch.Tensor) -> torch.Tensor:
    return latents.flatten(2).transpose(1, 2)  # (1, C, h, w) -> (1, h*w, C), row-major


def diffusers_validation(base, lora, held, controls=None) -> np.ndarray:
    """diffusers' loss of each validation level, averaged over the two held-out images, with `lora` loaded
    into a copy of its transformer, our fixed noise and (with `controls`) each image's reference in the
    sequence (D-ki's edit loss)."""
    from diffusers import Flux2KleinPipeline as P

    from flux_klein_mlx.train.data.dataset import bucket_size

    shared = diffusers_pipeline(base, "plain", distilled=False)  # the prompt embeddings, computed once per session
    pipe = diffusers_pipeline_for_loras(base, distilled=False)
    pipe.load_lora_weights(lora, adapter_name="v")
    sums = np.zeros(5)
    with torch.no_grad():
        for i in range(2):
            path = held / f"im{i}.png"
            size = bucket_size(*Image.open(path).size, 64)
            x0 = vae_latents(pipe.vae, P._patchify_latents, path, size)  # (1, C, h, w)
            conds = []  # D-ki's references: each image's own, after the target in its sequence
            if controls:
                conds.append(tokens(vae_latents(pipe.vae, P._patchify_latents, controls / f"im{i}.png", size)))
            C, h, w = x0.shape[1:]
            noise = np.random.default_rng([29, i]).standard_normal((5, h * w, C), dtype=np.float32)
            ctx = diffusers_prompt_embeds(shared, f"held out picture {i}")
            for k, sigma in enumerate((0.1, 0.3, 0.5, 0.7, 0.9)):
                eps = torch.from_numpy(noise[k][None])  # (1, L, C)
                # the scheduler's sigma (1000 - idx) / 1000, at the draw u in the middle of [idx, idx + 1) / 1000
                u = torch.tensor([(1000 - round(sigma * 1000) + 0.5) / 1000], dtype=torch.float32)
                loss = flux2_training_loss(pipe.transformer, tokens(x0), eps, u, [ctx], conds, (h, w))
                sums[k] += loss.item()
    return sums / 2


def test_validation_equals_diffusers_loss_with_the_checkpoints_lora_and_fixed_noise(base, folders, ema_run):
    events, _, work = ema_run
    measured = [ev for ev in events if isinstance(ev, ValidationFinished)]
    assert [ev.step for ev in measured] == [1, 2, 3]
    ref, ours = diffusers_validation(base, work / "checkpoint-000003" / "lora.safetensors", folders[1]), measured[-1]
    assert np.allclose([ours.by_sigma[str(s)] for s in (0.1, 0.3, 0.5, 0.7, 0.9)], ref, rtol=1e-4)
    assert ours.loss == pytest.approx(ref.mean(), rel=1e-4)
    record = json.loads((work / "train.json").read_text())
    assert [h["loss"] for h in record["validation"]] == [ev.loss for ev in measured]
    assert json.loads((work / "checkpoint-000003" / "state.json").read_text())["validation"][-1]["loss"] == ours.loss
    plot = np.asarray(Image.open(work / "loss.png").convert("RGB"))
    assert ((plot == (220, 40, 40)).all(-1)).sum() > 20  # the validation points are drawn


def test_validation_of_an_edit_lora_measures_each_image_with_its_reference_as_diffusers_does(base, folders, tmp_path):
    """--control with --validation-control: each held-out image is measured with its own control image in
    the sequence, as training puts it there (diffusers' edit loss, the run's LoRA, the fixed noise)."""
    train, held = folders
    before, held_before = tmp_path / "before", tmp_path / "held-before"
    g = np.random.default_rng(7)
    for images, references in ((train, before), (held, held_before)):
        references.mkdir()
        for path in sorted(images.glob("*.png")):
            w, h = Image.open(path).size
            Image.fromarray((g.random((h, w, 3)) * 255).astype(np.uint8)).save(references / path.name)
    out = tmp_path / "edit.safetensors"
    events = list(
        flux_klein_mlx.train_lora(
            model=base,
            data=train,
            controls=[before],
            output=out,
            steps=1,
            rank=4,
            resolution=64,
            dtype="float32",
            lr=3e-3,
            validation=held,
            validation_controls=[held_before],
        )
    )
    ours = [ev for ev in events if isinstance(ev, ValidationFinished)][-1]
    ref = diffusers_validation(base, out, held, held_before)
    assert np.allclose([ours.by_sigma[str(s)] for s in (0.1, 0.3, 0.5, 0.7, 0.9)], ref, rtol=1e-4)
    without = diffusers_validation(base, out, held)  # the references change the loss: the comparison means something
    assert np.abs(ref - without).max() > 1e-3 * np.abs(ref).max()
    assert json.loads((out.with_name("edit.train") / "train.json").read_text())["settings"]["validation_controls"] == [
        str(held_before)
    ]


def test_resume_is_bit_exact_with_ema_and_validation_in_bfloat16(base, folders, tmp_path):
    # one held-out image: resume is the point here, and each image costs 5 forward passes per measurement
    # (the mean over two images of two buckets is test_validation_equals_diffusers_loss_..._fixed_noise's)
    held = tmp_path / "held"
    held.mkdir()
    for name in ("im0.png", "im0.txt"):
        shutil.copy(folders[1] / name, held / name)
    common = dict(
        model=base,
        data=folders[0],
        rank=4,
        resolution=64,
        ema=0.99,
        validation=held,
        save_every=2,
        keep_checkpoints=5,
    )
    straight = list(flux_klein_mlx.train_lora(output=tmp_path / "straight.safetensors", steps=4, **common))
    first = list(
        flux_klein_mlx.train_lora(output=tmp_path / "first.safetensors", steps=2, work_dir=tmp_path / "r", **common)
    )
    second = list(
        flux_klein_mlx.train_lora(
            output=tmp_path / "second.safetensors", steps=4, work_dir=tmp_path / "r", resume=True, **common
        )
    )
    val = lambda evs: [(e.step, e.loss, e.by_sigma) for e in evs if isinstance(e, ValidationFinished)]  # noqa: E731
    assert val(first) + val(second) == val(straight) and len(val(straight)) == 2
    a, b = (mx.load(str(tmp_path / f"{n}.safetensors")) for n in ("straight", "second"))
    assert all(v.dtype == mx.bfloat16 for v in b.values())
    assert a.keys() == b.keys() and all(
        np.array_equal(np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32))) for k in a
    )
    ea, eb = (
        lora_arrays(d / "checkpoint-000004" / "ema.safetensors") for d in (tmp_path / "straight.train", tmp_path / "r")
    )
    assert all(np.array_equal(ea[k], eb[k]) for k in ea)
    state = json.loads((tmp_path / "r" / "checkpoint-000004" / "state.json").read_text())
    assert [h["step"] for h in state["validation"]] == [2, 4]
