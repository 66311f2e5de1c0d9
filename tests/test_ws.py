"""The websocket protocol in-process: TestClient against the app with a scripted FakeBackend.

Covers every client message type (send, stop, regenerate, model, answer), the bad ones (not JSON,
not an object, unknown type, missing fields, binary, oversized), a foreign Origin, token batching
and escaping. No model, no browser: runs in a couple of seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from engine.base import Done, GenerationStats, TextDelta
from engine.worker import Worker
from tests.conftest import FRAME_WAIT, FakeBackend, next_frame
from webapp.agent import web as agent_web
from webapp.app import create_app
from webapp.chat import socket as socket_module
from webapp.chat.protocol import MAX_MESSAGE_BYTES
from webapp.db import Database
from webapp.settings import Settings

ORIGIN = "http://127.0.0.1:8000"
BASE = "http://127.0.0.1:8000"


@pytest.fixture
def client(tmp_path: Path, fake: FakeBackend) -> Iterator[TestClient]:
    worker = Worker(lambda: fake)
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    with TestClient(app, base_url=BASE) as c:
        yield c
    worker.close()


@contextlib.contextmanager
def served(backend: FakeBackend, tmp_path: Path) -> Iterator[TestClient]:
    """The app on a worker that owns `backend`, behind a test client."""
    worker = Worker(lambda: backend)
    try:
        with TestClient(
            create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker), base_url=BASE
        ) as c:
            yield c
    finally:
        worker.close()


@contextlib.contextmanager
def writing(tmp_path: Path, *replies: list[str]) -> Iterator[tuple[TestClient, Database, FakeBackend]]:
    """The app, its database and its engine, which writes `replies` one after the other a token every 10 ms
    (long enough to go elsewhere, close a window or press Stop mid-reply)."""
    slow = FakeBackend(delay=0.01)
    for reply in replies:
        slow.enqueue(*reply)
    with served(slow, tmp_path) as c:
        yield c, c.app.state.flashcode.db, slow


def words(prefix: str, n: int) -> list[str]:
    """A reply's tokens " p0", " p1", ...: a test waits for one of them by name."""
    return [f" {prefix}{i}" for i in range(n)]


def connect(client: TestClient, origin: str = ORIGIN):
    return client.websocket_connect("ws://127.0.0.1:8000/ws", headers={"origin": origin})


def until(ws, pattern: str, limit: int = 200, seconds: float = FRAME_WAIT) -> list[str]:
    """Frames received until one matches `pattern` (inclusive), each within `seconds`."""
    frames: list[str] = []
    for _ in range(limit):
        try:
            frames.append(next_frame(ws, seconds))
        except AssertionError as e:
            raise AssertionError(f"{e}, waiting for {pattern!r}; the last frames: {frames[-3:]}") from None
        if re.search(pattern, frames[-1]):
            return frames
    raise AssertionError(f"no frame matched {pattern!r}; got {frames[-3:]}")


def send(ws, **fields) -> None:
    ws.send_text(json.dumps(fields | {"HEADERS": {"HX-Request": "true"}}))


def test_a_frame_that_never_comes_fails_the_wait_instead_of_hanging_it() -> None:
    """`until` waits for each frame at most `FRAME_WAIT` seconds: a missing frame is a failure that says what
    was awaited, not a test that hangs until pytest-timeout ends the whole file."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    async def quiet(websocket) -> None:  # answers one message, then never again
        await websocket.accept()
        await websocket.send_text(await websocket.receive_text())
        await websocket.receive_text()

    with TestClient(Starlette(routes=[WebSocketRoute("/ws", quiet)])) as client:
        with client.websocket_connect("/ws") as ws:
            ws.send_text("hello")
            assert next_frame(ws, 5) == "hello"
            started = time.monotonic()
            with pytest.raises(
                AssertionError, match="no websocket frame came within 0.5 s, waiting for 'never'"
            ):
                until(ws, "never", seconds=0.5)
            assert time.monotonic() - started < 5
            ws.send_text("bye")


def csrf(client: TestClient) -> str:
    """The page's CSRF token (what htmx sends with every POST)."""
    return re.search(r'"X-CSRF-Token": "([^"]+)"', client.get("/").text).group(1)


def settled(db, conversation_id: str, what: str, timeout: float = 5.0):
    """The conversation's last message once it is no longer `streaming` (`what`: said if it never stops)."""
    deadline = time.monotonic() + timeout
    while (last := db.messages(conversation_id)[-1]).status == "streaming":
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return last


def conversation_id(frames: list[str]) -> str:
    m = re.search(r'id="conversation-id" value="([0-9a-f]+)"', "".join(frames))
    assert m, "the first reply names its conversation"
    return m.group(1)


def test_ws_send_streams_reply_and_persists(client: TestClient, fake: FakeBackend) -> None:
    fake.enqueue("Hi", " there", "!")
    with connect(client) as ws:
        send(ws, type="send", text="hello", conversation_id="")
        frames = until(ws, r'data-state="idle"')
    joined = "".join(frames)
    cid = conversation_id(frames)
    assert 'hx-swap-oob="beforeend"' in joined and "Hi" in joined
    assert re.search(r'<article hx-swap-oob="true" class="msg msg-assistant status-complete"', joined)
    assert 'data-stat="decode_tps"' in joined and re.search(r"\d+ \+ 3 tokens", joined)
    system, user = fake.history[0].messages  # chat mode: the model is told it has no tools
    assert system["role"] == "system" and "no tools" in system["content"]
    assert user == {"role": "user", "content": "hello"}
    page = client.get(f"/c/{cid}").text
    assert "Hi there!" in page and "hello" in page


def test_ws_second_message_sends_history(client: TestClient, fake: FakeBackend) -> None:
    with connect(client) as ws:
        send(ws, type="send", text="one")
        cid = conversation_id(until(ws, r'data-state="idle"'))
        send(ws, type="send", text="two", conversation_id=cid)
        until(ws, r'data-state="idle"')
    assert [m["content"] for m in fake.history[1].messages if m["role"] != "system"] == [
        "one",
        "Hello world.",
        "two",
    ]


def test_ws_stop_cancels_quickly(tmp_path: Path) -> None:
    slow = FakeBackend(delay=0.05)
    slow.enqueue(*words("t", 400))
    with served(slow, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="long please")
            until(ws, r"t2")
            t0 = time.monotonic()
            send(ws, type="stop")
            frames = until(ws, r'data-state="idle"')
            elapsed = time.monotonic() - t0
            assert "status-stopped" in "".join(frames)
            cid = conversation_id(frames) if 'id="conversation-id"' in "".join(frames) else None
        assert elapsed < 2.0, f"stop took {elapsed * 1000:.0f} ms"  # the reply would run 20 s
        body = c.get("/").text
        assert cid is None or cid in body


def test_ws_regenerate_replaces_last_reply(client: TestClient, fake: FakeBackend) -> None:
    fake.enqueue("first")
    fake.enqueue("second")
    with connect(client) as ws:
        send(ws, type="send", text="q")
        frames = until(ws, r'data-state="idle"')
        cid = conversation_id(frames)
        old = re.search(r'id="msg-(\d+)" data-status="streaming"', "".join(frames)).group(1)
        send(ws, type="regenerate", conversation_id=cid)
        frames = until(ws, r'data-state="idle"')
    assert f'<div id="msg-{old}" hx-swap-oob="delete">' in "".join(frames)
    assert [m["content"] for m in fake.history[1].messages if m["role"] != "system"] == ["q"]
    data = client.get(f"/c/{cid}/export.json").json()
    assert [m["content"] for m in data["messages"]] == ["q", "second"]


