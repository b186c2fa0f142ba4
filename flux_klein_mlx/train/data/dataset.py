"""The training data: a folder of images with captions (and control folders for edit LoRAs),
checked in full before any model loads, sized into aspect-ratio buckets, and ordered into batches.

Layout (the kohya / ai-toolkit convention):

    photos/ink_01.png   photos/ink_01.txt     image + its caption (UTF-8)
    photos/ink_02.jpg   photos/ink_02.txt     .png .jpg .jpeg .webp, any case
    before/ink_01.png   before/ink_02.jpg     --control before/: the reference image of each stem

An image without a caption takes `--caption`; without it, missing captions are an error naming the
images. `--trigger WORD` replaces `[trigger]` in a caption, or else is prepended as `WORD, ` ("a fox"
trains as "sks, a fox") unless the caption holds it as a word already; `[trigger]` without `--trigger`
is refused; `--caption-dropout P` trains an example with the empty caption with
probability P, drawn per batch from the run's seed and the batch's place in the run (the same on
resume, and without touching the run's other random numbers). Captions are UTF-8 (a byte-order
mark, as Windows' Notepad writes, is dropped); their suffix is `--caption-extension` (.txt; kohya's
.caption works too). What is not read is said: sub-folders with images, caption files of the other
suffix. Every image (and control) is opened and decoded here, so an unreadable file is named before
the first model loads.

Repeats (kohya's convention). `--repeats N` draws every image N times an epoch; a sub-folder of --data
named `N_name` (`10_sks dog/`) holds images drawn N times an epoch (times --repeats), its captions beside
them. An epoch is the list of examples, each `repeats` times, in an order drawn from the seed (a
permutation of that list: a batch may hold one image twice), cut into batches within each bucket.
`--flip` mirrors an example left to right with probability 1/2 each time it is drawn, from a generator
keyed by (seed, step, the example's place in the step): see `flipped_examples`. Both change what a
step draws, exactly as `epoch_batches` and `flipped_examples` say (tests/train/test_dataset.py).

Buckets. An image of w x h pixels trains at W x H with W·H close to `resolution`², the aspect ratio
kept, both sides multiples of 16:

    W = 16 · round(resolution · sqrt(w / h) / 16),   H = 16 · round(resolution · sqrt(h / w) / 16)

(at least 16 each). With several resolutions (`--resolution 512,768,1024`) every image is an
example at each of them: an epoch visits each (image, size) once, in an order drawn from the seed,
and as batches never mix buckets, never mixes sizes. The image is resized (Lanczos) to cover W x H and centre-cropped
to it; its control images get the same W x H, as diffusers' img2img trainer does, so a reference costs as
many tokens as the target. Images that land on the same W x H form a bucket; a batch never mixes
buckets.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ...errors import FluxKleinError, first_few
from ...inputs.images import check_image_shape, open_image
from ...limits import MAX_REPEATS
from ...models.rope import PIXELS_PER_TOKEN
from ...storage.files import broken_link, file_sha256

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
CAPTION_SUFFIXES = (".txt", ".caption")  # the ones trainers use; the other one is named when found unread


@dataclass(kw_only=True)
class Picture:
    """One image file as checked: where it is, its pixel size and its content hash."""

    path: Path
    size: tuple[int, int]  # (w, h) in pixels, after the EXIF orientation
    sha256: str


@dataclass(kw_only=True)
class TrainItem:
    """One training example: the target image, its caption, its control images, its bucket."""

    stem: str
    image: Picture
    caption: str
    caption_from: str  # "file" or "--caption"
    controls: list[Picture] = field(default_factory=list)
    bucket: tuple[int, int] = (0, 0)  # (W, H) it trains at
    repeats: int = 1  # times an epoch draws it (its N_name folder's N x --repeats)

    def record(self) -> dict:
        """What train.json says about this example (the image's path within --data: its name, or
        `N_name/<name>` in a repeat folder)."""
        return {
            "stem": self.stem,
            "image": self.stem + self.image.path.suffix,
            "repeats": self.repeats,
            "sha256": self.image.sha256,
            "size": list(self.image.size),
            "bucket": list(self.bucket),
            "caption": self.caption,
            "caption_from": self.caption_from,
            "controls": [{"image": str(c.path), "sha256": c.sha256} for c in self.controls],
        }


def bucket_size(w: int, h: int, resolution: int) -> tuple[int, int]:
    """(W, H) of an image of w x h px at about `resolution`² area, sides multiples of 16 (module docstring)."""
    r = math.sqrt(w / h)
    side = lambda v: max(PIXELS_PER_TOKEN, PIXELS_PER_TOKEN * round(v / PIXELS_PER_TOKEN))  # noqa: E731
    return side(resolution * r), side(resolution / r)


def check_picture(path: Path, what: str) -> Picture:
    """Open and fully decode one image (one-line errors naming it); its size and hash."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an animated file's "first frame" warning is not news here
        img = open_image(path, what)
    w, h = img.size
    check_image_shape(w, h, f"{what} {path}")
    return Picture(path=path, size=(w, h), sha256=file_sha256(path))


