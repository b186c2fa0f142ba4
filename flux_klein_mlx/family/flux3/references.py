"""FLUX 3's reference images, as pixels: the canvas that keeps one reference whole, the crop back, the count.

One reference is kept whole (diffusers' `Flux3ImageProcessor` with `resize_mode="fill"`, after BFL's
`reference_canvas`; issue 35): shrunk (Lanczos, in the file's own mode) until its
canvas -- each side rounded up to the 16-px token grid, clamped to [64, 4096] -- fits 4 MP, then padded to
the canvas with its own reflection (mirrored, edge included, when a side is under one token), centred. The
box (left, top, right, bottom) of the image inside the canvas crops the generated image back to the
reference (`inputs/images.crop_to_box`) when no size was asked for. Several references are each centre-cropped
to the grid (`inputs/images.preprocess_reference`: at most 1 MP), which is exactly `resize_mode="crop"`, with
FLUX 3's limits (tests/test_modular_inputs.py proves both against diffusers).

The hall's `inputs/images` opens the files (`open_image`) and crops to the grid; this module is FLUX 3's own rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ...errors import FluxKleinError
from ...inputs.images import open_image, preprocess_reference
from ...limits import MAX_REFERENCES
from ...models.rope import PIXELS_PER_TOKEN

FLUX3_MAX_REFERENCES = MAX_REFERENCES  # BFL's and mflux's limit (the upsampler's MAX_REFERENCES); limits.py
CANVAS_MAX_AREA = 4 * 1024 * 1024  # px of one reference's canvas
CANVAS_MIN_SIDE = 64
CANVAS_MAX_SIDE = 4096
CANVAS_BACK_OFF = 0.995  # the scale shrinks by this until the rounded-up canvas fits (BFL's step)


@dataclass(frozen=True)
class CanvasReference:
    """One reference on its canvas, and where the reference itself sits in it."""

    pixels: np.ndarray  # (H, W, 3) float32 in [-1, 1]; H and W multiples of 16 in [64, 4096]
    box: tuple[int, int, int, int]  # (left, top, right, bottom) px of the image inside the canvas


def check_reference_count(count: int, limit: int, model_name: str) -> None:
    """One line when a run gives more reference images than the model takes."""
    if count > limit:
        raise FluxKleinError(f"{model_name} takes at most {limit} reference images, not {count}; pass {limit} or fewer")


def canvas_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of the canvas of a width x height px image: each side rounded up to the token grid,
    then clamped to [CANVAS_MIN_SIDE, CANVAS_MAX_SIDE]."""
    return tuple(
        min(CANVAS_MAX_SIDE, max(CANVAS_MIN_SIDE, math.ceil(side / PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN))
        for side in (width, height)
    )


def fitted_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) a width x height image is shrunk to (never grown) so that its canvas fits
    CANVAS_MAX_AREA and its sides CANVAS_MAX_SIDE.

    The scale that fits the image itself can leave the rounded-up canvas just over the area, so it backs off
    by 0.5% until the canvas fits (the first try fits unless the image is within a token of the cap)."""
    scale = min(1.0, math.sqrt(CANVAS_MAX_AREA / (width * height)), CANVAS_MAX_SIDE / max(width, height))
    while True:
        # Python's round (half to even), sides at least 1 px: diffusers' and BFL's sizes.
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        cw, ch = canvas_size(*size)
        if cw * ch <= CANVAS_MAX_AREA:
            return size
        scale *= CANVAS_BACK_OFF


def pad_to_canvas(rgb: np.ndarray, width: int, height: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Centre an (h, w, 3) image on a width x height canvas, the border filled with its reflection.

    A side shorter than one token is mirrored edge included ("symmetric"), a longer one reflected about
    its edge pixel ("reflect"): numpy's modes, which repeat the reflection as far as the pad reaches."""
    h, w = rgb.shape[:2]
    left, top = (width - w) // 2, (height - h) // 2
    box = (left, top, left + w, top + h)
    mode = "reflect" if min(w, h) > PIXELS_PER_TOKEN else "symmetric"
    padded = np.pad(rgb, ((top, height - h - top), (left, width - w - left), (0, 0)), mode=mode)
    return padded, box


def prepare_canvas_reference(image: Image.Image) -> CanvasReference:
    """The one reference of a FLUX 3 edit (an opened PIL image of any size, at least 1 px a side) on its
    canvas, with its box."""
    w, h = image.size
    if w < 1 or h < 1:
        raise FluxKleinError(f"the reference image is {w}x{h} px: it holds no pixel; give a real picture")
    fw, fh = fitted_size(w, h)
    if (fw, fh) != (w, h):
        image = image.resize((fw, fh), Image.Resampling.LANCZOS)  # in the image's own mode, as diffusers
    padded, box = pad_to_canvas(np.asarray(image.convert("RGB")), *canvas_size(fw, fh))
    # diffusers' pil_to_numpy and normalize: x / 255 in float32, then 2x - 1.
    pixels = 2.0 * (padded.astype(np.float32) / 255.0) - 1.0
    return CanvasReference(pixels=pixels, box=box)


def prepare_flux3_references(images: Sequence, model_name: str) -> tuple[list[np.ndarray], tuple | None]:
    """FLUX 3's reference pixels and the box to crop the output back to (None with several references).

    One reference is kept whole on its canvas (`prepare_canvas_reference`, any size of at least
    1 px); several are each prepared as FLUX.2 prepares one (`preprocess_reference`, with FLUX 3's limits), which
    is what diffusers' `Flux3ImageProcessor` does with `resize_mode="crop"`."""
    check_reference_count(len(images), FLUX3_MAX_REFERENCES, model_name)
    if len(images) == 1:
        canvas = prepare_canvas_reference(open_image(images[0], "reference image"))
        return [canvas.pixels], canvas.box
    # diffusers' `resize_mode="crop"` floors each side to the grid and checks nothing more: a side of one token
    # (16 px) is the least that crops to an image, and any aspect ratio goes (a 100x56 reference runs as 96x48)
    return [preprocess_reference(im, min_side=PIXELS_PER_TOKEN, max_aspect=None) for im in images], None
