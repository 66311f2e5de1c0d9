"""A base model on llama-server (issue 21): a GGUF without a chat template. llama-server would fall back
to a built-in template (chatml) for it — the reply then showed `<|im_end|> <|im_start|>user…` and looped
to the token limit. The adapter refuses chat for such a model, and the chat window's completion mode
sends the user's text as raw text to continue, end to end: the real default model's GGUF rewritten
without `tokenizer.chat_template`, the real llama-server, the app in-process over the websocket.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.base import Done, EngineError, GenerationRequest, SamplingParams, TextDelta
from engine.worker import Worker
from tests.test_ws import BASE, connect, conversation_id, send, until
from webapp.app import create_app
from webapp.engine_host import make_loaded_backend
from webapp.settings import Settings

pytestmark = [pytest.mark.llama, pytest.mark.slow]

llama_server = pytest.importorskip("engine.llama_server")
try:
    llama_server.find_llama_server()
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"no llama-server: {exc}", allow_module_level=True)

BASE_MODEL = "smollm2-base-gguf"
SOURCE = "smollm2-135m-instruct-q4_1"
OPTIONS = {"threads": 1, "context_length": 2048}


def gguf_without_template(src: Path, dst: Path) -> None:
    """`src` rewritten with every field and tensor but `tokenizer.chat_template` (gguf-py's own copier)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {}, ["tokenizer.chat_template"])


@pytest.fixture(scope="module")
def base_home(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Iterator[Path]:
    """A data directory with the installed models and BASE_MODEL: the default model, GGUF and
    directory alike, without a chat template."""
    home = tmp_path_factory.mktemp("base-llama")
    (home / "models").mkdir()
    (home / "gguf").mkdir()
    for d in (model_home / "models").iterdir():
        if d.is_dir():
            (home / "models" / d.name).symlink_to(d, target_is_directory=True)
    src = model_home / "models" / SOURCE
    meta = json.loads((src / "flashcode.json").read_text())
    base_gguf = home / "gguf" / "SmolLM2-135M-base.gguf"
    gguf_without_template(Path(meta["source_gguf"]), base_gguf)
    base = home / "models" / BASE_MODEL
    base.mkdir()
    for f in src.iterdir():
        if f.name in ("chat_template.jinja", "tokenizer_config.json", "flashcode.json"):
            continue
        (base / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "flashcode.json").write_text(
        json.dumps(meta | {"name": BASE_MODEL, "source_gguf": str(base_gguf)})
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHCODE_HOME", str(home))
    yield home
    mp.undo()


def test_the_base_gguf_has_no_template(base_home: Path) -> None:
    import gguf

    from engine.models import find_model

    info = find_model(BASE_MODEL)
    assert info.gguf_path is not None and not info.has_chat_template
    fields = gguf.GGUFReader(info.gguf_path).fields
    assert "tokenizer.chat_template" not in fields and "tokenizer.ggml.tokens" in fields


def test_llama_refuses_chat_and_continues_raw_text(base_home: Path) -> None:
    b = make_loaded_backend("llama", BASE_MODEL, OPTIONS)
    try:
        with pytest.raises(EngineError, match="no chat template"):
            b.apply_chat_template([{"role": "user", "content": "hi"}])
        chat = GenerationRequest(
            messages=({"role": "user", "content": "hi"},), sampling=SamplingParams(max_tokens=4)
        )
        with pytest.raises(EngineError, match="no chat template"):
            list(b.stream(chat, threading.Event()))
        raw = GenerationRequest(
            prompt="The three primary colors are", sampling=SamplingParams(temperature=0, max_tokens=16)
        )
        events = list(b.stream(raw, threading.Event()))
    finally:
        b.close()
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason in ("stop", "length"), done
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text.strip() and "<|im_" not in text and "assistant" not in text


@pytest.fixture
def llama_app(base_home: Path, tmp_path: Path) -> Iterator[tuple[TestClient, object]]:
    worker = Worker(lambda: make_loaded_backend("llama", BASE_MODEL, OPTIONS))
    (tmp_path / "proj").mkdir(exist_ok=True)  # a project never holds the data directory
    settings = Settings(data_dir=base_home, load_model=False, project_dir=tmp_path / "proj", backend="llama")
    app = create_app(settings, worker=worker)
    with TestClient(app, base_url=BASE) as c:
        yield c, app.state.flashcode
    worker.close()


def test_completion_mode_end_to_end_over_the_websocket(llama_app) -> None:
    client, parts = llama_app
    page = client.get("/").text
    assert 'data-mode="completion"' in page  # the toolbar says completion mode
    assert "base model" in page  # and the picker marks it
    with connect(client) as ws:
        send(ws, type="send", text="The three primary colors are", max_tokens=16, temperature=0)
        frames = until(ws, r'data-state="idle"', limit=400)
        cid = conversation_id(frames)
        rows = parts.db.messages(cid)
        reply = rows[-1]
        assert reply.role == "assistant" and reply.status == "complete", reply
        assert reply.content.strip() and "<|im_" not in reply.content and "chat template" not in reply.content
        assert reply.stats["backend"] == "llama" and reply.stats["model"] == BASE_MODEL
        assert not any("alert-box" in f for f in frames)
        # a second message: completion mode continues that text alone (no chat history, no template)
        send(ws, type="send", text="Once upon a time", conversation_id=cid, max_tokens=8, temperature=0)
        frames = until(ws, r'data-state="idle"', limit=400)
        second = parts.db.messages(cid)[-1]
        assert second.status == "complete" and "<|im_" not in second.content
        assert second.stats["prompt_tokens"] <= 8  # the four words (and BOS), not the conversation
    print(f"\nbase model on llama-server: {reply.content!r} / {second.content!r}")
