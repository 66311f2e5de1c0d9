"""The agent's rows in SQLite: per-project allow rules and network switch, and every proposal with
its decision (the audit trail).

What it knows: the queries on `agent_allow_rules`, `agent_actions`, `agent_project_settings` and
`agent_file_changes` (their schema is in `webapp.db`'s migration list). What it does not know: the policy (`shell.py`)
and the UI. Calls are short and synchronous.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass

from .files import text_sha256
from .shell import Rule, RuleKind, validate_rule


@dataclass(frozen=True)
class FileChangeRecord:
    """A write of the agent's file tools, as undo needs it: the file's text before (None: the write made the
    file) and a hash of the text the write left."""

    action_id: int
    project: str
    conversation_id: str | None
    path: str
    before: str | None
    after_sha256: str
    created_at: float
    undone_at: float | None
    made_dirs: int = 0  # the path's deepest folders the write made (an undo of a made file removes them)


@dataclass(frozen=True)
class ActionRecord:
    id: int
    project: str
    tool: str
    command: str
    decision: str
    rule: str | None
    reason: str | None
    exit_code: int | None
    outcome: str | None
    created_at: float


class AgentStore:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    # ------------------------------------------------------------------ sandbox settings
    def network_allowed(self, project: str) -> bool:
        """Whether the project's commands may use the network (off unless the user turned it on)."""
        row = self.conn.execute("SELECT network FROM agent_project_settings WHERE project = ?", (project,))
        found = row.fetchone()
        return bool(found and found[0])

    def set_network_allowed(self, project: str, allowed: bool) -> None:
        self.conn.execute(
            "INSERT INTO agent_project_settings (project, network, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (project) DO UPDATE SET network = excluded.network, updated_at = excluded.updated_at",
            (project, int(allowed), time.time()),
        )
        self.conn.commit()

    def edits_approved(self, project: str) -> bool:
        """Whether the agent's file edits in the project are approved without asking (off by default)."""
        row = self.conn.execute(
            "SELECT approve_edits FROM agent_project_settings WHERE project = ?", (project,)
        )
        found = row.fetchone()
        return bool(found and found[0])

    def set_edits_approved(self, project: str, on: bool) -> None:
        self.conn.execute(
            "INSERT INTO agent_project_settings (project, approve_edits, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (project) DO UPDATE SET approve_edits = excluded.approve_edits, "
            "updated_at = excluded.updated_at",
            (project, int(on), time.time()),
        )
        self.conn.commit()

    # ------------------------------------------------------------------ allow rules
    def add_rule(self, project: str, kind: RuleKind, pattern: str) -> Rule:
        rule = validate_rule(kind, pattern)
        self.conn.execute(
            "INSERT OR IGNORE INTO agent_allow_rules (project, kind, pattern, created_at) VALUES (?, ?, ?, ?)",
            (project, rule.kind, rule.pattern, time.time()),
        )
        self.conn.commit()
        row = self.conn.execute(
            "SELECT id FROM agent_allow_rules WHERE project = ? AND kind = ? AND pattern = ?",
            (project, rule.kind, rule.pattern),
        ).fetchone()
        return Rule(rule.kind, rule.pattern, int(row[0]))

    def list_rules(self, project: str) -> list[Rule]:
        rows = self.conn.execute(
            "SELECT id, kind, pattern FROM agent_allow_rules WHERE project = ? AND kind IN ('exact', 'prefix') "
            "ORDER BY id",
            (project,),
        ).fetchall()  # the shell's rules (MCP tools' rules, kind 'tool', are webapp.agent.mcp_store's)
        return [Rule(kind, pattern, int(id_)) for id_, kind, pattern in rows]

    def remove_rule(self, project: str, rule_id: int) -> bool:
        if not 0 < rule_id < 2**63:  # no such row (SQLite's ids are 64-bit: a larger one would not bind)
            return False
        cur = self.conn.execute(
            "DELETE FROM agent_allow_rules WHERE project = ? AND id = ?", (project, rule_id)
        )
        self.conn.commit()
        return cur.rowcount > 0

    # ------------------------------------------------------------------ the audit trail
    def record_proposal(
        self, project: str, tool: str, command: str, conversation_id: str | None = None
    ) -> int:
        cur = self.conn.execute(
            "INSERT INTO agent_actions (project, conversation_id, tool, command, created_at) VALUES (?, ?, ?, ?, ?)",
            (project, conversation_id, tool, command, time.time()),
        )
        self.conn.commit()
        return int(cur.lastrowid or 0)

    def record_decision(
        self, action_id: int, decision: str, rule: str | None = None, reason: str | None = None
    ) -> None:
        self.conn.execute(
            "UPDATE agent_actions SET decision = ?, rule = ?, reason = ?, decided_at = ? WHERE id = ?",
            (decision, rule, reason, time.time(), action_id),
        )
        self.conn.commit()

    def record_result(self, action_id: int, exit_code: int | None, outcome: str) -> None:
        self.conn.execute(
            "UPDATE agent_actions SET exit_code = ?, outcome = ?, finished_at = ? WHERE id = ?",
            (exit_code, outcome, time.time(), action_id),
        )
        self.conn.commit()

    # ------------------------------------------------------------------ earlier text of written files
    _CHANGE_COLUMNS = (
        "action_id, project, conversation_id, path, before, after_sha256, created_at, undone_at, made_dirs"
    )

    def record_file_change(
        self,
        action_id: int,
        project: str,
        conversation_id: str | None,
        path: str,
        before: str | None,
        after: str,
        made_dirs: int = 0,
    ) -> None:
        """Keep what a write replaced (`before`; None: it made the file, and `made_dirs` of its folders), so
        that it can be undone."""
        self.conn.execute(
            f"INSERT INTO agent_file_changes ({self._CHANGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)",
            (action_id, project, conversation_id, path, before, text_sha256(after), time.time(), made_dirs),
        )
        self.conn.commit()

    def file_change(self, action_id: int) -> FileChangeRecord | None:
        row = self.conn.execute(
            f"SELECT {self._CHANGE_COLUMNS} FROM agent_file_changes WHERE action_id = ?", (action_id,)
        ).fetchone()
        return FileChangeRecord(*row) if row else None

    def file_changes(self, project: str | None, limit: int = 50) -> list[FileChangeRecord]:
        """The project's file changes (None: every project's, a removed one's kept data too), newest first."""
        where, args = ("WHERE project = ? ", (project,)) if project is not None else ("", ())
        rows = self.conn.execute(
            f"SELECT {self._CHANGE_COLUMNS} FROM agent_file_changes {where}ORDER BY action_id DESC LIMIT ?",
            (*args, limit),
        ).fetchall()
        return [FileChangeRecord(*row) for row in rows]

    def mark_undone(self, action_id: int) -> None:
        self.conn.execute(
            "UPDATE agent_file_changes SET undone_at = ? WHERE action_id = ?", (time.time(), action_id)
        )
        self.conn.commit()

    def actions(self, project: str | None = None, limit: int = 100) -> list[ActionRecord]:
        sql = "SELECT id, project, tool, command, decision, rule, reason, exit_code, outcome, created_at FROM agent_actions"
        args: tuple = ()
        if project is not None:
            sql += " WHERE project = ?"
            args = (project,)
        rows = self.conn.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [ActionRecord(*row) for row in rows]
