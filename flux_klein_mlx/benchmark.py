"""`flux-klein-mlx benchmark`: per-stage latency, peak memory, and efficiency against physics.

Each stage is timed on its own (load, text encoding, every denoising step, VAE decode), after
warm-up runs that are discarded, over several trials (median, min, max). Every timed region ends
with `mx.eval`, so MLX's lazy graph is really computed inside the clock. Efficiency comes from an
analytic FLOP count (`docs/performance.md` section 4): achieved TFLOPS = FLOPs / median time, and
the percentage of the chip's peak where the chip is known.

The FLOP model and the chip table at the top of this module are plain arithmetic that the CLI
and `benchmarks/flops.py` share (the package is what gets installed, so the formulas live here).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click


from . import preload_openblas  # noqa: E402

_BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402  (after the BLAS preload, on purpose)
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from . import __version__  # noqa: E402
from .errors import FluxKleinError  # noqa: E402

# ---------------------------------------------------------------------------------------------
# FLOP model (performance.md section 4). 1 multiply-add = 2 FLOPs, batch 1.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flops:
    """FLOPs of one stage, by kind. `other` = transformer embeddings and output projection."""

    linear: float
    attention: float
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.other


def transformer_step_flops(
    hidden: int,
    depth: int,
    depth_single: int,
    image_tokens: int,
    text_tokens: int = 512,
    mlp_ratio: float = 3.0,
    context_dim: int = 7680,
    in_channels: int = 128,
) -> Flops:
    """FLOPs of one transformer forward (one denoising step of distilled klein, no CFG).

    The attention count does not depend on the number of heads (H·hd = hidden). The text
    projection (`context_embedder`) is counted in every step, as in performance.md, although
    the pipeline hoists it out of the loop (0.07 % of a 4B step at 1024²).
    """
    D, F, N, T = hidden, int(hidden * mlp_ratio), image_tokens, text_tokens
    L = N + T
    # Double block, per stream: q, k, v, o (4·D²) and the SwiGLU MLP D -> 2F -> D (3·D·F).
    double = (4 * D * D + 3 * D * F) * (N + T)
    # Single block on the joint sequence: fused qkv+mlp_in D -> 3D+2F, out (D+F) -> D.
    single = (D * (3 * D + 2 * F) + (D + F) * D) * L
    linear = 2 * (depth * double + depth_single * single)
    attention = (depth + depth_single) * 4 * L * L * D  # QK^T and AV, bidirectional
    other = 2 * (N * in_channels * D + T * context_dim * D + N * D * in_channels)
    return Flops(float(linear), float(attention), float(other))


def text_encoder_flops(
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int = 27,
    tokens: int = 512,
) -> Flops:
    """FLOPs of the Qwen3 prompt encoder: `layers` decoder layers (27 for klein) on `tokens`."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_token = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * intermediate
    linear = 2 * per_token * tokens * layers
    attention = 2 * tokens * tokens * q * layers  # causal: half of the 4·T²·(H·hd) full count
    return Flops(float(linear), float(attention))


def vae_decoder_flops(
    width: int,
    height: int,
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512),
    layers_per_block: int = 2,
    latent_channels: int = 32,
) -> Flops:
    """FLOPs of the FLUX.2 VAE decoder producing a width×height image (convs + mid attention)."""
    down = 2 ** (len(block_out_channels) - 1)
    h, w = height // down, width // down

    def conv(h, w, cin, cout, k=3):
        return 2 * h * w * cin * cout * k * k

    def resblock(h, w, cin, cout):
        return conv(h, w, cin, cout) + conv(h, w, cout, cout) + (conv(h, w, cin, cout, 1) if cin != cout else 0)

    c = block_out_channels[-1]
    linear = conv(h, w, latent_channels, latent_channels, 1) + conv(h, w, latent_channels, c)
    # Mid block: resnet, single-head attention over h·w tokens (q, k, v, out are 1x1), resnet.
    linear += 2 * resblock(h, w, c, c) + 2 * h * w * 4 * c * c
    attention = 4 * (h * w) ** 2 * c
    for i, cout in enumerate(reversed(block_out_channels)):
        for _ in range(layers_per_block + 1):
            linear += resblock(h, w, c, cout)
            c = cout
        if i < len(block_out_channels) - 1:
            h, w = 2 * h, 2 * w  # nearest upsample, then a 3x3 conv at the new size
            linear += conv(h, w, c, c)
    linear += conv(h, w, c, 3)
    return Flops(float(linear), float(attention))


