"""`python -m flux_klein_mlx generate`: prompt (and reference images) in, PNG out."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import click

from . import __version__
from .cli import run_command
from .errors import FluxKleinError
from .lora import pair_scales
from .output_files import check_output_file, write_exclusive
from .pipeline import DEFAULT_MODEL, check_settings, load, preprocess_reference
from .vae import check_image_size


def unique_path(path: Path) -> Path:
    """`path` if it is free, else the first free `stem-N.suffix`: outputs are never overwritten."""
    if not path.exists():
        return path
    n = 1
    while True:
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        if not candidate.exists():
            return candidate
        n += 1


def output_paths(output: str, count: int) -> list[Path]:
    base = Path(output).expanduser()
    if base.suffix.lower() != ".png":
        raise FluxKleinError(f"--output must end in .png, not {base.name!r}")
    check_output_file(base if count == 1 else base.with_name(f"{base.stem}-{count - 1}{base.suffix}"))
    if count == 1:
        return [base]
    return [base.with_name(f"{base.stem}-{i}{base.suffix}") for i in range(count)]


def png_info(metadata: dict):
    """PNG text chunks: one per parameter, plus all of them as JSON under "parameters"."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for k, v in metadata.items():
        info.add_text(k, "" if v is None else str(v))
    info.add_text("parameters", json.dumps(metadata))
    return info


def save_png(image, path: Path, metadata: dict) -> Path:
    """Write the PNG with the generation parameters in its text chunks; never overwrites.

    Created exclusively (`output_files.write_exclusive`): two processes saving to the same free
    name both succeed under different names, and the file is complete when it appears."""
    return write_exclusive(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=png_info(metadata)))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


@click.command("generate")
@click.option("--prompt", "-p", required=True, help="What to draw.")
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
              help="Hugging Face repo id, diffusers folder, or a folder written by `convert`.")
@click.option("--width", "-W", type=int, default=None, help="Width in px, multiple of 16 [default: 1024, or the first --image's].")
@click.option("--height", "-H", type=int, default=None, help="Height in px, multiple of 16 [default: 1024, or the first --image's].")
@click.option("--steps", type=int, default=None, help="Denoising steps [default: 4 distilled, 50 Base].")
@click.option("--guidance", type=float, default=None, help="CFG scale, Base models only [default: 4.0].")
@click.option("--seed", type=int, default=None, help="Noise seed [default: random, printed].")
@click.option("--noise", type=click.Choice(["torch", "mlx"]), default="torch", show_default=True,
              help="torch: the noise diffusers/ComfyUI draw for --seed on the CPU; mlx: mflux's.")
@click.option("--init-image", default=None, help="Image-to-image: start from this picture (sets the output size).")
@click.option("--strength", type=float, default=None,
              help="How much of --init-image to redraw, (0, 1]; 1 = from pure noise [default: 0.8].")
