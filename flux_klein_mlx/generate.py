"""`python -m flux_klein_mlx generate`: prompt (and reference images) in, PNG out."""

from __future__ import annotations

import contextlib
import sys
import time
from functools import partial
from pathlib import Path

import click

from .caption import caption_first
from .checks import check_prompt_given
from .cli import (
    dtype_option,
    lora_options,
    model_option,
    quantize_option,
    run_command,
    upsample_options,
    vae_and_cache_options,
)
from .inputs.rerun import record_options
from .inputs.settings import RunSettings, prepare_inputs
from .lora.apply import pair_scales
from .record.a1111 import resolve_lora_tags
from .record.output import image_format, save_image
from .run.pipeline import DEFAULT_MODEL, load
from .storage.files import check_output_file, numbered_name, write_exclusive


def output_paths(output: str, count: int, preview_dir=None) -> list[Path]:
    """The names a run asks for: `output`, or `stem-0.png` ... for several images; checked before any work, as
    is --preview-dir.

    An existing file is never replaced: a taken name moves on to the next free number (`files.write_exclusive`).
    """
    base = Path(output).expanduser()
    image_format(base, "--output")
    paths = [base] if count == 1 else [numbered_name(base, i) for i in range(count)]
    check_output_file(paths[-1])
    if preview_dir is not None:  # a missing folder or a file: one-line errors
        check_output_file(Path(preview_dir) / f"{paths[-1].stem}-step00.png", "--preview-dir")
    return paths


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def summary(st, seed, index: int, count: int) -> str:
    """One line per image (`st`: its Stats): model loading apart from the stages it happened in, then the total."""
    head = f"image {index + 1}/{count}, " if count > 1 else ""
    upsample = "" if st.upsample_seconds is None else f"upsample {st.upsample_seconds:.1f} s, "
    encode = st.encode.seconds - st.encode.load_seconds
    return (
        f"{head}seed {seed}: {upsample}load {st.load_seconds:.1f} s, encode {encode:.1f} s "
        f"(peak {_gb(st.encode.peak_memory)}), denoise {st.denoise.seconds - st.denoise.load_seconds:.1f} s = "
        f"{st.seconds_per_step:.2f} s/step (peak {_gb(st.denoise.peak_memory)}), decode "
        f"{st.decode.seconds - st.decode.load_seconds:.1f} s (peak {_gb(st.decode.peak_memory)}), "
        f"total {st.total_seconds:.1f} s"
    )


def record_defaults(ctx, param, value):
    """--from IMAGE (eager): its record's settings become the defaults, so options given beside it win;
    the parameter's value is the record read (`rerun.Rerun`: the images it needs are checked in `_checked_prompt`)."""
    if value is None:
        return None
    rerun = record_options(value)
    ctx.default_map = {**(ctx.default_map or {}), **rerun.options}
    return rerun


