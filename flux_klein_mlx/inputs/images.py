"""The run's images, read and prepared before any model runs: reference images (the centre crop to the token
grid both families use, each within its own limits; FLUX 3's one-reference canvas is `family/flux3/references`), the
init image and its mask (diffusers' order of resizes), each opened once with one-line errors (`open_image`),
checked (`check_image_shape`).

Shapes: pixels (H, W, 3) float32 in [-1, 1] with H, W multiples of 16; a mask on the token grid (h*w, 1).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from ..errors import FluxKleinError
from ..limits import MIN_SIDE, check_path
from ..models.rope import PIXELS_PER_TOKEN, token_grid

MAX_ASPECT = 8
MAX_AREA = 1024 * 1024
DEFAULT_STRENGTH = 0.8


def check_strength(strength) -> float:
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 < strength <= 1.0:
        raise FluxKleinError(
            f"strength must be in (0, 1] (1 = start from pure noise, small = stay close to the init image), "
            f"not {strength!r}"
        )
    return float(strength)


def check_image_shape(
    w: int, h: int, what: str, *, min_side: int = MIN_SIDE, max_aspect: float | None = MAX_ASPECT
) -> None:
    """An input image's limits: by default FLUX.2's (spec 8.1: each side >= 64 px, aspect ratio <= 8); a family
    gives its own (FLUX 3's several references: a side of one token, any aspect)."""
    if w < min_side or h < min_side:
        raise FluxKleinError(f"{what} is {w}x{h}; both sides must be at least {min_side} px")
    if max_aspect is not None and max(w / h, h / w) > max_aspect:
        raise FluxKleinError(f"{what} is {w}x{h} (aspect ratio {max(w / h, h / w):.1f}); the limit is {MAX_ASPECT}:1")


# --- reading images -----------------------------------------------------------------------------------


def open_image(image, what: str) -> Image.Image:
    """A PIL image from a path or a PIL image, fully read, as a photo viewer shows it; one-line errors.

    From a file: the EXIF orientation is applied (as diffusers' `load_image` does), 16- and 32-bit
    integer modes become 8-bit by value (a 50% grey 16-bit PNG stays 50% grey), an animated file
    gives its first frame with a warning, and a file over PIL's decompression-bomb limit is refused.
    Other modes keep their own (colour conversion happens later, as in diffusers).
    """
    if isinstance(image, Image.Image):
        try:
            image.load()  # a closed image fails here, not deep inside a resize
        except ValueError:
            raise FluxKleinError(
                f"the {what} is a closed PIL image (used after close() or outside its `with` "
                "block); pass it while it is open, or its file path"
            ) from None
        return to_8bit(image)
    if not isinstance(image, (str, Path)):
        raise FluxKleinError(f"the {what} must be a PIL image or a file path, not {type(image).__name__}")
    check_path(image, what)  # before any call of the OS: a name too long for it is an OSError there
    path = Path(image).expanduser()
    if not path.exists():
        raise FluxKleinError(f"{what} not found: {path}")
    if not path.is_file():
        kind = "a folder, not an image" if path.is_dir() else "not a regular file (a device or pipe)"
        raise FluxKleinError(f"{what} {path} is {kind}; give an image file")
    try:
        with warnings.catch_warnings():
            # 89-179 MP: PIL warns; such a picture is shrunk to 1 MP right after, so it is fine.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                frames = getattr(im, "n_frames", 1)
                im.load()
                img = ImageOps.exif_transpose(im) or im.copy()
    except Image.DecompressionBombError:
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6
        raise FluxKleinError(
            f"{what} {path} has more pixels than PIL decodes safely ({limit:.0f} MP); shrink it "
            "(e.g. to 4096 px a side) and try again"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise FluxKleinError(f"cannot read {what} {path}: {str(e).splitlines()[0][:160]}") from None
    if frames > 1:
        warnings.warn(f"{what} {path} has {frames} frames; the first one is used", stacklevel=2)
    return to_8bit(img)


def to_8bit(img: Image.Image) -> Image.Image:
    """16- and 32-bit integer and 32-bit float images -> 8-bit grey by value (PIL's own convert clips
    integers to white and floats in [0, 1] to black).

    Float images (mode F: float TIFF, numpy float arrays) are read in [0, 1], the float convention,
    unless a value exceeds 1: then in [0, 255]. NaN becomes 0.
    """
    if img.mode.startswith("I;16") or img.mode == "I":
        a = np.asarray(img).astype(np.float64)  # (H, W); 16-bit range (PNG / TIFF)
        return Image.fromarray(np.clip(np.round(a / 257.0), 0, 255).astype(np.uint8), mode="L")
    if img.mode == "F":
        a = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)  # (H, W)
        scale = 255.0 if a.size == 0 or a.max() <= 1.0 else 1.0
        return Image.fromarray(np.clip(np.round(a * scale), 0, 255).astype(np.uint8), mode="L")
    return img


def _shrink_to_area(img: Image.Image) -> Image.Image:
    """Lanczos-shrink to MAX_AREA px when larger (sizes truncated), as diffusers' image processor does."""
    w, h = img.size
    if w * h <= MAX_AREA:
        return img
    scale = math.sqrt(MAX_AREA / (w * h))
    return img.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)


