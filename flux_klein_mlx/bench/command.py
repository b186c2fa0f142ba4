"""`python -m flux_klein_mlx benchmark`: per-stage latency, peak memory, and efficiency against physics.

Each stage is timed on its own (load, text encoding, every denoising step, VAE decode), after
warm-up runs that are discarded, over several trials (median, min, max). The stages are the
pipeline's own (`FluxKleinPipeline.prepare` / `denoise` / `decode`), so the benchmark times the
code `generate` runs. Every timed region ends with `mx.eval`. Efficiency comes from the analytic
FLOP model in `flops.py`: achieved TFLOPS = FLOPs / median time, and the percentage of the chip's
peak where the chip is known.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from ..cli import run_command
from ..errors import FluxKleinError
from ..files import check_output_file, write_exclusive
from ..inputs import check_image_size
from ..loading import DEFAULT_DTYPE, DTYPES, dtype_name
from ..models.config import VARIANTS
from ..models.rope import token_grid
from ..models.text_encoder import OUT_LAYERS, encode_prompts
from ..models.tokenizer import MAX_LENGTH
from ..pipeline import FluxKleinPipeline, load
from .flops import (
    flops_of_text_encoder,
    flops_of_transformer,
    flops_of_vae_decoder,
    machine_info,
    reference_pass_flops,
)
from .random_model import random_pipeline
from .time_to_image import format_cold, measure_cold

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


def _text_encoder_stage(run: Run) -> mx.array:
    """Time 512 tokens through layers 1..27 (the pipeline's encode function); the embeddings (1, 512, C)."""
    pipe = run.pipe
    encoder = _timed_load(run, "text_encoder")
    tokenizer = pipe.component("tokenizer")
    run.flops["text_encoder"] = flops_of_text_encoder(encoder.config, layers=max(OUT_LAYERS), tokens=MAX_LENGTH).total
    mx.reset_peak_memory()
    times, ctx = _repeat(
        lambda: encode_prompts(encoder, tokenizer, [DEFAULT_PROMPT]).astype(pipe.dtype), run.warmup, run.trials
    )
    run.stages["text_encoding"] = _summary(run, times, run.flops["text_encoder"], mx.get_peak_memory() / 1e9)
    run.log(f"text encoding: {run.stages['text_encoding']['median_s']:.3f} s")
    encoder = None  # drop this reference before releasing the slot's
    pipe.release("text_encoder")
    return ctx


def _denoise_stage(run: Run):
    """Time the pipeline's denoising stage, every step on its own; returns the last job (for the decode)."""
    pipe, params = run.pipe, run.pipe.info.params
    _timed_load(run, "transformer")
    ref_tokens = run.references * math.prod(token_grid(run.width, run.height))
    step = flops_of_transformer(
        params,
        width=run.width,
        height=run.height,
        text_tokens=MAX_LENGTH,
        reference_tokens=ref_tokens,
        cached_references=run.kv,
    )
    ref_pass = reference_pass_flops(params, ref_tokens).total if run.kv else 0.0
    run.flops.update(step=step, denoise=step.total * run.steps + ref_pass)
    images = reference_pictures(run.references, run.width, run.height, run.seed)
    step_times = []
    stats = []  # of the timed trials
    for trial in range(run.warmup + run.trials):
        job = pipe.prepare(
            DEFAULT_PROMPT, width=run.width, height=run.height, steps=run.steps, seed=run.seed, images=images
        )
        seconds = [event.seconds for event in pipe.denoise(job)]
        if trial >= run.warmup:
            step_times.append(seconds)
            stats.append(job.stats)
        what = f"warm-up {trial + 1}" if trial < run.warmup else f"trial {trial - run.warmup + 1}"
        run.log(f"denoising {what}: {job.stats.denoise.seconds:.2f} s")
    memory = max(st.denoise.peak_memory for st in stats) / 1e9
    per_index = list(zip(*step_times, strict=True))  # (steps, trials)
    all_steps = [t for ts in per_index for t in ts]
    # KV steps are not alike (the first one also runs the reference pass): no one FLOP count for all.
    run.stages["denoise_step"] = _summary(run, all_steps, None if run.kv else step.total, memory)
    run.stages["denoise_step"]["per_step_median_s"] = [statistics.median(t) for t in per_index]
    run.stages["denoise"] = _summary(run, [st.denoise.seconds for st in stats], run.flops["denoise"], memory)
    if run.kv:
        ref_times = [st.reference_kv_seconds for st in stats]
        run.stages["kv_reference_pass"] = _summary(run, ref_times, ref_pass, memory)
        run.stages["kv_reference_pass"]["cache_gb"] = job.stats.reference_kv_bytes / 1e9
        run.stages["kv_first_step"] = _summary(run, per_index[0], step.total + ref_pass, memory)
        if run.steps > 1:  # steps 2.. of every trial
            run.stages["kv_cached_step"] = _summary(run, all_steps[run.trials :], step.total, memory)
    pipe.release("transformer")
    return job


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
    if text_encoder:
        ctx = _text_encoder_stage(run)
    else:
        ctx = mx.random.normal((1, MAX_LENGTH, info.params.context_in_dim), key=mx.random.key(seed + 3)).astype(
            pipe.dtype
        )
    pipe.remember_prompt(DEFAULT_PROMPT, ctx)
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
            "width": run.width,
            "height": run.height,
            "image_tokens": math.prod(token_grid(run.width, run.height)),
            "text_tokens": MAX_LENGTH,
            "blocks": f"{params.depth}+{params.depth_single}",
            "references": run.references,
            "reference_tokens": run.references * math.prod(token_grid(run.width, run.height)),
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
            "text_encoder_tflop": flops["text_encoder"] / 1e12 if "text_encoder" in flops else None,
            "vae_decode_tflop": flops["vae_decode"] / 1e12 if "vae_decode" in flops else None,
            "image_tflop": image_flops / 1e12,
        },
        "stages": stages,
    }


