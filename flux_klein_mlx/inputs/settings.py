"""What a run asks for (`RunSettings`) and what it is given to work with (`PreparedInputs`).

`RunSettings` holds the knobs of one generation, the keywords of `generate` / `stream`, declared
here once. `prepare_inputs(settings, info)` checks them, resolves the defaults of the model's
variant and reads every image the run needs (`images`), all before any model runs:

- reference images: shrunk to 1024^2 px area if larger (Lanczos, sizes truncated), sides floored to
  multiples of 16 and centre-cropped (spec 8.1); FLUX 3 keeps a single reference whole on a canvas
  (`family/flux3/references`: each family prepares its references);
- an init image (image-to-image / inpainting, as diffusers' `Flux2KleinInpaintPipeline`): shrunk
  to 1024^2 px area if larger, then resized -- not cropped -- to sides floored to multiples of 16;
  it sets the output size. A mask (white = repaint, black = keep) is resized like it, made grey,
  binarised at 0.5, then bilinearly resized to the h x w token grid (edges come out fractional).
  A mask with transparency (an alpha channel that is not opaque everywhere) follows OpenAI's
  convention instead: transparent = repaint, opaque = keep (its colours are ignored).

The CLI and the server call `prepare_inputs` before the work starts, so a bad input ends the run
in one line, and hand the result to the pipeline: nothing is decoded twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image

from ..checks import check_number, check_whole, is_int
from ..errors import FluxKleinError, Notice
from ..limits import (
    MAX_PROMPT_CHARS,
    MAX_REFERENCES,
    MAX_SEED,
    MAX_SIDE,
    MAX_STEPS,
    MIN_SEED,
    check_decode_fits,
)
from ..models.rope import PIXELS_PER_TOKEN, token_grid
from ..models.tokenizer import check_text
from ..record.a1111 import LORA_TAG
from ..sampling import check_noise_kind, seed_for_image, start_step
from ..upsample.boxes import canvas_rows, check_boxes, layout_prompt
from ..upsample.request import build_request, check_upsampler_family
from .images import (
    DEFAULT_STRENGTH,
    MIN_SIDE,
    InitImage,
    check_image_shape,
    check_strength,
    open_image,
    prepare_init_image,
)
from .outpaint import Outpaint, check_canvas, outpaint_canvas, parse_outpaint, round_pads

DEFAULT_SIZE = 1024


@dataclass
class RunSettings:
    """One generation's settings, as `generate(prompt, **settings)` takes them.

    prompt: the text prompt. width, height: output size in pixels, multiples of 16 (default
    1024x1024; with reference images and no size given, the first reference's processed size).
    steps: denoising steps (default: 4 for distilled models, 50 for Base). guidance: CFG scale for
    Base models (default 4.0); ignored, with a warning, by distilled models. seed: seed of the
    initial noise; random when None (taken modulo 2**32 for torch noise). images: reference
    image(s) for editing / multi-reference (PIL images or paths). negative_prompt: the
    unconditional prompt of CFG (Base models; default ""). latents: initial noise in diffusers'
    layout (1, 128, H/16, W/16) instead of a seed's (with an init image it is the noise that
    `strength` mixes in). output_type: "pil" or "np" (float32 (H, W, 3) in [0, 1]). noise: "torch"
    (default: the noise `torch.randn` draws on the CPU for this seed, so diffusers' images
    reproduce) or "mlx" (mflux's). init_image: image-to-image: start from this image instead of
    pure noise; the output takes its size, and it is also the first reference (`images` follow).
    strength: how far from the init image to go, in (0, 1] (default 0.8; 1 = pure noise), diffusers'
    convention. mask: inpainting: a mask the size of the init image; white is repainted, black kept.
    upsample: FLUX 3: rewrite the prompt with BFL's prompt upsampler first (`upsample/`). boxes: FLUX 3's
    layout, "x0,y0,x1,y1:desc" strings or diffusers' dicts (`upsample/boxes.py`); without `upsample` the
    layout is written into the prompt as the transformer reads it.
    """

    prompt: str
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    images: Sequence | None = None
    negative_prompt: str | None = None
    latents: object = None
    output_type: str = "pil"
    noise: str = "torch"
    init_image: object = None
    strength: float | None = None
    mask: object = None
    outpaint: object = None  # "LEFT,TOP,RIGHT,BOTTOM" px (or 4 numbers) added around init_image (outpaint.py)
    upsample: bool = False
    boxes: Sequence | None = None

    @classmethod
    def from_keywords(cls, prompt, keywords: dict) -> RunSettings:
        """`RunSettings(prompt, **keywords)` with a one-line error for an unknown keyword."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(keywords) - names):
            raise FluxKleinError(f"unknown setting {unknown[0]!r}; the settings are {', '.join(sorted(names))}")
        return cls(prompt, **keywords)

    def check(self) -> RunSettings:
        """Types and ranges, checked without reading an image or a model; returns self."""
        neg = self.negative_prompt
        if not isinstance(self.prompt, str):
            raise FluxKleinError(f"the prompt must be a string, not {type(self.prompt).__name__}")
        if neg is not None and not isinstance(neg, str):
            raise FluxKleinError(f"negative_prompt must be a string or None, not {type(neg).__name__}")
        if LORA_TAG.search(self.prompt):
            raise FluxKleinError(
                "the prompt holds a <lora:NAME:W> tag; resolve it first: generate --lora-dir DIR, or in Python "
                "prompt, loras = flux_klein_mlx.resolve_lora_tags(prompt, DIR) and load(..., loras=loras)"
            )
        check_text(self.prompt)  # lone surrogates (argv bytes not UTF-8, JSON "\ud800") end here, not in the tokenizer
        check_prompt_length(self.prompt, "the prompt")
        check_boxes(self.boxes, self.prompt, upsample=self.upsample is True)  # bounds before any image or model
        if neg is not None:
            check_text(neg, "the negative prompt")
            check_prompt_length(neg, "the negative prompt")
        if self.width is not None or self.height is not None:
            check_image_size(
                DEFAULT_SIZE if self.width is None else self.width, DEFAULT_SIZE if self.height is None else self.height
            )
        if self.steps is not None:
            check_whole("steps", self.steps, 1, MAX_STEPS)
        check_images_count(self.images)
        if self.guidance is not None:
            check_number("guidance", self.guidance, 0, hint=" (e.g. 4.0; at most 1 turns CFG off)")
        if self.seed is not None:
            check_whole("seed", self.seed, MIN_SEED, MAX_SEED)
        if self.output_type not in ("pil", "np"):
            raise FluxKleinError(f"output_type must be 'pil' or 'np', not {self.output_type!r}")
        check_noise_kind(self.noise)
        if self.init_image is None and (self.mask is not None or self.strength is not None):
            what = "{mask}" if self.mask is not None else "{strength}"
            raise FluxKleinError(f"{what} needs an init image: give {{init_image}}")
        if self.strength is not None:
            check_strength(self.strength)
        if self.outpaint is not None:
            parse_outpaint(self.outpaint)
            if self.init_image is None or self.mask is not None or self.width or self.height:
                raise FluxKleinError(
                    "outpaint extends the init image: give {init_image}, and no {mask} or {size} "
                    "(the canvas is the image and what the outpaint adds)"
                )
        if not isinstance(self.upsample, bool):
            raise FluxKleinError(f"upsample must be True or False, not {self.upsample!r}")
        return self


# --- the checks of a run's own values (the generic checkers live in `checks`) ---------------------------


def check_prompt_length(text: str, what: str) -> None:
    """A prompt past MAX_PROMPT_CHARS (limits.py: about a whole FLUX 3 text window) is refused, not cut."""
    if len(text) > MAX_PROMPT_CHARS:
        raise FluxKleinError(
            f"{what} is {len(text):,} characters long; the limit is {MAX_PROMPT_CHARS:,} (about 8,000 tokens, "
            "FLUX 3's whole text window): shorten it"
        )


def check_images_count(images) -> None:
    """At most MAX_REFERENCES reference images (limits.py), counted before any is opened (a single image, None,
    or an iterable without a length: prepare_inputs counts its list)."""
    if isinstance(images, (str, Path, Image.Image)) or not hasattr(images, "__len__"):
        return
    if len(images) > MAX_REFERENCES:
        raise FluxKleinError(f"{len(images)} reference images given ({{images}}); the limit is {MAX_REFERENCES}")


def check_side(name: str, v) -> None:
    """The one rule of an image side the model draws: a whole number of px, a multiple of 16 in [64, 4096].
    `name` is the option the message names (width, height, resolution, sample-size)."""
    if not is_int(v):
        raise FluxKleinError(f"{name} must be a whole number of pixels, not {v!r}")
    if not MIN_SIDE <= v <= MAX_SIDE:
        limit = f"below the minimum of {MIN_SIDE}" if v < MIN_SIDE else f"above the maximum of {MAX_SIDE}"
        raise FluxKleinError(
            f"{name} {v} is {limit} px; use a multiple of {PIXELS_PER_TOKEN} in [{MIN_SIDE}, {MAX_SIDE}]"
        )
    if v % PIXELS_PER_TOKEN:
        lo = v // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN  # v is inside [64, 4096], so are both neighbours
        raise FluxKleinError(
            f"{name} {v} is not a multiple of {PIXELS_PER_TOKEN}; use e.g. {lo} or {lo + PIXELS_PER_TOKEN}"
        )


def check_image_size(width: int, height: int) -> None:
    """Raise FluxKleinError unless both sides are multiples of 16 within [64, 4096] px that this machine can decode."""
    check_side("width", width)
    check_side("height", height)
    check_decode_fits(width, height)  # and what this machine's backend can decode (limits.py)


@dataclass(kw_only=True)
class PreparedInputs:
    """A checked run: its settings with every default resolved, and its images read.

    `settings` has width, height, steps, seed set (guidance None on distilled models, negative_prompt
    None unless CFG runs); `references` are the reference pixels in order; `init` the init image (and
    mask) for img2img / inpainting.
    """

    settings: RunSettings
    references: list[np.ndarray] = field(default_factory=list)  # each (H, W, 3) float32 in [-1, 1]
    init: InitImage | None = None
    t_start: int = 0  # schedule steps skipped (img2img); the schedule is still built for all steps
    latents: np.ndarray | None = None  # (1, C, h, w) float32 given noise, or None: from the seed
    # Content hashes (12 hex digits of sha256 of the prepared pixels): "references" [...], "init_image",
    # "mask"; the same image gives the same hash whichever door it came through.
    hashes: dict = field(default_factory=lambda: {"references": []})
    # FLUX 3 with one reference and no size given: the run is on the reference's padded canvas
    # (settings.width x height) and the image is cropped back to the reference, (left, top, right, bottom)
    crop: tuple[int, int, int, int] | None = None
    outpaint: Outpaint | None = None  # an outpaint: the original put back after decoding (outpaint.py)
    # FLUX 3's prompt rewritten: the prompt as typed (settings.prompt is what the text encoder reads), the
    # user's boxes (checked, 0-1), the upsampler's request while the caption is still to be written
    # (the pipeline writes it: `upsample.cache.revise`) and the seconds that took.
    typed_prompt: str | None = None
    boxes: tuple = ()
    upsample: object = None
    upsample_seconds: float | None = None

    @property
    def images_key(self) -> str:
        """One key for the init image and references together (the pipeline's token cache)."""
        return ",".join([self.hashes.get("init_image") or ""] + self.hashes["references"])

    @property
    def steps_run(self) -> int:
        return self.settings.steps - self.t_start

    @property
    def cfg_scale(self) -> float | None:
        """The CFG scale when classifier-free guidance runs (guidance > 1), else None."""
        g = self.settings.guidance
        return g if g is not None and g > 1.0 else None

    @property
    def prompts(self) -> list[str]:
        """The prompts the text encoder reads: [prompt], or [prompt, negative prompt] with CFG."""
        return [self.settings.prompt] + ([self.settings.negative_prompt or ""] if self.cfg_scale else [])

    def for_image(self, index: int) -> PreparedInputs:
        """Image `index` of a batch: the same inputs with seed + index (diffusers' generators N, N+1, ...)."""
        seed = self.settings.seed
        if index == 0 or seed is None:
            return self
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, seed=seed_for_image(seed, index)))


