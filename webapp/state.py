"""What one running web app holds: settings, the database, the engine worker, the views.

`EngineState` is the web app's view of the worker: which backend and model are loaded and the
context length, read on the worker thread after each (re)load, plus `switch()` to change them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.base import Backend
from engine.worker import Worker

from .db import Database
from .settings import Settings

if TYPE_CHECKING:
    from .views import Views

log = logging.getLogger(__name__)


@dataclass
class EngineState:
    worker: Worker
    backend: str | None = None
    model: str | None = None
    context_length: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # engine flags from the CLI, kept across switches

    def model_and_backend(self) -> tuple[str | None, str | None]:
        return self.model, self.backend

    async def refresh(self) -> None:
        def read(b: Backend) -> tuple[str, str | None, int]:
            return b.name, b.model.name if b.model else None, int(b.context_length or 0)

        try:
            self.backend, self.model, self.context_length = await self.worker.acall(read)
        except Exception:  # noqa: BLE001 - no backend loaded (tests, or a failed switch)
            self.backend, self.model, self.context_length = None, None, 0

    async def switch(self, backend: str, model: str) -> None:
        """Load `model` on `backend`; on failure reload what was there before, then re-raise."""
        from .engine_host import make_loaded_backend

        previous = (self.backend, self.model)
        try:
            await asyncio.to_thread(self.worker.switch, lambda: make_loaded_backend(backend, model, self.options))
        except Exception:
            if previous[0] and previous[1]:
                with_previous = previous
                try:
                    await asyncio.to_thread(self.worker.switch, lambda: make_loaded_backend(*with_previous, self.options))
                except Exception:  # noqa: BLE001
                    log.exception("could not restore %s on %s", previous[1], previous[0])
            raise
        finally:
            await self.refresh()


@dataclass
class AppState:
    settings: Settings
    db: Database
    engine: EngineState
    views: Views
    csrf_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.7, "max_tokens": 1024})
    # called after every finished reply as hook(state, stats, conversation_id=..., message_id=...);
    # later issues (stats) append theirs here instead of editing webapp.ws
    on_reply: list[Callable[..., Any]] = field(default_factory=list)
