"""`${VAR}` and `${VAR:-default}` in a project's `.mcp.json` (issue 20), expanded the way Claude Code
does: in `command`, `args`, `env` values, `url` and `headers` values, from flashcode's own
environment; `$VAR` is left alone; a variable that is not set and has no default makes that server
unusable with a message naming it (the other servers and the turn go on). The approval covers the
expanded config; what the user is shown keeps `${VAR}` (values from the environment may be
secrets). A real SDK server (`tests/data/mcp_server.py`) started through the expansion reports its
environment and its `--only` tools."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.test_mcp import SERVER, Approver, approve_file_servers, make_session, of, run, turn, write_config
from webapp.agent import events as ev
from webapp.agent.mcp import McpServers
from webapp.agent.mcp_config import expand_vars, parse_entry, read_file_config
from webapp.agent.mcp_store import McpStore
from webapp.agent.store import AgentStore
from webapp.db import connect_memory


def test_expand_vars_forms() -> None:
    env = {"A": "alpha", "EMPTY": "", "URL": "http://127.0.0.1:9"}
    missing: list[str] = []
    assert expand_vars("${A}-${A:-x}", env, missing) == "alpha-alpha"
    assert expand_vars("${NOPE:-fallback}/${NOPE:-a:-b}", env, missing) == "fallback/a:-b"
    assert expand_vars("[${EMPTY:-d}]", env, missing) == "[]"  # set to "" is set
    assert expand_vars("$A ${} $${A}", env, missing) == "$A ${} $alpha"  # $A and ${} stay
    assert (
        expand_vars("${X:-${A}}", env, missing) == "${A}"
    )  # a default ends at the first }: not expanded again
    assert missing == []
    assert expand_vars("${NOPE}/${NOPE2}", env, missing) == "${NOPE}/${NOPE2}"
    assert missing == ["NOPE", "NOPE2"]


def test_every_field_is_expanded_and_shown_as_written() -> None:
    env = {"PY": "/usr/bin/python3", "KEY": "s3cret", "HOST": "127.0.0.1:9"}
    stdio = parse_entry(
        "s",
        {
            "command": "${PY}",
            "args": ["-m", "srv", "--key=${KEY}"],
            "env": {"TOKEN": "t-${KEY}", "PLAIN": "$KEY"},
        },
        environ=env,
    )
    assert stdio.error is None and stdio.command == "/usr/bin/python3"
    assert stdio.args == ("-m", "srv", "--key=s3cret")
    assert dict(stdio.env) == {"TOKEN": "t-s3cret", "PLAIN": "$KEY"}
    assert stdio.describe() == '${PY} -m srv "--key=${KEY}"' and "s3cret" not in stdio.describe()
    remote = parse_entry(
        "r",
        {"type": "http", "url": "http://${HOST}/mcp", "headers": {"Authorization": "Bearer ${KEY}"}},
        environ=env,
    )
    assert remote.error is None and remote.url == "http://127.0.0.1:9/mcp"
    assert dict(remote.headers) == {"Authorization": "Bearer s3cret"}
    assert remote.describe() == "http://${HOST}/mcp"
    # the approval is for what runs: another value of a variable is another fingerprint
    other = parse_entry("s", stdio.raw, environ={**env, "KEY": "rotated"})
    assert other.fingerprint != stdio.fingerprint
    assert parse_entry("s", stdio.raw, environ=dict(env)).fingerprint == stdio.fingerprint
    # the whole SHA-256 (a red-team pass made two configs share a fingerprint cut to 36 bits in 2 s)
    assert len(stdio.fingerprint) == 64 and int(stdio.fingerprint, 16) >= 0
    # a url that is only valid once expanded; one that is not valid even then
    assert (
        parse_entry("u", {"url": "${NOPE:-http://localhost:1}/mcp"}, environ={}).url
        == "http://localhost:1/mcp"
    )
    assert "url must be" in (parse_entry("u", {"url": "${HOST}/mcp"}, environ=env).error or "")


def test_missing_variable_is_a_config_error_for_that_server_only(tmp_path: Path) -> None:
    (tmp_path / ".mcp.json").write_text(
        json.dumps(
            {
                "mcpServers": {
                    "needs": {"command": "srv", "args": ["${MCP_T_ONE}"], "env": {"K": "${MCP_T_TWO}"}},
                    "hdr": {"url": "http://127.0.0.1:9/mcp", "headers": {"X": "${MCP_T_ONE}"}},
                    "fine": {"command": "srv", "args": ["${MCP_T_ONE:-default}"]},
                }
            }
        )
    )
    servers, error = read_file_config(tmp_path, environ={})
    by = {s.name: s for s in servers}
    assert error is None
    assert by["needs"].error == (
        "${MCP_T_ONE} and ${MCP_T_TWO} are not set in flashcode's environment and have no default "
        "(set it before starting flashcode, or write ${NAME:-default})"
    )
    assert not by["needs"].usable and by["needs"].status().startswith("not usable: ${MCP_T_ONE} and")
    assert by["hdr"].error and "${MCP_T_ONE} is not set" in by["hdr"].error
    assert by["fine"].error is None and by["fine"].args == ("default",)


def test_settings_store_the_config_as_written() -> None:
    store = McpStore(connect_memory())
    env_before = {"command": "srv", "args": ["--key=${MCP_T_KEY}"], "env": {"T": "${MCP_T_KEY}"}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MCP_T_KEY", "s3cret")
        store.add("p", "mine", env_before)
        row = store.conn.execute("SELECT config FROM mcp_servers WHERE name = 'mine'").fetchone()[0]
        assert "s3cret" not in row and json.loads(row) == env_before
        cfg = store.servers("p", Path("/nonexistent")).servers[0]
        assert cfg.args == ("--key=s3cret",) and dict(cfg.env) == {"T": "s3cret"}
    with pytest.raises(ValueError, match=r"\$\{MCP_T_NOPE\} is not set"):
        store.add("p", "bad", {"command": "srv", "env": {"T": "${MCP_T_NOPE}"}})


# --------------------------------------------------------------------------- a real server
def test_real_server_gets_the_expanded_command_args_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MCP_T_PYTHON", sys.executable)
    monkeypatch.setenv("MCP_T_SERVER", SERVER)
    monkeypatch.setenv("MCP_T_SECRET", "from-the-environment")
    monkeypatch.delenv("MCP_T_TOOLS", raising=False)
    monkeypatch.delenv("MCP_T_ABSENT", raising=False)
    project = tmp_path / "proj"
    project.mkdir()
    write_config(
        project,
        demo={
            "command": "${MCP_T_PYTHON}",
            "args": ["${MCP_T_SERVER}", "--only=${MCP_T_TOOLS:-add,getenv}"],
            "env": {"SECRET": "<${MCP_T_SECRET}>", "LITERAL": "$MCP_T_SECRET"},
        },
        broken={"command": "${MCP_T_ABSENT}", "args": []},
    )
    fake = FakeBackend(tools=True, context_length=32768)
    worker = Worker(lambda: fake)
    store = AgentStore(connect_memory())
    servers = McpServers()
    try:
        approve_file_servers(store, project)  # `broken` is not usable, so not approvable
        s = make_session(worker, project, store, servers, Approver(ev.Decision.once(), ev.Decision.once()))
        fake.enqueue_call("demo__getenv", variable="SECRET").enqueue_call(
            "demo__getenv", variable="LITERAL"
        ).enqueue("ok")
        events = run(lambda: turn(s, "read the variables"), servers)
    finally:
        worker.close()
    offered = {t["function"]["name"] for t in fake.history[0].tools}
    assert {"demo__add", "demo__getenv"} <= offered and "demo__echo" not in offered  # args: --only=add,getenv
    results = [d.result for d in of(events, ev.ToolStepDone)]
    assert results == ["<from-the-environment>", "$MCP_T_SECRET"]
    notes = [n.text for n in of(events, ev.Notice)]
    assert any(n.startswith("MCP server broken is not used: ${MCP_T_ABSENT} is not set") for n in notes), (
        notes
    )
    assert of(events, ev.AnswerDone)[-1].text == "ok"  # the turn went on
    approved = McpStore(store.conn).servers(s.project, project).servers[0]
    assert (
        approved.usable
        and approved.describe() == '${MCP_T_PYTHON} "${MCP_T_SERVER}" "--only=${MCP_T_TOOLS:-add,getenv}"'
    )
    monkeypatch.setenv("MCP_T_SECRET", "changed")  # what runs changed: the approval no longer holds
    assert not McpStore(store.conn).servers(s.project, project).servers[0].approved