# what a control folder holds, in the words of a refusal that names a missing one
CONTROL_WANTED = "the folder of reference images (one per training image, same names)"


def _images_by_stem(folder: Path, option: str) -> dict[str, Path]:
    """stem -> image file of a data or control folder; two images with one stem is an error."""
    wanted = "a folder of images with .txt captions" if option in ("--data", "--validation") else CONTROL_WANTED
    if not folder.exists():
        raise FluxKleinError(f"{option} {folder} does not exist; give {wanted}")
    if not folder.is_dir():
        raise FluxKleinError(f"{option} {folder} is a file, not a folder of images")
    found: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.suffix.lower() not in IMAGE_SUFFIXES or p.name.startswith("."):
            continue
        if why := broken_link(p):
            raise FluxKleinError(f"{option} {folder}: {p.name} is a symbolic link that {why}; remove it or fix it")
        if p.stem in found:
            raise FluxKleinError(
                f"{option} {folder} has two images named {p.stem} ({found[p.stem].name}, {p.name}); keep one"
            )
        found[p.stem] = p
    return found


REPEAT_FOLDER = re.compile(r"(\d+)_(.+)")  # kohya's `10_sks dog`: its images drawn 10 times an epoch


def _repeat_folders(folder: Path, option: str) -> tuple[dict[str, Path], dict[str, int]]:
    """The images of --data's kohya repeat folders (`N_name/`): stem `N_name/<stem>` -> file, and -> N."""
    images: dict[str, Path] = {}
    repeats: dict[str, int] = {}
    for sub in sorted(folder.iterdir()):
        m = REPEAT_FOLDER.fullmatch(sub.name)
        if not m or not sub.is_dir() or sub.is_symlink():
            continue
        found = _images_by_stem(sub, option)
        n = _folder_repeats(m, f"{option} {folder}: {sub.name}") if found else 0
        for stem, path in found.items():
            images[f"{sub.name}/{stem}"] = path
            repeats[f"{sub.name}/{stem}"] = n
    return images, repeats


def _check_draws(counts: dict[str, int], repeats: int, where: str) -> None:
    """An image's draws an epoch (its folder's N x --repeats) at most MAX_REPEATS, as each alone is."""
    if (most := max(counts.values(), default=1)) * repeats > MAX_REPEATS:
        raise FluxKleinError(
            f"{where}: a repeat folder's {most} times --repeats {repeats} draws an image {most * repeats:,} times "
            f"an epoch; the limit is {MAX_REPEATS:,}: lower --repeats or the folder's number"
        )


def _folder_repeats(m: re.Match, where: str) -> int:
    """A repeat folder's N, in [1, MAX_REPEATS] (limits.py): each draw is an entry of the epoch's list."""
    digits = m.group(1).lstrip("0") or "0"  # up to 250 digits (a name's 255 bytes): compared, not converted
    n = int(digits) if len(digits) <= len(str(MAX_REPEATS)) else MAX_REPEATS + 1
    if n < 1:
        raise FluxKleinError(f"{where} repeats its images 0 times; name it 1_{m.group(2)} or more")
    if n > MAX_REPEATS:
        raise FluxKleinError(
            f"{where} repeats its images {digits[:12]}{'...' if len(digits) > 12 else ''} times; the limit is "
            f"{MAX_REPEATS:,}: name it {MAX_REPEATS}_{m.group(2)} or fewer"
        )
    return n


