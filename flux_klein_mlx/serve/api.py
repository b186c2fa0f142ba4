"""The HTTP side of `serve`: the OpenAI Images API routes (listed in `create_app`), request
validation, error mapping (all JSON errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`).

No request names a file on the server: images arrive as uploads (decoded and size-checked before
anything runs), LoRAs by bare name from the folder the server was started with. Fields are parsed
by `forms.py`. Generation runs on the `jobs.Worker` thread; this module never touches MLX.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..checks import check_prompt_given
from ..errors import FluxKleinError
from ..inputs.settings import RunSettings
from ..limits import MAX_PROMPT_CHARS
from ..storage.files import write_exclusive
from .forms import (
    EDIT_FIELDS,
    GENERATION_FIELDS,
    MB,
    ApiError,
    bool_field,
    boxes_field,
    float_field,
    int_field,
    outpaint_field,
    parse_size,
    pick_model,
    read_json,
    read_multipart,
    str_field,
)
from .guard import Guard
from .jobs import EndEvent, ImageEvent, ImageRequest, NotReady, QueueFull, StageEvent, StepEvent, Worker
from .loras import lora_files, merge_loras, prompt_loras, resolve_loras
from .training_api import training_routes

PNG = {"output_format": "png", "background": "opaque"}  # what every result is


@dataclass
class ServerOptions:
    """What the operator chose at start; nothing here comes from a request."""

    model_id: str = "flux-klein"
    model_aliases: tuple = ()  # other names of the served model a request's "model" may give: its path, its repo id
    other_models: tuple = ()  # ((id, aliases, card), ...) of each later --model: loaded one at a time, on request
    model_card: dict = field(default_factory=dict)  # the first model's variant, distilled, default_steps

    def served(self) -> tuple:
        """((id, aliases), ...) of every served model, the first --model first."""
        return ((self.model_id, self.model_aliases), *((m, a) for m, a, _ in self.other_models))

    server_loras: tuple = ()  # "name:scale" of the --lora files loaded with the model (shown in /v1/status)
    api_key: str | None = None
    lora_dir: Path | None = None  # LoRAs a request may name: <lora_dir>/<name>.safetensors
    save_dir: Path | None = None  # every result is also written here under a server-chosen name
    max_upload_bytes: int = 20 * MB  # per uploaded image
    max_pixels: int = 4096 * 4096  # per uploaded image, checked from the header before decoding
    max_images: int = 8  # uploads per edit request
    max_n: int = 10  # images per request (OpenAI's bound)
    max_steps: int = 200
    url_cache: int = 64  # results kept in memory for `response_format: "url"`
    log: Callable[[str], None] = field(default=lambda line: None)  # one line per request, warnings
    train_dir: Path | None = None  # fine-tuning's files and jobs (serve/training_api.py); None: no fine-tuning
    model_folders: dict = field(default_factory=dict)  # served id -> its folder (what a fine-tuning job trains)


@dataclass(kw_only=True)
class Answer:
    """How a request wants its answer (not what it makes): set by its route and its fields."""

    kind: str  # the route's event type prefix: "image_generation" or "image_edit"
    response_format: str = "b64_json"  # or "url": results kept in memory and linked
    stream: bool = False  # server-sent events instead of one JSON body
    base_url: str = ""  # where `url` results are served, set when the job is submitted


@dataclass(kw_only=True)
class RequestLog:
    """The one log line of a request: id, route, size, steps, n, then its outcome and seconds."""

    route: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    t0: float = field(default_factory=time.perf_counter)
    size: str = "auto"
    steps: object = "default"
    n: int = 1

    def describe(self, req: ImageRequest, metadata: dict | None = None) -> None:
        s = req.settings
        if metadata:  # what ran: sizes and steps the request left to the model
            self.size = f"{metadata['width']}x{metadata['height']}"
            self.steps = metadata["steps"]
        else:  # as asked: `size` sets both sides or neither
            self.size = f"{s.width}x{s.height}" if s.width else "auto"
            self.steps = s.steps or "default"
            self.n = req.n

    def finish(self, log: Callable[[str], None], outcome: str) -> None:
        log(
            f"request {self.id}: {self.route} {self.size}, {self.steps} steps, n={self.n} -> {outcome} "
            f"in {time.perf_counter() - self.t0:.2f} s"
        )


class Server:
    """The app's state and its routes: options, the worker, the results kept for `url` responses."""

    def __init__(self, worker: Worker, options: ServerOptions):
        self.worker = worker
        self.options = options
        self.files: OrderedDict[str, bytes] = OrderedDict()  # id -> PNG, newest last

    # ---- validation ---------------------------------------------------------------------------

    def common(self, body: dict, kind: str) -> tuple[ImageRequest, Answer]:
        """The fields both routes share -> a request (images added by the edit route) and how to answer it
        (`kind`: the route's event type prefix, "image_generation" or "image_edit")."""
        o = self.options
        model = pick_model(body.get("model"), o.served())
        prompt = str_field(body, "prompt", MAX_PROMPT_CHARS)
        if prompt is None:
            raise ApiError(400, "prompt is required: describe the image to make", "prompt")
        try:
            check_prompt_given(prompt)  # the CLI's rule: an empty prompt is refused
        except FluxKleinError as e:
            raise ApiError(400, e.worded("http"), "prompt") from None
        response_format = body.get("response_format") or "b64_json"
        if response_format not in ("b64_json", "url"):
            raise ApiError(
                400, f"response_format must be 'b64_json' or 'url', not {response_format!r}", "response_format"
            )
        output_format = body.get("output_format") or "png"
        if output_format != "png":
            raise ApiError(
                400,
                f"output_format must be 'png' (this server writes PNG only), not {output_format!r}",
                "output_format",
            )
        width, height = parse_size(body.get("size"))
        prompt, tagged = prompt_loras(prompt, o.lora_dir)  # <lora:NAME:W> tags: the model never sees them
        settings = RunSettings(
            prompt,
            width=width,
            height=height,
            negative_prompt=str_field(body, "negative_prompt", MAX_PROMPT_CHARS),
            steps=int_field(body, "steps", lo=1, hi=o.max_steps),
            seed=int_field(body, "seed", lo=0, hi=2**53),
            guidance=float_field(body, "guidance", 0.0, 50.0),
            upsample=bool_field(body, "upsample"),
            boxes=boxes_field(body, prompt, 0 if kind == "image_generation" else None),
        )
        stream = bool_field(body, "stream")
        # OpenAI's meaning: how many partial images a stream sends (0-3); left out, one per step (the page).
        partial = int_field(body, "partial_images", lo=0, hi=3)
        req = ImageRequest(
            settings=settings,
            n=int_field(body, "n", lo=1, hi=o.max_n, default=1),
            loras=merge_loras(resolve_loras(body.get("loras", body.get("loras[]")), o.lora_dir), tagged),
            partial_images=partial if stream else 0,
            model=model,
        )
        return req, Answer(kind=kind, response_format=response_format, stream=stream)

    def decode_upload(self, name: str, data: bytes, mode: str | None) -> Image.Image:
        """An upload, size-checked from its header, decoded; converted to `mode` (None: kept, e.g. a mask's alpha)."""
        o = self.options
        if len(data) > o.max_upload_bytes:
            raise ApiError(
                413, f"{name} is {len(data) / MB:.1f} MB; the limit is {o.max_upload_bytes / MB:.0f} MB", name
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                im = Image.open(io.BytesIO(data))  # reads the header only
                w, h = im.size
                if w * h <= o.max_pixels:
                    im.load()
                    return im.convert(mode) if mode else im
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ApiError(413, f"{name} has too many pixels; the limit is {o.max_pixels / 1e6:.0f} MP", name) from None
        except Exception:  # PIL raises many types for bad data
            raise ApiError(400, f"{name} is not a readable image; upload a PNG, JPEG or WebP file", name) from None
        raise ApiError(413, f"{name} is {w}x{h} = {w * h / 1e6:.0f} MP; the limit is {o.max_pixels / 1e6:.0f} MP", name)

    async def read_form(self, request: Request) -> tuple[dict, list[tuple[str, bytes]], bytes | None]:
        """A multipart edit request -> (plain fields, uploaded images in order, the mask upload or None)."""
        takes = "POST /v1/images/edits takes multipart/form-data with image file(s) and a prompt"
        limits = {"max_files": self.options.max_images + 1, "max_fields": 200, "max_part_size": 64 * 1024}
        form = await read_multipart(request, takes, whole=True, **limits)
        body, uploads, mask = {}, [], None
        try:
            for key, value in form.multi_items():
                if key not in EDIT_FIELDS:
                    raise ApiError(400, f"unknown field {key!r}; see GET /v1/status for the supported fields", key)
                is_file = hasattr(value, "read")
                if key in ("image", "image[]", "mask"):
                    if not is_file:
                        raise ApiError(
                            400, f"{key} must be an uploaded file; this server never reads files by path", key
                        )
                    data = await value.read(self.options.max_upload_bytes + 1)
                    if key == "mask":
                        mask = data
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
        return body, uploads, mask

    # ---- running a job from an async handler ----------------------------------------------------

    def keep(self, event: ImageEvent, answer: Answer) -> dict:
        """A finished image -> its OpenAI `data` item; saved to --save-dir when set."""
        file_id = uuid.uuid4().hex
        if self.options.save_dir is not None:
            self.save(event.png, file_id)
        item = {"revised_prompt": (event.metadata or {}).get("revised_prompt"), "metadata": event.metadata}
        if answer.response_format == "url":
            self.files[file_id] = event.png
            while len(self.files) > self.options.url_cache:
                self.files.popitem(last=False)
            item["url"] = f"{answer.base_url}/v1/images/files/{file_id}.png"
        else:
            item["b64_json"] = base64.b64encode(event.png).decode()
        return item

    def save(self, png: bytes, file_id: str) -> None:
        """Also write a result to --save-dir (a server-chosen name, never the client's). A full, removed or
        read-only folder costs a warning in the log and no file, never the client's image."""
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{file_id[:12]}.png"
        try:
            write_exclusive(self.options.save_dir / name, lambda tmp: tmp.write_bytes(png))
        except FluxKleinError as e:
            self.options.log(f"warning: a result was not saved to --save-dir: {e}")

    async def run(self, request: Request, req: ImageRequest, answer: Answer, entry: RequestLog):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        try:  # events go from the worker thread to this event loop
            job = self.worker.submit(req, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
        except QueueFull as e:
            raise ApiError(429, str(e), code=e.code) from None
        except NotReady as e:
            raise ApiError(503, str(e), code="model_loading") from None
        answer.base_url = str(request.base_url).rstrip("/")
        if answer.stream:
            return StreamingResponse(
                self.events(job, queue=queue, answer=answer, req=req, entry=entry),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        data = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # `finally` cancels: the worker stops at the next step
                        return Response(status_code=499)
                    continue
                if isinstance(event, ImageEvent):
                    entry.describe(req, event.metadata)
                    data.append(self.keep(event, answer))
                elif isinstance(event, EndEvent):
                    if event.kind == "cancelled":
                        raise ApiError(503, "the request was cancelled (server shutting down)")
                    if event.kind == "error":
                        raise ApiError(event.status, event.message)
                    break
        finally:
            job.cancel()  # no-op when finished; stops the job when this handler is torn down
        return JSONResponse({"created": int(time.time()), "data": data, "size": entry.size, **PNG})

    async def events(self, job, *, queue, answer: Answer, req: ImageRequest, entry: RequestLog):
        """Server-sent events in OpenAI's image streaming shape: progress after every step, the partial
        images asked for (`partial_images`; one per step when left out), each finished image."""

        def sse(name: str, **payload) -> bytes:
            return f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n".encode()

        kind = answer.kind
        size = entry.size  # the size asked for ("auto" or WxH)
        png = {**PNG, "quality": "auto"}
        partials: dict[int, int] = {}  # image index -> partial images sent
        outcome = "client went away (cancelled)"
        try:
            while True:
                event = await queue.get()
                if isinstance(event, StageEvent):  # before the first step: what the wait is
                    yield sse(f"{kind}.stage", stage=event.stage, image_index=event.index)
                elif isinstance(event, StepEvent):
                    step = {"image_index": event.index, "step": event.step, "total_steps": event.total}
                    yield sse(f"{kind}.progress", **step)
                    if event.preview is not None:
                        partials[event.index] = partials.get(event.index, -1) + 1
                        yield sse(
                            f"{kind}.partial_image",
                            b64_json=base64.b64encode(event.preview).decode(),
                            partial_image_index=partials[event.index],
                            created_at=int(time.time()),
                            size=size,
                            **png,
                            **step,
                        )
                elif isinstance(event, ImageEvent):
                    entry.describe(req, event.metadata)
                    yield sse(
                        f"{kind}.completed",
                        created_at=int(time.time()),
                        size=entry.size,
                        **png,
                        image_index=event.index,
                        seconds=event.seconds,
                        usage={
                            "input_tokens": 0,
                            "output_tokens": 0,
                            "total_tokens": 0,
                            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                        },
                        **self.keep(event, answer),
                    )
                elif event.kind == "error":
                    outcome = f"{event.status} {event.message} (streamed)"
                    yield sse("error", **ApiError(event.status, event.message).body())
                    return
                else:  # done or cancelled
                    outcome = "200 streamed" if event.kind == "done" else "503 cancelled (server shutting down)"
                    return
        finally:
            job.cancel()  # the client went away (or we finished): stop between steps
            entry.finish(self.options.log, outcome)

    # ---- routes ---------------------------------------------------------------------------------

    async def index(self, request: Request):
        html = resources.files("flux_klein_mlx.serve").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    async def script(self, request: Request):
        """GET /static/NAME.js: the page's scripts, only the package's own files (no path reaches beyond static/)."""
        static = resources.files("flux_klein_mlx.serve").joinpath("static")
        scripts = {entry.name: entry for entry in static.iterdir() if entry.name.endswith(".js")}
        source = scripts.get(f"{request.path_params['name']}.js")  # the name never reaches the OS (ENAMETOOLONG)
        if source is None:
            raise HTTPException(404)
        js = source.read_text(encoding="utf-8")
        return Response(js, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

    async def models(self, request: Request):
        """GET /v1/models (the served models) or /v1/models/{model}."""
        cards = [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "flux_klein_mlx"}
            for model_id, _ in self.options.served()
        ]
        name = request.path_params.get("model")
        if name is not None:
            picked = pick_model(name, self.options.served()) or self.options.model_id
            return JSONResponse(next(card for card in cards if card["id"] == picked))
        return JSONResponse({"object": "list", "data": cards})

    async def status(self, request: Request):
        o = self.options
        pipe = self.worker.pipe
        info = pipe.info if pipe is not None else None
        return JSONResponse(
            {
                **self.worker.status(),
                "model": self.worker.model_id or o.model_id,
                "models": [
                    {"id": o.model_id, **o.model_card},
                    *({"id": model_id, **card} for model_id, _, card in o.other_models),
                ],
                "variant": info.name if info else None,
                "default_steps": info.default_steps if info else None,
                "distilled": info.is_distilled if info else None,
                "inpainting": True,
                "upsampler": bool(info and info.family.upsampler),  # FLUX 3: the page offers `upsample`
                "server_loras": list(o.server_loras),
                "loras": list(lora_files(o.lora_dir)),
                "preview": pipe.preview_map().source if pipe is not None else None,
                "fields": {"generations": sorted(GENERATION_FIELDS), "edits": sorted(EDIT_FIELDS)},
                "limits": {
                    "max_upload_mb": o.max_upload_bytes / MB,
                    "max_megapixels": o.max_pixels / 1e6,
                    "max_images": o.max_images,
                    "max_n": o.max_n,
                    "max_steps": o.max_steps,
                },
            }
        )

    async def images(self, request: Request) -> Response:
        """POST /v1/images/generations or /edits: parse and run one image request; one log line when it
        ends, whatever the outcome (a stream logs when it closes)."""
        entry = RequestLog(route=request.url.path.rsplit("/", 1)[1])  # "generations" | "edits"
        try:
            parse = self.generation_request if entry.route == "generations" else self.edit_request
            req, answer = await parse(request)
            entry.describe(req)
            response = await self.run(request, req, answer, entry)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to run
            entry.finish(self.options.log, "499 client disconnected before sending its whole body")
            return Response(status_code=499)
        except Exception as e:
            entry.finish(self.options.log, outcome_of(e))
            raise
        if not isinstance(response, StreamingResponse):
            entry.finish(self.options.log, str(response.status_code))
        return response

    async def generation_request(self, request: Request):
        body = await read_json(request, "the JSON body is larger than 1 MB; images go to /v1/images/edits")
        for key in (k for k in body if k not in GENERATION_FIELDS):
            if key in ("image", "images", "mask", "image[]"):
                raise ApiError(
                    400,
                    f"{key} cannot be sent to /v1/images/generations: upload images with "
                    "POST /v1/images/edits (multipart); this server never reads files by path",
                    key,
                )
            raise ApiError(400, f"unknown field {key!r}; see GET /v1/status for the supported fields", key)
        return self.common(body, "image_generation")

    async def edit_request(self, request: Request):
        body, uploads, mask_data = await self.read_form(request)
        if not uploads:
            raise ApiError(400, "upload at least one image (field 'image' or 'image[]')", "image")
        if len(uploads) > self.options.max_images:
            raise ApiError(400, f"{len(uploads)} images uploaded; the limit is {self.options.max_images}", "image")
        req, answer = self.common(body, "image_edit")
        images = [self.decode_upload(name, data, "RGB") for name, data in uploads]
        mask = (
            None if mask_data is None else self.decode_upload("mask", mask_data, None)
        )  # alpha: transparent = repaint
        if mask is not None and mask.size != images[0].size:
            raise ApiError(
                400,
                f"mask is {mask.size[0]}x{mask.size[1]} but the image is "
                f"{images[0].size[0]}x{images[0].size[1]}; they must be the same size",
                "mask",
            )
        strength = float_field(body, "strength", 0.0, 1.0)
        outpaint = outpaint_field(body, req.settings, images[0].size, repaints=strength is not None and mask is None)
        # Inpainting / image-to-image / outpainting: the first upload is the image repainted, the rest references.
        init_image = images.pop(0) if mask is not None or strength is not None or outpaint else None
        size = {"width": None, "height": None} if outpaint else {}  # the canvas is the image and its pads
        req.settings = dataclasses.replace(
            req.settings,
            init_image=init_image,
            images=images or None,
            mask=mask,
            strength=strength,
            outpaint=outpaint,
            **size,
        )
        return req, answer

    async def file(self, request: Request):
        png = self.files.get(request.path_params["file_id"])
        if png is None:
            raise ApiError(
                404,
                f"no such image: results are kept in memory for the most recent {self.options.url_cache} images only",
            )
        return Response(png, media_type="image/png")


def outcome_of(error: Exception) -> str:
    """The log's words for a request that failed with `error`: the status the client gets, and why."""
    if isinstance(error, ApiError):
        return f"{error.status} {error.message}"
    if isinstance(error, HTTPException):  # answered with its own status by on_http_error
        return f"{error.status_code} {error.detail}"
    return f"500 {type(error).__name__}: {error}"


def create_app(worker: Worker, options: ServerOptions) -> Starlette:
    """The ASGI app: routes, bearer-key check, body-size limit, OpenAI-shaped errors."""
    server = Server(worker, options)

    async def on_api_error(request: Request, exc: ApiError):
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException):
        message = {
            404: f"no route {request.method} {request.url.path}; see GET /v1/status",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message).response()

    async def on_crash(request: Request, exc: Exception):  # a bug: JSON, no repr; the traceback goes to the log
        return ApiError(
            500, f"internal server error ({type(exc).__name__}); the server's log has the details"
        ).response()

    routes = [
        Route("/", server.index),  # the web page (static/index.html)
        Route("/static/{name:str}.js", server.script),  # its scripts (static/*.js)
        Route("/v1/models", server.models),  # the one model served
        Route("/v1/models/{model:path}", server.models),
        Route("/v1/status", server.status),  # worker state, queue, what this build supports
        Route("/v1/images/generations", server.images, methods=["POST"]),  # JSON; "stream": true answers with SSE
        Route("/v1/images/edits", server.images, methods=["POST"]),  # multipart: image / image[] (1..8), optional mask
        Route("/v1/images/files/{file_id:str}.png", server.file),  # results of response_format "url" (unguessable ids)
        *training_routes(worker, options),  # /v1/files and /v1/fine_tuning/jobs (serve/training_api.py)
    ]
    app = Starlette(
        routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash}
    )
    return Guard(app, options.api_key, (options.max_images + 2) * options.max_upload_bytes + MB)