def _fmt_s(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def format_report(result: dict) -> str:
    """The results as a table for people (the JSON has everything, unrounded)."""
    c, m, st = result["config"], result["machine"], result["stages"]
    quant = f", {c['quantize']}-bit transformer" if c["quantize"] else ""
    weights = "random weights" if c["weights"] == "random" else c["model"]
    chip = (m["chip"] or m["cpu"]) + (f" ({m['gpu_cores']}-core GPU)" if m["gpu_cores"] else "")
    peak = f"{m['peak_tflops']:.1f} TFLOPS peak" if m["peak_tflops"] else "peak unknown here: TFLOPS only"
    lines = [
        f"flux_klein_mlx {m['flux_klein_mlx']} benchmark: {c['variant']} ({weights}), {c['width']}x{c['height']} "
        f"({c['image_tokens']} image + {c['text_tokens']} text tokens), {c['steps']} steps, {c['dtype']}{quant}",
        f"{c['blocks']} blocks; {c['references']} reference(s), {c['reference_tokens']} tokens"
        + (" (reference K/V cached: the first step runs the reference pass)" if c["reference_kv"] else ""),
        f"warm-up {c['warmup']}, trials {c['trials']}; {chip}, {m['cpu_cores']} CPU cores, "
        f"{m['memory_gb']} GB; {m['os']}; MLX {m['mlx']} on {m['device']}; {peak}"
        + (f"; BLAS: {m['blas']}" if m.get("blas") else ""),
        "",
        f"{'stage':<24}{'median':>10}{'min':>10}{'max':>10}{'TFLOP':>9}{'TFLOPS':>9}{'% peak':>8}{'peak mem':>11}",
    ]

    def row(label, s):
        if s is None:
            return
        med = s.get("median_s", s.get("seconds"))
        tf, tfs, pct = s.get("tflop"), s.get("tflops"), s.get("pct_of_peak")
        lines.append(
            f"{label:<24}{_fmt_s(med):>10}{_fmt_s(s.get('min_s')):>10}{_fmt_s(s.get('max_s')):>10}"
            f"{f'{tf:.3g}' if tf else '':>9}{f'{tfs:.3g}' if tfs else '':>9}{f'{pct:.0f} %' if pct else '':>8}"
            f"{s['peak_memory_gb']:>8.2f} GB"
        )

    load = "load" if c["weights"] == "checkpoint" else "make random"
    row(f"{load} text encoder", st.get("text_encoder_load"))
    row("text encoding", st.get("text_encoding"))
    row(f"{load} transformer", st.get("transformer_load"))
    row("denoising step", st.get("denoise_step"))
    row("  KV reference pass", st.get("kv_reference_pass"))
    row("  KV first step", st.get("kv_first_step"))
    row("  KV cached step", st.get("kv_cached_step"))
    row(f"denoise ({c['steps']} step{'s' if c['steps'] > 1 else ''})", st.get("denoise"))
    row(f"{load} VAE", st.get("vae_load"))
    row("VAE decode", st.get("vae_decode"))
    row("image (no loads)", st.get("image"))
    per = st["denoise_step"].get("per_step_median_s", [])
    if len(per) > 1:
        lines.append("per step (median): " + ", ".join(_fmt_s(t) for t in per))
    loads = [k for k in ("text_encoder_load", "transformer_load", "vae_load") if k in st]
    lines.append(  # the transformer always loads
        "resident weights: "
        + ", ".join(f"{k.replace('_load', '').replace('_', ' ')} {st[k]['weights_gb']:.2f} GB" for k in loads)
    )
    skipped = [n for k, n in (("text_encoding", "text encoding"), ("vae_decode", "VAE decode")) if k not in st]
    note = f" ({' and '.join(skipped)} skipped)" if skipped else ""
    lines.append("image = sum of stage medians: " + " + ".join(st["image"]["includes"]) + note)
    return "\n".join(lines)


def check_json_path(path: str | Path) -> Path:
    """`check_output_file` for --json; a folder is answered with a JSON name inside it (not an image's)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        raise FluxKleinError(f"--json {path} is a folder; give a file name inside it, e.g. {folder / 'benchmark.json'}")
    return check_output_file(path, "--json")


def write_json(result: dict, path: str | Path) -> Path:
    """Write `result` as JSON to `path`, or to a new name if `path` exists; returns where it went."""
    path = check_json_path(path)
    # Created exclusively under the first free name: never clobbers a file that appeared meanwhile.
    return write_exclusive(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))


# --- the command ------------------------------------------------------------------------------------


def parse_blocks(text: str) -> dict:
    """ "1+2" -> {"depth": 1, "depth_single": 2}; FluxKleinError for anything else."""
    parts = text.split("+")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or sum(int(p) for p in parts) == 0:
        raise FluxKleinError(
            f"--blocks must be DOUBLE+SINGLE block counts such as 1+2 (klein-9B has 8+24), not {text!r}"
        )
    return {"depth": int(parts[0]), "depth_single": int(parts[1])}


def variant_row(variant: str, blocks: str | None):
    """The random model's row of `VARIANTS`, with `--blocks` its (double, single) depth instead."""
    row = VARIANTS[variant]
    if blocks:
        row = dataclasses.replace(row, transformer=dataclasses.replace(row.transformer, **parse_blocks(blocks)))
    return row


def _check_sources(model, *, random_weights: bool, blocks, cold: bool, vae) -> None:
    """Real weights (--model) or random ones (--random-weights), and the options that go with each."""
    if model and random_weights:
        raise click.UsageError("give either --model or --random-weights, not both")
    if not model and not random_weights:
        raise click.UsageError("give --model ID|DIR for real weights, or --random-weights [--variant ...]")
    if blocks and model:
        raise click.UsageError("--blocks only applies to --random-weights")
    if model and click.get_current_context().get_parameter_source("variant").name != "DEFAULT":
        raise FluxKleinError(
            "--variant only applies to --random-weights; with --model the variant is read from its files"
        )
    if (cold or vae) and not model:
        raise click.UsageError(
            "--cold and --vae need --model (a folder to read; benchmarks/cold_start.py make writes "
            "one with random weights)"
        )


@click.command("benchmark")
@click.option("--model", "-m", default=None, help="Hugging Face repo id or local folder (real weights).")
@click.option("--random-weights", is_flag=True, help="Build the model with random weights: nothing is downloaded.")
@click.option(
    "--variant",
    type=click.Choice(list(VARIANTS)),
    default="klein-4b",
    show_default=True,
    help="Architecture for --random-weights.",
)
@click.option("--width", "-W", type=int, default=1024, show_default=True, help="Image width in px, multiple of 16.")
@click.option("--height", "-H", type=int, default=1024, show_default=True, help="Image height in px, multiple of 16.")
@click.option("--steps", type=click.IntRange(1, 1000), default=4, show_default=True, help="Denoising steps per image.")
@click.option(
    "--quantize",
    "-q",
    type=click.Choice(["4", "8"]),
    default=None,
    help="Quantize the transformer and text encoder (group 64) before timing, as generate does.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES)),
    default=None,
    help="Compute dtype [default: bfloat16 on a GPU, float32 on a CPU].",
)
@click.option("--warmup", type=click.IntRange(0, 100), default=1, show_default=True, help="Untimed runs per stage.")
@click.option("--trials", type=click.IntRange(1, 1000), default=3, show_default=True, help="Timed runs per stage.")
@click.option("--skip-text-encoder", is_flag=True, help="Feed random text embeddings instead of running Qwen3.")
@click.option("--skip-decode", is_flag=True, help="Do not run the VAE decoder.")
@click.option(
    "--references",
    type=click.IntRange(0, 10),
    default=None,
    help="Edit with this many reference pictures of the output size; klein 9B-KV caches them "
    "[default: 1 for klein 9B-KV, else 0].",
)
@click.option(
    "--blocks",
    default=None,
    metavar="DOUBLE+SINGLE",
    help="With --random-weights: fewer transformer blocks than the variant (e.g. 1+2), for slow machines.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights and inputs.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Also write the results as JSON here (an existing file is kept: a new name is chosen).",
)
@click.option(
    "--vae", default=None, help="With --model: another VAE or decoder (e.g. black-forest-labs/FLUX.2-small-decoder)."
)
@click.option(
    "--cold",
    is_flag=True,
    help="With --model: time to first image cold and warm (page cache dropped where possible), prompt "
    "cached or not, each stage, against bytes / disk rate + compute (one run of each kind).",
)
def benchmark(
    model,
    *,
    random_weights,
    variant,
    width,
    height,
    steps,
    quantize,
    dtype,
    warmup,
    trials,
    skip_text_encoder,
    skip_decode,
    references,
    blocks,
    seed,
    json_path,
    vae,
    cold,
):
    """Time load, text encoding, each denoising step and VAE decode; report TFLOPS and % of peak."""
    _check_sources(model, random_weights=random_weights, blocks=blocks, cold=cold, vae=vae)
    if json_path:  # before any work: a read-only, missing or mistyped folder must not cost the run
        check_json_path(json_path)
    row = variant_row(variant, blocks)
    dtype = dtype or (DEFAULT_DTYPE if mx.default_device() == mx.gpu else "float32")
    bits = int(quantize) if quantize else None
    log = partial(click.echo, err=True)
    if cold:
        measured = measure_cold(
            model, width=width, height=height, steps=steps, dtype=dtype, quantize=bits, vae=vae, log=log
        )
        click.echo(format_cold(measured))
        result = measured.to_json()
    else:
        if model:
            pipe = load(model, dtype=dtype, quantize=bits, vae=vae)
        else:
            pipe = random_pipeline(row, dtype=DTYPES[dtype], quantize=bits, seed=seed)
        if references is None:  # the KV model exists for editing: time what it is for
            references = 1 if pipe.info.reference_kv else 0
        result = run_benchmark(
            pipe,
            width=width,
            height=height,
            steps=steps,
            warmup=warmup,
            trials=trials,
            text_encoder=not skip_text_encoder,
            decode=not skip_decode,
            seed=seed,
            log=log,
            references=references,
        )
        click.echo(format_report(result))
    if json_path:
        final = write_json(result, json_path)
        log(f"wrote {final}" if final == Path(json_path).expanduser() else f"{json_path} exists; wrote {final} instead")


def main(argv=None) -> int:
    return run_command(benchmark, argv)
