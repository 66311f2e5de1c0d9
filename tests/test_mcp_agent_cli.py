"""`flashcode agent --project DIR` with a project's MCP servers (issue 20), as a subprocess: it works
in the data directory's database (the project joins `flashcode projects`; approvals persist like
the web app's), and a `.mcp.json` server not approved yet is asked about on the terminal with
`--approve ask` (yes: approved for the project; no: not started), approved for that run only with
`--approve all`, and refused with a notice with `--approve none`. The MCP call's own approval is
asked on the terminal too; a denial reaches the model as a denial.

The scripted runs use `tests/data/fake_agent_cli.py` (the real command line, the real SDK server in
the sandbox, a FakeBackend model in the same subprocess); the last test runs the real agent model
(Qwen2.5-Coder-0.5B on llama-server, constrained) through the real `flashcode agent`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_mcp import SERVER, server_entry, write_config
from webapp.agent.mcp_store import McpStore
from webapp.db import Database
from webapp.projects.store import ProjectStore

ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(Path(__file__).parent / "data" / "fake_agent_cli.py")
CALL = [{"call": "demo__add", "arguments": {"a": 2, "b": 40}}, {"text": "The sum is 42."}]


def agent(home: Path, tmp: Path, project: Path, approve: str, stdin: str = "", script: list | None = None):
    """Run `flashcode agent --json` scripted; returns (process, report)."""
    (tmp / "script.json").write_text(json.dumps(CALL if script is None else script))
    report = tmp / "report.json"
    proc = subprocess.run(
        [sys.executable, DRIVER, str(tmp / "script.json"), str(report), "agent", "--project", str(project)]
        + ["--approve", approve, "--max-steps", "3", "--json", "add 2 and 40"],
        cwd=ROOT,
        env={**os.environ, "FLASHCODE_HOME": str(home)},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, json.loads(report.read_text()) if report.exists() else {}


def registry(home: Path, project: Path) -> tuple[bool, list[str]]:
    """(whether the project's demo server is approved, the registered projects' paths)."""
    db = Database(home / "flashcode.db")
    try:
        projects = ProjectStore(db.conn, home)
        ref = projects.by_path(project.resolve())
        assert ref is not None, "flashcode agent registers the project"
        servers = McpStore(db.conn).servers(ref.id, ref.path).servers
        return servers[0].approved, [str(p.path) for p in projects.all()]
    finally:
        db.close()


def mstore_approve(home: Path, project: Path) -> None:
    db = Database(home / "flashcode.db")
    try:
        ref = ProjectStore(db.conn, home).by_path(project.resolve())
        mstore = McpStore(db.conn)
        cfg = mstore.servers(ref.id, ref.path).servers[0]  # type: ignore[union-attr]
        mstore.approve(ref.id, cfg.name, cfg.fingerprint)  # type: ignore[union-attr]
    finally:
        db.close()


def mstore_allow(home: Path, project: Path, tool: str) -> None:
    db = Database(home / "flashcode.db")
    try:
        McpStore(db.conn).allow_tool(ProjectStore(db.conn, home).by_path(project.resolve()).id, tool)  # type: ignore[union-attr]
    finally:
        db.close()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    p = tmp_path / "proj"
    p.mkdir()
    write_config(p, demo=server_entry("--only=add,echo"))
    return p


def test_ask_approves_the_server_for_the_project_then_asks_for_each_call(
    tmp_path: Path, project: Path
) -> None:
    home = tmp_path / "home"
    proc, report = agent(home, tmp_path, project, "ask", stdin="y\ny\n")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "The project's .mcp.json names the MCP server demo, not approved yet" in err
    assert "mcp_server.py --only=add,echo" in err and "approve it only if you trust this command" in err
    # stdin is a pipe here: the server runs for this run, and nothing is saved from it (red-team: a stray `y`
    # or `a` in piped text approved for good)
    assert "Approve demo for this project? [y/N]" in err and "approved demo for this run only" in err
    assert 'The agent wants to call the MCP tool: demo__add {"a": 2, "b": 40}' in err
    assert "Its result reaches the model as untrusted data." in err
    # piped, no rule is offered (it was, then refused when taken: walkthrough)
    assert "Allow? [y]es once, or no (Enter, or type why not" in err and "[a]lways" not in err
    out = json.loads(proc.stdout)
    assert [(s["tool"], s["decision"], s["ok"]) for s in out["steps"]] == [("demo__add", "once", True)]
    assert out["answer"] == "The sum is 42." and out["stats"]["project"] == str(project.resolve())
    assert "demo__add" in report["offered"] and "demo__write_note" not in report["offered"]
    assert report["tool_messages"][0].startswith('<untrusted source="tool demo__add">')
    assert "42" in report["tool_messages"][0]
    approved, paths = registry(home, project)
    assert (
        not approved and str(project.resolve()) in paths
    )  # the project in `flashcode projects`, no approval
    mstore_approve(home, project)  # as Settings (or a terminal's y) approves it
    listed = subprocess.run(
        [sys.executable, "-m", "webapp.cli", "projects"],
        cwd=ROOT,
        env={**os.environ, "FLASHCODE_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"proj\t{project.resolve()}\t" in listed.stdout

    # the next run does not ask about the server again; denying the call reaches the model
    proc, report = agent(home, tmp_path, project, "ask", stdin="no, use mental arithmetic\n")
    assert proc.returncode == 0, proc.stderr
    assert "not approved yet" not in proc.stderr and "Approve demo" not in proc.stderr
    out = json.loads(proc.stdout)
    assert [(s["tool"], s["decision"], s["ok"]) for s in out["steps"]] == [("demo__add", "deny", False)]
    assert "Denied by the user: no, use mental arithmetic" in report["tool_messages"][0]

    # "a" from a pipe saves no rule: denied, said so; a rule made in Settings (the store) asks nothing
    proc, _ = agent(home, tmp_path, project, "ask", stdin="a\n")
    assert json.loads(proc.stdout)["steps"][0]["decision"] == "deny", proc.stderr
    assert "not allowed: stdin is not a terminal" in proc.stderr
    mstore_allow(home, project, "demo__add")
    proc, report = agent(home, tmp_path, project, "ask", stdin="")
    assert json.loads(proc.stdout)["steps"][0]["decision"] == "rule", proc.stderr
    assert "Allow?" not in proc.stderr and "42" in report["tool_messages"][0]


def test_ask_answered_no_does_not_start_the_server(tmp_path: Path, project: Path) -> None:
    home = tmp_path / "home"
    proc, report = agent(home, tmp_path, project, "ask", stdin="\n", script=[{"text": "Nothing to do."}])
    assert proc.returncode == 0, proc.stderr
    assert "demo is not started" in proc.stderr
    assert not any(n.startswith("demo__") for n in report["offered"])
    assert registry(home, project)[0] is False


def test_approve_all_approves_the_server_for_this_run_only(tmp_path: Path, project: Path) -> None:
    home = tmp_path / "home"
    proc, report = agent(home, tmp_path, project, "all")
    assert proc.returncode == 0, proc.stderr
    assert "MCP server demo from .mcp.json approved for this run (--approve all)" in proc.stderr
    assert "Allow?" not in proc.stderr and "Approve demo" not in proc.stderr
    out = json.loads(proc.stdout)
    assert [(s["tool"], s["decision"], s["ok"]) for s in out["steps"]] == [("demo__add", "once", True)]
    assert "42" in report["tool_messages"][0]
    assert registry(home, project)[0] is False  # not saved: the next `ask` run asks


def test_approve_all_says_a_write_was_approved_not_allowed_by_a_rule(tmp_path: Path, project: Path) -> None:
    """--approve all answers each write's question: "approved", as a command's; "allowed by rule" is only for
    the project's own auto-approval of edits (a walkthrough saw every --approve all write called a rule)."""
    write = [{"call": "write_file", "arguments": {"path": "a.txt", "content": "A"}}, {"text": "Done."}]
    proc, _ = agent(tmp_path / "home", tmp_path, project, "all", script=write)
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout)["steps"]
    assert [(s["tool"], s["decision"], s["ok"]) for s in steps] == [("write_file", "once", True)], proc.stderr
    assert (project / "a.txt").read_text() == "A" and "allowed by rule" not in proc.stderr


