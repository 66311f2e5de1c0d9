"""`/v1` loads on demand (issue 17): a request naming an installed model that is not loaded loads it, through
the app's one `EngineState` (the chat's model menu follows), one switch at a time.

Real parts: the default model and a synthetic model imported from a GGUF, the real engines, the real
`flashcode serve` and the official `openai` Python client (list, then ask a model not yet loaded); in
process, the real app with a websocket open.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from engine.models import DEFAULT_MODEL
from engine.placement import import_or_reuse
from tests.servers import serve_cli
from tests.test_ws import BASE, connect, until

pytest_plugins = ["tests.test_browser_trust"]  # home
pytestmark = pytest.mark.slow
SYNTH = "tiny-synth"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil

    from engine.flash.synth import export_gguf, synth_model

    model = synth_model("tiny", tmp_path_factory.mktemp("on-demand") / "tiny", progress=False)
    gguf = model.parent / f"{SYNTH}.gguf"
    export_gguf(model, gguf, progress=False)
    shutil.rmtree(model)
    return gguf


@pytest.fixture
def two_models(home: Path, tiny_gguf: Path) -> Path:
    """`home` (the default model installed) plus SYNTH, imported from its GGUF."""
    info, _ = import_or_reuse(tiny_gguf, home / "models", show_progress=False)
    assert info.name == SYNTH
    return home


def test_openai_client_lists_then_asks_a_model_that_is_not_loaded(two_models: Path) -> None:
    from openai import OpenAI

    with serve_cli(two_models, backend="mlx", timeout=300) as srv:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="not-needed", timeout=600, max_retries=0)
        listed = {m.id: m for m in client.models.list()}
        assert {DEFAULT_MODEL, SYNTH} <= set(listed)
        assert listed[DEFAULT_MODEL].model_extra["loaded"] and not listed[SYNTH].model_extra["loaded"]

        reply = client.chat.completions.create(
            model=SYNTH, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert reply.model == SYNTH and reply.usage.completion_tokens > 0
        loaded = {m.id for m in client.models.list() if m.model_extra["loaded"]}
        assert loaded == {SYNTH}
        page = httpx.get(srv.url, timeout=60).text  # the web app names the model /v1 loaded
        assert re.search(rf'id="menubar-model"[^>]*>{SYNTH}<', page)

        # two clients at once, each naming another model: switches take turns, each gets its own model
        got: dict[str, str] = {}

        def ask(model: str) -> None:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0
            )
            got[model] = r.model

        threads = [threading.Thread(target=ask, args=(m,)) for m in (f"mlx:{DEFAULT_MODEL}", SYNTH)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        assert got == {f"mlx:{DEFAULT_MODEL}": DEFAULT_MODEL, SYNTH: SYNTH}

        missing = httpx.post(f"{srv.base}/v1/chat/completions", timeout=60,
                             json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_v1_request_switches_the_model_and_every_window_follows(
    two_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.worker import Worker
    from webapp.app import create_app
    from webapp.engine_host import make_loaded_backend
    from webapp.settings import Settings

    monkeypatch.setenv("FLASHCODE_HOME", str(two_models))
    worker = Worker(lambda: make_loaded_backend("mlx", DEFAULT_MODEL))
    app = create_app(Settings(data_dir=two_models, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url=BASE, client=("127.0.0.1", 50000)) as c, connect(c) as ws:
            body = {"model": f"mlx:{SYNTH}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == SYNTH and r.json()["system_fingerprint"] == "flashcode-mlx"
            frames = until(ws, rf'id="menubar-model"[^>]*>{SYNTH}<')
            assert re.search(rf'<option value="mlx:{SYNTH}"[^>]* selected', "".join(frames))
            engine = app.state.flashcode.engine
            assert (engine.backend, engine.model) == ("mlx", SYNTH)
    finally:
        worker.close()
