"""What leaves a run: the image's metadata (one schema for every door), image files, previews.

- `image_metadata` is the one record of how an image was made; the pipeline attaches it to the
  final event, so `generate`, `serve` and the Python API write the same record for the same
  request. PNGs carry it twice: `parameters` is the A1111 / Forge text that A1111, Forge, Civitai,
  InvokeAI and ComfyUI's importer parse, and `flux_klein_mlx` holds the whole record as JSON (no
  text chunk is named `prompt`: ComfyUI parses that key as a workflow). JPEG and WebP files carry
  the same text where A1111 puts it, in the EXIF UserComment ("UNICODE" + UTF-16BE in big-endian
  EXIF, as piexif writes it), and the JSON record in XMP (`flux_klein_mlx:record`).
- `save_image` writes a new image file through `files.write_exclusive`: never a file replaced,
  never half an image under its name.
- `LatentPreview` maps latent tokens to a small RGB picture after every step, without the VAE.
"""

from __future__ import annotations

import io
import json
import os
import struct
import warnings
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import mlx.core as mx
import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .. import __version__
from ..errors import FluxKleinError
from ..models.vae import unpatchify
from ..storage.files import write_exclusive

RECORD_KEY = "flux_klein_mlx"  # PNG text chunk holding the JSON record
FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
QUALITY = 95  # JPEG and (lossy) WebP
EXIF_IFD, USER_COMMENT = 0x8769, 0x9286
UNICODE_COMMENT = b"UNICODE\0"  # EXIF UserComment character code; the text follows in UTF-16BE
XMP_NS = "urn:flux_klein_mlx:record:1"  # the XMP namespace of our record (JPEG, WebP)


# --- the record ---------------------------------------------------------------------------------------


def image_metadata(
    settings,
    *,
    model: str,
    variant: str,
    dtype: str,
    quantize: int | None,
    loras: list[dict],
    references: list[str],
    init_image: str | None = None,
    mask: str | None = None,
    steps_run: int | None = None,
    vae: str | None = None,
    model_hash: str | None = None,
    crop: tuple[int, int, int, int] | None = None,
    typed_prompt: str | None = None,
    boxes: tuple = (),
) -> dict:
    """The record of one image: `settings` is the run's resolved `inputs.RunSettings`; images are named
    by the content hash of their pixels (the same whichever door they came through). `crop`: the box
    (left, top, right, bottom) the width x height run was cropped back to (FLUX 3, one reference). A run
    that read another prompt than the one typed (`typed_prompt`: upsampled, or a layout of `boxes` written
    in) records both: `prompt` as typed and `revised_prompt` as read (OpenAI's name), with the boxes."""
    revised = {} if typed_prompt is None else {"revised_prompt": settings.prompt, "boxes": [dict(b) for b in boxes]}
    return {
        "prompt": settings.prompt if typed_prompt is None else typed_prompt,
        **revised,
        "negative_prompt": settings.negative_prompt,
        "seed": settings.seed,
        "steps": settings.steps,
        "steps_run": steps_run if steps_run is not None else settings.steps,
        "guidance": settings.guidance,
        "width": settings.width,
        "height": settings.height,
        "noise": "latents" if settings.latents is not None else settings.noise,
        "model": model,
        "model_hash": model_hash,  # A1111's AutoV2 of the transformer (a1111.model_hash)
        "variant": variant,
        "dtype": dtype,
        "quantize": quantize,
        "loras": loras,
        "references": references,
        "init_image": init_image,
        "strength": settings.strength if init_image else None,
        "mask": mask,
        "outpaint": list(settings.outpaint) if settings.outpaint else None,  # pads as run: left, top, right, bottom
        "vae": vae,
        "crop": list(crop) if crop is not None else None,
        "software": f"flux_klein_mlx {__version__}",
    }


def _a1111_value(v) -> str:
    """A1111 quotes a value that holds a comma, colon or quote (`infotext_utils.quote`)."""
    s = str(v)
    return json.dumps(s, ensure_ascii=False) if any(c in s for c in ',:"') else s


def _a1111_lora_name(name: str) -> str:
    """A1111 names a LoRA by its file name without the extension, less the ':' and ',' its infotext cannot hold."""
    stem = name[: -len(".safetensors")] if name.lower().endswith(".safetensors") else name
    return stem.replace(":", "").replace(",", "")


def a1111_prompt(record: dict) -> str:
    """The prompt as A1111 writes it: the text the model saw (an upsampled caption: `revised_prompt`), then a
    `<lora:NAME:WEIGHT>` tag for each LoRA (those of the prompt's own tags and of --lora alike), so a paste into
    A1111 / Forge restores them and makes this image."""
    tags = [f"<lora:{_a1111_lora_name(lora['name'])}:{lora['scale']:g}>" for lora in record.get("loras") or []]
    read = record.get("revised_prompt") or record.get("prompt") or ""
    return " ".join([str(read), *tags]).strip()