def _resolve_guidance(settings: RunSettings, info) -> tuple[float | None, str | None]:
    """(guidance, negative prompt) as the run uses them (None, None on distilled models), warning about
    what is ignored. CFG runs only when guidance > 1, as in diffusers."""
    if info.is_distilled:
        if settings.guidance is not None and settings.guidance != 1.0:
            warnings.warn(
                f"guidance {settings.guidance} is ignored: {info.name} is guidance-distilled "
                "(use a Base model for CFG)",
                stacklevel=2,
            )
        if settings.negative_prompt:
            warnings.warn(
                f"negative_prompt is ignored: {info.name} runs without classifier-free guidance", stacklevel=2
            )
        return None, None
    guidance = info.default_guidance if settings.guidance is None else float(settings.guidance)
    if guidance <= 1.0 and settings.negative_prompt:
        warnings.warn(
            f"negative_prompt is ignored: guidance {guidance:g} <= 1 runs without classifier-free guidance",
            stacklevel=2,
        )
    return guidance, settings.negative_prompt if guidance > 1.0 else None


def _latents(value, channels: int, width: int, height: int) -> np.ndarray:
    """Given noise as float32 numpy (MLX arrays of any float dtype, numpy, nested lists), checked."""
    shape = (1, channels, *token_grid(width, height))
    if isinstance(value, mx.array) and value.dtype in (mx.bool_, mx.complex64):
        raise FluxKleinError(f"latents must be a float array (numpy or MLX), not MLX {value.dtype}")
    if isinstance(value, np.ndarray) and value.dtype.kind not in "fiu":
        raise FluxKleinError(f"latents must be a float array (numpy or MLX), not numpy dtype {value.dtype}")
    try:
        x = np.array(value.astype(mx.float32)) if isinstance(value, mx.array) else np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise FluxKleinError(
            f"latents must be an array of numbers (numpy or MLX), not {type(value).__name__}"
        ) from None
    if x.shape != shape:
        raise FluxKleinError(f"latents must have shape {shape} for {width}x{height}, not {tuple(x.shape)}")
    if not np.isfinite(x).all():
        raise FluxKleinError("latents hold NaN or infinity; pass finite noise (e.g. a normal draw)")
    return x


