"""The flow-matching math of a klein run, as functions: schedule, prior, Euler step, CFG, img2img.

The schedule is the one both references use (BFL `get_schedule`; diffusers' klein pipeline +
FlowMatchEulerDiscreteScheduler): a linear sigma grid 1 -> 0 pushed towards high noise by an
exponential time shift whose strength mu depends on the target token count and the step count.
The process is x_t = (1 - sigma) x0 + sigma * noise; the transformer predicts v = noise - x0.
FLUX 3 has its own schedule (`shifted_schedule`: a constant shift) and time hand-off (`flow_timestep`).

The prior comes in two kinds, chosen with `noise=`:

- "torch" (default): bit-compatible with `torch.randn(shape, generator=torch.Generator("cpu")
  .manual_seed(seed))` in float32 -- the noise `Flux2KleinPipeline` draws with a CPU generator --
  computed with numpy (torch is not needed at run time). torch's CPU sampler (ATen
  `normal_kernel` / `normal_fill` / `normal_fill_16`) works like this:
    * MT19937 seeded with `seed mod 2**32` (numpy's legacy `RandomState(seed)` is the same engine
      and the same `init_genrand` seeding);
    * tensors of 16 or more elements: one 32-bit draw per element, kept as a 24-bit uniform
      u = (r & 0xFFFFFF) / 2**24; then, in blocks of 16, Box-Muller pairs element j with j + 8:
      radius = sqrt(-2 log(1 - u_j)), theta = 2 pi u_{j+8}, out_j = radius cos(theta),
      out_{j+8} = radius sin(theta). When the size is not a multiple of 16, the last 16 elements
      are redrawn with 16 fresh uniforms and transformed as one block (overwriting the overlap);
    * fewer than 16 elements: element by element in double precision, each pair of elements from
      two 53-bit uniforms (two 32-bit draws each, first one high): u1, u2; r = sqrt(-2 log1p(-u2)),
      theta = 2 pi u1; the first element is r cos(theta), the next one the cached r sin(theta).
- "mlx": `mx.random.normal(shape, key=mx.random.key(seed))` cast to bfloat16, which is what
  mflux draws, so mflux's seeds reproduce.

Several images: diffusers given generators seeded N, N+1, ... draws image k's noise from seed
N + k, one (1, C, h, w) tensor per generator; `seed_for_image` says which seed image k uses.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .checks import check_choice
from .errors import FluxKleinError

NOISE_KINDS = ("torch", "mlx")


# --- the schedule -------------------------------------------------------------------------------------


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL's fitted shift for `image_seq_len` target tokens (references excluded) and `num_steps`."""
    m200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return m200
    # Linear in the step count through the fits at 10 and 200 steps.
    m10 = 8.73809524e-05 * image_seq_len + 1.89833333
    return m200 + (m200 - m10) / 190.0 * (num_steps - 200)


def schedule(image_seq_len: int, num_steps: int) -> list[float]:
    """The n + 1 sigmas from 1.0 (pure noise) to 0.0 (clean) for `image_seq_len` target tokens.

    Values are rounded to float32, as the reference scheduler stores them, so that the model sees
    the same timesteps.
    """
    e_mu = math.exp(empirical_mu(image_seq_len, num_steps))
    grid = [1.0 - i / num_steps for i in range(num_steps)]  # 1, ..., 1/n; the final 0 is appended
    # The exponential time shift sigma' = e^mu / (e^mu + (1/sigma - 1)).
    return [float(np.float32(e_mu / (e_mu + (1.0 / s - 1.0)))) for s in grid] + [0.0]


def shifted_schedule(steps: int, shift: float) -> list[float]:
    """FLUX 3's n + 1 sigmas: the grid 1, ..., 1/n under the constant shift sigma' = a s / (1 + (a - 1) s),
    0 appended (issue 35; a = 6.93 for FLUX 3 Image Klein, whatever the image size).

    Computed in float32 as diffusers' FlowMatchEulerDiscreteScheduler(shift=a) computes the sigmas it is
    given (a and a - 1 rounded to float32 first), so the model sees the same timesteps."""
    grid = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)  # float64 grid, stored as float32
    a = np.float32(shift)
    shifted = a * grid / (np.float32(1.0) + np.float32(shift - 1.0) * grid)
    return [float(s) for s in shifted] + [0.0]


