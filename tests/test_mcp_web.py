"""Settings › MCP servers (the app in-process, real SQLite, CSRF as the browser sends it) and
`flashcode tools` (a real subprocess that starts the SDK test server in the sandbox)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.worker import Worker
from tests.conftest import FakeBackend
from webapp.agent.mcp_store import McpStore
from webapp.app import create_app
from webapp.settings import Settings

BASE = "http://127.0.0.1:8000"
ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "tests" / "data" / "mcp_server.py")


def write_config(project: Path, **servers: dict) -> None:
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    p = tmp_path / "proj"
    p.mkdir()
    write_config(p, demo={"command": sys.executable, "args": [SERVER]})
    return p


@pytest.fixture
def client(tmp_path: Path, project: Path) -> Iterator[TestClient]:
    worker = Worker(lambda: FakeBackend(tools=True))
    app = create_app(
        Settings(data_dir=tmp_path / "data", load_model=False, project_dir=project), worker=worker
    )
    with TestClient(app, base_url=BASE) as c:
        c.headers["X-CSRF-Token"] = app.state.flashcode.csrf_token
        c.headers["origin"] = BASE
        c.app_state = app.state.flashcode  # type: ignore[attr-defined]
        yield c
    worker.close()


def test_settings_lists_approves_adds_disables_and_removes(client: TestClient, project: Path) -> None:
    page = client.get("/")
    assert 'hx-get="/agent/mcp"' in page.text
    r = client.get("/agent/mcp")
    assert r.status_code == 200 and 'id="mcp-server-demo"' in r.text
    assert "not approved yet" in r.text and "mcp_server.py" in r.text
    project_id = client.app_state.agent.project_for(None).id  # type: ignore[attr-defined]
    mstore = McpStore(client.app_state.db.conn)  # type: ignore[attr-defined]
    fingerprint = mstore.servers(project_id, project).servers[0].fingerprint
    here = {"project": project_id}  # the project the list was drawn for (the panel's hidden field)
    assert 'id="mcp-project" value="' + project_id + '"' in r.text
    assert (
        client.post("/agent/mcp/demo/approve", data={"fingerprint": "stale"} | here).text.count("changed")
        == 1
    )
    r = client.post("/agent/mcp/demo/approve", data={"fingerprint": fingerprint} | here)
    assert 'data-status="enabled"' in r.text and mstore.servers(project_id, project).servers[0].usable
    # add one in Settings: a stdio server with arguments and environment; a bad one says why
    r = client.post(
        "/agent/mcp/add",
        data={"name": "calc", "command": sys.executable, "args": f"{SERVER}\n--only=add", "env": "A=1"}
        | here,
    )
    assert 'id="mcp-server-calc"' in r.text
    assert 'hx-confirm="Remove the MCP server ‘calc’?' in r.text  # it went at once, unasked (walkthrough)
    calc = {s.name: s for s in mstore.servers(project_id, project).servers}["calc"]
    assert calc.source == "settings" and calc.args == (SERVER, "--only=add") and calc.env == (("A", "1"),)
    r = client.post("/agent/mcp/add", data={"name": "calc", "command": "/bin/true"} | here)
    assert (
        "calc was not added: a server named calc is on the list already" in r.text
    )  # it replaced it, unsaid
    assert {s.name: s for s in mstore.servers(project_id, project).servers}["calc"].args == (
        SERVER,
        "--only=add",
    )
    r = client.post("/agent/mcp/add", data={"name": "bad name", "command": "x"} | here)
    assert "was not added" in r.text
    r = client.post("/agent/mcp/add", data={"name": "web", "url": "ftp://example"} | here)
    assert "was not added" in r.text and "http" in r.text
    # (walkthrough) a command that cannot start was listed "enabled" and failed every turn; a command and a URL
    # together kept the URL, unsaid
    refused = {
        "ghost-cmd-91": "ghost-cmd-91 is not found on PATH",
        "/nonexistent/cmd": "/nonexistent/cmd is not an executable file",
        "/tmp/venv91/bin/python": "is under /tmp, which the sandbox gives each server empty",
    }
    for command, said in refused.items():
        r = client.post("/agent/mcp/add", data={"name": "bad", "command": command} | here)
        assert (
            f"bad was not added: {command if said.startswith('is') else ''}" in r.text and said in r.text
        ), r.text
    r = client.post(
        "/agent/mcp/add", data={"name": "both", "command": "/bin/true", "url": "http://x/mcp"} | here
    )
    assert "both was not added: give a command" in r.text and "not both" in r.text
    r = client.post("/agent/mcp/add", data={"name": "envy", "command": "true", "env": "NOEQUALS"} | here)
    assert "envy was not added: environment lines are NAME=value" in r.text
    assert not {"bad", "both", "envy"} & {s.name for s in mstore.servers(project_id, project).servers}
    # disable, enable, remove; a tool rule listed and removed
    r = client.post("/agent/mcp/calc/enable", data={"enabled": "off"} | here)
    assert 'id="mcp-server-calc" data-status="disabled"' in r.text
    r = client.post("/agent/mcp/calc/enable", data={"enabled": "on"} | here)
    assert 'id="mcp-server-calc" data-status="enabled"' in r.text
    rule = mstore.allow_tool(project_id, "calc__add")
    assert "calc__add" in client.get("/agent/mcp").text
    r = client.post(f"/agent/mcp/rules/{rule.id}/delete", data=here)
    assert "No MCP tool is allowed" in r.text
    r = client.post("/agent/mcp/calc/remove", data=here)
    assert 'id="mcp-server-calc"' not in r.text and 'id="mcp-server-demo"' in r.text


def test_a_list_drawn_for_another_project_changes_nothing(
    client: TestClient, project: Path, tmp_path: Path
) -> None:
    """A window still showing project A's MCP servers approved B's (opened since in another window): the
    buttons acted on the project open now, so the user approved a `.mcp.json` server they never saw
    (red-team). A POST from a list drawn for another project is refused, and the list of the open one shown."""
    projects = client.app_state.projects  # type: ignore[attr-defined]
    a = projects.current().id
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    write_config(b_dir, demo={"command": sys.executable, "args": [SERVER, "--only=add"]})
    mstore = McpStore(client.app_state.db.conn)  # type: ignore[attr-defined]
    b = projects.add(b_dir).id
    projects.open(b)  # another window opened B
    fingerprint = mstore.servers(b, b_dir).servers[0].fingerprint  # the same name; what runs is B's
    posts = [
        ("/agent/mcp/demo/approve", {"fingerprint": fingerprint}),
        ("/agent/mcp/demo/enable", {"enabled": "off"}),
        ("/agent/mcp/add", {"name": "calc", "command": sys.executable, "args": SERVER}),
        ("/agent/mcp/demo/remove", {}),
    ]
    for url, data in posts:
        r = client.post(url, data=data | {"project": a})
        assert r.status_code == 200 and "another project was opened since" in r.text, url
        assert f"<code>b ({b_dir})</code>" in r.text  # the list now shown is B's
    b_servers = mstore.servers(b, b_dir).servers
    assert [s.name for s in b_servers] == ["demo"] and not b_servers[0].approved and b_servers[0].enabled
    assert (
        client.post("/agent/mcp/demo/approve", data={"fingerprint": fingerprint, "project": b}).status_code
        == 200
    )
    assert mstore.servers(b, b_dir).servers[0].approved


def test_settings_posts_need_the_csrf_token(client: TestClient) -> None:
    del client.headers["X-CSRF-Token"]
    r = client.post("/agent/mcp/add", data={"name": "x", "command": "true"})
    assert r.status_code == 403


def test_settings_escapes_what_mcp_json_says(client: TestClient, project: Path) -> None:
    write_config(project, demo={"command": "<script>alert(1)</script>", "args": ["<b>x</b>"]})
    r = client.get("/agent/mcp")
    assert "<script>alert" not in r.text and "&lt;script&gt;" in r.text


def test_settings_marks_hidden_characters_in_what_a_server_runs(client: TestClient, project: Path) -> None:
    """A right-to-left override draws `./tools/\u202eyp.revres-pcm-efas` as `./tools/safe-mcp-server.py` next
    to "Approve and enable": the command is shown with a <U+202E> marker and a warning above it."""
    write_config(project, demo={"command": "./tools/\u202eyp.revres-pcm-efas", "args": ["\x1b[2Kx"]})
    r = client.get("/agent/mcp")
    assert "\u202e" not in r.text and "&lt;U+202E&gt;" in r.text and 'data-field="hidden-chars"' in r.text
    write_config(project, demo={"command": sys.executable, "args": [SERVER]})
    assert 'data-field="hidden-chars"' not in client.get("/agent/mcp").text


def run_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLASHCODE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "webapp.cli", "tools", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_flashcode_tools_lists_builtin_and_mcp_tools(tmp_path: Path, project: Path) -> None:
    home = tmp_path / "home"
    before = run_cli(home, "--project", str(project), "--json")
    assert before.returncode == 0, before.stderr
    out = json.loads(before.stdout)
    names = {t["name"]: t for t in out["tools"]}
    assert names["read_file"]["source"] == "built-in" and not names["read_file"]["needs_approval"]
    assert names["run_command"]["needs_approval"] and names["write_file"]["needs_approval"]
    assert not any(n.startswith("demo__") for n in names)  # not approved: never started
    assert any("not approved yet" in n for n in out["notices"])
    # what --approve-server approves is said in full, as the agent's prompt says it: the environment too
    write_config(project, demo={"command": sys.executable, "args": [SERVER], "env": {"API_KEY": "${HOME}"}})
    after = run_cli(home, "--project", str(project), "--json", "--approve-server", "demo")
    assert after.returncode == 0, after.stderr
    assert (
        "env API_KEY=${HOME}" in after.stderr and "reads from flashcode's environment: $HOME" in after.stderr
    )
    out = json.loads(after.stdout)
    names = {t["name"]: t for t in out["tools"]}
    assert names["demo__add"]["source"] == "demo" and names["demo__add"]["needs_approval"]
    assert names["demo__add"]["description"] == "Add two integers and return the sum."
    assert out["servers"][0]["status"] == "enabled"
    text = run_cli(home, "--project", str(project))
    assert "demo__echo\tdemo\tyes: every call asks\tReturn the text unchanged." in text.stdout.splitlines()
    other = tmp_path / "other"
    other.mkdir()
    elsewhere = json.loads(run_cli(home, "--project", str(other), "--json").stdout)
    assert not any(t["source"] == "demo" for t in elsewhere["tools"])  # absent in another project