def flops_of_transformer(params, width: int, height: int, text_tokens: int = 512) -> Flops:
    """`transformer_step_flops` for a `FluxKleinParams` at a width×height image."""
    return transformer_step_flops(
        hidden=params.hidden_size,
        depth=params.depth,
        depth_single=params.depth_single,
        image_tokens=(width // 16) * (height // 16),
        text_tokens=text_tokens,
        mlp_ratio=params.mlp_ratio,
        context_dim=params.context_in_dim,
        in_channels=params.in_channels,
    )


def flops_of_text_encoder(config, layers: int = 27, tokens: int = 512) -> Flops:
    """`text_encoder_flops` for a `Qwen3Config`."""
    return text_encoder_flops(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        layers=layers,
        tokens=tokens,
    )


def flops_of_vae_decoder(config, width: int, height: int) -> Flops:
    """`vae_decoder_flops` for an `AutoEncoderConfig`."""
    return vae_decoder_flops(
        width,
        height,
        block_out_channels=tuple(getattr(config, "decoder_block_out_channels", None) or config.block_out_channels),
        layers_per_block=config.layers_per_block,
        latent_channels=config.latent_channels,
    )


# ---------------------------------------------------------------------------------------------
# Chip peaks (performance.md section 3: huggingface.js hardware.ts, Apple bandwidth figures).
# Apple GPUs up to M4 run fp16 at the fp32 rate and bf16 at most at that rate, so this one number
# is the peak for every dtype we run. M5 chips add GPU neural accelerators whose matmul peak is
# unpublished: their % of peak counts the shader ALUs only and may exceed 100.
# ---------------------------------------------------------------------------------------------

# (name, GPU cores, peak TFLOPS fp16 = fp32, memory bandwidth GB/s)
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
    if not chip:
        return None
    name = re.sub(r"^Apple\s+", "", chip.strip())
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
        "memory_gb": None,
        "chip": None,
        "gpu_cores": None,
        "peak_tflops": None,
    }
    try:
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if sys.platform == "darwin":
        brand = _command_output(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
        info["cpu"] = brand or info["cpu"]
        if brand.startswith("Apple M"):
            info["chip"] = brand
            info["gpu_cores"] = _apple_gpu_cores()
    elif sys.platform == "linux":
        info["blas"] = _BLAS
        try:
            m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
            info["cpu"] = m.group(1).strip() if m else info["cpu"]
        except OSError:
            pass
    # The table holds GPU peaks; a CPU run (Linux, or a Mac forced onto the CPU) gets no percentage.
    if mx.default_device() == mx.gpu:
        info["peak_tflops"] = chip_peak_tflops(info["chip"], info["gpu_cores"])
    return info


# ---------------------------------------------------------------------------------------------
# Building the models: real weights, or full-size random weights without any download.
# ---------------------------------------------------------------------------------------------

VARIANTS = ("klein-4b", "klein-9b")
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _randomize(model: nn.Module, dtype, seed: int) -> None:
    """Give every parameter of a freshly built (lazy) model random values in `dtype`.

    Matrices get N(0, 1/fan_in) so activations stay O(1) through the stack; vectors (norm scales,
    biases, statistics) get 1. Each block is generated and evaluated on its own, so the model's
    own lazy initialisers are never computed and the peak stays at the final weights' size.
    """
    # Group parameters by block ("double_blocks.3", "decoder", ...): one evaluation per group.
    groups: dict[str, list[tuple[str, mx.array]]] = {}
    for name, v in tree_flatten(model.parameters()):
        m = re.match(r"^(.*?\.\d+)\.", name)
        groups.setdefault(m.group(1) if m else name.split(".")[0], []).append((name, v))
    key = mx.random.key(seed)
    for items in groups.values():
        new = []
        for name, v in items:
            key, k = mx.random.split(key)
            if not mx.issubdtype(v.dtype, mx.floating):
                continue
            if v.ndim >= 2:
                fan_in = math.prod(v.shape[1:])
                new.append((name, mx.random.normal(v.shape, dtype=dtype, key=k) * (fan_in**-0.5)))
            else:
                new.append((name, mx.ones(v.shape, dtype=dtype)))
        model.load_weights(new, strict=False)
        mx.eval([v for _, v in new])


def _quantize(model: nn.Module, bits: int, group_size: int = 64) -> None:
    """Quantize the Linear layers whose input width is a multiple of the group size."""
    from .quantize import quantize_model

    quantize_model(model, bits=bits, group_size=group_size)
    mx.eval(model.parameters())


def _tiny_configs():
    """A tiny random configuration for tests: every stage runs for real, in seconds on a CPU."""
    from .text_encoder import Qwen3Config
    from .transformer import FluxKleinParams
    from .vae import AutoEncoderConfig

    qwen = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=1e6, vocab_size=1000,
    )  # fmt: skip
    params = FluxKleinParams(
        hidden_size=64, num_heads=2, axes_dim=(8, 8, 8, 8), depth=1, depth_single=1, context_in_dim=3 * 32
    )
    vae = AutoEncoderConfig.from_dict(
        {"block_out_channels": [32, 32, 32, 32], "layers_per_block": 1, "latent_channels": 32, "norm_num_groups": 32}
    )
    return qwen, (1, 2, 3), params, vae


