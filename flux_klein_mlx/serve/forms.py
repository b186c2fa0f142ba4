"""What a client may send to `serve`: OpenAI's fields parsed and checked into our types, and errors
in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`).

Nothing here touches MLX or the network; `api.py` calls these on every request. An error body never
shows a server-side path (only its last part) or an exception's repr.
"""

from __future__ import annotations

import json
import posixpath
import re

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..errors import FluxKleinError
from ..inputs.outpaint import centred_pads, parse_outpaint
from ..inputs.settings import check_image_size
from ..upsample.boxes import check_boxes


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = (
            "rate_limit_error"
            if self.status == 429
            else "server_error"
            if self.status >= 500
            else "invalid_request_error"
        )
        message = shown(self.message)
        return {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER.get(self.code, 5))} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def shown(message: str) -> str:
    """A message as a client sees it: server-side paths shortened to their last part (PATH_RE)."""
    return PATH_RE.sub(r"\1", message)


MB = 1 << 20
# Seconds a 429 or 503 tells the client to wait (Retry-After), by its code; 5 for the others (a queue moves fast).
RETRY_AFTER = {"fine_tuning_job_running": 60}  # a training run holds the machine for minutes or hours
# OpenAI fields we accept and ignore (they have no meaning for this model), and our extra fields.
IGNORED = {"quality", "style", "user", "background", "moderation", "output_compression", "input_fidelity"}
GENERATION_FIELDS = {
    "prompt",
    "n",
    "size",
    "response_format",
    "model",
    "seed",
    "steps",
    "guidance",
    "negative_prompt",
    "loras",
    "stream",
    "partial_images",
    "output_format",
    "upsample",  # FLUX 3: the prompt upsampler first; each data item's revised_prompt is its caption
    "boxes",  # FLUX 3 layout boxes (upsample/boxes.py); a JSON text in a multipart form
} | IGNORED
EDIT_FIELDS = GENERATION_FIELDS | {"image", "image[]", "mask", "strength", "loras[]", "outpaint"}
MAX_LORAS = 8  # LoRA names per request
# An absolute file path in a message (never this server's own routes, /v1/...): clients see its last part.
PATH_RE = re.compile(r"(?<![\w.:/])/(?!v1/)[^\s'\"(),;]*/([^\s'\"(),;/]+)")


def check_model(name, model_id: str, aliases: tuple = ()) -> None:
    """A request's "model": left out, --model-id, or one of its aliases (a path compared as written after
    `normpath`, never looked up on the server); else a 404 that tells a path to another folder with the
    same last part apart from the served one (both show as that last part: paths are shortened)."""
    if name in (None, "", model_id, *aliases):
        return
    text = str(name)
    if "/" in text and posixpath.normpath(text) in {posixpath.normpath(a) for a in aliases if "/" in a}:
        return
    last = posixpath.basename(text.rstrip("/"))
    served = {model_id, *(posixpath.basename(a) for a in aliases)}
    if "/" in text and last in served:
        message = (
            f"model {text!r} is not served here: it is a path to another folder named {last!r} (paths are "
            f"compared as written, never looked up on the server); this server serves {model_id!r} from its "
            f"own folder: name it {model_id!r} or leave model out (GET /v1/models)"
        )
    else:
        message = f"model {text!r} is not served here; this server serves {model_id!r} (GET /v1/models)"
    raise ApiError(404, message, "model", "model_not_found")


def pick_model(name, served: tuple) -> str | None:
    """A request's "model" -> the id of the served model it names; None when left out (the one loaded now).
    `served`: ((id, aliases), ...), the first --model first."""
    if name in (None, ""):
        return None
    for model_id, aliases in served:
        try:
            check_model(name, model_id, aliases)
            return model_id
        except ApiError:
            if len(served) == 1:
                raise  # its own words
    ids = ", ".join(repr(model_id) for model_id, _ in served)
    raise ApiError(
        404,
        f"model {str(name)!r} is not served here; this server serves {ids} (GET /v1/models)",
        "model",
        "model_not_found",
    )


def parse_json(data: bytes | bytearray) -> dict:
    """A request body -> the JSON object it must be, or a 400 that says why (never a 500)."""
    try:
        body = json.loads(data or b"null")
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at position {e.pos})") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 JSON") from None
    except RecursionError:
        raise ApiError(
            400, 'the request body nests JSON too deeply; send a flat object like {"prompt": "..."}'
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, 'the request body must be a JSON object like {"prompt": "..."}')
    return body


async def read_json(request: Request, too_large: str = "the JSON body is larger than 1 MB") -> dict:
    """A request's JSON object body, read as it arrives: past 1 MB a 413 (`too_large` says where more goes)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MB:
            raise ApiError(413, too_large)
    return parse_json(body)


async def read_multipart(request: Request, takes: str, *, whole: bool = False, **limits):
    """A multipart/form-data request's form (`limits`: starlette's max_files, max_fields, max_part_size), or
    a 400: another content type (`takes` says what the route takes), a body python-multipart refuses, or
    (`whole`: the body read first, capped by the guard) one cut short before its closing boundary."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise ApiError(400, takes)
    if whole:
        check_multipart_complete(ctype, await request.body())  # the whole body, kept for form()
    try:
        return await request.form(**limits)
    except HTTPException as e:  # python-multipart's refusal of a malformed body
        raise ApiError(400, f"the multipart body is malformed: {e.detail}") from None


