"""Outpainting: a larger canvas around the init image, the new area inpainted, the original kept.

The method (docs/generating.md#outpainting), in image pixels:
1. The pads (left, top, right, bottom) are rounded up to multiples of 16; right and bottom take the
   rest that makes each canvas side a multiple of 16 (the original is never resized).
2. The canvas holds the original at (left, top); the new area repeats the original's edge pixels
   (what a strength below 1 starts from, and what the model sees of the image as its reference).
3. The mask (white = repaint) is the new area plus a band of SEAM px inside the original along each
   padded edge, so the model draws across the join: an inpaint of the canvas, as diffusers'
   `Flux2KleinInpaintPipeline` runs it on that image and mask.
4. After decoding, the result is `alpha * generated + (1 - alpha) * original`, with alpha 1 in the new
   area, falling linearly to 0 across the band, and 0 beyond it: the original's pixels, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..checks import is_int
from ..errors import FluxKleinError
from ..limits import MAX_OUTPAINT_PAD, MAX_SIDE, MIN_SIDE, check_decode_fits
from ..models.rope import PIXELS_PER_TOKEN
from .images import MAX_ASPECT

SEAM = 32  # px of the original repainted and cross-faded along each padded edge (two token cells)
SIDES = ("left", "top", "right", "bottom")


def parse_outpaint(value) -> tuple[int, int, int, int]:
    """ "LEFT,TOP,RIGHT,BOTTOM" (or four numbers) -> whole pixel counts >= 0, at least one above 0."""
    parts = value.split(",") if isinstance(value, str) else value
    try:
        pads = tuple(int(str(p).strip()) if isinstance(p, str) else p for p in parts)
    except (TypeError, ValueError):
        pads = ()
    if len(pads) != 4 or not all(is_int(p) and p >= 0 for p in pads):
        raise FluxKleinError(
            f"outpaint takes four whole numbers of pixels >= 0, LEFT,TOP,RIGHT,BOTTOM (e.g. 0,0,256,0), not {value!r}"
        )
    if too_far := [f"{side} {p}" for side, p in zip(SIDES, pads, strict=True) if p > MAX_OUTPAINT_PAD]:
        raise FluxKleinError(
            f"outpaint adds at most {MAX_OUTPAINT_PAD} px a side (a canvas side is at most {MAX_SIDE} px, an image's "
            f"at least {MIN_SIDE}), not {', '.join(too_far)}"
        )
    if not any(pads):
        raise FluxKleinError("outpaint 0,0,0,0 adds nothing; give the pixels to add on some side (e.g. 0,0,256,0)")
    return pads


def round_pads(pads, width: int, height: int) -> tuple[tuple[int, int, int, int], str | None]:
    """The pads as run (step 1 above) for an original of `width` x `height`, and the line that says so when
    they differ from those asked for (None when they do not)."""

    def up(n):
        return -(-n // PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN

    left, top = up(pads[0]), up(pads[1])
    right = up(left + width + pads[2]) - left - width
    bottom = up(top + height + pads[3]) - top - height
    run = (left, top, right, bottom)
    if run == tuple(pads):
        return run, None
    canvas = f"{left + width + right}x{top + height + bottom}"
    asked, ran = ",".join(map(str, pads)), ",".join(map(str, run))
    return run, f"outpaint: {asked} px rounded to {ran} (a {canvas} canvas: sides in multiples of {PIXELS_PER_TOKEN})"


def check_canvas(width: int, height: int, pads) -> None:
    """The canvas of an original `width` x `height` with `pads` (as run) within the limits of an image drawn,
    refused by what the user gave: the outpaint and the init image (they give no width or height)."""
    cw, ch = width + pads[0] + pads[2], height + pads[1] + pads[3]
    what = (
        f"the outpainted canvas would be {cw}x{ch} ({{outpaint}} {','.join(map(str, pads))} around the "
        f"{width}x{height} init image)"
    )
    if max(cw, ch) > MAX_SIDE:
        raise FluxKleinError(f"{what}; a side may be at most {MAX_SIDE} px: add less")
    if max(cw / ch, ch / cw) > MAX_ASPECT:
        raise FluxKleinError(
            f"{what}, an aspect ratio of {max(cw / ch, ch / cw):.1f}; the limit is {MAX_ASPECT}:1: add less, or "
            "add on the other sides too"
        )
    try:
        check_decode_fits(cw, ch)
    except FluxKleinError as e:
        raise FluxKleinError(f"{what}: {e}") from None


def centred_pads(width: int, height: int, canvas_width: int, canvas_height: int) -> tuple[int, int, int, int]:
    """The pads that centre a `width` x `height` image on a larger canvas: left and top on the 16-px grid
    (rounded down), right and bottom the rest, so the canvas is exactly the size asked for."""
    left = (canvas_width - width) // 2 // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN
    top = (canvas_height - height) // 2 // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN
    return left, top, canvas_width - width - left, canvas_height - height - top


@dataclass
class Outpaint:
    """What the decode needs to put the original back: the canvas's original pixels and the blend weights."""

    pads: tuple[int, int, int, int]
    original: np.ndarray  # (H, W, 3) uint8: the canvas (the original at its place, the new area its edges)
    alpha: np.ndarray  # (H, W) float32: 1 = the generated pixel, 0 = the original's

    def composite(self, image):
        """The decoded image (PIL, or float32 (H, W, 3) in [0, 1]) with the original put back outside the seam."""
        a = self.alpha[..., None]
        if isinstance(image, np.ndarray):
            original = self.original.astype(np.float32) / 255
            return np.where(a == 0, original, a * image + (1 - a) * original).astype(np.float32)
        generated = np.asarray(image.convert("RGB")).astype(np.float32)
        blended = np.round(a * generated + (1 - a) * self.original.astype(np.float32)).astype(np.uint8)
        return Image.fromarray(np.where(a == 0, self.original, blended))