def a1111_parameters(record: dict) -> str:
    """The A1111 / Forge `parameters` text: prompt, `Negative prompt: ...`, then `Steps: 4, Sampler: ...`."""
    r = record.get
    lines = [a1111_prompt(record)]
    if r("negative_prompt"):
        lines.append(f"Negative prompt: {r('negative_prompt')}")
    fields = {
        "Steps": r("steps"),
        "Sampler": "Euler",
        "Schedule type": "Simple",
        "CFG scale": r("guidance") if r("guidance") is not None else 1,
        "Seed": r("seed"),
        "Size": f"{r('width')}x{r('height')}" if r("width") else None,
        "Model hash": r("model_hash"),
        "Model": r("model"),
        "VAE": r("vae"),
        "Denoising strength": r("strength") if r("init_image") else None,
        "Lora hashes": ", ".join(
            f"{_a1111_lora_name(lora['name'])}: {lora.get('autov3') or lora['sha256']}" for lora in r("loras") or []
        )
        or None,  # A1111's own hash (AutoV3): Civitai links it
        "Original prompt": r("prompt") if r("revised_prompt") else None,
        "Version": r("software", f"flux_klein_mlx {__version__}"),
    }
    lines.append(", ".join(f"{k}: {_a1111_value(v)}" for k, v in fields.items() if v is not None))
    return "\n".join(lines)


def exif_parameters(record: dict) -> bytes:
    """EXIF whose UserComment is the A1111 text, as A1111 writes JPEG and WebP (piexif's dump: a
    big-endian TIFF, IFD0 pointing to an Exif IFD holding UserComment as UNDEFINED bytes, "UNICODE\\0"
    + UTF-16BE). Built here because PIL would store the comment as BYTE, which piexif reads as ints."""
    comment = UNICODE_COMMENT + a1111_parameters(record).encode("utf-16-be")
    exif_ifd = 8 + 18  # header, then IFD0: count (2) + one entry (12) + next-IFD offset (4)
    data = exif_ifd + 18  # the Exif IFD is one entry too; the comment's bytes follow it
    header = struct.pack(">2sHI", b"MM", 42, 8)  # big-endian TIFF, IFD0 at offset 8
    ifd0 = struct.pack(">HHHIII", 1, EXIF_IFD, 4, 1, exif_ifd, 0)  # one entry: the Exif IFD's offset (LONG)
    exif = struct.pack(">HHHIII", 1, USER_COMMENT, 7, len(comment), data, 0)  # one entry: the comment (UNDEFINED)
    return b"Exif\x00\x00" + header + ifd0 + exif + comment


def record_xmp(record: dict) -> bytes:
    """An XMP packet holding the record as JSON in `flux_klein_mlx:record`."""
    text = escape(json.dumps(record, ensure_ascii=False))
    return (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description rdf:about="" xmlns:flux_klein_mlx="{XMP_NS}"><flux_klein_mlx:record>{text}'
        '</flux_klein_mlx:record></rdf:Description></rdf:RDF></x:xmpmeta><?xpacket end="w"?>'
    ).encode()


def record_text(im: Image.Image) -> str | None:
    """The JSON text of the record an open image carries (PNG text chunk, or XMP in JPEG / WebP), or None."""
    raw = getattr(im, "text", {}).get(RECORD_KEY)
    xmp = im.info.get("xmp")
    if not raw and xmp:
        try:
            raw = ElementTree.fromstring(xmp).findtext(f".//{{{XMP_NS}}}record")
        except ElementTree.ParseError:
            return None
    return raw or None


def read_record(path: str | Path) -> dict | None:
    """The record an image written here carries, or None (our own images; `rerun` reads a stranger's)."""
    with Image.open(path) as im:
        raw = record_text(im)
    return json.loads(raw) if raw else None


