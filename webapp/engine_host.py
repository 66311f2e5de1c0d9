"""Choosing and starting the engine for a process: which backend, which model, on which thread."""

from __future__ import annotations

import inspect
import logging
import platform
import sys
from typing import Any

from engine.base import Backend
from engine.models import find_model
from engine.registry import backend_factory
from engine.worker import Worker

from .settings import Settings

log = logging.getLogger(__name__)


def default_backend() -> str:
    """Picked by measurement: on Apple Silicon MLX (Metal) is the fast path; on a Linux CPU
    llama.cpp decodes SmolLM2-135M ~10x faster than MLX's CPU backend (97 vs 9 tok/s here),
    so the llama-server backend is the default there when its binary is available."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mlx"
    try:
        import mlx.core as mx

        if mx.default_device() != mx.cpu:
            return "mlx"
    except Exception:  # noqa: BLE001 - no MLX at all: llama is all there is
        return "llama"
    try:
        from engine.llama_server import find_llama_server

        find_llama_server()
        return "llama"
    except Exception:  # noqa: BLE001
        return "mlx"


def resolve_backend(name: str) -> str:
    return default_backend() if name in ("auto", "", None) else name


def options_for(backend: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The subset of engine options this backend's constructor takes (flags for another engine
    are kept in settings, so they apply again when the user switches back)."""
    from engine.registry import backend_class

    accepted: set[str] = set()
    for klass in backend_class(backend).__mro__:  # a subclass passing **kwargs up takes its parent's too
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters
        accepted |= {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return {k: v for k, v in (options or {}).items() if k in accepted - {"self"}}


def make_loaded_backend(backend: str, model: str | None, options: dict[str, Any] | None = None) -> Backend:
    """Build a backend and load a model into it (call on the thread that will own it)."""
    name = resolve_backend(backend)
    b = backend_factory(name, **options_for(name, options))()
    b.load(find_model(model))
    return b


def start_worker(settings: Settings) -> Worker:
    if not settings.load_model:
        return Worker()
    return Worker(lambda: make_loaded_backend(settings.backend, settings.model, settings.backend_options))
