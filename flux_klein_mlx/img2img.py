"""Image-to-image and inpainting as diffusers' `Flux2KleinInpaintPipeline` does them.

- The init image sets the output size: if it is larger than 1024^2 px it is shrunk to that area
  (Lanczos, sizes truncated), then resized -- not cropped -- to sides floored to multiples of 16.
- Its VAE tokens x0 are (a) noised to the schedule point chosen by `strength`,
  x = sigma * noise + (1 - sigma) * x0 (the scheduler's `scale_noise`), and (b) appended as the
  first reference image (time coordinate 10, so other references follow at 20, 30, ...).
- `strength` picks the start like diffusers' `get_timesteps`: the schedule (and its mu) is built for
  all `steps`, and the first int(steps - min(steps * strength, steps)) of them are skipped.
- A mask (white = repaint, black = keep) is resized like the init image, made grey, binarised at
  0.5, then bilinearly resized to the h x w token grid (edges come out fractional). After every
  step the kept region is replaced by x0 noised to the next sigma (clean x0 after the last one):
  x = (1 - m) * x0_noised + m * x.
An img2img run without a mask is that pipeline with an all-white mask, whose blend is the identity.

Everything here happens before any model runs, except `scale_noise` / `blend` (cheap array math).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image, ImageOps

from .errors import FluxKleinError

MIN_SIDE = 64  # as for reference images (spec 8.1)
MAX_ASPECT = 8
MAX_AREA = 1024 * 1024
MULTIPLE = 16


def open_image(image, what: str) -> Image.Image:
    """A PIL image from a path or a PIL image, fully read, as a photo viewer shows it; one-line errors.

    From a file: the EXIF orientation is applied (as diffusers' `load_image` does), 16- and 32-bit
    integer modes become 8-bit by value (a 50% grey 16-bit PNG stays 50% grey), an animated file
    gives its first frame with a warning, and a file over PIL's decompression-bomb limit is refused.
    Other modes keep their own (colour conversion happens later, as in diffusers).
    """
    if isinstance(image, Image.Image):
        return to_8bit(image)
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        if path.is_dir():
            raise FluxKleinError(f"{what} {path} is a folder, not an image; give an image file")
        if path.exists() and not path.is_file():
            raise FluxKleinError(f"{what} {path} is not a regular file (a device or pipe); give an image file")
        if not path.is_file():
            raise FluxKleinError(f"{what} not found: {path}")
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
            warnings.warn(f"{what} {path} has {frames} frames; the first one is used")
        return to_8bit(img)
    raise FluxKleinError(f"the {what} must be a PIL image or a file path, not {type(image).__name__}")


def to_8bit(img: Image.Image) -> Image.Image:
    """16- and 32-bit integer images -> 8-bit grey by value (PIL's own convert clips them to white)."""
    if img.mode.startswith("I;16") or img.mode == "I":
        a = np.asarray(img).astype(np.float64)  # (H, W); 16-bit range (PNG / TIFF)
        return Image.fromarray(np.clip(np.round(a / 257.0), 0, 255).astype(np.uint8), mode="L")
    return img


def check_strength(strength) -> float:
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 < strength <= 1.0:
        raise FluxKleinError(
            f"strength must be in (0, 1] (1 = start from pure noise, small = stay close to the init image), "
            f"not {strength!r}"
        )
    return float(strength)


def start_step(steps: int, strength: float) -> int:
    """Index of the first schedule step that runs (diffusers' `get_timesteps`, truncating)."""
    init_timestep = min(steps * strength, steps)
    t_start = int(max(steps - init_timestep, 0))
    if steps - t_start < 1:
        raise FluxKleinError(
            f"strength {strength} is so small that none of the {steps} steps runs; raise --strength or --steps"
        )
    return t_start


def _pixels(img: Image.Image, normalize: bool) -> np.ndarray:
    x = np.asarray(img).astype(np.float32) / 255.0  # diffusers' pil_to_numpy
    return 2.0 * x - 1.0 if normalize else x


@dataclass
class InitImage:
    """A prepared init image (and mask): what the pipeline needs, computed without any model."""

    pixels: np.ndarray  # (H, W, 3) float32 in [-1, 1], H and W multiples of 16
    mask: np.ndarray | None  # (h*w, 1) float32 in [0, 1] on the token grid, 1 = repaint; None = img2img
    strength: float

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]


def check_image_shape(w: int, h: int, what: str) -> None:
    """Both references' limits on an input image: each side >= 64 px, aspect ratio <= 8 (spec 8.1)."""
    if w < MIN_SIDE or h < MIN_SIDE:
        raise FluxKleinError(f"{what} is {w}x{h}; both sides must be at least {MIN_SIDE} px")
    if max(w / h, h / w) > MAX_ASPECT:
        raise FluxKleinError(f"{what} is {w}x{h} (aspect ratio {max(w / h, h / w):.1f}); the limit is {MAX_ASPECT}:1")


def prepare_init_image(image, strength: float = 0.8, mask=None) -> InitImage:
    """Validate and preprocess an init image (path or PIL) and optional mask as diffusers does."""
    strength = check_strength(strength)
    img = open_image(image, "init image")
    raw_w, raw_h = img.size
    check_image_shape(raw_w, raw_h, "init image")
    m = None if mask is None else open_image(mask, "mask")
    if m is not None and m.size != (raw_w, raw_h):
        raise FluxKleinError(
            f"the mask is {m.size[0]}x{m.size[1]} but the init image is {raw_w}x{raw_h}; they must be the same size"
        )
    # Resizes happen in the file's own mode, colour conversion after (diffusers' order).
    w, h = raw_w, raw_h
    if w * h > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (w * h))
        img = img.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)
        w, h = img.size
    W, H = w // MULTIPLE * MULTIPLE, h // MULTIPLE * MULTIPLE
    img = img.resize((W, H), Image.Resampling.LANCZOS)  # stretches to the 16-multiple; no crop
    pixels = _pixels(img.convert("RGB"), normalize=True)
    packed = None
    if m is not None:
        # The mask goes straight from its own size to (W, H); then grey, [0, 1], binarised at 0.5.
        grey = _pixels(m.resize((W, H), Image.Resampling.LANCZOS).convert("L"), normalize=False)
        binary = (grey >= 0.5).astype(np.float32)  # (H, W)
        if not binary.any():
            raise FluxKleinError("the mask has no white pixel: white marks what to repaint, black what to keep")
        packed = bilinear_resize(binary, H // MULTIPLE, W // MULTIPLE).reshape(-1, 1)  # (h*w, 1)
    return InitImage(pixels=pixels, mask=packed, strength=strength)


def bilinear_resize(x: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """(H, W) -> (out_h, out_w) like torch's `interpolate(mode="bilinear", align_corners=False)`."""

    def taps(n_in, n_out):
        scale = n_in / n_out
        src = np.maximum((np.arange(n_out) + 0.5) * scale - 0.5, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        frac = (src - i0).astype(np.float32)
        return i0, i1, frac

    y0, y1, fy = taps(x.shape[0], out_h)
    x0, x1, fx = taps(x.shape[1], out_w)
    top = x[y0][:, x0] * (1 - fx) + x[y0][:, x1] * fx
    bottom = x[y1][:, x0] * (1 - fx) + x[y1][:, x1] * fx
    return (top * (1 - fy)[:, None] + bottom * fy[:, None]).astype(np.float32)


def scale_noise(x0: mx.array, noise: mx.array, sigma: float) -> mx.array:
    """The flow-matching forward process x = sigma * noise + (1 - sigma) * x0, in float32."""
    return sigma * noise.astype(mx.float32) + (1.0 - sigma) * x0.astype(mx.float32)


def blend(x: mx.array, x0: mx.array, noise: mx.array, mask: mx.array, sigma_next: float | None) -> mx.array:
    """Keep the unmasked region: x0 noised to `sigma_next` (None after the last step: clean x0)
    where mask = 0, the denoised x where mask = 1; float32 math, x's dtype out. Shapes (1, L, C), mask (1, L, 1)."""
    known = x0.astype(mx.float32) if sigma_next is None else scale_noise(x0, noise, sigma_next)
    out = (1.0 - mask) * known + mask * x.astype(mx.float32)
    return out.astype(x.dtype)
