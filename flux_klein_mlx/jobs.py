"""The server's single worker: one model resident, one generation at a time, a bounded queue.

MLX work never runs concurrently: one thread loads the pipeline and then runs jobs in order. A
job reports through a callback (called on the worker thread) with `JobEvent`s: "step" after every
denoising step (with a small preview PNG), "image" for each finished image, then exactly one of
"done", "error" or "cancelled". A cancelled job stops between steps (`FluxKleinPipeline.stream`
yields after every step, so the worker just stops iterating). The HTTP layer (`api.py`) knows
nothing of MLX; this module knows nothing of HTTP.
"""

from __future__ import annotations

import collections
import io
import threading
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from PIL import Image

from . import __version__
from .errors import FluxKleinError


class QueueFull(Exception):
    """The waiting line is at its bound; the client should retry later (HTTP 429)."""


class NotReady(Exception):
    """The model is still loading, or failed to load (HTTP 503)."""


@dataclass
class ImageRequest:
    """A validated request: everything a job needs, no file paths from the client."""

    prompt: str
    n: int = 1
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    images: list[Image.Image] = field(default_factory=list)  # reference images, decoded
    mask: Image.Image | None = None  # inpainting mask (white = repaint)
    strength: float | None = None
    loras: tuple = ()  # ((server-side path, scale), ...) resolved from names by the HTTP layer
    previews: bool = False  # render a preview PNG after every step


@dataclass
class JobEvent:
    kind: str  # "step" | "image" | "done" | "error" | "cancelled"
    data: dict = field(default_factory=dict)


