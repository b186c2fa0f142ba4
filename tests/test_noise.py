"""The prior is torch's CPU `randn` for the same seed (torch is the judge), and MLX's for noise="mlx"."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.noise import initial_noise, seed_for_image, torch_randn

SEEDS = [0, 1, 42, 2**31 - 1, 2**32 + 5]
# (1, 128, H/16, W/16) latents of 64x64 ... 1024x1024 px images and non-square ones.
LATENT_SHAPES = [(1, 128, 4, 4), (1, 128, 16, 16), (1, 128, 32, 32), (1, 128, 64, 64), (1, 128, 48, 80),
                 (1, 128, 5, 7), (1, 128, 64, 40)]
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
