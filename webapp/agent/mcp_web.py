"""Settings › MCP servers: the open project's servers and their tools' allow rules, over HTTP.

Routes (every POST passed `webapp.security`'s CSRF and Origin checks before it arrives; each answers
with the redrawn list, `templates/agent/mcp.html`):

    GET  /agent/mcp                         the list
    POST /agent/mcp/add                     name, command, args (one per line), env (NAME=value lines) | url
    POST /agent/mcp/{name}/enable           enabled=on|off (off also stops it)
    POST /agent/mcp/{name}/approve          fingerprint: approve exactly this .mcp.json config
    POST /agent/mcp/{name}/remove           a server added here (stops it)
    POST /agent/mcp/rules/{id}/delete       an MCP tool's allow rule

What it knows: URLs and forms. What it does not know: SQL (`mcp_store.McpStore`), processes
(`mcp.McpServers`). Servers of projects no longer registered are stopped when the list is drawn.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from ..turns import ProjectLookup, ProjectRef
from .mcp import McpServers, shared
from .mcp_config import McpConfigError
from .mcp_store import McpStore


def command_problem(command: str, project: Path | None) -> str | None:
    """Why a stdio server's command cannot start, as far as can be told before it runs (None: it may). It runs in
    the sandbox, where /tmp is its own and empty: one installed there was listed "enabled" and failed every turn
    ("bwrap: execvp …: No such file or directory")."""
    if not command:
        return None  # the config's own check says what is missing
    if "/" in command:
        path = Path(
            os.path.abspath(Path(project or Path.cwd()) / command)
        )  # an absolute command stays itself
        inside = project is not None and path.is_relative_to(Path(os.path.abspath(project)))
        if path.is_relative_to("/tmp") and not inside:  # the project itself is there, when it lies in /tmp
            return (
                f"{command} is under /tmp, which the sandbox gives each server empty: install the server elsewhere "
                "(in the project, or your home)"
            )
        return None if os.access(path, os.X_OK) and path.is_file() else f"{command} is not an executable file"
    return None if shutil.which(command) else f"{command} is not found on PATH: give its full path"


class McpWeb:
    def __init__(
        self,
        store: McpStore,
        env: Environment,
        current: Any,  # () -> ProjectRef: the open project
        projects: ProjectLookup | None = None,
        servers: McpServers | None = None,
    ) -> None:
        self.store, self.current, self.projects = store, current, projects
        self.servers = servers or shared()
        self.ui: Any = env.get_template("agent/mcp.html").module

    @property
    def routes(self) -> list[Route]:
        return [
            Route("/agent/mcp", self.page),
            Route("/agent/mcp/add", self.add, methods=["POST"]),
            Route("/agent/mcp/rules/{rule_id:int}/delete", self.delete_rule, methods=["POST"]),
            Route("/agent/mcp/{name}/enable", self.enable, methods=["POST"]),
            Route("/agent/mcp/{name}/approve", self.approve, methods=["POST"]),
            Route("/agent/mcp/{name}/remove", self.remove, methods=["POST"]),
        ]

    async def _html(self, error: str = "") -> HTMLResponse:
        ref: ProjectRef = self.current()
        if self.projects is not None:
            await self.servers.sweep({p.id for p in self.projects.all()})
        found = self.store.servers(ref.id, ref.path)
        shown = f"{ref.name} ({ref.path})" if ref.name else str(ref.path)
        html = self.ui.mcp_servers(
            shown,
            found.servers,
            self.store.tool_rules(ref.id),
            self.servers.running(ref.id),
            error,
            found.file_error or "",
            ref.id,
        )
        return HTMLResponse(str(html))

    STALE = "another project was opened since this window showed its MCP servers; they are shown now, check them and"

    def _stale(self, form: Any) -> bool:
        """Whether the list was drawn for another project than the one open now (another window opened one
        since): an approval would land on a project whose `.mcp.json` the user never saw."""
        return str(form.get("project") or "") != self.current().id

    async def page(self, request: Request) -> HTMLResponse:
        return await self._html()

    async def add(self, request: Request) -> HTMLResponse:
        form = await request.form()
        if self._stale(form):
            return await self._html(f"Not added: {self.STALE} add it again")
        name = str(form.get("name") or "").strip()
        url = str(form.get("url") or "").strip()
        command = str(form.get("command") or "").strip()
        not_added = f"{name or 'the server'} was not added:"
        ref = self.current()
        if url and command:  # the command was dropped, unsaid, and the server taken for an http one
            return await self._html(
                f"{not_added} give a command (a server it starts) or a URL (one running), not both"
            )
        if url:
            entry: dict[str, Any] = {"type": "http", "url": url}
        else:
            if problem := command_problem(command, ref.path):
                return await self._html(f"{not_added} {problem}")
            args = [a.strip() for a in str(form.get("args") or "").splitlines() if a.strip()]
            env: dict[str, str] = {}
            for line in str(form.get("env") or "").splitlines():
                if line.strip():
                    key, sep, value = line.strip().partition("=")
                    if not sep or not key:
                        return await self._html(
                            f"{not_added} environment lines are NAME=value: {line.strip()[:60]!r}"
                        )
                    env[key.strip()] = value
            entry = {"command": command, "args": args, "env": env}
        listed = {s.name: s for s in self.store.servers(ref.id, ref.path).servers}.get(name)
        if listed is not None and listed.source == "settings":  # it was replaced, unsaid (walkthrough)
            return await self._html(
                f"{not_added} a server named {name} is on the list already: to change it, remove it first; "
                "or give this one another name"
            )
        try:
            self.store.add(ref.id, name, entry)
        except McpConfigError as exc:
            return await self._html(f"{name or 'the server'} was not added: {exc}")
        await self.servers.stop(ref.id, name)  # a replaced config starts afresh
        return await self._html()

    async def enable(self, request: Request) -> HTMLResponse:
        form = await request.form()
        if self._stale(form):
            return await self._html(f"Not changed: {self.STALE} change it again")
        name, ref = request.path_params["name"], self.current()
        on = form.get("enabled") == "on"
        try:
            self.store.set_enabled(ref.id, name, on)
        except McpConfigError as exc:
            return await self._html(str(exc))
        if not on:
            await self.servers.stop(ref.id, name)
        return await self._html()

    async def approve(self, request: Request) -> HTMLResponse:
        form = await request.form()
        if self._stale(form):
            return await self._html(f"Not approved: {self.STALE} approve it again")
        name, ref = request.path_params["name"], self.current()
        found = {s.name: s for s in self.store.servers(ref.id, ref.path).servers}.get(name)
        if found is None or found.source != "file" or found.error:
            return await self._html(f"there is no usable .mcp.json server {name!r}")
        if form.get("fingerprint") != found.fingerprint:  # the file changed after the list was drawn
            return await self._html(f".mcp.json changed: look at {name} again before approving it")
        self.store.approve(ref.id, name, found.fingerprint)
        return await self._html()

    async def remove(self, request: Request) -> HTMLResponse:
        if self._stale(await request.form()):
            return await self._html(f"Not removed: {self.STALE} remove it again")
        name, ref = request.path_params["name"], self.current()
        self.store.remove(ref.id, name)
        await self.servers.stop(ref.id, name)
        return await self._html()

    async def delete_rule(self, request: Request) -> HTMLResponse:
        if self._stale(await request.form()):
            return await self._html(f"Not removed: {self.STALE} remove it again")
        self.store.remove_tool_rule(self.current().id, int(request.path_params["rule_id"]))
        return await self._html()