def check_multipart_complete(content_type: str, body: bytes) -> None:
    """A multipart body must end with its closing delimiter (`--BOUNDARY--`). One cut short (a dropped
    upload, a client bug) would otherwise parse as the parts before the cut, the rest silently missing:
    a 400 instead."""
    m = re.search(r'boundary=(?:"([^"]+)"|([^;\s]+))', content_type)
    if m is None:
        raise ApiError(400, "the multipart Content-Type has no boundary; let the HTTP client build the form")
    close = b"--" + (m.group(1) or m.group(2)).encode("latin-1") + b"--"
    if not (body.startswith(close) or b"\r\n" + close in body):
        raise ApiError(
            400,
            f"the multipart body ends before its closing boundary ({len(body)} bytes received): "
            "the upload was cut short; send the request again",
        )


# ---- field parsing: values are JSON types (generations) or strings (multipart edits) -------------


def int_field(body: dict, name: str, *, lo: int, hi: int, default=None):
    v = body.get(name)
    if v is None or v == "":
        return default
    # JSON integers, or digit strings from multipart forms; never bools or floats
    iv = int(v) if isinstance(v, str) and re.fullmatch(r"\s*-?\d{1,20}\s*", v) else v
    if not isinstance(iv, int) or isinstance(iv, bool):
        raise ApiError(400, f"{name} must be a whole number, not {v!r}", name)
    if not lo <= iv <= hi:
        raise ApiError(400, f"{name} must be between {lo} and {hi}, not {iv}", name)
    return iv


def float_field(body: dict, name: str, lo: float, hi: float):
    v = body.get(name)
    if v is None or v == "":
        return None
    try:
        fv = float(v)
    except (TypeError, ValueError):
        fv = float("nan")  # refused below, as NaN is (it is in no range)
    if isinstance(v, bool) or not lo <= fv <= hi:
        raise ApiError(400, f"{name} must be a number between {lo} and {hi}, not {v!r}", name)
    return fv


def str_field(body: dict, name: str, max_len: int = 4000):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(400, f"{name} must be a string, not {type(v).__name__}", name)
    if len(v) > max_len:
        raise ApiError(400, f"{name} is {len(v)} characters long; the limit is {max_len}", name)
    return v


def bool_field(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise ApiError(400, f"{name} must be true or false, not {v!r}", name)


def boxes_field(body: dict, prompt: str, references: int | None):
    """`boxes`: "x0,y0,x1,y1:desc" strings or diffusers' dicts (JSON text in a form), checked with `prompt`
    (their texts share its limit) and `references` (0: a generation; None: an edit's, checked by the run)."""
    value = body.get("boxes")
    if value is None or value == "":
        return None
    try:
        boxes = json.loads(value) if isinstance(value, str) else value
        return list(check_boxes(boxes, prompt, references=references, upsample=bool_field(body, "upsample")))
    except FluxKleinError as e:
        raise ApiError(400, e.worded("http"), "boxes") from None
    except ValueError:
        raise ApiError(400, "boxes must be a JSON list of boxes", "boxes") from None


def parse_size(size) -> tuple[int | None, int | None]:
    """ "WxH" -> (W, H); None or "auto" -> (None, None) (the pipeline's default)."""
    if size in (None, "", "auto"):
        return None, None
    m = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size) if isinstance(size, str) else None
    if not m:
        raise ApiError(400, f"size must be 'WIDTHxHEIGHT' in pixels (e.g. '1024x1024') or 'auto', not {size!r}", "size")
    w, h = map(int, m.groups())
    try:
        check_image_size(w, h)
    except FluxKleinError as e:
        raise ApiError(400, f"size {size}: {e}", "size") from None
    return w, h


def outpaint_field(body: dict, settings, image_size: tuple[int, int], repaints: bool) -> tuple | None:
    """An edit's outpaint: the `outpaint` field ("LEFT,TOP,RIGHT,BOTTOM" px), or an img2img (`repaints`: a
    strength, no mask) whose `size` is larger than the image: the image centred on that canvas (a reference
    edit at a larger size stays one). None: no outpaint."""
    text = str_field(body, "outpaint")
    w, h = image_size
    if text is not None:
        try:
            return parse_outpaint(text)
        except FluxKleinError as e:
            raise ApiError(400, e.worded("http"), "outpaint") from None
    if not repaints or settings.width is None or settings.width < w or settings.height < h:
        return None  # not an outpaint: the worker checks the size against the image as it prepares it
    return None if (settings.width, settings.height) == (w, h) else centred_pads(w, h, settings.width, settings.height)