def test_ws_regenerate_keeps_the_old_reply_until_the_new_one_is_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regenerate deleted the reply before the new one existed: an engine failing (or Stop pressed at once, or
    a crash) lost it for good. It stays stored while the new one streams, and a new one that ends without
    text leaves it in place, shown again; one with text replaces it."""
    slow = FakeBackend(delay=0.05)
    slow.enqueue("the", " first", " answer")
    with served(slow, tmp_path) as c:
        db = c.app.state.flashcode.db
        with connect(c) as ws:
            send(ws, type="send", text="q")
            cid = conversation_id(until(ws, r'data-state="idle"'))
            old = db.messages(cid)[-1]
            assert old.content == "the first answer"
            # the engine fails before any text
            real = slow.stream

            def failing(request, cancel):
                slow.history.append(request)
                raise RuntimeError("the model went away")
                yield  # a generator, as the real one

            monkeypatch.setattr(slow, "stream", failing)
            send(ws, type="regenerate", conversation_id=cid)
            frames = "".join(until(ws, r'role="alert"'))
            assert "the model went away" in frames
            assert [(m.id, m.content) for m in db.messages(cid)] == [(old.id - 1, "q"), (old.id, old.content)]
            # the page showed the old reply again after the new empty one
            assert frames.rfind(f'id="msg-{old.id}"') > frames.rfind('hx-swap-oob="delete"')
            assert [m["content"] for m in slow.history[-1].messages if m["role"] != "system"] == ["q"]
            # Stop before the first token: the old reply stays too
            monkeypatch.setattr(slow, "stream", real)
            slow.enqueue(*words("t", 100))
            slow.delay = 0.3
            send(ws, type="regenerate", conversation_id=cid)
            until(ws, r'data-status="streaming"')
            send(ws, type="stop")
            until(ws, r'data-state="idle"')
            assert [m.content for m in db.messages(cid)] == ["q", old.content]
            # a new reply streaming: the old one is still stored; once the new one is, it replaces the old
            slow.delay = 0.05
            slow.enqueue(*words("n", 40))
            send(ws, type="regenerate", conversation_id=cid)
            until(ws, r"n3")
            assert old.id in [m.id for m in db.messages(cid)]
            until(ws, r'data-state="idle"')
            # an engine error midway: the old reply is the better one (review)
            latest = db.messages(cid)[-1]

            def fails_midway(request, cancel):
                slow.history.append(request)
                yield TextDelta("half an", (1,))
                yield Done(GenerationStats(), "error", "half an", error="the engine ran out of memory")

            monkeypatch.setattr(slow, "stream", fails_midway)
            send(ws, type="regenerate", conversation_id=cid)
            frames = "".join(until(ws, r'role="alert"'))  # after the controls went back to idle
            assert "ran out of memory" in frames and 'data-state="idle"' in frames
            assert [(m.id, m.content) for m in db.messages(cid)][1:] == [(latest.id, latest.content)]
        texts = [m.content for m in db.messages(cid)]
        assert texts[0] == "q" and texts[1].startswith(" n0") and len(texts) == 2


def test_a_crash_during_regenerate_leaves_one_reply(tmp_path: Path) -> None:
    """A crash while Regenerate wrote left the old reply and the new one's part (two replies in a row, which
    templates that need turns to alternate refuse): the next start settles it as the Regenerate would have."""
    from webapp.db import Database

    db = Database(tmp_path / "f.db")
    conv = db.create_conversation("c")
    for part in ("with text", ""):
        db.add_message(conv.id, "user", "q")
        old = db.add_message(conv.id, "assistant", "the old reply")
        new = db.add_message(conv.id, "assistant", "", status="streaming", stats={"replaces": old.id})
        if part:
            db.save_partial(new.id, part)
    db.close()
    db = Database(tmp_path / "f.db", recover=True)
    rows = [(m.role, m.content, m.status) for m in db.messages(conv.id)]
    assert rows == [
        ("user", "q", "complete"),
        ("assistant", "with text", "incomplete"),  # the new one had text: it replaced the old
        ("user", "q", "complete"),
        ("assistant", "the old reply", "complete"),  # it had none: the old one stays
    ]
    kept = [(e.type, e.data["text"], e.after_message) for e in db.events(conv.id)]
    assert kept == [("reply_replaced", "the old reply", db.messages(conv.id)[0].id)]  # folded, not lost


def test_ws_a_replaced_reply_stays_folded_in_the_transcript_and_out_of_the_context(
    tmp_path: Path,
) -> None:
    """(walkthrough) Regenerate, then Stop after a few words: the whole first answer was gone for good, the stub
    kept. A reply Regenerate replaces stays in the transcript, folded above the new one, live and after a
    reload, and in the Markdown export; the model's context holds only the new one."""
    slow = FakeBackend(delay=0.02)
    slow.enqueue("the <b>whole</b> first answer")
    with served(slow, tmp_path) as c:
        db = c.app.state.flashcode.db
        with connect(c) as ws:
            send(ws, type="send", text="q")
            cid = conversation_id(until(ws, r'data-state="idle"'))
            old = db.messages(cid)[-1]
            slow.enqueue(*words("s", 200))
            send(ws, type="regenerate", conversation_id=cid)
            live = "".join(until(ws, r"s3"))
            send(ws, type="stop")
            until(ws, r'data-state="idle"')
        assert f'id="replaced-{old.id}"' in live and "Earlier reply" in live  # shown as the new one starts
        assert [m.content[:3] for m in db.messages(cid)] == ["q", " s0"]
        fragments = json.loads(
            re.search(r'class="transcript-replay">(.*?)</script>', c.get(f"/c/{cid}").text, re.S).group(1)
        )
        kinds = [
            "user" if "msg-user" in f else "replaced" if f'id="replaced-{old.id}"' in f else "reply"
            for f in fragments
        ]
        assert kinds == ["user", "replaced", "reply"], (
            fragments
        )  # folded between the question and the new reply
        assert "<b>whole</b>" not in fragments[1] and "whole" in fragments[1]  # the model's text, escaped
        slow.enqueue("next")
        with connect(c) as ws:
            send(ws, type="send", text="more", conversation_id=cid)
            until(ws, r'data-state="idle"')
        context = [m["content"] for m in slow.history[-1].messages if m["role"] != "system"]
        assert not any("first answer" in t for t in context), context
        md = c.get(f"/c/{cid}/export.md").text
        assert "Earlier reply, replaced by Regenerate" in md and "first answer" in md
        assert "### Agent" not in md  # a chat conversation: no agent heading over it (review)
        exported = c.get(f"/c/{cid}/export.json").text  # and back: an import draws it as it was
        token = csrf(c)
        r = c.post(
            "/conversations/import", files={"file": ("c.json", exported)}, headers={"X-CSRF-Token": token}
        )
        again = c.get(f"/c/{r.json()['id']}").text
        assert "Earlier reply" in again and r.json()["skipped"] == [], r.json()


def test_ws_regenerate_without_reply_is_an_error(client: TestClient) -> None:
    with connect(client) as ws:
        send(ws, type="regenerate", conversation_id="nope")
        assert 'role="alert"' in ws.receive_text()


def test_ws_nothing_is_written_into_a_conversation_in_the_trash(
    client: TestClient, fake: FakeBackend
) -> None:
    """Send, regenerate and continue each refuse a trashed conversation with the same words (a red-team pass
    made a `continue` write a reply into one; regenerate said it "does not exist")."""
    fake.enqueue("first")
    db = client.app.state.flashcode.db
    with connect(client) as ws:
        send(ws, type="send", text="q")
        cid = conversation_id(until(ws, r'data-state="idle"'))
        stored = [(m.id, m.content) for m in db.messages(cid)]
        db.trash_conversation(cid)
        for msg in ({"type": "send", "text": "more"}, {"type": "regenerate"}, {"type": "continue"}):
            send(ws, conversation_id=cid, **msg)
            assert "in the Trash: put it back" in until(ws, r'role="alert"')[-1], msg
    assert [(m.id, m.content) for m in db.messages(cid)] == stored and len(fake.history) == 1


