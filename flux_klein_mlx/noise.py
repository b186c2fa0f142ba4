"""The initial noise of a generation, reproducible across tools from the seed alone.

Two kinds, chosen with `noise=`:

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

import numpy as np

from .errors import FluxKleinError

NOISE_KINDS = ("torch", "mlx")


def check_noise_kind(noise: str) -> str:
    if noise not in NOISE_KINDS:
        raise FluxKleinError(f"noise must be one of {', '.join(NOISE_KINDS)}, not {noise!r}")
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
    u = u.astype(np.float32)
    one_minus = (np.float32(1.0) - u[:, :8]).astype(np.float32)  # [0, 1) -> (0, 1] for the log
    radius = np.sqrt(np.float32(-2.0) * np.log(one_minus.astype(np.float64))).astype(np.float32)
    # theta = 2.0f * pi<double> * u: the product is double, stored as float.
    theta = (2.0 * np.pi * u[:, 8:].astype(np.float64)).astype(np.float32)
    out = np.empty_like(u)
    out[:, :8] = radius * np.cos(theta.astype(np.float64)).astype(np.float32)
    out[:, 8:] = radius * np.sin(theta.astype(np.float64)).astype(np.float32)
    return out


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
    if n == 0:
        return np.zeros(shape, np.float32)
    if n < 16:
        return _torch_normal_small(seed, n).reshape(shape)
    tail = n % 16
    words = _mt_words(seed, n + (16 if tail else 0))
    # 24-bit uniforms in [0, 1), exact in float32.
    u = ((words & np.uint64(0xFFFFFF)).astype(np.float64) / 2.0**24).astype(np.float32)
    full = n - tail
    out = np.empty(n, np.float32)
    out[:full] = _box_muller_blocks(u[:full].reshape(-1, 16)).reshape(-1)
    if tail:
        # The last 16 elements are recomputed from 16 new draws (they overlap the last full block).
        out[n - 16 :] = _box_muller_blocks(u[n:].reshape(1, 16)).reshape(-1)
    return out.reshape(shape)


def initial_noise(shape: tuple[int, ...], seed: int, noise: str = "torch"):
    """The prior of a generation as an MLX float32 array of `shape` (diffusers' (1, C, h, w) layout)."""
    import mlx.core as mx

    check_noise_kind(noise)
    if noise == "torch":
        return mx.array(torch_randn(shape, seed))
    # mflux: MLX's RNG in float32, stored as bf16 (the precision its latents start from).
    x = mx.random.normal(shape, dtype=mx.float32, key=mx.random.key(int(seed) % 2**64))
    return x.astype(mx.bfloat16).astype(mx.float32)
