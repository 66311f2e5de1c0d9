"""The model menu offers an engine only where it can run: llama-server entries only when llama-server is
installed (or attached to with --llama-url); the running engine always."""

from __future__ import annotations

import pytest

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


def test_switching_to_a_name_that_is_no_model_keeps_the_loaded_one_loaded() -> None:
    """(walkthrough) `/model bogus` said the right error, but the loaded model was unloaded first and loaded
    again (a new llama-server, its cache lost). The name is checked first: the backend is never touched."""
    import asyncio

    from engine.models import ModelNotFoundError
    from tests.conftest import FakeBackend

    built: list[FakeBackend] = []

    def make() -> FakeBackend:
        built.append(FakeBackend())
        return built[-1]

    worker = Worker(make)
    try:
        worker.call(lambda b: b)  # the first backend is built
        state = EngineState(worker, backend="mlx", model="fake-model")
        told: list[int] = []
        state.listeners.append(lambda: told.append(1))
        with pytest.raises(ModelNotFoundError):
            asyncio.run(state.switch("mlx", "no-such-model-anywhere"))
        assert len(built) == 1 and worker.call(lambda b: b) is built[0] and not built[0].closed
        assert told == [1]  # the windows' model menus are redrawn with the model still loaded
    finally:
        worker.close()
