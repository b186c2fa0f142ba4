"""Issue 39: the VAE latents of the training images are cached on disk (train/data/latents.py), as the captions'
embeddings are: a resume and a rerun encode nothing twice and open the VAE's weights zero times
(measured as the prompt cache's test measures the text encoder: tests/support/file_opens.py); the
log says so; a damaged entry is ignored and encoded again; the baseline samples are not redrawn on
resume.
"""

from __future__ import annotations

import numpy as np
from command_line import run_cli
from file_opens import FileOpens
from test_captions import said
from test_settings import base_args, make_images

import flux_klein_mlx.train.trainer as train_module
from flux_klein_mlx.run.loading import describe
from flux_klein_mlx.storage.embedding_cache import default_folder
from flux_klein_mlx.train.data.latents import LATENTS_SUBFOLDER


def counting_loads(monkeypatch) -> list[str]:
    loaded, real_load = [], train_module.load_component
    monkeypatch.setattr(
        train_module,
        "load_component",
        lambda info, name, *a, **k: loaded.append(name) or real_load(info, name, *a, **k),
    )
    return loaded


def tensors(path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


def test_resume_and_rerun_never_open_the_vae_and_a_damaged_entry_is_encoded_again(capsys, base, tmp_path, monkeypatch):
    """Run 1 (2 of 3 steps, bfloat16) encodes 2 latents; its resume and a rerun in another work folder read
    them all from the latent cache: the VAE's weight files are opened 0 times, the VAE is never loaded,
    the log says so; the rerun's LoRA equals the first run's bit for bit (the cached latents are the
    encoded ones). A damaged entry is ignored: the next run encodes that one latent again."""
    data = make_images(tmp_path / "data")
    vae_files = describe(base).files["vae"]
    args = base_args(base, data, tmp_path / "a.safetensors") + ["--steps", "2", "--save-every", "1"]
    rc, _, err = run_cli(capsys, "train", *args)
    assert rc == 0, err
    assert "encoding 2 images with the VAE ..." in said(err)
    assert any(line.startswith("latents: 2 latents encoded, VAE released") for line in said(err))
    loaded = counting_loads(monkeypatch)
    with FileOpens(vae_files, monkeypatch) as opens:
        resume = base_args(base, data, tmp_path / "a3.safetensors") + [
            "--steps",
            "3",
            "--resume",
            str(tmp_path / "a.train"),
        ]
        rc, _, err = run_cli(capsys, "train", *resume)
        assert rc == 0, err
        rc, _, err2 = run_cli(capsys, "train", *base_args(base, data, tmp_path / "b.safetensors"), "--steps", "2")
        assert rc == 0, err2
    assert opens.opened == [] and "vae" not in loaded, (opens.opened, loaded)
    for text in (err, err2):
        assert "2 images: all in the latent cache, the VAE is not loaded" in said(text)
    first, again = tensors(tmp_path / "a.safetensors"), tensors(tmp_path / "b.safetensors")
    assert all(np.array_equal(first[k], again[k]) for k in first)
    entries = sorted((default_folder() / LATENTS_SUBFOLDER).glob("*.safetensors"))
    assert len(entries) == 2
    blob = bytearray(entries[0].read_bytes())
    blob[-3] ^= 0xFF  # a damaged entry: its digest no longer matches
    entries[0].write_bytes(bytes(blob))
    loaded.clear()
    rc, _, err = run_cli(capsys, "train", *base_args(base, data, tmp_path / "c.safetensors"), "--steps", "1")
    assert rc == 0, err
    assert "encoding 2 images with the VAE (1 of 2 latents; 1 from the latent cache) ..." in said(err)
    assert loaded.count("vae") == 1
    assert any(
        line.startswith("latents: 1 latent encoded, 1 from the latent cache, VAE released") for line in said(err)
    )


def test_the_baseline_samples_are_not_redrawn_on_resume(capsys, base, distilled, tmp_path):
    """A resume keeps the baseline images of the run's start (same sample model, prompts and settings): the
    files are not rewritten and the log says they are kept; samples of later steps are drawn as before."""
    data = make_images(tmp_path / "data")
    out = tmp_path / "a.safetensors"
    sampling = ["--sample-every", "1", "--sample-prompt", "a fox", "--sample-model", str(distilled)]
    sampling += ["--sample-steps", "1"]
    rc, _, err = run_cli(capsys, "train", *base_args(base, data, out), "--steps", "1", "--save-every", "1", *sampling)
    assert rc == 0, err
    baseline = tmp_path / "a.train" / "samples" / "step-000000-0.png"
    stamp = baseline.stat().st_mtime_ns
    bytes_before = baseline.read_bytes()
    out.unlink()
    args = [*base_args(base, data, out), "--steps", "2", "--save-every", "1", *sampling, "--resume"]
    rc, _, err = run_cli(capsys, "train", *args)
    assert rc == 0, err
    assert any(
        line.startswith("baseline samples (no LoRA) kept from the run's start, not redrawn: ") for line in said(err)
    )
    assert baseline.stat().st_mtime_ns == stamp and baseline.read_bytes() == bytes_before
    assert (tmp_path / "a.train" / "samples" / "step-000002-0.png").is_file()
