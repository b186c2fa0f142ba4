"""Training data uploaded to `serve` (POST /v1/files, purpose "fine-tune"): a zip of images and captions,
checked whole, then unpacked under the server's --train-dir as the folders `train --data` and `--control` read.

A zip is a stranger's file. Every entry is checked before anything is written: its name (no absolute
name, no `..`, no backslash, no link, at most two folders deep), its kind (an image that opens, or a
caption that is UTF-8 text), and the counts, bytes and pixels of `limits` (the block at its end). The
zip's root is the `--data` folder (kohya `N_name/` repeat folders in it); its top-level folders `control/`,
`control_2/`, ... are the `--control` folders, in that order. A zip of one folder (what "compress" makes)
is read as that folder's contents; macOS's `__MACOSX/` and `.DS_Store` entries are skipped. The folder is
written whole or not at all (`storage/files.folder_transaction`), with its OpenAI file object beside the
data (`file.json`), so a restarted server lists what it holds.

    <train-dir>/files/file-<24 hex>/file.json  data/...  controls/control/...  controls/control_2/...
"""

from __future__ import annotations

import io
import json
import re
import secrets
import shutil
import stat
import time
import warnings
import zipfile
from pathlib import Path

from PIL import Image

from ..errors import FluxKleinError, quoted
from ..limits import (
    MAX_NAME_BYTES,
    MAX_PROMPT_CHARS,
    MAX_TRAINING_ENTRIES,
    MAX_TRAINING_IMAGE_PIXELS,
    MAX_TRAINING_UNPACKED_BYTES,
)
from ..storage.files import folder_transaction
from ..train.data.dataset import CAPTION_SUFFIXES, IMAGE_SUFFIXES

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
CONTROL_FOLDER = re.compile(r"control(?:_([1-9][0-9]{0,2}))?")  # control/, control_2/, ...: --control in order
SKIPPED = re.compile(r"(^|/)(__MACOSX/|\.DS_Store$)")  # macOS's resource forks and folder settings
RECORD = "file.json"


