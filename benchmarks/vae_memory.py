"""Peak memory and time of the full-size FLUX.2 VAE decoder, untiled vs tiled.

Random weights (the numbers do not depend on them), one image, latents of the real shape.
Peak memory is `mx.get_peak_memory()` after `mx.reset_peak_memory()` around each decode; the
decoder's own weights (~200 MB in float32) are allocated before and counted in both.

    python benchmarks/vae_memory.py --size 1024            # untiled then tiled, float32
    python benchmarks/vae_memory.py --size 512 --dtype bfloat16 --modes tiled

On Linux this takes minutes per 1024^2 decode (about 10 TFLOP on a few CPU cores).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py
import common  # noqa: E402,F401  (this checkout on sys.path, OpenBLAS preloaded)
import mlx.core as mx  # noqa: E402

from flux_klein_mlx.bench.flops import flops_of_vae_decoder  # noqa: E402
from flux_klein_mlx.models.config import AutoEncoderConfig  # noqa: E402
from flux_klein_mlx.models.vae import AutoEncoder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--modes", default="untiled,tiled")
    p.add_argument("--tile-pixels", type=int, default=1 << 16)
    args = p.parse_args()

    dtype = getattr(mx, args.dtype)
    config = AutoEncoderConfig.flux2()
    model = AutoEncoder(config)
    model.set_dtype(dtype)
    decoder = model.decoder
    mx.eval(decoder.parameters())
    z = mx.random.normal((1, args.size // 8, args.size // 8, config.latent_channels), key=mx.random.key(0))
    mx.eval(z)
    flops = flops_of_vae_decoder(config, args.size, args.size).total  # the package's FLOP model
    print(
        f"FLUX.2 VAE decoder, {args.size}x{args.size}, {args.dtype}, batch 1, random weights; "
        f"mlx {mx.__version__}, {mx.default_device()}, {platform.machine()} {platform.system()}, "
        f"{os.cpu_count()} cores; {flops / 1e12:.1f} TFLOP per decode"
    )
    outs = {}
    for mode in args.modes.split(","):
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        y = decoder.decode_tiled(z, args.tile_pixels) if mode == "tiled" else decoder(z)
        mx.eval(y)
        dt = time.perf_counter() - t0
        peak = mx.get_peak_memory() / 2**30
        outs[mode] = y
        extra = f", tile_pixels {args.tile_pixels}" if mode == "tiled" else ""
        print(f"{mode:8s} peak {peak:6.2f} GiB  time {dt:6.1f} s  ({flops / dt / 1e9:.0f} GFLOP/s){extra}")
        del y
    if "untiled" in outs and "tiled" in outs:
        a, b = outs["untiled"].astype(mx.float32), outs["tiled"].astype(mx.float32)
        diff = mx.abs(a - b).max().item() / max(mx.abs(a).max().item(), 1e-12)
        print(f"tiled vs untiled: max|diff| / max|untiled| = {diff:.2e}")


if __name__ == "__main__":
    main()