def _images_and_repeats(folder: Path, option: str, controls, repeats: int) -> tuple[dict[str, Path], dict[str, int]]:
    """stem -> image of a data folder, and -> its folder's repeats: the top level's 1, and under --data each
    kohya repeat folder's N (held-out images are not repeated; an edit LoRA's come from --data itself)."""
    images = _images_by_stem(folder, option)
    counts = dict.fromkeys(images, 1)
    if option == "--data":
        more, counts_more = _repeat_folders(folder, option)
        if more and controls:
            raise FluxKleinError(
                f"--data {folder} has repeat folders (N_name/) and --control is given: an edit LoRA's images are "
                "read from --data itself; move them there and give --repeats N"
            )
        images.update(more)
        counts.update(counts_more)
        _check_draws(counts, repeats, f"{option} {folder}")  # before any image is decoded
    return images, counts


def caption_of(image: Path, fallback: str | None, extension: str = ".txt") -> tuple[str, str] | None:
    """(caption, where from) for an image, or None when it has none (config_file compares it with a record)."""
    txt = image.with_suffix(extension)
    if why := broken_link(txt):
        raise FluxKleinError(f"caption {txt} is a symbolic link that {why}; remove it or fix it")
    if txt.is_dir():
        raise FluxKleinError(f"caption {txt} is a folder, not a text file; rename it or write the caption there")
    if txt.is_file():
        try:
            text = txt.read_text(encoding="utf-8-sig").strip()  # -sig: a leading BOM is not caption text
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise FluxKleinError(f"cannot read caption {txt} ({why}); save it as UTF-8 text") from None
        if text:
            return text, "file"
    return (fallback, "--caption") if fallback else None


TRIGGER_SLOT = "[trigger]"


def with_trigger(caption: str, trigger: str | None) -> str:
    """The caption as trained: `[trigger]` replaced by `trigger`; else `trigger, ` prepended unless the
    caption already holds the trigger as a word ("a fox, sks style" stays; "sksx" is not "sks"); None: as
    written (a `[trigger]` then is refused before: `check_trigger_slots`)."""
    if trigger is None:
        return caption
    if TRIGGER_SLOT in caption:
        return caption.replace(TRIGGER_SLOT, trigger)
    if re.search(rf"(?<!\w){re.escape(trigger)}(?!\w)", caption):
        return caption
    return f"{trigger}, {caption}"


def check_trigger_slots(named: list[tuple[str, str]], trigger: str | None) -> None:
    """`[trigger]` in a caption (name, text) with no --trigger to put there: one line naming them (it would
    train as the literal text "[trigger]")."""
    if trigger is not None:
        return
    holding = list(dict.fromkeys(name for name, text in named if TRIGGER_SLOT in text))
    if holding:
        raise FluxKleinError(
            f"{first_few(holding)} hold(s) {TRIGGER_SLOT} but no --trigger is given; give --trigger WORD to put "
            f"there, or write the word into the caption"
        )


def dropped_captions(seed: int, epoch: int, *, position: int, n: int, p: float) -> list[bool]:
    """Which of a batch's `n` examples train with the empty caption (probability `p` each).

    The draw comes from its own generator keyed by the run's seed and the batch's (epoch, position),
    so it is the same on resume and leaves the run's main random stream (order, sigma, noise) as
    it is: p = 0 and p = 1 runs draw the same noise."""
    if p <= 0.0:
        return [False] * n
    u = np.random.default_rng([seed, 0x64726F70, epoch, position]).random(n)  # 0x64726F70: "drop"
    return [bool(x < p) for x in u]


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def check_held_out(validation, data, validation_controls=(), controls=()) -> None:
    """--validation is not the --data folder, nor a --validation-control a --control folder: a held-out
    loss measured on the training images says nothing of how the LoRA does on others (one line)."""
    pairs = [(validation, "--validation", [data], "--data")]
    pairs += [(v, "--validation-control", list(controls), "--control") for v in validation_controls]
    for folder, option, trained, trained_option in pairs:
        if any(_same_folder(Path(folder).expanduser(), Path(t).expanduser()) for t in trained):
            raise FluxKleinError(
                f"{option} {folder} is the {trained_option} folder: its loss would measure the images the LoRA "
                "trains on; give a folder of held-out images, left out of training"
            )