def _pixels(img: Image.Image, normalize: bool) -> np.ndarray:
    x = np.asarray(img).astype(np.float32) / 255.0  # diffusers' pil_to_numpy
    return 2.0 * x - 1.0 if normalize else x


def preprocess_reference(image, *, min_side: int, max_aspect: float | None) -> np.ndarray:
    """A reference image centre-cropped to the grid: (H, W, 3) float32 in [-1, 1], H, W multiples of 16, at most
    1 MP; refused outside the family's limits (`check_image_shape`: a side under `min_side`, past `max_aspect`)."""
    img = open_image(image, "reference image").convert("RGB")
    check_image_shape(*img.size, "reference image", min_side=min_side, max_aspect=max_aspect)
    img = _shrink_to_area(img)
    w, h = img.size
    cw, ch = w // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN, h // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN
    left, top = (w - cw) // 2, (h - ch) // 2
    return _pixels(img.crop((left, top, left + cw, top + ch)), normalize=True)


@dataclass
class InitImage:
    """A prepared init image (and mask): what the pipeline needs, computed without any model."""

    pixels: np.ndarray  # (H, W, 3) float32 in [-1, 1], H and W multiples of 16
    mask: np.ndarray | None  # (h*w, 1) float32 in [0, 1] on the token grid, 1 = repaint; None = img2img
    strength: float


def prepare_init_image(image, strength: float = DEFAULT_STRENGTH, mask=None, shrink: bool = True) -> InitImage:
    """Validate and preprocess an init image (path or PIL) and optional mask as diffusers does (`shrink`:
    to 1024^2 px of area when larger; an outpaint's canvas is run at its own size)."""
    strength = check_strength(strength)
    img = open_image(image, "init image")
    check_image_shape(*img.size, "init image")
    m = None if mask is None else open_image(mask, "mask")
    if m is not None and m.size != img.size:
        raise FluxKleinError(
            f"the mask is {m.width}x{m.height} but the init image is {img.width}x{img.height}; "
            "they must be the same size"
        )
    # Resizes happen in the file's own mode, colour conversion after (diffusers' order).
    img = _shrink_to_area(img) if shrink else img
    W, H = img.size[0] // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN, img.size[1] // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN
    img = img.resize((W, H), Image.Resampling.LANCZOS)  # stretches to the 16-multiple; no crop
    packed = None
    if m is not None:
        # The mask goes straight from its own size to (W, H); then grey, [0, 1], binarised at 0.5.
        grey = _pixels(mask_as_grey(m).resize((W, H), Image.Resampling.LANCZOS).convert("L"), normalize=False)
        binary = (grey >= 0.5).astype(np.float32)  # (H, W)
        if not binary.any():
            raise FluxKleinError(
                "the mask has no white pixel: white marks what to repaint, black what to keep "
                "(or, in a mask with transparency, transparent what to repaint)"
            )
        packed = bilinear_resize(binary, *token_grid(W, H)).reshape(-1, 1)  # (h*w, 1)
        if not packed.any():  # the model works on 16x16-px cells; this mask's white falls between their samples
            raise FluxKleinError(
                f"the mask's white area ({int(binary.sum())} px at {W}x{H}) is too small: it misses every "
                f"{PIXELS_PER_TOKEN}x{PIXELS_PER_TOKEN}-px cell the model repaints, so nothing would change; enlarge it"
            )
    return InitImage(pixels=_pixels(img.convert("RGB"), normalize=True), mask=packed, strength=strength)


def mask_as_grey(mask: Image.Image) -> Image.Image:
    """A mask as grey, white = repaint. With transparency (alpha not opaque everywhere) OpenAI's
    convention holds: transparent = repaint, so the grey is 255 - alpha; otherwise its brightness."""
    if mask.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (mask.mode == "P" and "transparency" in mask.info):
        alpha = mask.convert("RGBA").getchannel("A")
        if alpha.getextrema()[0] < 255:
            return alpha.point(lambda a: 255 - a)
    return mask


def bilinear_resize(x: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """(H, W) -> (out_h, out_w) like torch's `interpolate(mode="bilinear", align_corners=False)`."""

    def taps(n_in, n_out):
        scale = n_in / n_out
        src = np.maximum((np.arange(n_out) + 0.5) * scale - 0.5, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        return i0, np.minimum(i0 + 1, n_in - 1), (src - i0).astype(np.float32)  # taps and weight of the second

    y0, y1, fy = taps(x.shape[0], out_h)
    x0, x1, fx = taps(x.shape[1], out_w)
    top = x[y0][:, x0] * (1 - fx) + x[y0][:, x1] * fx
    bottom = x[y1][:, x0] * (1 - fx) + x[y1][:, x1] * fx
    return (top * (1 - fy)[:, None] + bottom * fy[:, None]).astype(np.float32)


def crop_to_box(image, box: tuple[int, int, int, int]):
    """A decoded image (H, W, 3), numpy or MLX, cropped back to the box (left, top, right, bottom) a family's
    reference preparation returned (FLUX 3's canvas: the reference inside it)."""
    left, top, right, bottom = box
    return image[top:bottom, left:right]


# --- everything a run needs, before any model runs ----------------------------------------------------
