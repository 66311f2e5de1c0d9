"""The Starlette application: `create_app(settings, worker=None)`.

The lifespan opens the database, starts the engine worker (one thread owning the backend; a test
may pass its own `Worker`) and stops both. Routes live in `webapp.routes` (HTTP) and `webapp.ws`
(the websocket). Security that applies to every request is wired here from `webapp.security`: the
access token beyond loopback, only this app's own host names (defeats DNS rebinding), and a strict
Content-Security-Policy on every response.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine import paths
from engine.worker import Worker

from . import openai_api, security, stats_view
from .db import Database
from .engine_host import start_worker
from .routes import routes
from .settings import Settings
from .state import AppState, EngineState
from .views import Views, find_dir
from .ws import websocket_endpoint

log = logging.getLogger(__name__)


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
        middleware=security.middleware(settings),
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.settings = settings
    return app
