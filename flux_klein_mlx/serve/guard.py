"""The server's door: the bearer key on /v1/ (result files are capability URLs) and a cap on the body's
size, checked before a request reaches a route (an ASGI wrapper around the app)."""

from __future__ import annotations

import hmac

from ..limits import MAX_TRAINING_UPLOAD_BYTES
from .forms import MB, ApiError


class Guard:
    """ASGI wrapper: bearer key on /v1/ (result files are capability URLs) and a body-size cap."""

    def __init__(self, app, api_key: str | None, body_cap: int):
        self.app = app
        self.api_key = api_key
        self.body_cap = body_cap

    def refusal(self, headers: dict, path: str) -> ApiError | None:
        if self.api_key and path.startswith("/v1/") and not path.startswith("/v1/images/files/"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not auth:
                return ApiError(
                    401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
                )
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                return ApiError(401, "invalid API key", code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        cap = self.cap(path)
        return self.too_large(cap) if length.isdigit() and int(length) > cap else None

    def cap(self, path: str) -> int:
        """A request's body cap: training data (POST /v1/files, a zip) may be larger than images."""
        return MAX_TRAINING_UPLOAD_BYTES + MB if path == "/v1/files" else self.body_cap

    def too_large(self, cap: int) -> ApiError:
        return ApiError(413, f"the request body is larger than {cap / MB:,.0f} MB")

    async def __call__(self, scope, receive, send):
        error = self.refusal(dict(scope["headers"]), scope["path"]) if scope["type"] == "http" else None
        if error is not None:
            return await error.response()(scope, receive, send)
        seen, cap = 0, self.cap(scope.get("path", ""))

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))  # only "http.request" messages have a body
            if seen > cap:
                raise self.too_large(cap)  # raised inside the app: its ApiError handler answers
            return message

        return await self.app(scope, counted_receive, send)
