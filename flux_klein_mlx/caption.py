"""`upsample`: FLUX 3's caption for a prompt (and an edit's images, and layout boxes), printed.

    python -m flux_klein_mlx upsample --prompt "a fox" [--image room.png ...] [--box "x0,y0,x1,y1:desc" ...]

The caption streams to stderr on a terminal as it is written, then is printed whole on stdout (what a
script reads: pass it back as `generate --prompt`). It is cached as `generate --upsample` caches it.
"""

from __future__ import annotations

import sys

import click

from .cli import run_command, upsample_options
from .family import FAMILIES
from .inputs.images import open_image
from .inputs.settings import check_prompt_given
from .storage.embedding_cache import EmbeddingCache, parse_size
from .upsample.cache import CaptionCache, cached_caption
from .upsample.request import build_request
from .upsample.runtime import upsampler_folder


@click.command("upsample")
@click.option("--prompt", "-p", required=True, help="The short prompt (or an edit's request) to expand.")
@click.option("--image", "-i", "images", multiple=True, help="A reference image of the edit; repeat for several.")
@upsample_options
@click.option("--no-cache", is_flag=True, help="Neither read nor store the caption on disk.")
@click.option("--cache-size", default="1GiB", show_default=True, help="Bound of the caches on disk (0 = off).")
def upsample(prompt, *, images, upsample, boxes, upsampler, no_cache, cache_size):
    """Write FLUX 3's full scene caption for a prompt with BFL's prompt upsampler, and print it."""
    del upsample  # this command always upsamples; the flag is accepted as generate takes it
    check_prompt_given(prompt)
    request = build_request(prompt, [open_image(im, "reference image") for im in images], list(boxes) or None)
    size = parse_size(cache_size)
    cache = None if no_cache or size == 0 else CaptionCache.beside(EmbeddingCache.open_default(size))
    folder = upsampler_folder(upsampler or FAMILIES["flux3"].upsampler)
    tty = sys.stderr.isatty()

    def progress(p) -> None:
        if tty:
            click.echo(p.text, nl=False, err=True)

    caption, seconds = cached_caption(request, folder, cache, on_progress=progress)
    click.echo(("\n" if tty else "") + f"caption ({request.mode}) in {seconds:.1f} s", err=True)
    click.echo(caption)


def main(argv=None):
    return run_command(upsample, argv)
