"""Is flux_klein_mlx faithful on real weights? Same seed, same prompt, diffusers vs us, stage by stage.

    python benchmarks/check_real_weights.py --model black-forest-labs/FLUX.2-klein-4B

Needs the `test` extra (torch + diffusers). For each case -- text-to-image, a one-reference edit,
image-to-image -- it runs diffusers (float32, on CPU or MPS, CPU generator) and flux_klein_mlx
from the same seed and prompt, and prints how closely the stages agree:

    prompt embeddings   max |ours - theirs| / max |theirs| of the (1, 512, 3*hidden) embeddings
    first velocity      the same for the first step's velocity, (x_1 - x_0) / (sigma_1 - sigma_0)
    final latents       the same for the packed latents after the last step
    image PSNR          10 log10(1 / MSE) of the two float images in [0, 1] (inf = identical)

plus the machine and library versions and each side's wall seconds per case (the first case's
include loading), and writes one PNG per case: diffusers left, ours right.
The edit's reference and img2img's init image are diffusers' text-to-image result, so no input
files are needed. diffusers runs first and is released before our model loads, so only one
model is in memory at a time (klein-4B in float32 needs ~32 GB; use --device mps on a Mac).
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads the script by path
import common  # noqa: E402, F401  (this checkout first on sys.path, OpenBLAS before mlx)

CASES = ("text-to-image", "edit", "img2img")


def machine() -> str:
    import subprocess

    chip = platform.processor() or platform.machine()
    if sys.platform == "darwin":
        try:
            chip = (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
                ).stdout.strip()
                or chip
            )
        except OSError:
            pass
    return f"{platform.system()} {platform.release()} {chip}"


def versions() -> str:
    import diffusers
    import mlx.core as mx
    import torch

    import flux_klein_mlx

    return (
        f"python {platform.python_version()}, mlx {mx.__version__}, torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}, flux_klein_mlx {flux_klein_mlx.__version__}"
    )


def rel(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    if ours.shape != theirs.shape:
        raise SystemExit(f"shape mismatch: ours {ours.shape}, diffusers {theirs.shape}")
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-12))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def side_by_side(left: np.ndarray, right: np.ndarray):
    from PIL import Image

    both = np.concatenate([left, right], axis=1)
    return Image.fromarray(np.round(np.clip(both, 0, 1) * 255).astype(np.uint8))


def to_pil(x: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.round(np.clip(x, 0, 1) * 255).astype(np.uint8))


# ---- diffusers side ------------------------------------------------------------------------------


def run_diffusers(args) -> dict:
    """Every case with diffusers; per case: embeddings, x_0, x_1, final latents, image (numpy)."""
    import torch
    from diffusers import Flux2KleinInpaintPipeline, Flux2KleinPipeline
    from PIL import Image

    device = args.device
    if device == "auto":
        device = "mps" if torch.backends.mps.is_available() else "cpu"
    pipe = Flux2KleinPipeline.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    inpaint = Flux2KleinInpaintPipeline(**pipe.components, is_distilled=bool(pipe.config.is_distilled))
    inpaint.set_progress_bar_config(disable=True)
    out = {"device": device}

    def capture(run, prompt):
        """Run one pipeline call, recording the transformer's first input and every step's latents."""
        seen = {"x0": None, "steps": []}

        def pre_hook(module, a, kw):
            if seen["x0"] is None:
                seen["x0"] = kw["hidden_states"].detach().float().cpu().numpy()

        def on_step(p, i, t, tensors):
            seen["steps"].append(tensors["latents"].detach().float().cpu().numpy())
            return {}

        handle = pipe.transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                image = run(callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"])
                seconds = time.perf_counter() - t0
                emb, _ = pipe.encode_prompt(prompt=prompt, device=device)
        finally:
            handle.remove()
        n = seen["steps"][0].shape[1]  # target tokens; the transformer input also holds references
        return dict(
            emb=emb.float().cpu().numpy(),
            x0=seen["x0"][:, :n],
            x1=seen["steps"][0],
            final=seen["steps"][-1],
            image=image.images[0],
            seconds=seconds,
        )

    def gen():
        return torch.Generator("cpu").manual_seed(args.seed)

    shared = dict(num_inference_steps=args.steps, output_type="np")
    out["text-to-image"] = capture(
        lambda **cb: pipe(prompt=args.prompt, width=args.size, height=args.size, generator=gen(), **shared, **cb),
        args.prompt,
    )
    first = to_pil(out["text-to-image"]["image"])
    out["reference"] = first
    if "edit" in args.cases:
        out["edit"] = capture(
            lambda **cb: pipe(prompt=args.edit_prompt, image=[first], generator=gen(), **shared, **cb), args.edit_prompt
        )
    if "img2img" in args.cases:
        white = Image.new("L", first.size, 255)  # img2img = the inpaint pipeline with an all-white mask
        out["img2img"] = capture(
            lambda **cb: inpaint(
                prompt=args.edit_prompt,
                image=first,
                mask_image=white,
                strength=args.strength,
                generator=gen(),
                **shared,
                **cb,
            ),
            args.edit_prompt,
        )
    # Release diffusers before our model loads. Rebinding (not `del`) clears the cells the closures above
    # share just the same, without ruff's false F821 on their uses (astral-sh/ruff#9858).
    pipe = inpaint = None
    gc.collect()
    return out


# ---- our side ------------------------------------------------------------------------------------


def run_ours(args, reference) -> dict:
    import mlx.core as mx

    import flux_klein_mlx

    pipe = flux_klein_mlx.load(args.model, dtype=args.dtype)
    out = {}

    def capture(prompt, **kw):
        t0 = time.perf_counter()
        job = pipe.prepare(prompt, seed=args.seed, steps=args.steps, **kw)
        x0 = np.array(job.x.astype(mx.float32))
        x1 = None
        for _ in pipe.denoise(job):
            if x1 is None:
                x1 = np.array(job.x.astype(mx.float32))
        image = pipe.decode(job, "np")
        emb = np.array(pipe.encode_prompts([prompt]).astype(mx.float32))
        return dict(
            emb=emb,
            x0=x0,
            x1=x1,
            final=np.array(job.x.astype(mx.float32)),
            image=image,
            seconds=time.perf_counter() - t0,
            job=job,
        )

    out["text-to-image"] = capture(args.prompt, width=args.size, height=args.size)
    if "edit" in args.cases:
        out["edit"] = capture(args.edit_prompt, images=[reference])
    if "img2img" in args.cases:
        out["img2img"] = capture(args.edit_prompt, init_image=reference, strength=args.strength)
    return out


def first_sigma_step(job) -> float:
    """sigma_1 - sigma_0 of the steps that run (our schedule equals diffusers', tests/test_sampler.py)."""
    return job.sigmas[1] - job.sigmas[0]


def compare(args) -> tuple[list[dict], str]:
    theirs = run_diffusers(args)
    ours = run_ours(args, theirs["reference"])
    rows = []
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in [c for c in CASES if c in ours]:
        a, b = ours[case], theirs[case]
        dsig = first_sigma_step(a["job"])  # the first velocity: (x_1 - x_0) / (sigma_1 - sigma_0)
        v_ours, v_theirs = (a["x1"] - a["x0"]) / dsig, (b["x1"] - b["x0"]) / dsig
        row = dict(
            case=case,
            embeddings=rel(a["emb"], b["emb"]),
            velocity=rel(v_ours, v_theirs),
            latents=rel(a["final"], b["final"]),
            psnr=psnr(a["image"], b["image"]),
            ours_s=a["seconds"],
            theirs_s=b["seconds"],
            size=a["image"].shape[1::-1],
        )
        path = out_dir / f"{case}.png"
        side_by_side(b["image"], a["image"]).save(path)
        row["png"] = str(path)
        rows.append(row)
    return rows, theirs["device"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face repo id or local diffusers folder of a klein model")
    p.add_argument("--prompt", default="a red fox sitting in fresh snow, morning light, photograph")
    p.add_argument("--edit-prompt", default="turn it into a watercolor painting")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--size", type=int, default=512, help="text-to-image width and height (px, multiple of 16)")
    p.add_argument("--steps", type=int, default=None, help="[default: the model's, 4 distilled / 50 Base]")
    p.add_argument("--strength", type=float, default=0.6, help="img2img strength")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--device", choices=["auto", "cpu", "mps"], default="auto", help="where diffusers runs")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="our dtype")
    p.add_argument("--output-dir", default="check_real_weights", help="side-by-side PNGs (diffusers | ours)")
    args = p.parse_args(argv)
    if args.steps is None:
        import flux_klein_mlx

        args.steps = flux_klein_mlx.load(args.model, dtype="float32").info.default_steps
    rows, device = compare(args)
    print(f"model {args.model}, seed {args.seed}, {args.steps} steps; diffusers float32 on {device}, ours {args.dtype}")
    print(f"machine: {machine()}")
    print(f"versions: {versions()}")
    print("relative error = max|ours - diffusers| / max|diffusers|")
    header = (
        f"{'case':<14} {'size':>9} {'embeddings':>11} {'velocity 1':>11} {'latents':>11} {'PSNR dB':>8} "
        f"{'ours s':>7} {'diffusers s':>11}"
    )
    print(header)
    for r in rows:
        size = f"{r['size'][0]}x{r['size'][1]}"
        print(
            f"{r['case']:<14} {size:>9} {r['embeddings']:>11.2e} {r['velocity']:>11.2e} {r['latents']:>11.2e} "
            f"{r['psnr']:>8.1f} {r['ours_s']:>7.1f} {r['theirs_s']:>11.1f}"
        )
    for r in rows:
        print(f"wrote {r['png']} (left diffusers, right flux_klein_mlx)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
