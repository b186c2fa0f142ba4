"""One denoising step: our MLX `FluxKlein` against diffusers' `Flux2Transformer2DModel` (PyTorch).

Same machine, same run, same config, same dtype and the *same* random weights: the diffusers
model is built and randomised first, timed, then its state dict is handed tensor by tensor to
our `sanitize_flux2_klein_weights` and strict loader (each torch tensor is freed as soon as MLX
has its copy, so only one copy of the weights is ever resident: a full klein-4B in float32 is
15.5 GB). Both outputs are compared (max abs diff / max abs of diffusers') so the speed
comparison is between two programs that compute the same thing.

A step is one transformer forward with 512 text tokens + the image tokens, as in the klein
pipelines: diffusers recomputes the RoPE tables and the text projection in every forward, ours
builds them once per image (the pipeline does the same), which is 0.2 % of a step's FLOPs.

    .venv/bin/python benchmarks/bench_step.py --blocks full -W 512 -H 512 --warmup 1 --trials 2
    .venv/bin/python benchmarks/bench_step.py --blocks 1+2 -W 256 -H 256      # a quick look

Torch and MLX both use every core (torch.set_num_threads; MLX's CPU matmuls run in OpenBLAS,
which is preloaded before mlx is imported, as in the root conftest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when a test loads this file
import common  # noqa: E402, F401  (first: this checkout on sys.path, OpenBLAS bound before mlx loads)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import diffusers_transformer_config, randomize_torch_  # noqa: E402

from flux_klein_mlx.bench.command import write_json  # noqa: E402
from flux_klein_mlx.bench.flops import flops_of_transformer, machine_info  # noqa: E402
from flux_klein_mlx.models.flux2.config import FluxKleinParams  # noqa: E402
from flux_klein_mlx.models.flux2.transformer import FluxKlein, sanitize_flux2_klein_weights  # noqa: E402
from flux_klein_mlx.models.rope import image_ids, text_ids  # noqa: E402
from flux_klein_mlx.storage.weights import load_into  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def build_diffusers(params: FluxKleinParams, dtype: str = "float32", seed: int = 0):
    """A randomised diffusers transformer, allocated once (meta device, then filled in place)."""
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**diffusers_transformer_config(params))
    model = model.to_empty(device="cpu")  # uninitialised storage; randomize_torch_ fills every tensor
    randomize_torch_(model, seed)
    if dtype != "float32":
        model = model.to(TORCH_DTYPES[dtype])
    return model.eval()


def _time(fn, warmup: int, trials: int) -> tuple[list[float], object]:
    out = None
    times = []
    for i in range(warmup + trials):
        t0 = time.perf_counter()
        out = fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def _stats(times: list[float], flops: float) -> dict:
    med = statistics.median(times)
    return {"times_s": times, "median_s": med, "min_s": min(times), "max_s": max(times), "gflops": flops / med / 1e9}


def compare_step(
    diffusers_model,
    width: int = 512,
    height: int = 512,
    text_tokens: int = 512,
    dtype: str = "float32",
    warmup: int = 1,
    trials: int = 2,
    seed: int = 0,
    log=print,
) -> dict:
    """Time one step of `diffusers_model` and of our model holding its weights; compare outputs.

    The diffusers model is consumed: its tensors are released while MLX takes its copy, so a
    full-size comparison never holds two copies of the weights.
    """
    params = FluxKleinParams.from_dict(dict(diffusers_model.config))
    h, w = height // 16, width // 16
    rng = np.random.default_rng(seed)
    img = rng.standard_normal((1, h * w, params.in_channels), dtype=np.float32)
    txt = rng.standard_normal((1, text_tokens, params.context_in_dim), dtype=np.float32)
    sigma = 0.7
    t_img_ids, t_txt_ids = np.array(image_ids(h, w)), np.array(text_ids(text_tokens))
    flops = flops_of_transformer(params, width=width, height=height, text_tokens=text_tokens).total

    # diffusers first, then hand its weights over.
    torch.set_num_threads(os.cpu_count() or 1)
    tdt = TORCH_DTYPES[dtype]
    inputs = dict(
        hidden_states=torch.from_numpy(img).to(tdt),
        encoder_hidden_states=torch.from_numpy(txt).to(tdt),
        timestep=torch.tensor([sigma], dtype=tdt),
        img_ids=torch.from_numpy(t_img_ids),
        txt_ids=torch.from_numpy(t_txt_ids),
        return_dict=False,
    )

    def torch_step():
        with torch.inference_mode():
            return diffusers_model(**inputs)[0]

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    log(f"diffusers: {params.describe()}, {width}x{height}, {dtype}, torch threads {torch.get_num_threads()}")
    theirs_times, theirs = _time(torch_step, warmup, trials)
    theirs = theirs.float().numpy()
    log(f"diffusers step: median {statistics.median(theirs_times):.2f} s")

    weights = {}
    for name in list(diffusers_model.state_dict()):
        try:
            p = diffusers_model.get_parameter(name)
        except AttributeError:
            p = diffusers_model.get_buffer(name)
        weights[name] = mx.array(p.detach().float().numpy()).astype(MX_DTYPES[dtype])
        mx.eval(weights[name])
        p.data = torch.empty(0, dtype=p.dtype)  # free the torch copy now: one copy resident at a time
    diffusers_model = None  # drop our reference (`del` would make ruff flag torch_step's use: astral-sh/ruff#9858)
    ours_model = FluxKlein(params)
    load_into(ours_model, sanitize_flux2_klein_weights(weights), "transformer", dtype=MX_DTYPES[dtype])
    del weights
    mx.eval(ours_model.parameters())

    x, ctx = mx.array(img).astype(MX_DTYPES[dtype]), mx.array(txt).astype(MX_DTYPES[dtype])
    t = mx.array([sigma], dtype=MX_DTYPES[dtype])
    # As the pipeline runs a step: RoPE tables and the text projection built once per image.
    rope = ours_model.compute_rope(mx.array(t_txt_ids), mx.array(t_img_ids))
    txt_emb = ours_model.embed_text(ctx)
    mx.eval(rope, txt_emb)

    def mlx_step():
        out = ours_model.forward_with_rope(x, ctx, t, rope, txt_embedded=txt_emb)
        mx.eval(out)
        return out

    ours_times, ours = _time(mlx_step, warmup, trials)
    ours = np.array(ours.astype(mx.float32))
    log(f"MLX step: median {statistics.median(ours_times):.2f} s")
    rel_err = float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-12))
    theirs_s, ours_s = _stats(theirs_times, flops), _stats(ours_times, flops)
    return {
        "config": {
            "hidden": params.hidden_size,
            "double_blocks": params.depth,
            "single_blocks": params.depth_single,
            "width": width,
            "height": height,
            "image_tokens": h * w,
            "text_tokens": text_tokens,
            "dtype": dtype,
            "warmup": warmup,
            "trials": trials,
            "torch_threads": torch.get_num_threads(),
        },
        "tflop_per_step": flops / 1e12,
        "diffusers": theirs_s,
        "mlx": ours_s,
        "ratio_mlx_over_diffusers": ours_s["median_s"] / theirs_s["median_s"],
        "rel_err": rel_err,
        # Other processes on the machine slow both sides; the 1-minute load average says how busy it was.
        "load_average_before_after": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
    }


def _params_for(variant: str, blocks: str) -> FluxKleinParams:
    params = FluxKleinParams.klein_9b() if variant == "klein-9b" else FluxKleinParams.klein_4b()
    if blocks != "full":
        try:
            depth, single = (int(n) for n in blocks.split("+"))
        except ValueError:
            raise SystemExit(f"--blocks must be 'full' or DOUBLE+SINGLE such as 1+4, not {blocks!r}") from None
        params.depth, params.depth_single = depth, single
    return params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("klein-4b", "klein-9b"), default="klein-4b")
    ap.add_argument("--blocks", default="full", help="'full' (4B: 5+20) or DOUBLE+SINGLE, e.g. 1+4")
    ap.add_argument("-W", "--width", type=int, default=512)
    ap.add_argument("-H", "--height", type=int, default=512)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--dtype", choices=tuple(TORCH_DTYPES), default="float32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here (an existing file is kept)")
    args = ap.parse_args(argv)
    if args.width % 16 or args.height % 16:
        raise SystemExit("--width and --height must be multiples of 16")

    params = _params_for(args.variant, args.blocks)
    t0 = time.perf_counter()
    model = build_diffusers(params, args.dtype, args.seed)
    print(f"built and randomised diffusers model in {time.perf_counter() - t0:.1f} s", flush=True)
    result = compare_step(
        model,
        args.width,
        args.height,
        args.text_tokens,
        args.dtype,
        args.warmup,
        args.trials,
        args.seed,
        log=lambda m: print(m, flush=True),
    )
    result["machine"] = machine_info()
    result["versions"] = {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__}
    result["blocks"] = args.blocks
    c, d, m = result["config"], result["diffusers"], result["mlx"]
    print(
        f"\n{args.variant} {c['double_blocks']}+{c['single_blocks']} blocks, {c['width']}x{c['height']} "
        f"({c['image_tokens']} + {c['text_tokens']} tokens), {c['dtype']}, warm-up {c['warmup']}, "
        f"trials {c['trials']}, {result['tflop_per_step']:.3f} TFLOP/step"
    )
    print(f"{'':<10}{'median':>10}{'min':>10}{'max':>10}{'GFLOPS':>9}")
    for name, s in (("diffusers", d), ("MLX", m)):
        print(f"{name:<10}{s['median_s']:>9.2f}s{s['min_s']:>9.2f}s{s['max_s']:>9.2f}s{s['gflops']:>9.0f}")
    print(
        f"ratio MLX / diffusers (median): {result['ratio_mlx_over_diffusers']:.3f}; "
        f"outputs agree to rel err {result['rel_err']:.2e}"
    )
    if args.json:
        final = write_json(result, args.json)  # a new name if the file exists: results are never overwritten
        print(f"wrote {final}" + (f" ({args.json} exists)" if final != Path(args.json) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
