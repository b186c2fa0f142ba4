"""Peak memory of FLUX 3 Image Klein per stage (encode, denoise, decode), on full-size random weights.

Each measurement runs in a fresh process and is the real pipeline on the released model's shapes
(`bench/random_model.random_pipeline` of `models/flux3/config.FLUX3_VARIANTS`): `prepare` (the text
encoder, Qwen3-VL-4B's language tower to layer 32 only, no vision tower, made, run on an 80-token
window, then released), `denoise` (the transformer made and one step run) and `decode` (the VAE), each
stage's MLX peak as the pipeline records it (`Stats`, `mx.get_peak_memory` over the stage: the
components resident and the stage's work). Each component is made just before its stage (random values
drawn with float temporaries that a load from files never holds: those peaks are reported apart); the
4-bit ones layer by layer as a quantizing load makes them, never whole in bfloat16 (random_model.py).
The text encoder is released before the transformer is made, as the pipeline always does.

As in benchmarks/memory.py (FLUX.2's stage rows, same reasons): MLX's CPU backend runs bf16 and 4-bit
matmuls at a few GFLOPS and materialises attention scores, conv unfolds and float32 norm copies that the
Metal kernels of a Mac never make, so a full-size 1024² step cannot run here and its CPU peak is not a
Mac's. The matmuls, attention, convolutions and norms are therefore replaced by memory.py's stand-ins with
the Metal kernels' memory profile (one op, the real inputs, an output-sized allocation, meaningless
values); everything else is the package's own code, scheduled by MLX as is. `--real` runs without the
stand-ins (real compute: float32 and reduced depth only, the check of the stand-ins).

    .venv/bin/python benchmarks/flux3_memory.py stages     # the plan below, one child each (~minutes each)
    .venv/bin/python benchmarks/flux3_memory.py report     # markdown table of benchmarks/flux3_memory.json
    .venv/bin/python benchmarks/flux3_memory.py one --size 512 --bits 4   # one measurement, printed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, memory.py
import common  # noqa: E402, F401  (first: this checkout on sys.path, OpenBLAS bound before mlx loads)

# isort: split
import mlx.core as mx  # noqa: E402
from common import GB, ROOT, max_rss_bytes, run_json_child  # noqa: E402

RESULTS = ROOT / "benchmarks" / "flux3_memory.json"
PROMPT = "a red fox in fresh snow at dawn, soft light, 35 mm photograph"
# (variant, size, dtype, bits, low_memory, then_low_memory): the two targets at 1024² (4-bit <= 6 GB,
# bf16 <= 13 GB), each with and without `--low-memory` (each child makes a full-size model: ~10-15 min here)
PLAN = [
    ("flux3-klein", 1024, "bfloat16", 4, False, False),
    ("flux3-klein", 1024, "bfloat16", 4, True, False),
    ("flux3-klein", 1024, "bfloat16", None, False, True),  # bf16, then the same weights with --low-memory
]


def stand_ins() -> None:
    """memory.py's stand-ins with the Metal kernels' memory profile (its docstring says why and how)."""
    import memory

    memory.emulate_fused_attention()
    memory.emulate_implicit_gemm_conv()
    memory.emulate_fused_norms()
    memory.emulate_matmul_kernels()


def plan_lines(plan) -> list[str]:
    """What the pipeline holds at each stage under `plan` (a MemoryPlan)."""
    release = "released after its stage" if plan.release_models else "kept resident (no --low-memory)"
    return [
        "text encoder: made for the prompt and released before the transformer loads (always)",
        f"transformer: {'block by block' if plan.blockwise else 'whole graph per step'}, {release}",
        f"VAE decode: {'banded' if plan.tiled_decode else 'whole image, unless the machine cannot hold it'}",
    ]


def resident_bytes(pipe, name: str, bits: int | None) -> int:
    """The bytes a component holds once loaded (as the random pipeline makes it), from a lazily built copy:
    shapes and dtypes only, nothing allocated."""
    from mlx.utils import tree_flatten

    from flux_klein_mlx.models.quantize import quantize_model
    from flux_klein_mlx.run.components import build_module

    module = build_module(name, pipe.info.configs[name], pipe.info.family)
    module.set_dtype(pipe.dtype)
    if bits and name != "vae":
        quantize_model(module, bits)
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def child(
    variant: str, size: int, dtype: str, bits: int | None, low_memory: bool, real: bool, blocks, then_low_memory=False
) -> list[dict]:
    """One image of one step through the pipeline; each stage's peak and what was resident. `then_low_memory`
    (after a run without it): the same weights again under `--low-memory`'s plan, the prompt remembered (its
    encode stage is the first run's: the text encoder's work does not depend on the plan), the VAE released
    first so that the denoise stage holds the transformer alone."""
    import dataclasses

    from flux_klein_mlx.bench.random_model import random_pipeline
    from flux_klein_mlx.dtypes import DTYPES
    from flux_klein_mlx.events import MemoryPlan
    from flux_klein_mlx.models.flux3.config import FLUX3_VARIANTS

    if not real:
        stand_ins()
        if bits is None:
            # bf16 matrices of zeros instead of random values: the stand-ins' meaningless outputs grow past bf16's
            # range through 32 unnormalised text layers (the pipeline then stops at its finite check), and
            # memory does not depend on values. (4-bit layers keep their quantized random values: they stay finite.)
            mx.random.normal = lambda shape, dtype=mx.float32, key=None, **kw: mx.zeros(shape, dtype)
    row = FLUX3_VARIANTS[variant]
    if blocks:
        depth, single = (int(b) for b in blocks.split("+"))
        row = dataclasses.replace(
            row, transformer=dataclasses.replace(row.transformer, depth=depth, depth_single=single)
        )
    pipe = random_pipeline(row, dtype=DTYPES[dtype], quantize=bits, low_memory=low_memory)
    made = {}
    settings = dict(width=size, height=size, steps=1, seed=0)

    runs = [run_image(pipe, made, True, PROMPT, **settings)]
    if then_low_memory:
        pipe.release("vae")
        pipe.memory = MemoryPlan.of(True)
        runs.append(run_image(pipe, made, False, PROMPT, **settings))
    rows = [run_row(pipe, r, variant, size, dtype, bits, real, blocks, made) for r in runs]
    rows[-1]["encode_peak"] = rows[0]["encode_peak"]  # (the prompt was remembered by then)
    for r in rows:
        r["peak"] = max(r["encode_peak"], r["denoise_peak"], r["decode_peak"])
    return rows


def make_component(pipe, name: str, made: dict) -> None:
    """Make a component before its stage: the stage's peak is then its weights and its work, not the random
    making's (which draws float temporaries a load from files never holds; reported on its own, in `made`)."""
    mx.reset_peak_memory()
    pipe.component(name)
    made[name] = mx.get_peak_memory()


