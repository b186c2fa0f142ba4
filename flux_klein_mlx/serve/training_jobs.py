"""Fine-tuning jobs (docs/server.md#fine-tuning-jobs): a request checked into `train`'s settings and planned
as `train` plans it (`train/plan.plan_run`: every check before a model loads), then run by `train_lora` on the
server's one worker thread (a `jobs.Task`), its events kept as OpenAI's event objects.

A job's folder, `<train-dir>/jobs/ftjob-<24 hex>/`, holds `job.json` (the job object, its settings and its
checkpoints, replaced whole at every change: storage/files.write_replacing), `events.jsonl` (one event a
line, appended; a line cut short by a crash is skipped) and `work/`, the run's work folder as `train` lays
it out (checkpoints, samples, loss.png, train.json). The LoRA goes to the server's --lora-dir as
`ft-[SUFFIX-]<12 hex>.safetensors` (the job's `fine_tuned_model`), each checkpoint's beside it as
`...-step-N`. A restarted server lists every job; one that was queued or running when it stopped is failed
with a line saying so, and resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import shutil
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FluxKleinError
from ..limits import MAX_ACTIVE_TRAINING_JOBS
from ..storage.files import write_exclusive, write_replacing
from ..train.memory import MemoryPlanned, describe_plan
from ..train.plan import plan_run
from ..train.report.evaluation import ValidationFinished
from ..train.report.events import (
    CheckpointSaved,
    StageFinished,
    StageStarted,
    StepFinished,
    TrainFinished,
    TrainStarted,
)
from ..train.report.samples import SamplesSaved
from ..train.settings import TrainSettings
from ..train.trainer import train_lora
from .forms import ApiError, pick_model, shown
from .jobs import EndEvent, NotReady, Task
from .training_requests import (
    check_fields,
    check_suffix,
    hyperparameters,
    merged,
    public_hyperparameters,
    training_options,
)

ACTIVE = ("validating_files", "queued", "running")  # OpenAI's statuses of a job not yet ended
RECORD, EVENTS = "job.json", "events.jsonl"


@dataclass
class JobState:
    """A job: its OpenAI object, `train`'s settings, its events and checkpoints, the worker's job while it runs."""

    record: dict
    settings: dict
    events: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)
    running: object = None  # the worker's Job while queued or running (its cancel())


def finite(x) -> float | None:
    """A number for JSON: NaN and infinities (a diverged loss) are null."""
    return float(x) if x is not None and math.isfinite(x) else None


def plan_job(settings: dict):
    """`train`'s checks of a job's settings, all before any model loads (`train/plan.plan_run`): the plan, or
    one line (400)."""
    try:
        return plan_run(TrainSettings(**settings))
    except FluxKleinError as e:
        raise ApiError(400, e.worded("http"), "training") from None
    except (TypeError, ValueError) as e:  # a value of a type no check expected: still one line
        raise ApiError(400, f"a training option has a value of the wrong type ({e})", "training") from None


def planned(record: dict, plan) -> dict:
    """A dry run's answer: what the job would train, and its memory plan (train/memory.py)."""
    m = plan.memory
    memory = None
    if m is not None:
        memory = {"peak": m.peak, "weights": m.weights, "trainable": m.trainable, "available": m.available}
        memory.update(fits=m.fits, remedies=m.remedies, description=describe_plan(m))
    keep = ("model", "training_file", "validation_file", "seed", "steps", "hyperparameters", "training")
    return {
        "object": "fine_tuning.job.plan",
        **{k: record[k] for k in keep},
        "images": len(plan.items),
        "memory": memory,
    }


