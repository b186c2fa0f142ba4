"""The routes of training over the API, in OpenAI's shape (docs/server.md#training-over-the-api): the
files (POST/GET /v1/files, GET/DELETE /v1/files/{id}) hold uploaded training data (serve/training_files.py).

They need the server's --train-dir; without it each answers one line saying so. The API key and the body
cap are the server's (serve/guard.py: a zip may be up to `limits.MAX_TRAINING_UPLOAD_BYTES`).
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import FluxKleinError
from .forms import ApiError
from .training_files import TrainingFiles

FILE_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}  # OpenAI's; expiry not kept


class TrainingApi:
    """The files (and, through them, the jobs) of one server's --train-dir."""

    def __init__(self, worker, options):
        self.worker = worker
        self.options = options
        self.files = TrainingFiles(options.train_dir) if options.train_dir is not None else None

    def stored_files(self) -> TrainingFiles:
        if self.files is None:
            raise ApiError(
                400,
                "this server was started without --train-dir, so it keeps no training data; start it with "
                "--train-dir DIR (and --lora-dir for the LoRAs it trains)",
                code="fine_tuning_off",
            )
        return self.files

    async def create_file(self, request: Request):
        """POST /v1/files: multipart `file` (a zip of training data) and `purpose` "fine-tune"."""
        files = self.stored_files()
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "POST /v1/files takes multipart/form-data: a zip as 'file' and purpose 'fine-tune'")
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=64 * 1024)
        except HTTPException as e:  # python-multipart's refusal of a malformed body
            raise ApiError(400, f"the multipart body is malformed: {e.detail}") from None
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
        files = [] if purpose not in (None, "fine-tune") else await asyncio.to_thread(self.stored_files().all)
        return JSONResponse({"object": "list", "data": files, "has_more": False})

    def file_record(self, file_id: str, param: str | None = None) -> dict:
        """A stored file's object, or 404 naming the id."""
        record = self.stored_files().get(file_id)
        if record is None:
            raise ApiError(
                404,
                f"no file {str(file_id)!r} here; upload one with POST /v1/files (GET /v1/files lists them)",
                param,
                "file_not_found",
            )
        return record

    async def get_file(self, request: Request):
        return JSONResponse(self.file_record(request.path_params["file_id"]))

    async def delete_file(self, request: Request):
        file_id = request.path_params["file_id"]
        self.file_record(file_id)
        deleted = await asyncio.to_thread(self.files.delete, file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": deleted})


def training_routes(worker, options) -> list[Route]:
    """The routes of training over the API, for `api.create_app`."""
    api = TrainingApi(worker, options)
    return [
        Route("/v1/files", api.create_file, methods=["POST"]),
        Route("/v1/files", api.list_files, methods=["GET"]),
        Route("/v1/files/{file_id:str}", api.get_file, methods=["GET"]),
        Route("/v1/files/{file_id:str}", api.delete_file, methods=["DELETE"]),
    ]
