"""Layout boxes: what the user gives, the upsampler's 0-1000 canvas, and its answer's box table.

A user box places one element: `--box "x0,y0,x1,y1:desc"` (x first, 0-1, top-left origin) or, in Python
and the server, diffusers' form: a dict with "desc", an optional "id" and "bbox" [y_min, x_min, y_max,
x_max] in 0-1 (an edit may instead give "from" "ref_image_N" / "target" with "src_bbox" / "tgt_bbox").
On the canvas the upsampler and the transformer read, a box is [y_min, x_min, y_max, x_max] in whole
units of 0-1000 and a row is {"id", "bbox", "desc"}; an id left out is `obj_<n>`, as diffusers names it.

The upsampler answers "caption citing <id>s [table]"; `reconcile` puts the user's boxes back as given
(they are locked): a row that re-planned a locked box under another id (IoU >= 0.9) takes the locked
id, a locked row keeps the upsampler's description, and the rows it added follow when well formed.
The rules are BFL's (flux3 `bbox.py`), as diffusers' `prompt_upsampler.py` carries them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from ..errors import FluxKleinError, quoted
from ..limits import MAX_BOXES, MAX_PROMPT_CHARS
from ..models.tokenizer import check_text

CANVAS = 1000  # the grid the boxes live on, stretched onto the image
BOX_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
ORIGIN = re.compile(r"ref_image_\d+|target")
SAME_BOX_IOU = 0.9  # a re-planned row this close to a locked box is that box
BOX_SPEC = '"x0,y0,x1,y1:desc" with 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1 (fractions of the width and height)'


KEYS = ("id", "desc", "bbox", "from", "src_bbox", "tgt_bbox")  # diffusers' box dict; nothing else is read


def parse_box(spec: str) -> dict:
    """`--box "x0,y0,x1,y1:desc"` -> {"bbox": [y0, x0, y1, x1], "desc"} (checked by `check_boxes`; a box
    without ":desc" has desc "", which only the upsampler may fill)."""
    numbers, _, desc = str(spec).partition(":")
    parts = numbers.split(",")
    try:
        x0, y0, x1, y1 = (float(p) for p in parts)
    except ValueError:
        raise FluxKleinError(f"{{boxes}} {quoted(spec)} is not {BOX_SPEC}") from None
    return {"bbox": [y0, x0, y1, x1], "desc": desc.strip()}


def _check_unit_box(box, what: str) -> list[float]:
    """A [y_min, x_min, y_max, x_max] in 0-1 with min < max on both axes, each side at least one unit of
    the 0-1000 canvas (a narrower box would be a line or [0, 0, 0, 0] for the model), or one line."""
    ok = isinstance(box, (list, tuple)) and len(box) == 4
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
    if not ok:
        raise FluxKleinError(f"{what} must be [y_min, x_min, y_max, x_max], four numbers in 0-1, not {box!r:.80}")
    y0, x0, y1, x1 = (float(v) for v in box)
    if min(box) < 0 or max(box) > 1:
        raise FluxKleinError(f"{what} {_as_xy(box)} lies outside the image: every coordinate must be in 0-1")
    if x0 >= x1 or y0 >= y1:
        raise FluxKleinError(f"{what} {_as_xy(box)} is empty: it needs x0 < x1 and y0 < y1")
    cy0, cx0, cy1, cx1 = _on_canvas([y0, x0, y1, x1])
    if cx0 >= cx1 or cy0 >= cy1:
        raise FluxKleinError(
            f"{what} {_as_xy(box)} is narrower than the layout's grid: the model reads boxes in 1/{CANVAS} of "
            f"the image, so each side must span at least 1/{CANVAS}"
        )
    return [y0, x0, y1, x1]


def _as_xy(box) -> str:
    y0, x0, y1, x1 = box
    return f"(x0,y0,x1,y1 = {x0:g},{y0:g},{x1:g},{y1:g})"


def check_boxes(
    boxes: Sequence | None, prompt: str = "", *, references: int | None = None, upsample: bool = False
) -> tuple[dict, ...]:
    """The user's boxes (`--box` strings or diffusers' dicts) checked, as diffusers' dicts; () for none.
    Every door's one parser: at most MAX_BOXES, and their texts with `prompt` at most MAX_PROMPT_CHARS
    (a box's text is prompt text), both counted before any box is read further. `references`: the images
    an edit's "from" may name (ref_image_0 ..); 0 is a text-to-image run (no edit forms); None: not known
    yet (checked again once it is). `upsample`: the upsampler writes a box's desc when it has none."""
    if boxes is None:
        return ()
    if isinstance(boxes, (str, dict)) or not isinstance(boxes, Sequence):
        raise FluxKleinError(f"boxes must be a list of boxes, not {type(boxes).__name__}")
    if len(boxes) > MAX_BOXES:
        raise FluxKleinError(f"{len(boxes):,} layout boxes given ({{boxes}}); the limit is {MAX_BOXES}")
    chars = len(prompt)
    out, ids = [], set()
    for i, box in enumerate(boxes):
        what = f"box {i + 1}"
        chars += len(box) if isinstance(box, str) else len(str(box.get("desc", ""))) if isinstance(box, dict) else 0
        if chars > MAX_PROMPT_CHARS:
            raise FluxKleinError(
                f"the prompt and the boxes' text are at least {chars:,} characters long; the limit for them "
                f"together is {MAX_PROMPT_CHARS:,} (a box's text is prompt text): shorten them"
            )
        row = _check_box(parse_box(box) if isinstance(box, str) else box, what, references, upsample)
        row_id = row.get("id") or f"obj_{i + 1}"  # canvas_rows' name for it
        if row_id in ids:
            raise FluxKleinError(f"{what}'s id {row_id!r} is taken by an earlier box; give each box its own id")
        ids.add(row_id)
        out.append(row)
    return tuple(out)


def _check_box(box, what: str, references: int | None, upsample: bool) -> dict:
    """One box (diffusers' dict) checked: its keys, id, desc, and one form of boxes."""
    if not isinstance(box, dict):
        raise FluxKleinError(f'{what} must be "x0,y0,x1,y1:desc" or a dict with bbox and desc, not {box!r:.80}')
    if unknown := [key for key in box if key not in KEYS]:
        raise FluxKleinError(f"{what} has an unknown key {str(unknown[0])!r:.60}; a box's keys are {', '.join(KEYS)}")
    row = {}
    if box.get("id") is not None:
        if not isinstance(box["id"], str) or not BOX_ID.fullmatch(box["id"]):
            raise FluxKleinError(f"{what}'s id must be a letter then letters, digits or _, not {box['id']!r:.60}")
        row["id"] = box["id"]
    desc = box.get("desc", "")
    if not isinstance(desc, str):
        raise FluxKleinError(f"{what}'s desc must be text, not {type(desc).__name__}")
    check_text(desc, f"{what}'s desc")
    if not desc.strip() and not upsample:
        raise FluxKleinError(
            f'{what} names no element: give its desc ("0.1,0.5,0.45,0.95:a cat", or "desc": "a cat"), or let the '
            "prompt upsampler write it ({upsample})"
        )
    row["desc"] = desc.strip()
    if box.get("bbox") is not None:
        if any(box.get(key) is not None for key in ("from", "src_bbox", "tgt_bbox")):
            raise FluxKleinError(f"{what} gives both bbox and an edit's from / src_bbox / tgt_bbox; give one form")
        row["bbox"] = _check_unit_box(box["bbox"], what)
    elif box.get("src_bbox") is not None or box.get("tgt_bbox") is not None:
        row.update(_edit_form(box, what, references))
    else:
        raise FluxKleinError(f"{what} has no bbox (nor src_bbox / tgt_bbox)")
    return row


def _edit_form(box: dict, what: str, references: int | None) -> dict:
    """An edit's box: "from" "ref_image_N" (an element of reference N, 0-based, with its src_bbox there) or
    "target" (a new element: a tgt_bbox, no src_bbox), as the upsampler's own rows are kept (`added_row`)."""
    if references == 0:
        raise FluxKleinError(
            f"{what} gives from / src_bbox / tgt_bbox, which place an element of a reference image: this run has "
            "none; give bbox [y_min, x_min, y_max, x_max]"
        )
    origin = box.get("from")
    if not isinstance(origin, str) or not ORIGIN.fullmatch(origin):
        raise FluxKleinError(f"{what}'s from must be 'target' or 'ref_image_N', not {origin!r:.60}")
    if references is not None and origin != "target" and int(origin.removeprefix("ref_image_")) >= references:
        raise FluxKleinError(
            f"{what}'s from is {origin!r} but the run has {references} reference image(s): ref_image_0 to "
            f"ref_image_{references - 1}"
        )
    rows = {"from": origin}
    for name in ("src_bbox", "tgt_bbox"):
        rows[name] = None if box.get(name) is None else _check_unit_box(box[name], f"{what}'s {name}")
    if (origin == "target") == (rows["src_bbox"] is not None):
        raise FluxKleinError(
            f"{what}: a box from 'target' (a new element) has no src_bbox, one from a reference image has one"
        )
    return rows


def _on_canvas(box: list[float] | None) -> list[int] | None:
    return None if box is None else [round(min(1.0, max(0.0, float(v))) * CANVAS) for v in box]


def canvas_rows(boxes: Sequence[dict]) -> list[dict]:
    """Checked user boxes (0-1) as rows of the box table on the 0-1000 canvas, ids given or `obj_<n>`."""
    rows = []
    for i, box in enumerate(boxes):
        row_id, desc = str(box.get("id") or f"obj_{i + 1}"), str(box.get("desc") or "")
        if box.get("bbox"):
            rows.append({"id": row_id, "bbox": _on_canvas(box["bbox"]), "desc": desc})
        else:
            src, tgt = _on_canvas(box.get("src_bbox")), _on_canvas(box.get("tgt_bbox"))
            rows.append(
                {"id": row_id, "from": str(box.get("from") or ""), "src_bbox": src, "tgt_bbox": tgt, "desc": desc}
            )
    return rows


def layout_request(prompt: str, rows: list[dict]) -> str:
    """The user turn of a layout request: the prompt, then the locked rows the answer must keep."""
    return (
        f"ORIGINAL PROMPT:\n{prompt.strip()}\n\n"
        "LOCKED BOUNDING-BOX ANNOTATIONS ([y_min, x_min, y_max, x_max] on a 0-1000 canvas, with (0, 0) at "
        "the top-left). This is an authoritative JSON list of dictionaries; preserve every supplied identity, "
        f"provenance value, null, and coordinate exactly:\n{json.dumps(rows, ensure_ascii=False)}"
    )


def layout_prompt(prompt: str, rows: list[dict]) -> str:
    """The layout written as the transformer reads it, without the upsampler: the prompt, each row's
    `<id>` it does not cite yet, then the table (0-1000 canvas)."""
    cites = "".join(f" <{row['id']}>" for row in rows if f"<{row['id']}>" not in prompt)
    return f"{prompt.strip()}{cites} {json.dumps(rows, ensure_ascii=False)}"


def split_answer(text: str) -> tuple[str, list | None]:
    """(caption, table): the table is the JSON list that ends the text (the last '[' that parses), if any."""
    start = len(text)
    while (start := text.rfind("[", 0, start)) >= 0:
        try:
            table = json.loads(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(table, list):
            return text[:start].rstrip(), table
    return text.strip(), None


def canvas_box(box) -> list | None:
    """`box` when it is a well-formed [y_min, x_min, y_max, x_max] on the 0-1000 canvas, else None
    (all of it at most 1 is read as 0-1 coordinates, which the canvas is not)."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        return None
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in box):
        return None
    y0, x0, y1, x1 = box
    inside = 0 <= y0 < y1 <= CANVAS and 0 <= x0 < x1 <= CANVAS
    return list(box) if inside and max(box) > 1 else None


def added_row(row, caption: str) -> dict | None:
    """A row the upsampler added, as kept: a well-formed id the caption cites, a description, valid boxes."""
    if not isinstance(row, dict):
        return None
    row_id, desc = row.get("id"), row.get("desc")
    if not isinstance(row_id, str) or not BOX_ID.fullmatch(row_id) or f"<{row_id}>" not in caption:
        return None
    if not isinstance(desc, str) or not desc.strip():
        return None
    if (box := canvas_box(row.get("bbox"))) is not None:
        return {"id": row_id, "bbox": box, "desc": desc.strip()}
    origin, src, tgt = row.get("from"), row.get("src_bbox"), row.get("tgt_bbox")
    src_box = None if src is None else canvas_box(src)
    tgt_box = None if tgt is None else canvas_box(tgt)
    broken = (src is not None and src_box is None) or (tgt is not None and tgt_box is None)
    if not isinstance(origin, str) or not ORIGIN.fullmatch(origin) or broken or (src_box is None and tgt_box is None):
        return None
    if (origin == "target") == (src_box is not None):  # a new element has no source box; a moved one has one
        return None
    return {"id": row_id, "from": origin, "src_bbox": src_box, "tgt_bbox": tgt_box, "desc": desc.strip()}


def overlap(a: list, b: list) -> float:
    """Intersection over union of two [y_min, x_min, y_max, x_max] boxes."""
    inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _any_box(row: dict):
    return row.get("bbox") or row.get("tgt_bbox") or row.get("src_bbox")


def _renames(table: list, locked: list[dict]) -> dict[str, str]:
    """upsampler id -> locked id, for each locked box the answer re-planned under another id."""
    locked_ids = {row["id"] for row in locked}
    answered = {row.get("id") for row in table if isinstance(row, dict)}
    renamed: dict[str, str] = {}
    for lock in locked:
        lock_box = _any_box(lock)
        if lock["id"] in answered or lock_box is None:
            continue
        for row in table:
            if not isinstance(row, dict) or row.get("id") in renamed or row.get("id") in locked_ids:
                continue
            box = canvas_box(_any_box(row))
            if box is not None and overlap(box, lock_box) >= SAME_BOX_IOU:
                renamed[row["id"]] = lock["id"]
                break
    return renamed


def reconcile(text: str, locked: list[dict]) -> str:
    """The upsampler's answer with the locked rows re-imposed (see the module docstring)."""
    caption, table = split_answer(text)
    table = table or []
    renamed = _renames(table, locked)
    for row in table:
        if isinstance(row, dict) and row.get("id") in renamed:
            row["id"] = renamed[row["id"]]
    for old, new in renamed.items():
        caption = caption.replace(f"<{old}>", f"<{new}>")
    by_id = {row.get("id"): row for row in table if isinstance(row, dict) and isinstance(row.get("id"), str)}
    out = []
    for lock in locked:
        desc = by_id.get(lock["id"], {}).get("desc")
        out.append({**lock, "desc": desc.strip() if isinstance(desc, str) and desc.strip() else lock.get("desc", "")})
    for row in table:
        added = added_row(row, caption)
        if added is not None and added["id"] not in {kept["id"] for kept in out}:
            out.append(added)
    return f"{caption} {json.dumps(out, ensure_ascii=False)}"
