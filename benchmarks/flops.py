"""The analytic FLOP model of FLUX.2 [klein] and FLUX 3 Image Klein, and the lower bounds it implies, per chip.

The formulas live in the package (`flux_klein_mlx.bench.flops`, which the `benchmark` command
uses to turn seconds into TFLOPS and % of peak); this module re-exports them and, when run,
prints the tables of docs/performance.md#the-flop-model from the model presets:

    .venv/bin/python benchmarks/flops.py

Conventions: 1 multiply-add = 2 FLOPs, batch 1, one transformer forward per step (distilled
klein, no CFG), 512 text tokens, image tokens = (W/16)·(H/16). Lower bound = FLOPs / peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when a test loads this file
import common  # noqa: E402,F401  (this checkout on sys.path)

from flux_klein_mlx.bench.flops import (  # noqa: E402,F401  (re-exported)
    APPLE_CHIPS,
    OTHER_ACCELERATORS,
    Flops,
    chip_peak_tflops,
    count_parameters,  # noqa: E402
    denoise_flops,
    flops_of_text_encoder,
    flops_of_transformer,
    flops_of_vae_decoder,
    transformer_step_flops,
)
from flux_klein_mlx.family import FLUX3  # noqa: E402
from flux_klein_mlx.models.config import AutoEncoderConfig  # noqa: E402
from flux_klein_mlx.models.flux2.config import FluxKleinParams, qwen3_4b, qwen3_8b  # noqa: E402
from flux_klein_mlx.models.flux3.config import FLUX3_VARIANTS  # noqa: E402

SIZES = (1024, 512)


def variants() -> dict:
    """klein-4B and klein-9B: (transformer params, text encoder config)."""
    return {"klein-4B": (FluxKleinParams.klein_4b(), qwen3_4b()), "klein-9B": (FluxKleinParams.klein_9b(), qwen3_8b())}


def image_flops(params, qwen, size: int, steps: int = 4) -> dict:
    """FLOPs (TFLOP) of each stage of one size×size image, and the total."""
    step = flops_of_transformer(params, width=size, height=size)
    text = flops_of_text_encoder(qwen, layers=27)
    vae = flops_of_vae_decoder(AutoEncoderConfig.flux2(), size, size)
    return {
        "step": step.total / 1e12,
        "step_linear": step.linear / 1e12,
        "step_attention": step.attention / 1e12,
        "text_encoder": text.total / 1e12,
        "vae_decode": vae.total / 1e12,
        "vae_attention": vae.attention / 1e12,
        "image": (steps * step.total + text.total + vae.total) / 1e12,
    }


def tables() -> str:
    out = []
    out.append("FLOPs per step (TFLOP), 512 text tokens")
    out.append(
        f"{'':<10}{'size':>6}{'params':>10}{'linear':>9}{'attention':>11}{'step':>8}{'4 steps':>9}"
        f"{'encoder':>9}{'VAE dec':>9}{'image':>8}"
    )
    flops = {}
    for name, (params, qwen) in variants().items():
        for size in SIZES:
            f = flops[name, size] = image_flops(params, qwen, size)
            out.append(
                f"{name:<10}{size:>5}²{count_parameters(params) / 1e9:>9.3f}B{f['step_linear']:>9.2f}"
                f"{f['step_attention']:>11.2f}{f['step']:>8.2f}{4 * f['step']:>9.1f}{f['text_encoder']:>9.2f}"
                f"{f['vae_decode']:>9.2f}{f['image']:>8.1f}"
            )
    out.append("")
    out.append("Lower bounds at 100 % of peak (per step / per 4-step image incl. encoder and decoder)")
    cols = [("klein-4B", 1024), ("klein-4B", 512), ("klein-9B", 1024), ("klein-9B", 512)]
    heads = "".join(f"{n[6:] + ' ' + str(s) + '² step':>17}{'image':>9}" for n, s in cols)
    out.append(f"{'chip':<18}{'TFLOPS':>7}" + heads)

    def fmt(seconds: float) -> str:
        return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"

    chips = [(f"{n} ({c}c)", chip_peak_tflops(n, c)) for n, c, _, _ in APPLE_CHIPS]
    chips += [(n, t) for n, t, _ in OTHER_ACCELERATORS]
    for label, peak in chips:
        row = f"{label:<18}{peak:>7.1f}"
        for key in cols:
            f = flops[key]
            row += f"{fmt(f['step'] / peak):>17}{fmt(f['image'] / peak):>9}"
        out.append(row)
    out.append("M5 rows count the shader ALUs only (GPU neural accelerators unpublished): measure first.")
    return "\n".join(out)


def flux3_image_flops(variant: str, size: int, references: int = 0, text_tokens: int = 80) -> dict:
    """FLUX 3 Image Klein: FLOPs (TFLOP) of one size×size image with `references` references of the same size,
    a prompt in one `text_tokens` window (Base: its negative prompt in another), at the default steps."""
    row = FLUX3_VARIANTS[variant]
    tokens = (size // 16) ** 2
    windows = [text_tokens] * (1 if row.distilled else 2)
    step, once = denoise_flops(
        "flux3", row.transformer, image_tokens=tokens, text_tokens=windows, reference_tokens=references * tokens
    )
    text = flops_of_text_encoder(row.text_encoder, layers=max(FLUX3.text_taps), tokens=text_tokens)
    vae = flops_of_vae_decoder(row.vae, size, size)
    return {
        "step": step.total / 1e12,
        "step_linear": step.linear / 1e12,
        "step_attention": step.attention / 1e12,
        "once_per_image": once.total / 1e12,
        "steps": row.steps,
        "text_encoder": len(windows) * text.total / 1e12,
        "vae_decode": vae.total / 1e12,
        "image": (row.steps * step.total + once.total + len(windows) * text.total + vae.total) / 1e12,
    }


def flux3_tables() -> str:
    out = ["FLUX 3 Image Klein (TFLOP), 80-token prompt windows (Base: cond + uncond passes), default steps"]
    out.append(
        f"{'':<18}{'size':>6}{'refs':>5}{'linear':>9}{'attention':>11}{'step':>8}{'once/img':>10}{'steps':>6}"
        f"{'encoder':>9}{'VAE dec':>9}{'image':>8}"
    )
    for variant in FLUX3_VARIANTS:
        for size in SIZES:
            for refs in (0, 1):
                f = flux3_image_flops(variant, size, refs)
                out.append(
                    f"{variant:<18}{size:>5}²{refs:>5}{f['step_linear']:>9.2f}{f['step_attention']:>11.2f}"
                    f"{f['step']:>8.2f}{f['once_per_image']:>10.2f}{f['steps']:>6}{f['text_encoder']:>9.3f}"
                    f"{f['vae_decode']:>9.2f}{f['image']:>8.1f}"
                )
    return "\n".join(out)


if __name__ == "__main__":
    print(tables())
    print()
    print(flux3_tables())