def prepare_inputs(settings: RunSettings, info) -> PreparedInputs:
    """Check `settings` against the model described by `info` and read every image, before any model runs."""
    settings = settings.check()
    steps = info.default_steps if settings.steps is None else int(settings.steps)
    guidance, negative = _resolve_guidance(settings, info)
    width, height = settings.width, settings.height
    init, outpainting = _init_image(settings)
    if init is not None:
        ih, iw = init.pixels.shape[:2]
        if (width or iw, height or ih) != (iw, ih):
            raise FluxKleinError(f"the output takes the init image's size ({iw}x{ih}); leave {{size}} out")
        width, height = iw, ih
    images = [settings.images] if isinstance(settings.images, (str, Path, Image.Image)) else list(settings.images or [])
    check_images_count(images)
    references, crop = info.family.prepare_references(images, info.name)
    prompt, request, boxes = _prompt_plan(settings, images, info)
    if references:  # a side left out is the first reference's (a given side is never 0: checked above)
        width, height = width or references[0].shape[1], height or references[0].shape[0]
    if settings.width is not None or settings.height is not None or init is not None:
        crop = None  # a size the user chose is the output's size (diffusers crops back only to its own canvas)
    width, height = width or DEFAULT_SIZE, height or DEFAULT_SIZE  # all valid: given ones checked, images' made so
    t_start = 0 if init is None else start_step(steps, init.strength)
    latents = None if settings.latents is None else _latents(settings.latents, info.in_channels, width, height)
    seed = random.randrange(2**31) if settings.seed is None and latents is None else settings.seed
    resolved = dataclasses.replace(
        settings,
        prompt=prompt,
        width=width,
        height=height,
        steps=steps,
        guidance=guidance,
        seed=seed,
        negative_prompt=negative,
        images=None,
        strength=init.strength if init is not None else None,  # recorded as run: the default 0.8 too
        outpaint=outpainting and outpainting.pads,
    )
    hashes = _hashes(references, init)
    typed = settings.prompt if prompt != settings.prompt or request is not None else None
    return PreparedInputs(
        settings=resolved,
        references=references,
        init=init,
        t_start=t_start,
        latents=latents,
        hashes=hashes,
        crop=crop,
        outpaint=outpainting,
        typed_prompt=typed,
        boxes=boxes,
        upsample=request,
    )


