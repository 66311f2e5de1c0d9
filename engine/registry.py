"""Backends by name, imported lazily so that `import engine` pulls in no MLX or HTTP client."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from .base import Backend, BackendUnavailableError

# name -> "module:factory"; later issues add theirs here
BACKENDS: dict[str, str] = {
    "mlx": "engine.mlx_backend:MLXBackend",
    "llama": "engine.llama_server:LlamaServerBackend",
    "flash": "engine.flash.backend:FlashBackend",
}


def available_backends() -> list[str]:
    out = []
    for name, target in BACKENDS.items():
        module = target.split(":")[0]
        if importlib.util.find_spec(module) is not None:
            out.append(name)
    return out


def backend_class(name: str) -> Any:
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    module_name, attr = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} is not available: {exc}") from exc


def backend_factory(name: str, **options: Any) -> Callable[[], Backend]:
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    module_name, attr = BACKENDS[name].split(":")

    def make() -> Backend:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise BackendUnavailableError(f"backend {name!r} is not available: {exc}") from exc
        return getattr(module, attr)(**options)

    return make