def _random_configs(variant: str):
    """(Qwen3 config, tapped layers, transformer params, VAE config) of a variant, for random weights."""
    if variant == "tiny":
        return _tiny_configs()
    from .text_encoder import OUT_LAYERS, qwen3_4b, qwen3_8b
    from .transformer import FluxKleinParams
    from .vae import AutoEncoderConfig

    if variant == "klein-4b":
        return qwen3_4b(), OUT_LAYERS, FluxKleinParams.klein_4b(), AutoEncoderConfig.flux2()
    if variant == "klein-9b":
        return qwen3_8b(), OUT_LAYERS, FluxKleinParams.klein_9b(), AutoEncoderConfig.flux2()
    raise FluxKleinError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")


class _Source:
    """Where the three models come from: one loader per component, called stage by stage.

    Random weights need no download: full-size modules are built lazily and filled with random
    values block by block. A model id or folder goes through `flux_klein_mlx.load`, the loaders
    `generate` uses, whose components load on first use.
    """

    def __init__(self, model: str | None, variant: str, dtype, quantize: int | None, seed: int):
        self.model, self.dtype, self.quantize, self.seed = model, dtype, quantize, seed
        self.pipe = None
        self.out_layers = None
        if model is None:
            self.qwen, self.out_layers, self.params, self.vae_config = _random_configs(variant)
            self.variant = variant
            return
        from .pipeline import load

        self.params = self.qwen = self.vae_config = None  # known once each model is loaded
        dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
        self.pipe = load(model, dtype=dtype_name, quantize=quantize)
        self.variant = self.pipe.info.variant

    def text_encoder(self):
        """(encoder, input_ids, attention_mask) for one prompt padded to 512 tokens."""
        if self.pipe is not None:
            encoder, tokenizer = self.pipe.text_encoder.get(), self.pipe.tokenizer.get()
            ids, mask = tokenizer(DEFAULT_PROMPT)
            self.qwen, self.out_layers = encoder.config, encoder.out_layers
            return encoder, ids, mask
        from .text_encoder import Qwen3TextEncoder

        encoder = Qwen3TextEncoder(self.qwen, self.out_layers)
        _randomize(encoder, self.dtype, self.seed)
        ids = mx.random.randint(0, self.qwen.vocab_size, (1, TEXT_TOKENS), key=mx.random.key(self.seed))
        real = 40  # a typical prompt plus the chat template; the rest is padding, as in the pipeline
        mask = (mx.arange(TEXT_TOKENS) < real).astype(mx.int32)[None]
        return encoder, ids.astype(mx.int32), mask

    def transformer(self):
        if self.pipe is not None:
            model = self.pipe.transformer.get()
        else:
            from .transformer import FluxKlein

            model = FluxKlein(self.params)
            _randomize(model, self.dtype, self.seed + 1)
            if self.quantize:
                _quantize(model, self.quantize)  # from the random weights in `dtype`, as `convert` would
        self.params = model.params
        return model

    def vae(self):
        if self.pipe is not None:
            vae = self.pipe.vae.get()
        else:
            from .vae import AutoEncoder

            vae = AutoEncoder(self.vae_config)
            _randomize(vae, self.dtype, self.seed + 2)
        self.vae_config = vae.config
        return vae

    def release(self, slot: str) -> None:
        if self.pipe is not None:
            getattr(self.pipe, slot).release()
        mx.clear_cache()


