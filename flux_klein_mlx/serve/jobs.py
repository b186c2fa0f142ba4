"""The server's single worker: one model resident, one generation at a time, a bounded queue.

MLX work never runs concurrently: one thread loads the pipeline and then runs jobs in order. A
job reports through a callback (called on the worker thread) with typed events: `StageEvent`s
before its first step (LoRAs applied, text encoder loaded or prompt cached), a `StepEvent`
after every denoising step (with a small preview PNG when asked), an `ImageEvent` for each
finished image, then exactly one `EndEvent` ("done", "error" or "cancelled"). A cancelled job
stops between steps (`FluxKleinPipeline.stream` yields after every step, so the worker just stops
iterating). The HTTP layer (`api.py`) knows nothing of MLX; this module knows nothing of HTTP.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import FluxKleinError
from ..inputs.settings import RunSettings, prepare_inputs
from ..record.output import image_bytes
from ..run.loading import COMPONENTS


class QueueFull(Exception):
    """The waiting line is at its bound; the client should retry later (HTTP 429)."""

    code = "queue_full"  # the API error's code (its Retry-After: forms.RETRY_AFTER)


class NotReady(Exception):
    """The model is still loading, or failed to load (HTTP 503)."""


class Busy(QueueFull):
    """A heavy task (a fine-tuning job) holds or waits for the worker: image requests are refused until it
    ends (HTTP 429 with its reason and a longer Retry-After)."""

    code = "fine_tuning_job_running"


@dataclass(kw_only=True)
class Task:
    """Work other than images on the worker thread, one machine's heavy job (a fine-tuning run): `work(job)`
    runs with the pipeline's models released (they load again for the next image) and returns False when
    cancelled part-way. While one runs or waits, image requests get `Busy` with `busy`'s words."""

    work: Callable[[object], bool]
    busy: str  # why an image request is refused meanwhile, and what to do


@dataclass(kw_only=True)
class ImageRequest:
    """A validated request: the run's settings (images decoded, no file paths from the client)."""

    settings: RunSettings
    n: int = 1
    loras: tuple = ()  # ((server-side path, scale), ...) resolved from names by the HTTP layer
    partial_images: int | None = 0  # preview PNGs per image while denoising (OpenAI's meaning); None: every step
    model: str | None = None  # the served model's id it names (serve --model A --model B); None: the one loaded


@dataclass(kw_only=True)
class StepEvent:
    index: int  # image of the request
    step: int
    total: int
    preview: bytes | None = None  # PNG
    kind: str = "step"


@dataclass(kw_only=True)
class StageEvent:
    """What the job does before its first step: "loras" (applying a change of LoRAs), "upsample" (writing FLUX 3's
    caption with the prompt upsampler), "text_encoder" (loading
    the text encoder to encode a new prompt) or "cached" (the prompt's embeddings are cached: no encoder)."""

    stage: str
    index: int = 0
    kind: str = "stage"


@dataclass(kw_only=True)
class ImageEvent:
    index: int
    metadata: dict
    png: bytes
    seconds: float
    kind: str = "image"


@dataclass(kw_only=True)
class EndEvent:
    kind: str  # "done" | "error" | "cancelled"
    status: int = 200  # HTTP status of an error (400: the request; 500: ours)
    message: str = ""


