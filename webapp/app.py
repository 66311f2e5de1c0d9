"""The Starlette application: `create_app(settings, worker=None)`.

Placeholder page for the Foundation; the real classic-Mac UI comes with the web app issue.
The lifespan starts the engine worker (one thread owning the backend) and stops it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from engine.worker import Worker

from .engine_host import start_worker
from .settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, worker: Worker | None = None) -> Starlette:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = worker is None
        app.state.worker = worker or start_worker(settings)
        try:
            yield
        finally:
            if own:
                app.state.worker.close()

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse("<!doctype html><title>flashcode</title><h1>flashcode</h1><p>It runs.</p>")

    async def health(request: Request) -> JSONResponse:
        b = request.app.state.worker.backend
        return JSONResponse({"ok": True, "backend": getattr(b, "name", None),
                             "model": b.model.name if b is not None and b.model else None})  # fmt: skip

    app = Starlette(routes=[Route("/", index), Route("/health", health)], lifespan=lifespan)
    app.state.settings = settings
    return app