def flow_timestep(sigma: float, batch: int) -> mx.array:
    """The (B,) float32 time FLUX 3's transformer is handed for `sigma`: the scheduler's timestep
    (sigma * 1000 in float32) / 1000 in float32. The model casts it to its dtype and multiplies by 1000
    there (a parity trap in bfloat16); FLUX.2's `model_timestep` rounds in another order."""
    t = np.float32(sigma) * np.float32(1000.0)
    return mx.full((batch,), float(t / np.float32(1000.0)), dtype=mx.float32)


def start_step(steps: int, strength: float) -> int:
    """Index of the first schedule step that runs for img2img (diffusers' `get_timesteps`, truncating)."""
    t_start = int(steps - steps * strength)  # strength in (0, 1]: init_timestep = steps * strength
    if t_start == steps:
        raise FluxKleinError(
            f"strength {strength} is so small that none of the {steps} steps runs; raise {{strength}} or {{steps}}"
        )
    return t_start


def reference_time(k: int) -> int:
    """The RoPE time coordinate of reference image k (0-based): 10 (k + 1), where BFL and diffusers put
    it (the target image is at 0), in generation and in training alike."""
    return 10 * (k + 1)


def model_timestep(sigma: float, batch: int, dtype) -> mx.array:
    """The (B,) timestep the transformer sees: sigma*1000 in the activation dtype, then /1000
    (diffusers' path; bf16-coarse, spec 2.3)."""
    return mx.full((batch,), sigma * 1000.0, dtype=mx.float32).astype(dtype) / 1000.0


# --- one step -----------------------------------------------------------------------------------------


def euler_step(x: mx.array, v: mx.array, sigma: float, sigma_next: float) -> mx.array:
    """x <- x + (sigma_next - sigma) * v, computed in float32, returned in x's dtype."""
    return (x.astype(mx.float32) + (sigma_next - sigma) * v.astype(mx.float32)).astype(x.dtype)


def cfg(v: mx.array, scale: float) -> mx.array:
    """Classifier-free guidance on a [cond ; uncond] batch (2, L, C): uncond + s * (cond - uncond)."""
    return v[1:2] + scale * (v[0:1] - v[1:2])


def x0_estimate(x: mx.array, v: mx.array, sigma: float) -> mx.array:
    """The clean latent the step predicts: x_t = (1 - s) x0 + s noise and v = noise - x0 give x0 = x - s v."""
    return x - sigma * v


def scale_noise(x0: mx.array, noise: mx.array, sigma: float | mx.array) -> mx.array:
    """The forward process x = sigma * noise + (1 - sigma) * x0, in float32 (the scheduler's `scale_noise`).

    `sigma` is one number (a run's step), or float32 sigmas that broadcast against x0, e.g. (B, 1, 1)
    for a training batch (the objective's x_t)."""
    return sigma * noise.astype(mx.float32) + (1.0 - sigma) * x0.astype(mx.float32)


def blend(x: mx.array, x0: mx.array, noise: mx.array, *, mask: mx.array, sigma_next: float | None) -> mx.array:
    """Inpainting: keep the unmasked region as x0 noised to `sigma_next` (None after the last step: clean
    x0) where mask = 0, the denoised x where mask = 1; float32 math, x's dtype out. Shapes (1, L, C),
    mask (1, L, 1)."""
    known = x0.astype(mx.float32) if sigma_next is None else scale_noise(x0, noise, sigma_next)
    return ((1.0 - mask) * known + mask * x.astype(mx.float32)).astype(x.dtype)


def pack_latents(latents: mx.array) -> mx.array:
    """Noise in diffusers' layout (B, C, h, w) -> tokens (B, h*w, C), row-major (C = 128 for klein)."""
    B, C, h, w = latents.shape
    return latents.reshape(B, C, h * w).transpose(0, 2, 1)