def say_shared_images(held_out: list[TrainItem], items: list[TrainItem]) -> None:
    """Warn, naming them, where held-out images are training images byte for byte (another folder, a copy)."""
    trained = {it.image.sha256 for it in items}
    shared = sorted({it.image.path.name for it in held_out if it.image.sha256 in trained})
    if shared:
        warnings.warn(
            f"--validation: {len(shared)} held-out image(s) are also training images ({first_few(shared)}): their "
            "loss measures what the LoRA trains on; leave them out of --data or of --validation",
            stacklevel=3,
        )


def _holds_images(folder: Path) -> bool:
    """Whether an image lies anywhere under `folder` (links below it are not followed: a loop ends)."""
    return any(q.suffix.lower() in IMAGE_SUFFIXES for q in folder.rglob("*"))


def _say_unread_repeat_folders(folder: Path) -> None:
    """Warn about kohya repeat folders that are not read: a symbolic link (never followed: it may loop or
    lead out of the data) and a repeat folder's own sub-folders (N_name/ is read one level deep)."""
    linked, nested = [], []
    for p in sorted(folder.iterdir()):
        if not (REPEAT_FOLDER.fullmatch(p.name) and p.is_dir()):
            continue
        if p.is_symlink():
            linked.append(p.name)
            continue
        nested += [f"{p.name}/{q.name}" for q in sorted(p.iterdir()) if q.is_dir() and _holds_images(q)]
    if linked:
        warnings.warn(
            f"--data {folder}: the repeat folder(s) {first_few(linked)} are symbolic links, which are not followed "
            "(a link can loop or lead out of the data): their images are not read; put the folders themselves there",
            stacklevel=3,
        )
    if nested:
        warnings.warn(
            f"--data {folder}: the images in {first_few(nested)} are not read: a repeat folder's own sub-folders "
            "are not; move them into the repeat folder (or into one of their own, N_name/)",
            stacklevel=3,
        )


def _say_what_is_not_read(folder: Path, images: dict[str, Path], extension: str) -> None:
    """Warn about sub-folders holding images and caption files of another suffix (never silent)."""
    subs = []
    for p in sorted(folder.iterdir()):
        if REPEAT_FOLDER.fullmatch(p.name) and p.is_dir():  # a kohya repeat folder: _say_unread_repeat_folders
            continue
        if p.is_dir() and not p.name.startswith(".") and _holds_images(p):
            subs.append(p.name)
    _say_unread_repeat_folders(folder)
    if subs:
        head = first_few(subs)
        warnings.warn(
            f"--data {folder}: the images in its sub-folder(s) {head} are not read; move them into {folder} "
            "to train on them",
            stacklevel=2,
        )
    for other in CAPTION_SUFFIXES:
        unread = [p for p in images.values() if other != extension and p.with_suffix(other).is_file()]
        if unread:
            warnings.warn(
                f"--data {folder}: {len(unread)} {other} caption file(s) are not read (captions come from "
                f"{extension} files); give --caption-extension {other} to use them",
                stacklevel=2,
            )