@click.command("generate")
@click.option(
    "--from",
    "from_image",
    default=None,
    is_eager=True,
    callback=record_defaults,
    help="Rerun IMAGE from its record (ours, or A1111's parameters); options given beside it override.",
)
@click.option("--prompt", "-p", required=True, help="What to draw; <lora:NAME:W> tags name LoRAs in --lora-dir.")
@model_option(
    "Hugging Face repo id, diffusers folder, or a folder written by `convert`.",
    default=DEFAULT_MODEL,
    show_default=True,
)
@click.option(
    "--width", "-W", type=int, default=None, help="Width in px, multiple of 16 [default: 1024, or the first --image's]."
)
@click.option(
    "--height",
    "-H",
    type=int,
    default=None,
    help="Height in px, multiple of 16 [default: 1024, or the first --image's].",
)
@click.option("--steps", type=int, default=None, help="Denoising steps [default: 4 distilled, 50 Base].")
@click.option("--guidance", type=float, default=None, help="CFG scale, Base models only [default: 4.0].")
@click.option("--seed", type=int, default=None, help="Noise seed [default: random, printed].")
@click.option(
    "--noise",
    type=click.Choice(["torch", "mlx"]),
    default="torch",
    show_default=True,
    help="torch: the noise diffusers/ComfyUI draw for --seed on the CPU; mlx: mflux's.",
)
@click.option("--init-image", default=None, help="Image-to-image: start from this picture (sets the output size).")
@click.option(
    "--strength",
    type=float,
    default=None,
    help="How much of --init-image to redraw, (0, 1]; 1 = from pure noise [default: 0.8].",
)
@click.option(
    "--mask",
    default=None,
    help="Inpainting: white = repaint, black = keep (or, with transparency, transparent "
    "= repaint); the size of --init-image.",
)
@click.option(
    "--outpaint",
    default=None,
    help="LEFT,TOP,RIGHT,BOTTOM px to add around --init-image and paint (rounded to 16; strength 1 unless given).",
)
@click.option("--image", "-i", "images", multiple=True, help="Reference image to edit; repeat for multi-reference.")
@click.option("--negative-prompt", default=None, help="Unconditional prompt for CFG (Base models).")
@click.option(
    "--num-images",
    "-n",
    type=click.IntRange(1, 1000),
    default=1,
    show_default=True,
    help="Images to make; seeds count up from --seed.",
)
@quantize_option("Quantize transformer and text encoder at load to 4 or 8 bits (not needed for a quantized folder).")
@dtype_option()
@click.option(
    "--low-memory",
    is_flag=True,
    help="Release the transformer before decoding and decode in tiles (for small-memory Macs).",
)
@click.option(
    "--output",
    "-o",
    default="image.png",
    show_default=True,
    help="A .png, .jpg or .webp path; an existing file is kept and the next free number used.",
)
@click.option(
    "--preview-dir",
    default=None,
    help="Also write a small latent preview PNG after every step into this existing folder.",
)
@lora_options("A LoRA applied to the transformer")
@click.option("--lora-dir", default=None, help="The folder that the prompt's <lora:NAME:W> tags name LoRAs in.")
@click.option("--lora-partial", is_flag=True, help="Apply a LoRA even when some of its modules match no layer.")
@upsample_options
@vae_and_cache_options
def generate(
    prompt,
    *,
    model,
    num_images,
    quantize,
    dtype,
    low_memory,
    output,
    preview_dir,
    loras,
    lora_scales,
    lora_partial,
    lora_dir,
    from_image,
    vae,
    no_cache,
    cache_size,
    upsampler,
    **options,  # the run's own settings, named as RunSettings names them
):
    """Generate images from a prompt (and optional reference images)."""
    images, init_image, mask = options["images"], options["init_image"], options["mask"]
    prompt, tagged = _checked_prompt(prompt, lora_dir, from_image, images=images, init_image=init_image, mask=mask)
    options.update(images=list(images), boxes=list(options["boxes"]) or None)
    # cheap checks before loading gigabytes: the settings, the output paths, the LoRA options
    settings = RunSettings(prompt, **options).check()
    if from_image is not None and (note := from_image.model_note(model)):
        click.echo(note, err=True)  # a record names a model; --model (or its default) chooses it
    paths = output_paths(output, num_images, preview_dir)
    load_settings = dict(dtype=dtype, quantize=quantize, low_memory=low_memory, vae=vae)
    load_settings.update(loras=pair_scales(loras, lora_scales) + tagged, lora_partial=lora_partial)
    load_settings.update(cache=not no_cache, cache_size=cache_size, upsampler=upsampler)
    _generate_images(
        *_load_checked(model, settings, load_settings), paths=paths, output=output, preview_dir=preview_dir
    )