def entry_parts(name: str) -> tuple[str, ...]:
    """A zip entry's name -> its parts, or a one-line refusal of a name that could leave its folder: an
    absolute name, a drive, `..`, a backslash, a NUL, an empty part, a part too long, more than 2 folders."""
    if not name or name.startswith("/") or "\\" in name or "\0" in name or re.match(r"[A-Za-z]:", name):
        raise FluxKleinError(f"the zip holds the entry {name!r}: names must be relative paths with / between parts")
    parts = tuple(name.rstrip("/").split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise FluxKleinError(f"the zip holds the entry {name!r}: a name may not hold '..', '.' or '//'")
    if any(len(p.encode()) > MAX_NAME_BYTES for p in parts):
        raise FluxKleinError(f"the zip holds a name longer than {MAX_NAME_BYTES} bytes: {quoted(name)}")
    if len(parts) > 4:  # an optional wrapper folder, a repeat or control folder, the file: 3; more is refused later
        raise FluxKleinError(f"the zip holds {name!r}, {len(parts) - 1} folders deep; the data is at most 2 deep")
    return parts


def is_link(info: zipfile.ZipInfo) -> bool:
    """A symbolic link (a Unix zip's mode bits), or any type but a plain file or folder (no type: a file)."""
    kind = stat.S_IFMT(info.external_attr >> 16)
    return kind not in (0, stat.S_IFREG, stat.S_IFDIR)


def zip_entries(archive: zipfile.ZipFile) -> list[tuple[tuple[str, ...], zipfile.ZipInfo]]:
    """The files of a zip as (destination parts under the file's folder, entry), every name and size checked;
    folders and macOS's extras left out, a single wrapper folder taken off."""
    infos = archive.infolist()
    if len(infos) > MAX_TRAINING_ENTRIES:
        raise FluxKleinError(f"the zip holds {len(infos):,} entries; the limit is {MAX_TRAINING_ENTRIES:,}")
    files, total = [], 0
    for info in infos:
        parts = entry_parts(info.filename)
        if is_link(info):
            raise FluxKleinError(f"the zip holds {info.filename!r}, a link (or device); put the file itself in it")
        if info.is_dir() or SKIPPED.search(info.filename):
            continue
        total += info.file_size
        if total > MAX_TRAINING_UNPACKED_BYTES:
            raise FluxKleinError(f"the zip unpacks to more than {MAX_TRAINING_UNPACKED_BYTES / 2**30:.0f} GB")
        files.append((parts, info))
    if not files:
        raise FluxKleinError("the zip holds no files; put images (.png .jpg .jpeg .webp) and .txt captions in it")
    tops = {parts[0] for parts, _ in files}
    wrapper = len(tops) == 1 and all(len(parts) > 1 for parts, _ in files)
    if wrapper and not re.fullmatch(r"\d+_.+", next(iter(tops))) and not CONTROL_FOLDER.fullmatch(next(iter(tops))):
        files = [(parts[1:], info) for parts, info in files]
    return [(destination(parts, info.filename), info) for parts, info in files]


def destination(parts: tuple[str, ...], name: str) -> tuple[str, ...]:
    """Where an entry goes: a control folder's file under controls/, anything else under data/; a file in
    data/ is at most one folder deep (a kohya repeat folder), a control folder's directly in it."""
    if len(parts) > 1 and CONTROL_FOLDER.fullmatch(parts[0]):
        if len(parts) > 2:
            raise FluxKleinError(f"the zip holds {name!r}: a control folder holds images directly, no folders")
        return ("controls", *parts)
    if len(parts) > 2:
        raise FluxKleinError(f"the zip holds {name!r}: the data is images at the top or in N_name/ folders")
    return ("data", *parts)


def check_entry(name: str, data: bytes) -> str:
    """An entry's content: "image" (it opens whole, within the pixel bound) or "caption" (UTF-8 text)."""
    suffix = Path(name).suffix.lower()
    if suffix in CAPTION_SUFFIXES:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise FluxKleinError(f"the caption {name!r} is not UTF-8 text; save it as UTF-8") from None
        if "\0" in text or len(text) > MAX_PROMPT_CHARS:
            raise FluxKleinError(f"the caption {name!r} is not a caption: text of at most {MAX_PROMPT_CHARS:,} chars")
        return "caption"
    if suffix not in IMAGE_SUFFIXES:
        raise FluxKleinError(
            f"the zip holds {name!r}, neither an image ({' '.join(IMAGE_SUFFIXES)}) nor a caption (.txt, .caption)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:  # the header first: its size before any decoding
                w, h = im.size
                if w * h > MAX_TRAINING_IMAGE_PIXELS:
                    raise FluxKleinError(
                        f"the image {name!r} is {w}x{h}; the limit is {MAX_TRAINING_IMAGE_PIXELS / 1e6:.0f} MP"
                    )
                im.load()
    except FluxKleinError:
        raise
    except Exception:  # PIL raises many kinds for bad data, a decompression bomb among them
        raise FluxKleinError(f"the image {name!r} does not open as an image; upload PNG, JPEG or WebP files") from None
    return "image"


def unpack(archive: zipfile.ZipFile, folder: Path) -> dict:
    """Every entry checked and written under `folder` (a new folder's temporary twin, then renamed into place);
    returns the counts for the file object."""
    entries = zip_entries(archive)
    counts = {"images": 0, "captions": 0}
    for parts, info in entries:
        read = read_entry(archive, info)
        counts[check_entry(info.filename, read) + "s"] += 1
        target = folder.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(target, "xb") as f:  # a second entry of one name (or of one name but for case) is refused
                f.write(read)
        except FileExistsError:
            raise FluxKleinError(f"the zip holds {info.filename!r} twice (or two names that differ by case)") from None
    if not counts["images"]:
        raise FluxKleinError("the zip holds no images; put .png .jpg .jpeg or .webp files with their .txt captions")
    controls = sorted((folder / "controls").iterdir(), key=control_order) if (folder / "controls").is_dir() else []
    counts["controls"] = [c.name for c in controls]
    return counts


def control_order(path: Path) -> int:
    """control/ first, then control_2/, control_3/, ... (by number, not by name)."""
    m = CONTROL_FOLDER.fullmatch(path.name)
    return int(m.group(1) or 1) if m else 0


def read_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """An entry's bytes, at most its declared size (zipfile stops there) and checked against its CRC."""
    try:
        with archive.open(info) as f:
            return f.read(MAX_TRAINING_UNPACKED_BYTES + 1)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as e:
        raise FluxKleinError(f"the zip's entry {info.filename!r} cannot be read ({e}); zip the files again") from None


class TrainingFiles:
    """The uploaded training data under `<train-dir>/files/`: add, list, look up, delete."""

    def __init__(self, root: Path):
        self.root = root / "files"

    def add(self, upload, filename: str, size: int) -> dict:
        """An uploaded zip (a seekable binary file of `size` bytes) -> its checked, unpacked folder's file object."""
        try:
            archive = zipfile.ZipFile(upload)
        except (zipfile.BadZipFile, OSError, EOFError):
            raise FluxKleinError("the upload is not a zip file; zip the images and their .txt captions") from None
        file_id = f"file-{secrets.token_hex(12)}"
        record = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename[:200],
            "purpose": "fine-tune",
            "status": "processed",
            "status_details": None,
        }
        with archive, folder_transaction(self.root / file_id) as tmp:
            record.update(unpack(archive, tmp))
            (tmp / RECORD).write_text(json.dumps(record), encoding="utf-8")
        return record

    def all(self) -> list[dict]:
        """Every stored file's object, newest first (a folder without its record is not one of ours)."""
        found = (
            [self.get(p.name) for p in self.root.iterdir() if FILE_ID.fullmatch(p.name)] if self.root.is_dir() else []
        )
        return sorted(filter(None, found), key=lambda r: r["created_at"], reverse=True)

    def get(self, file_id) -> dict | None:
        if not isinstance(file_id, str) or not FILE_ID.fullmatch(file_id):
            return None
        try:
            return json.loads((self.root / file_id / RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def folders(self, file_id: str) -> tuple[Path, tuple[Path, ...]]:
        """A stored file's `--data` folder and its `--control` folders, in order."""
        record = self.get(file_id)
        folder = self.root / file_id
        return folder / "data", tuple(folder / "controls" / name for name in (record or {}).get("controls", []))

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        (self.root / file_id / RECORD).unlink()  # no longer listed, even if the rest is cut short
        shutil.rmtree(self.root / file_id, ignore_errors=True)
        return True