# --- the prior ----------------------------------------------------------------------------------------


def check_noise_kind(noise: str) -> str:
    check_choice("noise", noise, NOISE_KINDS)
    return noise


def seed_for_image(seed: int, index: int) -> int:
    """The seed of image `index` of a batch started at `seed` (diffusers' list of generators N, N+1, ...)."""
    return seed + index


def _mt_words(seed: int, count: int) -> np.ndarray:
    """The next `count` raw 32-bit outputs of MT19937 seeded like torch's CPU generator (uint64)."""
    # torch keeps the low 32 bits of the seed; negative seeds wrap the same way (two's complement).
    rs = np.random.RandomState(int(seed) % 2**32)
    # Full-range uint32 draws are the engine's raw outputs (no rejection, no masking).
    return rs.randint(0, 2**32, size=count, dtype=np.uint32).astype(np.uint64)


def _box_muller_blocks(u: np.ndarray) -> np.ndarray:
    """torch's `normal_fill_16` on (n, 16) float32 uniforms -> (n, 16) float32 normals."""
    one_minus = np.float32(1.0) - u[:, :8]  # float32 [0, 1) -> (0, 1] for the log
    radius = np.sqrt(np.float32(-2.0) * np.log(one_minus.astype(np.float64))).astype(np.float32)
    # theta = 2.0f * pi<double> * u: the product is double, stored as float.
    theta = (2.0 * np.pi * u[:, 8:].astype(np.float64)).astype(np.float32)
    cos, sin = np.cos(theta.astype(np.float64)).astype(np.float32), np.sin(theta.astype(np.float64)).astype(np.float32)
    return np.concatenate([radius * cos, radius * sin], axis=1)  # elements j and j + 8 of each block


def _torch_normal_small(seed: int, n: int) -> np.ndarray:
    """torch's per-element double-precision path for tensors of fewer than 16 elements."""
    pairs = (n + 1) // 2
    w = _mt_words(seed, 4 * pairs).reshape(pairs, 2, 2)  # per pair: u1 = (w0, w1), u2 = (w2, w3)
    r64 = (w[..., 0] << np.uint64(32)) | w[..., 1]  # random64(): first draw in the high half
    u = (r64 & np.uint64(2**53 - 1)).astype(np.float64) / 2.0**53  # (pairs, 2)
    r = np.sqrt(-2.0 * np.log1p(-u[:, 1]))
    theta = 2.0 * np.pi * u[:, 0]
    out = np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1).reshape(-1)
    return out[:n].astype(np.float32)


def torch_randn(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """`torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))` (float32) in numpy."""
    n = int(np.prod(shape, dtype=np.int64))
    if n < 16:
        return _torch_normal_small(seed, n).reshape(shape)
    tail = n % 16
    words = _mt_words(seed, n + (16 if tail else 0))
    # 24-bit uniforms in [0, 1), exact in float32.
    u = ((words & np.uint64(0xFFFFFF)).astype(np.float64) / 2.0**24).astype(np.float32)
    out = _box_muller_blocks(u[: n - tail].reshape(-1, 16)).reshape(-1)
    if tail:
        # The last 16 elements are recomputed from 16 new draws (they overlap the last full block).
        out = np.concatenate([out[: n - 16], _box_muller_blocks(u[n:].reshape(1, 16)).reshape(-1)])
    return out.reshape(shape)


def initial_noise(shape: tuple[int, ...], seed: int, noise: str = "torch") -> mx.array:
    """The prior of a generation as an MLX float32 array of `shape` (diffusers' (1, C, h, w) layout)."""
    if check_noise_kind(noise) == "torch":
        return mx.array(torch_randn(shape, seed))
    # mflux: MLX's RNG in float32, stored as bf16 (the precision its latents start from).
    x = mx.random.normal(shape, dtype=mx.float32, key=mx.random.key(int(seed) % 2**64))
    return x.astype(mx.bfloat16).astype(mx.float32)