def test_ws_escapes_model_output(client: TestClient, fake: FakeBackend) -> None:
    fake.enqueue("<script>alert(1)</script>", " <img src=x onerror=alert(2)>")
    with connect(client) as ws:
        send(ws, type="send", text="<b>bold?</b>")
        frames = until(ws, r'data-state="idle"')
    joined = "".join(frames)
    assert "<script>" not in joined and "<img" not in joined and "<b>" not in joined
    assert "&lt;script&gt;" in joined and "&lt;img src=x onerror=alert(2)&gt;" in joined
    cid = conversation_id(frames)
    page = client.get(f"/c/{cid}").text
    assert "<script>alert" not in page and "<img src=x" not in page


def test_ws_switch_model_to_unknown_model_keeps_engine(client: TestClient) -> None:
    with connect(client) as ws:
        send(ws, type="model", choice="mlx:no-such-model")
        frames = until(ws, r"could not load")
        frames += until(ws, r'data-state="idle"')
    assert "no-such-model" in "".join(frames)


def test_ws_a_refused_switch_while_writing_puts_the_controls_back(tmp_path: Path) -> None:
    """Picking another model (or mode) while a reply is written is refused; the picker and the mode switch
    are redrawn with what still answers, so they never show a model that is not the one loaded."""
    slow = FakeBackend(delay=0.05)
    slow.enqueue(*words("t", 100))
    with served(slow, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="one two three")
            cid = conversation_id(until(ws, r"t1"))
            send(ws, type="model", choice="mlx:another-model", conversation_id=cid)
            picked = "".join(until(ws, r'id="model-picker-box"[^>]*hx-swap-oob'))
            send(ws, type="mode", mode="agent", conversation_id=cid)
            moded = "".join(until(ws, r'id="mode-switch"'))
            send(ws, type="stop")
            until(ws, r'data-state="idle"')
        assert c.app.state.flashcode.engine.model_and_backend()[0] == "fake-model"
        assert c.app.state.flashcode.db.get_conversation(cid).mode == "chat"
    assert "press Stop first" in picked and "another-model" not in picked
    assert "press Stop first" in moded and '<option value="chat" selected>' in moded


def test_ws_a_new_conversation_starts_in_the_mode_last_chosen(client: TestClient) -> None:
    """Agent stays Agent after Ctrl+N (a new conversation had silently gone back to Chat): the new page, and a
    conversation sent from it, take the mode last picked."""
    assert '<option value="chat" selected>' in client.get("/").text
    with connect(client) as ws:
        send(ws, type="mode", mode="agent")
        until(ws, r'id="mode-switch"')
    page = client.get("/").text
    assert '<option value="agent" selected>' in page and '<option value="chat" selected>' not in page
    with connect(client) as ws:
        send(ws, type="send", text="/help", mode="agent")
        cid = conversation_id(until(ws, r'data-state="idle"'))
    assert client.app.state.flashcode.db.get_conversation(cid).mode == "agent"
    with connect(client) as ws:
        send(ws, type="mode", mode="chat", conversation_id=cid)
        until(ws, r'id="mode-switch"')
    assert '<option value="chat" selected>' in client.get("/").text
    with connect(client) as ws:  # typed, /agent chooses it as the picker does
        send(ws, type="send", text="/agent", conversation_id=cid, mode="chat")
        until(ws, r'data-state="idle"')
    assert '<option value="agent" selected>' in client.get("/").text


def test_ws_a_model_that_cannot_load_says_so_in_the_transcript(client: TestClient) -> None:
    """/model NAME that fails: the transcript keeps why (it kept only "Switching to …"); a name that is no
    installed model is said alone, never "Switching to" it first (walkthrough)."""
    with connect(client) as ws:
        send(ws, type="send", text="/model no-such-model", mode="agent")
        frames = "".join(until(ws, r'data-state="idle"'))
        cid = conversation_id([frames])
    assert "Switching to" not in frames and "Could not load no-such-model" in frames
    assert "Could not load no-such-model" in client.get(f"/c/{cid}").text  # kept: a reload shows it too


def test_ws_answer_without_dialog_is_an_error(client: TestClient) -> None:
    with connect(client) as ws:
        send(ws, type="answer", dialog_id="d1", choice="deny")
        assert "no open dialog" in ws.receive_text()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"type": "dance"}', "unknown message type"),
        ('{"text": "no type"}', "unknown message type"),
        ('{"type": "send", "text": "   "}', "type a message first"),
        ('{"type": "send", "text": 5}', "must be a string"),
        ('{"type": "regenerate"}', "conversation_id is missing"),
        ('{"type": "answer", "dialog_id": "x"}', "choice is missing"),
        ("9" * 100000, "not valid JSON|too long"),
        (
            '{"type": "send", "text": "' + "y" * 40000 + '"}',
            r"too long \(40,000 characters, at most 32,000\): shorten it",
        ),
    ],
)
def test_ws_bad_message_gets_error_frame_and_lives_on(client: TestClient, raw: str, expected: str) -> None:
    with connect(client) as ws:
        ws.send_text(raw)
        frame = ws.receive_text()
        assert re.search(expected, frame) and 'role="alert"' in frame
        send(ws, type="send", text="still alive?")
        until(ws, r'data-state="idle"')


def test_ws_oversized_and_binary_frames(client: TestClient) -> None:
    with connect(client) as ws:
        ws.send_text(json.dumps({"type": "send", "text": "x" * (MAX_MESSAGE_BYTES + 10)}))
        assert (
            "too long (at most 32,000 characters; this one is over 64 KiB): shorten it" in ws.receive_text()
        )
        ws.send_bytes(b"\x00\x01")
        assert "text frames" in ws.receive_text()
        send(ws, type="send", text="ok")
        until(ws, r'data-state="idle"')


def test_ws_busy_while_generating(tmp_path: Path) -> None:
    slow = FakeBackend(delay=0.02)
    slow.enqueue(*["x"] * 30)
    with served(slow, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="a")
            until(ws, r'data-state="generating"')
            send(ws, type="send", text="b")
            assert "press Stop first" in "".join(until(ws, r"press Stop first"))
            until(ws, r'data-state="idle"')


def test_ws_batches_fast_tokens(tmp_path: Path) -> None:
    fast = FakeBackend(delay=0.002)
    fast.enqueue(*[f"{i} " for i in range(300)])
    with served(fast, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="go")
            frames = until(ws, r'data-state="idle"')
    batches = [f for f in frames if '-tail" hx-swap-oob="innerHTML"' in f]
    assert 1 < len(batches) < 100, f"{len(batches)} batches for 300 tokens"
    text = re.sub(r"<[^>]+>", "", batches[-1])  # one paragraph: the last frame's tail holds it all
    assert text.strip() == "".join(f"{i} " for i in range(300)).strip()


@pytest.mark.parametrize("origin", ["http://evil.example", "http://127.0.0.1:9999", "null", ""])
def test_ws_rejects_foreign_origin(client: TestClient, origin: str) -> None:
    with pytest.raises(WebSocketDisconnect) as info, connect(client, origin=origin) as ws:
        ws.receive_text()
    assert info.value.code == 1008


def test_ws_accepts_localhost_origin(client: TestClient) -> None:
    with connect(client, origin="http://localhost:8000") as ws:
        send(ws, type="stop")  # nothing to stop: no frame, no error
        send(ws, type="send", text="hi")
        until(ws, r'data-state="idle"')


def test_ws_reply_hooks_get_the_stats(client: TestClient) -> None:
    seen = []
    client.app.state.flashcode.on_reply.append(lambda stats, **kw: seen.append((stats, kw)))
    client.app.state.flashcode.on_reply.append(lambda *a, **kw: 1 / 0)  # a broken hook changes nothing
    with connect(client) as ws:
        send(ws, type="send", text="hi")
        until(ws, r'data-state="idle"')
    ((stats, kw),) = seen
    assert stats["completion_tokens"] == 3 and stats["finish_reason"] == "stop" and kw["message_id"] > 0


