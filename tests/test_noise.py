"""The prior is torch's CPU `randn` for the same seed (torch is the judge), and MLX's for noise="mlx"."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from refs import diffusers_pipeline, picture

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.sampling import initial_noise, seed_for_image, torch_randn

SEEDS = [0, 1, 42, 2**31 - 1, 2**32 + 5]
# (1, 128, H/16, W/16) latents of 64x64 ... 1024x1024 px images and non-square ones.
LATENT_SHAPES = [
    (1, 128, 4, 4),
    (1, 128, 16, 16),
    (1, 128, 32, 32),
    (1, 128, 64, 64),
    (1, 128, 48, 80),
    (1, 128, 5, 7),
    (1, 128, 64, 40),
]
# Fewer than 16 elements (torch's double-precision path) and sizes that are not multiples of 16
# (the last 16 elements are redrawn).
ODD_SHAPES = [(1,), (2,), (3,), (7,), (15,), (1, 1, 3, 5), (16,), (17,), (31,), (33,), (1, 8, 3, 3)]


def reference(shape, seed):
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed)).numpy()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", LATENT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_latent_prior_equals_torch_cpu_randn(seed, shape):
    ours = torch_randn(shape, seed)
    theirs = reference(shape, seed)
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 1e-5


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_small_and_ragged_sizes_equal_torch(seed, shape):
    assert np.abs(torch_randn(shape, seed) - reference(shape, seed)).max() <= 1e-5


def test_seed_is_taken_modulo_2_32_and_seeds_differ():
    a = torch_randn((1, 128, 4, 4), 5)
    assert np.array_equal(a, torch_randn((1, 128, 4, 4), 2**32 + 5))
    assert not np.allclose(a, torch_randn((1, 128, 4, 4), 6))
    for seed in (-1, -5, 2**63 - 1):  # torch wraps these to 64 bits and keeps the low 32
        assert np.abs(torch_randn((1, 128, 4, 4), seed) - reference((1, 128, 4, 4), seed)).max() <= 1e-5


def test_bfloat16_pipelines_draw_the_same_noise_rounded():
    """A diffusers pipeline in bf16 draws `randn(dtype=bf16)`: torch's float32 noise rounded to bf16,
    which is what our bf16 pipeline feeds the model."""
    shape = (1, 128, 4, 6)
    theirs = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(7), dtype=torch.bfloat16)
    ours = initial_noise(shape, 7, "torch").astype(mx.bfloat16)
    assert np.array_equal(np.array(ours.astype(mx.float32)), theirs.float().numpy())


def test_mlx_noise_is_mfluxs_draw():
    shape = (1, 128, 4, 4)
    mflux = mx.random.normal(shape, key=mx.random.key(3)).astype(mx.bfloat16)
    assert np.array_equal(np.array(initial_noise(shape, 3, "mlx")), np.array(mflux.astype(mx.float32)))
    assert not np.allclose(np.array(initial_noise(shape, 3, "mlx")), torch_randn(shape, 3), atol=0.1)


def test_several_images_use_consecutive_seeds_like_diffusers_generator_lists():
    shape = (1, 128, 4, 4)
    gens = [torch.Generator("cpu").manual_seed(10 + k) for k in range(3)]
    # diffusers' randn_tensor with a list of generators: one (1, ...) draw per generator.
    theirs = [torch.randn(shape, generator=g).numpy() for g in gens]
    for k in range(3):
        assert np.abs(torch_randn(shape, seed_for_image(10, k)) - theirs[k]).max() <= 1e-5


def test_unknown_noise_kind():
    with pytest.raises(FluxKleinError, match="noise must be one of torch, mlx, not 'numpy'"):
        initial_noise((1, 128, 4, 4), 0, "numpy")


# ---- end to end by seed alone: no injected latents on either side -----------------------------
# Two steps: a seed decides only the starting noise, which two steps check as well as four.


def by_seed(path, seed, **kwargs):
    """diffusers' Flux2KleinPipeline with a CPU generator seeded `seed`, and ours with `seed` alone."""
    import flux_klein_mlx

    ref = diffusers_pipeline(path)
    theirs_kw = dict(
        prompt=kwargs["prompt"],
        num_inference_steps=kwargs["steps"],
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    for ours_name, their_name in (
        ("width", "width"),
        ("height", "height"),
        ("images", "image"),
        ("guidance", "guidance_scale"),
    ):
        if kwargs.get(ours_name) is not None:
            theirs_kw[their_name] = kwargs[ours_name]
    with torch.no_grad():
        theirs = ref(**theirs_kw).images[0]
    ours = flux_klein_mlx.load(path, dtype="float32").generate(seed=seed, output_type="np", **kwargs)
    return ours, theirs


@pytest.mark.parametrize("seed", [0, 42, 2**32 + 5])
def test_text_to_image_by_seed_matches_diffusers(distilled, seed):
    ours, theirs = by_seed(distilled, seed, prompt="a red fox in fresh snow", width=96, height=64, steps=2)
    err = np.abs(ours - theirs).max()
    print(f"text-to-image seed {seed}: max abs {err:.2e}")
    assert ours.shape == theirs.shape == (64, 96, 3) and err <= 1e-3 and theirs.std() > 0.01


def test_one_reference_by_seed_matches_diffusers(distilled):
    ours, theirs = by_seed(distilled, 7, prompt="make it winter", images=[picture(100, 72, 1)], steps=2)
    err = np.abs(ours - theirs).max()
    print(f"one reference: max abs {err:.2e}")
    assert ours.shape == theirs.shape == (64, 96, 3) and err <= 1e-3


def test_base_with_cfg_by_seed_matches_diffusers(base):
    ours, theirs = by_seed(base, 3, prompt="a lighthouse at dusk", width=64, height=80, steps=2, guidance=4.0)
    err = np.abs(ours - theirs).max()
    print(f"Base + CFG: max abs {err:.2e}")
    assert err <= 1e-3


def test_mlx_noise_gives_a_different_image(distilled):
    import flux_klein_mlx

    pipe = flux_klein_mlx.load(distilled, dtype="float32")
    a = pipe.generate("x", width=64, height=64, seed=1, output_type="np")
    b = pipe.generate("x", width=64, height=64, seed=1, noise="mlx", output_type="np")
    assert pipe.last_metadata["noise"] == "mlx" and not np.allclose(a, b, atol=1e-3)
