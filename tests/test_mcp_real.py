"""An MCP tool called by the real agent model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, temperature 0,
llama-server with its JSON-schema grammar: constrained tool calls) in a project whose `.mcp.json`
names the SDK test server (`tests/data/mcp_server.py --only=add`), run in the sandbox: approved
once (the result reaches the model and its answer), denied (the denial reaches the model), and
allowed by a rule (no dialog). Which tool the model picks is its own; the task names the tool."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.worker import Worker
from webapp.agent import events as ev
from webapp.agent.agent import AgentSession
from webapp.agent.loop import DEFAULT_AGENT_MODEL
from webapp.agent.mcp import McpServers
from webapp.agent.mcp_store import McpStore
from webapp.agent.search import LocalSearchProvider
from webapp.agent.store import AgentStore
from webapp.db import connect_memory

pytestmark = [pytest.mark.slow, pytest.mark.llama]
SERVER = str(Path(__file__).parent / "data" / "mcp_server.py")
TASK = "Use the calc__add tool to add 1234 and 4321, then tell me the sum."


@pytest.fixture(scope="module")
def llama_worker(model_home: Path) -> Iterator[Worker]:
    from engine.llama_server import LlamaServerBackend, find_llama_server
    from engine.models import find_model

    if not (model_home / "models" / DEFAULT_AGENT_MODEL).is_dir():
        pytest.skip(f"the agent model {DEFAULT_AGENT_MODEL} is not installed (`make setup`)")
    try:
        find_llama_server()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"llama-server is not installed: {exc}")
    model = find_model(DEFAULT_AGENT_MODEL, model_home)

    def make() -> LlamaServerBackend:
        b = LlamaServerBackend(threads=1, context_length=8192)
        b.load(model)
        return b

    w = Worker(make)
    yield w
    w.close()


def test_real_model_calls_an_mcp_tool_through_approval(llama_worker: Worker, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / ".mcp.json").write_text(
        json.dumps({"mcpServers": {"calc": {"command": sys.executable, "args": [SERVER, "--only=add"]}}})
    )
    store = AgentStore(connect_memory())
    mstore = McpStore(store.conn)
    cfg = mstore.servers(str(project.resolve()), project).servers[0]
    mstore.approve(str(project.resolve()), "calc", cfg.fingerprint)
    answers = [
        ev.Decision.once(),
        ev.Decision.deny("use mental arithmetic instead"),
        ev.Decision.always_exact(),
    ]
    asked: list[ev.Proposal] = []
    sessions: list[AgentSession] = []

    async def approve(p: ev.Proposal) -> ev.Decision:
        asked.append(p)
        return answers[len(sessions) - 1]  # one decision per turn

    servers = McpServers()

    def session() -> AgentSession:
        s = AgentSession(
            llama_worker,
            project,
            request_approval=approve,
            store=store,
            search=LocalSearchProvider(),
            max_steps=1,  # one call per turn (a small model may call again)
        )
        s.mcp = servers  # type: ignore[attr-defined]
        s.sampling = s.sampling.__class__(temperature=0.0, max_tokens=200)
        return s

    async def main() -> list[list]:
        out = []
        try:
            for _ in range(4):  # once, deny, always (saves the rule), then the rule alone
                sessions.append(session())
                out.append([e async for e in sessions[-1].run_turn(TASK)])
        finally:
            await servers.close_all()
        return out

    once, denied, always, ruled = asyncio.run(main())

    def mcp_steps(events: list) -> list[ev.ToolStepDone]:
        return [e for e in events if isinstance(e, ev.ToolStepDone) and e.tool == "calc__add"]

    first = mcp_steps(once)
    assert first, [e for e in once if isinstance(e, ev.ToolStep | ev.Notice)]
    call = next(e for e in once if isinstance(e, ev.ToolStep) and e.tool == "calc__add")
    assert call.arguments == {"a": 1234, "b": 4321}  # constrained: integers, as the schema says
    assert first[0].ok and first[0].decision == "once" and first[0].result == "5555"
    assert asked[0].tool == "mcp" and asked[0].command.startswith("calc__add ")
    to_model = [m["content"] for m in sessions[0].loop.messages if m["role"] == "tool"]  # type: ignore[union-attr]
    assert to_model[0].startswith('<untrusted source="tool calc__add">') and "5555" in to_model[0]
    no = mcp_steps(denied)
    assert no and not no[0].ok and no[0].decision == "deny"
    denial = [m["content"] for m in sessions[1].loop.messages if m["role"] == "tool"]  # type: ignore[union-attr]
    assert "Denied by the user: use mental arithmetic instead" in denial[0]
    assert mcp_steps(always)[0].decision == "always_exact"
    assert [r.tool for r in mstore.tool_rules(str(project.resolve()))] == ["calc__add"]
    by_rule = mcp_steps(ruled)
    assert by_rule and by_rule[0].decision == "rule" and by_rule[0].result == "5555"
    assert len(asked) == 3  # the fourth call asked no one