def write_image(image: Image.Image, target, fmt: str, record: dict | None) -> None:
    """Save `image` to `target` (a path or file) as `fmt` ("PNG", "JPEG", "WEBP") with `record`.

    A JPEG's metadata segments hold 64 KB each: a record (then the A1111 text) too long for them is
    left out with a warning rather than failing the image.
    """
    if fmt == "PNG":
        info = PngInfo()
        if record:  # text chunks: `parameters` (A1111 text) and `flux_klein_mlx` (the record as JSON)
            info.add_text("parameters", a1111_parameters(record))
            info.add_text(RECORD_KEY, json.dumps(record, ensure_ascii=False))
        return image.save(target, format=fmt, pnginfo=info)
    extra = {"exif": exif_parameters(record), "xmp": record_xmp(record)} if record else {}
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")  # JPEG has no alpha
    while True:
        try:
            return image.save(target, format=fmt, quality=QUALITY, **extra)
        except ValueError as e:  # "EXIF data is too long" / "XMP data is too long" (JPEG)
            if not extra or "too long" not in str(e):
                raise
            dropped, _ = extra.popitem()  # the JSON record (XMP) first, then the A1111 text (EXIF)
            warnings.warn(
                f"the {'JSON record (XMP)' if dropped == 'xmp' else 'A1111 text (EXIF)'} does not fit "
                f"in a {fmt} file (64 KB); the image is written without it: use .png to keep it",
                stacklevel=2,
            )


def image_bytes(image: Image.Image, record: dict | None = None) -> bytes:
    """A PNG in memory, with `record` in its text chunks when given."""
    buf = io.BytesIO()
    write_image(image, buf, "PNG", record)
    return buf.getvalue()


def image_format(path: str | Path, option: str = "the output") -> str:
    """The file format a name asks for ("PNG", "JPEG", "WEBP"), or a one-line error."""
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise FluxKleinError(f"{option} must end in {', '.join(FORMATS)}, not {Path(path).name!r}")
    return fmt


def save_image(image: Image.Image, path: str | Path, record: dict | None = None, first: int | None = None) -> Path:
    """Write `image` as a new PNG, JPEG or WebP file (by the name's ending) with its record; never
    replaces a file (the next free name is used; `first`: see `write_exclusive`).

    Returns the name written. For the Python API: `save_image(image, "fox.png", pipe.last_metadata)`.
    """
    path = Path(path).expanduser()
    fmt = image_format(path)
    return write_exclusive(path, lambda tmp: write_image(image, tmp, fmt, record), first)


# --- step previews ------------------------------------------------------------------------------------

# FLUX.2 VAE (32 latent channels), published by ComfyUI: comfy/latent_formats.py, class Flux2,
# `latent_rgb_factors` / `latent_rgb_factors_bias` (github.com/Comfy-Org/ComfyUI). ComfyUI applies
# them to its sampling latent after reshaping the 128 packed channels to (32, 2, 2) per token,
# channel index c*4 + py*2 + px, which is diffusers' (and our) patchify order. Its Flux2 format has
# identity process_in/out, so that latent is the transformer's own (BatchNorm-normalised) space,
# the space of our tokens. The outputs are in [-1, 1] like the decoder's. Not re-fitted here: the
# real VAE weights are not available to this project's tests (benchmarks/fit_preview.py fits a
# map for any diffusers VAE folder).
FLUX2_RGB_FACTORS = (
    (0.0058, 0.0113, 0.0073),
    (0.0495, 0.0443, 0.0836),
    (-0.0099, 0.0096, 0.0644),
    (0.2144, 0.3009, 0.3652),
    (0.0166, -0.0039, -0.0054),
    (0.0157, 0.0103, -0.0160),
    (-0.0398, 0.0902, -0.0235),
    (-0.0052, 0.0095, 0.0109),
    (-0.3527, -0.2712, -0.1666),
    (-0.0301, -0.0356, -0.0180),
    (-0.0107, 0.0078, 0.0013),
    (0.0746, 0.0090, -0.0941),
    (0.0156, 0.0169, 0.0070),
    (-0.0034, -0.0040, -0.0114),
    (0.0032, 0.0181, 0.0080),
    (-0.0939, -0.0008, 0.0186),
    (0.0018, 0.0043, 0.0104),
    (0.0284, 0.0056, -0.0127),
    (-0.0024, -0.0022, -0.0030),
    (0.1207, -0.0026, 0.0065),
    (0.0128, 0.0101, 0.0142),
    (0.0137, -0.0072, -0.0007),
    (0.0095, 0.0092, -0.0059),
    (0.0000, -0.0077, -0.0049),
    (-0.0465, -0.0204, -0.0312),
    (0.0095, 0.0012, -0.0066),
    (0.0290, -0.0034, 0.0025),
    (0.0220, 0.0169, -0.0048),
    (-0.0332, -0.0457, -0.0468),
    (-0.0085, 0.0389, 0.0609),
    (-0.0076, 0.0003, -0.0043),
    (-0.0111, -0.0460, -0.0614),
)
FLUX2_RGB_BIAS = (-0.0329, -0.0718, -0.0851)