def test_ws_stopped_reply_still_fills_the_context_gauge(tmp_path: Path) -> None:
    slow = FakeBackend(delay=0.05)
    slow.enqueue(*words("t", 100))
    with served(slow, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="one two three")
            until(ws, r"t1")
            send(ws, type="stop")
            frames = until(ws, r'id="context-gauge"')
        assert re.search(r'gauge-text">\d+ / 2048', frames[-1])


def test_ws_stopped_reply_gets_the_engine_numbers_when_it_stops(tmp_path: Path) -> None:
    """Stop answers with the text so far at once; the engine's own Done comes after (at its next token) and
    its numbers (prompt size, memory, engine extras) then fill the stopped reply's footer and its stored
    stats. The text and its token count stay the stop's."""

    class Measuring(FakeBackend):
        def _stats(self, prompt: int, n: int, start: float) -> GenerationStats:
            return dataclasses.replace(
                super()._stats(prompt, n, start),
                peak_rss_bytes=900_000_000,
                extra={"bytes_per_token": 12_300_000, "hit_rate": 0.5, "memory_budget": 2e9,
                       "peak_rss_bytes": 900_000_000},
            )  # fmt: skip

    slow = Measuring(delay=0.05)
    slow.enqueue(*words("t", 100))
    with served(slow, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="one two three")
            first = until(ws, r"t1")
            send(ws, type="stop")
            frames = until(ws, r'data-state="idle"')
            stopped = re.search(r'id="msg-(\d+)" data-status="stopped"', "".join(frames))
            assert stopped and "MB/token" not in "".join(frames)  # the stop's own answer: no engine numbers
            later = until(ws, r'data-stat="flash"')
        assert f'id="msg-{stopped[1]}"' in later[-1]
        assert re.search(r"12\.3 MB/token · 50% hits", later[-1])
        assert re.search(r"Peak 0\.90 / 2\.00 GB", later[-1])
        cid = conversation_id(first + frames)
        reply = c.get(f"/c/{cid}/export.json").json()["messages"][-1]
        rows = c.app.state.flashcode.db.conn.execute(
            "SELECT prompt_tokens, completion_tokens, peak_rss_bytes, flash_hit_rate FROM stats_replies "
            "WHERE message_id = ?",
            (int(stopped[1]),),
        ).fetchall()
    assert reply["status"] == "stopped" and reply["content"].startswith(" t0 t1")
    stats = reply["stats"]
    assert stats["extra"]["bytes_per_token"] == 12_300_000 and stats["prompt_tokens"] > 0
    assert stats["completion_tokens"] == len(reply["content"].split())  # the stop's count, not the engine's
    assert stats["peak_rss_bytes"] == 900_000_000
    # Stats counts the same reply once, with the prompt the engine counted after the stop
    assert [tuple(r) for r in rows] == [
        (stats["prompt_tokens"], stats["completion_tokens"], 900_000_000, 0.5)
    ]


def test_a_conversation_written_with_another_model_says_so(tmp_path: Path) -> None:
    """Reopening a conversation another model wrote: the window names that model and the one answering now,
    offers to load it (or says it is gone); a model switch takes the notice away."""
    fake = FakeBackend()
    fake.enqueue(" hi")
    with served(fake, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="hello")
            cid = conversation_id(until(ws, r'data-state="idle"'))
        db = c.app.state.flashcode.db
        assert 'id="written-with" class="written-with" role="status" hidden' in c.get(f"/c/{cid}").text
        db.conn.execute(
            "UPDATE conversations SET model = ?, backend = 'mlx' WHERE id = ?", ("<b>old</b>-7b", cid)
        )
        db.conn.commit()
        page = c.get(f"/c/{cid}").text
        notice = re.search(r'<div id="written-with".*?</div>', page, re.S)[0]  # type: ignore[index]
        assert "hidden" not in notice.split(">")[0]
        assert "written with <b>&lt;b&gt;old&lt;/b&gt;-7b</b>; <b>fake-model</b> answers now" in notice
        assert "is not installed any more" in notice and "<button" not in notice
        fragment = c.get(f"/c/{cid}", headers={"hx-request": "true", "hx-target": "chat-window"}).text
        assert "written with <b>&lt;b&gt;old" in fragment  # opened from the list too
        with connect(c) as ws:
            c.app.state.flashcode.engine.listeners[0]()  # the engine changed (the menu, /v1)
            assert re.search(
                r'id="written-with"[^>]*hidden[^>]*hx-swap-oob="true"', "".join(until(ws, "written-with"))
            )
        # one that held only a command's answer (/help): no model wrote it, so it names none (walkthrough)
        with connect(c) as ws:
            send(ws, type="send", text="/help")
            only = conversation_id(until(ws, r'data-state="idle"'))
        db.conn.execute("UPDATE conversations SET model = 'old-7b', backend = 'mlx' WHERE id = ?", (only,))
        db.conn.commit()
        assert 'id="written-with" class="written-with" role="status" hidden' in c.get(f"/c/{only}").text


def test_ws_conversation_deleted_while_its_reply_streams(tmp_path: Path, caplog) -> None:
    """Deleted in another window mid-reply: the reply ends quietly (it had raised IndexError when storing
    its end: a traceback in the log, no idle state), and the socket goes on to the next message."""
    slow = FakeBackend(delay=0.02)
    slow.enqueue(*words("t", 60))
    slow.enqueue("next")
    with served(slow, tmp_path) as c:
        csrf = c.app.state.flashcode.csrf_token
        with connect(c) as ws:
            send(ws, type="send", text="long please")
            frames = until(ws, r"t2")
            cid = conversation_id(frames)
            for step in ("delete", "delete-now"):  # to the Trash, then deleted for good from it
                r = c.post(f"/c/{cid}/{step}", headers={"x-csrf-token": csrf, "origin": ORIGIN})
                assert r.status_code == 200
            frames = until(ws, r'data-state="idle"')
            assert "internal error" not in "".join(frames)
            send(ws, type="send", text="again")
            frames = until(ws, r'data-state="idle"')
            assert "next" in "".join(frames)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_ws_conversation_moved_to_the_trash_while_its_reply_streams_keeps_the_reply(tmp_path: Path) -> None:
    """Moved to the Trash mid-reply: the reply is stored all the same, and Put Back shows it."""
    slow = FakeBackend(delay=0.02)
    slow.enqueue(*words("t", 30))
    with served(slow, tmp_path) as c:
        h = {"x-csrf-token": c.app.state.flashcode.csrf_token, "origin": ORIGIN}
        with connect(c) as ws:
            send(ws, type="send", text="long please")
            cid = conversation_id(until(ws, r"t2"))
            assert c.post(f"/c/{cid}/delete", headers=h).status_code == 200
            until(ws, r'data-state="idle"')
            send(ws, type="send", text="more", conversation_id=cid)
            assert "is in the Trash" in "".join(until(ws, r'role="alert"'))
        assert c.post(f"/c/{cid}/restore", headers=h).status_code == 200
        db = c.app.state.flashcode.db
        reply = db.messages(cid)[-1]
        assert reply.role == "assistant" and reply.content.endswith("t29") and reply.status == "complete"


