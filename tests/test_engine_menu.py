"""The model menu offers an engine only where it can run: llama-server entries only when llama-server is
installed (or attached to with --llama-url); the running engine always."""

from __future__ import annotations

from engine.worker import Worker
from webapp.engine_host import EngineState


def menu(**kw) -> list[str]:
    worker = Worker()
    try:
        return EngineState(worker, **kw).menu_backends()
    finally:
        worker.close()


def test_no_llama_entries_without_llama_server() -> None:
    assert "llama" not in menu(options={"binary": "/nonexistent/llama-server"})
    assert "mlx" in menu(options={"binary": "/nonexistent/llama-server"})


def test_llama_entries_when_attached_or_running() -> None:
    assert "llama" in menu(options={"binary": "/nonexistent/llama-server", "url": "http://127.0.0.1:9"})
    assert menu(backend="llama", options={"binary": "/nonexistent/llama-server"})[0] == "llama"
