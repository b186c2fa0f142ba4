"""FLUX 3 Image Klein Base: a step with the text and reference modes computed once per image, against
the same step recomputing them every step.

On Base the text and reference tokens sit at time 0 at every step, so their mode blocks give the same
output at every step: `family/flux3/family.Flux3Steps` runs them once per image (`Flux3.early_text`,
`early_references`; the references once for both CFG passes) and each step runs the image's mode
blocks and the joint blocks. The recomputing path is the same `Flux3Steps` with `txt_early` and
`ref_early` set to None, so `forward_with_rope` runs every mode in every pass (as the distilled model
must: its target time changes the text and references every step). Both paths run on the same job (the
pipeline's `prepare`: a reference VAE-encoded, Base's cond and uncond windows), alternating step by
step; their velocities must agree to float rounding before a time means anything.

    .venv/bin/python benchmarks/flux3_base_step.py                       # hidden 768, 5+28 blocks, 256², 1 reference
    .venv/bin/python benchmarks/flux3_base_step.py --hidden 3072 -W 1024 -H 1024 --dtype bfloat16   # a Mac

Random weights (`bench/random_model`); the prompts' embeddings are random (1, 80, 20480) windows (no text
encoder runs). A reduced hidden size keeps the ratio of the work: every block costs the same per token, so
the saving is the share of token-blocks the text and reference modes take (the FLOP count is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py
import common  # noqa: E402, F401  (first: this checkout on sys.path, OpenBLAS bound before mlx loads)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from flux_klein_mlx.bench.flops import denoise_flops, flux3_pass_flops, machine_info  # noqa: E402
from flux_klein_mlx.bench.random_model import random_pipeline  # noqa: E402
from flux_klein_mlx.family import FLUX3  # noqa: E402
from flux_klein_mlx.models.flux3.config import FLUX3_VARIANTS  # noqa: E402
from flux_klein_mlx.run.loading import DTYPES  # noqa: E402

PROMPT = "a red fox in fresh snow at dawn, soft light, 35 mm photograph"


def build(hidden: int, blocks: str, dtype: str, seed: int):
    """The Base pipeline with a transformer of width `hidden` (heads of 128) and MODE+SINGLE blocks."""
    row = FLUX3_VARIANTS["flux3-klein-base"]
    depth, single = (int(b) for b in blocks.split("+"))
    params = dataclasses.replace(
        row.transformer, hidden_size=hidden, num_heads=hidden // 128, depth=depth, depth_single=single
    )
    return random_pipeline(dataclasses.replace(row, transformer=params), dtype=DTYPES[dtype], seed=seed)


def job_for(pipe, width: int, height: int, references: int, steps: int, seed: int):
    """The pipeline's own job: random 80-token windows for the prompt and the negative prompt, references
    of the output size VAE-encoded."""
    C = pipe.info.params.context_in_dim
    for k, prompt in enumerate((PROMPT, "")):
        pipe.remember_prompt(prompt, mx.random.normal((1, 80, C), key=mx.random.key(seed + k)))
    rng = np.random.default_rng(seed)
    images = [Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)) for _ in range(references)]
    return pipe.prepare(PROMPT, width=width, height=height, steps=steps, seed=seed, images=images)


def measure(pipe, job, dtype, rounds: int, warmup: int) -> dict:
    model = pipe.component("transformer")
    t0 = time.perf_counter()
    once = FLUX3.steps(model, job, dtype=dtype, reference_kv=False, low_memory=False)  # evaluates the t = 0 modes
    once_seconds = time.perf_counter() - t0
    every = FLUX3.steps(model, job, dtype=dtype, reference_kv=False, low_memory=False)
    every.txt_early = every.ref_early = None  # forward_with_rope then runs every mode in every pass
    times = {"once": [], "every": []}
    err = 0.0
    for i in range(warmup + rounds):
        out = {}
        for name, steps in (("once", once), ("every", every)) if i % 2 == 0 else (("every", every), ("once", once)):
            t = time.perf_counter()
            out[name] = steps.velocity(job.x, i % len(job.sigmas[:-1]))
            mx.eval(out[name])
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
        a, b = (np.array(out[n].astype(mx.float32)) for n in ("once", "every"))
        err = max(err, float(np.abs(a - b).max() / np.abs(b).max()))
        last = {k: f"{v[-1]:.2f} s" for k, v in times.items() if v and i >= warmup}
        print(
            f"round {i + 1}/{warmup + rounds}{' (warm-up)' if i < warmup else ''}: {last}", file=sys.stderr, flush=True
        )
    return {"times": times, "once_seconds": once_seconds, "rel_err": err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--blocks", default="5+28", help="MODE+SINGLE blocks (released: 5+28)")
    p.add_argument("-W", "--width", type=int, default=256)
    p.add_argument("-H", "--height", type=int, default=256)
    p.add_argument("--references", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    pipe = build(args.hidden, args.blocks, args.dtype, args.seed)
    job = job_for(pipe, args.width, args.height, args.references, args.warmup + args.rounds, args.seed)
    r = measure(pipe, job, DTYPES[args.dtype], args.rounds, args.warmup)
    params, windows = pipe.info.params, [c.shape[1] for c in job.ctx]
    refs = 0 if job.ref_tokens is None else job.ref_tokens.shape[1]
    shapes = dict(image_tokens=int(np.prod(job.grid)), reference_tokens=refs)
    step, once = denoise_flops("flux3", params, text_tokens=windows, **shapes)
    every = sum(part.total for T in windows for part in flux3_pass_flops(params, text_tokens=T, **shapes).values())
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    m = machine_info()
    lines = [
        f"FLUX 3 Image Klein Base, random weights: hidden {params.hidden_size}, {params.depth}+{params.depth_single} "
        f"blocks, {args.width}x{args.height} ({shapes['image_tokens']} image tokens), {args.references} reference(s) "
        f"({refs} tokens), CFG passes with text windows {windows}, {args.dtype}",
        f"{m['cpu']}, {m['cpu_cores']} cores, MLX {m['mlx']} on {m['device']}; {args.rounds} rounds after "
        f"{args.warmup} warm-up, alternating",
        f"once per image (text + reference modes at t = 0): {r['once_seconds']:.2f} s, {once.total / 1e12:.3f} TFLOP",
        f"step, modes once per image:   median {med['once']:.3f} s  ({step.total / 1e12:.3f} TFLOP)",
        f"step, modes recomputed:       median {med['every']:.3f} s  ({every / 1e12:.3f} TFLOP)",
        f"saving per step: {100 * (1 - med['once'] / med['every']):.1f} % measured, "
        f"{100 * (1 - step.total / every):.1f} % by the FLOP count; velocities agree to {r['rel_err']:.1e} (max rel.)",
    ]
    print("\n".join(lines))
    if args.json:
        out = {"args": vars(args), "machine": m, **r, "median": med, "flops": {"step": step.total, "every": every}}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
