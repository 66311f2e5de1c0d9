"""MCP rows in SQLite: each project's servers from Settings and switches for its `.mcp.json` ones
(`mcp_servers`), and the allow rules of MCP tools (kind 'tool' in the agent's `agent_allow_rules`,
one rule per `server__tool` per project).

What it knows: those queries (the schema is migration 7 in `webapp.db`) and how a project's
configured servers come together (`servers()`: `.mcp.json`, then Settings, with the user's
switches). What it does not know: processes, the UI. Calls are short and synchronous.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .mcp_config import NAME_RE, McpConfigError, ServerConfig, parse_entry, read_file_config


@dataclass(frozen=True)
class ToolRule:
    id: int
    tool: str  # server__tool


@dataclass(frozen=True)
class ProjectServers:
    servers: list[ServerConfig]
    file_error: str | None  # why .mcp.json could not be read (None: fine or absent)


class McpStore:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    # ------------------------------------------------------------------ servers
    def _rows(self, project: str) -> dict[str, tuple[str | None, bool, str | None]]:
        rows = self.conn.execute(
            "SELECT name, config, enabled, approved FROM mcp_servers WHERE project = ?", (project,)
        ).fetchall()
        return {name: (config, bool(enabled), approved) for name, config, enabled, approved in rows}

    def servers(self, project: str, project_dir: Path) -> ProjectServers:
        """Every server of the project: `.mcp.json`'s (with the user's switches), then those added in
        Settings (which replace a `.mcp.json` server of the same name), in that order."""
        from_file, error = read_file_config(project_dir)
        rows = self._rows(project)
        out: dict[str, ServerConfig] = {}
        for cfg in from_file:
            _, enabled, approved = rows.get(cfg.name, (None, True, None))
            out[cfg.name] = replace(
                cfg, enabled=enabled and cfg.error is None, approved=approved == cfg.fingerprint
            )
        for name, (config, enabled, _) in rows.items():
            if config is None:
                continue
            try:
                entry = json.loads(config)
            except json.JSONDecodeError:
                entry = None
            out[name] = replace(parse_entry(name, entry, "settings"), enabled=enabled)
        return ProjectServers(list(out.values()), error)

    def add(self, project: str, name: str, entry: dict) -> ServerConfig:
        """Add (or replace) a server from Settings; McpConfigError if the entry is not usable."""
        cfg = parse_entry(name, entry, "settings")
        if cfg.error:
            raise McpConfigError(cfg.error)
        now = time.time()
        self.conn.execute(
            "INSERT INTO mcp_servers (project, name, config, enabled, approved, created_at, updated_at) "
            "VALUES (?, ?, ?, 1, NULL, ?, ?) ON CONFLICT (project, name) DO UPDATE SET "
            "config = excluded.config, enabled = 1, updated_at = excluded.updated_at",
            (project, name, json.dumps(cfg.as_written()), now, now),
        )
        self.conn.commit()
        return cfg

    def _upsert(self, project: str, name: str, column: str, value: object) -> None:
        if not NAME_RE.fullmatch(name):
            raise McpConfigError("a server name is 1-40 letters, digits, '_' or '-'")
        now = time.time()
        self.conn.execute(
            f"INSERT INTO mcp_servers (project, name, {column}, created_at, updated_at) VALUES (?, ?, ?, ?, ?) "
            f"ON CONFLICT (project, name) DO UPDATE SET {column} = excluded.{column}, "
            "updated_at = excluded.updated_at",
            (project, name, value, now, now),
        )
        self.conn.commit()

    def set_enabled(self, project: str, name: str, enabled: bool) -> None:
        self._upsert(project, name, "enabled", int(enabled))

    def approve(self, project: str, name: str, fingerprint: str) -> None:
        """The user approved this `.mcp.json` config (and it is enabled)."""
        self._upsert(project, name, "approved", fingerprint)
        self.set_enabled(project, name, True)

    def remove(self, project: str, name: str) -> bool:
        """Forget a server added in Settings (or the switches for a `.mcp.json` one)."""
        cur = self.conn.execute("DELETE FROM mcp_servers WHERE project = ? AND name = ?", (project, name))
        self.conn.commit()
        return cur.rowcount > 0

    # ------------------------------------------------------------------ tool allow rules
    def tool_rules(self, project: str) -> list[ToolRule]:
        rows = self.conn.execute(
            "SELECT id, pattern FROM agent_allow_rules WHERE project = ? AND kind = 'tool' ORDER BY id",
            (project,),
        ).fetchall()
        return [ToolRule(int(i), p) for i, p in rows]

    def tool_rule(self, project: str, tool: str) -> ToolRule | None:
        return next((r for r in self.tool_rules(project) if r.tool == tool), None)

    def allow_tool(self, project: str, tool: str) -> ToolRule:
        self.conn.execute(
            "INSERT OR IGNORE INTO agent_allow_rules (project, kind, pattern, created_at) VALUES (?, 'tool', ?, ?)",
            (project, tool, time.time()),
        )
        self.conn.commit()
        found = self.tool_rule(project, tool)
        assert found is not None
        return found

    def remove_tool_rule(self, project: str, rule_id: int) -> bool:
        if not 0 < rule_id < 2**63:  # no such row (SQLite's ids are 64-bit: a larger one would not bind)
            return False
        cur = self.conn.execute(
            "DELETE FROM agent_allow_rules WHERE project = ? AND id = ? AND kind = 'tool'", (project, rule_id)
        )
        self.conn.commit()
        return cur.rowcount > 0
