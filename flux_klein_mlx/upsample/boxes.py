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

from ..errors import FluxKleinError

CANVAS = 1000  # the grid the boxes live on, stretched onto the image
BOX_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
ORIGIN = re.compile(r"ref_image_\d+|target")
SAME_BOX_IOU = 0.9  # a re-planned row this close to a locked box is that box
BOX_SPEC = '"x0,y0,x1,y1:desc" with 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1 (fractions of the width and height)'


def parse_box(spec: str) -> dict:
    """`--box "x0,y0,x1,y1:desc"` -> {"bbox": [y0, x0, y1, x1], "desc"} (checked by `check_boxes`)."""
    numbers, sep, desc = str(spec).partition(":")
    parts = numbers.split(",")
    try:
        x0, y0, x1, y1 = (float(p) for p in parts)
    except ValueError:
        raise FluxKleinError(f"--box {spec!r} is not {BOX_SPEC}") from None
    if not sep or not desc.strip():
        raise FluxKleinError(f'--box {spec!r} names no element: write {BOX_SPEC}, e.g. "0.1,0.5,0.45,0.95:a cat"')
    return {"bbox": [y0, x0, y1, x1], "desc": desc.strip()}


def _check_unit_box(box, what: str) -> list[float]:
    """A [y_min, x_min, y_max, x_max] in 0-1 with min < max on both axes, or one line saying what is wrong."""
    ok = isinstance(box, (list, tuple)) and len(box) == 4
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
    if not ok:
        raise FluxKleinError(f"{what} must be [y_min, x_min, y_max, x_max], four numbers in 0-1, not {box!r}")
    y0, x0, y1, x1 = (float(v) for v in box)
    if min(box) < 0 or max(box) > 1:
        raise FluxKleinError(f"{what} {_as_xy(box)} lies outside the image: every coordinate must be in 0-1")
    if x0 >= x1 or y0 >= y1:
        raise FluxKleinError(f"{what} {_as_xy(box)} is empty: it needs x0 < x1 and y0 < y1")
    return [y0, x0, y1, x1]


def _as_xy(box) -> str:
    y0, x0, y1, x1 = box
    return f"(x0,y0,x1,y1 = {x0:g},{y0:g},{x1:g},{y1:g})"


def check_boxes(boxes: Sequence | None) -> tuple[dict, ...]:
    """The user's boxes (`--box` strings or diffusers' dicts) checked, as diffusers' dicts; () for none."""
    if boxes is None:
        return ()
    if isinstance(boxes, (str, dict)) or not isinstance(boxes, Sequence):
        raise FluxKleinError(f"boxes must be a list of boxes, not {type(boxes).__name__}")
    out = []
    for i, box in enumerate(boxes):
        what = f"box {i + 1}"
        box = parse_box(box) if isinstance(box, str) else box
        if not isinstance(box, dict):
            raise FluxKleinError(f'{what} must be "x0,y0,x1,y1:desc" or a dict with bbox and desc, not {box!r}')
        row = {}
        if box.get("id") is not None:
            if not isinstance(box["id"], str) or not BOX_ID.fullmatch(box["id"]):
                raise FluxKleinError(f"{what}'s id must be a letter then letters, digits or _, not {box['id']!r}")
            row["id"] = box["id"]
        if not isinstance(box.get("desc", ""), str):
            raise FluxKleinError(f"{what}'s desc must be text, not {type(box['desc']).__name__}")
        row["desc"] = box.get("desc", "")
        if box.get("bbox") is not None:
            row["bbox"] = _check_unit_box(box["bbox"], what)
        elif box.get("src_bbox") is not None or box.get("tgt_bbox") is not None:
            origin = box.get("from")
            if not isinstance(origin, str) or not ORIGIN.fullmatch(origin):
                raise FluxKleinError(f"{what}'s from must be 'target' or 'ref_image_N', not {origin!r}")
            row["from"] = origin
            for name in ("src_bbox", "tgt_bbox"):
                row[name] = None if box.get(name) is None else _check_unit_box(box[name], f"{what}'s {name}")
        else:
            raise FluxKleinError(f"{what} has no bbox (nor src_bbox / tgt_bbox)")
        out.append(row)
    return tuple(out)


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
