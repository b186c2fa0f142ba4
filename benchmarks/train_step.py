"""Seconds and peak memory of a LoRA training step for FLUX.2 [klein] 4B Base (full widths, random weights);
`flux3` does the same for FLUX 3 Image Klein Base (its family's call and 160 text tokens, LoRA on every block
but the reference mode's, fitted to 5 blocks per mode + 28 single blocks).

Every step here is the trainer's own code: `flow_loss` under `nn.value_and_grad` (with
`forward_with_rope(checkpoint=...)` for `--low-memory`), then `optimizer_step` (clip to 1.0, AdamW),
on a transformer with rank-16 adapters on every block Linear (`attach_lora`, targets `all`), 512 text
tokens, batch 1.

Part 1, `speed`: real float32 compute on this machine (MLX's CPU backend runs bf16 and 4-bit matmuls
at a few GFLOPS, so only float32 times mean anything here), klein-4B's widths with 1 double + 1 single
block: the forward pass alone, a training step, and a step with gradient checkpointing. The step's FLOPs
come from `flops.lora_training_flops` (a LoRA backward computes input gradients only: ~2x a forward,
~3x with checkpointing); the measured step / forward ratio is the check of that model, and the time of
the full 5 + 20 blocks is the measured time scaled by the FLOP model.

Part 2, `memory`: the peak memory of a step with everything a run holds: the frozen weights (zeros of
the real shapes, bf16 or 4-bit g64), the float32 adapters with their gradients and AdamW moments, the
activations. As in `memory.py`, matmuls and norms are output-only stand-ins with the memory profile of
Metal's kernels (`emulate_matmul_kernels`, `emulate_fused_norms`). Attention is different in training:
MLX on Metal runs it unfused when it traces gradients ("It's faster for training on Metal to use the
unfused SDPA for both forward and backward", MLX 0.32 `ScaledDotProductAttention::use_fallback`; the
fused VJP is not implemented on Metal), so its (heads, L, L) scores and probabilities exist and the
probabilities are kept for the backward. The stand-in (`emulate_unfused_training_attention`) is that
graph with its two matmuls output-only: the (B, H, L, L) arrays and their gradients are real. Each
configuration is measured at 1+1, 2+1 and 1+2 blocks in fresh processes and fitted exactly with
peak = a + b * double + c * single, which gives klein-4B's 5 + 20; where the machine allows, the full
depth is measured too (the `full` rows), as a check of the fit.

    .venv/bin/python benchmarks/train_step.py speed --size 512 --trials 2
    .venv/bin/python benchmarks/train_step.py memory [--full]
    .venv/bin/python benchmarks/train_step.py multires      # --resolution 256,512: a step at each size
    .venv/bin/python benchmarks/train_step.py lokr          # --adapter lokr beside LoRA: time, parameters, peak
    .venv/bin/python benchmarks/train_step.py flux3         # FLUX 3 Image Klein Base: issue 37's targets
    .venv/bin/python benchmarks/train_step.py report
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, memory.py
import common  # noqa: E402, F401  (first: this checkout on sys.path, OpenBLAS bound before mlx loads)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from common import GB, ROOT, run_json_child  # noqa: E402

from flux_klein_mlx.bench.flops import APPLE_CHIPS, flops_of_transformer, lora_training_flops, machine_info  # noqa: E402
from flux_klein_mlx.models.flux2.config import FluxKleinParams  # noqa: E402

RESULTS = ROOT / "benchmarks" / "train_step.json"
RANK = 16
TEXT = 512


def params_for(depth: int, depth_single: int, family: str = "flux2"):
    """klein-4B's widths (FLUX.2), or FLUX 3 Image Klein Base's (`depth` blocks per mode) at the given depths."""
    if family == "flux3":
        from flux_klein_mlx.models.flux3.config import Flux3Params

        return Flux3Params(depth=depth, depth_single=depth_single)
    return FluxKleinParams(depth=depth, depth_single=depth_single)  # klein-4B widths


def adapter_flops(slots, image_tokens: int, text_tokens: int = TEXT) -> float:
    """Forward FLOPs of the adapters: 2 r (in + out) per token through each adapted module."""
    total = 0.0
    for s in slots:
        tokens = text_tokens if ".add_" in s.name or "to_add_out" in s.name or "ff_context" in s.name else image_tokens
        tokens = image_tokens + text_tokens if s.name.startswith("single_") else tokens
        total += 2.0 * tokens * RANK * (s.in_dims + s.out_dims)
    return total


def step_flops(params: FluxKleinParams, size: int, checkpoint: bool) -> tuple[float, float]:
    """(forward FLOPs, training-step FLOPs) of `params` at size x size, rank-16 adapters on every block Linear."""
    from flux_klein_mlx.train.step.adapters import parse_targets

    fwd = flops_of_transformer(params, width=size, height=size)
    lora = adapter_flops(parse_targets("all", params), (size // 16) ** 2)
    fwd_total = fwd.total + lora
    return fwd_total, lora_training_flops(fwd, lora, checkpoint).total


class Setup:
    """A transformer with adapters, its optimizer and one batch, built as the trainer builds them."""

    def __init__(self, params, size: int, dtype, bits: int | None, random_weights: bool, adapter: str = "lora"):
        from mlx.utils import tree_map

        from flux_klein_mlx.bench.random_model import randomize
        from flux_klein_mlx.family import family_of
        from flux_klein_mlx.models.quantize import quantize_model
        from flux_klein_mlx.train.settings import TrainSettings
        from flux_klein_mlx.train.step.adapters import attach_lokr, attach_lora, parse_targets
        from flux_klein_mlx.train.step.optimizers import make_optimizer

        self.family = family_of(params)  # FLUX 3: its planned text window, its own call (family/)
        model = self.family.build_transformer(params)
        if random_weights:
            randomize(model, dtype, seed=0)
        else:  # zeros of the real shapes: memory as real weights, nothing computed
            model.update(tree_map(lambda a: mx.zeros(a.shape, dtype), model.parameters()))
        if bits:
            quantize_model(model, bits)
        mx.eval(model.parameters())
        self.model, self.params, self.dtype = model, params, dtype
        slots, rng = parse_targets("all", params, references=False), np.random.default_rng(0)
        if adapter == "lokr":  # LyCORIS' LoKr on every block Linear, factor -1 (the trainer's default)
            self.lora = attach_lokr(model, slots, params=params, rank=RANK, alpha=float(RANK), factor=-1, rng=rng)
        else:
            self.lora = attach_lora(model, slots, rank=RANK, alpha=float(RANK), rng=rng)
        self.optimizer = make_optimizer(TrainSettings(lr=1e-4))
        self.set_size(size)

    def set_size(self, size: int) -> None:
        """The batch of one size x size image (a run with several resolutions changes it between steps)."""
        model, params, dtype = self.model, self.params, self.dtype
        h = w = size // 16
        text = self.family.planned_text_tokens  # FLUX.2: 512 (TEXT); FLUX 3: two caption windows
        g = np.random.default_rng(1)
        self.x0 = mx.array(g.standard_normal((1, h * w, params.in_channels)).astype(np.float32)).astype(dtype)
        self.noise = mx.array(g.standard_normal((1, h * w, params.in_channels)).astype(np.float32))
        self.ctx = mx.array(g.standard_normal((1, text, params.context_in_dim)).astype(np.float32)).astype(dtype)
        self.sigma = mx.array([0.7], dtype=mx.float32)
        self.rope = self.family.training_rope(model, (h, w), 0, text)
        mx.eval(model.trainable_parameters(), self.x0, self.noise, self.ctx, self.rope)

    def forward(self):
        x = self.x0.astype(mx.float32)
        return self.family.training_velocity(
            self.model, x, self.ctx, sigma=self.sigma, rope=self.rope, refs=None, checkpoint=False
        )

    def step(self, checkpoint: bool):
        from flux_klein_mlx.train.step.objective import flow_loss, optimizer_step

        def loss():
            return flow_loss(
                self.model, self.x0, self.noise, sigma=self.sigma, ctx=self.ctx, rope=self.rope, checkpoint=checkpoint
            )

        value, grads = nn.value_and_grad(self.model, loss)()
        norm = optimizer_step(self.optimizer, self.model, grads, 1.0)
        return value, norm, self.model.trainable_parameters(), self.optimizer.state


def _timed(fn, warmup: int, trials: int) -> list[float]:
    times = []
    for i in range(warmup + trials):
        t0 = time.perf_counter()
        mx.eval(fn())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def child_speed(
    size: int,
    depth: int,
    depth_single: int,
    warmup: int,
    trials: int,
    dtype: str = "float32",
    bits: int | None = None,
    adapter: str = "lora",
    family: str = "flux2",
) -> dict:
    """Real compute (random weights): forward, step, step with checkpointing (interleaved trials)."""
    params = params_for(depth, depth_single, family)
    s = Setup(params, size, getattr(mx, dtype), bits, random_weights=True, adapter=adapter)
    runs = {"forward": s.forward, "step": lambda: s.step(False), "step_checkpoint": lambda: s.step(True)}
    times = {k: [] for k in runs}
    for fn in runs.values():  # warm-up (and the optimizer's state allocated) before any timed trial
        _timed(fn, warmup, 0)
    for _ in range(trials):
        for k, fn in runs.items():
            times[k] += _timed(fn, 0, 1)
    if family == "flux2":  # the FLOP model (bench/flops) is FLUX.2's
        fwd, step = step_flops(params, size, False)
        _, step_ckpt = step_flops(params, size, True)
    else:
        fwd = step = step_ckpt = None
    return {
        "family": family,
        "size": size,
        "depth": depth,
        "depth_single": depth_single,
        "dtype": dtype,
        "bits": bits,
        "times": times,
        "flops": {"forward": fwd, "step": step, "step_checkpoint": step_ckpt},
        "trainable": s.lora.num_parameters,
        "adapter": adapter,
    }


def emulate_unfused_training_attention() -> None:
    """Attention as MLX on Metal runs it under `mx.grad` (unfused, see the module docstring):
    scores = q kᵀ (B, H, L, Lk), probabilities = softmax(scores) (kept for the backward), out = p v.
    The two matmuls are output-only stand-ins whose backward allocates what a matmul's backward does
    (dP = dO vᵀ is (B, H, L, Lk); dq, dk, dv are their inputs' sizes); the softmax and its backward
    are MLX's own. So every (B, H, L, Lk) array of the real graph exists, and no other."""

    @mx.custom_function
    def qk(q, k):  # (B, H, L, hd), (B, H, Lk, hd) -> (B, H, L, Lk)
        return mx.broadcast_to(q[..., :1], (*q.shape[:3], k.shape[2])) * k[:, :, None, :, 0]

    @qk.vjp
    def qk_vjp(primals, d_scores, _):
        q, k = primals
        dq = d_scores[..., :1] * k[:, :, :1, :]  # (B, H, L, hd), as dS @ k
        dk = d_scores[:, :, :1, :].swapaxes(-1, -2) * q[:, :, :1, :]  # (B, H, Lk, hd), as dSᵀ @ q
        return dq, dk

    @mx.custom_function
    def pv(p, v):  # (B, H, L, Lk), (B, H, Lk, hd) -> (B, H, L, hd)
        return p[..., :1] * v[:, :, :1, :]

    @pv.vjp
    def pv_vjp(primals, d_out, _):
        p, v = primals
        dp = d_out[..., :1] * v[:, :, None, :, 0]  # (B, H, L, Lk), as dO @ vᵀ
        dv = p[:, :, :1, :].swapaxes(-1, -2) * d_out[:, :, :1, :]  # (B, H, Lk, hd), as pᵀ @ dO
        return dp, dv

    def unfused(q, k, v, *, scale, mask=None, **kw):
        p = mx.softmax(qk(q * scale, k), axis=-1, precise=True)
        return pv(p, v)

    mx.fast.scaled_dot_product_attention = unfused


def child_memory_multires(
    sizes: list[int], dtype: str, bits: int | None, checkpoint: bool, depth: int, depth_single: int
) -> dict:
    """A run with several resolutions (`--resolution 256,512`): one model, a step at each size in turn
    (a batch never mixes sizes), the peak of each step and of them all, with the stand-ins of `child_memory`."""
    from memory import emulate_fused_norms, emulate_matmul_kernels

    emulate_matmul_kernels()
    emulate_fused_norms()
    emulate_unfused_training_attention()
    s = Setup(params_for(depth, depth_single), sizes[0], getattr(mx, dtype), bits, random_weights=False)
    s.optimizer.init(s.model.trainable_parameters())
    mx.eval(s.optimizer.state)
    mx.synchronize()
    mx.clear_cache()
    resident = mx.get_active_memory()
    peaks = []
    for size in sizes + sizes[::-1]:  # up and down again: what one size leaves behind must not add to the next
        s.set_size(size)
        mx.reset_peak_memory()
        mx.eval(s.step(checkpoint))
        peaks.append(mx.get_peak_memory())
    return {
        "sizes": sizes,
        "dtype": dtype,
        "bits": bits,
        "checkpoint": checkpoint,
        "depth": depth,
        "depth_single": depth_single,
        "resident": resident,
        "peaks": peaks,
        "peak": max(peaks),
    }


def child_memory(
    size: int,
    dtype: str,
    bits: int | None,
    checkpoint: bool,
    depth: int,
    depth_single: int,
    adapter: str = "lora",
    family: str = "flux2",
) -> dict:
    """Peak memory of a training step with Metal-like stand-ins (the AdamW moments allocated first, as after step 1)."""
    from memory import emulate_fused_norms, emulate_matmul_kernels

    emulate_matmul_kernels()
    emulate_fused_norms()
    emulate_unfused_training_attention()
    dt = getattr(mx, dtype)
    s = Setup(params_for(depth, depth_single, family), size, dt, bits, random_weights=False, adapter=adapter)
    s.optimizer.init(s.model.trainable_parameters())  # the AdamW moments, as after the first step
    mx.eval(s.optimizer.state)
    mx.synchronize()
    mx.clear_cache()
    resident = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    mx.eval(s.step(checkpoint))
    return {
        "size": size,
        "dtype": dtype,
        "bits": bits,
        "checkpoint": checkpoint,
        "depth": depth,
        "depth_single": depth_single,
        "resident": resident,
        "peak": mx.get_peak_memory(),
        "trainable": s.lora.num_parameters,
        "seconds": time.perf_counter() - t0,
        "adapter": adapter,
    }


# --- driver -------------------------------------------------------------------------------------------


def run_child(task: str, **kwargs) -> dict:
    t0 = time.perf_counter()
    result = run_json_child(
        [sys.executable, __file__, "--child", json.dumps({"task": task, **kwargs})], f"{task} {kwargs}"
    )
    result["wall"] = time.perf_counter() - t0
    print(f"  {task} {kwargs}: {json.dumps(result)[:300]}", flush=True)
    return result


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def save_results(results: dict) -> None:
    results["machine"] = machine_info()  # OS, CPU, MLX, and on Linux which BLAS the timings ran on
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


# (size, dtype, bits, checkpointing). Without checkpointing at 1024² every block keeps its (24, L, L)
# probabilities (L = 4608: 1.02 GB each in bf16), > 25 GB for 25 blocks: not measured, bounded in the report.
MEMORY_CONFIGS = [
    (512, "bfloat16", None, False),
    (512, "bfloat16", None, True),
    (512, "bfloat16", 4, False),
    (512, "bfloat16", 4, True),
    (1024, "bfloat16", None, True),
    (1024, "bfloat16", 4, True),
]
DEPTHS = [(1, 1), (2, 1), (1, 2)]
FULL_DEPTH = [(512, "bfloat16", 4, True), (512, "bfloat16", None, True)]  # measured whole, as a check of the fit


def part_memory(results: dict, full: bool) -> None:
    rows = results.setdefault("memory", [])
    key = lambda r: (r["size"], r["dtype"], r["bits"], r["checkpoint"], r["depth"], r["depth_single"])  # noqa: E731
    done = {key(r) for r in rows if r.get("adapter", "lora") == "lora"}
    plan = [(*c, d, s) for c in MEMORY_CONFIGS for d, s in DEPTHS]
    if full:
        plan = [(*c, 5, 20) for c in FULL_DEPTH] + plan
    for job in plan:
        if job not in done:
            size, dtype, bits, ckpt, d, s = job
            rows.append(
                run_child("memory", size=size, dtype=dtype, bits=bits, checkpoint=ckpt, depth=d, depth_single=s)
            )
            save_results(results)


# FLUX 3 Image Klein Base: the two targets (512² 4-bit and 1024² bf16, both --low-memory), fitted over
# DEPTHS as klein-4B's (a "double" here is one block of each of the three modes) to its 5 + 28 blocks.
FLUX3_MEMORY = [(512, "bfloat16", 4, True), (1024, "bfloat16", None, True)]


def part_flux3(results: dict) -> None:
    """FLUX 3's rows: the step / forward time ratio at 512² (float32, 1 + 1 blocks) and the two targets' memory."""
    rows = results.setdefault("flux3_memory", [])
    key = lambda r: (r["size"], r["dtype"], r["bits"], r["checkpoint"], r["depth"], r["depth_single"])  # noqa: E731
    done = {key(r) for r in rows}
    for size, dtype, bits, ckpt in FLUX3_MEMORY:
        for d, single in DEPTHS:
            if (size, dtype, bits, ckpt, d, single) not in done:
                job = dict(size=size, dtype=dtype, bits=bits, checkpoint=ckpt, depth=d, depth_single=single)
                rows.append(run_child("memory", family="flux3", **job))
                save_results(results)
    if "flux3_speed" not in results:
        results["flux3_speed"] = run_child(
            "speed", size=512, depth=1, depth_single=1, warmup=1, trials=3, family="flux3"
        )
        save_results(results)


def flux3_report(results: dict) -> list[str]:
    """The FLUX 3 lines of the report (nothing when `flux3` has not run)."""
    lines = []
    fit = {"memory": results.get("flux3_memory", [])}
    for size, dtype, bits, ckpt in FLUX3_MEMORY:
        got = fitted_peak(fit, size, dtype, bits, ckpt, depth=5, depth_single=28)
        if got is not None:
            what = f"{size}², {'4-bit' if bits else dtype}{', --low-memory' if ckpt else ''}"
            lines.append(
                f"FLUX 3 Base {what}: {got[0] / GB:.2f} GB peak (fitted to 5 + 28 blocks), "
                f"{got[1] / GB:.2f} GB resident"
            )
    speed = results.get("flux3_speed")
    if speed:
        t = {k: statistics.median(v) for k, v in speed["times"].items()}
        lines.append(
            f"FLUX 3 Base 512² float32, 1 block per mode + 1 single: forward {t['forward']:.2f} s, step "
            f"{t['step'] / t['forward']:.2f}x, with checkpointing {t['step_checkpoint'] / t['forward']:.2f}x"
        )
    return lines


MULTIRES = ([256, 512], "bfloat16", 4, True)  # small sizes: measurable on this machine in minutes


def part_multires(results: dict) -> None:
    """The multi-resolution rows at 1+1, 2+1, 1+2 blocks (fitted to full depth as the others)."""
    rows = results.setdefault("memory_multires", [])
    sizes, dtype, bits, ckpt = MULTIRES
    for d, s in DEPTHS:
        if not any(
            (r["sizes"], r["bits"], r["checkpoint"], r["depth"], r["depth_single"]) == (sizes, bits, ckpt, d, s)
            for r in rows
        ):
            rows.append(
                run_child(
                    "memory_multires", sizes=sizes, dtype=dtype, bits=bits, checkpoint=ckpt, depth=d, depth_single=s
                )
            )
            save_results(results)


LOKR_MEMORY = (512, "bfloat16", 4, True)  # the small-Mac configuration
LOKR_SPEED = (512, 1, 1)  # size, double + single blocks (float32: the only meaningful times on a CPU)


def part_lokr(results: dict) -> None:
    """LoKr (factor -1, rank 16, every block Linear) beside LoRA: the step's time at 1+1 blocks (both
    measured now, interleaved in one session) and its peak memory at 1+1, 2+1, 1+2 blocks."""
    size, d, s = LOKR_SPEED
    results["speed"] = [r for r in results.get("speed", []) if r.get("lokr_pair") is None]
    for adapter in ("lora", "lokr"):
        row = run_child("speed", size=size, depth=d, depth_single=s, warmup=1, trials=2, adapter=adapter)
        results["speed"].append({**row, "lokr_pair": True})
    rows = results.setdefault("memory", [])
    size, dtype, bits, ckpt = LOKR_MEMORY
    for d, s in DEPTHS:
        if not any(
            (r["size"], r["bits"], r["checkpoint"], r["depth"], r["depth_single"], r.get("adapter"))
            == (size, bits, ckpt, d, s, "lokr")
            for r in rows
        ):
            rows.append(
                run_child(
                    "memory",
                    size=size,
                    dtype=dtype,
                    bits=bits,
                    checkpoint=ckpt,
                    depth=d,
                    depth_single=s,
                    adapter="lokr",
                )
            )
    save_results(results)


def lokr_report(results: dict) -> list[str]:
    """LoKr against LoRA: trainable parameters, the step's time (same session), the fitted peak."""
    pair = {r["adapter"]: r for r in results.get("speed", []) if r.get("lokr_pair")}
    lokr = fitted_peak(results, *LOKR_MEMORY, adapter="lokr")
    lora = fitted_peak(results, *LOKR_MEMORY)
    if len(pair) < 2 or lokr is None:
        return []
    step = {a: statistics.median(r["times"]["step"]) for a, r in pair.items()}
    size, dtype, bits, ckpt = LOKR_MEMORY
    lines = [
        "",
        "| adapter (rank 16, every block Linear, klein-4B) | trainable parameters (5 + 20 blocks) | "
        f"step, {LOKR_SPEED[1]} + {LOKR_SPEED[2]} blocks, {LOKR_SPEED[0]}², float32 (this machine) | "
        f"peak, {size}², 4-bit, --low-memory, fitted to 5 + 20 |",
        "|---|---|---|---|",
    ]
    for adapter, peak in (("lora", lora), ("lokr", lokr)):
        lines.append(
            f"| {adapter} | {trainable(adapter) / 1e6:.2f} M | {step[adapter]:.2f} s | "
            f"{'–' if peak is None else f'{peak[0] / GB:.2f} GB'} |"
        )
    return lines


def trainable(adapter: str) -> int:
    """Trained values of rank-16 adapters on every block Linear of klein-4B (5 + 20 blocks), from the shapes."""
    from flux_klein_mlx.train.step.adapters import adapter_file_shapes, parse_targets

    params = params_for(5, 20)
    slots = parse_targets("all", params)
    shapes = adapter_file_shapes(slots, params, adapter=adapter, rank=RANK)
    return sum(math.prod(shape) for name, shape in shapes.items() if not name.endswith(".alpha"))


def multires_report(results: dict) -> list[str]:
    """The multi-resolution row: its fitted full-depth peak against the largest size's own."""
    sizes, dtype, bits, ckpt = MULTIRES
    pts = {(r["depth"], r["depth_single"]): r for r in results.get("memory_multires", [])}
    if not all(d in pts for d in DEPTHS):
        return []
    a11, a21, a12 = (pts[d]["peak"] for d in DEPTHS)
    full = a11 + (a21 - a11) * 4 + (a12 - a11) * 19
    single = fitted_peak(results, max(sizes), dtype, bits, ckpt)
    label = f"{','.join(map(str, sizes))}, {'4-bit' if bits else 'bf16'}{', --low-memory' if ckpt else ''}"
    same = f"{single[0] / GB:.2f} GB at {max(sizes)}² alone" if single else "–"
    return [f"| --resolution {label} (steps at each size, up and down) | | {full / GB:.2f} GB | {same} | – |"]


def fitted_peak(
    results: dict, size, dtype, bits, ckpt, depth=5, depth_single=20, adapter="lora"
) -> tuple[float, float] | None:
    """(peak, resident) at `depth` + `depth_single` blocks from the exact fit over DEPTHS (None if missing)."""
    pts = {
        (r["depth"], r["depth_single"]): r
        for r in results.get("memory", [])
        if (r["size"], r["dtype"], r["bits"], r["checkpoint"], r.get("adapter", "lora"))
        == (size, dtype, bits, ckpt, adapter)
    }
    if not all(d in pts for d in DEPTHS):
        return None
    out = []
    for field in ("peak", "resident"):
        a11, a21, a12 = (pts[d][field] for d in DEPTHS)
        b, c = a21 - a11, a12 - a11  # per double block, per single block
        out.append(a11 + b * (depth - 1) + c * (depth_single - 1))
    return out[0], out[1]


def report(results: dict) -> str:
    g = lambda b: "–" if b is None else f"{b / GB:.2f} GB"  # noqa: E731
    lines = [
        "| size | blocks measured | forward | step | step, checkpointing | step / forward | checkpointing / forward "
        "| step GFLOPS | full 5 + 20 blocks: step (checkpointing), scaled | TFLOP per step (checkpointing) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("speed", []):
        if r.get("adapter", "lora") != "lora":  # LoKr's: lokr_report
            continue
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        f = r["flops"]
        full_fwd, full_step = step_flops(params_for(5, 20), r["size"], False)
        _, full_ckpt = step_flops(params_for(5, 20), r["size"], True)

        def scale(key, full_flops, med=med, f=f):
            return med[key] * full_flops / f[key]

        def spread(key, med=med, r=r):
            return f"{med[key]:.1f} s ({min(r['times'][key]):.1f}–{max(r['times'][key]):.1f})"

        kind = r.get("dtype", "float32") + (f", {r['bits']}-bit" if r.get("bits") else "")
        lines.append(
            f"| {r['size']}², {kind} | {r['depth']} + {r['depth_single']} | {spread('forward')} | {spread('step')} | "
            f"{spread('step_checkpoint')} | "
            f"{med['step'] / med['forward']:.2f} (FLOPs {f['step'] / f['forward']:.2f}) | "
            f"{med['step_checkpoint'] / med['forward']:.2f} (FLOPs {f['step_checkpoint'] / f['forward']:.2f}) | "
            f"{f['step'] / med['step'] / 1e9:.0f} | "
            f"{scale('step', full_step):.0f} s ({scale('step_checkpoint', full_ckpt):.0f} s) | "
            f"{full_step / 1e12:.1f} ({full_ckpt / 1e12:.1f}) |"
        )
    lines += [
        "",
        "| klein-4B step, rank 16 on all block Linears, at 100 % of the GPU's peak | TFLOP | M1 | M2 Pro | M3 Max "
        "| M4 Max |",
        "|---|---|---|---|---|---|",
    ]
    peaks = {name: tflops for name, _, tflops, _ in APPLE_CHIPS}
    for size in (512, 1024):
        for ckpt in (False, True):
            flops = step_flops(params_for(5, 20), size, ckpt)[1]
            cells = " | ".join(f"{flops / (peaks[c] * 1e12):.2f} s" for c in ("M1", "M2 Pro", "M3 Max", "M4 Max"))
            lines.append(f"| {size}²{', checkpointing' if ckpt else ''} | {flops / 1e12:.1f} | {cells} |")
    lines += [
        "",
        "| klein-4B Base, rank 16 on every block Linear | resident (weights + adapters + AdamW) | peak, fitted "
        "| peak, measured at full depth | target |",
        "|---|---|---|---|---|",
    ]
    targets = {(512, 4, True): 6 * GB, (1024, None, True): 16 * GB}
    for size, dtype, bits, ckpt in MEMORY_CONFIGS:
        fit = fitted_peak(results, size, dtype, bits, ckpt)
        full = next(
            (
                r
                for r in results.get("memory", [])
                if (
                    r["size"],
                    r["dtype"],
                    r["bits"],
                    r["checkpoint"],
                    r["depth"],
                    r["depth_single"],
                    r.get("adapter", "lora"),
                )
                == (size, dtype, bits, ckpt, 5, 20, "lora")
            ),
            None,
        )
        label = f"{size}², {'4-bit' if bits else 'bf16'}{', --low-memory' if ckpt else ''}"
        target = targets.get((size, bits, ckpt))
        peak = full["peak"] if full else (fit[0] if fit else None)
        verdict = (
            "–"
            if target is None or peak is None
            else f"≤ {target / GB:.0f} GB: " + ("met" if peak <= target else "missed")
        )
        lines.append(
            f"| {label} | {g(fit and fit[1])} | {g(fit and fit[0])} | {g(full and full['peak'])} | {verdict} |"
        )
    lines += multires_report(results)
    probs = 25 * 24 * ((1024 // 16) ** 2 + TEXT) ** 2 * 2  # 25 blocks x 24 heads x L x L, bf16
    lines.append(
        f"| 1024², no checkpointing | | each block keeps its attention probabilities: > {probs / GB:.1f} GB "
        "of them alone | not measured | – |"
    )
    lines += lokr_report(results)
    lines += flux3_report(results)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ["speed", "memory", "multires", "lokr", "flux3", "report"]
    p.add_argument("part", choices=parts, nargs="?", default="report")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--blocks", default="1+1", help="double+single blocks of the speed measurement")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="speed: weights and activations"
    )
    p.add_argument("--quantize", type=int, default=None, choices=[4, 8], help="speed: quantize the frozen weights")
    p.add_argument("--full", action="store_true", help="memory: also measure the full depth where it fits")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        job = json.loads(args.child)
        fn = {"speed": child_speed, "memory": child_memory, "memory_multires": child_memory_multires}[job.pop("task")]
        print(json.dumps(fn(**job)))
        return
    results = load_results()
    if args.part == "speed":
        d, s = (int(x) for x in args.blocks.split("+"))
        row = run_child(
            "speed",
            size=args.size,
            depth=d,
            depth_single=s,
            warmup=args.warmup,
            trials=args.trials,
            dtype=args.dtype,
            bits=args.quantize,
        )

        def same(r):
            key = (r["size"], r["depth"], r["depth_single"], r.get("dtype", "float32"), r.get("bits"))
            return key == (args.size, d, s, args.dtype, args.quantize)

        results["speed"] = [r for r in results.get("speed", []) if not same(r)]
        results["speed"].append(row)
        save_results(results)
    elif args.part == "memory":
        part_memory(results, args.full)
    elif args.part == "multires":
        part_multires(results)
    elif args.part == "lokr":
        part_lokr(results)
    elif args.part == "flux3":
        part_flux3(results)
    print(report(results))


if __name__ == "__main__":
    main()
