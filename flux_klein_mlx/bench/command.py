"""`python -m flux_klein_mlx benchmark`: per-stage latency, peak memory, and efficiency against physics.

The stages and what they measure are `stages.py`; this module reads the options, builds the pipeline
(real weights, or random ones of a released model's shapes: every family's `variants`), prints the
report and writes the JSON. Efficiency comes from the analytic FLOP model in `flops.py`: achieved
TFLOPS = FLOPs / median time, and the percentage of the chip's peak where the chip is known.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import click
import mlx.core as mx

from ..cli import dtype_option, model_option, quantize_option, run_command
from ..dtypes import DEFAULT_DTYPE, DTYPES
from ..errors import FluxKleinError
from ..family import all_variants
from ..limits import MAX_STEPS
from ..run.pipeline import load
from ..storage.files import check_output_file, write_exclusive
from .random_model import random_pipeline
from .stages import run_benchmark
from .time_to_image import format_cold, measure_cold

RANDOM_MODELS = all_variants()  # the released models of every family (FLUX.2 [klein], FLUX 3 Image Klein), by name


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
    passes = c.get("text_tokens_per_pass", [c["text_tokens"]])
    texts = " / ".join(str(t) for t in passes) + (" (a pass each)" if len(passes) > 1 else "")
    lines = [
        f"flux_klein_mlx {m['flux_klein_mlx']} benchmark: {c['title']} ({weights}), {c['width']}x{c['height']} "
        f"({c['image_tokens']} image + {texts} text tokens), {c['steps']} steps, {c['dtype']}{quant}",
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
    row("  once per image (t = 0)", st.get("once_per_image"))
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
            "--blocks must be DOUBLE+SINGLE block counts such as 1+2 (klein-9B has 8+24; FLUX 3 Image Klein "
            f"5+28, its per-mode + single blocks), not {text!r}"
        )
    return {"depth": int(parts[0]), "depth_single": int(parts[1])}


def variant_row(variant: str, blocks: str | None):
    """The random model's row of `RANDOM_MODELS`, with `--blocks` its (double, single) depth instead."""
    row = RANDOM_MODELS[variant]
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
@model_option("Hugging Face repo id or local folder (real weights).", default=None)
@click.option("--random-weights", is_flag=True, help="Build the model with random weights: nothing is downloaded.")
@click.option(
    "--variant",
    type=click.Choice(list(RANDOM_MODELS)),
    default="klein-4b",
    show_default=True,
    help="Architecture for --random-weights.",
)
@click.option("--width", "-W", type=int, default=1024, show_default=True, help="Image width in px, multiple of 16.")
@click.option("--height", "-H", type=int, default=1024, show_default=True, help="Image height in px, multiple of 16.")
@click.option(
    "--steps", type=click.IntRange(1, MAX_STEPS), default=4, show_default=True, help="Denoising steps per image."
)
@quantize_option("Quantize the transformer and text encoder (group 64) to 4 or 8 bits before timing, as generate does.")
@dtype_option(default=None, help="Compute dtype [default: bfloat16 on a GPU, float32 on a CPU].")
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
@click.option(  # mx.random.key takes an unsigned 64-bit seed, to which the stages add small offsets
    "--seed",
    type=click.IntRange(0, 2**32 - 1),
    default=0,
    show_default=True,
    help="Seed of the random weights and inputs.",
)
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
    log = partial(click.echo, err=True)
    if cold:
        measured = measure_cold(
            model, width=width, height=height, steps=steps, dtype=dtype, quantize=quantize, vae=vae, log=log
        )
        click.echo(format_cold(measured))
        result = measured.to_json()
    else:
        if model:
            pipe = load(model, dtype=dtype, quantize=quantize, vae=vae)
        else:
            pipe = random_pipeline(row, dtype=DTYPES[dtype], quantize=quantize, seed=seed)
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
