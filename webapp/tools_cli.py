"""`flashcode tools [--project DIR] [--json] [--approve-server NAME]`: every tool the agent would get
in a project — the built-in ones and those of the project's MCP servers (`.mcp.json` and Settings),
which it starts to list them — with its source (`built-in` or the server's name) and whether a call
needs approval. `--approve-server NAME` first approves the `.mcp.json` server NAME as it is
configured now (what Settings › MCP servers › Approve does). Servers that are not used are named on
stderr (or under "notices" with `--json`). The project is added to `flashcode projects` if new.

Text output: one line per tool, tab-separated: name, source, approval, description. Part of the
command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine import paths

from . import cli_projects, preflight
from .agent import events as ev
from .agent.mcp import McpServers, McpTools, summary
from .agent.mcp_store import McpStore
from .agent.store import AgentStore
from .agent.tools import SPECS
from .agent.web import hidden_paths
from .render import visible_text
from .units import HELP

BUILTIN_APPROVAL = {
    "none": (False, "no"),
    "write": (True, "yes: every write shows its diff and asks"),
    "shell": (True, "yes, unless an allow rule matches the command"),
}


def builtin_rows(network: bool) -> list[dict[str, Any]]:
    rows = []
    for spec in SPECS:
        if spec.effect == "network":
            needs, text = False, f"no; needs the project's network switch (now {'on' if network else 'off'})"
        else:
            needs, text = BUILTIN_APPROVAL[spec.effect]
        rows.append(
            {
                "name": spec.name,
                "source": "built-in",
                "needs_approval": needs,
                "approval": text,
                "description": spec.description,
            }
        )
    return rows


async def collect(store: AgentStore, project: str, project_dir: Path, hidden: tuple[Path, ...]) -> dict:
    servers = McpServers()
    session = SimpleNamespace(store=store, project=project, project_dir=project_dir, hidden=hidden)
    tools = McpTools(session, servers)  # type: ignore[arg-type]
    notices: list[str] = []
    try:
        async for e in tools.load():
            if isinstance(e, ev.Notice):
                notices.append(e.text)
    finally:
        await servers.close_all()
    mstore = McpStore(store.conn)
    rows = builtin_rows(store.network_allowed(project))
    for name, tool in tools.tools.items():
        launch = tools.launches[name]
        _, sandboxed = launch.describe_sandbox()
        rule = mstore.tool_rule(project, name)
        allowed = rule is not None and (launch.remote or sandboxed)
        rows.append(
            {
                "name": name,
                "source": tool.server,
                "needs_approval": not allowed,
                "approval": "no: allowed by a rule for this tool" if allowed else "yes: every call asks",
                "description": tool.description,
            }
        )
    configured = mstore.servers(project, project_dir).servers
    return {"tools": rows, "servers": [summary(c) for c in configured], "notices": notices}


def cmd_tools(args: argparse.Namespace) -> int:
    if args.data_dir:
        os.environ[paths.ENV_HOME] = os.path.abspath(os.path.expanduser(args.data_dir))
    folder = cli_projects.project_dir(args)
    db, projects = cli_projects._store()
    try:
        ref = projects.add(folder) if folder is not None else projects.current()
        store = AgentStore(db.conn)
        mstore = McpStore(db.conn)
        for name in args.approve_server or []:
            found = {s.name: s for s in mstore.servers(ref.id, ref.path).servers}.get(name)
            if found is None or found.source != "file" or found.error:
                raise preflight.StartupError(
                    f"--approve-server: there is no usable .mcp.json server {name!r}"
                )
            mstore.approve(ref.id, name, found.fingerprint)
            # all of what was approved, as the agent's prompt and Settings show it: the environment a stdio
            # server gets, the headers sent to an HTTP one, the variables a ${VAR} reads
            more = "".join(f"\n  {line}" for line in found.details())
            print(visible_text(f"approved {name}: {found.describe()}{more}"), file=sys.stderr)
        hidden = hidden_paths(projects.data_dir)
        result = asyncio.run(collect(store, ref.id, ref.path, hidden))
    finally:
        db.close()
    if args.json:
        print(json.dumps({"project": {"id": ref.id, "name": ref.name, "path": str(ref.path)}, **result}))
        return 0
    # MCP servers name and describe their own tools: their hidden characters are marked, one line each
    for note in result["notices"]:
        print(visible_text(f"# {note}"), file=sys.stderr)
    for row in result["tools"]:
        cells = (row["name"], row["source"], row["approval"], row["description"])
        print("\t".join(visible_text(str(c)).replace("\t", " ").replace("\n", " ") for c in cells))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tools", help="list the tools the agent would get in a project (built-in and MCP), and which ask"
    )
    cli_projects.add_project_arg(
        p, "the project whose tools to list (added to the projects if new; default: the open one)"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object: project, tools, servers, notices"
    )
    p.add_argument(
        "--approve-server",
        action="append",
        metavar="NAME",
        help="approve the .mcp.json server NAME as configured now (repeatable)",
    )
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_tools)
