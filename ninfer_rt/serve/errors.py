"""The one error path: every failure, expected or not, leaves as a JSON error body with its HTTP status and
is counted in /metrics.

Expected failures are `APIError`s (bad input, capacity, a model still loading). Routing failures (404,
405) are Starlette's HTTPException, reshaped here. Anything else is a bug: the `CatchAll` middleware logs
its traceback, counts it and answers 500 with a JSON body, so a client never reads a plain-text page. The
body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``, or on the Anthropic routes
Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_rt.serve.metrics import ServerMetrics
from ninfer_rt.serve.protocol import APIError

log = logging.getLogger("ninfer_rt.serve")

ANTHROPIC_PREFIX = "/v1/messages"

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_body(error: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(path: str, error: APIError) -> dict[str, Any]:
    """The error as the route's protocol shapes it."""
    return anthropic_body(error) if path.startswith(ANTHROPIC_PREFIX) else error.body()


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc, metrics)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        return _respond(request, error, metrics)

    app.add_middleware(CatchAll, metrics=metrics)


def _respond(request: Request, error: APIError, metrics: ServerMetrics) -> JSONResponse:
    metrics.request_done(_endpoint(request.scope), error.status)
    return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=error.headers)


def _endpoint(scope: Scope) -> str:
    """The metrics label: the route's path, and one label for all paths that match no route (a scanner's
    random paths must not grow the label set without bound)."""
    route = scope.get("route")
    return getattr(route, "path", "unmatched")


class CatchAll:
    """Turns an exception nothing else handled into a logged, counted 500 with a JSON body. Once a
    response has started (a stream), the status is sent already: the stream's own handler reports it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 — the whole point: no failure leaves without a JSON body
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            self.metrics.unexpected_errors.inc()
            if started:
                return
            self.metrics.request_done(_endpoint(scope), 500)
            await _send_json(send, 500, error_body(scope.get("path", ""), internal_error(exc)))


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