@dataclass(frozen=True)
class LatentPreview:
    """A linear latent -> RGB map: rgb = latent @ factors + bias, rgb nominally in [-1, 1]."""

    factors: np.ndarray  # (C, 3) for C unpatchified latent channels
    bias: np.ndarray  # (3,)
    source: str = ""  # where the numbers come from, for reports

    @property
    def channels(self) -> int:
        return self.factors.shape[0]

    def render(self, tokens, h: int, w: int) -> np.ndarray:
        """Tokens (1, h*w, 4C) or (h*w, 4C) on an h x w grid, any dtype (MLX bf16 too) -> uint8 RGB (2h, 2w, 3)."""
        if isinstance(tokens, mx.array):
            tokens = np.array(tokens.astype(mx.float32))  # numpy cannot read bf16 MLX arrays
        lat = unpatchify_tokens(np.asarray(tokens, dtype=np.float32), h, w)  # (2h, 2w, C)
        if lat.shape[-1] != self.channels:
            raise ValueError(f"this preview map takes {self.channels} latent channels, not {lat.shape[-1]}")
        rgb = lat @ self.factors + self.bias  # (2h, 2w, 3) in about [-1, 1]
        return np.clip(np.round((rgb + 1.0) * 127.5), 0, 255).astype(np.uint8)

    def image(self, tokens, h: int, w: int) -> Image.Image:
        return Image.fromarray(self.render(tokens, h, w))


def flux2_preview() -> LatentPreview:
    """The published map for the real FLUX.2 VAE (32 latent channels)."""
    return LatentPreview(
        np.array(FLUX2_RGB_FACTORS, np.float32),
        np.array(FLUX2_RGB_BIAS, np.float32),
        "ComfyUI comfy/latent_formats.py Flux2",
    )


def unpatchify_tokens(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    """Tokens (1, h*w, 4C) -> (2h, 2w, C); packed channel index c*4 + py*2 + px (vae.patchify)."""
    t = tokens.reshape(h, w, -1, 2, 2)  # (y, x, c, py, px)
    return t.transpose(0, 3, 1, 4, 2).reshape(2 * h, 2 * w, -1)  # (y, py, x, px, c)


def fit_preview(latents: np.ndarray, images: np.ndarray, source: str = "fitted") -> LatentPreview:
    """Least-squares fit of a preview map.

    Args:
        latents: (N, h, w, C) unpatchified latents in the normalised token space.
        images: (N, 8h, 8w, 3) what the VAE decoder makes of them, in [-1, 1].

    Each latent pixel is matched with the mean colour of the 8x8 pixels it decodes to.
    """
    latents = np.asarray(latents, np.float64)
    images = np.asarray(images, np.float64)
    N, h, w, C = latents.shape
    f = images.shape[1] // h
    target = images.reshape(N, h, f, w, f, 3).mean(axis=(2, 4)).reshape(-1, 3)  # (N*h*w, 3)
    design = np.concatenate([latents.reshape(-1, C), np.ones((N * h * w, 1))], axis=1)  # (N*h*w, C+1)
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)  # (C+1, 3)
    return LatentPreview(solution[:C].astype(np.float32), solution[C].astype(np.float32), source)


def preview_for(vae) -> LatentPreview:
    """The preview map for a loaded MLX VAE: the published one for 32 channels, else one fitted on
    prior-distributed random tokens (VAEs without a published map, such as the tiny test models: a
    few decodes of 8x8-token latents, cheap for small VAEs)."""
    if vae.config.latent_channels == len(FLUX2_RGB_FACTORS):
        return flux2_preview()
    C4 = vae.config.token_channels
    grid = 8
    samples = 4
    # (N, L, 4C); the decoder casts to its own dtype
    x = mx.array(np.random.default_rng(0).standard_normal((samples, grid * grid, C4)).astype(np.float32))
    images = vae.decode_tokens(x, grid, grid).astype(mx.float32)  # (N, 16g, 16g, 3)
    feats = unpatchify(x.reshape(samples, grid, grid, C4)).astype(mx.float32)  # (N, 2g, 2g, C)
    mx.eval(images, feats)
    return fit_preview(np.array(feats), np.array(images), "fitted at load to this model's VAE decoder")


def to_output(images: mx.array, output_type: str):
    """Decoded images (1, H, W, 3), nominally [-1, 1] -> PIL (rounded) or float32 [0, 1] array."""
    x = np.array(mx.clip(images[0].astype(mx.float32) / 2 + 0.5, 0.0, 1.0))
    return x if output_type == "np" else Image.fromarray(np.round(x * 255).astype(np.uint8))


def model_name(source) -> str:
    """How metadata names a model (or VAE) source: a repo id as given, a local folder or file by its name."""
    source = str(source)
    return Path(source.rstrip("/")).name if os.path.exists(source) else source
