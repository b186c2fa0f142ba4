"""Issue 39: the trainers' dialect: kohya's repeats (`N_name` folders, `--repeats`), `--flip`, `--epochs` with
saving and sampling every N epochs.

- repeats and flips change which examples a step draws exactly as documented (train/data/dataset.py,
  docs/training.md#repeats-flips-and-epochs): the draws of a real run are listed and equal those the
  documented rules give (an epoch: each example `repeats` times, permuted by the run's generator, cut
  into batches per bucket, the batches permuted; a flip: U(0, 1) < 1/2 from (seed, "flip", step, example)),
  and a flipped example trains on the latents of the mirrored image;
- `--epochs` stops at the step its epochs take; `--save-every-epochs` / `--sample-every-epochs` land on the
  steps that end those epochs;
- each new option's bad value is one line before any model loads, nothing written.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_settings import base_args, make_images, no_models, refused  # noqa: F401

import flux_klein_mlx
import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.train.data.dataset import FLIP_STREAM, TrainItem, epoch_batches, load_pixels, scan_data
from flux_klein_mlx.train.report.events import CheckpointSaved, StepFinished, TrainStarted
from flux_klein_mlx.train.report.samples import SamplesSaved


def kohya_data(root):
    """--data with one image at the top level and a `3_dots/` repeat folder of two."""
    make_images(root, n=1)
    make_images(root / "3_dots", n=2)
    return root


def documented_epoch(repeats: list[int], buckets: list, batch: int, rng) -> list[list[int]]:
    """An epoch as documented: each example `repeats` times, in the order of a permutation of that list drawn
    from the run's generator, cut into batches within each bucket, the batches in the order of a second
    permutation."""
    pool = [i for i, r in enumerate(repeats) for _ in range(r)]
    order = [pool[j] for j in rng.permutation(len(pool))]
    cut = []
    for bucket in dict.fromkeys(buckets[i] for i in order):  # buckets in order of their first example
        same = [i for i in order if buckets[i] == bucket]
        cut += [same[k : k + batch] for k in range(0, len(same), batch)]
    return [cut[j] for j in rng.permutation(len(cut))]


def documented_flips(seed: int, step: int, first: int, n: int) -> list[bool]:
    return [bool(np.random.default_rng([seed, FLIP_STREAM, step, k]).random() < 0.5) for k in range(first, first + n)]


def test_an_epoch_lists_each_example_repeats_times_as_documented(tmp_path):
    """Items of repeats 1, 3 and 2 in two buckets: the epoch is the documented one, each example its
    repeats times (a batch may hold one twice); repeats of 1 give the plain permutation of before."""
    pic = scan_data(make_images(tmp_path / "d", n=1), resolution=64)[0].image
    items = [
        TrainItem(stem=s, image=pic, caption="c", caption_from="file", bucket=b, repeats=r)
        for s, b, r in [("a", (64, 64), 1), ("b", (64, 64), 3), ("c", (96, 48), 2)]
    ]
    for seed in range(5):
        got = epoch_batches(items, 2, np.random.default_rng(seed))
        assert got == documented_epoch([1, 3, 2], [it.bucket for it in items], 2, np.random.default_rng(seed))
        assert sorted(i for b in got for i in b) == [0, 1, 1, 1, 2, 2]
        plain = [TrainItem(**{**it.__dict__, "repeats": 1}) for it in items]
        order = np.random.default_rng(seed).permutation(3)
        assert sorted(i for b in epoch_batches(plain, 2, np.random.default_rng(seed)) for i in b) == sorted(order)


def test_a_run_draws_its_repeats_and_flips_exactly_as_documented(base, tmp_path, monkeypatch):
    """A run on a top-level image and a `3_dots/` folder of two, --repeats 2, --flip, batch 2, 9 steps: the
    items are im0 x2 and 3_dots/im0, 3_dots/im1 x6 each; every step's examples are the documented epoch's
    (from the generator's state where each epoch starts), each example flipped by the documented draw and
    trained on the latents of that (mirrored or plain) image."""
    data = kohya_data(tmp_path / "data")
    starts, draws = [], []
    real_epoch, real_batch = train_module.epoch_batches, train_module.Trainer.micro_batch

    def epoch(items, batch, rng):
        starts.append(rng.bit_generator.state)
        return real_epoch(items, batch, rng)

    def micro_batch(self, indices, first):
        out = real_batch(self, indices, first)
        flips = documented_flips(5, self.step_no + 1, first, len(indices))
        wanted = [
            self.latent_cache.get(self.items[i].image, self.items[i].bucket, f)
            for i, f in zip(indices, flips, strict=True)
        ]
        draws.append((list(indices), flips, bool(mx.array_equal(out[0], mx.concatenate(wanted, axis=0)).item())))
        return out

    monkeypatch.setattr(train_module, "epoch_batches", epoch)
    monkeypatch.setattr(train_module.Trainer, "micro_batch", micro_batch)
    # float32: bf16 steps are slower on a CPU, and the draws, not the dtype, are what is checked
    settings = dict(
        model=base, data=data, rank=4, resolution=64, repeats=2, flip=True, batch_size=2, seed=5, dtype="float32"
    )
    events = list(flux_klein_mlx.train_lora(output=tmp_path / "o.safetensors", steps=9, **settings))
    assert [e.step for e in events if isinstance(e, StepFinished)] == list(range(1, 10))
    items = scan_data(data, resolution=64, repeats=2)
    assert [(it.stem, it.repeats) for it in items] == [("im0", 2), ("3_dots/im0", 6), ("3_dots/im1", 6)]
    expected = []
    for state in starts:  # 14 examples an epoch in one bucket: 7 batches; 9 steps reach into the second epoch
        rng = np.random.default_rng()
        rng.bit_generator.state = state
        expected += documented_epoch([it.repeats for it in items], [it.bucket for it in items], 2, rng)
    assert len(starts) == 2 and [d[0] for d in draws] == expected[:9]
    assert all(same for *_, same in draws)  # each example's latents: the mirrored image's where it flipped
    flips = [f for _, fs, _ in draws for f in fs]
    assert 0 < sum(flips) < len(flips)


def test_a_mirrored_latent_is_the_vae_of_the_mirrored_image(tmp_path):
    path = make_images(tmp_path / "d", n=1) / "im0.png"
    plain, mirrored = load_pixels(path, (96, 64)), load_pixels(path, (96, 64), flip=True)
    assert np.array_equal(mirrored, plain[:, ::-1]) and not np.array_equal(mirrored, plain)


@pytest.mark.filterwarnings("ignore:the LoRA at step")
def test_epochs_stop_at_their_step_and_save_and_sample_at_epoch_ends(base, distilled, tmp_path):
    """7 examples (1 + 3_dots' 2 x 3), batch 2: 4 batches an epoch; --epochs 2 with --grad-accum 3 is
    ceil(8 / 3) = 3 steps; epoch 1 ends in step 2 (batch 4), epoch 2 in step 3 (batch 8): checkpoints at
    2 and 3 (--save-every-epochs 1), samples at 3 (--sample-every-epochs 2, and the baseline)."""
    data = kohya_data(tmp_path / "data")
    events = list(
        flux_klein_mlx.train_lora(
            model=base,
            data=data,
            output=tmp_path / "o.safetensors",
            rank=4,
            resolution=64,
            dtype="float32",  # faster than bf16 on a CPU; the epoch arithmetic is what is checked
            batch_size=2,
            grad_accum=3,
            epochs=2,
            save_every_epochs=1,
            sample_every_epochs=2,
            sample_prompts=["a fox"],
            sample_model=distilled,
            sample_steps=1,
        )
    )
    assert next(e for e in events if isinstance(e, TrainStarted)).total_steps == 3
    assert [e.step for e in events if isinstance(e, StepFinished)] == [1, 2, 3]
    assert [e.step for e in events if isinstance(e, CheckpointSaved)] == [2, 3]
    assert [e.step for e in events if isinstance(e, SamplesSaved)] == [0, 3]


def test_the_dialects_bad_input_is_one_line_before_any_model(capsys, base, tmp_path, no_models):  # noqa: F811
    data = make_images(tmp_path / "data")
    args = base_args(base, data, tmp_path / "o.safetensors")
    refused(capsys, tmp_path, [*args, "--repeats", "0"], "repeats")
    refused(capsys, tmp_path, [*args, "--epochs", "0"], "epochs")
    refused(capsys, tmp_path, [*args, "--save-every-epochs", "0"], "save-every-epochs")
    refused(capsys, tmp_path, [*args, "--sample-every-epochs", "2"], "--sample-every-epochs needs", "--sample-prompt")
    refused(capsys, tmp_path, [*args, "--epochs", "2", "--steps", "10"], "--epochs", "--steps")
    refused(capsys, tmp_path, [*args, "--epochs", "1", "--warmup-steps", "5", "--lr-scheduler", "linear"], "warmup")
    make_images(data / "0_none", n=1)
    refused(capsys, tmp_path, args, "0_none", "0 times")
    (data / "0_none" / "im0.png").rename(data / "0_none" / "x.png")
    (data / "0_none").rename(data / "2_some")
    controls = make_images(tmp_path / "before")
    refused(capsys, tmp_path, [*args, "--control", str(controls)], "repeat folders", "--repeats")
    try:
        flux_klein_mlx.train_lora(model=base, data=data, output=tmp_path / "p.safetensors", flip="yes")
    except flux_klein_mlx.FluxKleinError as e:
        assert "flip must be True or False" in str(e)
    else:
        raise AssertionError("flip='yes' was taken")
