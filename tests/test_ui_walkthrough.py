"""What a new user's walkthrough found, in-process (TestClient, FakeBackend): the Settings window's rules
and MCP servers are fetched each time it opens; Undo after Move to Trash of the open conversation is marked
to show it again; a window shown while another writes in its conversation says so, and the alert when it
sends anyway starts with a capital; the approval dialog's disabled prefix button says why; a refused
attachment says "not attached" (the size limit only after a size refusal), and sizes are binary ("64 KB").
The browser side: tests/test_browser_walkthrough.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.testclient import TestClient

from tests import test_projects
from tests.conftest import FakeBackend
from tests.test_agent_views import proposal
from tests.test_ws import connect, conversation_id, send, served, until
from webapp.agent.views import AgentViews
from webapp.projects.files import ATTACH_LIMIT, ATTACH_TOTAL
from webapp.projects.web import _human
from webapp.render import find_dir

BASE = test_projects.BASE
client = test_projects.client  # the app with a FakeBackend, its CSRF token and Origin set


def test_settings_window_fetches_its_rules_and_mcp_servers_each_time_it_opens(client: TestClient) -> None:
    page = client.get("/").text
    settings = page.split('id="settings-window"')[1].split("</section>")[0]
    for part, url in (("settings-rules", "/agent/rules"), ("settings-mcp", "/agent/mcp")):
        tag = re.search(rf'<div id="{part}"[^>]*>', settings)
        assert tag, settings
        # static/app.js triggers "refresh" on [data-refresh] when the window opens (and after an approval)
        assert "data-refresh" in tag[0] and f'hx-get="{url}"' in tag[0] and 'hx-trigger="refresh"' in tag[0]
        assert 'hx-swap="innerHTML"' in tag[0]  # the part stays, to be refreshed again


def test_undo_shows_the_trashed_conversation_again_only_when_it_was_the_open_one(
    client: TestClient, fake: FakeBackend
) -> None:
    with connect(client) as ws:
        send(ws, type="send", text="first", conversation_id="")
        first = conversation_id(until(ws, r'data-state="idle"'))
        send(ws, type="send", text="second", conversation_id="")
        second = conversation_id(until(ws, r'data-state="idle"'))
    # the open one: the page goes to /?trashed=ID, whose Undo shows it again in the chat window
    r = client.post(f"/c/{first}/delete", headers={"HX-Current-URL": f"{BASE}/c/{first}"})
    assert r.headers["HX-Redirect"] == f"/?trashed={first}"
    page = client.get(f"/?trashed={first}").text
    assert re.search(rf'class="btn undo-trash" data-reopen="{first}" hx-post="/c/{first}/restore"', page)
    # another one (the chat window shows `second`): Undo puts it back in the list only
    client.post(f"/c/{first}/restore")
    r = client.post(f"/c/{first}/delete", headers={"HX-Current-URL": f"{BASE}/c/{second}"})
    assert f'hx-post="/c/{first}/restore"' in r.text and "data-reopen" not in r.text


def test_a_window_shown_while_another_writes_says_so_and_its_alert_starts_with_a_capital(
    tmp_path: Path,
) -> None:
    slow = FakeBackend(delay=0.03)
    slow.enqueue("first answer").enqueue(*["x"] * 60)
    with served(slow, tmp_path) as c, connect(c) as one, connect(c) as two:
        send(one, type="send", text="hello")
        cid = conversation_id(until(one, r'data-state="idle"'))
        assert "Ready" in c.get(f"/c/{cid}/sync").text
        seen = c.app.state.flashcode.db.messages(cid)[-1].id
        send(one, type="send", text="a long one", conversation_id=cid, seen=seen)
        until(one, r'data-state="generating"')
        # window two is told (when "hello" was sent, when its reply ended, when "a long one" was sent), and asks
        # for the conversation: it and a page drawn now say a reply is being written elsewhere, not Ready
        for html in (c.get(f"/c/{cid}/sync").text, c.get(f"/c/{cid}").text):
            status = re.search(r'<div id="status".*?<span class="buttons">', html, re.S)
            assert status and 'data-elsewhere="writing"' in status[0], html[:300]
            assert "A reply is being written in another window…" in status[0] and "Ready" not in status[0]
        send(two, type="send", text="from two", conversation_id=cid, seen=seen)
        alert = until(two, r'role="alert"')[-1]
        assert "A reply is being written in this conversation in another window" in alert
        until(one, r'data-state="idle"')
        # once it has ended: Ready again
        sync = c.get(f"/c/{cid}/sync").text
        assert "data-elsewhere" not in sync and re.search(r'class="status-text">Ready<', sync)


@pytest.fixture(scope="module")
def agent_views() -> AgentViews:
    return AgentViews(
        Environment(loader=FileSystemLoader(find_dir("templates")), autoescape=select_autoescape(["html"]))
    )


def test_the_disabled_prefix_button_says_there_is_no_prefix_rule(agent_views: AgentViews) -> None:
    for command in ("python3 main.py", "curl https://example.com", "ls | wc -l"):
        html = agent_views.approval_dialog(proposal(command), "d1")
        button = re.search(r'<button[^>]*data-choice="always_prefix"[^>]*>(.*?)</button>', html, re.S)
        assert button and " disabled " in button[0], html
        assert button[1] == "No prefix rule for this command", button[1]
        assert "Always allow the prefix" not in html and "  in this project" not in html
    html = agent_views.approval_dialog(proposal("git status --short"), "d2")
    assert "Always allow the prefix <code>git status</code> in this project</button>" in html


def test_a_refused_attachment_says_not_attached_and_sizes_are_binary(
    client: TestClient, tmp_path: Path
) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "blob.bin").write_bytes(b"\x00\x01binary")
    (project / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (project / "big.txt").write_text("y" * (ATTACH_LIMIT + 1))
    (project / "exact.txt").write_text("z" * ATTACH_LIMIT)
    for n in range(3):
        (project / f"part{n}.txt").write_text("p" * (ATTACH_LIMIT - 100))
    r = client.post("/projects/open", data={"path": str(project)}, headers={"HX-Request": "true"})
    assert r.headers.get("HX-Redirect") == "/"
    assert (_human(ATTACH_LIMIT), _human(ATTACH_TOTAL), _human(1536), _human(999)) == (
        "64 KB",
        "192 KB",
        "1.5 KB",
        "999 bytes",
    )
    listing = client.get("/files/window").text
    row = re.search(r'<tr data-path="exact.txt".*?</tr>', listing, re.S)
    assert row and '<td class="num">64 KB</td>' in row[0]  # 65,536 bytes, as the docs say it (was 65.5 KB)

    def errors(*paths: str) -> list[str]:
        client.post("/files/attachments/clear")
        html = client.post("/files/attach", data={"path": list(paths)}).text
        return re.findall(r'class="attachment-error" role="alert">([^<]*)<', html)

    assert errors("blob.bin") == ["blob.bin is a binary file: not attached"]
    assert errors("latin1.txt") == ["latin1.txt is not UTF-8 text: not attached"]
    assert errors("big.txt") == [
        f"big.txt is {ATTACH_LIMIT + 1:,} bytes: not attached (attachments: at most 64 KB each)"
    ]
    assert errors("part0.txt", "part1.txt", "part2.txt", "exact.txt") == [
        "exact.txt was not attached: the attachments would pass 192 KB in all"
    ]
    client.post("/files/attachments/clear")
    attached = client.post("/files/attach", data={"path": ["exact.txt"]}).text
    assert 'data-path="exact.txt"' in attached and '<span class="muted">(64 KB)</span>' in attached