@dataclass
class Job:
    request: ImageRequest
    on_event: Callable[[JobEvent], None]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop at the next step boundary (or never start, if still waiting)."""
        self.cancelled.set()


def png_bytes(image: Image.Image, metadata: dict | None = None) -> bytes:
    """Encode a PNG in memory, with `metadata` in its text chunks like `generate` writes them."""
    from .generate import png_info

    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=png_info(metadata) if metadata else None)
    return buf.getvalue()


class Worker:
    """Owns the pipeline and the job line.

    Args:
        loader: `loader(loras)` -> a `FluxKleinPipeline`; called on the worker thread at start and
            again when a request asks for another set of LoRAs (the old model is dropped first).
        max_queue: how many jobs may wait behind the running one; more are refused (`QueueFull`).
        base_loras: the LoRAs loaded at start, kept under every request's own.
        metadata: extra PNG metadata for every image (model id, dtype, ...).
    """

    def __init__(self, loader: Callable[[tuple], object], *, max_queue: int = 4, base_loras: tuple = (),
                 metadata: dict | None = None):
        self._loader = loader
        self.max_queue = max_queue
        self.base_loras = tuple(base_loras)
        self.metadata = dict(metadata or {})
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._stop = False
        self.state = "loading"  # "loading" | "ready" | "failed"
        self.error: str | None = None
        self.pipe = None
        self.preview = None  # preview.LatentPreview for the loaded VAE
        self.loaded_loras: tuple = ()
        self.completed = 0
        self.cancelled_jobs = 0
        self.active_memory = 0  # MLX bytes in use after the last job (read on the worker thread)
        self._thread = threading.Thread(target=self._run, name="flux-klein-worker", daemon=True)

    # ---- called from the HTTP side ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            for job in self._waiting:
                job.cancel()
            if self._running is not None:
                self._running.cancel()
            self._lock.notify_all()
        self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        with self._lock:
            self._lock.wait_for(lambda: self.state != "loading", timeout)
            return self.state == "ready"

    def submit(self, request: ImageRequest, on_event: Callable[[JobEvent], None]) -> Job:
        """Queue a job; raises `NotReady` (loading or failed) or `QueueFull`."""
        with self._lock:
            if self.state == "loading":
                raise NotReady("the model is still loading; retry in a few seconds")
            if self.state == "failed":
                raise NotReady(f"the model failed to load: {self.error}")
            idle = self._running is None and not self._waiting
            if len(self._waiting) >= self.max_queue and not idle:
                raise QueueFull(
                    f"the queue is full ({self.max_queue} waiting, one running); retry later or start the server "
                    "with a larger --queue"
                )
            job = Job(request, on_event)
            self._waiting.append(job)
            self._lock.notify_all()
            return job

    def status(self) -> dict:
        with self._lock:
            return {"state": self.state, "error": self.error, "waiting": len(self._waiting),
                    "running": self._running is not None, "max_queue": self.max_queue,
                    "completed": self.completed, "cancelled": self.cancelled_jobs,
                    "mlx_active_bytes": self.active_memory}

    # ---- the worker thread ----------------------------------------------------------------------

    def _load(self, loras: tuple) -> None:
        from .preview import preview_for

        self.pipe = None  # one model resident: drop the old one before loading the next
        pipe = self._loader(loras)
        self.preview = preview_for(pipe.vae.get())
        self.pipe, self.loaded_loras = pipe, loras

    def _run(self) -> None:
        try:
            self._load(self.base_loras)
        except Exception as e:  # noqa: BLE001: any load failure is reported as 503 with its message
            with self._lock:
                self.state, self.error = "failed", str(e) if isinstance(e, FluxKleinError) else repr(e)
                self._lock.notify_all()
            return
        with self._lock:
            self.state = "ready"
            self._lock.notify_all()
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stop or self._waiting)
                if self._stop:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._execute(job)
            finally:
                with self._lock:
                    self._running = None
                    self.completed += 1
                import mlx.core as mx

                mx.clear_cache()  # give freed buffers back so idle memory returns to its level
                self.active_memory = mx.get_active_memory()

    def _execute(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.cancelled_jobs += 1
            job.on_event(JobEvent("cancelled"))
            return
        try:
            loras = self.base_loras + tuple(job.request.loras)
            if loras != self.loaded_loras:
                self._load(loras)
            finished = self._generate(job)
            self.cancelled_jobs += not finished
            job.on_event(JobEvent("done" if finished else "cancelled"))
        except FluxKleinError as e:
            job.on_event(JobEvent("error", {"status": 400, "message": str(e)}))
        except Exception as e:  # noqa: BLE001: the server must outlive a failed job
            traceback.print_exc()
            job.on_event(JobEvent("error", {"status": 500, "message": f"generation failed: {e!r}"}))

    def _generate(self, job: Job) -> bool:
        """Run the job's images; False when cancelled part-way."""
        req, pipe = job.request, self.pipe
        kwargs = dict(width=req.width, height=req.height, steps=req.steps, guidance=req.guidance,
                      negative_prompt=req.negative_prompt, images=req.images or None)
        if req.mask is not None or req.strength is not None:
            # Inpainting / img2img: the first uploaded image is the one to repaint (checked by the HTTP layer).
            kwargs.update(mask=req.mask, init_image=req.images[0], images=req.images[1:] or None)
        if req.strength is not None:
            kwargs["strength"] = req.strength
        for index in range(req.n):
            seed = None if req.seed is None else req.seed + index
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # guidance on distilled models etc.: noted in metadata
                stream = pipe.stream(req.prompt, seed=seed, **kwargs)
                event = None
                try:
                    for event in stream:
                        if job.cancelled.is_set():
                            return False
                        if event.stage == "denoise":
                            preview = None
                            if req.previews and event.denoised is not None:
                                h, w = event.grid
                                preview = png_bytes(Image.fromarray(self.preview.render(event.denoised, h, w)))
                            job.on_event(JobEvent("step", {"index": index, "step": event.step,
                                                           "total": event.total, "preview": preview}))
                finally:
                    stream.close()  # runs the generator's cleanup now, on this thread
            stats = event.stats
            info = pipe.info
            metadata = {
                "prompt": req.prompt, "negative_prompt": req.negative_prompt if not info.is_distilled else None,
                "seed": stats["seed"], "steps": stats["steps"], "guidance": stats["guidance"],
                "width": stats["width"], "height": stats["height"], **self.metadata,
                "variant": info.name, "quantize": pipe.quantization["bits"] if pipe.quantization else None,
                "references": len(req.images) or None, "mask": req.mask is not None or None,
                "strength": req.strength, "loras": ", ".join(f"{Path(p).stem}:{s}" for p, s in self.loaded_loras) or None,
                "software": f"flux_klein_mlx {__version__}",
            }
            job.on_event(JobEvent("image", {"index": index, "image": event.image, "metadata": metadata,
                                            "png": png_bytes(event.image, metadata),
                                            "seconds": stats["total_seconds"], "created": int(time.time())}))
        return True
