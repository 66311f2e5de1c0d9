"""Continue a reply cut at the token limit (issue 21): the same message grows, and the prompt ends with
the reply's text — no "Continue" user turn, no end of turn, no new generation prompt. The real
default model on MLX (in-process, through the websocket) and the real llama-server; FakeBackend only
where the request itself is checked.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.base import Done, GenerationRequest, SamplingParams, TextDelta
from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.test_ws import BASE, connect, conversation_id, send, until
from webapp.app import create_app
from webapp.engine_host import make_loaded_backend
from webapp.settings import Settings

QUESTION = "Name three primary colors and say why."
USER = ({"role": "user", "content": QUESTION},)


@pytest.fixture
def mlx_app(data_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, object]]:
    worker = Worker(lambda: make_loaded_backend("mlx", None))
    (tmp_path / "proj").mkdir(exist_ok=True)  # a project never holds the data directory
    app = create_app(
        Settings(data_dir=data_dir, load_model=False, project_dir=tmp_path / "proj"), worker=worker
    )
    with TestClient(app, base_url=BASE) as c:
        yield c, app.state.flashcode
    worker.close()


@pytest.mark.slow
def test_continue_grows_the_same_reply_on_mlx(mlx_app) -> None:
    client, parts = mlx_app
    db = parts.db
    with connect(client) as ws:
        send(ws, type="send", text=QUESTION, max_tokens=10, temperature=0)
        frames = until(ws, r'data-state="idle"', limit=400)
        cid = conversation_id(frames)
        cut = db.messages(cid)[-1]
        assert cut.status == "complete" and cut.stats["finish_reason"] == "length"
        assert 'data-flag="length"' in frames[-1] or any('data-flag="length"' in f for f in frames)
        assert f'"message_id": {cut.id}' in "".join(frames)  # the button names its reply

        db.set_generation(cid, {"max_tokens": 10, "temperature": 0.0})  # Continue takes the conversation's
        send(ws, type="continue", conversation_id=cid, message_id=cut.id)
        frames = until(ws, r'data-state="idle"', limit=400)
        send(ws, type="send", text=QUESTION, max_tokens=20, temperature=0)  # the same reply, never cut
        uncut = parts.db.messages(conversation_id(until(ws, r'data-state="idle"', limit=400)))[-1]
    rows = db.messages(cid)
    assert [m.role for m in rows] == ["user", "assistant"]  # no "Continue" turn, no second reply
    grown = rows[-1]
    assert (
        grown.id == cut.id and grown.content.startswith(cut.content) and len(grown.content) > len(cut.content)
    )
    assert grown.stats["continued"] == 1 and grown.stats["completion_tokens"] > 0
    # the prompt was the first prompt plus the cut reply (re-tokenized: a token either way at the seam),
    # served from the cache: no end of turn, no user turn, no second generation prompt in between
    first_prompt, first_reply = cut.stats["prompt_tokens"], cut.stats["completion_tokens"]
    assert abs(grown.stats["prompt_tokens"] - (first_prompt + first_reply)) <= 2, (cut.stats, grown.stats)
    assert grown.stats["cached_tokens"] >= first_prompt
    # the page: the reply reopened in place (streaming), then finished as one article with the flag
    live = "".join(frames)
    assert (
        f'id="msg-{cut.id}" data-status="streaming"' in live
        and 'id="messages" hx-swap-oob="beforeend"' not in live
    )
    assert f'id="msg-{cut.id}" data-status="complete"' in frames[-1] or any(
        f'id="msg-{cut.id}" data-status="complete"' in f for f in frames
    )
    assert 'data-stat="continued"' in live
    assert grown.content == uncut.content  # greedy: cut and continued is the reply written in one go
    print(
        f"\ncut: {cut.content!r}\ngrown: {grown.content!r}\nstats: {cut.stats['prompt_tokens']}+{first_reply} -> {grown.stats['prompt_tokens']}"
    )


def test_mlx_template_continues_the_final_message(mlx_backend) -> None:
    partial = "The primary colors are red,"
    messages = (*USER, {"role": "assistant", "content": partial})
    cont = mlx_backend.apply_chat_template(messages, continue_final=True)
    fresh = mlx_backend.apply_chat_template(USER)
    assert cont[: len(fresh)] == fresh  # the template up to the reply, with its generation prompt
    text = mlx_backend.tokenizer.decode(cont[len(fresh) :])
    assert text == partial  # then the reply's text, and nothing after it (no end of turn)
    closed = mlx_backend.apply_chat_template(messages)  # without it: a finished turn and a new prompt
    assert (
        len(closed) > len(cont) and mlx_backend.tokenizer.decode(closed).count("<|im_start|>assistant") == 2
    )


def test_mlx_continued_reply_keeps_the_space_at_the_seam(mlx_backend) -> None:
    """mlx-lm's streaming detokenizer drops a reply's leading space; at a seam it is part of the text."""
    messages = (*USER, {"role": "assistant", "content": "The primary colors are red, blue and"})
    request = GenerationRequest(
        messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=3), continue_final=True
    )
    events = list(mlx_backend.stream(request, threading.Event()))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text.startswith(" ") and text.strip(), text  # "… and yellow", not "… andyellow"
    fresh = list(
        mlx_backend.stream(GenerationRequest(messages=USER, sampling=request.sampling), threading.Event())
    )
    assert not "".join(e.text for e in fresh if isinstance(e, TextDelta)).startswith(
        " "
    )  # a new reply: no space


def test_continue_only_the_last_finished_reply(tmp_path: Path, fake: FakeBackend) -> None:
    worker = Worker(lambda: fake)
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url=BASE) as client, connect(client) as ws:
            send(ws, type="send", text="hello")
            frames = until(ws, r'data-state="idle"')
            cid = conversation_id(frames)
            first = re.search(r'id="msg-(\d+)" data-status="complete"', "".join(frames)).group(1)  # type: ignore[union-attr]
            send(ws, type="send", text="again", conversation_id=cid)
            until(ws, r'data-state="idle"')
            send(ws, type="continue", conversation_id=cid, message_id=int(first))
            assert "only the last reply can be continued" in "".join(until(ws, r"alert-box"))
            fake.enqueue(" and", " more.")
            send(ws, type="continue", conversation_id=cid)
            until(ws, r'data-state="idle"')
            rows = app.state.flashcode.db.messages(cid)
    finally:
        worker.close()
    request = fake.history[-1]
    assert request.continue_final and request.messages[-1] == {"role": "assistant", "content": "Hello world."}
    assert [m["role"] for m in request.messages[1:]] == ["user", "assistant", "user", "assistant"]
    assert len(rows) == 4 and rows[-1].content == "Hello world. and more."


def test_a_stopped_reply_continues_and_an_agent_answer_does_not(tmp_path: Path) -> None:
    """A reply stopped with Esc had no Continue (only one cut at the token limit had; walkthrough): it has one,
    and the same message goes on. An agent's answer cut off says it is one from its start, so it is never
    continued as a chat reply."""
    slow = FakeBackend(delay=0.05)
    slow.enqueue(*[f" w{i}" for i in range(200)])
    worker = Worker(lambda: slow)
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    db = app.state.flashcode.db
    try:
        with TestClient(app, base_url=BASE) as client, connect(client) as ws:
            send(ws, type="send", text="count")
            cid = conversation_id(until(ws, r" w3"))
            send(ws, type="stop")
            frames = "".join(until(ws, r'data-state="idle"'))
            stopped = db.messages(cid)[-1]
            assert stopped.status == "stopped" and stopped.content.startswith(" w0")
            footer = re.search(rf'id="msg-{stopped.id}-stats".*?</footer>', frames, re.S).group(0)  # type: ignore[union-attr]
            assert "Stopped" in footer and "continue-button" in footer
            slow.enqueue(" and", " the rest.")
            send(ws, type="continue", conversation_id=cid, message_id=stopped.id)
            until(ws, r'data-state="idle"')
            rows = db.messages(cid)
            assert len(rows) == 2 and rows[-1].id == stopped.id and rows[-1].status == "complete"
            assert rows[-1].content == stopped.content + " and the rest."
            assert slow.history[-1].continue_final
            # an agent's answer, cut off by a crash mid-stream: marked from the start, not continued
            from webapp.chat.pipeline import ReplyStream

            stream = ReplyStream(db=db, views=None, engine=None, hooks=(), send=lambda *a: None,  # type: ignore[arg-type]
                                 conversation_id=cid, turn="agent")  # fmt: skip
            db.save_partial(stream.message_id, "I listed the files")
            assert db.messages(cid)[-1].stats == {"turn": "agent"}
            send(ws, type="continue", conversation_id=cid)
            assert "answer cannot be continued" in "".join(until(ws, r"alert-box"))
    finally:
        worker.close()


# --------------------------------------------------------------------------- llama-server
@pytest.mark.llama
@pytest.mark.slow
def test_llama_continue_final_streams_only_the_new_text(data_dir: Path) -> None:
    llama_server = pytest.importorskip("engine.llama_server")
    try:
        llama_server.find_llama_server()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no llama-server: {exc}")
    from engine.models import find_model

    def run(request: GenerationRequest) -> tuple[str, Done]:
        text, done = "", None
        for ev in b.stream(request, threading.Event()):
            if isinstance(ev, TextDelta):
                text += ev.text
            elif isinstance(ev, Done):
                done = ev
        assert done is not None and done.finish_reason in ("stop", "length"), done
        return text, done

    b = llama_server.LlamaServerBackend(context_length=2048, threads=1)
    b.load(find_model(None))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        first, done1 = run(GenerationRequest(messages=USER, sampling=greedy))
        assert done1.finish_reason == "length"
        messages = (*USER, {"role": "assistant", "content": first})
        more, done2 = run(GenerationRequest(messages=messages, sampling=greedy, continue_final=True))
        whole, _ = run(
            GenerationRequest(messages=USER, sampling=SamplingParams(temperature=0.0, max_tokens=20))
        )
    finally:
        b.close()
    assert more and not more.startswith(first)  # only the new text comes back
    assert abs(done2.stats.prompt_tokens - (done1.stats.prompt_tokens + done1.stats.completion_tokens)) <= 2
    assert done2.stats.cached_tokens >= done1.stats.prompt_tokens  # the same prefix: no new turn
    assert "<|im_" not in more
    assert first + more == whole  # greedy: cut and continued is the reply written in one go
    print(f"\nfirst {first!r} + more {more!r}; uncut {whole!r}; equal: {first + more == whole}")