@click.option("--mask", default=None, help="Inpainting: white = repaint, black = keep; the size of --init-image.")
@click.option("--image", "-i", "images", multiple=True, help="Reference image to edit; repeat for multi-reference.")
@click.option("--negative-prompt", default=None, help="Unconditional prompt for CFG (Base models).")
@click.option("--num-images", "-n", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Images to make; seeds count up from --seed.")
@click.option("--quantize", "-q", type=click.Choice(["4", "8"]), default=None,
              help="Quantize transformer and text encoder at load (not needed for a quantized folder).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--low-memory", is_flag=True, help="Release the transformer before decoding and decode in tiles (for small-memory Macs).")
@click.option("--output", "-o", default="image.png", show_default=True,
              help="PNG path; an existing file is kept and a new name chosen.")
@click.option("--preview-dir", default=None,
              help="Also write a small latent preview PNG after every step into this existing folder.")
@click.option("--lora", "loras", multiple=True,
              help="LoRA .safetensors file, owner/name (its single .safetensors) or owner/name:FILE; repeat for several.")
@click.option("--lora-scale", "lora_scales", type=float, multiple=True,
              help="Strength of each --lora, by position [default: 1.0].")
@click.option("--lora-partial", is_flag=True, help="Apply a LoRA even when some of its modules match no layer.")
def generate(prompt, model, width, height, steps, guidance, seed, noise, init_image, strength, mask, images,
             negative_prompt, num_images, quantize, dtype, low_memory, output, preview_dir, loras, lora_scales,
             lora_partial):
    """Generate images from a prompt (and optional reference images)."""
    # Cheap checks before loading gigabytes: sizes, reference images, the output path.
    check_settings(prompt, negative_prompt, width, height, steps, guidance, seed)
    if width is not None or height is not None:
        check_image_size(1024 if width is None else width, 1024 if height is None else height)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the run itself warns once (e.g. an animated reference)
        for p in images:
            preprocess_reference(p)
    if init_image is None and (mask is not None or strength is not None):
        raise FluxKleinError(f"{'--mask' if mask is not None else '--strength'} needs --init-image")
    if init_image is not None:
        from .img2img import prepare_init_image, start_step

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            init = prepare_init_image(init_image, 0.8 if strength is None else strength, mask)
        if steps is not None:
            start_step(steps, init.strength)
        if (width or init.width, height or init.height) != (init.width, init.height):
            raise FluxKleinError(f"the output takes --init-image's size ({init.width}x{init.height}); "
                                 "leave --width/--height out")
    paths = output_paths(output, num_images)
    if preview_dir is not None and not Path(preview_dir).is_dir():
        raise FluxKleinError(f"--preview-dir {preview_dir} is not an existing folder; create it first")
    if preview_dir is not None:
        check_output_file(Path(preview_dir) / f"{paths[-1].stem}-step00.png", "--preview-dir")
    lora_specs = pair_scales(loras, lora_scales)

    t0 = time.perf_counter()
    pipe = load(model, dtype=dtype, quantize=int(quantize) if quantize else None,
                low_memory=low_memory, loras=lora_specs, lora_partial=lora_partial)
    info = pipe.info
    # load() only reads configs and checks the files' headers; each model loads when first used.
    click.echo(f"{info.name} from {info.source} ({dtype}"
               f"{', %d-bit' % pipe.quantization['bits'] if pipe.quantization else ''}): files checked in "
               f"{time.perf_counter() - t0:.1f} s, models load on first use", err=True)
    for lora in pipe.loras:
        click.echo(f"LoRA {lora.name} ({lora.sha256}) at scale {lora.scale:g}: {len({t.layer for t in lora.terms})} "
                   f"layers, {lora.nbytes / 1e6:.1f} MB", err=True)

    from .noise import seed_for_image

    base_seed = seed
    img2img = dict(noise=noise, init_image=init_image, strength=strength, mask=mask)
    for n, path in enumerate(paths):
        # Image n uses seed + n, as diffusers does for a list of generators seeded N, N+1, ...
        run_seed = None if base_seed is None else seed_for_image(base_seed, n)
        previews = None if preview_dir is None else (Path(preview_dir), path.stem)
        image, stats = _run(pipe, prompt, width, height, steps, guidance, run_seed, images, negative_prompt, previews,
                            img2img)
        metadata = {
            "prompt": prompt, "negative_prompt": negative_prompt if not info.is_distilled else None,
            "seed": stats["seed"], "steps": stats["steps"], "guidance": stats["guidance"],
            "width": stats["width"], "height": stats["height"], "model": info.source,
            "variant": info.name, "dtype": dtype,
            "quantize": pipe.quantization["bits"] if pipe.quantization else None,
            "references": [str(p) for p in images] or None, "software": f"flux_klein_mlx {__version__}",
            "loras": [lora.record() for lora in pipe.loras] or None, "noise": stats["noise"],
        }
        if init_image is not None:
            metadata.update(init_image=str(init_image), strength=stats["strength"], mask=mask,
                            steps_run=stats["steps_run"])
        final = save_png(image, path, metadata)
        if final != path:
            click.echo(f"{path} exists; wrote {final} instead", err=True)
        click.echo(
            f"seed {stats['seed']}: encode {stats['encode']['seconds']:.1f} s (peak {_mb(stats['encode']['peak_memory'])}), "
            f"denoise {stats['denoise']['seconds']:.1f} s = {stats['denoise']['seconds_per_step']:.2f} s/step "
            f"(peak {_mb(stats['denoise']['peak_memory'])}), decode {stats['decode']['seconds']:.1f} s "
            f"(peak {_mb(stats['decode']['peak_memory'])})", err=True)
        click.echo(str(final))


def _run(pipe, prompt, width, height, steps, guidance, seed, images, negative_prompt, previews=None, img2img=None):
    """One image, with a progress bar that shows seconds per step; `previews`: (folder, name stem);
    `img2img`: noise / init_image / strength / mask keyword arguments."""
    import warnings

    from PIL import Image

    from .preview import preview_for

    preview = preview_for(pipe.vae.get()) if previews else None

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda msg, *a, **k: click.echo(f"warning: {msg}", err=True)
        stream = pipe.stream(prompt, width=width, height=height, steps=steps, guidance=guidance, seed=seed,
                             images=list(images) or None, negative_prompt=negative_prompt, **(img2img or {}))
        first = next(stream)  # prompt encoded, references encoded
        bar = click.progressbar(length=first.total, label="denoising", file=sys.stderr,
                                show_eta=True, item_show_func=lambda s: s)
        event = first
        with bar:
            for event in stream:
                if event.stage == "denoise":
                    bar.update(1, f"{event.seconds:.2f} s/step")
                    if preview is not None:
                        folder, stem = previews
                        small = Image.fromarray(preview.render(event.denoised, *event.grid))
                        small.save(unique_path(folder / f"{stem}-step{event.step:02d}.png"))
        return event.image, event.stats


def main(argv=None):
    return run_command(generate, argv)