@dataclass(kw_only=True)
class Job:
    request: ImageRequest
    on_event: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop at the next step boundary (or never start, if still waiting)."""
        self.cancelled.set()


class Worker:
    """Owns the pipeline and the job line.

    Args:
        loader: `loader()` -> a `FluxKleinPipeline` with the server's own LoRAs and its `preview_map()`
            fitted (not during the first job); called once, on the worker thread. A request's LoRAs are
            applied with `set_loras` (the base model stays).
        max_queue: how many jobs may wait behind the running one; more are refused (`QueueFull`).
        model_id: the id of the model `loader` gives. switch: `switch(model_id)` -> the pipeline of another
            served model, ready to load (called on the worker thread after the current one's models are
            released: one model in memory at a time).
    """

    def __init__(self, loader: Callable[[], object], *, max_queue: int = 4, model_id=None, switch=None):
        self._loader = loader
        self._switch_to = switch
        self.model_id = model_id
        self.switching: str | None = None  # the model being switched to, while it loads
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._stop = False
        self.state = "loading"  # "loading" | "ready" | "failed"
        self.error: str | None = None
        self.pipe = None
        self.base_loras: tuple = ()  # what the pipeline was loaded with, kept under every request's own
        self.applied: tuple = ()  # ((path, scale, file_stamp), ...) of the LoRAs the pipeline holds now
        self.completed = self.cancelled_jobs = 0
        self.active_memory = 0  # MLX bytes in use after the last job (read on the worker thread)
        self._thread = threading.Thread(target=self._run, name="flux-klein-worker", daemon=True)

    # ---- called from the HTTP side ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            for job in filter(None, [*self._waiting, self._running]):
                job.cancel()
            self._lock.notify_all()
        self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        with self._lock:
            self._lock.wait_for(lambda: self.state != "loading", timeout)
            return self.state == "ready"

    def submit(self, request: ImageRequest | Task, on_event: Callable[[object], None]) -> Job:
        """Queue a job; raises `NotReady` (loading or failed), `Busy` (an image behind a task) or `QueueFull`.
        A task is not counted against --queue (its caller bounds tasks)."""
        with self._lock:
            if self.state == "loading":
                raise NotReady("the model is still loading; retry in a few seconds")
            if self.state == "failed":
                raise NotReady(f"the model failed to load: {self.error}")
            task = next(
                (
                    j.request
                    for j in (self._running, *self._waiting)
                    if j and isinstance(j.request, Task) and not j.cancelled.is_set()
                ),
                None,
            )
            if task is not None and not isinstance(request, Task):
                raise Busy(task.busy)
            full = len(self._waiting) >= self.max_queue and (self._running or self._waiting)  # idle: one runs at 0
            if full and not isinstance(request, Task):
                raise QueueFull(
                    f"the queue is full ({self.max_queue} waiting, one running); retry later or start "
                    "the server with a larger --queue"
                )
            job = Job(request=request, on_event=on_event)
            self._waiting.append(job)
            self._lock.notify_all()
            return job

    def status(self) -> dict:
        with self._lock:
            return {
                "state": self.state,
                "error": self.error,
                "model": self.model_id,
                "switching": self.switching,
                "waiting": len(self._waiting),
                "running": self._running is not None,
                "max_queue": self.max_queue,
                "completed": self.completed,
                "cancelled": self.cancelled_jobs,
                "mlx_active_bytes": self.active_memory,
            }

    # ---- the worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.pipe = self._loader()
            self.base_loras = tuple((lora.path, lora.scale) for lora in self.pipe.loras)
            self.applied = stamped(self.base_loras)
        except Exception as e:  # any load failure is reported as 503 with its message
            self.error = e.worded("http") if isinstance(e, FluxKleinError) else f"{type(e).__name__}: {e}"
        with self._lock:  # the pipe is set before the state says so
            self.state = "failed" if self.pipe is None else "ready"
            self._lock.notify_all()
        if self.pipe is None:
            return
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stop or self._waiting)
                if self._stop:
                    return
                job = self._running = self._waiting.popleft()
            try:
                if job.cancelled.is_set():  # cancelled while waiting: never starts
                    finished = False
                elif isinstance(job.request, Task):
                    self.release_models()
                    finished = job.request.work(job)
                else:
                    finished = self._generate(job)
                if not finished:
                    self.cancelled_jobs += 1
                job.on_event(EndEvent(kind="done" if finished else "cancelled"))
            except FluxKleinError as e:
                job.on_event(EndEvent(kind="error", status=400, message=e.worded("http")))
            except Exception as e:  # the server must outlive a failed job
                traceback.print_exc()
                job.on_event(EndEvent(kind="error", status=500, message=f"generation failed ({type(e).__name__})"))
            finally:
                with self._lock:
                    self._running = None
                    self.completed += 1
                mx.clear_cache()  # give freed buffers back so idle memory returns to its level
                self.active_memory = mx.get_active_memory()

    def _generate(self, job: Job) -> bool:
        """Run the job's images with its LoRAs; False when cancelled part-way."""
        req = job.request
        if req.model is not None and req.model != self.model_id:
            self._switch(req.model, job)
        pipe = self.pipe
        loras = self.base_loras + tuple(req.loras)
        wanted = stamped(loras)  # a file replaced since it was applied is read again
        if wanted != self.applied:
            job.on_event(StageEvent(stage="loras"))
            pipe.set_loras(list(loras))  # checked first: on error the pipeline keeps its LoRAs
            self.applied = wanted
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # guidance on distilled models etc.: noted in the metadata
            prepared = prepare_inputs(req.settings, pipe.info)  # uploads decoded once for all n images
        if prepared.upsample is not None:
            job.on_event(StageEvent(stage="upsample"))
            prepared = pipe.inputs(prepared, {})  # FLUX 3's caption, once for all n images (then released)
        job.on_event(StageEvent(stage="text_encoder" if pipe.check_text_encoder(prepared) else "cached"))
        wanted = preview_steps(prepared.steps_run, req.partial_images)
        for index in range(req.n):
            with contextlib.closing(pipe.stream(prepared.for_image(index))) as stream:  # cleanup now, on this thread
                for event in stream:
                    if job.cancelled.is_set():
                        return False
                    if event.stage == "denoise":
                        preview = (
                            image_bytes(pipe.preview_map().image(event.denoised, *event.grid))
                            if event.step in wanted
                            else None
                        )
                        job.on_event(StepEvent(index=index, step=event.step, total=event.total, preview=preview))
            job.on_event(
                ImageEvent(
                    index=index,
                    metadata=event.metadata,
                    png=image_bytes(event.image, event.metadata),
                    seconds=event.stats.total_seconds,
                )
            )
        return True

    def release_models(self) -> None:
        """Free the pipeline's models for a task; each loads again, with its LoRAs, when an image needs it."""
        for name in COMPONENTS:
            self.pipe.release(name)

    def _switch(self, model_id: str, job: Job) -> None:
        """Make `model_id` the loaded model: the current one's models released first, then the other's loaded."""
        job.on_event(StageEvent(stage="model"))
        with self._lock:
            self.switching = model_id
        try:
            self.release_models()
            pipe = self._switch_to(model_id)
            if not pipe.memory.release_models:
                pipe.component("transformer")  # resident anyway, as at start
            pipe.preview_map()  # the VAE
            self.pipe, self.model_id = pipe, model_id
            self.base_loras = tuple((lora.path, lora.scale) for lora in pipe.loras)
            self.applied = stamped(self.base_loras)
        finally:
            with self._lock:
                self.switching = None


def file_stamp(path: str) -> tuple | None:
    """A file's identity without reading it: (size, mtime_ns, ctime_ns, inode); None when it cannot be
    read (the LoRA loader then says why). A file written over or replaced changes at least ctime."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def stamped(loras: tuple) -> tuple:
    """((path, scale), ...) -> ((path, scale, file_stamp), ...): what a pipeline's LoRAs are compared by."""
    return tuple((path, scale, file_stamp(path)) for path, scale in loras)


def preview_steps(steps: int, count: int | None) -> set[int]:
    """The steps (1-based) after which a preview is sent: all of them (None), or `count` spread evenly
    over the run, the last step excluded when it can be (its image follows anyway)."""
    if count is None:
        return set(range(1, steps + 1))
    return {min(steps, max(1, round(steps * k / (count + 1)))) for k in range(1, count + 1)}
