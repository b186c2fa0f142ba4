"""Convert a FLUX.2 [klein] model into an MLX folder once (optionally quantized), and load it back.

An MLX folder (written by `convert_model` / `quantize_folder`, read by `load_component`):

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

The `convert` click command at the bottom is the CLI (`python -m flux_klein_mlx convert`); the
`quantize` command lives in quantize.py and calls `quantize_folder`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import __version__
from .errors import FluxKleinError
from .kv_cache import KV_PIPELINE_CLASS
from .quantize import apply_quantization, check_quantization, check_record, evaluate_by_layer, quantize_model
from .text_encoder import Qwen3Config, Qwen3TextEncoder, sanitize_qwen3_weights
from .transformer import FluxKlein, FluxKleinParams, infer_params, sanitize_flux2_klein_weights
from .vae import AutoEncoder, AutoEncoderConfig, sanitize_vae_weights
from .weights import (
    component_files,
    load_into,
    prefixed_files,
    read_json,
    read_safetensors,
    read_weight_files,
    resolve_model,
    save_safetensors_sharded,
)

FORMAT = "flux_klein_mlx"
FORMAT_VERSION = 1
COMPONENTS = ("transformer", "text_encoder", "vae")
WHAT = {"transformer": "transformer", "text_encoder": "text encoder", "vae": "VAE"}
MAX_SHARD_BYTES = 5 << 30
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

# progress(component, bytes written so far, bytes of the component)
Progress = Callable[[str, int, int], None]


def as_dtype(dtype) -> mx.Dtype | None:
    """None, an mx.Dtype or its name ("bfloat16", "float16", "float32") -> mx.Dtype or None."""
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise FluxKleinError(f"dtype {dtype!r} is not supported; choose bfloat16, float16 or float32")
    return DTYPES[dtype]


def dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


# --- models from stored configs ----------------------------------------------------------------------


def build_component(name: str, config: dict) -> nn.Module:
    """An unloaded (lazily initialised, so free) model for one component's stored config."""
    if name == "transformer":
        return FluxKlein(FluxKleinParams.from_dict(config))
    if name == "text_encoder":
        return Qwen3TextEncoder(Qwen3Config.from_dict(config))
    if name == "vae":
        return AutoEncoder(AutoEncoderConfig.from_dict(config))
    raise ValueError(f"unknown component {name!r}")


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


def make_part(name: str, config: dict, weights: dict[str, mx.array], dtype=None, bits=None, group_size=64) -> Part:
    """Check `weights` (our names) strictly against the component built from `config`, cast and
    quantize them, all lazily: no tensor is read from disk here."""
    model = build_component(name, config)
    load_into(model, weights, WHAT[name], dtype=dtype)
    record = quantize_model(model, bits, group_size) if bits and name != "vae" else None
    out = dict(tree_flatten(model.parameters()))
    return Part(name, config, out, record)


# --- reading sources -----------------------------------------------------------------------------------


def read_config(folder: str | Path) -> dict:
    """The config.json of an MLX folder, checked for our format marker and version."""
    path = Path(folder) / "config.json"
    config = read_json(path)
    if config.get("format") != FORMAT:
        raise FluxKleinError(f"{folder} is not a folder written by `flux_klein_mlx convert` (no format marker in config.json)")
    if int(config.get("format_version", 0)) > FORMAT_VERSION:
        raise FluxKleinError(f"{folder} was written by a newer flux_klein_mlx (format {config['format_version']}); upgrade flux_klein_mlx")
    for name in COMPONENTS:
        entry = config.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            raise FluxKleinError(f"{path} has no {WHAT[name]} config; convert the model again")
        if entry.get("quantization") is not None:
            check_record(entry["quantization"], WHAT[name])
    return config


def is_mlx_folder(path: str | Path) -> bool:
    """Whether `path` is a folder written by `convert` (has a config.json with our format marker)."""
    path = Path(path) / "config.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (ValueError, AttributeError):
        return False