def _checked_prompt(prompt, lora_dir, from_image, *, images, init_image, mask) -> tuple[str, list]:
    """The prompt the model sees and its `<lora:NAME:W>` tags' LoRAs [(file, weight)] from --lora-dir; with
    --from, the images the record's run used must be given again (the record names them by hash only)."""
    check_prompt_given(prompt)
    if from_image is not None:
        given = {"--image": len(images), "--init-image": int(init_image is not None), "--mask": int(mask is not None)}
        from_image.check_given(given)
    prompt, tagged = resolve_lora_tags(prompt, lora_dir)
    return prompt, [(str(path), weight) for path, weight in tagged]


def _load_checked(model, settings: RunSettings, load_settings: dict):
    """The pipeline and the run's prepared inputs: every file and image checked before any model runs."""
    t0 = time.perf_counter()
    pipe = load(model, **load_settings)
    prepared = prepare_inputs(settings, pipe.info)  # every image read and checked before any model runs
    prepared = caption_first(pipe, prepared)  # FLUX 3 --upsample: written (or cached) and released here
    encode = pipe.check_text_encoder(prepared)  # its files too, unless the prompt is cached
    _say_loaded(pipe, load_settings["dtype"], time.perf_counter() - t0, encode)
    return pipe, prepared


def _say_loaded(pipe, dtype: str, seconds: float, encode: bool) -> None:
    """What load() did: it only reads configs and checks the files' headers; each model loads when first used."""
    info = pipe.info
    bits = f", {pipe.quantization['bits']}-bit" if pipe.quantization else ""
    click.echo(
        f"{info.name} from {info.source} ({dtype}{bits}): files checked in {seconds:.1f} s, "
        f"{'' if encode else 'prompt embeddings cached, '}models load on first use",
        err=True,
    )
    for lora in pipe.loras:
        click.echo(
            f"LoRA {lora.name} ({lora.sha256}) at scale {lora.scale:g}: {len(lora.terms)} adapters on "
            f"{len({t.layer for t in lora.terms})} layers, {lora.nbytes / 1e6:.1f} MB",
            err=True,
        )


def _generate_images(pipe, prepared, *, paths: list[Path], output, preview_dir) -> None:
    """Each image of the batch in turn, written as it is done (numbered after the names that are taken)."""
    num_images = len(paths)
    next_number = None if num_images == 1 else 0  # a batch continues its numbering after names that are taken
    for n, path in enumerate(paths):
        label = "denoising" if num_images == 1 else f"image {n + 1}/{num_images}: denoising"
        previews = None if preview_dir is None else Path(preview_dir) / path.stem
        event = _run(pipe, prepared.for_image(n), previews, label)
        final = save_image(event.image, output, event.metadata, first=next_number)
        if num_images > 1:
            next_number = int(final.stem.rsplit("-", 1)[1]) + 1
        if final != path:
            click.echo(f"{path} exists; wrote {final} instead", err=True)
        click.echo(summary(event.stats, event.metadata["seed"], n, num_images), err=True)
        click.echo(str(final))


def _run(pipe, prepared, previews=None, label="denoising"):
    """One image with progress on stderr: a bar with seconds per step on a terminal, else one line per
    step (logs, pipes). `previews`: folder / name stem, to write a latent preview after every step."""
    stream = pipe.stream(prepared)
    event = next(stream)  # prompt encoded, references encoded
    tty = sys.stderr.isatty()
    bar = (
        click.progressbar(length=event.total, label=label, file=sys.stderr, show_eta=True, item_show_func=lambda s: s)
        if tty
        else contextlib.nullcontext()
    )
    with bar:
        for event in stream:
            if event.stage != "denoise":
                continue
            if tty:
                bar.update(1, f"{event.seconds:.2f} s/step")
            else:
                click.echo(f"{label} step {event.step}/{event.total}: {event.seconds:.2f} s", err=True)
            if previews is not None:
                small = pipe.preview_map().image(event.denoised, *event.grid)
                write_exclusive(f"{previews}-step{event.step:02d}.png", partial(small.save, format="PNG"))
    return event


def main(argv=None):
    return run_command(generate, argv)
