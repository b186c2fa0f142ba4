"""klein 9B-KV: a cached denoising step against an uncached klein-9B step with the same references.

One process, one set of random weights with klein-9B's widths (hidden 4096, 32 heads, Qwen3-8B text
width) and a reduced, stated number of blocks, the same target and reference latents:

- uncached: klein-9B's step, the reference tokens appended to the target tokens every step
  (`forward_with_rope` on [target ; refs], what the plain klein pipeline runs at every step);
- KV extract: the KV variant's first step, the reference pass (`reference_kv`) plus a cached step;
- KV cached: every later step, target tokens only, attending to the cached reference K/V.

The ratio cached / uncached is what the KV variant saves on steps 2..n. A step's cost scales with
its blocks, so the per-block ratio carries over to the full 8 + 24 blocks up to the (unchanged)
embedding and final layers.

    .venv/bin/python benchmarks/kv_step.py --blocks 1+1 -W 512 -H 512 --warmup 1 --trials 2

The three are timed in turn within every round, so the load of a shared machine weighs on all alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when a test loads this file
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import common  # noqa: E402, F401  (this checkout first on sys.path, OpenBLAS preloaded)
import mlx.core as mx  # noqa: E402

from flux_klein_mlx.bench.flops import flops_of_transformer, machine_info, reference_pass_flops  # noqa: E402
from flux_klein_mlx.bench.random_model import randomize  # noqa: E402
from flux_klein_mlx.models.flux2.config import FluxKleinParams  # noqa: E402
from flux_klein_mlx.models.flux2.transformer import FluxKlein  # noqa: E402
from flux_klein_mlx.models.rope import image_ids, text_ids  # noqa: E402

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
TEXT_TOKENS = 512  # the pipelines always pad prompts to 512 tokens


def step_tflop(params, width: int, height: int, refs: int) -> dict:
    """TFLOP in the blocks of the three kinds of step, from the package's FLOP model
    (`flux_klein_mlx.bench.flops`); the embeddings are left out (the text projection is hoisted here)."""
    r = refs * (width // 16) * (height // 16)

    def blocks(f):
        return (f.linear + f.attention) / 1e12

    uncached = blocks(
        flops_of_transformer(params, width=width, height=height, text_tokens=TEXT_TOKENS, reference_tokens=r)
    )
    cached = blocks(
        flops_of_transformer(
            params, width=width, height=height, text_tokens=TEXT_TOKENS, reference_tokens=r, cached_references=True
        )
    )
    return {"uncached": uncached, "cached": cached, "extract": cached + blocks(reference_pass_flops(params, r))}


def _time_interleaved(fns: dict, warmup: int, trials: int) -> dict[str, list[float]]:
    """Wall times of each fn, run in turn within every round (a shared machine's load then weighs
    on all of them alike); the first `warmup` rounds are discarded."""
    times = {name: [] for name in fns}
    for i in range(warmup + trials):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _stats(times: list[float]) -> dict:
    return {
        "times_s": [round(t, 4) for t in times],
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
    }


def kv_step(blocks=(1, 1), width=256, height=256, refs=1, dtype="float32", warmup=1, trials=3, seed=0, log=print):
    """Time the three kinds of step on one random model; return the results and the ratio."""
    depth, depth_single = blocks
    params = dataclasses.replace(FluxKleinParams.klein_9b(), depth=depth, depth_single=depth_single)
    dt = DTYPES[dtype]
    model = FluxKlein(params)
    randomize(model, dt, seed)
    h, w = height // 16, width // 16
    key = mx.random.key(seed + 1)
    k1, k2, k3 = mx.random.split(key, 3)
    x = mx.random.normal((1, h * w, params.in_channels), key=k1).astype(dt)  # target tokens
    ref = mx.random.normal((1, refs * h * w, params.in_channels), key=k2).astype(dt)  # refs of the target's size
    ctx = mx.random.normal((1, TEXT_TOKENS, params.context_in_dim), key=k3).astype(dt)
    ref_ids = mx.concatenate([image_ids(h, w, t=10 * (k + 1)) for k in range(refs)], axis=0)
    txt = model.embed_text(ctx)
    rope_plain = model.compute_rope(text_ids(TEXT_TOKENS), mx.concatenate([image_ids(h, w), ref_ids], axis=0))
    rope_kv = model.compute_rope(text_ids(TEXT_TOKENS), image_ids(h, w))
    mx.eval(txt, rope_plain, rope_kv)
    t = mx.array([0.7], dtype=dt)
    log(
        f"kv_step: hidden {params.hidden_size}, {depth} double + {depth_single} single blocks, {width}x{height}, "
        f"{refs} reference(s) of {h * w} tokens, {TEXT_TOKENS} text tokens, {dtype}"
    )

    def uncached():
        v = model.forward_with_rope(mx.concatenate([x, ref], axis=1), ctx, t, rope_plain, txt_embedded=txt)
        return v[:, : h * w]

    cache = model.reference_kv(ref, ref_ids)
    mx.eval(cache.arrays())

    def extract():
        c = model.reference_kv(ref, ref_ids)
        return model.forward_with_rope(x, ctx, t, rope_kv, txt_embedded=txt, reference_kv=c)

    def cached():
        return model.forward_with_rope(x, ctx, t, rope_kv, txt_embedded=txt, reference_kv=cache)

    fns = {"uncached_klein_9b": uncached, "kv_extract": extract, "kv_cached": cached}
    times = _time_interleaved(fns, warmup, trials)
    results = {name: _stats(t) for name, t in times.items()}
    # Paired within each round (same load): the steadier estimate on a shared machine.
    paired = [c / u for c, u in zip(times["kv_cached"], times["uncached_klein_9b"], strict=True)]
    for name, r in results.items():
        log(f"{name}: median {r['median_s']:.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f})")
    ratio = results["kv_cached"]["median_s"] / results["uncached_klein_9b"]["median_s"]
    flop = step_tflop(params, width, height, refs)
    full = step_tflop(FluxKleinParams.klein_9b(), 1024, 1024, 1)
    log(
        f"ratio cached / uncached: {ratio:.3f} (medians), {statistics.median(paired):.3f} (median of the "
        f"per-round ratios {', '.join(f'{r:.3f}' for r in paired)}), "
        f"{flop['cached'] / flop['uncached']:.3f} by FLOP count; "
        f"full klein-9B at 1024^2 with one 1024^2 reference by FLOP count: {full['cached'] / full['uncached']:.3f} "
        f"(extract step {full['extract'] / full['uncached']:.3f})"
    )
    return {
        "benchmark": "klein 9B-KV cached step vs klein-9B uncached step",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "config": {
            "hidden": params.hidden_size,
            "double_blocks": depth,
            "single_blocks": depth_single,
            "width": width,
            "height": height,
            "references": refs,
            "reference_tokens": refs * h * w,
            "image_tokens": h * w,
            "text_tokens": TEXT_TOKENS,
            "dtype": dtype,
            "warmup": warmup,
            "trials": trials,
            "cache_bytes": cache.nbytes,
        },
        "steps": results,
        "tflop": flop,
        "tflop_klein_9b_1024_one_reference": full,
        "ratio_cached_over_uncached": ratio,
        "ratio_cached_over_uncached_paired": paired,
        "ratio_cached_over_uncached_paired_median": statistics.median(paired),
        "ratio_extract_over_uncached": results["kv_extract"]["median_s"] / results["uncached_klein_9b"]["median_s"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="1+1", help="DOUBLE+SINGLE blocks (klein-9B has 8+24)")
    ap.add_argument("-W", "--width", type=int, default=256)
    ap.add_argument("-H", "--height", type=int, default=256)
    ap.add_argument("--refs", type=int, default=1, help="references, each of the target's size")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        blocks = tuple(int(b) for b in a.blocks.split("+"))
        assert len(blocks) == 2 and min(blocks) >= 0 and sum(blocks) > 0
    except (ValueError, AssertionError):
        ap.error(f"--blocks must be DOUBLE+SINGLE, e.g. 1+1 or 8+24, not {a.blocks!r}")
    if a.width % 16 or a.height % 16 or a.refs < 1 or a.trials < 1:
        ap.error("width and height must be multiples of 16; --refs and --trials at least 1")
    out = kv_step(blocks, a.width, a.height, a.refs, a.dtype, a.warmup, a.trials)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
