"""The timed stages of one benchmark image: load, text encoding, every denoising step, VAE decode.

Each stage is timed on its own, after warm-up runs that are discarded, over several trials (median,
min, max). The stages are the pipeline's own (`FluxKleinPipeline.prepare` / `denoise` / `decode`), so
the benchmark times the code `generate` runs; every timed region ends with `mx.eval`. What differs
between model families (the text window and taps, the FLOPs of a step and of what runs once per image)
is asked of the model's family and of `flops.denoise_flops`, never branched on here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from ..dtypes import dtype_name
from ..errors import FluxKleinError
from ..inputs.settings import check_image_size
from ..models.rope import token_grid
from ..run.pipeline import FluxKleinPipeline
from .flops import denoise_flops, flops_of_text_encoder, flops_of_vae_decoder, machine_info
from .random_model import REAL_PROMPT_TOKENS

DEFAULT_PROMPT = "a red fox in fresh snow at dawn, soft light, 35 mm photograph"


def _summary(run: Run, times: list[float], flops: float | None, peak_memory_gb: float) -> dict:
    """Median, min, max of `times`, the efficiency at the median and the stage's peak memory."""
    med = statistics.median(times)
    out = {"times_s": [round(t, 6) for t in times], "median_s": med, "min_s": min(times), "max_s": max(times)}
    if flops:
        out["tflop"] = flops / 1e12
        out["tflops"] = flops / med / 1e12
        out["pct_of_peak"] = 100 * out["tflops"] / run.peak if run.peak else None
    out["peak_memory_gb"] = peak_memory_gb
    return out


def _timed_load(run: Run, name: str):
    """Load one of the pipeline's models (evaluated); its time, size and peak go to `<name>_load`."""
    verb = "making random weights for" if run.pipe.info.format == "random" else "loading"
    run.log(f"{verb} the {name.replace('_', ' ').replace('vae', 'VAE')}")
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    model = run.pipe.component(name)
    mx.eval(model.parameters())
    run.stages[f"{name}_load"] = {
        "seconds": time.perf_counter() - t0,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "weights_gb": sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9,
    }
    return model