def _snapshot_parts_folder(folder: Path) -> Path:
    if not folder.is_dir():
        raise FluxKleinError(f"missing {folder.name}/ in {folder.parent}: the snapshot is incomplete, download it again")
    return folder


def _transformer_from_diffusers(folder: Path) -> tuple[dict, dict[str, mx.array]]:
    folder = _snapshot_parts_folder(folder)
    config = read_json(folder / "config.json")
    if config.get("guidance_embeds"):
        raise FluxKleinError(
            f"not a klein checkpoint: it is FLUX.2-dev ({folder / 'config.json'} has guidance_embeds); "
            "use a FLUX.2 [klein] 4B or 9B model"
        )
    FluxKleinParams.from_dict(config)  # validates before any weight is touched
    return config, sanitize_flux2_klein_weights(read_weight_files(component_files(folder)))


def _transformer_from_bfl(file: Path, base: Path) -> tuple[dict, dict[str, mx.array]]:
    weights = sanitize_flux2_klein_weights(read_safetensors(file))
    params = infer_params(weights)
    # The base snapshot's transformer/config.json also carries theta/eps/axes; use it when it describes
    # the same shapes (a 4B file next to a 4B snapshot), else the shapes' own parameters.
    base_config = base / "transformer" / "config.json"
    if base_config.is_file():
        config = read_json(base_config)
        if FluxKleinParams.from_dict(config)._shape_key() == params._shape_key():
            return config, weights
    return dataclasses.asdict(params), weights


def _is_distilled(snapshot: Path) -> bool:
    index = snapshot / "model_index.json"
    if not index.is_file():
        return False
    return bool(read_json(index).get("is_distilled", False)) or _is_kv(snapshot)


def _is_kv(snapshot: Path) -> bool:
    """A klein 9B-KV snapshot (distilled, although its index has no is_distilled key)."""
    index = snapshot / "model_index.json"
    return index.is_file() and read_json(index).get("_class_name") == KV_PIPELINE_CLASS


def inspect_source(model: str | Path, base: str | Path | None = None) -> dict:
    """Resolve `model` (and `base`) and say what it is.

    Returns {"format": "diffusers" | "bfl", "path": Path, "base": Path (where the text encoder, VAE,
    tokenizer come from)}. A converted MLX folder or anything else raises FluxKleinError.
    """
    path = resolve_model(model)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FluxKleinError(f"{path} is not a .safetensors file; pass a model folder, a repo id or a BFL .safetensors file")
        base_path = resolve_model(base) if base is not None else path.parent
        if not (base_path / "text_encoder").is_dir() or not (base_path / "vae").is_dir():
            raise FluxKleinError(
                f"a single transformer file needs the text encoder, VAE and tokenizer of a diffusers snapshot, "
                f"and {base_path} has none; pass --base with a FLUX.2 [klein] folder or repo id"
            )
        return {"format": "bfl", "path": path, "base": base_path}
    if is_mlx_folder(path):
        raise FluxKleinError(
            f"{path} is already converted; use it as it is, or `quantize` it to make a 4- or 8-bit copy"
        )
    if not (path / "model_index.json").is_file() and not (path / "transformer").is_dir():
        raise FluxKleinError(
            f"{path} is not a FLUX.2 [klein] snapshot: it has neither model_index.json nor transformer/"
        )
    return {"format": "diffusers", "path": path, "base": path if base is None else resolve_model(base)}