class TrainingJobs:
    """Every fine-tuning job of one --train-dir: created, run one at a time on the worker, kept on disk."""

    def __init__(self, root: Path, *, worker, options, files):
        self.root = root / "jobs"
        self.worker, self.options, self.files = worker, options, files
        self.lock = threading.RLock()  # the jobs' state, taken briefly by the HTTP side and the worker
        self.planning = threading.Lock()  # one create or resume is checked at a time (the queue's bound holds)
        self.jobs: dict[str, JobState] = self.load()

    # ---- on the disk ------------------------------------------------------------------------------

    def folder(self, job_id: str) -> Path:
        return self.root / job_id

    def save(self, state: JobState) -> None:
        folder = self.folder(state.record["id"])
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"job": state.record, "settings": state.settings, "checkpoints": state.checkpoints})
        write_replacing(folder / RECORD, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def load(self) -> dict[str, JobState]:
        """The jobs a previous run of the server left; one it left unfinished is failed, resumable."""
        jobs = {}
        for folder in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            try:
                saved = json.loads((folder / RECORD).read_text(encoding="utf-8"))
                state = JobState(saved["job"], saved["settings"], checkpoints=saved["checkpoints"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a job's folder (or one cut short before its first record)
            with contextlib.suppress(OSError):
                for line in (folder / EVENTS).read_text(encoding="utf-8").splitlines():
                    with contextlib.suppress(ValueError):
                        state.events.append(json.loads(line))
            jobs[state.record["id"]] = state
            if state.record["status"] in ACTIVE:
                message = (
                    f"the server stopped while this job was {state.record['status']}; POST "
                    f"/v1/fine_tuning/jobs/{state.record['id']}/resume continues it from its last checkpoint"
                )
                self.end(state, "failed", "server_stopped", message)
        return jobs

    def add_event(self, state: JobState, message: str, data: dict | None = None, *, kind: str = "message") -> None:
        level = (
            "error" if state.record["status"] == "failed" and kind == "end" else "warn" if kind == "warning" else "info"
        )
        n = len(state.events)
        event = {
            "object": "fine_tuning.job.event",
            "id": f"ftevent-{n}-{state.record['id'][6:]}",
            "created_at": int(time.time()),
            "level": level,
            "message": shown(message),  # never the server's own folders
            "data": data or {},
            "type": "metrics" if kind == "metrics" else "message",
        }
        with self.lock:
            state.events.append(event)
            with contextlib.suppress(OSError), open(self.folder(state.record["id"]) / EVENTS, "a") as f:
                f.write(json.dumps(event) + "\n")

    # ---- requests -----------------------------------------------------------------------------------

    def job(self, job_id) -> JobState:
        state = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if state is None:
            raise ApiError(
                404,
                f"no fine-tuning job {str(job_id)!r} here; GET /v1/fine_tuning/jobs lists them",
                None,
                "job_not_found",
            )
        return state

    def check_room(self) -> None:
        active = [s.record["id"] for s in self.jobs.values() if s.record["status"] in ACTIVE]
        if len(active) >= MAX_ACTIVE_TRAINING_JOBS:
            raise ApiError(
                429,
                f"{len(active)} fine-tuning jobs are queued or running ({', '.join(active)}), the most this "
                "server holds; retry when one ends, or cancel one",
                code="fine_tuning_job_running",
            )

    def create(self, body: dict) -> dict:
        """POST /v1/fine_tuning/jobs: checked and planned as `train` (one line, 400), then queued."""
        check_fields(body)
        with self.planning:
            if body.get("dry_run") is not True:
                self.check_room()
            job_id = f"ftjob-{secrets.token_hex(12)}"
            record = self.new_record(job_id, body)
            state = JobState(record, self.job_settings(record, body))
            self.folder(job_id).mkdir(parents=True)  # the work folder's parent, as `train --work-dir` needs
            try:
                plan = plan_job(state.settings)
                self.describe_plan(state, plan)
                if body.get("dry_run") is True:  # the plan only (the page shows it before starting): no job
                    shutil.rmtree(self.folder(job_id), ignore_errors=True)
                    return planned(state.record, plan)
                with self.lock:  # the worker waits for it before the job's first change: the answer is "queued"
                    self.jobs[job_id] = state
                    self.save(state)
                    self.submit(state)
                    self.add_event(state, f"created fine-tuning job {job_id} ({state.record['steps']} steps), queued")
                    return dict(state.record)
            except BaseException:  # refused (or the model still loading): nothing of it is kept
                self.jobs.pop(job_id, None)
                shutil.rmtree(self.folder(job_id), ignore_errors=True)
                raise

    def describe_plan(self, state: JobState, plan) -> None:
        """What the plan settled (the steps --epochs makes, the seed) into the job object."""
        s = plan.settings
        state.record.update(seed=s.seed, steps=s.steps)
        state.record["hyperparameters"] = public_hyperparameters(vars(s))
        state.record["method"] = {
            "type": "supervised",
            "supervised": {"hyperparameters": state.record["hyperparameters"]},
        }

    def new_record(self, job_id: str, body: dict) -> dict:
        model = pick_model(body.get("model"), self.options.served())
        if model is None:
            raise ApiError(400, "model is required: the id of a served Base model (GET /v1/models)", "model")
        o = self.options
        card = o.model_card if model == o.model_id else next(c for m, _, c in o.other_models if m == model)
        if card.get("distilled"):  # `train` refuses a distilled FLUX 3 and only warns of a FLUX.2: nobody would see it
            raise ApiError(
                400,
                f"{model} is a distilled model; a fine-tuning job trains a Base model (training a distilled one "
                "breaks its distillation): serve its Base model beside it and name that",
                "model",
            )
        return {
            "id": job_id,
            "object": "fine_tuning.job",
            "model": model,
            "created_at": int(time.time()),
            "finished_at": None,
            "fine_tuned_model": None,
            "organization_id": "flux_klein_mlx",
            "result_files": [],
            "status": "queued",
            "validation_file": body.get("validation_file"),
            "training_file": body.get("training_file"),
            "hyperparameters": {},
            "trained_tokens": 0,
            "error": None,
            "seed": 0,
            "suffix": check_suffix(body.get("suffix")),
            "estimated_finish": None,
            "integrations": [],
            "metadata": body.get("metadata"),
            "method": {"type": "supervised"},
            "training": body.get("training") or {},  # train's options as the request gave them
        }

    def job_settings(self, record: dict, body: dict) -> dict:
        """The request (and its job object, `new_record`'s) -> `train_lora`'s keyword arguments: the server's
        folders, then the request's options."""
        settings = merged(hyperparameters(body), training_options(body.get("training")))
        if body.get("seed") is not None:
            if "seed" in settings:
                raise ApiError(400, "seed is given at the top and in training; give it once", "seed")
            settings["seed"] = body["seed"]
        data, controls = self.file_folders(body.get("training_file"), "training_file")
        settings.update(data=str(data), controls=[str(c) for c in controls])
        if body.get("validation_file") is not None:
            held_out, held_out_controls = self.file_folders(body["validation_file"], "validation_file")
            settings.update(validation=str(held_out), validation_controls=[str(c) for c in held_out_controls])
        model, suffix = record["model"], record["suffix"]
        name = f"ft-{suffix + '-' if suffix else ''}{record['id'][6:18]}"
        settings.update(
            model=str(self.options.model_folders[model]),
            output=str(self.options.lora_dir / f"{name}.safetensors"),
            work_dir=str(self.folder(record["id"]) / "work"),
        )
        if "sample_model" in settings:  # samples on another served model (e.g. the distilled one), by its id
            if not isinstance(settings["sample_model"], str):
                raise ApiError(400, "training.sample_model must be the id of a served model (a text)", "training")
            sampled = pick_model(settings["sample_model"], self.options.served())
            settings["sample_model"] = str(self.options.model_folders[sampled or model])
        return settings

    def file_record(self, file_id, param: str | None = None) -> dict:
        """A stored file's object, or 404 naming the id."""
        record = self.files.get(file_id)
        if record is None:
            message = f"no file {str(file_id)!r} here; upload one with POST /v1/files (GET /v1/files lists them)"
            raise ApiError(404, message, param, "file_not_found")
        return record

    def file_folders(self, file_id, param: str) -> tuple[Path, tuple[Path, ...]]:
        if file_id in (None, ""):
            raise ApiError(400, f"{param} is required: the id of a zip uploaded with POST /v1/files", param)
        self.file_record(file_id, param)
        return self.files.folders(file_id)

    def submit(self, state: JobState) -> None:
        job_id = state.record["id"]
        busy = (
            f"a fine-tuning job ({job_id}) holds this machine, and image requests wait until it ends; retry "
            f"later, or cancel it with POST /v1/fine_tuning/jobs/{job_id}/cancel"
        )
        try:
            state.running = self.worker.submit(
                Task(work=lambda job: self.run(state, job), busy=busy), lambda event: self.on_end(state, event)
            )
        except NotReady as e:
            raise ApiError(503, str(e), code="model_loading") from None

    # ---- the run, on the worker thread ------------------------------------------------------------

    def run(self, state: JobState, job) -> bool:
        """`train_lora` with the job's settings; False when cancelled (at the next event: after a step)."""
        with self.lock:  # a job cancelled while it waited has ended already
            if job.cancelled.is_set():
                return False
            self.set(state, status="validating_files")  # train_lora checks everything again before a model loads
        caught = []  # `train`'s warnings (a small lr, unread folders, a stale lock taken over): events too
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                events = train_lora(**state.settings)
                with contextlib.closing(events):  # closed: the run's own cleanup (its lock) on this thread
                    for event in events:
                        self.say_warnings(state, caught)
                        if job.cancelled.is_set():
                            return False
                        self.record_event(state, event)
        except FluxKleinError as e:
            self.say_warnings(state, caught)
            self.end(state, "failed", "invalid_training", e.worded("http"))
        except Exception as e:  # the server outlives a failed run; the log has the traceback
            traceback.print_exc()
            message = f"training failed ({type(e).__name__}); the server's log has the details"
            self.end(state, "failed", "server_error", message)
        return True

    def say_warnings(self, state: JobState, caught: list) -> None:
        while caught:
            self.add_event(state, str(caught.pop(0).message), kind="warning")

    def on_end(self, state: JobState, event) -> None:
        """The worker's end of the job: a job cancelled (before it started, or at a step) is "cancelled"."""
        if state.record["status"] not in ACTIVE:  # ended already (cancelled while it waited)
            pass
        elif isinstance(event, EndEvent) and event.kind == "cancelled":
            self.end(state, "cancelled")
        elif isinstance(event, EndEvent) and event.kind == "error":
            self.end(state, "failed", "server_error", event.message)
        state.running = None

    def set(self, state: JobState, **changes) -> None:
        with self.lock:
            state.record.update(changes)
            self.save(state)

    def end(self, state: JobState, status: str, code: str | None = None, message: str | None = None) -> None:
        """The job ended with `status`; a failure's error object is OpenAI's {code, message, param}."""
        error = None if code is None else {"code": code, "message": shown(message), "param": None}
        self.set(state, status=status, error=error, finished_at=int(time.time()))
        words = {"cancelled": "cancelled; its last checkpoint is kept", "failed": f"failed: {message}"}
        self.add_event(state, f"the job {words.get(status, status)}", kind="end")

    def record_event(self, state: JobState, ev) -> None:
        """A `train` event -> the job's OpenAI event (and its status, steps done, checkpoints, LoRA)."""
        if state.record["status"] != "running":
            self.set(state, status="running")
        if isinstance(ev, StepFinished):
            state.record["trained_tokens"] = ev.step
            data = {"step": ev.step, "total_steps": ev.total, "train_loss": finite(ev.loss), "learning_rate": ev.lr}
            data.update(average_loss=finite(ev.average), grad_norm=finite(ev.grad_norm), seconds=ev.seconds)
            self.add_event(state, f"step {ev.step}/{ev.total}: training loss={ev.loss:.4f}", data, kind="metrics")
        elif isinstance(ev, CheckpointSaved):
            self.keep_checkpoint(state, ev)
        elif isinstance(ev, SamplesSaved):
            names = [str(p.relative_to(Path(state.settings["work_dir"]))) for p in ev.paths]
            self.add_event(state, f"samples at step {ev.step}: {', '.join(names)}", {"step": ev.step, "samples": names})
        elif isinstance(ev, ValidationFinished):
            data = {"step": ev.step, "valid_loss": finite(ev.loss)}
            self.add_event(state, f"validation at step {ev.step}: loss {ev.loss:.4f}", data, kind="metrics")
        elif isinstance(ev, TrainStarted):
            self.set(state, trained_tokens=ev.first_step - 1)
            where = f"resuming at step {ev.first_step}" if ev.resumed_from else "training"
            data = {"first_step": ev.first_step, "total_steps": ev.total_steps, "images": ev.images}
            self.add_event(state, f"{where}: {ev.images} images, {ev.total_steps} steps", data)
        elif isinstance(ev, TrainFinished):
            name = Path(ev.output).stem
            self.set(state, fine_tuned_model=name, status="succeeded", finished_at=int(time.time()))
            self.add_event(
                state, f"the job succeeded: the LoRA {name!r} ({ev.steps} steps)", {"fine_tuned_model": name}
            )
        elif isinstance(ev, MemoryPlanned):
            self.add_event(state, describe_plan(ev))
        elif isinstance(ev, (StageStarted, StageFinished)):
            self.add_event(state, ev.detail if isinstance(ev, StageStarted) else f"{ev.stage}: {ev.detail}")

    def keep_checkpoint(self, state: JobState, ev: CheckpointSaved) -> None:
        """A checkpoint's LoRA (its EMA under --ema: what the run delivers) copied into --lora-dir, usable at once."""
        source = ev.path / "ema.safetensors"
        source = source if source.is_file() else ev.path / "lora.safetensors"
        output = Path(state.settings["output"])
        path = write_exclusive(
            output.with_name(f"{output.stem}-step-{ev.step}.safetensors"), lambda tmp: shutil.copyfile(source, tmp)
        )
        checkpoint = {
            "object": "fine_tuning.job.checkpoint",
            "id": f"ftckpt-{ev.step}-{state.record['id'][6:]}",
            "created_at": int(time.time()),
            "fine_tuned_model_checkpoint": path.stem,
            "fine_tuning_job_id": state.record["id"],
            "metrics": {"step": ev.step, "train_loss": self.last_loss(state)},
            "step_number": ev.step,
        }
        with self.lock:
            state.checkpoints.append(checkpoint)
            self.save(state)
        self.add_event(state, f"checkpoint at step {ev.step}: the LoRA {path.stem!r}", {"step": ev.step, **checkpoint})

    def last_loss(self, state: JobState) -> float | None:
        return next((e["data"].get("train_loss") for e in reversed(state.events) if e["type"] == "metrics"), None)

    # ---- cancel and resume ------------------------------------------------------------------------------

    def cancel(self, job_id) -> JobState:
        state = self.job(job_id)
        with self.lock:
            if state.record["status"] not in ACTIVE:
                raise ApiError(
                    400, f"the job {job_id} is {state.record['status']}; only a queued or running job cancels"
                )
            if state.running is not None:
                state.running.cancel()  # a run stops at its next step; the worker then says "cancelled"
            if state.record["status"] == "queued":  # never started: it never will
                self.end(state, "cancelled")
        return state

    def resume(self, job_id) -> dict:
        """A cancelled or failed job continues from its last checkpoint, bit for bit (`train --resume`)."""
        state = self.job(job_id)
        with self.planning:
            if state.record["status"] not in ("cancelled", "failed"):
                raise ApiError(
                    400, f"the job {job_id} is {state.record['status']}; only a cancelled or failed job resumes"
                )
            self.check_room()
            settings = {**state.settings, "resume": True}
            plan_job(settings)
            with self.lock:  # the worker waits for it before it says "validating_files"
                previous, state.settings = state.settings, settings
                try:
                    self.submit(state)
                except ApiError:
                    state.settings = previous
                    raise
                self.set(state, status="queued", error=None, finished_at=None)
                done = state.checkpoints[-1]["step_number"] if state.checkpoints else 0
                self.add_event(state, f"resumed: queued to continue from step {done}")
                return dict(state.record)

    def uses(self, file_id: str) -> str | None:
        """The id of a queued or running job that reads `file_id`, if any (such a file is not deleted)."""
        with self.lock:
            return next(
                (
                    s.record["id"]
                    for s in self.jobs.values()
                    if s.record["status"] in ACTIVE
                    and file_id in (s.record["training_file"], s.record["validation_file"])
                ),
                None,
            )
