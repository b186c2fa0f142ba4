"""`python -m flux_klein_mlx lora convert | info`: a LoRA file into the layout another tool loads, and
what a LoRA file is. Thin wrappers over `lora.convert`; every refusal is one line (cli.run_command)."""

from __future__ import annotations

import click

from .convert import convert_lora, describe_lora, describe_number
from .layouts import LAYOUTS


@click.group("lora")
def lora():
    """Convert LoRA files between layouts, or describe one."""


@lora.command("convert")
@click.argument("source")
@click.option("--output", "-o", required=True, help="The file to write (.safetensors); never overwritten.")
@click.option(
    "--format",
    "layout",
    default="comfyui",
    show_default=True,
    help=f"The layout to write: {', '.join(LAYOUTS)} (comfyui: ComfyUI's and ai-toolkit's BFL names; "
    "kohya: musubi-tuner's; all three load in diffusers; a LoKr: comfyui only).",
)
def convert(source, output, layout):
    """Write SOURCE (any LoRA --lora reads: diffusers/PEFT, kohya, ai-toolkit/ComfyUI, LyCORIS, mflux,
    flux-2-swift-mlx) in another layout, with the same effect."""
    written = convert_lora(source, output, layout)
    click.echo(f"wrote {written} ({layout})")


@lora.command("info")
@click.argument("path")
def info(path):
    """Describe a LoRA file: format, modules, rank, alpha, trainer, base model, klein size, the training
    (steps, schedule, sizes, dataset: from a trained file's header), hashes."""
    d = describe_lora(path)
    alphas = ", ".join(describe_number(a) for a in d["alphas"])
    # the trained rank (from the header) where a trainer wrote it; else each rank of the file's pairs
    ranks = ", ".join(str(r) for r in d["ranks"] if r)
    lines = [
        ("file", d["file"]),
        ("format", d["format"]),
        ("modules", f"{d['modules']} (on {d['layers']} layers)"),
        ("rank", lokr_rank(d, ranks) if d["lokr"] else ranks),
        ("alpha", alphas or None),
        ("model", d["model"]),
        ("dtype", d["dtype"]),
        ("trainer", d["trainer"]),
        ("base model", d["base_model"]),
        ("trigger", d["trigger"]),
        *d["training"],
        ("sha256", d["sha256"]),
        ("AutoV3", f"{d['autov3']} (A1111 / Civitai)"),
    ]
    for key, value in lines:
        if value is not None:
            click.echo(f"{key + ':':<12}{value}")


def lokr_rank(d: dict, ranks: str) -> str:
    """A LoKr's rank line: its w2 pairs' rank where it has them, the trained --rank where the header says it."""
    if d["trained_rank"]:
        return f"LoKr, --rank {ranks} (the rank of w2 where it is a low-rank pair)"
    return f"LoKr, {ranks}" if d["alphas"] else "LoKr"
