"""Cheap step previews: latent tokens -> a small RGB image with one fixed linear map.

Decoding every step through the VAE would cost as much as a denoising step; instead each latent
pixel's channels are mapped to RGB by a (C, 3) matrix plus a bias, fitted once by least squares
against the VAE decoder (the approach of ComfyUI's `latent_rgb_factors` and stable-diffusion.cpp's
preview). The preview is at latent resolution: 1/8 of the image's side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# FLUX.2 VAE (32 latent channels), published by ComfyUI: comfy/latent_formats.py, class Flux2,
# `latent_rgb_factors` / `latent_rgb_factors_bias` (github.com/Comfy-Org/ComfyUI). ComfyUI applies
# them to its sampling latent after reshaping the 128 packed channels to (32, 2, 2) per token,
# channel index c*4 + py*2 + px, which is diffusers' (and our) patchify order. Its Flux2 format has
# identity process_in/out, so that latent is the transformer's own (BatchNorm-normalised) space,
# the space of our tokens. The outputs are in [-1, 1] like the decoder's. Not re-fitted here: the
# real VAE weights are not available to this project's tests (benchmarks/fit_preview.py fits a
# map for any diffusers VAE folder).
FLUX2_RGB_FACTORS = (
    (0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
    (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109),
    (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
    (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
    (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065),
    (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
    (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
    (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614),
)
FLUX2_RGB_BIAS = (-0.0329, -0.0718, -0.0851)


@dataclass(frozen=True)
class LatentPreview:
    """A linear latent -> RGB map: rgb = latent @ factors + bias, rgb nominally in [-1, 1]."""

    factors: np.ndarray  # (C, 3) for C unpatchified latent channels
    bias: np.ndarray  # (3,)
    source: str = ""  # where the numbers come from, for reports

    @property
    def channels(self) -> int:
        return self.factors.shape[0]

    def render(self, tokens, h: int, w: int) -> np.ndarray:
        """Tokens (1, h*w, 4C) or (h*w, 4C) on an h x w grid -> uint8 RGB (2h, 2w, 3)."""
        if not isinstance(tokens, np.ndarray) and hasattr(tokens, "astype"):
            import mlx.core as mx

            tokens = tokens.astype(mx.float32)  # numpy cannot read bfloat16 MLX arrays (the default dtype)
        lat = unpatchify_tokens(np.asarray(tokens, dtype=np.float32), h, w)  # (2h, 2w, C)
        if lat.shape[-1] != self.channels:
            raise ValueError(f"this preview map takes {self.channels} latent channels, not {lat.shape[-1]}")
        rgb = lat @ self.factors + self.bias  # (2h, 2w, 3) in about [-1, 1]
        return np.clip(np.round((rgb + 1.0) * 127.5), 0, 255).astype(np.uint8)


def flux2_preview() -> LatentPreview:
    """The published map for the real FLUX.2 VAE (32 latent channels)."""
    return LatentPreview(np.array(FLUX2_RGB_FACTORS, np.float32), np.array(FLUX2_RGB_BIAS, np.float32),
                         "ComfyUI comfy/latent_formats.py Flux2")


def unpatchify_tokens(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    """Tokens (1, h*w, 4C) -> (2h, 2w, C); packed channel index c*4 + py*2 + px (vae.patchify)."""
    t = tokens.reshape(h, w, -1, 2, 2)  # (y, x, c, py, px)
    C = t.shape[2]
    return t.transpose(0, 3, 1, 4, 2).reshape(2 * h, 2 * w, C)  # (y, py, x, px, c)


def fit_preview(latents: np.ndarray, images: np.ndarray, source: str = "fitted") -> LatentPreview:
    """Least-squares fit of a preview map.

    Args:
        latents: (N, h, w, C) unpatchified latents in the normalised token space.
        images: (N, 8h, 8w, 3) what the VAE decoder makes of them, in [-1, 1].

    Each latent pixel is matched with the mean colour of the 8x8 pixels it decodes to.
    """
    latents = np.asarray(latents, np.float64)
    images = np.asarray(images, np.float64)
    N, h, w, C = latents.shape
    f = images.shape[1] // h
    target = images.reshape(N, h, f, w, f, 3).mean(axis=(2, 4)).reshape(-1, 3)  # (N*h*w, 3)
    design = np.concatenate([latents.reshape(-1, C), np.ones((N * h * w, 1))], axis=1)  # (N*h*w, C+1)
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)  # (C+1, 3)
    return LatentPreview(solution[:C].astype(np.float32), solution[C].astype(np.float32), source)


def fit_to_decoder(vae, *, grid: int = 8, samples: int = 4, seed: int = 0) -> LatentPreview:
    """Fit a map for an MLX `AutoEncoder` (ours) on prior-distributed random tokens.

    Used for VAEs without a published map (the tiny test models): a few decodes of
    grid x grid-token latents, which is cheap for small VAEs.
    """
    import mlx.core as mx

    from .vae import unpatchify

    C4 = vae.config.token_channels
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((samples, grid * grid, C4)).astype(np.float32)  # (N, L, 4C)
    x = mx.array(tokens)
    images = vae.decode_tokens(x, grid, grid).astype(mx.float32)  # (N, 16g, 16g, 3)
    feats = unpatchify(x.reshape(samples, grid, grid, C4))  # (N, 2g, 2g, C)
    mx.eval(images, feats)
    return fit_preview(np.array(feats), np.array(images), "fitted at load to this model's VAE decoder")


def preview_for(vae) -> LatentPreview:
    """The preview map for a loaded MLX VAE: the published one for 32 channels, else fitted."""
    if vae.config.latent_channels == len(FLUX2_RGB_FACTORS):
        return flux2_preview()
    return fit_to_decoder(vae)