def scan_data(
    data,
    *,
    caption: str | None = None,
    controls=(),
    resolution: int | tuple = 512,
    trigger: str | None = None,
    caption_extension: str = ".txt",
    option: str = "--data",
    control_option: str = "--control",
    repeats: int = 1,
) -> list[TrainItem]:
    """The training examples of `data` (and its `controls` folders), every file opened and checked;
    with several resolutions, one example per image and resolution (in the order listed).

    Raises FluxKleinError (one line) for a missing or empty folder, unreadable or corrupt images, images
    without a caption (and no `caption`), a control folder that is the data folder or misses a counterpart;
    warns about what it does not read and what it upscales. Captions are as trained (`trigger` applied).
    """
    folder = Path(data).expanduser()
    images, counts = _images_and_repeats(folder, option, controls, repeats)
    for c in controls:
        if _same_folder(Path(c).expanduser(), folder):
            raise FluxKleinError(f"{control_option} {c} is the {option} folder itself; give {CONTROL_WANTED}")
    if not images:
        raise FluxKleinError(
            f"{option} {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); put the training images there, "
            "each with a .txt caption"
        )
    uncaptioned = [p.name for p in images.values() if caption_of(p, caption, caption_extension) is None]
    if uncaptioned:
        head = first_few(uncaptioned)
        raise FluxKleinError(
            f"{len(uncaptioned)} image(s) in {folder} have no caption ({head}); write <name>{caption_extension} "
            f"next to each or give --caption for them{_other_captions_hint(folder, images, caption_extension)}"
        )
    control_maps = [(Path(c).expanduser(), _images_by_stem(Path(c).expanduser(), control_option)) for c in controls]
    for cfolder, cmap in control_maps:
        missing = [s for s in images if s not in cmap]
        if missing:
            head = first_few(missing)
            raise FluxKleinError(
                f"{control_option} {cfolder} has no image for {len(missing)} image(s) of {option} ({head}); "
                f"each control folder needs one image per image of {option}, with the same name"
            )
    captions = _captions(images, caption, caption_extension, trigger)
    sizes = (resolution,) if isinstance(resolution, int) else tuple(resolution)
    items = []
    for stem, path in images.items():
        text, source = captions[stem]
        picture = check_picture(path, "training image")
        pics = [check_picture(cmap[stem], "control image") for _, cmap in control_maps]
        example = dict(
            stem=stem, image=picture, caption=with_trigger(text, trigger), caption_from=source, controls=pics
        )
        example["repeats"] = counts[stem] * repeats
        items += [TrainItem(**example, bucket=bucket_size(*picture.size, size)) for size in sizes]  # one per size
    _say_what_is_not_read(folder, images, caption_extension)  # once the data passed: a refusal stays one line
    _say_upscaled(items, option)
    return items


def _captions(images: dict[str, Path], caption, extension: str, trigger) -> dict[str, tuple[str, str]]:
    """stem -> (caption as written, where from) of captioned `images`, a `[trigger]` without --trigger refused."""
    captions = {stem: caption_of(path, caption, extension) for stem, path in images.items()}
    named = [
        ("--caption" if source == "--caption" else images[stem].with_suffix(extension).name, text)
        for stem, (text, source) in captions.items()
    ]
    check_trigger_slots(named, trigger)
    return captions


UPSCALE_SAID = 2.0  # an image stretched past twice its width or height trains on blur: said, named


def _say_upscaled(items: list[TrainItem], option: str) -> None:
    """Warn, naming the images and their size, where a training size stretches an image past `UPSCALE_SAID`
    times a side (a 64 px image at 768 is 12x): the run may go on (tiny art may be meant), never silently."""
    worst: dict[str, tuple[float, TrainItem]] = {}  # image name -> (its largest stretch, the example)
    for it in items:
        stretch = max(it.bucket[0] / it.image.size[0], it.bucket[1] / it.image.size[1])
        if stretch > worst.get(it.image.path.name, (0.0,))[0]:
            worst[it.image.path.name] = (stretch, it)
    big = [(name, x, it) for name, (x, it) in worst.items() if x > UPSCALE_SAID]
    if big:
        named = first_few([f"{name} ({it.image.size[0]}x{it.image.size[1]} px, {x:.0f}x)" for name, x, it in big])
        warnings.warn(
            f"{option}: {len(big)} image(s) are upscaled more than {UPSCALE_SAID:g}x to the training size: {named}; "
            "they train on blur: give larger images or a smaller --resolution",
            stacklevel=3,
        )