def source_parts(source: dict, dtype, bits, group_size) -> tuple[list[Part], dict]:
    """The three lazy components of a diffusers/BFL source and the metadata for config.json."""
    path, base = source["path"], source["base"]
    if source["format"] == "bfl":
        t_config, t_weights = _transformer_from_bfl(path, base)
        # A Base checkpoint next to (or based on) a distilled snapshot is still a Base model.
        is_distilled = _is_distilled(base) and "base" not in path.name.lower()
        reference_kv = _is_kv(base)
    else:
        t_config, t_weights = _transformer_from_diffusers(path / "transformer")
        is_distilled = _is_distilled(path)
        reference_kv = _is_kv(path)
    te_folder = _snapshot_parts_folder(base / "text_encoder")
    te_config = read_json(te_folder / "config.json")
    te_weights = sanitize_qwen3_weights(read_weight_files(component_files(te_folder)))
    vae_folder = _snapshot_parts_folder(base / "vae")
    vae_config = read_json(vae_folder / "config.json")
    vae_weights = sanitize_vae_weights(read_weight_files(component_files(vae_folder)))

    params = FluxKleinParams.from_dict(t_config)
    te = Qwen3Config.from_dict(te_config)
    vae = AutoEncoderConfig.from_dict(vae_config)
    if params.context_in_dim != 3 * te.hidden_size:
        raise FluxKleinError(
            f"the transformer reads {params.context_in_dim}-wide text embeddings but the text encoder in {te_folder} "
            f"makes {3 * te.hidden_size}; take the text encoder from the same model (klein-4B: Qwen3-4B, klein-9B: Qwen3-8B)"
        )
    if params.in_channels != vae.token_channels:
        raise FluxKleinError(
            f"the transformer reads {params.in_channels} latent channels but the VAE in {vae_folder} makes "
            f"{vae.token_channels}; use the FLUX.2 VAE"
        )
    parts = [
        make_part("transformer", t_config, t_weights, dtype, bits, group_size),
        make_part("text_encoder", te_config, te_weights, dtype, bits, group_size),
        make_part("vae", vae_config, vae_weights, dtype, None),
    ]
    scheduler = base / "scheduler" / "scheduler_config.json"
    meta = {
        "variant": params.variant,
        "is_distilled": is_distilled,
        "reference_kv": reference_kv,
        "scheduler": read_json(scheduler) if scheduler.is_file() else None,
        "tokenizer_source": base / "tokenizer",
    }
    return parts, meta


# --- writing the folder ----------------------------------------------------------------------------------


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


