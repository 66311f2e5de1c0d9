"""Saved project contexts through the llama-server backend (its slot save/restore) with the real
binary and the real default model: save, restart the server, resume, and the next reply reuses the
restored slot and equals the live session's."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.base import CacheMismatchError, Done, EngineError, GenerationRequest, SamplingParams
from engine.sessions import ContextStore

pytestmark = [pytest.mark.llama, pytest.mark.slow]

llama_server = pytest.importorskip("engine.llama_server")
try:
    llama_server.find_llama_server()
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"no llama-server: {exc}", allow_module_level=True)

THREADS = int(os.environ.get("FLASHCODE_TEST_LLAMA_THREADS", "1"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SYSTEM = {"role": "system", "content": "You are a terse assistant. " + "Keep answers short. " * 30}
TURN1 = (SYSTEM, {"role": "user", "content": "What is 2+2?"})


def chat(backend, messages) -> Done:
    done = None
    for ev in backend.stream(GenerationRequest(messages=tuple(messages), sampling=GREEDY), threading.Event()):
        if isinstance(ev, Done):
            done = ev
    assert done is not None and done.error is None, done
    return done


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, model_home: Path, default_model) -> Iterator:
    h = tmp_path_factory.mktemp("llama-ctx-home")
    (h / "models").symlink_to(model_home / "models", target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHCODE_HOME", str(h))
    b = llama_server.LlamaServerBackend(context_length=2048, threads=THREADS)
    b.load(default_model)
    yield b
    b.close()
    mp.undo()


def test_sessions_llama_save_restart_resume_matches_live(llama, tmp_path: Path) -> None:
    store = ContextStore(tmp_path)
    first = chat(llama, TURN1)
    ctx = store.save(llama, "p1", "arithmetic")
    assert ctx.backend == "llama" and ctx.token_count > 150 and ctx.kv_bits == 16
    assert not list((store.root / "p1" / "contexts" / ctx.id).glob("*.bin.json"))  # folded into meta.json
    turn2 = (*TURN1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3+3?"})
    live = chat(llama, turn2)

    llama.close_process()
    llama.ensure_running()  # flashcode restarted: an empty slot
    res = store.resume(llama, "p1", ctx.id)
    assert res.resumed and res.tokens == ctx.token_count
    resumed = chat(llama, turn2)
    assert resumed.text == live.text
    assert resumed.stats.cached_tokens > 150 and resumed.stats.extra.get("restore_reused") is True

    with pytest.raises(EngineError, match="cache-type"):
        store.save(llama, "p1", "quantized", kv_bits=8)


def test_sessions_llama_refuses_an_mlx_context(llama, mlx_backend, tmp_path: Path) -> None:
    store = ContextStore(tmp_path)
    req = GenerationRequest(prompt="Hi", sampling=SamplingParams(temperature=0.0, max_tokens=1))
    list(mlx_backend.stream(req, threading.Event()))
    ctx = store.save(mlx_backend, "p2", "from mlx", kv_bits=4)
    with pytest.raises(CacheMismatchError, match="saved by the mlx engine"):
        store.resume(llama, "p2", ctx.id)