def run_image(pipe, made: dict, first: bool, prompt, **settings) -> dict:
    """One image through `pipe`'s stages (`prompt`: a prompt with `settings`, or a PreparedInputs alone), each
    component made just before the stage that needs it (the text encoder only for the `first` image)."""
    t0 = time.perf_counter()
    if first:
        make_component(pipe, "text_encoder", made)
    job = pipe.prepare(prompt, **settings)  # encodes, then releases the encoder
    if not pipe.is_loaded("transformer"):
        make_component(pipe, "transformer", made)
    events = list(pipe.denoise(job))
    if not pipe.is_loaded("vae"):
        make_component(pipe, "vae", made)
    out = pipe.decode(job, "np")
    return {
        "job": job,
        "step_seconds": events[-1].seconds,
        "seconds": time.perf_counter() - t0,
        "shape": out.shape,
        "plan": pipe.memory,
    }


def run_row(pipe, r: dict, variant, size, dtype, bits, real, blocks, made) -> dict:
    """One image's row: the stage peaks the pipeline recorded, what each component holds, the plan."""
    from mlx.utils import tree_flatten

    from flux_klein_mlx.run.components import build_module

    encoder = build_module("text_encoder", pipe.info.configs["text_encoder"], pipe.info.family)
    names = [n for n, _ in tree_flatten(encoder.parameters())]
    job, st = r["job"], r["job"].stats
    return {
        "variant": variant,
        "size": size,
        "dtype": dtype,
        "bits": bits,
        "low_memory": r["plan"].release_models,  # the plan this image ran under
        "real": real,
        "blocks": blocks,
        "text_tokens": [c.shape[1] for c in job.ctx],
        "text_layers": len(encoder.model.layers),
        "vision_tensors": sum("visual" in n for n in names),
        "encode_peak": st.encode.peak_memory,
        "denoise_peak": st.denoise.peak_memory,
        "decode_peak": st.decode.peak_memory,
        "weights": {name: resident_bytes(pipe, name, bits) for name in ("text_encoder", "transformer", "vae")},
        "making_peak": dict(made),
        "step_seconds": r["step_seconds"],
        "seconds": r["seconds"],
        "max_rss": max_rss_bytes(),
        "image_shape": list(r["shape"]),
        "plan": plan_lines(r["plan"]),
    }


