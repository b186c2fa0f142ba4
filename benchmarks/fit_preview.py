"""Fit the step-preview map (latent channels -> RGB) for a FLUX.2 VAE by least squares.

    python benchmarks/fit_preview.py --vae PATH/TO/SNAPSHOT/vae [--images 16] [--size 256]

The judge is diffusers' own `AutoencoderKLFlux2`: smooth synthetic pictures (random colour fields,
gradients and blobs) go through its encoder (posterior mean), the latents are normalised with its
BatchNorm statistics the way `Flux2KleinPipeline` does (patchify -> (z - mean) / std -> unpatchify,
the space our tokens live in), and the decoder's output, averaged over each latent pixel's 8x8
block, is the target. Random prior latents (what early steps look like) are mixed in with
`--noise`. Prints the (C, 3) factors and the bias as Python, plus the fit's R^2 on held-out
pictures, so a fitted map can be pasted into flux_klein_mlx/record/output.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when a test loads this file
import common  # noqa: E402,F401  (this checkout on sys.path, OpenBLAS preloaded)


def pictures(n: int, size: int, seed: int) -> np.ndarray:
    """(n, size, size, 3) smooth random pictures in [-1, 1]: colour fields, gradients, blobs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    yy, xx = np.mgrid[0:size, 0:size] / size
    for _ in range(n):
        cells = int(rng.integers(2, 9))
        field = (rng.random((cells, cells, 3)) * 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(field).resize((size, size), Image.Resampling.BICUBIC), np.float32) / 127.5 - 1
        a = rng.normal(size=3)
        img = img + 0.5 * np.tanh(a[0] * xx + a[1] * yy + a[2])[..., None] * rng.normal(size=3)
        cx, cy, r = rng.random(3)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (0.02 + 0.1 * r))
        img = img * (1 - blob[..., None]) + blob[..., None] * rng.uniform(-1, 1, 3)
        out.append(np.clip(img, -1, 1))
    return np.stack(out).astype(np.float32)


def latents_and_targets(vae, images: np.ndarray, noise: int, seed: int):
    """Normalised unpatchified latents (N, h, w, C) and decoder outputs (N, 8h, 8w, 3)."""
    import torch
    from diffusers import Flux2KleinPipeline

    x = torch.from_numpy(images).permute(0, 3, 1, 2)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean  # (N, C, h, w) raw
        if noise:
            # Prior samples in the normalised space, mapped back to raw latents for decoding.
            g = torch.Generator().manual_seed(seed)
            C4 = vae.bn.running_mean.numel()
            h, w = z.shape[2] // 2, z.shape[3] // 2
            t = torch.randn((noise, C4, h, w), generator=g)
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
            raw = Flux2KleinPipeline._unpatchify_latents(t * std + vae.bn.running_mean.view(1, -1, 1, 1))
            z = torch.cat([z, raw], 0)
        decoded = vae.decode(z).sample  # (N, 3, 8h, 8w)
        packed = Flux2KleinPipeline._patchify_latents(z)  # (N, 4C, h/2, w/2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        normed = Flux2KleinPipeline._unpatchify_latents((packed - mean) / std)  # (N, C, h, w)
    return normed.permute(0, 2, 3, 1).numpy(), decoded.permute(0, 2, 3, 1).numpy()


def r_squared(preview, latents: np.ndarray, images: np.ndarray) -> float:
    N, h, w, C = latents.shape
    f = images.shape[1] // h
    target = images.reshape(N, h, f, w, f, 3).mean(axis=(2, 4))
    pred = latents @ preview.factors + preview.bias
    return float(1 - ((pred - target) ** 2).sum() / ((target - target.mean(axis=(0, 1, 2))) ** 2).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vae", required=True, help="diffusers VAE folder (e.g. SNAPSHOT/vae)")
    ap.add_argument("--images", type=int, default=16, help="synthetic pictures to fit on")
    ap.add_argument("--noise", type=int, default=4, help="extra random prior latents to fit on")
    ap.add_argument("--size", type=int, default=128, help="picture side in px (multiple of 16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from diffusers import AutoencoderKLFlux2

    from flux_klein_mlx.record.output import fit_preview

    torch.manual_seed(args.seed)
    vae = AutoencoderKLFlux2.from_pretrained(args.vae, torch_dtype=torch.float32).eval()
    lat, img = latents_and_targets(vae, pictures(args.images, args.size, args.seed), args.noise, args.seed)
    preview = fit_preview(lat, img, f"fitted by benchmarks/fit_preview.py on {args.vae}")
    held_lat, held_img = latents_and_targets(vae, pictures(4, args.size, args.seed + 1), 0, args.seed + 1)
    print(f"# {preview.source}: {args.images} pictures + {args.noise} prior latents at {args.size}px")
    print(
        f"# R^2 on the fit set {r_squared(preview, lat, img):.4f}, "
        f"on 4 held-out pictures {r_squared(preview, held_lat, held_img):.4f}"
    )
    print("RGB_FACTORS = (")
    for row in preview.factors:
        print("    (" + ", ".join(f"{v:.4f}" for v in row) + "),")
    print(")")
    print("RGB_BIAS = (" + ", ".join(f"{v:.4f}" for v in preview.bias) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
