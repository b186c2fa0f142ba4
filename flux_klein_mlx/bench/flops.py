"""Arithmetic about the models and the machine: parameter counts, an analytic FLOP model
(`docs/performance.md#the-flop-model`) and a table of chip peaks, so that benchmarks can report
achieved TFLOPS and % of peak. Used by the `benchmark` command and the scripts in `benchmarks/`.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .. import __version__, preload_openblas
from ..models.flux2.config import FluxKleinParams
from ..models.rope import token_grid


def count_parameters(params: FluxKleinParams) -> int:
    """Parameter count from the hyper-parameters alone (no allocation)."""
    D = params.hidden_size
    M = params.mlp_hidden
    hd = params.head_dim
    C = params.in_channels
    embed = D * C + D * params.context_in_dim + D * params.time_channels + D * D
    modulation = (6 + 6 + 3) * D * D
    # qkv, proj, MLP up (2M) and down, per stream, plus two QK-norm scales per stream
    double = 2 * (3 * D * D + D * D + 2 * M * D + M * D + 2 * hd)
    single = (3 * D + 2 * M) * D + (D + M) * D + 2 * hd
    final = 2 * D * D + C * D
    return embed + modulation + params.depth * double + params.depth_single * single + final


# --- FLOP model (performance.md section 4). 1 multiply-add = 2 FLOPs, batch 1. ----------------


@dataclass(frozen=True, kw_only=True)
class Flops:
    """FLOPs of one stage, by kind. `other` = transformer embeddings and output projection."""

    linear: float
    attention: float
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.other

    def __add__(self, other: Flops) -> Flops:
        return Flops(
            linear=self.linear + other.linear,
            attention=self.attention + other.attention,
            other=self.other + other.other,
        )


NO_FLOPS = Flops(linear=0.0, attention=0.0)


def transformer_step_flops(
    *,
    hidden: int,
    depth: int,
    depth_single: int,
    image_tokens: int,
    text_tokens: int = 512,
    mlp_ratio: float = 3.0,
    context_dim: int = 7680,
    in_channels: int = 128,
    reference_tokens: int = 0,
    cached_references: bool = False,
) -> Flops:
    """FLOPs of one transformer forward (one denoising step of distilled klein, no CFG).

    The attention count does not depend on the number of heads (H·hd = hidden). The text
    projection (`context_embedder`) is counted in every step, as in performance.md, although
    the pipeline hoists it out of the loop (0.07 % of a 4B step at 1024²). `reference_tokens`
    join the sequence; with `cached_references` (klein 9B-KV) they are only extra keys/values.
    """
    D = hidden
    F = int(hidden * mlp_ratio)
    N = image_tokens
    T = text_tokens
    R = reference_tokens
    Lq = N + T + (0 if cached_references else R)  # tokens that run through the blocks
    Lk = N + T + R  # keys every query sees
    # Double block, per stream: q, k, v, o (4·D²) and the SwiGLU MLP D -> 2F -> D (3·D·F).
    double = (4 * D * D + 3 * D * F) * Lq
    # Single block on the joint sequence: fused qkv+mlp_in D -> 3D+2F, out (D+F) -> D.
    single = (D * (3 * D + 2 * F) + (D + F) * D) * Lq
    linear = 2 * (depth * double + depth_single * single)
    attention = (depth + depth_single) * 4 * Lq * Lk * D  # QK^T and AV, bidirectional
    other = 2 * D * (2 * (Lq - T) * in_channels + T * context_dim)  # image tokens in and out, text tokens in
    return Flops(linear=float(linear), attention=float(attention), other=float(other))


def lora_training_flops(forward: Flops, adapter_forward: float = 0.0, checkpoint: bool = False) -> Flops:
    """FLOPs of one LoRA training step (batch 1) from those of its forward pass.

    The backward pass of a LoRA step computes input gradients through every frozen layer (1x the
    forward's linear FLOPs; frozen weights need no weight gradients), attention's backward costs
    twice its forward (dQ, dK, dV and dP), and the adapters' own backward twice theirs
    (`adapter_forward`: their forward FLOPs). Gradient checkpointing recomputes the forward once.
    So a step is ~2x a forward, ~3x with checkpointing.
    """
    k = 3 if checkpoint else 2  # forward, input gradients (and the recomputed forward)
    return Flops(
        linear=forward.linear * k + adapter_forward * (k + 1),
        attention=forward.attention * (k + 1),
        other=forward.other * k,
    )


def reference_pass_flops(params: FluxKleinParams, reference_tokens: int) -> Flops:
    """FLOPs of klein 9B-KV's reference pass (`FluxKlein.reference_kv`): the reference tokens
    alone through every block, attending only to themselves (counted whole; MLX skips the last
    block's MLP, 1-2 % of it)."""
    R = reference_tokens
    f = klein_step_flops(params, image_tokens=R, text_tokens=0)
    return Flops(
        linear=f.linear, attention=f.attention, other=2.0 * R * params.in_channels * params.hidden_size
    )  # input projection only


def flops_of_text_encoder(config, layers: int = 27, tokens: int = 512) -> Flops:
    """FLOPs of the Qwen3 prompt encoder (a `Qwen3Config`): `layers` decoder layers (27 for klein) on `tokens`."""
    hidden = config.hidden_size
    intermediate = config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_token = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * intermediate
    linear = 2 * per_token * tokens * layers
    attention = 2 * tokens * tokens * q * layers  # causal: half of the 4·T²·(H·hd) full count
    return Flops(linear=float(linear), attention=float(attention))


def flops_of_vae_decoder(config, width: int, height: int) -> Flops:
    """FLOPs of the FLUX.2 VAE decoder (an `AutoEncoderConfig`, its decoder's channels where they differ)
    producing a width×height image (convs + mid attention)."""
    block_out_channels = tuple(getattr(config, "decoder_block_out_channels", None) or config.block_out_channels)
    layers_per_block = config.layers_per_block
    latent_channels = config.latent_channels
    down = 2 ** (len(block_out_channels) - 1)
    h, w = height // down, width // down

    def conv(h, w, *, cin, cout, k=3):
        return 2 * h * w * cin * cout * k * k

    def resblock(h, w, cin, cout):
        return (
            conv(h, w, cin=cin, cout=cout)
            + conv(h, w, cin=cout, cout=cout)
            + (conv(h, w, cin=cin, cout=cout, k=1) if cin != cout else 0)
        )

    c = block_out_channels[-1]
    linear = conv(h, w, cin=latent_channels, cout=latent_channels, k=1) + conv(h, w, cin=latent_channels, cout=c)
    # Mid block: resnet, single-head attention over h·w tokens (q, k, v, out are 1x1), resnet.
    linear += 2 * resblock(h, w, c, c) + 2 * h * w * 4 * c * c
    attention = 4 * (h * w) ** 2 * c
    for i, cout in enumerate(reversed(block_out_channels)):
        for _ in range(layers_per_block + 1):
            linear += resblock(h, w, c, cout)
            c = cout
        if i < len(block_out_channels) - 1:
            h, w = 2 * h, 2 * w  # nearest upsample, then a 3x3 conv at the new size
            linear += conv(h, w, cin=c, cout=c)
    linear += conv(h, w, cin=c, cout=3)
    return Flops(linear=float(linear), attention=float(attention))


def flops_of_transformer(
    params,
    *,
    width: int,
    height: int,
    text_tokens: int = 512,
    reference_tokens: int = 0,
    cached_references: bool = False,
) -> Flops:
    """`transformer_step_flops` for a `FluxKleinParams` at a width×height image."""
    return klein_step_flops(
        params,
        image_tokens=math.prod(token_grid(width, height)),
        text_tokens=text_tokens,
        reference_tokens=reference_tokens,
        cached_references=cached_references,
    )


def klein_step_flops(params, *, image_tokens: int, text_tokens: int, **references) -> Flops:
    """`transformer_step_flops` with the sizes of a `FluxKleinParams` (`references`: reference_tokens,
    cached_references)."""
    return transformer_step_flops(
        hidden=params.hidden_size,
        depth=params.depth,
        depth_single=params.depth_single,
        image_tokens=image_tokens,
        text_tokens=text_tokens,
        mlp_ratio=params.mlp_ratio,
        context_dim=params.context_in_dim,
        in_channels=params.in_channels,
        **references,
    )


# --- FLUX 3 Image Klein (docs/performance.md#flux-3-image-klein) ----------------------------------------


def flux3_stack_flops(params, tokens: int, in_dim: int, depth: int) -> Flops:
    """`tokens` tokens of one kind through an input layer `in_dim` -> D (`other`; 0: none) and `depth` FLUX 3
    blocks in which they attend only among themselves. A block runs q, k, v, out (4·D²) and the SwiGLU MLP
    D -> 2M -> D (3·D·M) on every token; attention 4·L²·D (scores and weighted sum)."""
    D, M, L = params.hidden_size, params.mlp_hidden, tokens
    return Flops(
        linear=float(2 * depth * (4 * D * D + 3 * D * M) * L),
        attention=float(depth * 4 * L * L * D),
        other=float(2 * L * in_dim * D),
    )


def flux3_pass_flops(params, *, image_tokens: int, text_tokens: int, reference_tokens: int = 0) -> dict[str, Flops]:
    """One FLUX 3 transformer pass (batch 1) by part: "image" (emb_in.image, the image's mode blocks, the
    `depth_single` joint blocks over [text, image, references] and the output layer D -> in on the image tokens
    only), "text" (txt_in and the text mode blocks), "references" (emb_in.image_cond and their mode blocks).
    The per-sample time embedders and modulation heads (a few (1, D) x (D, 3D) products) are left out."""
    N, T, R = image_tokens, text_tokens, reference_tokens
    joint = flux3_stack_flops(params, T + N + R, 0, params.depth_single)
    image = flux3_stack_flops(params, N, params.in_channels, params.depth) + joint
    return {
        "image": image + Flops(linear=0.0, attention=0.0, other=2.0 * N * params.hidden_size * params.in_channels),
        "text": flux3_stack_flops(params, T, params.context_in_dim, params.depth),
        "references": flux3_stack_flops(params, R, params.cond_in_channels, params.depth) if R else NO_FLOPS,
    }


def flux3_denoise_flops(
    params, *, image_tokens: int, text_tokens: Sequence[int], reference_tokens: int = 0, cached_references=False
) -> tuple[Flops, Flops]:
    """(a step, once per image) of FLUX 3 with one pass per prompt window in `text_tokens` (Base's CFG: cond
    and uncond, each its own length). The distilled flow map runs every part in every pass (its target time
    changes the text and references every step). Base runs its text and reference mode blocks once per image,
    at t = 0 (family/flux3/family.Flux3Steps): each prompt's text once, the references once for both passes.
    FLUX 3 has no reference K/V cache (`cached_references` is always False)."""
    step = once = NO_FLOPS
    for n, T in enumerate(text_tokens):
        parts = flux3_pass_flops(params, image_tokens=image_tokens, text_tokens=T, reference_tokens=reference_tokens)
        if params.flow_map:
            step = step + parts["image"] + parts["text"] + parts["references"]
        else:
            step, once = step + parts["image"], once + parts["text"] + (parts["references"] if n == 0 else NO_FLOPS)
    return step, once


def flux2_denoise_flops(
    params, *, image_tokens: int, text_tokens: Sequence[int], reference_tokens: int = 0, cached_references=False
) -> tuple[Flops, Flops]:
    """(a step, once per image) of FLUX.2: one forward per prompt window (CFG: a batch of 2 windows of 512);
    klein 9B-KV with references runs its reference pass once per image."""
    step = NO_FLOPS
    for T in text_tokens:
        step = step + klein_step_flops(
            params,
            image_tokens=image_tokens,
            text_tokens=T,
            reference_tokens=reference_tokens,
            cached_references=cached_references,
        )
    once = reference_pass_flops(params, reference_tokens) if cached_references and reference_tokens else NO_FLOPS
    return step, once


# Each family's count of its denoising stage, by `Family.key`: the one place bench/ tells families apart.
DENOISE_FLOPS = {"flux2": flux2_denoise_flops, "flux3": flux3_denoise_flops}


def denoise_flops(family_key: str, params, **shapes) -> tuple[Flops, Flops]:
    """(a step, once per image) of a model of family `family_key` (see `flux2_denoise_flops`)."""
    return DENOISE_FLOPS[family_key](params, **shapes)


# --- Chip peaks (performance.md section 3: huggingface.js hardware.ts, Apple bandwidth figures). ---
# Apple GPUs up to M4 run fp16 at the fp32 rate and bf16 at most at that rate, so this one number
# is the peak for every dtype we run. M5 chips add GPU neural accelerators whose matmul peak is
# unpublished: their % of peak counts the shader ALUs only and may exceed 100.

# (name, GPU cores, peak TFLOPS fp16 = fp32, memory bandwidth GB/s), one generation per line
APPLE_CHIPS: tuple[tuple[str, int, float, int], ...] = (
    ("M1", 8, 2.6, 68),
    ("M1 Pro", 16, 5.2, 200),
    ("M1 Max", 32, 10.4, 400),
    ("M1 Ultra", 64, 21.0, 800),
    ("M2", 10, 3.6, 100),
    ("M2 Pro", 19, 6.8, 200),
    ("M2 Max", 38, 13.6, 400),
    ("M2 Ultra", 76, 27.2, 800),
    ("M3", 10, 4.1, 100),
    ("M3 Pro", 18, 7.4, 150),
    ("M3 Max", 40, 14.2, 400),
    ("M3 Ultra", 80, 28.4, 819),
    ("M4", 10, 4.6, 120),
    ("M4 Pro", 20, 9.2, 273),
    ("M4 Max", 40, 18.4, 546),
    ("M5", 10, 5.7, 153),
    ("M5 Max", 40, 22.8, 614),
)

# For the lower-bound table only (MLX also runs on CUDA); dense bf16 tensor-core peaks.
OTHER_ACCELERATORS: tuple[tuple[str, float, int], ...] = (
    ("H100 SXM", 989.0, 3350),
    ("H100 PCIe", 756.0, 2000),
    ("H200", 989.0, 4800),
)


def chip_peak_tflops(chip: str | None, gpu_cores: int | None = None) -> float | None:
    """Peak TFLOPS of an Apple chip ("Apple M3 Max" or "M3 Max"); None when unknown.

    A binned part (fewer GPU cores than the table's configuration, e.g. the 30-core M3 Max)
    scales linearly with the core count.
    """
    name = re.sub(r"^Apple\s+", "", (chip or "").strip())
    for entry, cores, tflops, _ in APPLE_CHIPS:
        if entry == name:
            return tflops * gpu_cores / cores if gpu_cores else tflops
    return None


def _command_output(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _apple_gpu_cores() -> int | None:
    m = re.search(r"Total Number of Cores:\s*(\d+)", _command_output(["system_profiler", "SPDisplaysDataType"]))
    if not m:
        m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', _command_output(["ioreg", "-rc", "AGXAccelerator"]))
    return int(m.group(1)) if m else None


def machine_info() -> dict:
    """What ran the benchmark: chip, cores, memory, OS, library versions, peak TFLOPS if known."""
    info = {
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "?"),
        "flux_klein_mlx": __version__,
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        **dict.fromkeys(("memory_gb", "chip", "gpu_cores", "peak_tflops")),  # filled in below where known
    }
    with contextlib.suppress(ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    if sys.platform == "darwin":
        brand = _command_output(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
        info["cpu"] = brand or info["cpu"]
        if brand.startswith("Apple M"):
            info["chip"] = brand
            info["gpu_cores"] = _apple_gpu_cores()
    elif sys.platform == "linux":
        info["blas"] = preload_openblas()  # says which BLAS is mapped (mlx is imported by now)
        with contextlib.suppress(OSError):
            m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
            info["cpu"] = m.group(1).strip() if m else info["cpu"]
    # The table holds GPU peaks; a CPU run (Linux, or a Mac forced onto the CPU) gets no percentage.
    if mx.default_device() == mx.gpu:
        info["peak_tflops"] = chip_peak_tflops(info["chip"], info["gpu_cores"])
    return info
