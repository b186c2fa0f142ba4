"""Rectified-flow sampling for FLUX.2 [klein]: BFL's empirical-mu schedule, Euler steps, the prior.

The schedule is the one both references use (BFL `get_schedule`; diffusers' klein pipeline +
FlowMatchEulerDiscreteScheduler): a linear sigma grid 1 -> 0 pushed towards high noise by an
exponential time shift whose strength mu depends on the target token count and the step count.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .config import sampling_defaults


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL's fitted shift for `image_seq_len` target tokens (references excluded) and `num_steps`."""
    m200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return m200
    # Linear in the step count through the fits at 10 and 200 steps.
    m10 = 8.73809524e-05 * image_seq_len + 1.89833333
    return m200 + (m200 - m10) / 190.0 * (num_steps - 200)


def time_shift(mu: float, sigma: float) -> float:
    """Exponential time shift: sigma' = e^mu / (e^mu + (1/sigma - 1)); sigma = 0 stays 0."""
    if sigma <= 0.0:
        return 0.0
    return math.exp(mu) / (math.exp(mu) + (1.0 / sigma - 1.0))


class FluxSampler:
    """Schedule, Euler update and prior noise for the klein denoising loop."""

    def __init__(self, num_steps: int = 4):
        self.num_steps = num_steps  # used when `timesteps` is not told a step count

    @classmethod
    def klein(cls) -> "FluxSampler":
        """Distilled klein: 4 steps (the variant table's default)."""
        return cls(sampling_defaults(True)[0])

    @classmethod
    def base(cls) -> "FluxSampler":
        """klein Base: 50 steps (used with CFG 4.0)."""
        return cls(sampling_defaults(False)[0])

    def timesteps(self, image_seq_len: int, num_steps: int | None = None) -> list[float]:
        """The n + 1 sigmas from 1.0 (pure noise) to 0.0 (clean) for `image_seq_len` target tokens.

        Values are rounded to float32, as the reference scheduler stores them, so that the model
        sees the same timesteps.
        """
        n = num_steps or self.num_steps
        if n < 1:
            raise ValueError("num_steps must be at least 1")
        mu = empirical_mu(image_seq_len, n)
        grid = [1.0 - i / n for i in range(n)]  # 1, ..., 1/n; the final 0 is appended below
        sig = [time_shift(mu, s) for s in grid] + [0.0]
        return [float(mx.array(s, dtype=mx.float32).item()) for s in sig]

    @staticmethod
    def step(x: mx.array, v: mx.array, t: float, t_prev: float) -> mx.array:
        """One Euler step x <- x + (t_prev - t) * v, computed in float32, returned in x's dtype."""
        out = x.astype(mx.float32) + (t_prev - t) * v.astype(mx.float32)
        return out.astype(x.dtype)

    @staticmethod
    def sample_prior(
        shape: tuple[int, ...], seed: int | None = None, dtype=mx.float32, noise: str = "torch"
    ) -> mx.array:
        """Standard normal noise of `shape` for `seed` (random when None), drawn as `noise.initial_noise`
        does: torch's CPU randn ("torch", the default) or mflux's MLX draw ("mlx")."""
        import random

        from .noise import initial_noise

        seed = random.randrange(2**31) if seed is None else seed
        return initial_noise(shape, seed, noise).astype(dtype)
