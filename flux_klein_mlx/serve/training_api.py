"""The routes of training over the API, in OpenAI's shape (docs/server.md#training-over-the-api): the
files (POST/GET /v1/files, GET/DELETE /v1/files/{id}) hold uploaded training data (serve/training_files.py);
the fine-tuning jobs (POST/GET /v1/fine_tuning/jobs, GET .../{id}, .../events (SSE with stream=true),
.../checkpoints, .../samples/{path}, POST .../cancel, .../resume) train on them (serve/training_jobs.py).

They need the server's --train-dir; without it each answers one line saying so. The API key and the body
cap are the server's (serve/guard.py: a zip may be up to `limits.MAX_TRAINING_UPLOAD_BYTES`).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import FluxKleinError
from .forms import ApiError, read_json, read_multipart
from .training_files import TrainingFiles
from .training_jobs import ACTIVE, TrainingJobs

FILE_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}  # OpenAI's; expiry not kept


class TrainingApi:
    """The fine-tuning jobs of one server's --train-dir, and through them its uploaded files."""

    def __init__(self, worker, options):
        self.options = options
        self.jobs = None
        if options.train_dir is not None:
            files = TrainingFiles(options.train_dir)
            self.jobs = TrainingJobs(options.train_dir, worker=worker, options=options, files=files)

    def stored_jobs(self) -> TrainingJobs:
        """The jobs (and through them the files) of --train-dir, or the one line saying there is none."""
        if self.jobs is None:
            raise ApiError(
                400,
                "this server was started without --train-dir, so it keeps no training data; start it with "
                "--train-dir DIR (and --lora-dir for the LoRAs it trains)",
                code="fine_tuning_off",
            )
        return self.jobs

    async def create_file(self, request: Request):
        """POST /v1/files: multipart `file` (a zip of training data) and `purpose` "fine-tune"."""
        files = self.stored_jobs().files
        takes = "POST /v1/files takes multipart/form-data: a zip as 'file' and purpose 'fine-tune'"
        form = await read_multipart(request, takes, max_files=1, max_fields=8, max_part_size=64 * 1024)
        try:
            unknown = next((key for key in form if key not in FILE_FIELDS), None)
            if unknown is not None:
                raise ApiError(400, f"unknown field {unknown!r}; POST /v1/files takes 'file' and 'purpose'", unknown)
            if form.get("purpose") != "fine-tune":
                raise ApiError(
                    400, f"purpose must be 'fine-tune' (training data), not {form.get('purpose')!r}", "purpose"
                )
            upload = form.get("file")
            if not hasattr(upload, "read"):
                raise ApiError(400, "upload the zip of images and captions as the file field 'file'", "file")
            try:
                record = await asyncio.to_thread(files.add, upload.file, upload.filename or "data.zip", upload.size)
            except FluxKleinError as e:
                raise ApiError(400, e.worded("http"), "file") from None
        finally:
            await form.close()
        self.options.log(f"file {record['id']}: {record['images']} images from {record['filename']!r}")
        return JSONResponse(record)

    async def list_files(self, request: Request):
        """GET /v1/files (purpose=fine-tune, or none: every file here is training data)."""
        purpose = request.query_params.get("purpose")
        files = [] if purpose not in (None, "fine-tune") else await asyncio.to_thread(self.stored_jobs().files.all)
        return JSONResponse({"object": "list", "data": files, "has_more": False})

    async def get_file(self, request: Request):
        return JSONResponse(self.stored_jobs().file_record(request.path_params["file_id"]))

    async def delete_file(self, request: Request):
        file_id = request.path_params["file_id"]
        self.stored_jobs().file_record(file_id)
        if user := self.jobs.uses(file_id):
            raise ApiError(409, f"the file {file_id} is read by the job {user}, not ended; cancel it first", "file_id")
        deleted = await asyncio.to_thread(self.jobs.files.delete, file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": deleted})

    # ---- jobs ---------------------------------------------------------------------------------------

    async def create_job(self, request: Request):
        jobs = self.stored_jobs()
        body = await read_json(request)
        record = await asyncio.to_thread(jobs.create, body)  # train's checks read the data: off the event loop
        if record["object"] == "fine_tuning.job":  # not a dry run
            self.options.log(f"fine-tuning job {record['id']}: queued, {record['steps']} steps on {record['model']}")
        return JSONResponse(record)

    async def list_jobs(self, request: Request):
        jobs = self.stored_jobs()
        with jobs.lock:  # not while a job is added
            states = sorted(jobs.jobs.values(), key=lambda s: s.record["created_at"], reverse=True)
        return JSONResponse(page([dict(s.record) for s in states], request, default=20))

    async def get_job(self, request: Request):
        return JSONResponse(dict(self.stored_jobs().job(request.path_params["job_id"]).record))

    async def cancel_job(self, request: Request):
        """POST .../cancel: the run stops at its next step (its last checkpoint kept); answered once it has
        stopped, or after 10 s with the job as it is then (it says "cancelled" when it has)."""
        state = self.stored_jobs().cancel(request.path_params["job_id"])
        for _ in range(40):
            if state.record["status"] not in ACTIVE:
                break
            await asyncio.sleep(0.25)
        return JSONResponse(dict(state.record))

    async def resume_job(self, request: Request):
        record = await asyncio.to_thread(self.stored_jobs().resume, request.path_params["job_id"])
        return JSONResponse(record)

    async def job_events(self, request: Request):
        """GET .../events: newest first, paged by `after` and `limit` (OpenAI's); `stream=true`: every event
        in order as server-sent events, until the job ends ("data: [DONE]")."""
        state = self.stored_jobs().job(request.path_params["job_id"])
        if request.query_params.get("stream") in ("true", "1"):
            return StreamingResponse(
                follow(state), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return JSONResponse(page(state.events[::-1], request, default=20))

    async def job_checkpoints(self, request: Request):
        state = self.stored_jobs().job(request.path_params["job_id"])
        return JSONResponse(page(state.checkpoints[::-1], request, default=10))

    async def job_sample(self, request: Request):
        """GET .../samples/{path}: a sample image the job's events named (nothing else of its folder)."""
        state = self.stored_jobs().job(request.path_params["job_id"])
        path = request.path_params["path"]
        named = {name for e in state.events for name in e["data"].get("samples", [])}
        if path not in named or not path.endswith(".png"):
            raise ApiError(404, f"no sample {path!r} in this job; its events name its samples", "path")
        return FileResponse(Path(state.settings["work_dir"]) / path, media_type="image/png")


def page(items: list[dict], request: Request, *, default: int) -> dict:
    """OpenAI's list page: the items after the one whose id is `after` (in the order given), at most `limit`."""
    after = request.query_params.get("after")
    raw = request.query_params.get("limit") or str(default)
    if not re.fullmatch(r"[0-9]{1,4}", raw) or not 1 <= int(raw) <= 100:
        raise ApiError(400, f"limit must be a whole number from 1 to 100, not {raw!r}", "limit")
    start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), None) if after else 0
    if start is None:
        raise ApiError(404, f"after names {after!r}, which is not in this list", "after")
    chosen = items[start : start + int(raw)]
    return {
        "object": "list",
        "data": chosen,
        "has_more": start + int(raw) < len(items),
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
    }