def _repeat(run, warmup: int, trials: int) -> tuple[list[float], object]:
    """Wall times of `trials` calls of `run()`, its output evaluated, after `warmup` untimed ones, and the
    last output."""
    times = []
    for i in range(warmup + trials):
        t0 = time.perf_counter()
        out = run()
        mx.eval(out)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def reference_pictures(n: int, width: int, height: int, seed: int = 0) -> list[Image.Image]:
    """`n` smooth random RGB pictures of width x height (stand-in references: the VAE encodes them)."""
    rng = np.random.default_rng(seed)
    small = [(rng.random((max(height // 32, 2), max(width // 32, 2), 3)) * 255).astype(np.uint8) for _ in range(n)]
    return [Image.fromarray(a).resize((width, height), Image.Resampling.BILINEAR) for a in small]


@dataclasses.dataclass(kw_only=True)
class Run:
    """One benchmark's settings and what it has measured so far."""

    pipe: FluxKleinPipeline
    width: int
    height: int
    steps: int
    warmup: int
    trials: int
    references: int
    seed: int
    log: Callable[[str], None]
    peak: float | None  # the chip's peak TFLOPS, when known
    stages: dict = dataclasses.field(default_factory=dict)
    flops: dict = dataclasses.field(default_factory=dict)
    tokens: dict = dataclasses.field(default_factory=dict)  # "text" (one per pass), "reference": what ran

    @property
    def kv(self) -> bool:
        """klein 9B-KV with references: the first step differs from the others."""
        return self.pipe.info.reference_kv and self.references > 0


def _check_run(width: int, height: int, *, steps: int, warmup: int, trials: int, references: int) -> None:
    check_image_size(width, height)
    if steps < 1 or trials < 1 or warmup < 0:
        raise FluxKleinError("steps and trials must be at least 1 and warmup at least 0")
    if references < 0:
        raise FluxKleinError(f"references must be 0 or more, not {references}")


def _text_encoder_stage(run: Run, prompts: list[str]) -> list[mx.array]:
    """Time the first prompt through the family's text encoder (FLUX.2: 512 tokens through layers 1..27;
    FLUX 3: its 80-multiple window through layers 1..32); the others (Base's negative prompt) are encoded
    once, untimed. Returns each prompt's embeddings (1, L, C)."""
    pipe, family = run.pipe, run.pipe.info.family
    encoder = _timed_load(run, "text_encoder")
    tokenizer = pipe.component("tokenizer")
    mx.reset_peak_memory()
    times, ctx = _repeat(
        lambda: family.encode_prompts(encoder, tokenizer, prompts[:1])[0].astype(pipe.dtype), run.warmup, run.trials
    )
    run.flops["text_encoder"] = flops_of_text_encoder(
        encoder.config, layers=max(family.text_taps), tokens=ctx.shape[1]
    ).total
    run.stages["text_encoding"] = _summary(run, times, run.flops["text_encoder"], mx.get_peak_memory() / 1e9)
    run.stages["text_encoding"]["tokens"] = ctx.shape[1]
    run.log(f"text encoding: {run.stages['text_encoding']['median_s']:.3f} s")
    rest = [e.astype(pipe.dtype) for e in family.encode_prompts(encoder, tokenizer, prompts[1:])] if prompts[1:] else []
    mx.eval(rest)
    encoder = None  # drop this reference before releasing the slot's
    pipe.release("text_encoder")
    return [ctx, *rest]


def _random_embeddings(run: Run, prompts: list[str]) -> list[mx.array]:
    """Stand-ins (1, L, C) for each prompt's embeddings, L the family's window for a typical prompt."""
    info = run.pipe.info
    L = info.family.text_window.length(REAL_PROMPT_TOKENS)
    keys = mx.random.split(mx.random.key(run.seed + 3), len(prompts))
    return [mx.random.normal((1, L, info.params.context_in_dim), key=k).astype(run.pipe.dtype) for k in keys]


def _denoise_stage(run: Run):
    """Time the pipeline's denoising stage, every step on its own; returns the last job (for the decode)."""
    pipe, params = run.pipe, run.pipe.info.params
    _timed_load(run, "transformer")
    images = reference_pictures(run.references, run.width, run.height, run.seed)
    step_times = []
    stats = []  # of the timed trials
    for trial in range(run.warmup + run.trials):
        job = pipe.prepare(
            DEFAULT_PROMPT, width=run.width, height=run.height, steps=run.steps, seed=run.seed, images=images
        )
        if trial == 0:  # the FLOPs of the shapes the pipeline made (windows, reference tokens)
            _denoise_flops(run, job, params)
        seconds = [event.seconds for event in pipe.denoise(job)]
        if trial >= run.warmup:
            step_times.append(seconds)
            stats.append(job.stats)
        what = f"warm-up {trial + 1}" if trial < run.warmup else f"trial {trial - run.warmup + 1}"
        run.log(f"denoising {what}: {job.stats.denoise.seconds:.2f} s")
    step, once = run.flops["step"], run.flops["once_per_image"].total
    memory = max(st.denoise.peak_memory for st in stats) / 1e9
    per_index = list(zip(*step_times, strict=True))  # (steps, trials)
    all_steps = [t for ts in per_index for t in ts]
    # KV steps are not alike (the first one also runs the reference pass): no one FLOP count for all.
    run.stages["denoise_step"] = _summary(run, all_steps, None if run.kv else step.total, memory)
    run.stages["denoise_step"]["per_step_median_s"] = [statistics.median(t) for t in per_index]
    run.stages["denoise"] = _summary(run, [st.denoise.seconds for st in stats], run.flops["denoise"], memory)
    if run.kv:
        ref_times = [st.reference_kv_seconds for st in stats]
        run.stages["kv_reference_pass"] = _summary(run, ref_times, once, memory)
        run.stages["kv_reference_pass"]["cache_gb"] = job.stats.reference_kv_bytes / 1e9
        run.stages["kv_first_step"] = _summary(run, per_index[0], step.total + once, memory)
        if run.steps > 1:  # steps 2.. of every trial
            run.stages["kv_cached_step"] = _summary(run, all_steps[run.trials :], step.total, memory)
    elif once:  # FLUX 3 Base's t = 0 text/reference modes: the denoise stage's time before its first step
        before = [
            st.denoise.seconds - st.denoise.load_seconds - sum(t) for st, t in zip(stats, step_times, strict=True)
        ]
        run.stages["once_per_image"] = _summary(run, before, once, memory)
    pipe.release("transformer")
    return job


def _denoise_flops(run: Run, job, params) -> None:
    """A step's FLOPs and those of what runs once per image (klein 9B-KV's reference pass, FLUX 3 Base's text and
    reference modes), counted by the family's model (`flops.denoise_flops`) on this job's shapes."""
    reference_tokens = 0 if job.ref_tokens is None else job.ref_tokens.shape[1]
    step, once = denoise_flops(
        run.pipe.info.family.key,
        params,
        image_tokens=math.prod(job.grid),
        text_tokens=[c.shape[1] for c in job.ctx],
        reference_tokens=reference_tokens,
        cached_references=run.kv,
    )
    run.flops.update(step=step, once_per_image=once, denoise=step.total * run.steps + once.total)
    run.tokens.update(text=[c.shape[1] for c in job.ctx], reference=reference_tokens)


def _decode_stage(run: Run, job) -> None:
    pipe = run.pipe
    vae = _timed_load(run, "vae")
    run.flops["vae_decode"] = flops_of_vae_decoder(vae.config, run.width, run.height).total
    peaks = []

    def decode():
        pipe.decode(job, "np")
        peaks.append(job.stats.decode.peak_memory / 1e9)

    times, _ = _repeat(decode, run.warmup, run.trials)
    run.stages["vae_decode"] = _summary(run, times, run.flops["vae_decode"], max(peaks))
    run.log(f"VAE decode: {run.stages['vae_decode']['median_s']:.3f} s")
    del vae
    pipe.release("vae")


def run_benchmark(
    pipe: FluxKleinPipeline,
    *,
    width: int = 1024,
    height: int = 1024,
    steps: int = 4,
    warmup: int = 1,
    trials: int = 3,
    text_encoder: bool = True,
    decode: bool = True,
    seed: int = 0,
    log=None,
    references: int = 0,
) -> dict:
    """Time every stage of one image on `pipe` and return the results (the structure `--json` writes).

    Skipped stages are absent from "stages"; without the text encoder, random embeddings of the
    right shape stand in. `references` edits with that many reference pictures of the output size
    (encoded in the prepare stage, not timed); for klein 9B-KV the first step (reference pass +
    cached step) and the cached steps are reported apart. `log(msg)` gets progress lines.
    """
    _check_run(width, height, steps=steps, warmup=warmup, trials=trials, references=references)
    machine = machine_info()
    run = Run(
        pipe=pipe,
        width=width,
        height=height,
        steps=steps,
        warmup=warmup,
        trials=trials,
        references=references,
        seed=seed,
        log=log or (lambda msg: None),
        peak=machine["peak_tflops"],
    )
    info = pipe.info
    run.log(f"benchmark: {info.name}, {width}x{height}, {steps} steps, warm-up {warmup}, trials {trials}")
    prompts = pipe.inputs(DEFAULT_PROMPT, dict(width=width, height=height, steps=steps)).prompts  # Base: + ""
    ctx = _text_encoder_stage(run, prompts) if text_encoder else _random_embeddings(run, prompts)
    for prompt, emb in zip(prompts, ctx, strict=True):
        pipe.remember_prompt(prompt, emb)
    job = _denoise_stage(run)
    if decode:
        _decode_stage(run, job)
    return _result(run, machine)


def _result(run: Run, machine: dict) -> dict:
    """The whole-image row (sum of the stage medians, loads excluded) and the JSON structure."""
    stages, flops, pipe, info = run.stages, run.flops, run.pipe, run.pipe.info
    parts = ["denoise"] + [s for s in ("text_encoding", "vae_decode") if s in stages]
    image_s = sum(stages[s]["median_s"] for s in parts)
    image_flops = sum(flops.get(k, 0.0) for k in ("denoise", "text_encoder", "vae_decode"))
    stages["image"] = {
        "seconds": image_s,
        "includes": parts,
        "tflop": image_flops / 1e12,
        "tflops": image_flops / image_s / 1e12,
        "pct_of_peak": 100 * image_flops / image_s / 1e12 / run.peak if run.peak else None,
        "peak_memory_gb": max(stages[s]["peak_memory_gb"] for s in parts),
    }
    random = info.format == "random"
    params = info.params
    step = flops["step"]
    return {
        "benchmark": "flux_klein_mlx per-stage latency",
        "schema": 1,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": {
            "model": None if random else info.source,
            "weights": "random" if random else "checkpoint",
            "variant": info.variant,
            "title": info.name,
            "width": run.width,
            "height": run.height,
            "image_tokens": math.prod(token_grid(run.width, run.height)),
            "text_tokens": run.tokens["text"][0],  # the prompt's window
            "text_tokens_per_pass": run.tokens["text"],  # one window per pass (CFG: cond, uncond)
            "blocks": f"{params.depth}+{params.depth_single}",
            "references": run.references,
            "reference_tokens": run.tokens["reference"],
            "reference_kv": run.kv,
            "steps": run.steps,
            "dtype": dtype_name(pipe.dtype),
            "quantize": pipe.quantization["bits"] if pipe.quantization else None,
            "warmup": run.warmup,
            "trials": run.trials,
        },
        "flops": {
            "step_tflop": step.total / 1e12,
            "step_linear_tflop": step.linear / 1e12,
            "step_attention_tflop": step.attention / 1e12,
            "once_per_image_tflop": flops["once_per_image"].total / 1e12,
            "text_encoder_tflop": flops["text_encoder"] / 1e12 if "text_encoder" in flops else None,
            "vae_decode_tflop": flops["vae_decode"] / 1e12 if "vae_decode" in flops else None,
            "image_tflop": image_flops / 1e12,
        },
        "stages": stages,
    }