def run_child(**job) -> list[dict]:
    rows = run_json_child([sys.executable, __file__, "--child", json.dumps(job)], f"flux3 memory {job}")
    rows = rows if isinstance(rows, list) else [rows]
    for row in rows:
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    quant = f"{r['bits']}-bit" if r["bits"] else r["dtype"]
    low = ", --low-memory" if r["low_memory"] else ""
    how = "real compute" if r["real"] else "Metal-like stand-ins"
    return (
        f"{r['variant']} {r['size']}² {quant}{low} ({how}{', blocks ' + r['blocks'] if r['blocks'] else ''}): "
        f"encode {r['encode_peak'] / GB:.2f} GB, denoise {r['denoise_peak'] / GB:.2f} GB, "
        f"decode {r['decode_peak'] / GB:.2f} GB, peak {r['peak'] / GB:.2f} GB"
    )


def report(results: dict) -> str:
    """The markdown table of benchmarks/MEMORY.md (FLUX 3 section)."""
    lines = [
        "| FLUX 3 Image Klein, one step | text encoder | transformer | encode | denoise | decode | peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.get("runs", []):
        w = r["weights"]
        quant = f"`--quantize {r['bits']}`" if r["bits"] else r["dtype"]
        low = " `--low-memory`" if r["low_memory"] else ""
        tf = f"{w['transformer'] / GB:.2f} GB" if "transformer" in w else "(released)"
        lines.append(
            f"| {r['variant']} {r['size']}² {quant}{low} | {w['text_encoder'] / GB:.2f} GB | {tf} | "
            f"{r['encode_peak'] / GB:.2f} GB | {r['denoise_peak'] / GB:.2f} GB | {r['decode_peak'] / GB:.2f} GB | "
            f"**{r['peak'] / GB:.2f} GB** |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["stages", "one", "report"], nargs="?", default="stages")
    p.add_argument("--variant", default="flux3-klein")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bits", type=int, default=None)
    p.add_argument("--low-memory", action="store_true")
    p.add_argument("--real", action="store_true", help="Real compute (no stand-ins): float32, reduced depth.")
    p.add_argument("--blocks", default=None, help="MODE+SINGLE blocks instead of 5+28 (with --real).")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
    if args.part == "report":
        print(report(results))
        return
    if args.part == "one":
        job = dict(variant=args.variant, size=args.size, dtype=args.dtype, bits=args.bits)
        rows = run_child(**job, low_memory=args.low_memory, real=args.real, blocks=args.blocks)
        print("\n".join(rows[-1]["plan"]))
        return
    fields = ("variant", "size", "dtype", "bits", "low_memory")
    done = {tuple(r[f] for f in fields) for r in results["runs"] if not r["real"]}
    for *job, then_low_memory in PLAN:
        wanted = [tuple(job)] + ([(*job[:-1], True)] if then_low_memory else [])
        if not set(wanted) <= done:
            job = dict(zip(fields, job, strict=True), real=False, blocks=None, then_low_memory=then_low_memory)
            results["runs"] += run_child(**job)
            results["machine"] = {"mlx": mx.__version__, "platform": sys.platform}
            RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
