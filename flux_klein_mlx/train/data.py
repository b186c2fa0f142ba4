"""The training data: a folder of images with captions (and control folders for edit LoRAs),
checked in full before any model loads, sized into aspect-ratio buckets, and ordered into batches.

Layout (the kohya / ai-toolkit convention):

    photos/ink_01.png   photos/ink_01.txt     image + its caption (UTF-8)
    photos/ink_02.jpg   photos/ink_02.txt     .png .jpg .jpeg .webp, any case
    before/ink_01.png   before/ink_02.jpg     --control before/: the reference image of each stem

An image without a caption takes `--caption`; without it, missing captions are an error naming the
images. Every image (and control) is opened and decoded here, so an unreadable file is named before
the first model loads.

Buckets. An image of w x h pixels trains at W x H with W·H close to `resolution`², the aspect ratio
kept, both sides multiples of 16:

    W = 16 · round(resolution · sqrt(w / h) / 16),   H = 16 · round(resolution · sqrt(h / w) / 16)

(at least 16 each). The image is resized (Lanczos) to cover W x H and centre-cropped to it; its
control images get the same W x H, as diffusers' img2img trainer does, so a reference costs as
many tokens as the target. Images that land on the same W x H form a bucket; a batch never mixes
buckets.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import FluxKleinError
from ..inputs import check_image_shape, open_image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
SIZE_MULTIPLE = 16


@dataclass
class Picture:
    """One image file as checked: where it is, its pixel size and its content hash."""

    path: Path
    size: tuple[int, int]  # (w, h) in pixels, after the EXIF orientation
    sha256: str


@dataclass
class TrainItem:
    """One training example: the target image, its caption, its control images, its bucket."""

    stem: str
    image: Picture
    caption: str
    caption_from: str  # "file" or "--caption"
    controls: list[Picture] = field(default_factory=list)
    bucket: tuple[int, int] = (0, 0)  # (W, H) it trains at

    def record(self) -> dict:
        """What train.json says about this example."""
        return {
            "stem": self.stem, "image": self.image.path.name, "sha256": self.image.sha256,
            "size": list(self.image.size), "bucket": list(self.bucket), "caption": self.caption,
            "caption_from": self.caption_from,
            "controls": [{"image": str(c.path), "sha256": c.sha256} for c in self.controls],
        }  # fmt: skip


def bucket_size(w: int, h: int, resolution: int) -> tuple[int, int]:
    """(W, H) of an image of w x h px at about `resolution`² area, sides multiples of 16 (module docstring)."""
    r = math.sqrt(w / h)
    side = lambda v: max(SIZE_MULTIPLE, SIZE_MULTIPLE * round(v / SIZE_MULTIPLE))  # noqa: E731
    return side(resolution * r), side(resolution / r)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_picture(path: Path, what: str) -> Picture:
    """Open and fully decode one image (one-line errors naming it); its size and hash."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an animated file's "first frame" warning is not news here
        img = open_image(path, what)
    w, h = img.size
    check_image_shape(w, h, f"{what} {path}")
    return Picture(path, (w, h), file_sha256(path))


def _images_by_stem(folder: Path, option: str) -> dict[str, Path]:
    """stem -> image file of a data or control folder; two images with one stem is an error."""
    if not folder.exists():
        raise FluxKleinError(f"{option} {folder} does not exist; give a folder of images with .txt captions")
    if not folder.is_dir():
        raise FluxKleinError(f"{option} {folder} is a file, not a folder of images")
    found: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.suffix.lower() not in IMAGE_SUFFIXES or p.name.startswith("."):
            continue
        if p.stem in found:
            raise FluxKleinError(f"{option} {folder} has two images named {p.stem} ({found[p.stem].name}, {p.name}); keep one")
        found[p.stem] = p
    return found


def _caption(image: Path, fallback: str | None) -> tuple[str, str] | None:
    """(caption, where from) for an image, or None when it has none."""
    txt = image.with_suffix(".txt")
    if txt.is_file():
        try:
            text = txt.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise FluxKleinError(f"cannot read caption {txt} ({why}); save it as UTF-8 text") from None
        if text:
            return text, "file"
    return (fallback, "--caption") if fallback else None


def scan_data(data, caption: str | None = None, controls=(), resolution: int = 512, option: str = "--data") -> list[TrainItem]:
    """The training examples of `data` (and its `controls` folders), every file opened and checked.

    Raises FluxKleinError (one line) for a missing or empty folder, unreadable or corrupt images,
    images without a caption (and no `caption`), and control folders missing a counterpart.
    """
    folder = Path(data).expanduser()
    images = _images_by_stem(folder, option)
    if not images:
        raise FluxKleinError(
            f"{option} {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); put the training images there, "
            "each with a .txt caption"
        )
    uncaptioned = [p.name for p in images.values() if _caption(p, caption) is None]
    if uncaptioned:
        head = ", ".join(uncaptioned[:3]) + (", ..." if len(uncaptioned) > 3 else "")
        raise FluxKleinError(
            f"{len(uncaptioned)} image(s) in {folder} have no caption ({head}); write <name>.txt next to each "
            "or give --caption for them"
        )
    control_maps = [(Path(c).expanduser(), _images_by_stem(Path(c).expanduser(), "--control")) for c in controls]
    for cfolder, cmap in control_maps:
        missing = [s for s in images if s not in cmap]
        if missing:
            head = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise FluxKleinError(
                f"--control {cfolder} has no image for {len(missing)} training image(s) ({head}); "
                "each control folder needs one image per training image, with the same name"
            )
    items = []
    for stem, path in images.items():
        text, source = _caption(path, caption)
        picture = _check_picture(path, "training image")
        pics = [_check_picture(cmap[stem], "control image") for _, cmap in control_maps]
        items.append(TrainItem(stem, picture, text, source, pics, bucket_size(*picture.size, resolution)))
    return items


def load_pixels(path: Path, size: tuple[int, int]) -> np.ndarray:
    """An image resized to cover `size` = (W, H) and centre-cropped to it: (H, W, 3) float32 in [-1, 1]."""
    img = open_image(path, "training image").convert("RGB")
    W, H = size
    w, h = img.size
    scale = max(W / w, H / h)
    rw, rh = max(W, round(w * scale)), max(H, round(h * scale))
    img = img.resize((rw, rh), Image.Resampling.LANCZOS)
    left, top = (rw - W) // 2, (rh - H) // 2
    img = img.crop((left, top, left + W, top + H))
    return np.asarray(img, dtype=np.float32) / 127.5 - 1.0


def epoch_batches(items: list[TrainItem], batch_size: int, rng: np.random.Generator) -> list[list[int]]:
    """One epoch's batches (lists of item indices): a random order, cut into batches within each
    bucket (a bucket's last batch may be smaller), the batches in random order."""
    order = rng.permutation(len(items))
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i in order:
        by_bucket.setdefault(items[i].bucket, []).append(int(i))
    batches = [idx[k : k + batch_size] for idx in by_bucket.values() for k in range(0, len(idx), batch_size)]
    return [batches[j] for j in rng.permutation(len(batches))]


def bucket_counts(items: list[TrainItem]) -> dict[str, int]:
    """"WxH" -> number of images, for reports."""
    counts: dict[str, int] = {}
    for it in items:
        key = f"{it.bucket[0]}x{it.bucket[1]}"
        counts[key] = counts.get(key, 0) + 1
    return counts
