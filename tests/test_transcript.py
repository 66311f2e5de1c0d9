"""The transcript a reload keeps (issue 21), in-process: the event log replays what an agent turn
showed, any event type included; the mode belongs to the conversation; /clear empties the context
and the gauge; generation settings are stored and used; titles cut at a word. FakeBackend scripts
the model; SQLite and the app are real.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.test_ws import BASE, connect, conversation_id, send, until
from webapp.app import create_app
from webapp.chat.transcript import make_title
from webapp.settings import Settings


@pytest.fixture
def app_client(tmp_path: Path, fake: FakeBackend) -> Iterator[tuple[TestClient, object]]:
    worker = Worker(lambda: fake)
    project = tmp_path / "project"  # not the data directory: that cannot be a project (its database is there)
    project.mkdir()
    settings = Settings(data_dir=tmp_path / "data", load_model=False, project_dir=project)
    app = create_app(settings, worker=worker)
    with TestClient(app, base_url=BASE) as c:
        yield c, app.state.flashcode
    worker.close()


def replayed(page: str) -> list[str]:
    """The fragments the page replays into #messages, in order."""
    m = re.search(r'<script type="application/json" class="transcript-replay">(.*?)</script>', page, re.S)
    assert m, "no transcript in the page"
    return json.loads(m.group(1))


def test_transcript_replays_slash_output_events_and_unknown_types(app_client) -> None:
    client, parts = app_client
    with connect(client) as ws:
        send(ws, type="send", text="/help", conversation_id="")
        frames = until(ws, r'data-state="idle"')
    cid = conversation_id(frames)
    live = "".join(frames)
    assert "agent-help" in live
    parts.db.add_event(cid, "tool_step_from_the_future", {"type": "tool_step_from_the_future", "n": 7})
    fragments = replayed(client.get(f"/c/{cid}").text)
    assert 'class="msg msg-user' in fragments[0] and "/help" in fragments[0]
    help_html = next(f for f in fragments if "agent-help" in f)
    assert help_html in live  # drawn exactly as it was live
    assert 'data-type="tool_step_from_the_future"' in fragments[-1] and "<dd>7</dd>" in fragments[-1]


def test_mode_is_the_conversations_and_shown(app_client, fake: FakeBackend) -> None:
    client, parts = app_client
    with connect(client) as ws:
        send(ws, type="send", text="hello", conversation_id="", mode="agent")
        frames = until(ws, r'data-state="idle"')
        cid = conversation_id(frames)
        assert parts.db.get_conversation(cid).mode == "agent"
        send(ws, type="mode", mode="chat", conversation_id=cid)
        frames = until(ws, r'id="mode-switch"')
    assert parts.db.get_conversation(cid).mode == "chat"
    assert "Chat mode" in "".join(frames)
    page = client.get(f"/c/{cid}").text
    assert re.search(r'<option value="chat" selected>', page)
    assert any("Chat mode" in f for f in replayed(page))  # the switch is in the transcript too


def test_clear_empties_the_context_and_the_gauge(app_client, fake: FakeBackend) -> None:
    client, parts = app_client
    with connect(client) as ws:
        send(ws, type="send", text="one two three", conversation_id="")
        frames = until(ws, r'data-state="idle"')
        cid = conversation_id(frames)
        assert not re.search(r'gauge-text">0 /', frames[-1] + "".join(frames))
        send(ws, type="send", text="/clear", conversation_id=cid)
        frames = until(ws, r'data-state="idle"')
        assert re.search(r'class="gauge-text">0 / 2048', "".join(frames))
        send(ws, type="send", text="four", conversation_id=cid)
        until(ws, r'data-state="idle"')
    last = fake.history[-1].messages
    assert [m["content"] for m in last if m["role"] != "system"] == ["four"]  # nothing from before /clear
    assert 'class="gauge-text">0 /' not in client.get(f"/c/{cid}").text


def test_generation_settings_are_stored_and_used(app_client, fake: FakeBackend) -> None:
    client, parts = app_client
    token = parts.csrf_token
    r = client.post(
        "/settings/generation", data={"max_tokens": "7", "temperature": "0.2", "csrf_token": token}
    )
    assert "Saved." in r.text
    r = client.post("/settings/generation", data={"top_p": "3", "csrf_token": token})
    assert "Not saved: top p must be between" in r.text
    with connect(client) as ws:
        send(ws, type="send", text="hi", conversation_id="")
        frames = until(ws, r'data-state="idle"')
    cid = conversation_id(frames)
    assert fake.history[-1].sampling.max_tokens == 7 and fake.history[-1].sampling.temperature == 0.2
    r = client.post(
        f"/c/{cid}/generation", data={"max_tokens": "3", "system": "Be brief.", "csrf_token": token}
    )
    assert "Saved." in r.text
    with connect(client) as ws:
        send(ws, type="send", text="again", conversation_id=cid)
        until(ws, r'data-state="idle"')
    request = fake.history[-1]
    assert request.sampling.max_tokens == 3 and request.sampling.temperature == 0.2
    assert request.messages[0]["role"] == "system" and request.messages[0]["content"].endswith("Be brief.")
    assert client.post(f"/c/{cid}/generation", data={"max_tokens": "3"}).status_code == 403  # no CSRF token


