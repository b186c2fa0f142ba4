"""The HTTP side of `serve`: the OpenAI Images API routes, request validation, error mapping.

Routes (all JSON errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`):

    GET  /                          the web page (static/index.html)
    GET  /v1/models                 the one model served
    POST /v1/images/generations     JSON; `"stream": true` answers with server-sent events
    POST /v1/images/edits           multipart: image / image[] (1..8 files), optional mask
    GET  /v1/images/files/{id}.png  results of `response_format: "url"` (unguessable ids)
    GET  /v1/status                 worker state, queue, what this build supports

No request names a file on the server: images arrive as uploads (decoded and size-checked before
anything runs), LoRAs by bare name from the folder the server was started with. Generation runs
on the `jobs.Worker` thread; this module never touches MLX.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import json
import re
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import FluxKleinError
from .jobs import ImageRequest, JobEvent, NotReady, QueueFull, Worker

MB = 1 << 20


@dataclass
class ServerOptions:
    """What the operator chose at start; nothing here comes from a request."""

    model_id: str = "flux-klein"
    api_key: str | None = None
    lora_dir: Path | None = None  # LoRAs a request may name: <lora_dir>/<name>.safetensors
    save_dir: Path | None = None  # every result is also written here under a server-chosen name
    max_upload_bytes: int = 20 * MB  # per uploaded image
    max_pixels: int = 4096 * 4096  # per uploaded image, checked from the header before decoding
    max_images: int = 8  # uploads per edit request
    max_n: int = 10  # images per request (OpenAI's bound)
    max_steps: int = 200
    url_cache: int = 64  # results kept in memory for `response_format: "url"`


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "5"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class BodyTooLarge(Exception):
    pass


# OpenAI fields we accept and ignore (they have no meaning for this model), and our extra fields.
IGNORED = {"quality", "style", "user", "background", "moderation", "output_compression", "input_fidelity"}
COMMON = {"prompt", "n", "size", "response_format", "model", "seed", "steps", "guidance", "negative_prompt",
          "loras", "stream", "partial_images", "output_format"} | IGNORED
GENERATION_FIELDS = COMMON
EDIT_FIELDS = COMMON | {"image", "image[]", "mask", "strength", "loras[]"}
SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# ---- field parsing: values are JSON types (generations) or strings (multipart edits) -------------


def _int(body: dict, name: str, lo: int, hi: int, default=None):
    v = body.get(name)
    if v is None or v == "":
        return default
    # JSON integers, or digit strings from multipart forms; never bools or floats
    if isinstance(v, int) and not isinstance(v, bool):
        iv = v
    elif isinstance(v, str) and re.fullmatch(r"\s*-?\d{1,20}\s*", v):
        iv = int(v)
    else:
        raise ApiError(400, f"{name} must be a whole number, not {v!r}", name)
    if not lo <= iv <= hi:
        raise ApiError(400, f"{name} must be between {lo} and {hi}, not {iv}", name)
    return iv


def _float(body: dict, name: str, lo: float, hi: float):
    v = body.get(name)
    if v is None or v == "":
        return None
    try:
        fv = float(v)
        if isinstance(v, bool) or fv != fv:
            raise ValueError
    except (TypeError, ValueError):
        raise ApiError(400, f"{name} must be a number, not {v!r}", name) from None
    if not lo <= fv <= hi:
        raise ApiError(400, f"{name} must be between {lo} and {hi}, not {fv}", name)
    return fv


def _str(body: dict, name: str, max_len: int = 4000):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(400, f"{name} must be a string, not {type(v).__name__}", name)
    if len(v) > max_len:
        raise ApiError(400, f"{name} is {len(v)} characters long; the limit is {max_len}", name)
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise ApiError(400, f"{name} must be true or false, not {v!r}", name)


def parse_size(size) -> tuple[int | None, int | None]:
    """ "WxH" -> (W, H); None or "auto" -> (None, None) (the pipeline's default)."""
    from .vae import check_image_size

    if size is None or size == "" or size == "auto":
        return None, None
    m = SIZE_RE.match(size) if isinstance(size, str) else None
    if not m:
        raise ApiError(400, f"size must be 'WIDTHxHEIGHT' in pixels (e.g. '1024x1024') or 'auto', not {size!r}",
                       "size")
    w, h = int(m.group(1)), int(m.group(2))
    try:
        check_image_size(w, h)
    except FluxKleinError as e:
        raise ApiError(400, f"size {size}: {e}", "size") from None
    return w, h


class Server:
    """The app's state: options, the worker, the results kept for `url` responses."""

    def __init__(self, worker: Worker, options: ServerOptions):
        self.worker = worker
        self.options = options
        self.files: OrderedDict[str, bytes] = OrderedDict()  # id -> PNG, newest last

    # ---- validation ---------------------------------------------------------------------------

    def check_fields(self, body: dict, allowed: set[str]) -> None:
        for key in body:
            if key in ("image", "images", "mask", "image[]") and key not in allowed:
                raise ApiError(400, f"{key} cannot be sent to /v1/images/generations: upload images with "
                                    "POST /v1/images/edits (multipart); this server never reads files by path", key)
            if key not in allowed:
                raise ApiError(400, f"unknown field {key!r}; see GET /v1/status for the supported fields", key)

    def resolve_loras(self, value) -> tuple:
        """LoRA names (optionally "name:scale") -> ((path in --lora-dir, scale), ...)."""
        if value is None or value == [] or value == "":
            return ()
        names = value if isinstance(value, list) else [value]
        out = []
        for item in names:
            if not isinstance(item, str):
                raise ApiError(400, f"loras must be names (strings), not {type(item).__name__}", "loras")
            name, _, scale = item.partition(":")
            if "/" in name or "\\" in name or ".." in name or not LORA_NAME_RE.match(name):
                raise ApiError(400, f"LoRA {item!r} is not a name: give the name of a file in the server's "
                                    "--lora-dir (without .safetensors), never a path", "loras")
            try:
                s = float(scale) if scale else 1.0
            except ValueError:
                raise ApiError(400, f"LoRA scale in {item!r} must be a number", "loras") from None
            if self.options.lora_dir is None:
                raise ApiError(400, "this server was started without --lora-dir, so requests cannot name LoRAs",
                               "loras")
            path = self.options.lora_dir / f"{name}.safetensors"
            if not path.is_file():
                raise ApiError(404, f"no LoRA named {name!r} in the server's LoRA folder; GET /v1/status lists them",
                               "loras")
            out.append((str(path), s))
        return tuple(out)

    def common(self, body: dict) -> tuple[ImageRequest, dict]:
        o = self.options
        model = body.get("model")
        if model not in (None, "", o.model_id):
            raise ApiError(404, f"model {model!r} is not served here; this server serves {o.model_id!r} "
                                "(GET /v1/models)", "model", "model_not_found")
        prompt = _str(body, "prompt")
        if not prompt or not prompt.strip():
            raise ApiError(400, "prompt is required: describe the image to make", "prompt")
        response_format = body.get("response_format") or "b64_json"
        if response_format not in ("b64_json", "url"):
            raise ApiError(400, f"response_format must be 'b64_json' or 'url', not {response_format!r}",
                           "response_format")
        output_format = body.get("output_format") or "png"
        if output_format != "png":
            raise ApiError(400, f"output_format must be 'png' (this server writes PNG only), not {output_format!r}",
                           "output_format")
        width, height = parse_size(body.get("size"))
        req = ImageRequest(
            prompt=prompt,
            n=_int(body, "n", 1, o.max_n, default=1),
            width=width, height=height,
            seed=_int(body, "seed", 0, 2**53),
            steps=_int(body, "steps", 1, o.max_steps),
            guidance=_float(body, "guidance", 0.0, 50.0),
            negative_prompt=_str(body, "negative_prompt"),
            loras=self.resolve_loras(body.get("loras", body.get("loras[]"))),
        )
        stream = _bool(body, "stream")
        partial = _int(body, "partial_images", 0, 1000)
        req.previews = stream and partial != 0
        return req, {"response_format": response_format, "stream": stream}

    def decode_upload(self, name: str, data: bytes, mode: str) -> Image.Image:
        o = self.options
        if len(data) > o.max_upload_bytes:
            raise ApiError(413, f"{name} is {len(data) / MB:.1f} MB; the limit is {o.max_upload_bytes / MB:.0f} MB",
                           name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                im = Image.open(io.BytesIO(data))  # reads the header only
                w, h = im.size
                if w * h > o.max_pixels:
                    raise ApiError(413, f"{name} is {w}x{h} = {w * h / 1e6:.0f} MP; the limit is "
                                        f"{o.max_pixels / 1e6:.0f} MP", name)
                im.load()
                return im.convert(mode)
        except ApiError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ApiError(413, f"{name} has too many pixels; the limit is {o.max_pixels / 1e6:.0f} MP", name) from None
        except Exception:  # noqa: BLE001: PIL raises many types for bad data
            raise ApiError(400, f"{name} is not a readable image; upload a PNG, JPEG or WebP file", name) from None

    # ---- running a job from an async handler ----------------------------------------------------

    def submit(self, req: ImageRequest):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()

        def on_event(event: JobEvent) -> None:  # worker thread -> event loop
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            job = self.worker.submit(req, on_event)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full") from None
        except NotReady as e:
            raise ApiError(503, str(e), code="model_loading") from None
        return job, queue

    def keep(self, event: JobEvent, response_format: str, base_url: str) -> dict:
        """A finished image -> its OpenAI `data` item; saved to --save-dir when set."""
        png, meta = event.data["png"], event.data["metadata"]
        file_id = uuid.uuid4().hex
        if self.options.save_dir is not None:
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{file_id[:12]}.png"  # server-chosen, never the client's
            with open(self.options.save_dir / name, "xb") as f:
                f.write(png)
        item = {"revised_prompt": None, "metadata": meta}
        if response_format == "url":
            self.files[file_id] = png
            while len(self.files) > self.options.url_cache:
                self.files.popitem(last=False)
            item["url"] = f"{base_url}/v1/images/files/{file_id}.png"
        else:
            item["b64_json"] = base64.b64encode(png).decode()
        return item

    async def run(self, request: Request, req: ImageRequest, opts: dict, kind: str):
        job, queue = self.submit(req)
        opts["base_url"] = str(request.base_url).rstrip("/")
        if opts["stream"]:
            return StreamingResponse(self.events(job, queue, opts, kind, req), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        data = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()  # the worker stops at the next step
                        return Response(status_code=499)
                    continue
                if event.kind == "image":
                    data.append(self.keep(event, opts["response_format"], opts["base_url"]))
                elif event.kind == "done":
                    break
                elif event.kind == "cancelled":
                    raise ApiError(503, "the request was cancelled (server shutting down)")
                elif event.kind == "error":
                    raise ApiError(event.data["status"], event.data["message"])
        finally:
            job.cancel()  # no-op when finished; stops the job when this handler is torn down
        meta = data[0]["metadata"]
        return JSONResponse({"created": int(time.time()), "data": data, "output_format": "png",
                             "size": f"{meta['width']}x{meta['height']}", "background": "opaque"})

    async def events(self, job, queue, opts, kind: str, req: ImageRequest):
        """Server-sent events in OpenAI's image streaming shape, one partial image per step."""

        def sse(name: str, payload: dict) -> bytes:
            return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()

        size = f"{req.width}x{req.height}" if req.width else "auto"
        try:
            while True:
                event = await queue.get()
                if event.kind == "step":
                    yield sse(f"{kind}.progress", {"type": f"{kind}.progress", "image_index": event.data["index"],
                                                   "step": event.data["step"], "total_steps": event.data["total"]})
                    if event.data["preview"] is not None:
                        yield sse(f"{kind}.partial_image", {
                            "type": f"{kind}.partial_image", "b64_json": base64.b64encode(event.data["preview"]).decode(),
                            "partial_image_index": event.data["step"] - 1, "created_at": int(time.time()),
                            "size": size, "output_format": "png", "background": "opaque", "quality": "auto",
                            "image_index": event.data["index"], "step": event.data["step"],
                            "total_steps": event.data["total"]})
                elif event.kind == "image":
                    item = self.keep(event, opts["response_format"], opts["base_url"])
                    meta = event.data["metadata"]
                    yield sse(f"{kind}.completed", {
                        "type": f"{kind}.completed", "created_at": int(time.time()), "output_format": "png",
                        "size": f"{meta['width']}x{meta['height']}", "background": "opaque", "quality": "auto",
                        "image_index": event.data["index"], "seconds": event.data["seconds"],
                        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                                  "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}},
                        **item})
                elif event.kind == "error":
                    yield sse("error", {"type": "error", **ApiError(event.data["status"], event.data["message"]).body()})
                    return
                else:  # done or cancelled
                    return
        finally:
            job.cancel()  # the client went away (or we finished): stop between steps


def create_app(worker: Worker, options: ServerOptions) -> Starlette:
    """The ASGI app: routes, bearer-key check, body-size limit, OpenAI-shaped errors."""
    server = Server(worker, options)
    body_cap = options.max_images * options.max_upload_bytes + 2 * options.max_upload_bytes + MB

    async def read_json(request: Request) -> dict:
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > MB:
                raise ApiError(413, "the JSON body is larger than 1 MB; images go to /v1/images/edits")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e.msg} at position {e.pos})"
                           if isinstance(e, json.JSONDecodeError) else "the request body is not UTF-8 JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object like {\"prompt\": \"...\"}")
        return body

    async def index(request: Request):
        html = resources.files("flux_klein_mlx").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [_model_card(options.model_id)]})

    async def model(request: Request):
        if request.path_params["model"] != options.model_id:
            raise ApiError(404, f"model {request.path_params['model']!r} is not served here; this server serves "
                                f"{options.model_id!r}", "model", "model_not_found")
        return JSONResponse(_model_card(options.model_id))

    async def status(request: Request):
        st = worker.status()
        loras = sorted(p.stem for p in options.lora_dir.glob("*.safetensors")) if options.lora_dir else []
        info = worker.pipe.info if worker.pipe is not None else None
        return JSONResponse({
            **st, "model": options.model_id, "variant": info.name if info else None,
            "default_steps": info.default_steps if info else None,
            "distilled": info.is_distilled if info else None,
            "inpainting": True, "loras": loras,
            "preview": worker.preview.source if worker.preview else None,
            "fields": {"generations": sorted(GENERATION_FIELDS), "edits": sorted(EDIT_FIELDS)},
            "limits": {"max_upload_mb": options.max_upload_bytes / MB, "max_megapixels": options.max_pixels / 1e6,
                       "max_images": options.max_images, "max_n": options.max_n, "max_steps": options.max_steps},
        })

    async def generations(request: Request):
        body = await read_json(request)
        server.check_fields(body, GENERATION_FIELDS)
        req, opts = server.common(body)
        return await server.run(request, req, opts, "image_generation")

    async def edits(request: Request):
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise ApiError(400, "POST /v1/images/edits takes multipart/form-data with image file(s) and a prompt")
        form = await request.form(max_files=options.max_images + 1, max_fields=200, max_part_size=64 * 1024)
        try:
            body: dict = {}
            uploads: list[tuple[str, bytes]] = []
            mask_data = None
            for key, value in form.multi_items():
                if key not in EDIT_FIELDS:
                    raise ApiError(400, f"unknown field {key!r}; see GET /v1/status for the supported fields", key)
                is_file = hasattr(value, "read")
                if key in ("image", "image[]", "mask"):
                    if not is_file:
                        raise ApiError(400, f"{key} must be an uploaded file; this server never reads files by path",
                                       key)
                    data = await value.read(options.max_upload_bytes + 1)
                    if key == "mask":
                        mask_data = data
                    else:
                        uploads.append((f"image[{len(uploads)}]", data))
                elif is_file:
                    raise ApiError(400, f"{key} must be a plain form field, not a file", key)
                elif key in ("loras", "loras[]"):
                    body.setdefault("loras", []).append(value)
                else:
                    body[key] = value
        finally:
            await form.close()
        if not uploads:
            raise ApiError(400, "upload at least one image (field 'image' or 'image[]')", "image")
        if len(uploads) > options.max_images:
            raise ApiError(400, f"{len(uploads)} images uploaded; the limit is {options.max_images}", "image")
        req, opts = server.common(body)
        req.images = [server.decode_upload(name, data, "RGB") for name, data in uploads]
        if mask_data is not None:
            mask = server.decode_upload("mask", mask_data, "L")
            if mask.size != req.images[0].size:
                raise ApiError(400, f"mask is {mask.size[0]}x{mask.size[1]} but the image is "
                                    f"{req.images[0].size[0]}x{req.images[0].size[1]}; they must be the same size",
                               "mask")
            req.mask = mask
        strength = _float(body, "strength", 0.0, 1.0)
        if strength is not None:
            req.strength = strength
        return await server.run(request, req, opts, "image_edit")

    async def files(request: Request):
        png = server.files.get(request.path_params["file_id"])
        if png is None:
            raise ApiError(404, "no such image: results are kept in memory for the most recent "
                                f"{options.url_cache} images only")
        return Response(png, media_type="image/png")

    async def on_api_error(request: Request, exc: ApiError):
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException):
        message = {404: f"no route {request.method} {request.url.path}; see GET /v1/status",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message).response()

    async def on_too_large(request: Request, exc: BodyTooLarge):
        return ApiError(413, f"the request body is larger than {body_cap / MB:.0f} MB").response()

    routes = [
        Route("/", index),
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", model),
        Route("/v1/status", status),
        Route("/v1/images/generations", generations, methods=["POST"]),
        Route("/v1/images/edits", edits, methods=["POST"]),
        Route("/v1/images/files/{file_id:str}.png", files),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                                       BodyTooLarge: on_too_large})
    return _Guard(app, options.api_key, body_cap)


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "flux_klein_mlx"}


class _Guard:
    """ASGI wrapper: bearer key on /v1/ (result files are capability URLs) and a body-size cap."""

    def __init__(self, app, api_key: str | None, body_cap: int):
        self.app, self.api_key, self.body_cap = app, api_key, body_cap

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.api_key and path.startswith("/v1/") and not path.startswith("/v1/images/files/"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not auth:
                return await _send(scope, receive, send, ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                                                  code="invalid_api_key"))
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                return await _send(scope, receive, send, ApiError(401, "invalid API key", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.body_cap:
            return await _send(scope, receive, send, ApiError(413, f"the request body is larger than {self.body_cap / MB:.0f} MB"))
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.body_cap:
                    raise BodyTooLarge()
            return message

        return await self.app(scope, counted_receive, send)


async def _send(scope, receive, send, error: ApiError) -> None:
    await error.response()(scope, receive, send)
