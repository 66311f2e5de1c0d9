"""HTTP side of the web app, in-process: pages, exports, CSRF, hosts, security headers, restart."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.test_ws import BASE, connect, conversation_id, send, until
from webapp.app import create_app
from webapp.db import Database
from webapp.settings import Settings


@pytest.fixture
def app_parts(tmp_path: Path) -> Iterator[tuple[TestClient, FakeBackend]]:
    fake = FakeBackend()
    worker = Worker(lambda: fake)
    with TestClient(
        create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker), base_url=BASE
    ) as c:
        yield c, fake
    worker.close()


def make_conversation(client: TestClient, text: str = "hello there") -> str:
    with connect(client) as ws:
        send(ws, type="send", text=text)
        return conversation_id(until(ws, r'data-state="idle"'))


def csrf(client: TestClient) -> str:
    return re.search(r'"X-CSRF-Token": "([^"]+)"', client.get("/").text).group(1)


def test_webapp_page_is_a_desktop_with_menus_and_windows(app_parts) -> None:
    client, _ = app_parts
    r = client.get("/")
    assert r.status_code == 200
    for needle in (
        'role="menu-bar"',
        ">File",
        ">Edit",
        ">View",
        ">Special",
        'id="chat-window"',
        'id="conversations-window"',
        'id="projects-window"',
        'id="stats-window"',
        'id="settings-window"',
        'ws-connect="/ws"',
        'id="context-gauge"',
        'id="model-picker"',
    ):
        assert needle in r.text, needle
    assert "fake-model" in r.text


def test_webapp_security_headers_and_no_wildcard_cors(app_parts) -> None:
    client, _ = app_parts
    r = client.get("/", headers={"origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"


def test_webapp_refuses_foreign_host_header(app_parts) -> None:
    client, _ = app_parts
    assert client.get("/", headers={"host": "evil.example"}).status_code == 400


def test_webapp_conversation_page_fragment_and_list(app_parts) -> None:
    client, _ = app_parts
    cid = make_conversation(client)
    full = client.get(f"/c/{cid}").text
    assert full.startswith("<!doctype html>") and "hello there" in full
    frag = client.get(f"/c/{cid}", headers={"HX-Request": "true", "HX-Target": "chat-window"}).text
    assert frag.lstrip().startswith("<section") and "Hello world." in frag
    assert cid in client.get("/conversations").text
    assert client.get("/c/doesnotexist").status_code == 404


def test_webapp_rename_and_delete_need_csrf_token(app_parts) -> None:
    client, _ = app_parts
    cid = make_conversation(client)
    assert client.post(f"/c/{cid}/rename", data={"title": "x"}).status_code == 403
    assert (
        client.post(f"/c/{cid}/rename", data={"title": "x"}, headers={"X-CSRF-Token": "wrong"}).status_code
        == 403
    )
    token = csrf(client)
    bad_origin = {"X-CSRF-Token": token, "origin": "http://evil.example"}
    assert client.post(f"/c/{cid}/delete", headers=bad_origin).status_code == 403
    assert client.post(f"/c/{cid}/rename", data={"title": "form", "csrf_token": token}).status_code == 200
    r = client.post(f"/c/{cid}/rename", data={"title": "  My <b>talk</b> "}, headers={"X-CSRF-Token": token})
    assert r.status_code == 200 and "My &lt;b&gt;talk&lt;/b&gt;" in r.text
    r = client.post(f"/c/{cid}/delete", headers={"X-CSRF-Token": token, "HX-Current-URL": f"{BASE}/c/{cid}"})
    assert r.headers.get("hx-redirect") == "/"
    assert client.get(f"/c/{cid}").status_code == 404


def test_webapp_export_markdown_and_json(app_parts) -> None:
    client, _ = app_parts
    cid = make_conversation(client, "export this")
    md = client.get(f"/c/{cid}/export.md")
    assert md.headers["content-disposition"].startswith("attachment;")
    assert "## User" in md.text and "export this" in md.text and "Hello world." in md.text
    data = client.get(f"/c/{cid}/export.json").json()
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["stats"]["completion_tokens"] == 3


def test_webapp_conversations_survive_restart(tmp_path: Path) -> None:
    fake = FakeBackend()
    worker = Worker(lambda: fake)
    settings = Settings(data_dir=tmp_path, load_model=False)
    with TestClient(create_app(settings, worker=worker), base_url=BASE) as c:
        cid = make_conversation(c, "remember me")
    with TestClient(create_app(settings, worker=worker), base_url=BASE) as c:
        assert "remember me" in c.get("/").text  # listed
        assert "Hello world." in c.get(f"/c/{cid}").text
    worker.close()


def test_webapp_incomplete_reply_is_shown_after_crash(tmp_path: Path) -> None:
    from engine import paths

    d = Database(paths.database_path(tmp_path))
    c = d.create_conversation("crashy")
    d.add_message(c.id, "user", "q")
    r = d.add_message(c.id, "assistant", "", status="streaming")
    d.save_partial(r.id, "half a repl")
    d.conn.close()
    worker = Worker(lambda: FakeBackend())
    with TestClient(
        create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker), base_url=BASE
    ) as cl:
        page = cl.get(f"/c/{c.id}").text
    assert "half a repl" in page and "status-incomplete" in page and "Incomplete" in page
    worker.close()
