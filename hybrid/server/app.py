"""The Starlette app: routes, the API key check, and errors as OpenAI-style JSON (400/401/404/413/503), never a
traceback."""

from __future__ import annotations

import functools
import hmac
import json

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hybrid.server import routes as api
from hybrid.server import routes_misc as misc
from hybrid.server.responses import error_body
from hybrid.server.schemas import BadRequest

PUBLIC = {"/health", "/v1/health", "/"}  # the page holds no data; it asks for the key itself


def guarded(handler, needs_model: bool = True):
    """A route handler whose errors are answered, not raised: BadRequest as its status, anything else as 500
    with one line; 503 while the model loads."""

    @functools.wraps(handler)
    async def route(request: Request):
        state = request.app.state.server
        if needs_model and not state.ready:
            return JSONResponse(error_body("Loading model", "unavailable_error", code=503), status_code=503)
        try:
            return await handler(request)
        except BadRequest as exc:
            state.metrics.add(rejected=1)
            body = error_body(exc.message, exc.kind, exc.param, exc.status)
            body["error"].update(exc.extra)
            return JSONResponse(body, status_code=exc.status)
        except Exception as exc:  # noqa: BLE001 - one line to the client, the server stays up
            return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error", code=500), status_code=500)

    return route


class ApiKey:
    """ASGI middleware: every route but PUBLIC needs `Authorization: Bearer KEY` (or `X-Api-Key: KEY`)."""

    def __init__(self, app, key: str | None, on_reject):
        self.app, self.key, self.on_reject = app, key, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.key is None or scope["path"] in PUBLIC or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if given and hmac.compare_digest(given.encode(), self.key.encode()):
            return await self.app(scope, receive, send)
        self.on_reject()
        msg = "invalid API key" if given else "missing API key: send 'Authorization: Bearer KEY'"
        body = json.dumps(error_body(msg, "authentication_error", code=401)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


async def _http_error(request: Request, exc: HTTPException):
    what = "no such route" if exc.status_code == 404 else exc.detail
    return JSONResponse(error_body(f"{what}: {request.method} {request.url.path}", "invalid_request_error",
                                   code=exc.status_code), status_code=exc.status_code)


def build_app(state) -> Starlette:
    """The ASGI app over a ServerState (the model may still be loading: /health answers 503 until it is)."""
    routes = [
        Route("/v1/chat/completions", guarded(api.chat_completions), methods=["POST"]),
        Route("/chat/completions", guarded(api.chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(api.completions), methods=["POST"]),
        Route("/completions", guarded(api.completions), methods=["POST"]),
        Route("/v1/models", guarded(misc.models), methods=["GET"]),
        Route("/models", guarded(misc.models), methods=["GET"]),
        Route("/health", misc.health, methods=["GET"]),
        Route("/v1/health", misc.health, methods=["GET"]),
        Route("/props", guarded(misc.props), methods=["GET"]),
        Route("/tokenize", guarded(misc.tokenize), methods=["POST"]),
        Route("/detokenize", guarded(misc.detokenize), methods=["POST"]),
        Route("/apply-template", guarded(misc.apply_template), methods=["POST"]),
        Route("/metrics", guarded(misc.metrics, needs_model=False), methods=["GET"]),
        Route("/", misc.page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.server = state
    app.state.page = misc.page_html()
    app.add_middleware(ApiKey, key=state.config.api_key, on_reject=lambda: state.metrics.add(rejected=1))
    return app