# ---------------------------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------------------------

TEXT_TOKENS = 512
DEFAULT_PROMPT = "a red fox in fresh snow at dawn, soft light, 35 mm photograph"
GB = 1e9


def _summary(times: list[float], flops: float | None, peak_tflops: float | None) -> dict:
    """Median, min, max of `times` and the efficiency at the median."""
    med = statistics.median(times)
    out = {"times_s": [round(t, 6) for t in times], "median_s": med, "min_s": min(times), "max_s": max(times)}
    if flops:
        out["tflop"] = flops / 1e12
        out["tflops"] = flops / med / 1e12
        out["pct_of_peak"] = 100 * out["tflops"] / peak_tflops if peak_tflops else None
    return out


def _timed_load(load) -> tuple[object, dict]:
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = load()
    model = out[0] if isinstance(out, tuple) else out
    mx.eval(model.parameters())
    seconds = time.perf_counter() - t0
    return out, {
        "seconds": seconds,
        "weights_gb": sum(v.nbytes for _, v in tree_flatten(model.parameters())) / GB,
        "peak_memory_gb": mx.get_peak_memory() / GB,
    }


def run_benchmark(
    model: str | None = None,
    variant: str = "klein-4b",
    width: int = 1024,
    height: int = 1024,
    steps: int = 4,
    quantize: int | None = None,
    dtype: str | None = None,
    warmup: int = 1,
    trials: int = 3,
    text_encoder: bool = True,
    decode: bool = True,
    seed: int = 0,
    log=None,
) -> dict:
    """Time every stage of one image and return the results (the structure `--json` writes).

    `model` is a Hugging Face id or folder; None builds `variant` with random weights (no
    download). `dtype` None picks bfloat16 on a GPU and float32 on a CPU (where MLX's bf16
    matmuls are slow). Skipped stages are absent from "stages". `log(msg)` gets progress lines.
    """
    log = log or (lambda msg: None)
    for name, v in (("width", width), ("height", height)):
        if v < 16 or v % 16:
            fix = " or ".join(str(c) for c in sorted({max(16, v // 16 * 16), v // 16 * 16 + 16}))
            raise FluxKleinError(f"{name} {v} is not a positive multiple of 16; use {fix}")
    if steps < 1 or trials < 1 or warmup < 0:
        raise FluxKleinError("steps and trials must be at least 1 and warmup at least 0")
    if model is None and variant not in VARIANTS + ("tiny",):
        raise FluxKleinError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
    if quantize not in (None, 4, 8):
        raise FluxKleinError(f"--quantize must be 4 or 8, not {quantize}")
    dtype_name = dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    if dtype_name not in DTYPES:
        raise FluxKleinError(f"unknown dtype {dtype_name!r}; use one of {', '.join(DTYPES)}")
    mx_dtype = DTYPES[dtype_name]
    machine = machine_info()
    peak = machine["peak_tflops"]
    h, w = height // 16, width // 16
    src = _Source(model, variant, mx_dtype, quantize, seed)
    stages: dict[str, dict] = {}
    flops: dict[str, float] = {}
    verb = "loading" if model is not None else "making random weights for"
    log(f"benchmark: {src.variant}, {width}x{height}, {steps} steps, {dtype_name}, warm-up {warmup}, trials {trials}")

    # 1. Text encoder: 512 tokens through layers 1..27.
    ctx = None
    if text_encoder:
        log(f"{verb} the text encoder")
        (encoder, ids, mask), stages["text_encoder_load"] = _timed_load(src.text_encoder)
        f = flops_of_text_encoder(src.qwen, layers=max(src.out_layers), tokens=TEXT_TOKENS).total
        flops["text_encoder"] = f
        times = []
        mx.reset_peak_memory()
        for i in range(warmup + trials):
            t0 = time.perf_counter()
            ctx = encoder(ids, mask)
            mx.eval(ctx)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        stages["text_encoding"] = _summary(times, f, peak) | {"peak_memory_gb": mx.get_peak_memory() / GB}
        log(f"text encoding: {stages['text_encoding']['median_s']:.3f} s")
        del encoder
        src.release("text_encoder")

    # 2. Transformer: the denoising loop, every step timed on its own.
    log(f"{verb} the transformer")
    transformer, stages["transformer_load"] = _timed_load(src.transformer)
    params = src.params
    if ctx is None:
        ctx = mx.random.normal((1, TEXT_TOKENS, params.context_in_dim), key=mx.random.key(seed + 3))
    ctx = ctx.astype(mx_dtype)
    step_flops = flops_of_transformer(params, width, height, TEXT_TOKENS)
    flops["step"] = step_flops.total
    from .rope import image_ids, text_ids
    from .sampler import FluxSampler

    sigmas = FluxSampler().timesteps(h * w, steps)
    noise = mx.random.normal((1, h * w, params.in_channels), key=mx.random.key(seed + 4)).astype(mx_dtype)
    step_times, per_index, denoise_times = [], [[] for _ in range(steps)], []
    mx.reset_peak_memory()
    for trial in range(warmup + trials):
        x = noise
        t_start = time.perf_counter()
        # Shape-only work and the step-invariant text projection, once per image (as the pipeline does).
        rope = transformer.compute_rope(text_ids(TEXT_TOKENS), image_ids(h, w))
        txt = transformer.embed_text(ctx)
        mx.eval(rope, txt)
        for i in range(steps):
            t0 = time.perf_counter()
            t = mx.array([sigmas[i]], dtype=mx_dtype)
            v = transformer.forward_with_rope(x, ctx, t, rope, txt_embedded=txt)
            x = FluxSampler.step(x, v, sigmas[i], sigmas[i + 1])
            mx.eval(x)
            if trial >= warmup:
                step_times.append(time.perf_counter() - t0)
                per_index[i].append(step_times[-1])
        if trial >= warmup:
            denoise_times.append(time.perf_counter() - t_start)
        what = f"warm-up {trial + 1}" if trial < warmup else f"trial {trial - warmup + 1}"
        log(f"denoising {what}: {time.perf_counter() - t_start:.2f} s")
    denoise_peak = mx.get_peak_memory() / GB
    stages["denoise_step"] = _summary(step_times, step_flops.total, peak) | {
        "per_step_median_s": [statistics.median(t) for t in per_index],
        "peak_memory_gb": denoise_peak,
    }
    stages["denoise"] = _summary(denoise_times, steps * step_flops.total, peak) | {"peak_memory_gb": denoise_peak}
    latents = x
    del transformer, rope, txt
    src.release("transformer")

    # 3. VAE decode of the final latents.
    if decode:
        log(f"{verb} the VAE")
        vae, stages["vae_load"] = _timed_load(src.vae)
        f = flops_of_vae_decoder(src.vae_config, width, height).total
        flops["vae_decode"] = f
        times = []
        mx.reset_peak_memory()
        for i in range(warmup + trials):
            t0 = time.perf_counter()
            image = vae.decode_tokens(latents, h, w)
            mx.eval(image)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        stages["vae_decode"] = _summary(times, f, peak) | {"peak_memory_gb": mx.get_peak_memory() / GB}
        log(f"VAE decode: {stages['vae_decode']['median_s']:.3f} s")
        del vae
        src.release("vae")

    # The image: sum of the stage medians (loads excluded; the stages run one after another).
    parts = ["denoise"] + [s for s in ("text_encoding", "vae_decode") if s in stages]
    image_s = sum(stages[s]["median_s"] for s in parts)
    image_flops = steps * flops["step"] + flops.get("text_encoder", 0.0) + flops.get("vae_decode", 0.0)
    stages["image"] = {
        "seconds": image_s,
        "includes": parts,
        "tflop": image_flops / 1e12,
        "tflops": image_flops / image_s / 1e12,
        "pct_of_peak": 100 * image_flops / image_s / 1e12 / peak if peak else None,
        "peak_memory_gb": max(stages[s]["peak_memory_gb"] for s in parts),
    }
    return {
        "benchmark": "flux_klein_mlx per-stage latency",
        "schema": 1,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": {
            "model": model,
            "weights": "random" if model is None else "checkpoint",
            "variant": src.variant if model is None else params.variant,
            "width": width,
            "height": height,
            "image_tokens": h * w,
            "text_tokens": TEXT_TOKENS,
            "steps": steps,
            "dtype": dtype_name,
            "quantize": quantize,
            "warmup": warmup,
            "trials": trials,
        },
        "flops": {
            "step_tflop": step_flops.total / 1e12,
            "step_linear_tflop": step_flops.linear / 1e12,
            "step_attention_tflop": step_flops.attention / 1e12,
            "text_encoder_tflop": flops.get("text_encoder", 0.0) / 1e12 if text_encoder else None,
            "vae_decode_tflop": flops.get("vae_decode", 0.0) / 1e12 if decode else None,
            "image_tflop": image_flops / 1e12,
        },
        "stages": stages,
    }


# ---------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def format_report(result: dict) -> str:
    """The results as a table for people (the JSON has everything, unrounded)."""
    c, m, st = result["config"], result["machine"], result["stages"]
    quant = f", {c['quantize']}-bit transformer" if c["quantize"] else ""
    weights = "random weights" if c["weights"] == "random" else c["model"]
    chip = m["chip"] or m["cpu"]
    if m["gpu_cores"]:
        chip += f" ({m['gpu_cores']}-core GPU)"
    peak = f"{m['peak_tflops']:.1f} TFLOPS peak" if m["peak_tflops"] else "peak unknown here: TFLOPS only"
    lines = [
        f"flux_klein_mlx {m['flux_klein_mlx']} benchmark: {c['variant']} ({weights}), {c['width']}x{c['height']} "
        f"({c['image_tokens']} image + {c['text_tokens']} text tokens), {c['steps']} steps, {c['dtype']}{quant}",
        f"warm-up {c['warmup']}, trials {c['trials']}; {chip}, {m['cpu_cores']} CPU cores, "
        f"{m['memory_gb']} GB; {m['os']}; MLX {m['mlx']} on {m['device']}; {peak}"
        + (f"; BLAS: {m['blas']}" if m.get("blas") else ""),
        "",
        f"{'stage':<24}{'median':>10}{'min':>10}{'max':>10}{'TFLOP':>9}{'TFLOPS':>9}{'% peak':>8}{'peak mem':>11}",
    ]

    def row(label, s, median=None):
        if s is None:
            return
        med = s.get("median_s", median if median is not None else s.get("seconds"))
        lo, hi = s.get("min_s"), s.get("max_s")
        tf, tfs, pct = s.get("tflop"), s.get("tflops"), s.get("pct_of_peak")
        lines.append(
            f"{label:<24}{_fmt_s(med):>10}{_fmt_s(lo) if lo is not None else '':>10}"
            f"{_fmt_s(hi) if hi is not None else '':>10}{f'{tf:.3g}' if tf else '':>9}"
            f"{f'{tfs:.3g}' if tfs else '':>9}{f'{pct:.0f} %' if pct else '':>8}"
            f"{s['peak_memory_gb']:>8.2f} GB"
        )

    load = "load" if c["weights"] == "checkpoint" else "make random"
    row(f"{load} text encoder", st.get("text_encoder_load"))
    row("text encoding", st.get("text_encoding"))
    row(f"{load} transformer", st.get("transformer_load"))
    row("denoising step", st.get("denoise_step"))
    row(f"denoise ({c['steps']} step{'s' if c['steps'] > 1 else ''})", st.get("denoise"))
    row(f"{load} VAE", st.get("vae_load"))
    row("VAE decode", st.get("vae_decode"))
    row("image (no loads)", st.get("image"))
    per = st["denoise_step"].get("per_step_median_s", [])
    if len(per) > 1:
        lines.append("per step (median): " + ", ".join(_fmt_s(t) for t in per))
    loads = [k for k in ("text_encoder_load", "transformer_load", "vae_load") if k in st]
    if loads:
        lines.append(
            "resident weights: "
            + ", ".join(f"{k.replace('_load', '').replace('_', ' ')} {st[k]['weights_gb']:.2f} GB" for k in loads)
        )
    skipped = [n for k, n in (("text_encoding", "text encoding"), ("vae_decode", "VAE decode")) if k not in st]
    note = "image = sum of stage medians: " + " + ".join(st["image"]["includes"])
    if skipped:
        note += f" ({' and '.join(skipped)} skipped)"
    lines.append(note)
    return "\n".join(lines)


def free_path(path: Path) -> Path:
    """`path` if nothing is there, else the first free `stem-N.suffix` (results are never overwritten)."""
    if not path.exists():
        return path
    n = 1
    while (candidate := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return candidate


def write_json(result: dict, path: str | Path) -> Path:
    """Write `result` as JSON to `path`, or to a new name if `path` exists; returns where it went."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FluxKleinError(f"folder {path.parent} does not exist; create it or choose another --json path")
    final = free_path(path)
    with open(final, "x") as f:  # "x": never clobber a file that appeared meanwhile
        json.dump(result, f, indent=2)
        f.write("\n")
    return final


# ---------------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------------


@click.command("benchmark")
@click.option("--model", "-m", default=None, help="Hugging Face repo id or local folder (real weights).")
@click.option("--random-weights", is_flag=True, help="Build the model with random weights: nothing is downloaded.")
@click.option("--variant", type=click.Choice(VARIANTS), default="klein-4b", show_default=True,
              help="Architecture for --random-weights.")
@click.option("--tiny", is_flag=True, hidden=True, help="A tiny random model (tests).")
@click.option("--width", "-W", type=int, default=1024, show_default=True, help="Image width in px, multiple of 16.")
@click.option("--height", "-H", type=int, default=1024, show_default=True, help="Image height in px, multiple of 16.")
@click.option("--steps", type=click.IntRange(1, 1000), default=4, show_default=True, help="Denoising steps per image.")
@click.option("--quantize", "-q", type=click.Choice(["4", "8"]), default=None,
              help="Quantize Linear layers (group 64) before timing: the transformer's with --random-weights, "
                   "transformer and text encoder with --model (as generate does).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help="Compute dtype [default: bfloat16 on a GPU, float32 on a CPU].")
@click.option("--warmup", type=click.IntRange(0, 100), default=1, show_default=True, help="Untimed runs per stage.")
@click.option("--trials", type=click.IntRange(1, 1000), default=3, show_default=True, help="Timed runs per stage.")
@click.option("--skip-text-encoder", is_flag=True, help="Feed random text embeddings instead of running Qwen3.")
@click.option("--skip-decode", is_flag=True, help="Do not run the VAE decoder.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights and inputs.")
@click.option("--json", "json_path", default=None,
              help="Also write the results as JSON here (an existing file is kept: a new name is chosen).")
def benchmark(model, random_weights, variant, tiny, width, height, steps, quantize, dtype, warmup, trials,
              skip_text_encoder, skip_decode, seed, json_path):  # fmt: skip
    """Time load, text encoding, each denoising step and VAE decode; report TFLOPS and % of peak."""
    if model and (random_weights or tiny):
        raise click.UsageError("give either --model or --random-weights, not both")
    if not model and not (random_weights or tiny):
        raise click.UsageError("give --model ID|DIR for real weights, or --random-weights [--variant ...]")
    if json_path and not Path(json_path).parent.is_dir():
        raise FluxKleinError(f"folder {Path(json_path).parent} does not exist; create it or choose another --json path")
    result = run_benchmark(
        model=model,
        variant="tiny" if tiny else variant,
        width=width,
        height=height,
        steps=steps,
        quantize=int(quantize) if quantize else None,
        dtype=dtype,
        warmup=warmup,
        trials=trials,
        text_encoder=not skip_text_encoder,
        decode=not skip_decode,
        seed=seed,
        log=lambda msg: click.echo(msg, err=True),
    )
    click.echo(format_report(result))
    if json_path:
        final = write_json(result, json_path)
        if final != Path(json_path):
            click.echo(f"{json_path} exists; wrote {final} instead", err=True)
        else:
            click.echo(f"wrote {final}", err=True)


def main(argv=None) -> int:
    from .__main__ import run_command

    return run_command(benchmark, argv)
