"""Memory a LoRA adds: a random rank-16 LoRA on every block Linear of full-size klein-4B (ai-toolkit
layout, bf16), read and checked by flux_klein_mlx; prints the file size, the bytes of LoRA tensors
held (measured with mx.get_active_memory), and what fusing into bf16 weights would keep for exact
unfusing if the originals were held in memory.

Then it fuses a LoRA into a bf16 transformer of klein-4B width with one double and one single block,
stored on disk and loaded as the pipeline loads it, twice: keeping the touched layers' originals in
memory, and keeping them as lazy arrays of the file (what the pipeline does): the active-memory
increase of each is printed.

    python benchmarks/lora_memory.py [--rank 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py
import common  # noqa: E402,F401  (this checkout on sys.path, OpenBLAS preloaded)
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from flux_klein_mlx.bench.random_model import randomize  # noqa: E402
from flux_klein_mlx.lora.apply import apply_loras, load_loras  # noqa: E402
from flux_klein_mlx.models.flux2.config import FluxKleinParams  # noqa: E402
from flux_klein_mlx.models.flux2.transformer import (
    FluxKlein,  # noqa: E402
    linear_shapes,  # noqa: E402
)
from flux_klein_mlx.storage.weights import (  # noqa: E402
    load_into,
    read_weight_files,
    save_safetensors_streaming,  # noqa: E402
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    params = FluxKleinParams.klein_4b()
    shapes = {k: v for k, v in linear_shapes(params).items() if k.startswith(("double_blocks", "single_blocks"))}
    tensors = {}
    for layer, (out, inp) in shapes.items():
        tensors[f"diffusion_model.{layer}.lora_A.weight"] = (mx.random.normal((args.rank, inp)) * 0.01).astype(
            mx.bfloat16
        )
        tensors[f"diffusion_model.{layer}.lora_B.weight"] = (mx.random.normal((out, args.rank)) * 0.01).astype(
            mx.bfloat16
        )
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
    print(
        f"file {file_bytes / 1e6:.1f} MB; LoRA tensors held {lora.nbytes / 1e6:.1f} MB "
        f"(active memory measured +{held / 1e6:.1f} MB)"
    )
    print(f"bf16 fused: the touched layers' original weights, if kept in memory: {originals / 1e9:.2f} GB")
    fused_cost(args.rank)


def fused_cost(rank: int) -> None:
    """Active memory added by fusing a LoRA into a stored bf16 transformer (1 double + 1 single block)."""
    params = FluxKleinParams(depth=1, depth_single=1)
    shapes = {k: v for k, v in linear_shapes(params).items() if k.startswith(("double_blocks", "single_blocks"))}
    with tempfile.TemporaryDirectory() as tmp:
        model = FluxKlein(params)
        randomize(model, mx.bfloat16, seed=0)
        save_safetensors_streaming(Path(tmp) / "t.safetensors", dict(tree_flatten(model.parameters())))
        lora_file = Path(tmp) / "lora.safetensors"
        save_safetensors_streaming(
            lora_file,
            {
                **{
                    f"diffusion_model.{k}.lora_A.weight": (mx.random.normal((rank, i)) * 0.01).astype(mx.bfloat16)
                    for k, (o, i) in shapes.items()
                },
                **{
                    f"diffusion_model.{k}.lora_B.weight": (mx.random.normal((o, rank)) * 0.01).astype(mx.bfloat16)
                    for k, (o, i) in shapes.items()
                },
            },
        )
        (lora,) = load_loras([lora_file], params)
        for how in ("originals in memory", "originals as lazy arrays of the file"):
            del model
            mx.clear_cache()
            weights = read_weight_files([Path(tmp) / "t.safetensors"])
            model = FluxKlein(params)
            load_into(model, weights, "transformer")
            mx.eval(model.parameters())
            del weights  # as in the pipeline: only the model holds the loaded arrays
            mx.clear_cache()
            before = mx.get_active_memory()
            # As the pipeline does: the file opened anew, so these arrays are not the (evaluated) loaded ones.
            fresh = read_weight_files([Path(tmp) / "t.safetensors"]) if "lazy" in how else None
            reread = (lambda path, fresh=fresh: fresh[f"{path}.weight"]) if fresh else None
            apply_loras(model, [lora], reread=reread)
            mx.clear_cache()
            print(
                f"fused rank-{rank} LoRA into {len(shapes)} bf16 layers "
                f"({sum(o * i * 2 for o, i in shapes.values()) / 1e9:.2f} GB), "
                f"{how}: +{(mx.get_active_memory() - before) / 1e6:.1f} MB (LoRA tensors {lora.nbytes / 1e6:.1f} MB)"
            )


if __name__ == "__main__":
    main()