def test_titles_cut_at_a_word() -> None:
    assert make_title("fix the bug") == "fix the bug"
    title = make_title("please explain how the context gauge is computed for agent turns and slash commands")
    assert title.endswith("…") and len(title) <= 60 and not title[:-1].endswith(" ")
    assert make_title("  \n first line\nsecond") == "first line"


def test_the_gauge_of_a_reloaded_agent_turn_without_an_answer_is_its_last_steps(app_client) -> None:
    """An agent turn of tool calls that ended with no reply: the reloaded page's gauge reads its last step's
    context (it read 0), a reply after it reads the reply's, and /clear empties it."""
    client, parts = app_client
    db = parts.db
    gauge = lambda: re.search(r'class="gauge-text">(\d+) /', client.get(f"/c/{cid}").text).group(1)  # noqa: E731
    cid = db.create_conversation("steps only").id
    db.add_message(cid, "user", "hi")
    reply = db.add_message(cid, "assistant", "hello")
    db.finish_message(reply.id, "hello", "complete", {"prompt_tokens": 100, "completion_tokens": 5})
    assert gauge() == "105"
    db.add_message(cid, "user", "list the files")
    for tokens in (180, 260):
        db.add_event(cid, "tool_step", {"type": "tool_step", "step": 1, "context_tokens": tokens})
    db.add_event(
        cid, "tool_step", {"type": "tool_step", "step": 3, "context_tokens": "lots"}
    )  # imported junk
    assert gauge() == "260"  # the turn's last step, not the reply before it (nor 0)
    answer = db.add_message(cid, "assistant", "done")
    db.finish_message(answer.id, "done", "complete", {"prompt_tokens": 300, "completion_tokens": 9})
    assert gauge() == "309"
    db.add_message(cid, "user", "/clear")
    db.add_event(cid, "clear", {"type": "clear"})
    assert gauge() == "0"


def test_the_gauge_of_a_reloaded_stalled_agent_turn_is_what_it_showed_live(app_client) -> None:
    """Seen in a walkthrough: an agent turn whose model stalled was answered from a small prompt of its own
    (149 tokens) after steps whose prompts held 1,135; the gauge read 1,153 live and 262 once reloaded. The
    reloaded gauge counts the steps of the turn the answer ends, as the live one did; a later turn's reply
    alone counts for itself."""
    client, parts = app_client
    db = parts.db
    gauge = lambda: re.search(r'class="gauge-text">(\d+) /', client.get(f"/c/{cid}").text).group(1)  # noqa: E731
    cid = db.create_conversation("stalled").id
    db.add_message(cid, "user", "create hello.py, then run it")
    for tokens in (900, 1153):
        db.add_event(cid, "tool_step", {"type": "tool_step", "step": 1, "context_tokens": tokens})
    answer = db.add_message(cid, "assistant", "I could not run it.")
    db.finish_message(answer.id, answer.content, "complete", {"prompt_tokens": 149, "completion_tokens": 113})
    assert gauge() == "1153"
    db.add_message(cid, "user", "thanks")
    reply = db.add_message(cid, "assistant", "You are welcome.")
    db.finish_message(reply.id, reply.content, "complete", {"prompt_tokens": 1000, "completion_tokens": 6})
    assert gauge() == "1006"


def test_saving_the_generation_form_unchanged_pins_nothing(app_client) -> None:
    """The Generation Settings form shows every value in force; saved as shown (or for a system prompt alone)
    it had stored the chat's 0.7 and 1024 as the user's own, over an agent turn's greedy 512."""
    client, parts = app_client
    token, db = parts.csrf_token, parts.db
    form = {
        "max_tokens": "1024",
        "temperature": "0.7",
        "top_p": "1.0",
        "system": "Be kind.",
        "csrf_token": token,
    }
    assert "Saved." in client.post("/settings/generation", data=form).text
    assert db.get_setting("generation_defaults") == {"system": "Be kind."}
    conv = db.create_conversation("agent work")
    db.set_mode(conv.id, "agent")
    shown = client.get("/generation", params={"conversation_id": conv.id}).text  # what its form shows
    assert 'name="max_tokens" min="1" max="32768" value="512"' in shown and 'value="0.0"' in shown
    form = {
        "max_tokens": "512",
        "temperature": "0.0",
        "top_p": "1.0",
        "system": "Be kind.",
        "csrf_token": token,
    }
    assert "Saved." in client.post(f"/c/{conv.id}/generation", data=form).text
    assert not db.get_conversation(conv.id).generation_settings
    form["temperature"] = "0.4"
    client.post(f"/c/{conv.id}/generation", data=form)
    assert db.get_conversation(conv.id).generation_settings == {"temperature": 0.4}
    # a chat conversation's window left open while it switches to agent mode, then saved as it was shown:
    # the chat's 0.7 and 1024 it showed are not the user's own (a walkthrough's agent turns went back to 0.7)
    chat = db.create_conversation("chat first")
    drawn = client.get("/generation", params={"conversation_id": chat.id}).text
    inherited = html.unescape(re.search(r'name="inherited" value="([^"]*)"', drawn).group(1))  # type: ignore[union-attr]
    db.set_mode(chat.id, "agent")
    form = {"max_tokens": "1024", "temperature": "0.7", "top_p": "1.0", "system": "Be kind.",
            "inherited": inherited, "csrf_token": token}  # fmt: skip
    assert "Saved." in client.post(f"/c/{chat.id}/generation", data=form).text
    assert not db.get_conversation(chat.id).generation_settings
