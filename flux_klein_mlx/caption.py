"""The CLI's captions: the `upsample` command (FLUX 3's caption for a prompt, an edit's images and layout
boxes, printed) and `generate --upsample`'s caption stage (`caption_first`), which show a caption's
progress alike.

    python -m flux_klein_mlx upsample --prompt "a fox" [--image room.png ...] [--box "x0,y0,x1,y1:desc" ...]

The caption streams to stderr on a terminal as it is written, then is printed whole on stdout (what a
script reads: pass it back as `generate --prompt`). It is cached as `generate --upsample` caches it.
"""

from __future__ import annotations

import sys

import click

from .checks import check_prompt_given
from .cli import upsample_options
from .family import default_upsampler
from .inputs.images import open_image
from .storage.embedding_cache import open_cache
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
    cache = CaptionCache.beside(open_cache(not no_cache, cache_size))  # None: --no-cache, or a size of 0
    folder = upsampler_folder(upsampler or default_upsampler())
    progress = CaptionProgress()
    caption, seconds = cached_caption(request, folder, cache, on_progress=progress)
    click.echo(progress.end() + f"caption ({request.mode}) in {seconds:.1f} s", err=True)
    click.echo(caption)


class CaptionProgress:
    """A caption's words as the upsampler writes them, streamed to stderr on a terminal; the last progress
    (tokens, tokens/s) is kept for the closing line. Called with `upsample/runtime.Progress` values."""

    def __init__(self):
        self.tty, self.last = sys.stderr.isatty(), None

    def __call__(self, p) -> None:
        self.last = p
        if self.tty:
            click.echo(p.text, nl=False, err=True)

    def end(self) -> str:
        """What starts the closing line: a newline after streamed words, else nothing."""
        return "\n" if self.tty and self.last is not None else ""


UPSAMPLE_HINT_WORDS = 30  # a FLUX 3 prompt shorter than this is not the full scene caption the model knows


def caption_first(pipe, prepared):
    """A FLUX 3 run's prompt before anything else runs: with --upsample the caption is written (streamed to a
    terminal, then printed whole with its rate) or read from the cache; a short prompt without it gets a hint."""
    if prepared.upsample is None:
        words = len(prepared.settings.prompt.split())
        if pipe.info.family.upsampler and prepared.typed_prompt is None and words < UPSAMPLE_HINT_WORDS:
            click.echo(
                f"hint: {pipe.info.family.title} was trained on full scene captions; --upsample writes one from this "
                "short prompt with BFL's prompt upsampler (Qwen3.5-9B: an 18.8 GB download in bfloat16, loaded and "
                "released before the transformer, its captions cached)",
                err=True,
            )
        return prepared
    click.echo(f"prompt upsampler ({prepared.upsample.mode}): writing the caption", err=True)
    progress = CaptionProgress()
    pipe.on_caption = progress
    try:
        revised = pipe.inputs(prepared, {})
    finally:
        pipe.on_caption = None
    last = progress.last
    rate = f"{last.tokens} tokens, {last.tokens_per_second:.1f} tokens/s" if last else "from the caption cache"
    click.echo(progress.end() + f"caption ({rate}, {revised.upsample_seconds:.1f} s):", err=True)
    click.echo(revised.settings.prompt, err=True)
    return revised