def test_ws_a_stale_tab_is_shown_what_another_added_before_its_message_goes(tmp_path: Path) -> None:
    """Two tabs on one conversation: tab 2 never saw tab 1's last turn. Its message (sent with the newest
    message id it shows) is not sent: the missed messages are drawn, an alert says why, nothing is stored;
    sent again with what it now shows, it goes."""
    fake = FakeBackend()
    fake.enqueue("first answer").enqueue("second answer").enqueue("third answer")
    with served(fake, tmp_path) as c:
        db = c.app.state.flashcode.db
        with connect(c) as one:
            send(one, type="send", text="hello")
            frames = until(one, r'data-state="idle"')
            cid = conversation_id(frames)
            seen = max(int(x) for x in re.findall(r'id="seen-message" value="(\d+)"', "".join(frames)))
            assert seen == db.messages(cid)[-1].id  # the page's newest, kept up to date as messages arrive
            with connect(c) as two:  # opened now: it shows up to `seen`
                send(one, type="send", text="from tab one", conversation_id=cid, seen=seen)
                until(one, r'data-state="idle"')
                stored = len(db.messages(cid))
                send(two, type="send", text="from tab two", conversation_id=cid, seen=seen)
                frame = until(two, r'role="alert"')[-1]  # one frame: what was missed, and why nothing went
                assert "changed in another window: 2 new messages now shown" in frame
                assert "from tab one" in frame and "second answer" in frame
                assert len(db.messages(cid)) == stored  # nothing sent
                # Regenerate from the stale tab would have rewritten tab one's newer reply: refused the same way
                send(two, type="regenerate", conversation_id=cid, seen=seen)
                assert "changed in another window" in until(two, r'role="alert"')[-1]
                assert len(db.messages(cid)) == stored and db.messages(cid)[-1].content == "second answer"
                newest = db.messages(cid)[-1].id
                send(two, type="send", text="from tab two", conversation_id=cid, seen=newest)
                frames = "".join(until(two, r'data-state="idle"'))
                assert "third answer" in frames and db.messages(cid)[-2].content == "from tab two"


def test_ws_other_windows_are_told_when_a_conversation_changes_and_wait_while_it_is_written(
    tmp_path: Path,
) -> None:
    """Tab one sends: every other tab is told (the page shows the conversation again, static/trust.js), when
    the message is sent and when the reply ends; while it is written, tab two cannot send, regenerate or
    continue in that conversation (nothing stored), and it can once the reply has ended."""
    slow = FakeBackend(delay=0.02)
    slow.enqueue("first answer").enqueue(*["x"] * 40).enqueue("third answer")
    with served(slow, tmp_path) as c:
        db = c.app.state.flashcode.db
        with connect(c) as one, connect(c) as two:
            send(one, type="send", text="hello")
            frames = until(one, r'data-state="idle"')
            cid = conversation_id(frames)
            assert 'id="conversation-changed"' not in "".join(frames)  # a window is not told of its own turn
            told = until(two, r'id="conversation-changed"')[-1]
            assert f'data-conversation="{cid}"' in told and 'hx-swap-oob="true"' in told
            until(two, r'id="conversation-changed"')  # and when the reply ended
            seen = db.messages(cid)[-1].id
            send(one, type="send", text="a long one", conversation_id=cid, seen=seen)
            until(one, r'data-state="generating"')
            assert f'data-conversation="{cid}"' in until(two, r'id="conversation-changed"')[-1]
            stored = len(db.messages(cid))
            newest = max(m.id for m in db.messages(cid))
            for msg in (
                {"type": "send", "text": "from tab two", "seen": newest},
                {"type": "regenerate", "seen": newest},
                {"type": "continue"},
            ):
                send(two, conversation_id=cid, **msg)
                alert = until(two, r'role="alert"')[-1]
                assert "being written in this conversation in another window" in alert
            send(two, type="mode", mode="agent", conversation_id=cid)  # nor switch its mode mid-turn
            assert "being written in this conversation in another window" in until(two, r'role="alert"')[-1]
            assert db.get_conversation(cid).mode == "chat"
            assert len(db.messages(cid)) == stored
            until(one, r'data-state="idle"')
            assert f'data-conversation="{cid}"' in until(two, r'id="conversation-changed"')[-1]
            newest = db.messages(cid)[-1].id
            send(two, type="send", text="from tab two", conversation_id=cid, seen=newest)
            assert "third answer" in "".join(until(two, r'data-state="idle"'))
            assert db.messages(cid)[-2].content == "from tab two"
            # tab one is told in turn
            assert f'data-conversation="{cid}"' in until(one, r'id="conversation-changed"')[-1]


