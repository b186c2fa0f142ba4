"""Memory a LoRA adds: a random rank-16 LoRA on every block Linear of full-size klein-4B (ai-toolkit
layout, bf16), read and checked by flux_klein_mlx; prints the file size, the bytes of LoRA tensors
held (measured with mx.get_active_memory), and what fusing into bf16 weights keeps for exact unfusing.

    python benchmarks/lora_memory.py [--rank 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from flux_klein_mlx import preload_openblas

preload_openblas()

import mlx.core as mx  # noqa: E402

from flux_klein_mlx.lora import load_loras  # noqa: E402
from flux_klein_mlx.lora_formats import layer_shapes  # noqa: E402
from flux_klein_mlx.config import FluxKleinParams  # noqa: E402
from flux_klein_mlx.weights import save_safetensors_streaming  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    params = FluxKleinParams.klein_4b()
    shapes = {k: v for k, v in layer_shapes(params).items() if k.startswith(("double_blocks", "single_blocks"))}
    tensors = {}
    for layer, (out, inp) in shapes.items():
        tensors[f"diffusion_model.{layer}.lora_A.weight"] = (mx.random.normal((args.rank, inp)) * 0.01).astype(mx.bfloat16)
        tensors[f"diffusion_model.{layer}.lora_B.weight"] = (mx.random.normal((out, args.rank)) * 0.01).astype(mx.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank16.safetensors"
        save_safetensors_streaming(path, tensors)
        file_bytes = path.stat().st_size
        mx.clear_cache()
        before = mx.get_active_memory()
        (lora,) = load_loras([path], params)
        held = mx.get_active_memory() - before
    touched = {t.layer for t in lora.terms}
    originals = sum(shapes[k][0] * shapes[k][1] * 2 for k in touched)
    print(f"klein-4B, rank {args.rank}, {len(touched)} layers (every double/single block Linear)")
    print(f"file {file_bytes / 1e6:.1f} MB; LoRA tensors held {lora.nbytes / 1e6:.1f} MB "
          f"(active memory measured +{held / 1e6:.1f} MB)")
    print(f"bf16 fused: the touched layers' original weights kept for exact unfusing: {originals / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