def _check_disk_space(output: Path, needed: int) -> None:
    probe = output.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    # 1 % + 64 MB of headroom for the index/config files and the file system's own needs.
    if free < needed * 1.01 + (64 << 20):
        raise FluxKleinError(
            f"not enough disk space for {output}: the converted model needs about {needed / 1e9:.2f} GB "
            f"and {free / 1e9:.2f} GB are free; free some space or choose another --output"
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
    _check_paths(list(sources), output, overwrite)
    tokenizer_src = Path(meta["tokenizer_source"])
    if not tokenizer_src.is_dir():
        raise FluxKleinError(f"missing tokenizer/ in {tokenizer_src.parent}: the snapshot is incomplete, download it again")
    tokenizer_files = [f for f in sorted(tokenizer_src.iterdir()) if f.is_file()]
    _check_disk_space(output, sum(p.nbytes for p in parts) + sum(f.stat().st_size for f in tokenizer_files))

    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flux_klein_mlx_version": __version__,
        "variant": meta["variant"],
        "is_distilled": bool(meta["is_distilled"]),
        "reference_kv": bool(meta.get("reference_kv", False)),
        "dtype": meta["dtype"],
        "source": meta["source"],
        **{p.name: {"config": p.config, "quantization": p.quantization} for p in parts},
        "tokenizer": "tokenizer",
        "scheduler": meta.get("scheduler"),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_sibling(output, "tmp")
    try:
        for part in parts:
            total, done = part.nbytes, 0

            def on_tensor(_name: str, nbytes: int, part=part, total=total) -> None:
                nonlocal done
                done += nbytes
                if progress is not None:
                    progress(part.name, done, total)

            if progress is not None:
                progress(part.name, 0, total)
            try:
                save_safetensors_sharded(part.weights, tmp, part.name, max_shard_bytes, on_tensor=on_tensor)
            except (OSError, RuntimeError) as e:  # disk full, unreadable source bytes, ...
                raise FluxKleinError(
                    f"writing the {WHAT[part.name]} failed ({str(e).splitlines()[0][:160]}); nothing was written to {output}"
                ) from None
            mx.clear_cache()
        (tmp / "tokenizer").mkdir()
        for f in tokenizer_files:
            shutil.copy2(f, tmp / "tokenizer" / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _move_into_place(tmp, output)
    except BaseException:  # also KeyboardInterrupt: never leave a partial folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config


def _fresh_sibling(output: Path, tag: str) -> Path:
    """Create and return an empty folder `<output>.<tag>-XXXXXXXX` next to `output` (umask permissions)."""
    while True:
        path = output.with_name(f"{output.name}.{tag}-{secrets.token_hex(4)}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _move_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished folder to `output`; an existing output is moved aside first and deleted
    only once the new one is in place (restored if the rename fails)."""
    if not output.exists():
        os.rename(tmp, output)
        return
    old = _fresh_sibling(output, "old")
    os.rmdir(old)
    os.rename(output, old)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)


def convert_model(
    model: str | Path,
    output: str | Path,
    *,
    dtype: str = "bfloat16",
    bits: int | None = None,
    group_size: int = 64,
    base: str | Path | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> dict:
    """Convert a FLUX.2 [klein] model into an MLX folder at `output`; returns its config.

    `model` is a diffusers snapshot folder (model_index.json, transformer/, text_encoder/, vae/,
    tokenizer/), a Hugging Face repo id, or a BFL single-file transformer (`.safetensors`), whose
    text encoder, VAE and tokenizer then come from `base` (default: the folder the file is in).
    `bits` 4 or 8 quantizes the transformer and text encoder (group size `group_size`); the VAE
    stays in `dtype`.
    """
    cast = as_dtype(dtype)
    if bits is not None:
        check_quantization(bits, group_size)
    source = inspect_source(model, base)
    parts, meta = source_parts(source, cast, bits, group_size)
    meta["dtype"] = dtype_name(cast)
    meta["source"] = {"model": str(model), "path": str(source["path"]), "format": source["format"]}
    if source["format"] == "bfl":
        meta["source"]["base"] = str(source["base"])
    return write_folder(
        output, parts, meta, overwrite=overwrite, sources=[source["path"], source["base"]],
        max_shard_bytes=max_shard_bytes, progress=progress,
    )  # fmt: skip


def quantize_folder(
    model: str | Path,
    output: str | Path,
    bits: int,
    group_size: int = 64,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> dict:
    """Quantize a converted MLX folder into a new one (transformer and text encoder; the VAE is copied)."""
    check_quantization(bits, group_size)
    folder = resolve_model(model)
    if not is_mlx_folder(folder):
        raise FluxKleinError(f"{folder} is not a folder written by `flux_klein_mlx convert`; convert it first (convert --quantize {bits} does both)")
    config = read_config(folder)
    done = [(n, config[n]["quantization"]["bits"]) for n in COMPONENTS if config[n]["quantization"]]
    if done:
        raise FluxKleinError(
            f"{folder} is already quantized ({done[0][1]}-bit {WHAT[done[0][0]]}); quantize the unquantized "
            "folder, or convert the original model again with --quantize"
        )
    parts = []
    for name in COMPONENTS:
        weights = read_weight_files(prefixed_files(folder, name))
        parts.append(make_part(name, config[name]["config"], weights, None, None if name == "vae" else bits, group_size))
    meta = {
        "variant": config["variant"],
        "is_distilled": config["is_distilled"],
        "reference_kv": bool(config.get("reference_kv", False)),
        "dtype": config["dtype"],
        "source": {"model": str(model), "path": str(folder), "format": FORMAT, "original": config.get("source")},
        "scheduler": config.get("scheduler"),
        "tokenizer_source": folder / config.get("tokenizer", "tokenizer"),
    }
    return write_folder(
        output, parts, meta, overwrite=overwrite, sources=[folder], max_shard_bytes=max_shard_bytes, progress=progress
    )


# --- loading --------------------------------------------------------------------------------------------


def load_component(
    folder: str | Path, name: str, dtype=None, quantize: int | None = None, group_size: int = 64
) -> nn.Module:
    """Load one component ("transformer", "text_encoder" or "vae") of an MLX folder, evaluated.

    A quantized component is rebuilt from its config.json record and loaded strictly. `dtype`
    casts floating tensors (None: as stored). `quantize` 4 or 8 quantizes an unquantized
    transformer or text encoder while loading (ignored for the VAE and for a quantized component).
    """
    if name not in COMPONENTS:
        raise ValueError(f"unknown component {name!r}; expected one of {COMPONENTS}")
    folder = Path(folder)
    entry = read_config(folder)[name]
    model = build_component(name, entry["config"])
    if entry["quantization"] is not None:
        apply_quantization(model, entry["quantization"], WHAT[name])
    load_into(model, read_weight_files(prefixed_files(folder, name)), WHAT[name], dtype=as_dtype(dtype))
    if quantize and entry["quantization"] is None and name != "vae":
        quantize_model(model, quantize, group_size)
    evaluate_by_layer(model)
    return model


def load_mlx_folder(folder: str | Path, dtype=None, quantize: int | None = None, group_size: int = 64):
    """Load a converted folder: (transformer, text_encoder, vae, tokenizer folder, config dict).

    The config tells `variant`, `is_distilled`, `dtype` and each component's `quantization`.
    """
    folder = Path(folder)
    config = read_config(folder)
    models = [load_component(folder, n, dtype, quantize, group_size) for n in COMPONENTS]
    tokenizer = folder / config.get("tokenizer", "tokenizer")
    if not tokenizer.is_dir():
        raise FluxKleinError(f"{folder} has no tokenizer/ folder; convert the model again")
    return (*models, tokenizer, config)


# --- CLI ----------------------------------------------------------------------------------------------------


class ProgressBars:
    """One click progress bar per component on stderr (the `progress` callback of the commands)."""

    def __init__(self):
        self.name, self.bar = None, None

    def __call__(self, name: str, done: int, total: int) -> None:
        if name != self.name:
            self.close()
            self.name = name
            self.bar = click.progressbar(length=max(total, 1), label=f"{name:<12}", file=sys.stderr, show_pos=False)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def summary(output: str | Path, config: dict) -> str:
    """One line: where, what, how big."""
    output = Path(output)
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    q = [f"{WHAT[n]} {config[n]['quantization']['bits']}-bit" for n in COMPONENTS if config[n]["quantization"]]
    return f"wrote {output} ({config['variant']}, {config['dtype']}{', ' + ', '.join(q) if q else ''}, {size / 1e9:.2f} GB)"


@click.command("convert")
@click.option("--model", "-m", required=True, help="Diffusers snapshot folder, Hugging Face repo id, or BFL single-file .safetensors.")
@click.option("--output", "-o", required=True, type=click.Path(), help="The MLX folder to write.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bfloat16", show_default=True, help="Weight dtype.")
@click.option("--quantize", "-q", "bits", type=int, default=None, help="Quantize transformer and text encoder to 4 or 8 bits.")
@click.option("--group-size", type=int, default=64, show_default=True, help="Quantization group size (32, 64 or 128).")
@click.option("--base", default=None, help="For a single-file transformer: folder or repo id with text_encoder/, vae/, tokenizer/.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def convert(model, output, dtype, bits, group_size, base, overwrite):
    """Convert a FLUX.2 [klein] model into an MLX folder (optionally 4/8-bit)."""
    bars = ProgressBars()
    try:
        config = convert_model(
            model, output, dtype=dtype, bits=bits, group_size=group_size, base=base, overwrite=overwrite, progress=bars
        )
    finally:
        bars.close()
    click.echo(summary(output, config))


def main(argv=None) -> int:
    """`convert` as a program: FluxKleinError -> one line on stderr, exit status 1."""
    from .__main__ import run_command

    return run_command(convert, argv)


if __name__ == "__main__":
    sys.exit(main())
