"""The klein schedule against diffusers' scheduler + pipeline mu, and the Euler step."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

from flux_klein_mlx.sampling import empirical_mu, euler_step, initial_noise, schedule


def reference_sigmas(seq_len: int, steps: int) -> np.ndarray:
    # Exactly what Flux2KleinPipeline does (spec 7.1 / 11 scheduler config).
    sched = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    sigmas = np.linspace(1.0, 1 / steps, steps)
    sched.set_timesteps(sigmas=sigmas, mu=compute_empirical_mu(seq_len, steps))
    return sched.sigmas.numpy()


@pytest.mark.parametrize("seq_len", [16, 1024, 2304, 4080, 4096, 4300, 4301, 9216, 16384])
@pytest.mark.parametrize("steps", [1, 4, 28, 50])
def test_schedule_matches_diffusers(seq_len, steps):
    assert abs(empirical_mu(seq_len, steps) - compute_empirical_mu(seq_len, steps)) < 1e-9
    ours = np.array(schedule(seq_len, steps))
    theirs = reference_sigmas(seq_len, steps)
    assert ours.shape == theirs.shape == (steps + 1,)
    assert np.abs(ours - theirs).max() <= 1e-6
    assert ours[0] == 1.0 and ours[-1] == 0.0


def test_schedule_spec_values():
    # reference-spec 7.1, 1024^2, 4 steps
    np.testing.assert_allclose(schedule(4096, 4), [1, 0.967384, 0.908144, 0.767200, 0], atol=1e-6)


def test_euler_step_matches_diffusers():
    sched = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, use_dynamic_shifting=True, time_shift_type="exponential"
    )
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=compute_empirical_mu(64, 4))
    sched.set_begin_index(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 128)).astype(np.float32)
    sigmas = schedule(64, 4)
    xt, xm = torch.from_numpy(x), mx.array(x)
    for i, t in enumerate(sched.timesteps):
        v = rng.standard_normal(x.shape).astype(np.float32)
        xt = sched.step(torch.from_numpy(v), t, xt, return_dict=False)[0]
        xm = euler_step(xm, mx.array(v), sigmas[i], sigmas[i + 1])
    assert np.abs(np.array(xm) - xt.numpy()).max() < 1e-5


def test_prior_is_seeded():
    a = initial_noise((1, 128, 4, 6), 7)
    b = initial_noise((1, 128, 4, 6), 7)
    c = initial_noise((1, 128, 4, 6), 8)
    assert np.array_equal(np.array(a), np.array(b))
    assert not np.array_equal(np.array(a), np.array(c))
    assert abs(float(a.std()) - 1.0) < 0.2