async def follow(state):
    """A job's events as server-sent events, oldest first, as they come; "[DONE]" once it has ended."""
    sent = 0
    while True:
        ended = state.record["status"] not in ACTIVE  # read before the events: none is missed at the end
        events = state.events[sent:]
        for event in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        sent += len(events)
        if ended and sent == len(state.events):
            yield b"data: [DONE]\n\n"
            return
        await asyncio.sleep(0.1)


def training_routes(worker, options) -> list[Route]:
    """The routes of training over the API, for `api.create_app`."""
    api = TrainingApi(worker, options)
    job = "/v1/fine_tuning/jobs/{job_id:str}"
    return [
        Route("/v1/files", api.create_file, methods=["POST"]),
        Route("/v1/files", api.list_files, methods=["GET"]),
        Route("/v1/files/{file_id:str}", api.get_file, methods=["GET"]),
        Route("/v1/files/{file_id:str}", api.delete_file, methods=["DELETE"]),
        Route("/v1/fine_tuning/jobs", api.create_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs", api.list_jobs, methods=["GET"]),
        Route(job, api.get_job, methods=["GET"]),
        Route(job + "/events", api.job_events, methods=["GET"]),
        Route(job + "/checkpoints", api.job_checkpoints, methods=["GET"]),
        Route(job + "/samples/{path:path}", api.job_sample, methods=["GET"]),
        Route(job + "/cancel", api.cancel_job, methods=["POST"]),
        Route(job + "/resume", api.resume_job, methods=["POST"]),
    ]