def outpaint_canvas(image: Image.Image, pads) -> tuple[Image.Image, Image.Image, Outpaint]:
    """(canvas, mask, Outpaint) for the original `image` and pads already rounded (steps 2-4 above)."""
    left, top, right, bottom = pads
    pixels = np.asarray(image.convert("RGB"))
    h, w = pixels.shape[:2]
    canvas = np.pad(pixels, ((top, bottom), (left, right), (0, 0)), mode="edge")
    alpha = np.zeros(canvas.shape[:2], np.float32)
    ramp = np.clip(1 - (np.arange(1, w + h + 1, dtype=np.float32)) / SEAM, 0, 1)  # px k inside the edge: 1 - k/SEAM
    inside = np.zeros((h, w), np.float32)
    for pad, dist in (
        (left, np.arange(w)[None, :].repeat(h, 0)),
        (top, np.arange(h)[:, None].repeat(w, 1)),
        (right, np.arange(w)[::-1][None, :].repeat(h, 0)),
        (bottom, np.arange(h)[::-1][:, None].repeat(w, 1)),
    ):
        if pad:
            inside = np.maximum(inside, ramp[dist])
    alpha[:] = 1.0
    alpha[top : top + h, left : left + w] = inside
    repaint = alpha > 0  # the new area and the band
    for pad, band in ((left, np.s_[:, left : left + SEAM]), (top, np.s_[top : top + SEAM, :])):
        if pad:
            repaint[band] = True
    if right:
        repaint[:, max(left + w - SEAM, 0) : left + w] = True
    if bottom:
        repaint[max(top + h - SEAM, 0) : top + h, :] = True
    mask = Image.fromarray((repaint * 255).astype(np.uint8), "L")
    return Image.fromarray(canvas), mask, Outpaint(pads=tuple(pads), original=canvas, alpha=alpha)
