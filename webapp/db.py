"""SQLite storage for the web app: conversations and their messages, plus a tiny migration step.

What it knows: the schema, how to open the database (WAL, foreign keys), and the few queries the
web app needs. Later issues add tables by appending to `MIGRATIONS` (never editing a shipped one):
each entry runs once, in order, and is recorded in `schema_migrations`.

Message lifecycle: a user message is committed when sent. A reply is inserted as `streaming` when
it starts, its text is saved as it grows (`save_partial`), and it becomes `complete`, `stopped` or
`error` when it ends. A reply still `streaming` when the database is opened was cut by a crash: it
is marked `incomplete` and keeps the text that had streamed.

What it does not know: HTTP, websockets, engines. Calls are synchronous and short; the web app
makes them on the event loop (local file, small rows).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MessageStatus = str  # "complete" | "streaming" | "stopped" | "incomplete" | "error"

# (version, name, sql). Append only.
def _agent_migration(index: int = 0) -> str:
    from .agent.store import MIGRATIONS as AGENT_MIGRATIONS

    return AGENT_MIGRATIONS[index]


MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "conversations and messages",
        """
        CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            model TEXT,
            backend TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'complete',
            stats TEXT,
            created_at REAL NOT NULL
        );
        CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
        CREATE INDEX conversations_by_update ON conversations(updated_at);
        """,
    ),
    (2, "agent allow rules and actions", _agent_migration()),
    (3, "per-project sandbox settings", _agent_migration(1)),
]


SCHEMA_VERSION = max(v for v, _, _ in MIGRATIONS)  # also stored as PRAGMA user_version


class NewerDatabaseError(RuntimeError):
    """The database was migrated by a newer flashcode than this one."""


def stored_version(conn: sqlite3.Connection) -> int:
    """The schema version a database holds: PRAGMA user_version, or its newest recorded migration."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    try:
        recorded = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
    except sqlite3.OperationalError:  # no such table: a new or foreign database
        recorded = None
    return max(version, int(recorded or 0))


def check_version(conn: sqlite3.Connection, path: Path | None = None) -> None:
    found = stored_version(conn)
    if found > SCHEMA_VERSION:
        where = f"the database {path}" if path else "the database"
        raise NewerDatabaseError(
            f"{where} was written by a newer flashcode (schema version {found}; this one knows up to "
            f"{SCHEMA_VERSION}): upgrade flashcode, or pass another --data-dir"
        )


@dataclass
class Conversation:
    id: str
    title: str
    model: str | None
    backend: str | None
    created_at: float
    updated_at: float


@dataclass
class StoredMessage:
    id: int
    conversation_id: str
    role: str
    content: str
    status: MessageStatus
    created_at: float
    stats: dict[str, Any] = field(default_factory=dict)


class Database:
    """One connection, used from the event loop thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        check_version(self.conn, path)
        migrate(self.conn)
        self.recovered = self._mark_interrupted()

    def close(self) -> None:
        self.conn.close()

    def _mark_interrupted(self) -> int:
        return self.conn.execute("UPDATE messages SET status='incomplete' WHERE status='streaming'").rowcount

    # ------------------------------------------------------------------ conversations
    def create_conversation(self, title: str = "Untitled", model: str | None = None,
                            backend: str | None = None) -> Conversation:  # fmt: skip
        now = time.time()
        conv = Conversation(uuid.uuid4().hex[:12], title, model, backend, now, now)
        self.conn.execute(
            "INSERT INTO conversations (id, title, model, backend, created_at, updated_at) VALUES (?,?,?,?,?,?)",
            (conv.id, conv.title, conv.model, conv.backend, now, now),
        )
        return conv

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        row = self.conn.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return Conversation(**dict(row)) if row else None

    def list_conversations(self) -> list[Conversation]:
        rows = self.conn.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id").fetchall()
        return [Conversation(**dict(r)) for r in rows]

    def rename_conversation(self, conversation_id: str, title: str) -> bool:
        cur = self.conn.execute("UPDATE conversations SET title=?, updated_at=? WHERE id=?",
                                (title, time.time(), conversation_id))  # fmt: skip
        return cur.rowcount == 1

    def delete_conversation(self, conversation_id: str) -> bool:
        return self.conn.execute("DELETE FROM conversations WHERE id=?", (conversation_id,)).rowcount == 1

    def touch(self, conversation_id: str, model: str | None = None, backend: str | None = None) -> None:
        self.conn.execute(
            "UPDATE conversations SET updated_at=?, model=COALESCE(?, model), backend=COALESCE(?, backend) WHERE id=?",
            (time.time(), model, backend, conversation_id),
        )

    # ------------------------------------------------------------------ messages
    def add_message(self, conversation_id: str, role: str, content: str,
                    status: MessageStatus = "complete") -> StoredMessage:  # fmt: skip
        now = time.time()
        cur = self.conn.execute(
            "INSERT INTO messages (conversation_id, role, content, status, created_at) VALUES (?,?,?,?,?)",
            (conversation_id, role, content, status, now),
        )
        self.touch(conversation_id)
        return StoredMessage(int(cur.lastrowid or 0), conversation_id, role, content, status, now)

    def save_partial(self, message_id: int, content: str) -> None:
        self.conn.execute(
            "UPDATE messages SET content=? WHERE id=? AND status='streaming'", (content, message_id)
        )

    def finish_message(self, message_id: int, content: str, status: MessageStatus,
                       stats: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.conn.execute("UPDATE messages SET content=?, status=?, stats=? WHERE id=?",
                          (content, status, json.dumps(stats) if stats else None, message_id))  # fmt: skip

    def delete_message(self, message_id: int) -> None:
        self.conn.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def messages(self, conversation_id: str) -> list[StoredMessage]:
        rows = self.conn.execute("SELECT * FROM messages WHERE conversation_id=? ORDER BY id",
                                 (conversation_id,)).fetchall()  # fmt: skip
        return [_message(r) for r in rows]


def _message(row: sqlite3.Row) -> StoredMessage:
    d = dict(row)
    d["stats"] = json.loads(d["stats"]) if d.get("stats") else {}
    return StoredMessage(**d)


def migrate(conn: sqlite3.Connection) -> list[int]:
    """Apply the migrations not yet recorded; returns the versions applied now."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
    )
    done = {r[0] for r in conn.execute("SELECT version FROM schema_migrations")}
    applied = []
    for version, name, sql in MIGRATIONS:
        if version in done:
            continue
        conn.execute("BEGIN")
        try:
            for statement in sql.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT INTO schema_migrations VALUES (?,?,?)", (version, name, time.time()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(version)
    if stored_version(conn) <= SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return applied


def export_markdown(conv: Conversation, messages: list[StoredMessage]) -> str:
    lines = [f"# {conv.title}", ""]
    if conv.model:
        lines += [f"_model: {conv.model} ({conv.backend or '?'})_", ""]
    for m in messages:
        note = "" if m.status == "complete" else f" _({m.status})_"
        lines += [f"## {m.role.capitalize()}{note}", "", m.content, ""]
    return "\n".join(lines)


def export_json(conv: Conversation, messages: list[StoredMessage]) -> dict[str, Any]:
    return {
        "id": conv.id,
        "title": conv.title,
        "model": conv.model,
        "backend": conv.backend,
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created_at": m.created_at,
                "stats": m.stats,
            }  # fmt: skip
            for m in messages
        ],
    }
