"""The Starlette application: `create_app(settings, worker=None)`.

The lifespan opens the database, starts the engine worker (one thread owning the backend; a test
may pass its own `Worker`) and stops both. Routes live in `webapp.routes` (HTTP) and `webapp.ws`
(the websocket). Security that applies to every request is here: only this app's own host names
are served (defeats DNS rebinding), and every response carries a strict Content-Security-Policy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import paths
from engine.worker import Worker

from . import openai_api, stats_view
from .db import Database
from .engine_host import start_worker
from .routes import routes
from .settings import Settings
from .state import AppState, EngineState
from .views import Views, find_dir
from .ws import websocket_endpoint

log = logging.getLogger(__name__)

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                headers += [
                    (k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items() if k.encode() not in names
                ]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def allowed_hosts(settings: Settings) -> list[str]:
    return sorted({urlsplit(o).hostname or "" for o in settings.allowed_origins} - {""})


async def http_error(request: Request, exc: Exception) -> PlainTextResponse:
    assert isinstance(exc, HTTPException)
    return PlainTextResponse(f"{exc.status_code}: {exc.detail}", status_code=exc.status_code)


def create_app(settings: Settings | None = None, worker: Worker | None = None) -> Starlette:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = worker is None
        db = Database(paths.database_path(settings.data_dir))
        if db.recovered:
            log.warning("%d reply(s) cut by a previous crash were kept and marked incomplete", db.recovered)
        engine = EngineState(worker or start_worker(settings), options=dict(settings.backend_options))
        await engine.refresh()
        state = AppState(settings=settings, db=db, engine=engine, views=None)  # type: ignore[arg-type]
        state.views = Views(state)
        stats_view.install(state)
        app.state.flashcode = state
        app.state.worker = engine.worker
        try:
            yield
        finally:
            if own:
                engine.worker.close()
            db.close()

    app = Starlette(
        routes=[
            *routes,
            *stats_view.routes,
            *openai_api.routes,
            WebSocketRoute("/ws", websocket_endpoint),
            Mount("/static", StaticFiles(directory=find_dir("static")), name="static"),
        ],  # fmt: skip
        middleware=[
            Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings)),
            Middleware(SecurityHeaders),
        ],  # fmt: skip
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.settings = settings
    return app