def test_approve_all_never_writes_into_a_git_directory(tmp_path: Path, project: Path) -> None:
    """--approve all approves every edit but one into a git directory (or one that makes a folder one): such a
    write always asks, so here it is denied, its warning said (a walkthrough saw `print('hello')` land in a
    planted docs/HEAD with no word)."""
    for d in ("docs/objects", "docs/refs"):
        (project / d).mkdir(parents=True)
    (project / "docs" / "HEAD").write_text("ref: refs/heads/main\n")
    write = [
        {"call": "read_file", "arguments": {"path": "docs/HEAD"}},  # write_file replaces only a file it read
        {"call": "write_file", "arguments": {"path": "docs/HEAD", "content": "x"}},
        {"text": "Done."},
    ]
    proc, _ = agent(tmp_path / "home", tmp_path, project, "all", script=write)
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout)["steps"]
    assert [(s["tool"], s["decision"], s["ok"]) for s in steps] == [
        ("read_file", "none", True),
        ("write_file", "deny", False),
    ], proc.stderr
    assert (project / "docs" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert "Warning: this write leaves docs looking like a git directory" in proc.stderr


def test_approve_none_refuses_the_server_with_a_notice(tmp_path: Path, project: Path) -> None:
    home = tmp_path / "home"
    proc, report = agent(home, tmp_path, project, "none", script=[{"text": "I cannot add."}])
    assert proc.returncode == 0, proc.stderr
    assert (
        "MCP server demo from .mcp.json is not approved, and --approve none approves nothing: it is not "
        "started" in proc.stderr
    )
    assert f"flashcode tools --project {project.resolve()} --approve-server demo" in proc.stderr
    assert not any(n.startswith("demo__") for n in report["offered"])
    assert json.loads(proc.stdout)["answer"] == "I cannot add."
    # once approved (here by `flashcode tools`), --approve none still denies every call
    subprocess.run(
        [sys.executable, "-m", "webapp.cli", "tools", "--project", str(project), "--approve-server", "demo"],
        cwd=ROOT,
        env={**os.environ, "FLASHCODE_HOME": str(home)},
        capture_output=True,
        timeout=300,
        check=True,
    )
    proc, report = agent(home, tmp_path, project, "none")
    out = json.loads(proc.stdout)
    assert [(s["tool"], s["decision"]) for s in out["steps"]] == [("demo__add", "deny")], proc.stderr
    assert "Denied by the user: the agent runs with --approve none" in report["tool_messages"][0]


# --------------------------------------------------------------------------- the real model
@pytest.mark.slow
@pytest.mark.llama
def test_real_model_flashcode_agent_asks_for_the_server_and_the_call(
    tmp_path: Path, project: Path, model_home: Path
) -> None:
    from engine.llama_server import find_llama_server
    from webapp.agent.loop import DEFAULT_AGENT_MODEL

    if not (model_home / "models" / DEFAULT_AGENT_MODEL).is_dir():
        pytest.skip(f"the agent model {DEFAULT_AGENT_MODEL} is not installed (`make setup`)")
    try:
        find_llama_server()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"llama-server is not installed: {exc}")
    home = tmp_path / "home"
    home.mkdir()
    for sub in ("models", "gguf"):
        (home / sub).symlink_to(model_home / sub, target_is_directory=True)
    write_config(project, calc={"command": sys.executable, "args": [SERVER, "--only=add"]})
    proc = subprocess.run(
        [sys.executable, "-m", "webapp.cli", "agent", "--project", str(project), "--backend", "llama"]
        + ["--approve", "ask", "--max-steps", "1", "--max-tokens", "200"]
        + ["Use the calc__add tool to add 1234 and 4321, then tell me the sum."],
        cwd=ROOT,
        env={**os.environ, "FLASHCODE_HOME": str(home)},
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    # one step: the call, then the step limit before an answer (exit status 3, the task not answered)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    err = proc.stderr
    assert proc.returncode == 0 or "reached the step limit (1 steps)" in err  # answered at it, or not
    assert "names the MCP server calc, not approved yet" in err and "approved calc for" in err
    assert 'The agent wants to call the MCP tool: calc__add {"a": 1234, "b": 4321}' in err
    assert "-> ok (approved) '5555'" in err, err[-3000:]