def test_ws_storage_failures_and_broken_characters_are_said_in_words(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk, a database another program holds, a lone surrogate in the text: each alert says what to
    do (they read "internal error: OperationalError: database or disk is full")."""
    import sqlite3

    db = client.app.state.flashcode.db
    with connect(client) as ws:
        ws.send_text('{"type": "send", "text": "half \\ud800 a pair"}')
        assert "broken character" in until(ws, r'role="alert"')[-1]
        for message, said in (
            ("database or disk is full", "the disk is full. Free some space there"),
            ("database is locked", "held busy by another program"),
        ):

            def failing(*a, _m=message, **k):
                raise sqlite3.OperationalError(_m)

            monkeypatch.setattr(db, "add_message", failing)
            send(ws, type="send", text="hello")
            alert = until(ws, r'role="alert"')[-1]
            assert said in alert and str(db.path) in alert and "internal error" not in alert


def test_ws_a_reply_the_database_refuses_midway_streams_on_and_says_regenerate(
    client: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk filled while a reply streamed: the reply's save so far failed and ended it, and the alert said
    "send again (what you typed is still in the box)" — but the message was stored and the box cleared, so
    sending again stored it twice (red-team). A failed save so far is logged and the reply goes on; a reply
    that cannot be stored at its end says to press Regenerate."""
    import sqlite3

    from webapp.chat import pipeline

    db = client.app.state.flashcode.db
    monkeypatch.setattr(pipeline, "SAVE_PARTIAL_SECONDS", 0.0)  # every flush saves what streamed so far

    tries: list[int] = []

    def full(*a, **k):
        tries.append(1)
        raise sqlite3.OperationalError("database or disk is full")

    def partial_full(*a, **k):  # once: a locked database waits out SQLite's busy timeout on the event loop
        full()

    monkeypatch.setattr(db, "save_partial", partial_full)
    fake.enqueue("a reply that streams on " * 20)
    with connect(client) as ws:
        send(ws, type="send", text="hello")
        frames = "".join(until(ws, r'data-state="idle"'))
        cid = conversation_id([frames])
        assert 'role="alert"' not in frames
        assert db.messages(cid)[-1].status == "complete" and "streams on" in db.messages(cid)[-1].content
        assert len(tries) == 1, tries
        monkeypatch.setattr(db, "finish_message", full)
        fake.enqueue("this one cannot be stored")
        send(ws, type="send", text="again", conversation_id=cid)
        alert = until(ws, r'role="alert"')[-1]
        assert "press Regenerate (your message was saved" in alert and "still in the box" not in alert
        # the reply row itself could not be written: Regenerate writes one (it said "nothing to regenerate")
        monkeypatch.undo()
        kept = [m for m in db.messages(cid) if m.role == "assistant" and not m.content]
        for m in kept:
            db.delete_message(m.id)
        assert db.messages(cid)[-1].role == "user"
        fake.enqueue("written at last")
        send(ws, type="regenerate", conversation_id=cid)
        assert "nothing to regenerate" not in until(ws, r'data-state="idle"|nothing to regenerate')[-1]
        texts = [m.content for m in db.messages(cid)]
        assert texts[-1] == "written at last" and texts.count("again") == 1


def test_sync_sends_only_what_another_window_changed(client: TestClient, fake: FakeBackend) -> None:
    """GET /c/ID/sync: the transcript, newest message id, controls, gauge, title, mode and list, out of band;
    never the composer (what the other window has typed) or the window itself."""
    fake.enqueue("an answer")
    with connect(client) as ws:
        send(ws, type="send", text="hello")
        cid = conversation_id(until(ws, r'data-state="idle"'))
    body = client.get(f"/c/{cid}/sync").text
    for part in ('id="transcript" hx-swap-oob="true"', 'id="seen-message"', 'id="status"', 'id="context-gauge"',
                 'id="chat-title"', 'id="mode-picker"', 'id="conversation-list"', "an answer"):  # fmt: skip
        assert part in body, part
    assert 'id="prompt"' not in body and 'id="chat-window"' not in body
    assert "deleted or moved to the Trash" in client.get("/c/000000000000/sync").text


def test_ws_a_slash_command_first_leaves_the_title_to_the_first_real_message(
    client: TestClient, fake: FakeBackend
) -> None:
    """`/help` or `/stats` first made the conversation's title "/help": the title comes from the first
    message the model is sent; one renamed meanwhile keeps its name."""
    db = client.app.state.flashcode.db
    fake.enqueue("sure")
    with connect(client) as ws:
        send(ws, type="send", text="/help")
        frames = until(ws, r'data-state="idle"')
        cid = conversation_id(frames)
        assert db.get_conversation(cid).title == "Untitled"
        assert 'data-title="/help"' not in "".join(frames)
        send(ws, type="send", text="/stats", conversation_id=cid)
        until(ws, r'data-state="idle"')
        assert db.get_conversation(cid).title == "Untitled"
        send(ws, type="send", text="fix the flaky test\nin tests/", conversation_id=cid)
        joined = "".join(until(ws, r'data-state="idle"'))
        assert db.get_conversation(cid).title == "fix the flaky test"
        assert 'id="chat-title" data-title="fix the flaky test" hx-swap-oob="true"' in joined  # shown now
        assert re.search(
            r'<ul id="conversation-list"[^>]*hx-swap-oob="true"[^>]*>.*fix the flaky test', joined, re.S
        )
        send(ws, type="send", text="and another thing", conversation_id=cid)
        until(ws, r'data-state="idle"')
        assert db.get_conversation(cid).title == "fix the flaky test"  # the first real message only

        send(ws, type="send", text="/model nothing-such")
        other = conversation_id(until(ws, r'data-state="idle"'))
        assert other != cid and db.get_conversation(other).title == "Untitled"
        db.rename_conversation(other, "My plan")
        send(ws, type="send", text="now a question", conversation_id=other)
        until(ws, r'data-state="idle"')
        assert db.get_conversation(other).title == "My plan"  # a name given by Rename stays

    with connect(client) as ws:
        send(ws, type="send", text="a real first message")
        third = conversation_id(until(ws, r'data-state="idle"'))
    assert db.get_conversation(third).title == "a real first message"  # as before


def test_ws_the_frame_that_names_a_command_turns_conversation_also_says_it_is_busy(
    client: TestClient, fake: FakeBackend
) -> None:
    """A slash command's first frame gave the page its new conversation's id with the status still Ready; the
    Busy status came in a frame of its own. A page (or a fast user) acting between the two sent its next
    message as if the command had been answered: Enter did nothing once Busy came (a browser test waited
    10 minutes for a reply that way), or the send was refused as "changed in another window". The frame that
    names the conversation also shows the command being worked on (a model reply's too)."""

    def busy_before_named(frames: list[str]) -> bool:  # in one frame: the page applies it at once
        named = next(f for f in frames if 'id="conversation-id"' in f)
        return re.search(r'<div id="status"[^>]*data-state="generating"', named) is not None

    with connect(client) as ws:
        send(ws, type="send", text="/stats")
        frames = until(ws, r'data-state="idle"')
    assert busy_before_named(frames), frames[:3]
    assert 'data-state="idle"' in frames[-1]  # and the turn's last frame is still its status line
    fake.enqueue("sure")
    with connect(client) as ws:
        send(ws, type="send", text="hello")
        frames = until(ws, r'data-state="idle"')
    assert busy_before_named(frames), frames[:3]


def test_about_says_the_version(client: TestClient) -> None:
    """About flashcode named no version (walkthrough): the one `engine.__version__` says (saved contexts
    record it too)."""
    from engine import __version__

    assert f'<p class="about-version" data-field="version">Version {__version__}</p>' in client.get("/").text


def test_ws_a_reply_written_while_the_page_shows_another_conversation_stays_out_of_it(tmp_path: Path) -> None:
    """(review) A window writing a reply in A that shows B got A's fragments, its message and tokens landing in
    B's transcript, and at the end A's controls: Regenerate on, acting on B (an agent's answer rewritten as a
    chat reply). Now B gets the page-wide frames only and its own controls; Regenerate of an agent's answer is
    refused by the server too; and back in A the reply is drawn as written so far."""
    with writing(tmp_path, ["an answer in B"]) as (c, db, slow):
        with connect(c) as ws:
            send(ws, type="send", text="in B")
            b = conversation_id(until(ws, r'data-state="idle"'))
            last = db.messages(b)[-1]
            db.finish_message(last.id, last.content, "complete", dict(last.stats) | {"turn": "agent"})
            slow.enqueue(*words("a", 300))
            send(ws, type="send", text="in A", conversation_id="")
            frames = until(ws, r" a5")
            a = conversation_id(frames)
            reply = db.messages(a)[-1].id
            send(ws, type="showing", conversation_id=b)
            elsewhere = "".join(until(ws, r"another conversation of this window"))
            send(ws, type="showing", conversation_id=a)
            back = "".join(until(ws, rf'id="msg-{reply}"|data-state="idle"'))  # redrawn as written so far
            assert f'id="msg-{reply}"' in back and " a5" in back
            send(ws, type="showing", conversation_id=b)
            rest = (
                "".join(until(ws, r'data-state="idle"', limit=2000))
                if 'data-state="idle"' not in back
                else ""
            )
            send(ws, type="regenerate", conversation_id=b)
            refused = "".join(until(ws, r'role="alert"|data-state="idle"'))
        assert f"msg-{reply}" not in elsewhere.split("another conversation")[-1]
        assert f"msg-{reply}" not in rest and " a299" not in rest  # nothing of A's reply landed in B
        assert (
            'id="regenerate-button" ws-send' in rest
            and "disabled" in rest.split('id="regenerate-button"')[1][:400]
        )
        assert "is not redone" in refused
        assert db.messages(a)[-1].content.endswith(" a299") and db.messages(b)[-1].content == "an answer in B"


def test_ws_a_reply_goes_on_when_its_window_closes_and_the_next_window_shows_it_live(tmp_path: Path) -> None:
    """A reload or a closed tab stopped the reply being written (the socket was its owner). Now a chat reply
    goes on to its end and is saved; a page drawn meanwhile says a reply is being written; the next window
    that shows the conversation gets it as written so far, then live, with Stop; a second message there is
    refused until it ends; and Stop there stops it."""
    with writing(tmp_path, words("t", 150)) as (c, db, slow):
        with connect(c) as ws:
            send(ws, type="send", text="a long one")
            frames = until(ws, r" t5")
            cid = conversation_id(frames)
        reply = db.messages(cid)[-1].id
        assert "being written in another window" in c.get(f"/c/{cid}").text  # the reload's page
        with connect(c) as ws:
            send(ws, type="showing", conversation_id=cid)
            shown = "".join(until(ws, r'id="status"'))
            assert f'id="msg-{reply}"' in shown and " t5" in shown  # as written so far
            assert re.search(r'id="stop-button"[^>]*>', shown) and "disabled" not in re.search(
                r'id="stop-button"[^>]*>', shown
            ).group(0)
            live = "".join(until(ws, r" t40"))
            send(ws, type="send", text="another", conversation_id=cid)
            refused = "".join(until(ws, r'role="alert"'))
            assert "press Stop first" in refused and "still in the box" in refused
            rest = "".join(until(ws, r'data-state="idle"', limit=2000))
        assert " t41" in live + refused + rest
        assert db.messages(cid)[-1].status == "complete" and db.messages(cid)[-1].content.endswith(" t149")
        assert [m.role for m in db.messages(cid)] == ["user", "assistant"]  # "another" was not sent

        slow.enqueue(*words("u", 300))
        with connect(c) as ws:
            send(ws, type="send", text="and another", conversation_id=cid)
            until(ws, r" u5")
        with connect(c) as first, connect(c) as ws:  # nobody shows it for a while: it goes on all the same
            time.sleep(0.3)
            send(first, type="showing", conversation_id=cid)
            until(first, r'id="status"')
            send(ws, type="showing", conversation_id=cid)  # a second window showing it waits (another window)
            send(ws, type="stop")  # not its reply: nothing happens
            time.sleep(0.1)
            assert db.messages(cid)[-1].status == "streaming"
            first.close()  # the window showing it closed: the waiting one shows it now
            until(ws, r'id="stop-button"(?![^>]*disabled)')
            send(ws, type="stop")
            until(ws, r'data-state="idle"', limit=2000)
        last = db.messages(cid)[-1]
        assert last.status == "stopped" and " u20" in last.content and not last.content.endswith(" u299")


def test_ws_a_reply_shown_again_while_its_prompt_is_read_says_so(tmp_path: Path) -> None:
    """A window that comes back to a reply (its own, or one left writing by a closed window) while the engine
    still reads the prompt: the status line said "Writing…"; it says "Reading your prompt…" with the progress."""
    from engine.base import PrefillProgress

    slow = FakeBackend(delay=0.05)
    slow.replies.append(
        [PrefillProgress(100, 1000), *[PrefillProgress(100 * i, 1000) for i in range(2, 40)], "done"]
    )
    slow.replies.append(list(slow.replies[0]))
    with served(slow, tmp_path) as c:
        with connect(c) as ws:  # its own reply: to another conversation and back
            send(ws, type="send", text="a long prompt")
            cid = conversation_id(until(ws, r"Reading your prompt"))
            send(ws, type="showing", conversation_id="")
            until(ws, r"another conversation of this window")
            send(ws, type="showing", conversation_id=cid)
            back = "".join(until(ws, r'id="status"'))
            assert "Reading your prompt…" in back and re.search(r"\d+ / 1,?000", back), back[-600:]
            until(ws, r'data-state="idle"', limit=2000)
        with connect(c) as ws:
            send(ws, type="send", text="another long prompt", conversation_id=cid)
            until(ws, r"Reading your prompt")
        with connect(c) as ws:
            send(ws, type="showing", conversation_id=cid)
            shown = "".join(until(ws, r'id="status"'))
            assert "Reading your prompt…" in shown and re.search(r"\d+ / 1,?000", shown), shown[-600:]
            until(ws, r'data-state="idle"', limit=2000)


def test_ws_a_reply_left_writing_stops_when_its_conversation_goes_to_the_trash(tmp_path: Path) -> None:
    """(review) Move to Trash of the conversation a window writes in reloads that window: the reply went on in
    the Trash, where no window could show it or stop it. It stops (and is kept, as any stopped reply); so does
    one a closed window left writing when its conversation is moved to the Trash from another."""
    with writing(tmp_path, words("t", 400), words("u", 400)) as (c, db, slow):
        token = csrf(c)
        with connect(c) as ws:
            send(ws, type="send", text="a long one")
            cid = conversation_id(until(ws, r" t5"))
            c.post(f"/c/{cid}/delete", headers={"X-CSRF-Token": token, "HX-Current-URL": f"{BASE}/c/{cid}"})
        last = settled(db, cid, "the reply in the Trash went on")
        assert last.status == "stopped" and not last.content.endswith(" t399")
        c.post(f"/c/{cid}/restore", headers={"X-CSRF-Token": token})
        with connect(c) as ws:
            send(ws, type="send", text="again", conversation_id=cid)
            until(ws, r" u5")
        c.post(f"/c/{cid}/delete", headers={"X-CSRF-Token": token})  # from another window, after it closed
        assert not settled(db, cid, "the reply left writing went on in the Trash").content.endswith(" u399")


def test_ws_a_left_reply_is_handed_on_to_a_window_that_shows_it(tmp_path: Path) -> None:
    """(review, walkthrough) Tab A writes, tab B shows the conversation ("another window"); A closes: B stayed
    frozen, Stop greyed, though no other window was left. B shows the reply now, with Stop. The same when the
    window that showed a left reply goes to another conversation."""
    with writing(tmp_path, words("a", 400)) as (c, db, slow):
        with connect(c) as b:
            with connect(c) as a:
                send(a, type="send", text="in A")
                cid = conversation_id(until(a, r" a5"))
                send(b, type="showing", conversation_id=cid)
                time.sleep(0.1)
            until(b, r'id="stop-button"(?![^>]*disabled)')  # A closed: B shows it
            with connect(c) as other:
                send(other, type="showing", conversation_id=cid)  # waits while B shows it
                send(b, type="showing", conversation_id="")  # B goes elsewhere: the other one shows it
                until(other, r'id="stop-button"(?![^>]*disabled)')
                send(other, type="stop")
                until(other, r'data-state="idle"', limit=3000)
        assert db.messages(cid)[-1].status == "stopped"


def test_ws_a_window_writing_its_own_reply_takes_a_left_one_when_its_own_ends(tmp_path: Path) -> None:
    """(review) A window writing in B shows A, where a closed window's reply waits for the engine: it took
    nothing, and once its own reply ended it showed A idle, the left reply running with no Stop anywhere."""
    with writing(tmp_path, words("b", 100), words("a", 400)) as (c, db, slow):
        with connect(c) as ws:
            send(ws, type="send", text="in B")
            b = conversation_id(until(ws, r" b5"))
            with connect(c) as other:  # a reply in A, queued behind B's, left by its window
                send(other, type="send", text="in A")
                a = conversation_id(until(other, r'id="conversation-id" value="[0-9a-f]+"'))
            send(ws, type="showing", conversation_id=a)
            until(ws, r"another conversation of this window")
            until(ws, r" a5", limit=3000)  # B's reply ended: A's is shown here
            send(ws, type="stop")
            until(ws, r'data-state="idle"', limit=3000)
        assert b != a and db.messages(b)[-1].content.endswith(" b99")
        assert db.messages(a)[-1].status == "stopped" and not db.messages(a)[-1].content.endswith(" a399")


def test_ws_a_reply_left_writing_is_saved_when_the_server_stops(tmp_path: Path) -> None:
    """(review) The server stopping while a closed window's reply is written: it closed the database first, so
    the reply stayed `streaming` with nothing saved. It is stopped and saved with its text first."""
    with writing(tmp_path, words("t", 400)) as (c, db, slow):
        with connect(c) as ws:
            send(ws, type="send", text="a long one")
            cid = conversation_id(until(ws, r" t20"))
    db = Database(tmp_path / "flashcode.db")
    last = db.messages(cid)[-1]
    assert last.status == "stopped" and " t20" in last.content
    db.close()


def test_ws_a_reply_waiting_for_the_engine_says_so_and_stop_holds(tmp_path: Path) -> None:
    """(walkthrough) A message sent in Y while another window's reply in X holds the engine: the page said
    Ready, Stop greyed, and no sign of a reply until X's ended. It says it waits for the engine, and a Stop
    pressed then stops the reply as soon as it is submitted."""
    with writing(tmp_path, words("x", 150), words("y", 150)) as (c, db, slow):
        with connect(c) as wx, connect(c) as wy:
            send(wx, type="send", text="in X")
            until(wx, r" x5")
            send(wy, type="send", text="in Y")
            waiting = "".join(until(wy, r"Waiting for the engine"))
            y = conversation_id([waiting])
            assert re.search(r'id="stop-button"(?![^>]*disabled)', waiting)
            send(wy, type="stop")
            until(wy, r'data-state="idle"', limit=3000)
            until(wx, r'data-state="idle"', limit=3000)
        assert db.messages(y)[-1].role == "assistant" and db.messages(y)[-1].status == "stopped"
        assert " y100" not in db.messages(y)[-1].content


def test_ws_a_reply_that_waited_goes_to_its_own_conversation_not_the_one_shown(tmp_path: Path) -> None:
    """(review) A reply waiting for the engine while its window went to another conversation: its opening (the
    empty reply, "Writing…", the list selecting it) landed in the conversation shown. It stays out of it."""
    import asyncio
    import gc

    from webapp.chat.socket import ChatContext

    with writing(tmp_path, ["z"], words("y", 20)) as (c, db, slow):
        ctx = next(o for o in gc.get_objects() if isinstance(o, ChatContext) and o.db is db)

        async def slow_before(_cid: str) -> None:  # a resume that takes a while
            await asyncio.sleep(1.0)

        ctx.before_reply = slow_before
        with connect(c) as ws:
            send(ws, type="send", text="in Z")
            z = conversation_id(until(ws, r'data-state="idle"'))
            send(ws, type="send", text="in Y")
            y = conversation_id(until(ws, r"Waiting for the engine"))
            send(ws, type="showing", conversation_id=z)
            until(ws, r"another conversation of this window")
            rest = "".join(until(ws, r'data-state="idle"', limit=3000))
        reply = db.messages(y)[-1]
        assert reply.role == "assistant" and f'id="msg-{reply.id}"' not in rest
        assert "Writing…</" not in rest  # the status line said it writes in another conversation


def test_ws_a_window_closing_as_its_own_reply_ends_takes_no_left_reply(tmp_path: Path) -> None:
    """(review) A window closing while its own reply ended took a reply a closed window had left in the
    conversation it showed: that reply then belonged to a dead window, and no later one could show or stop it."""
    with writing(tmp_path, words("y", 300), words("x", 300)) as (c, db, slow):
        token = csrf(c)
        with connect(c) as b:
            send(b, type="send", text="in Y")
            y = conversation_id(until(b, r" y5"))
            with connect(c) as a:
                send(a, type="send", text="in X")
                x = conversation_id(until(a, r"Waiting for the engine"))
                send(b, type="showing", conversation_id=x)  # b writes its own: takes nothing
                until(b, r"another conversation of this window")
            time.sleep(0.1)
            c.post(
                f"/c/{y}/delete", headers={"X-CSRF-Token": token}
            )  # y to the Trash: b's reply stops as b closes
        time.sleep(0.5)
        with connect(c) as w:
            send(w, type="showing", conversation_id=x)
            until(w, r'id="stop-button"(?![^>]*disabled)', limit=3000)
            send(w, type="stop")
            until(w, r'data-state="idle"', limit=3000)
        assert db.messages(x)[-1].status == "stopped"


def test_a_window_going_elsewhere_just_after_its_reply_ended_gets_that_conversation_as_it_is(
    tmp_path: Path,
) -> None:
    """(review) A reply's last page-wide frames (its idle status: Regenerate on) can reach the page after it went
    to another conversation over HTTP, before its "showing": that conversation's controls were then A's. A window
    whose reply ended in the last seconds is now sent the conversation it shows as it is, its frames marked."""
    fake = FakeBackend()
    fake.enqueue("first reply")
    with served(fake, tmp_path) as c:
        with connect(c) as ws:
            send(ws, type="send", text="in B")
            b = conversation_id(until(ws, r'data-state="idle"'))
            fake.enqueue("second reply")
            send(ws, type="send", text="in A", conversation_id="")
            until(ws, r'data-state="idle"')
            send(ws, type="showing", conversation_id=b)
            send(ws, type="nonsense")  # answered with an alert: what came before it is what "showing" sent
            frames = until(ws, r'role="alert"')
    at = next(i for i, f in enumerate(frames) if f.startswith(f"<!--for:{b}-->"))  # (A's last frames first)
    synced = "".join(frames[at:])
    assert 'id="transcript"' in synced and "first reply" in synced and "second reply" not in synced
    assert 'data-state="idle"' in synced


def test_ws_commands_that_ask_no_work_stay_out_of_the_models_context(
    client: TestClient, fake: FakeBackend
) -> None:
    """(walkthrough) `/model mlx:smol`, `/help`, `/stats` were sent to the model as the user's words: it answered
    "Name a fruit." with "Orange:smol". A command that asks for work (`/shell`, `/search`) and its answer stay: the
    next turn may be about them."""
    db = client.app.state.flashcode.db
    with connect(client) as ws:
        send(ws, type="send", text="one")
        cid = conversation_id(until(ws, r'data-state="idle"'))
        for command in ("/model mlx:nosuch-model", "/help", "/stats", "/cost"):  # (one that loads nothing)
            send(ws, type="send", text=command, conversation_id=cid)
            until(ws, r'data-state="idle"')
        send(ws, type="send", text="Name a fruit.", conversation_id=cid)
        until(ws, r'data-state="idle"')
    stored = [m.content for m in db.messages(cid) if m.role == "user"]
    assert "/model mlx:nosuch-model" in stored and "/help" in stored  # the transcript keeps them
    sent = [m["content"] for m in fake.history[-1].messages if m["role"] != "system"]
    assert sent == ["one", "Hello world.", "Name a fruit."], sent


def test_ws_model_command_takes_an_engine_before_the_name(client: TestClient, monkeypatch) -> None:
    """(walkthrough) `/model mlx:smol` said "model 'mlx:smol' not found": `BACKEND:NAME`, as the API takes it,
    picks the engine too; a name with another colon is a name."""
    engine = client.app.state.flashcode.engine
    asked: list[tuple[str, str]] = []

    async def switch(backend: str, model: str) -> None:
        asked.append((backend, model))

    monkeypatch.setattr(engine, "switch", switch)
    monkeypatch.setattr(agent_web, "find_model", lambda name: None)  # every name here is taken as installed
    with connect(client) as ws:
        for text in (
            "/model mlx:smol",
            "/model flash: qwen",
            "/model smol",
            "/model odd:name",
            "/model llama:",
        ):
            send(ws, type="send", text=text, mode="agent")
            until(ws, r'data-state="idle"')
    here = engine.backend or "mlx"
    assert asked == [("mlx", "smol"), ("flash", "qwen"), (here, "smol"), (here, "odd:name"), (here, "llama:")]


def test_an_engine_without_live_numbers_has_no_meter_row(client: TestClient) -> None:
    """Only the flash engine has a meter (its idle row: test_flash_ui.py); for the others it takes no room."""
    assert re.search(r'<div id="engine-meter" class="engine-meter" hidden>\s*</div>', client.get("/").text)


def test_every_window_redraws_the_engine_meter_when_the_engine_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flash meter's row stays between replies (idle): when the engine changes, from any window or a /v1
    request, every window draws it again (the other windows kept the old engine's row, its budget)."""

    class Metered(FakeBackend):  # an engine with live numbers, as flash has
        def live_stats(self) -> dict:
            return {"bytes_per_s": 5e8, "rss_bytes": 3e8, "memory_budget": 6e8, "peak_rss_bytes": 4e8,
                    "hosts": [{"host": "10.0.0.2", "layers": [0, 4], "bytes_per_s": 8.5e8, "rss_bytes": 2e8}]}  # fmt: skip

    with served(Metered(), tmp_path) as c:
        page = c.get("/").text
        with connect(c) as ws:  # a reply's row is live at once, not "idle" until the meter's first tick
            monkeypatch.setattr(socket_module, "METER_SECONDS", 60.0)
            send(ws, type="send", text="hi")
            frames = until(ws, r'data-state="idle"')
            live = [f for f in frames if 'id="engine-meter"' in f and "Disk idle" not in f]
            assert live and "Disk 0.50 GB/s" in live[0] and "– MB/token" in live[0]
            assert "Disk idle" in [f for f in frames if 'id="engine-meter"' in f][-1]  # and idle once done
        assert 'class="engine-meter idle"' in page and "Disk idle" in page
        assert "10.0.0.2 L0–3 0 MB/s" in page  # each host idle too, not its last token's rate
        with connect(c) as a, connect(c) as b:
            send(
                a, type="model", choice="mlx:no-such-model"
            )  # refused: the engine is told, every window redraws
            for ws in (a, b):
                meter = "".join(until(ws, r'id="engine-meter"'))
                assert re.search(r'id="engine-meter" class="engine-meter idle"[^>]*hx-swap-oob', meter)
