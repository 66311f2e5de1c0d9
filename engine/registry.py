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


# `--hosts HOSTFILE`: the MLX backend with the model split over the hostfile's machines
PIPELINE = "engine.pipeline:PipelineBackend"
PIPELINE_ENGINES = ("mlx", "flash")  # what each rank can run on its own layers


def _target(name: str, options: dict[str, Any] | None = None) -> str:
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if (options or {}).get("hostfile"):
        if name == "llama":  # llama.cpp's own RPC backend (engine/llama_rpc.py)
            return BACKENDS[name]
        if name not in PIPELINE_ENGINES:
            raise BackendUnavailableError(
                f"--hosts runs the mlx or flash backend with its layers split over the hostfile's machines; the "
                f"{name} backend does not run over several machines here yet (docs/distributed.md)"
            )
        return PIPELINE
    return BACKENDS[name]


def backend_class(name: str, options: dict[str, Any] | None = None) -> Any:
    module_name, attr = _target(name, options).split(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} is not available: {exc}") from exc


def backend_factory(name: str, **options: Any) -> Callable[[], Backend]:
    module_name, attr = _target(name, options).split(":")

    def make() -> Backend:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise BackendUnavailableError(f"backend {name!r} is not available: {exc}") from exc
        if (options or {}).get("hostfile") and name in PIPELINE_ENGINES:
            return getattr(module, attr)(engine=name, **options)
        return getattr(module, attr)(**options)

    return make