def _init_image(settings: RunSettings) -> tuple[InitImage | None, Outpaint | None]:
    """The init image (and mask) of img2img / inpainting, or the canvas of an outpaint (no size given: checked)."""
    if settings.outpaint is not None:
        return prepare_outpaint(settings)
    if settings.init_image is None:
        return None, None
    strength = DEFAULT_STRENGTH if settings.strength is None else settings.strength
    return prepare_init_image(settings.init_image, strength, settings.mask), None


def _hashes(references: list[np.ndarray], init: InitImage | None) -> dict:
    """The content hashes of the prepared images: "references" [...], "init_image", "mask"."""
    hashes = {"references": [content_hash(r) for r in references]}
    if init is not None:
        hashes["init_image"] = content_hash(init.pixels)
        hashes["mask"] = None if init.mask is None else content_hash(init.mask)
    return hashes


def prepare_outpaint(settings: RunSettings) -> tuple[InitImage, Outpaint]:
    """The canvas around the init image as an inpaint (strength 1 unless given), and what puts the original back."""
    img = open_image(settings.init_image, "init image")
    check_image_shape(*img.size, "init image")
    pads, said = round_pads(parse_outpaint(settings.outpaint), *img.size)
    check_canvas(*img.size, pads)
    if said:
        warnings.warn(said, Notice, stacklevel=3)
    canvas, mask, outpainting = outpaint_canvas(img, pads)
    strength = 1.0 if settings.strength is None else settings.strength
    return prepare_init_image(canvas, strength, mask, shrink=False), outpainting


def _prompt_plan(settings: RunSettings, images: list, info) -> tuple[str, object, tuple]:
    """(the prompt the run reads for now, the upsampler's request or None, the checked boxes): FLUX 3's
    boxes written into the prompt without `upsample`; with it, the request (the init image, then the
    references, as the upsampler's images) for the pipeline to answer."""
    if not settings.upsample and not settings.boxes:
        return settings.prompt, None, ()
    check_upsampler_family(info.family, upsample=settings.upsample)
    shown = ([settings.init_image] if settings.init_image is not None else []) + images
    if not settings.upsample:
        boxes = check_boxes(settings.boxes, settings.prompt, references=len(shown))
        return layout_prompt(settings.prompt, canvas_rows(boxes)), None, boxes
    request = build_request(settings.prompt, [open_image(im, "reference image") for im in shown], settings.boxes)
    return settings.prompt, request, request.boxes


def content_hash(pixels: np.ndarray) -> str:
    return hashlib.sha256(str(pixels.shape).encode() + pixels.tobytes()).hexdigest()[:12]