def _other_captions_hint(folder: Path, images: dict[str, Path], extension: str) -> str:
    for other in CAPTION_SUFFIXES:
        if other != extension and any(p.with_suffix(other).is_file() for p in images.values()):
            return f" (the {other} files there are read with --caption-extension {other})"
    return ""


# The rule `load_pixels` sizes an image by, named in the latent cache's keys (train/data/latents.py): change the
# name when the rule changes, so that no latent of the old rule is read back.
CROP_RULE = "lanczos-cover-centre-crop"


def load_pixels(path: Path, size: tuple[int, int], flip: bool = False) -> np.ndarray:
    """An image resized to cover `size` = (W, H) and centre-cropped to it (`flip`: then mirrored left to
    right): (H, W, 3) float32 in [-1, 1]."""
    img = open_image(path, "training image").convert("RGB")
    W, H = size
    w, h = img.size
    scale = max(W / w, H / h)
    rw, rh = max(W, round(w * scale)), max(H, round(h * scale))
    img = img.resize((rw, rh), Image.Resampling.LANCZOS)
    left, top = (rw - W) // 2, (rh - H) // 2
    img = img.crop((left, top, left + W, top + H))
    pixels = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return np.ascontiguousarray(pixels[:, ::-1]) if flip else pixels


def epoch_batches(items: list[TrainItem], batch_size: int, rng: np.random.Generator) -> list[list[int]]:
    """One epoch's batches (lists of item indices): each item `repeats` times, in a random order (a
    permutation of that list), cut into batches within each bucket (a bucket's last batch may be
    smaller), the batches in random order. (Repeats of 1: a permutation of the items.)"""
    pool = [i for i, it in enumerate(items) for _ in range(it.repeats)]
    order = rng.permutation(len(pool))
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for j in order:
        i = pool[j]
        by_bucket.setdefault(items[i].bucket, []).append(int(i))
    batches = [idx[k : k + batch_size] for idx in by_bucket.values() for k in range(0, len(idx), batch_size)]
    return [batches[j] for j in rng.permutation(len(batches))]


def batches_per_epoch(items: list[TrainItem], batch_size: int) -> int:
    """How many batches of at most `batch_size` (the global batch) one epoch of `epoch_batches` cuts."""
    counts: dict[tuple[int, int], int] = {}
    for it in items:
        counts[it.bucket] = counts.get(it.bucket, 0) + it.repeats
    return sum(math.ceil(n / batch_size) for n in counts.values())


FLIP_STREAM = 0x666C6970  # "flip": the generator of --flip's draws, apart from the run's main stream


def flipped_examples(seed: int, step: int, examples) -> list[bool]:
    """--flip: which examples of optimizer step `step` train mirrored left to right, example k (counted
    over the step's global batches, as the noise is: distributed.example_draws) when a draw U(0, 1) of
    the generator seeded (seed, FLIP_STREAM, step, k) is below 1/2. Keyed per example, so the same on
    resume and under mlx.launch, and the run's other random numbers stay as they are."""
    return [bool(np.random.default_rng([seed, FLIP_STREAM, step, k]).random() < 0.5) for k in examples]


def running_batch(items: list[TrainItem], batch_size: int) -> int:
    """The largest batch a run of `items` ever runs: a batch never mixes buckets, so `batch_size` is cut to
    the largest bucket's count (said once, with a warning, where that is less than asked)."""
    largest = max(bucket_counts(items).values(), default=1)
    if largest < batch_size:
        warnings.warn(
            f"--batch-size {batch_size} is more than the {largest} image(s) of the largest bucket (a batch never "
            f"mixes buckets): batches of at most {largest} run, and the memory plan sizes {largest}",
            stacklevel=2,
        )
    return min(batch_size, largest)


def bucket_counts(items: list[TrainItem]) -> dict[str, int]:
    """ "WxH" -> number of images, for reports."""
    counts: dict[str, int] = {}
    for it in items:
        key = f"{it.bucket[0]}x{it.bucket[1]}"
        counts[key] = counts.get(key, 0) + 1
    return counts
