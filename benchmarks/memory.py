"""Memory of converting and of running FLUX.2 [klein] 4B at 4 bits, on full-size random weights.

Part 1, `convert`: lays out a full-size random klein-4B snapshot exactly like the hub repo
(diffusers transformer/ with one ~7.75 GB bf16 file, Qwen3-4B text_encoder/ in 2 shards with all
36 layers, vae/, the real Qwen3 tokenizer, model_index.json), generated tensor by tensor, then
runs `convert_model` (what `python -m flux_klein_mlx convert` calls) in bf16 and in 4-bit, each in
a fresh process: wall time, peak MLX memory (`mx.get_peak_memory`), max RSS, file sizes.

It then loads each component of the converted folders in a fresh process and reads
`mx.get_active_memory()`: what a stage holds (transformer 4-bit, Qwen3-4B 27 layers 4-bit, VAE bf16).

Part 2, `stages`: each pipeline stage at full size in bf16 (encode = Qwen3-4B at 512 tokens,
denoise = one Euler step of the transformer on 512 text + H·W/256 image tokens, decode = the
VAE), weights resident as loaded, peak memory over the stage. MLX's CPU backend cannot run
full-size bf16/4-bit matmuls in reasonable time, and it implements attention (full L×L scores),
convolutions (whole-input unfold) and norms/RoPE (float32 copies) differently from the Metal
kernels a Mac uses. Those ops, and the matmuls, are swapped for stand-ins with the kernels'
memory profile (one op, same inputs, output-sized allocation, meaningless values; see the
`emulate_*` functions); the rest of the graph runs and is scheduled by MLX as is. The VAE's mid
attention (head dim 512) has no fused Metal kernel and runs unchanged. Check rows compare the
matmul stand-ins with real float32 compute at reduced depth. The `low_memory` rows measure the
transformer's own block-by-block forward (`forward_with_rope(..., low_memory=True)`).

Why stand-ins patched in a child process and not a seam in the package (issue 11 asks for "a seam
like mlx-lm's `use_attention_backend`, not a patch"): mlx-lm's seam is a module-level stack of
backends that every attention call consults. Ours would have to reach attention in three model
files (and inside mlx-lm's Qwen3 block), every conv, every norm and every matmul, so it would be
module-level mutable state (our style has none) consulted on the hot path of every layer, for a
measurement that only this script makes. So the stand-ins replace MLX's own public ops
(`mx.fast.*`, `mx.conv2d`, `mx.quantized_matmul`, `mx.addmm`, `mx.array.__matmul__`), only in the
fresh child process of one measurement, and never a function of the package: the package runs
exactly its real code on top of them.

Part 3, `activations`: real float32 compute (attention stand-in only) at reduced depth: the peak
does not depend on depth; and the VAE decode with MLX's own CPU convolutions (Linux numbers).

    .venv/bin/python benchmarks/memory.py all --work /tmp/klein-memory     # ~30 GB of disk, deleted after
    .venv/bin/python benchmarks/memory.py stages                           # no disk needed
    .venv/bin/python benchmarks/memory.py report                           # markdown tables

Results go to benchmarks/memory.json (the tables of benchmarks/MEMORY.md are made from it).
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
from common import (  # noqa: E402
    GB,
    ROOT,
    SCHEDULER,
    diffusers_transformer_config,
    folder_bytes,
    max_rss_bytes,
    qwen3_hf_config,
    qwen_tokenizer_dir,
    run_json_child,
)

from flux_klein_mlx.models.config import AutoEncoderConfig  # noqa: E402
from flux_klein_mlx.models.flux2.config import FluxKleinParams, qwen3_4b  # noqa: E402

RESULTS = ROOT / "benchmarks" / "memory.json"


# --- part 1: a full-size random snapshot -------------------------------------------------------------


def _shapes(module) -> dict[str, tuple[tuple[int, ...], str]]:
    import torch

    out = {}
    for name, t in list(module.state_dict().items()):
        out[name] = (tuple(t.shape), "int" if not torch.is_floating_point(t) else "float")
    return out


def _random_tensors(shapes: dict, seed: int) -> dict[str, mx.array]:
    """Lazy bf16 uniform values of scale 1/sqrt(fan_in) (BN variances positive): generated at write time."""
    out = {}
    for i, (name, (shape, kind)) in enumerate(shapes.items()):
        key = mx.random.key(seed * 100_000 + i)
        if kind == "int":
            out[name] = mx.zeros(shape, dtype=mx.int64)
        elif name.endswith("running_var"):
            out[name] = mx.random.uniform(0.5, 1.5, shape, dtype=mx.bfloat16, key=key)
        else:
            fan_in = 1
            for s in shape[1:]:
                fan_in *= s
            r = (3.0 / max(fan_in, 1)) ** 0.5 if len(shape) > 1 else 0.1
            out[name] = mx.random.uniform(-r, r, shape, dtype=mx.bfloat16, key=key)
    return out


def make_full_snapshot(dst: Path) -> dict:
    """Write a random klein-4B snapshot in the hub layout; returns the seconds and bytes it took."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flux_klein_mlx.storage.weights import save_safetensors_sharded, save_safetensors_streaming

    t0 = time.perf_counter()
    dst.mkdir(parents=True)
    with torch.device("meta"):
        transformer = Flux2Transformer2DModel(**diffusers_transformer_config(FluxKleinParams.klein_4b()))
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**qwen3_hf_config(qwen3_4b())))
        vae = AutoencoderKLFlux2()
    index = {
        "_class_name": "Flux2KleinPipeline",
        "_diffusers_version": "0.37.0.dev0",
        "is_distilled": True,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    (dst / "model_index.json").write_text(json.dumps(index, indent=2))
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_config(dst / "scheduler")
    transformer.save_config(dst / "transformer")
    vae.save_config(dst / "vae")
    text_encoder.config.save_pretrained(dst / "text_encoder")
    shutil.copytree(qwen_tokenizer_dir(), dst / "tokenizer")

    save_safetensors_streaming(
        dst / "transformer" / "diffusion_pytorch_model.safetensors", _random_tensors(_shapes(transformer), 1)
    )
    te = {k: v for k, v in _shapes(text_encoder).items() if k != "lm_head.weight"}  # tied: not stored
    # Two shards with an index, named as transformers names them (model-00001-of-00002.safetensors).
    save_safetensors_sharded(
        _random_tensors(te, 2), dst / "text_encoder", prefix="model", max_shard_bytes=4_100_000_000
    )
    save_safetensors_streaming(dst / "vae" / "diffusion_pytorch_model.safetensors", _random_tensors(_shapes(vae), 3))
    return {
        "seconds": time.perf_counter() - t0,
        "bytes": {c: folder_bytes(dst / c) for c in ("transformer", "text_encoder", "vae", "tokenizer")},
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss_bytes(),
    }


def child_convert(src: str, out: str, bits: int | None) -> dict:
    """One `convert_model` run; per-component seconds from the progress callback."""
    from flux_klein_mlx.convert import convert_model

    marks: dict[str, float] = {}

    def progress(name, done, total):
        marks.setdefault(name, time.perf_counter())
        if done >= total:
            marks[name + ":end"] = time.perf_counter()

    t0 = time.perf_counter()
    config = convert_model(src, out, dtype="bfloat16", bits=bits, progress=progress)
    wall = time.perf_counter() - t0
    files = {f.name: f.stat().st_size for f in sorted(Path(out).iterdir()) if f.is_file()}
    per = {c: marks.get(c + ":end", 0) - marks.get(c, 0) for c in ("transformer", "text_encoder", "vae")}
    return {
        "bits": bits,
        "seconds": wall,
        "component_seconds": per,
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss_bytes(),
        "files": files,
        "total_bytes": folder_bytes(Path(out)),
        "quantized_layers": {
            c: len(config[c]["quantization"]["layers"]) if config[c]["quantization"] else 0
            for c in ("transformer", "text_encoder", "vae")
        },
    }


def child_resident(folder: str, name: str) -> dict:
    """Load one component (evaluated) and report what it holds."""
    from mlx.utils import tree_flatten

    from flux_klein_mlx.run.components import load_component
    from flux_klein_mlx.run.loading import describe

    t0 = time.perf_counter()
    model = load_component(describe(folder), name)
    seconds = time.perf_counter() - t0
    mx.synchronize()
    params = tree_flatten(model.parameters())
    return {
        "component": name,
        "load_seconds": seconds,
        "active_memory": mx.get_active_memory(),
        "parameter_bytes": sum(v.nbytes for _, v in params),
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss_bytes(),
    }


# --- part 3: activations ------------------------------------------------------------------------------

FUSED_HEAD_DIMS = (64, 72, 80, 96, 128)  # MLX's full-attention Metal kernel (see module docstring)


def emulate_fused_attention() -> None:
    """Give attention the memory profile of MLX's fused Metal kernel: one op that reads q, k, v and
    allocates only its output (the CPU backend instead materialises the (H, L, L) scores).

    The stand-in reduces k, v (and the mask) and returns q plus a zero made from those sums: the same output
    shape and inputs, so the rest of the lazy graph is scheduled and freed exactly as with the kernel, but
    the values are meaningless.
    Only memory is measured with it. Head dims without a fused kernel (the VAE's 512) run as they are.
    """
    sdpa = mx.fast.scaled_dot_product_attention

    def fused_stand_in(q, k, v, *, scale, mask=None, **kw):
        if q.shape[-1] not in FUSED_HEAD_DIMS or q.shape[2] <= 8:
            return sdpa(q, k, v, scale=scale, mask=mask, **kw)
        extra = k.sum() + v.sum()
        if isinstance(mask, mx.array):
            extra = extra + mask.astype(q.dtype).sum()
        # k, v and the mask are read as the kernel reads them, and nothing is added to q: a sum that overflows (a
        # long window's additive mask of -inf) would otherwise reach the output. isnan(...) is finite either way.
        return q + mx.isnan(extra).astype(q.dtype) * 0

    mx.fast.scaled_dot_product_attention = fused_stand_in


def emulate_implicit_gemm_conv() -> None:
    """Give convolutions the memory profile of MLX's Metal convs (implicit GEMM: one op, output only).

    MLX's CPU conv unfolds its whole input first (H·W·9·C values for a 3x3 conv: 9.7 GB of float32
    for the VAE's 256-channel conv at 1024²), which Metal's implicit-GEMM kernels never do (Winograd,
    when chosen, works in memory-bounded batches). The stand-in allocates the conv's output from
    a strided view of the input and the weight's sum: same shape and inputs, meaningless values.
    """

    def conv_stand_in(x, w, stride=1, padding=0, dilation=1, groups=1, **kw):
        st = (stride, stride) if isinstance(stride, int) else tuple(stride)
        pad = (padding, padding) if isinstance(padding, int) else tuple(padding)
        B, H, W, _ = x.shape
        Co, kh, kw_ = w.shape[0], w.shape[1], w.shape[2]
        Ho, Wo = (H + 2 * pad[0] - kh) // st[0] + 1, (W + 2 * pad[1] - kw_) // st[1] + 1
        # A strided view covering the output grid (rows/cols clipped), then one allocation of the output.
        view = x[:, : Ho * st[0] : st[0], : Wo * st[1] : st[1], :1]
        view = (
            mx.pad(view, [(0, 0), (0, Ho - view.shape[1]), (0, Wo - view.shape[2]), (0, 0)])
            if (view.shape[1] != Ho or view.shape[2] != Wo)
            else view
        )
        return mx.broadcast_to(view, (B, Ho, Wo, 1)) * w.sum() + mx.zeros((Co,), dtype=x.dtype)

    mx.conv2d = conv_stand_in


def emulate_matmul_kernels() -> None:
    """Give matmuls (`@`, `mx.addmm`, `mx.quantized_matmul`: what nn.Linear, nn.QuantizedLinear and
    the transformer's low-memory halves call) the memory profile of a GEMM kernel (output only),
    without the compute: bf16 and 4-bit matmuls run at a few GFLOPS on MLX's CPU backend, so a
    full-size bf16 / 4-bit stage at 1024² is out of reach here, while its memory is what we want to
    know. Validated against real float32 compute in `part_stages` (the 'check' rows)."""

    def output_only(x, corner, out: int, bias=None):  # (..., out) from one column of x: one allocation
        add = mx.zeros((out,), x.dtype) if bias is None else bias
        return mx.broadcast_to(x[..., :1], (*x.shape[:-1], out)) * corner + add

    products = mx.array.__matmul__

    def matmul(a, b):  # a (..., K) @ b (K, N): weights, as nn.Linear and linear_part use it
        if b.ndim != 2:  # a product of activations with batch axes (mlx-vlm's chunked DeltaNet scan): as it is
            return products(a, b)
        return output_only(a, b[0, 0], b.shape[-1])

    def quantized_matmul(x, w, scales, biases=None, transpose=True, group_size=64, bits=4, **kw):
        out = w.shape[0] if transpose else w.shape[-1] * 32 // bits  # w (out, in·bits/32) packed
        return output_only(x, scales[0, 0], out)

    mx.array.__matmul__ = matmul
    mx.addmm = lambda c, a, b, alpha=1.0, beta=1.0, **kw: output_only(a, b[0, 0], b.shape[-1], c)
    mx.quantized_matmul = quantized_matmul


def emulate_fused_norms() -> None:
    """Give mx.fast.layer_norm / rms_norm / rope the memory profile of their Metal kernels.

    On the CPU these ops fall back to composed ops that upcast a bf16 input to a float32 copy and
    build several full-size temporaries; the Metal kernels write one output (reusing a donatable
    input's buffer, like any MLX elementwise op). The stand-in is one elementwise op on the input."""
    fast = mx.fast

    def scaled(x, weight=None):
        s = weight.reshape(-1)[0] if isinstance(weight, mx.array) else 1.0
        return x * mx.array(s, dtype=x.dtype) if not isinstance(s, mx.array) else x * s.astype(x.dtype)

    fast.layer_norm = lambda x, weight, bias, eps, **kw: scaled(x, weight)
    fast.rms_norm = lambda x, weight, eps, **kw: scaled(x, weight)
    fast.rope = lambda x, dims, **kw: scaled(x)


def _zero_params(model) -> None:
    """Set every parameter to zeros of its own shape and dtype (memory as real weights, no random fill)."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: mx.zeros(a.shape, a.dtype), model.parameters()))
    mx.eval(model.parameters())


def child_stage(
    stage: str,
    size: int,
    dtype: str = "bfloat16",
    bits: int | None = 4,
    tiled: bool = False,
    stand_in_matmul: bool = True,
    depth: int | None = None,
    block_eval: bool | str = False,
) -> dict:
    """A whole pipeline stage at full size: weights resident (zeros of the real shapes, `bits`-quantized
    like a converted folder), then the stage's work as the pipeline runs it, peak memory over both.

    Matmuls, attention and convs are output-only stand-ins (see the `emulate_*` functions) unless
    `stand_in_matmul` is False (real float32 matmuls: the check of the stand-in). `block_eval`
    "low_memory" runs the denoise step through `forward_with_rope(..., low_memory=True)`."""
    from flux_klein_mlx.models.quantize import quantize_model

    if block_eval not in (False, "low_memory"):
        raise SystemExit(f"block_eval is False or 'low_memory', not {block_eval!r}")

    emulate_fused_attention()
    emulate_implicit_gemm_conv()
    emulate_fused_norms()
    if stand_in_matmul:
        emulate_matmul_kernels()
    dt = getattr(mx, dtype)
    mx.random.seed(0)
    mx.reset_peak_memory()
    if stage == "encode":
        from flux_klein_mlx.models.text_encoder import Qwen3TextEncoder

        cfg = qwen3_4b() if depth is None else dataclasses.replace(qwen3_4b(), num_hidden_layers=depth)
        layers = (9, 18, 27) if depth is None else (depth,)
        model = Qwen3TextEncoder(cfg, out_layers=layers)
    elif stage == "denoise":
        from flux_klein_mlx.models.flux2.transformer import FluxKlein

        p = FluxKleinParams.klein_4b() if depth is None else FluxKleinParams(depth=depth, depth_single=depth)
        model = FluxKlein(p)
    else:
        from flux_klein_mlx.models.vae import AutoEncoder

        model = AutoEncoder(AutoEncoderConfig.flux2())
    model.update(model.parameters())  # (lazy random init is never evaluated)
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(dt) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    if bits and stage != "decode":
        quantize_model(model, bits)
    _zero_params(model)
    if not stand_in_matmul:  # real compute needs real values
        from flux_klein_mlx.bench.random_model import randomize  # (imports the pipeline: seconds)

        randomize(model, dt, seed=0)
    resident = mx.get_active_memory()
    load_peak = mx.get_peak_memory()
    if stage == "encode":
        ids = mx.random.randint(0, qwen3_4b().vocab_size, (1, 512))
        mask = (mx.arange(512) < 24).astype(mx.int32)[None]
        mx.eval(ids, mask)
        res = _measure(lambda: model(ids, mask).astype(dt))
    elif stage == "denoise":
        from flux_klein_mlx.models.rope import image_ids, text_ids

        h = w = size // 16
        ctx = mx.random.normal((1, 512, model.params.context_in_dim)).astype(dt)
        x = mx.random.normal((1, h * w, 128)).astype(dt)
        mx.eval(ctx, x)
        setup = _measure(lambda: (model.compute_rope(text_ids(512), image_ids(h, w)), model.embed_text(ctx)))
        rope = model.compute_rope(text_ids(512), image_ids(h, w))
        txt = model.embed_text(ctx)
        mx.eval(rope, txt)
        t = mx.array([0.9], dtype=dt)
        low = block_eval == "low_memory"
        res = _measure(lambda: x + (-0.05) * model.forward_with_rope(x, ctx, t, rope, txt_embedded=txt, low_memory=low))
        res["setup_peak"] = setup["peak"]
    else:
        h = w = size // 16
        tokens = mx.random.normal((1, h * w, 128)).astype(dt)
        mx.eval(tokens)
        res = _measure(lambda: model.decode_tokens(tokens, h, w, tiled=tiled))
    return {
        "stage": stage,
        "size": size,
        "dtype": dtype,
        "bits": bits,
        "tiled": tiled,
        "stand_in_matmul": stand_in_matmul,
        "depth": depth,
        "block_eval": block_eval,
        "resident": resident,
        "load_peak": load_peak,
        **res,
        "stage_peak": max(load_peak, res["peak"], res.get("setup_peak", 0)),
    }


def _measure(run) -> dict:
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = run()
    mx.eval(out)
    seconds = time.perf_counter() - t0
    return {
        "resident_before": before,
        "peak": mx.get_peak_memory(),
        "activation_peak": mx.get_peak_memory() - before,
        "seconds": seconds,
    }


def child_activation(
    stage: str, size: int, dtype: str, width: str, depth: int, tiled: bool = False, metal_conv: bool = False
) -> dict:
    """One stage's activation peak with real float32 compute (`width` "full": the real widths, `depth`
    blocks/layers) at a `size`² image (512 text tokens); attention is the fused-kernel stand-in.
    `tiled` decodes with the VAE's banded decoder; `metal_conv` swaps convs for stand-ins too."""
    from flux_klein_mlx.bench.random_model import randomize

    emulate_fused_attention()
    if metal_conv:
        emulate_implicit_gemm_conv()
    dt = getattr(mx, dtype)
    mx.random.seed(0)
    if stage == "encode":
        from flux_klein_mlx.models.text_encoder import Qwen3TextEncoder

        cfg = dataclasses.replace(qwen3_4b(), num_hidden_layers=depth)
        model = Qwen3TextEncoder(cfg, out_layers=tuple(sorted({max(1, depth // 3), max(1, 2 * depth // 3), depth})))
        randomize(model, dt, seed=0)
        ids = mx.random.randint(0, cfg.vocab_size, (1, 512))
        mask = (mx.arange(512) < 24).astype(mx.int32)[None]  # a short prompt, right-padded to 512
        mx.eval(ids, mask)
        res = _measure(lambda: model(ids, mask))
    elif stage == "denoise":
        from flux_klein_mlx.models.flux2.transformer import FluxKlein
        from flux_klein_mlx.models.rope import image_ids, text_ids

        p = FluxKleinParams(depth=depth, depth_single=depth)
        model = FluxKlein(p)
        randomize(model, dt, seed=0)
        h = w = size // 16
        ctx = mx.random.normal((1, 512, p.context_in_dim)).astype(dt)
        x = mx.random.normal((1, h * w, 128)).astype(dt)
        rope = model.compute_rope(text_ids(512), image_ids(h, w))
        txt = model.embed_text(ctx)  # hoisted out of the loop, as the pipeline does
        mx.eval(ctx, x, rope, txt)
        t = mx.array([0.9], dtype=dt)
        res = _measure(lambda: x + (-0.05) * model.forward_with_rope(x, ctx, t, rope, txt_embedded=txt))
    elif stage == "decode":
        from flux_klein_mlx.models.vae import AutoEncoder

        cfg = AutoEncoderConfig.flux2()
        model = AutoEncoder(cfg)
        randomize(model, dt, seed=0)
        h = w = size // 16
        tokens = mx.random.normal((1, h * w, cfg.token_channels)).astype(dt)
        mx.eval(tokens)
        res = _measure(lambda: model.decode_tokens(tokens, h, w, tiled=tiled))
    else:
        raise ValueError(stage)
    return {
        "stage": stage,
        "size": size,
        "dtype": dtype,
        "width": width,
        "depth": depth,
        "tiled": tiled,
        "metal_conv": metal_conv,
        **res,
    }


# --- driver -------------------------------------------------------------------------------------------


def run_child(task: str, **kwargs) -> dict:
    """Run one measurement in a fresh process (clean peaks and RSS); returns its JSON result."""
    result = run_json_child(
        [sys.executable, __file__, "--child", json.dumps({"task": task, **kwargs})], f"{task} {kwargs}"
    )
    print(f"  {task} {kwargs}: {json.dumps(result)[:400]}", flush=True)
    return result


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def save_results(results: dict) -> None:
    import mlx.core

    results["machine"] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "mlx": mlx.core.__version__,
        "python": platform.python_version(),
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


def part_convert(work: Path, results: dict, keep: bool) -> None:
    src, out_bf16, out_q4 = work / "src", work / "klein-4b-bf16", work / "klein-4b-q4"
    if not src.exists():
        print(f"writing the random full-size snapshot to {src} ...", flush=True)
        results["snapshot"] = run_child("snapshot", dst=str(src))
    print("converting to 4-bit ...", flush=True)
    results["convert_q4"] = run_child("convert", src=str(src), out=str(out_q4), bits=4)
    print("loading the 4-bit components ...", flush=True)
    results["resident_q4"] = {
        n: run_child("resident", folder=str(out_q4), name=n) for n in ("transformer", "text_encoder", "vae")
    }
    shutil.rmtree(out_q4)  # keep the disk under ~30 GB: source 16 GB + bf16 output 14 GB
    save_results(results)
    print("converting to bf16 ...", flush=True)
    results["convert_bf16"] = run_child("convert", src=str(src), out=str(out_bf16), bits=None)
    results["resident_bf16"] = {"transformer": run_child("resident", folder=str(out_bf16), name="transformer")}
    shutil.rmtree(out_bf16)
    if not keep:
        shutil.rmtree(src)
    save_results(results)


def run_plan(results: dict, key: str, task: str, fields: tuple, plan: list, defaults: dict) -> None:
    """Run each job of `plan` (a tuple of `fields` values) that `results[key]` lacks, in a child, and save
    after each; a stored row without one of the fields reads as `defaults` gives it (else None)."""
    rows = results.setdefault(key, [])
    done = {tuple(r.get(f, defaults.get(f)) for f in fields) for r in rows}
    for job in plan:
        if job not in done:
            rows.append(run_child(task, **dict(zip(fields, job, strict=True))))
            save_results(results)


def part_activations(results: dict) -> None:
    fields = ("stage", "size", "dtype", "width", "depth", "tiled", "metal_conv")
    plan = [
        # Real float32 compute (only attention is a stand-in): is the peak independent of depth?
        ("encode", 1024, "float32", "full", 3, False, False),
        ("encode", 1024, "float32", "full", 6, False, False),
        ("denoise", 256, "float32", "full", 1, False, False),
        ("denoise", 256, "float32", "full", 2, False, False),
        ("denoise", 256, "float32", "full", 4, False, False),
        ("denoise", 512, "float32", "full", 2, False, False),
        # The decoder with the CPU's own convs (full unfold), whole and banded: what a Linux/CPU run needs.
        ("decode", 256, "float32", "full", 1, False, False),
        ("decode", 512, "float32", "full", 1, False, False),
        ("decode", 256, "float32", "full", 1, True, False),
        ("decode", 512, "float32", "full", 1, True, False),
    ]
    run_plan(results, "activations", "activation", fields, plan, dict.fromkeys(fields, False))


def part_stages(results: dict) -> None:
    fields = ("stage", "size", "dtype", "bits", "tiled", "stand_in_matmul", "depth", "block_eval")
    plan = [
        ("encode", 1024, "bfloat16", 4, False, True, None, False),
        ("denoise", 256, "bfloat16", 4, False, True, None, False),
        ("denoise", 512, "bfloat16", 4, False, True, None, False),
        ("denoise", 1024, "bfloat16", 4, False, True, None, False),
        ("denoise", 1024, "bfloat16", None, False, True, None, False),
        ("decode", 256, "bfloat16", None, False, True, None, False),
        ("decode", 512, "bfloat16", None, False, True, None, False),
        ("decode", 1024, "bfloat16", None, False, True, None, False),
        ("decode", 1024, "bfloat16", None, True, True, None, False),
        # checks of the matmul stand-in against real float32 compute (unquantized, reduced depth)
        ("encode", 1024, "float32", None, False, True, 3, False),
        ("encode", 1024, "float32", None, False, False, 3, False),
        ("denoise", 512, "float32", None, False, True, 2, False),
        ("denoise", 512, "float32", None, False, False, 2, False),
        # the transformer's own low-memory forward: one block's intermediates at a time, single blocks in halves
        ("denoise", 512, "bfloat16", 4, False, True, None, "low_memory"),
        ("denoise", 1024, "bfloat16", 4, False, True, None, "low_memory"),
    ]
    run_plan(results, "stages", "stage", fields, plan, {"block_eval": False})


def _act(results: dict, **want) -> float | None:
    """The activation peak (bytes) of the run matching `want`, or None."""
    for a in results.get("activations", []):
        if all(a.get(k, False) == v for k, v in want.items()):
            return a["activation_peak"]
    return None


def report(results: dict) -> str:
    """Markdown tables of the measurements (pasted into benchmarks/MEMORY.md)."""
    g = lambda b: "–" if b is None else f"{b / GB:.2f} GB"  # noqa: E731
    lines = [
        "| conversion (16.0 GB bf16 snapshot) | wall | peak MLX memory | max RSS "
        "| transformer | text encoder | VAE | folder |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, label in (("convert_bf16", "bf16"), ("convert_q4", "4-bit g64")):
        c = results.get(key)
        if not c:
            continue

        def size(prefix: str, files: dict = c["files"]) -> int:
            return sum(v for k, v in files.items() if k.startswith(prefix) and k.endswith(".safetensors"))

        lines.append(
            f"| {label} | {c['seconds']:.0f} s | {g(c['peak_memory'])} | {g(c['max_rss'])} | "
            f"{g(size('transformer'))} | {g(size('text_encoder'))} | {g(size('vae'))} | {g(c['total_bytes'])} |"
        )
    lines += ["", "| loaded component | resident (mx.get_active_memory) | load peak | max RSS |", "|---|---|---|---|"]
    for key, label in (("resident_q4", "4-bit"), ("resident_bf16", "bf16")):
        for name, r in results.get(key, {}).items():
            lines.append(
                f"| {name} ({label if name != 'vae' else 'bf16'}) | {g(r['active_memory'])} | "
                f"{g(r['peak_memory'])} | {g(r['max_rss'])} |"
            )

    def stage(**want):
        want.setdefault("block_eval", False)
        for r in results.get("stages", []):
            if all(r.get(k, False if k == "block_eval" else None) == v for k, v in want.items()):
                return r
        return None

    lines += [
        "",
        "| stage (bf16 activations, Metal-like kernels) | weights resident | 256² | 512² | 1024² |",
        "|---|---|---|---|---|",
    ]
    rows = [
        ("1. encode: Qwen3-4B 27 layers 4-bit, 512 tokens", dict(stage="encode", bits=4, dtype="bfloat16")),
        ("2. denoise: transformer 4-bit, one step", dict(stage="denoise", bits=4, dtype="bfloat16", depth=None)),
        ("2. denoise: transformer bf16, one step", dict(stage="denoise", bits=None, dtype="bfloat16", depth=None)),
        (
            "2. denoise: transformer 4-bit, `low_memory=True`",
            dict(stage="denoise", bits=4, dtype="bfloat16", depth=None, block_eval="low_memory"),
        ),
        ("3. decode: VAE bf16, whole image", dict(stage="decode", tiled=False, dtype="bfloat16")),
        ("3. decode: VAE bf16, banded (`tiled=True`)", dict(stage="decode", tiled=True, dtype="bfloat16")),
    ]
    for label, want in rows:
        cells, resident = [], None
        for size in (256, 512, 1024):
            r = stage(size=1024, **want) if want["stage"] == "encode" else stage(size=size, **want)
            resident = resident or (r and r["resident"])
            cells.append("–" if r is None else f"{g(r['stage_peak'])} (+{r['activation_peak'] / GB:.2f})")
        if want["stage"] == "encode":
            cells = [cells[-1], "same", "same"]
        lines.append(f"| {label} | {g(resident)} | {' | '.join(cells)} |")
    lines += ["", "| check: float32, reduced depth | stand-in matmuls | real matmuls |", "|---|---|---|"]
    for label, want in (
        ("encode, 3 layers, 512 tokens", dict(stage="encode", depth=3, dtype="float32")),
        ("denoise 512², 2 + 2 blocks", dict(stage="denoise", depth=2, dtype="float32")),
    ):
        a_, b_ = stage(stand_in_matmul=True, **want), stage(stand_in_matmul=False, **want)
        if a_ and b_:
            lines.append(f"| {label} | +{a_['activation_peak'] / GB:.3f} GB | +{b_['activation_peak'] / GB:.3f} GB |")

    lines += ["", "| float32, real compute (attention stand-in only) | 256² | 512² |", "|---|---|---|"]
    rows = [
        ("encode, 3 layers (6 layers)", dict(stage="encode", width="full")),
        ("denoise, 1+1 / 2+2 / 4+4 blocks", dict(stage="denoise", width="full")),
        ("decode, CPU convs, whole image", dict(stage="decode", width="full", metal_conv=False, tiled=False)),
        ("decode, CPU convs, banded", dict(stage="decode", width="full", metal_conv=False, tiled=True)),
    ]
    for label, want in rows:
        if want["stage"] == "encode":
            a3, a6 = (
                _act(results, size=1024, dtype="float32", depth=3, **want),
                _act(results, size=1024, dtype="float32", depth=6, **want),
            )
            lines.append(f"| {label} | {g(a3)} ({g(a6)}) | |")
        elif want["stage"] == "denoise":
            d = [g(_act(results, size=256, dtype="float32", depth=k, **want)) for k in (1, 2, 4)]
            lines.append(
                f"| {label} | {' / '.join(d)} | {g(_act(results, size=512, dtype='float32', depth=2, **want))} (2+2) |"
            )
        else:
            lines.append(
                f"| {label} | {g(_act(results, size=256, dtype='float32', **want))} | "
                f"{g(_act(results, size=512, dtype='float32', **want))} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["convert", "stages", "activations", "all", "report"], nargs="?", default="all")
    p.add_argument("--work", default="/tmp/klein-memory", help="Scratch folder for the ~30 GB of part 1.")
    p.add_argument("--keep", action="store_true", help="Keep the random source snapshot.")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        job = json.loads(args.child)
        task = job.pop("task")
        fn = {
            "snapshot": lambda dst: make_full_snapshot(Path(dst)),
            "convert": child_convert,
            "resident": child_resident,
            "activation": child_activation,
            "stage": child_stage,
        }[task]
        print(json.dumps(fn(**job)))
        return
    results = load_results()
    if args.part == "report":
        print(report(results))
        return
    if args.part in ("convert", "all"):
        part_convert(Path(args.work), results, args.keep)
    if args.part in ("stages", "all"):
        part_stages(results)
    if args.part in ("activations", "all"):
        part_activations(results)
    save_results(results)
    print(f"results in {RESULTS}")


if __name__ == "__main__":
    main()
