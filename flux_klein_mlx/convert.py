"""`convert` and `quantize`: write a FLUX.2 [klein] model once as an MLX folder (optionally
quantized), or quantize a converted folder into a new one. The CLI commands are at the bottom.

An MLX folder (read back by `loading.describe` / `components.load_component`):

    config.json                  format marker and version, variant, is_distilled, reference_kv
                                 (klein 9B-KV), dtype, source, and per component its config and
                                 quantization record (or null)
    transformer.safetensors      our parameter names (post-sanitize), so loading needs no mapping;
    text_encoder.safetensors     over 5 GB a component is split into prefix-0000i-of-0000n shards
    vae.safetensors              + prefix.safetensors.index.json; the VAE is never quantized
    tokenizer/                   the snapshot's tokenizer files

Conversion streams: the source tensors are opened lazily, mapped to our names, cast and
(optionally) quantized as lazy arrays, and written one tensor at a time, so peak memory stays
near the largest tensor, not the model. Everything is written into `<output>.tmp-XXXX` next to
the output and renamed into place at the end; on any error or interruption the temporary folder
is removed and nothing appears at the output path. The source is never modified.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import mlx.core as mx
from mlx.utils import tree_flatten

from . import __version__
from .cli import dtype_option, lora_options, model_option, quantize_option
from .dtypes import DEFAULT_DTYPE, as_dtype, dtype_name
from .errors import FluxKleinError
from .family import FAMILIES
from .lora.apply import apply_loras, load_loras, pair_scales
from .models.quantize import already_quantized, check_quantization, quantize_model
from .models.tokenizer import tokenizer_files
from .run.components import assemble_component, check_weights
from .run.loading import COMPONENTS, FORMAT, FORMAT_VERSION, WHAT, ModelInfo, describe, is_mlx_folder
from .storage.files import check_disk_space, folder_transaction, refuse_broken_links
from .storage.weights import save_safetensors_sharded
from .upsample.runtime import convert_upsampler, is_upsampler

MAX_SHARD_BYTES = 5 << 30

# progress(component, bytes written so far, bytes of the component)
Progress = Callable[[str, int, int], None]


@dataclass
class Part:
    """One component, ready to write: lazy output tensors under our names, and its config entry."""

    name: str
    config: dict
    weights: dict[str, mx.array]
    quantization: dict | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.weights.values())


def make_part(
    info: ModelInfo, name: str, *, dtype=None, bits: int | None = None, group_size: int = 64, loras: list | None = None
) -> Part:
    """One component of a described model, strictly checked, cast and quantized, all lazily: no
    tensor is read from disk here. `loras` (transformer only, from `lora.load_loras`) are fused
    into the float weights before quantization."""
    bits = None if name == "vae" else bits
    # with LoRAs: quantized once they are fused
    module, record = assemble_component(info, name, dtype, bits=None if loras else bits, group_size=group_size)
    if loras:
        apply_loras(module, loras, keep_originals=False, evaluate=False)  # lazy: each fused weight computed as written
        if bits:
            record = quantize_model(module, bits, group_size)
    return Part(name, info.configs[name], dict(tree_flatten(module.parameters())), record)


def _describe_source(model, base, vae):
    """The model to convert, described; refused in one line when it is converted already, or when `base`
    is given for a whole model."""
    info = describe(model, base, vae)
    if info.format == "mlx":
        raise FluxKleinError(
            f"{info.path} is already converted; use it as it is, or `quantize` it to make a 4- or 8-bit copy"
        )
    if base is not None and info.format != "bfl":
        raise FluxKleinError(
            f"--base is only for a single-file transformer; {model} is a whole model with its own text encoder "
            "and VAE: leave --base out"
        )
    return info


def _source_record(model, info, vae) -> tuple[dict, list[Path]]:
    """Where the converted folder came from (config.json's "source"), and `vae=`'s folders (the output may
    not be inside them either)."""
    source = {"model": str(model), "path": str(info.path), "format": info.format}
    if info.format == "bfl":
        source["base"] = str(info.tokenizer.parent)
    vae_folders = []
    if vae is not None:
        source["vae"] = str(vae)
        vae_folders = [f.parent for f in info.decoder_files or info.files["vae"]]
    return source, vae_folders


def convert_model(
    model: str | Path,
    output: str | Path,
    *,
    dtype: str = DEFAULT_DTYPE,
    bits: int | None = None,
    group_size: int = 64,
    base: str | Path | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Progress | None = None,
    loras: list | None = None,
    lora_partial: bool = False,
    vae: str | Path | None = None,
) -> dict:
    """Convert a FLUX.2 [klein] model into an MLX folder at `output`; returns its config.

    `model` is a diffusers snapshot folder (model_index.json, transformer/, text_encoder/, vae/,
    tokenizer/), a Hugging Face repo id, or a BFL single-file transformer (`.safetensors`), whose
    text encoder, VAE and tokenizer then come from `base` (default: the folder the file is in).
    `bits` 4 or 8 quantizes the transformer and text encoder (group size `group_size`); the VAE
    stays in `dtype`. `loras` (paths or (path, scale), as for `load`) are baked into the transformer
    before quantization and recorded in config.json ("loras": name, sha256, scale). `vae` (a
    folder, file or repo id, e.g. black-forest-labs/FLUX.2-small-decoder) replaces the model's VAE,
    or only its decoder, in the written folder (`loading.with_vae`); recorded as source "vae".
    """
    cast = as_dtype(dtype)
    if bits is not None:
        check_quantization(bits, group_size)
    refuse_broken_links(Path(output).expanduser(), f"--output {output}")
    info = _describe_source(model, base, vae)
    check_weights(info)  # every file's header, keys and shapes, before anything is written
    baked = load_loras(loras, info.params, lora_partial)  # all checked before anything is written
    parts = [
        make_part(
            info, name, dtype=cast, bits=bits, group_size=group_size, loras=baked if name == "transformer" else None
        )
        for name in COMPONENTS
    ]
    source, vae_folders = _source_record(model, info, vae)
    meta = folder_meta(info, dtype_name(cast), source, loras=[lora.record() for lora in baked] or None)
    return write_folder(
        output,
        parts,
        meta,
        overwrite=overwrite,
        sources=[info.path, info.tokenizer.parent, *vae_folders],
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )


def quantize_folder(
    model: str | Path,
    output: str | Path,
    *,
    bits: int,
    group_size: int = 64,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> dict:
    """Quantize a converted MLX folder into a new one (transformer and text encoder; the VAE is copied)."""
    check_quantization(bits, group_size)
    refuse_broken_links(Path(output).expanduser(), f"--output {output}")
    info = describe(model)
    if info.format != "mlx":
        raise FluxKleinError(
            f"{info.path} is not a folder written by `flux_klein_mlx convert`; convert it first "
            f"(convert --quantize {bits} does both)"
        )
    if done := [r["bits"] for r in info.quantization.values() if r]:
        instead = "quantize the unquantized folder, or convert the original model again with --quantize"
        raise already_quantized(str(info.path), done[0], instead)
    check_weights(info)
    parts = [make_part(info, name, dtype=None, bits=bits, group_size=group_size) for name in COMPONENTS]
    source = {"model": str(model), "path": str(info.path), "format": FORMAT, "original": info.original}
    return write_folder(
        output,
        parts,
        folder_meta(info, info.stored_dtype, source),
        overwrite=overwrite,
        sources=[info.path],
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )


# --- writing the folder ----------------------------------------------------------------------------------


def folder_meta(info: ModelInfo, dtype: str, source: dict, loras: list | None = None) -> dict:
    """`write_folder`'s `meta` for a folder written from the model `info` describes, in `dtype`."""
    return {
        "family": info.family.key,
        "variant": info.variant,
        "is_distilled": info.is_distilled,
        "reference_kv": info.reference_kv,
        "dtype": dtype,
        "source": source,
        "scheduler": info.scheduler,
        "tokenizer_source": info.tokenizer,
        "loras": loras,  # baked into the transformer (their records), or None
    }


def _check_paths(sources: list[Path], output: Path, overwrite: bool) -> None:
    out = output.resolve()
    for src in sources:
        src = src.resolve()
        if out == src or src in out.parents:
            raise FluxKleinError(f"--output {output} is inside the source {src}; choose a folder outside it")
        if out in src.parents:
            raise FluxKleinError(f"--output {output} contains the source {src}; choose another folder")
    if output.exists() or output.is_symlink():
        if not output.is_dir():
            raise FluxKleinError(f"--output {output} exists and is not a folder; choose another path")
        if not overwrite:
            raise FluxKleinError(f"{output} already exists; pass --overwrite to replace it, or choose another --output")
        # --overwrite replaces only what `convert`/`quantize` wrote (or an empty folder): never photos or documents.
        if not is_mlx_folder(output) and any(output.iterdir()):
            raise FluxKleinError(
                f"--overwrite refused: {output} is not a folder written by `flux_klein_mlx convert` (no format marker "
                "in its config.json), so it is left untouched; choose another --output"
            )


def write_folder(
    output: str | Path,
    parts: list[Part],
    meta: dict,
    *,
    overwrite: bool = False,
    sources: list[Path] = (),
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> dict:
    """Write an MLX folder atomically: into `<output>.tmp-XXXX`, renamed into place at the end.

    `meta` holds the top-level config fields (variant, is_distilled, dtype, source, scheduler,
    tokenizer_source). Refuses an existing output unless `overwrite`, an output inside a source,
    and too little free disk space, before writing anything. Returns the config written.
    """
    output = Path(output).expanduser()
    if output.is_symlink() and output.is_dir():
        # Replace the folder the link points to; the link itself stays and points at the new folder.
        output = output.resolve()
    _check_paths(list(sources), output, overwrite)
    tokenizer_src = Path(meta["tokenizer_source"])
    if not tokenizer_src.is_dir():
        raise FluxKleinError(
            f"missing tokenizer/ in {tokenizer_src.parent}: the snapshot is incomplete, download it again"
        )
    tokenizer = tokenizer_files(tokenizer_src)  # FLUX 3's sit in text_encoder/: its weights stay behind
    check_disk_space(
        output, sum(p.nbytes for p in parts) + sum(f.stat().st_size for f in tokenizer), "the converted model"
    )

    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flux_klein_mlx_version": __version__,
        "family": meta["family"],
        "variant": meta["variant"],
        "is_distilled": bool(meta["is_distilled"]),
        "reference_kv": bool(meta.get("reference_kv", False)),
        "dtype": meta["dtype"],
        "source": meta["source"],
        **{p.name: {"config": p.config, "quantization": p.quantization} for p in parts},
        "tokenizer": "tokenizer",
        "scheduler": meta.get("scheduler"),
        **({"loras": meta["loras"]} if meta.get("loras") else {}),  # LoRAs baked into the transformer
    }
    with folder_transaction(output) as tmp:
        for part in parts:
            _write_part(
                part, tmp, output=output, max_shard_bytes=max_shard_bytes, progress=progress or (lambda *_: None)
            )
        (tmp / "tokenizer").mkdir()
        for f in tokenizer:
            shutil.copy2(f, tmp / "tokenizer" / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _write_part(part: Part, folder: Path, *, output: Path, max_shard_bytes: int, progress: Progress) -> None:
    total = part.nbytes
    done = 0

    def on_tensor(_name: str, nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress(part.name, done, total)

    progress(part.name, 0, total)
    try:
        save_safetensors_sharded(
            part.weights, folder, prefix=part.name, max_shard_bytes=max_shard_bytes, on_tensor=on_tensor
        )
    except (OSError, RuntimeError) as e:  # disk full, unreadable source bytes, ...
        raise FluxKleinError(
            f"writing the {WHAT[part.name]} failed ({str(e).splitlines()[0][:160]}); nothing was written to {output}"
        ) from None
    mx.clear_cache()


@contextlib.contextmanager
def progress_bars() -> Iterator[Progress]:
    """One click progress bar per component on stderr: the `progress` callback of the commands."""
    stack = contextlib.ExitStack()
    bars = {}

    def update(name: str, done: int, total: int) -> None:
        if name not in bars:
            stack.close()  # the previous component's bar ends
            bar = click.progressbar(length=max(total, 1), label=f"{name:<12}", file=sys.stderr, show_pos=False)
            bars[name] = stack.enter_context(bar)
        bars[name].update(done - bars[name].pos)

    with stack:
        yield update


def summary(output: str | Path, config: dict) -> str:
    """One line: where, what, how big."""
    output = Path(output)
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    q = [f"{WHAT[n]} {config[n]['quantization']['bits']}-bit" for n in COMPONENTS if config[n]["quantization"]]
    baked = f", {len(config['loras'])} LoRA(s) baked in" if config.get("loras") else ""
    source = config.get("source") or {}
    # A single transformer file cannot say it is the 9B-KV model: the flag is its base snapshot's.
    kv = (
        f", reference KV because its base {source['base']} is a Flux2KleinKVPipeline"
        if config.get("reference_kv") and source.get("format") == "bfl"
        else ""
    )
    return (
        f"wrote {output} ({config['variant']}{kv}, {config['dtype']}{', ' + ', '.join(q) if q else ''}{baked}, "
        f"{size / 1e9:.2f} GB)"
    )


@contextlib.contextmanager
def interrupt_on_termination():
    """SIGTERM and SIGHUP end a conversion like Ctrl-C (SIGINT): the temporary folder is removed."""

    def handler(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Handlers can only be set in the main thread; elsewhere the caller's handling stays.
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP) if main}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@click.command("convert")
@model_option("Diffusers snapshot folder, Hugging Face repo id, or BFL single-file .safetensors.", required=True)
@click.option("--output", "-o", required=True, type=click.Path(), help="The MLX folder to write.")
@dtype_option(help="Weight dtype.")
@quantize_option("Quantize transformer and text encoder to 4 or 8 bits.", "--quantize", "-q", "bits")
@click.option("--group-size", type=int, default=64, show_default=True, help="Quantization group size (32, 64 or 128).")
@click.option(
    "--base",
    default=None,
    help="For a single-file transformer: folder or repo id with text_encoder/, vae/, tokenizer/.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@lora_options("A LoRA baked into the transformer")
@click.option("--lora-partial", is_flag=True, help="Bake a LoRA even when some of its modules match no layer.")
@click.option(
    "--vae",
    default=None,
    help="Write this VAE instead of the model's: folder, .safetensors or repo id "
    "(e.g. black-forest-labs/FLUX.2-small-decoder); a decoder-only file replaces just the decoder.",
)
def convert(model, output, *, dtype, bits, group_size, base, overwrite, loras, lora_scales, lora_partial, vae):
    """Convert a FLUX.2 [klein] model into an MLX folder (optionally 4/8-bit, optionally with LoRAs baked in)."""
    if any(
        is_upsampler(model, f.upsampler) for f in FAMILIES.values()
    ):  # a family's prompt upsampler: mlx-vlm writes it
        if loras or base or vae:
            raise FluxKleinError("the prompt upsampler takes no --lora, --base or --vae; convert it alone")
        click.echo(f"wrote {convert_upsampler(model, output, bits=bits, group_size=group_size, overwrite=overwrite)}")
        return
    with interrupt_on_termination(), progress_bars() as bars:
        config = convert_model(
            model,
            output,
            dtype=dtype,
            bits=bits,
            group_size=group_size,
            base=base,
            overwrite=overwrite,
            progress=bars,
            loras=pair_scales(loras, lora_scales),
            lora_partial=lora_partial,
            vae=vae,
        )
    click.echo(summary(output, config))


@click.command("quantize")
@model_option("A folder written by `convert` (unquantized).", required=True)
@click.option("--bits", "-b", type=int, required=True, help="4 or 8.")
@click.option(
    "--group-size", type=int, default=64, show_default=True, help="Values sharing one scale and bias: 32, 64 or 128."
)
@click.option("--output", "-o", required=True, type=click.Path(), help="The quantized MLX folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def quantize_command(model, *, bits, group_size, output, overwrite):
    """Quantize a converted MLX folder's transformer and text encoder to 4 or 8 bits."""
    if any(
        is_upsampler(model, f.upsampler) for f in FAMILIES.values()
    ):  # a family's prompt upsampler: mlx-vlm writes it
        click.echo(f"wrote {convert_upsampler(model, output, bits=bits, group_size=group_size, overwrite=overwrite)}")
        return
    with interrupt_on_termination(), progress_bars() as bars:
        config = quantize_folder(model, output, bits=bits, group_size=group_size, overwrite=overwrite, progress=bars)
    click.echo(summary(output, config))
