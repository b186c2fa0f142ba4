"""Peak memory of loading the full-size Qwen3-4B text encoder: layers 28-36 are never read.

Writes a random Qwen3-4B checkpoint in the Hugging Face layout of FLUX.2-klein-4B's
`text_encoder/` (36 layers, bf16, tied embeddings, two shards of at most 5 GiB plus
`model.safetensors.index.json`, ~8 GB; streamed tensor by tensor, so the writer needs well under
1 GB), then measures in fresh processes:

1. bf16 (the Mac path): `load_component(describe(root), "text_encoder")` + `mx.eval(model.parameters())`.
   The peak is the bytes of what was read. bf16 matmuls run at ~5 GFLOPS on Linux CPUs, so no encode here by
   default (`--encode-bf16` runs one: ~2.8 TFLOP, about 10 minutes).
2. float32 (fast on a Linux CPU): the same load cast to float32, then one prompt through
   `encode_prompts` (512 tokens, 27 layers, ~2.8 TFLOP).

Each prints `mx.get_peak_memory()` and the process's max RSS, next to the checkpoint's bytes for
the embedding + layers 1-27 versus everything. The checkpoint is deleted at the end (`--keep`
keeps it).

    python benchmarks/text_encoder_memory.py [--dir /tmp/qwen3_4b_random] [--keep] [--encode-bf16] [--no-float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py
import common  # noqa: E402, F401  (first: this checkout on sys.path, OpenBLAS bound before mlx loads)

# isort: split
import mlx.core as mx  # noqa: E402
from common import GB, max_rss_bytes, qwen3_hf_config, qwen_tokenizer_dir, run_json_child  # noqa: E402

from flux_klein_mlx.models.flux2.config import FluxKleinParams, qwen3_4b  # noqa: E402
from flux_klein_mlx.models.text_encoder import OUT_LAYERS  # noqa: E402
from flux_klein_mlx.storage.weights import save_safetensors_sharded  # noqa: E402


def lazy_checkpoint(seed: int = 0) -> dict[str, mx.array]:
    """Every tensor of Qwen3ForCausalLM-4B (tied: no lm_head), lazy random bf16, in HF key order.

    Values come from one random pool (different offsets per tensor) so writing is disk-bound;
    what is measured does not depend on them, they only need to keep the encoder finite.
    """
    c = qwen3_4b()
    d, m = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    pool = mx.random.normal((2 * m * d,), dtype=mx.bfloat16, key=mx.random.key(seed)) * 0.02

    def rand(shape, i):
        n = shape[0] * shape[1]
        start = (i * 7919) % (pool.size - n)
        return pool[start : start + n].reshape(shape)

    embed = mx.random.normal((c.vocab_size, d), dtype=mx.bfloat16, key=mx.random.key(seed + 1))
    w = {"model.embed_tokens.weight": embed}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (q, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, q),
            "mlp.gate_proj.weight": (m, d),
            "mlp.up_proj.weight": (m, d),
            "mlp.down_proj.weight": (d, m),
        }
        for j, (name, shape) in enumerate(shapes.items()):
            w[p + name] = rand(shape, 16 * i + j)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            w[p + name] = mx.ones((d,), dtype=mx.bfloat16)
        for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            w[p + name] = mx.ones((c.head_dim,), dtype=mx.bfloat16)
    w["model.norm.weight"] = mx.ones((d,), dtype=mx.bfloat16)
    return w


def checkpoint_sizes(weights: dict[str, mx.array]) -> dict:
    """Bytes of the whole checkpoint, of what the encoder reads (embedding + layers 1-27), of the embedding."""
    n_used = max(OUT_LAYERS)

    def used(k):
        return k.startswith("model.embed_tokens.") or (k.startswith("model.layers.") and int(k.split(".")[2]) < n_used)

    return {
        "all": sum(v.nbytes for v in weights.values()),
        "used": sum(v.nbytes for k, v in weights.items() if used(k)),
        "embed": weights["model.embed_tokens.weight"].nbytes,
    }


def write_checkpoint(root: Path) -> list[str]:
    """Write the random snapshot (text_encoder/ + tokenizer/); returns the shards written."""
    folder = root / "text_encoder"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(qwen3_hf_config(qwen3_4b()), indent=2))
    files = save_safetensors_sharded(lazy_checkpoint(), folder, prefix="model", max_shard_bytes=5 << 30)
    shutil.copytree(qwen_tokenizer_dir(), root / "tokenizer", dirs_exist_ok=True)  # as in the snapshot
    # The other components' configs (no weights): the loading layer describes a whole snapshot, reading
    # configs only, and then loads just the text encoder's files.
    for name, config in (("transformer", dataclasses.asdict(FluxKleinParams.klein_4b())), ("vae", {})):
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": True}))
    return [f"{f.name} ({f.stat().st_size / GB:.2f} GB)" for f in files]


def measure(root: Path, dtype_name: str, encode: bool) -> dict:
    """Runs in a fresh process: load (and encode), report peak memory and RSS."""
    from flux_klein_mlx.models.text_encoder import encode_prompts
    from flux_klein_mlx.models.tokenizer import FLUX2_WINDOW
    from flux_klein_mlx.run.components import load_component
    from flux_klein_mlx.run.loading import describe

    dtype = getattr(mx, dtype_name)
    out = {"dtype": dtype_name, "rss_before_load": max_rss_bytes()}
    mx.reset_peak_memory()
    t = time.perf_counter()
    encoder = load_component(describe(root), "text_encoder", dtype)
    mx.eval(encoder.parameters())
    out["load_s"] = time.perf_counter() - t
    out["layers_built"] = len(encoder.model.layers)
    out["param_bytes"] = sum(v.nbytes for _, v in _flatten(encoder.parameters()))
    out["peak_after_load"] = mx.get_peak_memory()
    out["rss_after_load"] = max_rss_bytes()
    if encode:
        from flux_klein_mlx.models.tokenizer import load_tokenizer

        tok = load_tokenizer(root)
        t = time.perf_counter()
        emb = encode_prompts(encoder, tok, "a red fox in fresh snow, golden hour", FLUX2_WINDOW)
        mx.eval(emb)
        out["encode_s"] = time.perf_counter() - t
        out["shape"] = list(emb.shape)
        out["finite"] = bool(mx.isfinite(emb.astype(mx.float32)).all().item())
        out["peak_after_encode"] = mx.get_peak_memory()
        out["rss_after_encode"] = max_rss_bytes()
    return out


def _flatten(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def run_child(root: Path, dtype: str, encode: bool) -> dict:
    cmd = [sys.executable, __file__, "--measure", str(root), "--dtype", dtype] + (["--encode"] if encode else [])
    print("$", " ".join(cmd), flush=True)
    return run_json_child(cmd, "measurement")


def wait_for_memory(need: float, timeout_s: float = 300) -> bool:
    """Wait (on a shared machine) until `need` bytes are available; Linux only, else True."""
    if not Path("/proc/meminfo").is_file():
        return True
    deadline = time.time() + timeout_s
    while True:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(info["MemAvailable"].split()[0]) * 1024
        if available >= need:
            return True
        if time.time() > deadline:
            return False
        print(f"  waiting for memory: {available / GB:.1f} GB available, {need / GB:.1f} GB needed", flush=True)
        time.sleep(15)


def report(r: dict) -> None:
    print(
        f"\n[{r['dtype']}] layers built: {r['layers_built']}, parameter bytes {r['param_bytes'] / GB:.2f} GB, "
        f"load {r['load_s']:.1f} s"
    )
    print(f"  max RSS after imports            {r['rss_before_load'] / GB:6.2f} GB")
    print(
        f"  mx peak after load (params eval) {r['peak_after_load'] / GB:6.3f} GB   "
        f"max RSS {r['rss_after_load'] / GB:6.2f} GB"
    )
    if "encode_s" in r:
        print(
            f"  mx peak after one encode         {r['peak_after_encode'] / GB:6.3f} GB   max RSS "
            f"{r['rss_after_encode'] / GB:6.2f} GB   encode {r['encode_s']:.1f} s, shape {r['shape']}, "
            f"finite {r['finite']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/qwen3_4b_random"))
    p.add_argument("--keep", action="store_true", help="keep the ~8 GB checkpoint")
    p.add_argument("--encode-bf16", action="store_true", help="also encode in bf16 (slow on Linux CPUs)")
    p.add_argument("--no-float32", action="store_true", help="skip the float32 load + encode (~14 GB)")
    p.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--encode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.measure is not None:  # child process
        print(json.dumps(measure(args.measure, args.dtype, args.encode)))
        return

    print(
        f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs; mlx {mx.__version__}, "
        f"device {mx.default_device()}"
    )
    try:
        if not (args.dir / "text_encoder" / "model.safetensors.index.json").is_file():
            print(f"writing a random Qwen3-4B checkpoint to {args.dir} ...", flush=True)
            t = time.perf_counter()
            files = write_checkpoint(args.dir)
            print(f"  wrote {', '.join(files)} in {time.perf_counter() - t:.0f} s", flush=True)
        sizes = checkpoint_sizes(lazy_checkpoint())  # shapes only: nothing is evaluated
        print(
            f"checkpoint bytes: all 36 layers + embedding + norm {sizes['all'] / GB:.3f} GB; "
            f"embedding + layers 1-27 {sizes['used'] / GB:.3f} GB (embedding {sizes['embed'] / GB:.3f} GB); "
            f"never read: {(sizes['all'] - sizes['used']) / GB:.3f} GB"
        )
        results = [run_child(args.dir, "bfloat16", args.encode_bf16)]
        need = 2 * sizes["used"] * 1.15  # float32 weights plus the transient bf16 tensor and activations
        if args.no_float32:
            pass
        elif wait_for_memory(need):
            results.append(run_child(args.dir, "float32", True))
        else:
            print(f"skipped the float32 encode: it needs ~{need / GB:.1f} GB and less is available")
        for r in results:
            report(r)
        if len(results) > 1:
            print(
                f"\nfloat32 expectation: 2 x {sizes['used'] / GB:.2f} = {2 * sizes['used'] / GB:.2f} GB of weights "
                f"(the whole checkpoint would be {2 * sizes['all'] / GB:.2f} GB)"
            )
    finally:
        if not args.keep and args.dir.exists():
            shutil.rmtree(args.dir)
            print(f"deleted {args.dir}")


if __name__ == "__main__":
    main()
