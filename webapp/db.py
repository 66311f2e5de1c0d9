"""SQLite storage: the one schema of flashcode's database, its migrations, and conversations.

What it knows: every table and how each came to be (`MIGRATIONS`, the one list), how to open the
database (WAL, foreign keys), and the conversation and message queries. Tables and who queries them:

    conversations, messages            webapp.db (this module), for the chat
    agent_allow_rules, agent_actions,  webapp.agent.store
    agent_project_settings,
    agent_file_changes
    stats_replies, stats_grades,       webapp.stats.store
    stats_bench_runs
    projects                           webapp.projects.store (conversations.project_id: this module)
    mcp_servers                        webapp.agent.mcp_store

Migrations. Each step is `(version, name, statements)`: statements run one by one, in one
transaction with `PRAGMA user_version = version`, so a step is applied whole or not at all and
`user_version` says which steps a database has. `schema_migrations` keeps when each step ran (and
is how databases from before `user_version` was written say their version). Steps are appended,
never edited: a shipped step is what an old database already holds. They run once, when
`Database` opens (at start-up); a database from a newer flashcode is refused before it is touched.

Message lifecycle: a user message is committed when sent. A reply is inserted as `streaming` when
it starts, its text is saved as it grows (`save_partial`), and it becomes `complete`, `stopped` or
`error` when it ends. A reply still `streaming` when the database is opened was cut by a crash: it
is marked `incomplete` and keeps the text that had streamed.

What it does not know: HTTP, websockets, engines. Calls are synchronous and short; the web app
makes them on the event loop (local file, small rows).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import re
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, NamedTuple

MessageStatus = str  # "complete" | "streaming" | "stopped" | "incomplete" | "error"
UNTITLED = "Untitled"  # a conversation's title until its first message to the model names it
REPLACED = "reply_replaced"  # the event a reply that Regenerate replaced leaves in the transcript, folded


class Migration(NamedTuple):
    version: int
    name: str
    statements: tuple[str, ...] | str  # a str is one statement


MIGRATIONS: list[Migration] = [
    Migration(
        1,
        "conversations and messages",
        (
            """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            model TEXT,
            backend TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
            """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'complete',
            stats TEXT,
            created_at REAL NOT NULL
        )""",
            "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
            "CREATE INDEX conversations_by_update ON conversations(updated_at)",
        ),
    ),
    # IF NOT EXISTS from here on: before this list owned them, the agent and the stats created their
    # tables themselves, so a database of that time may hold them without the step recorded
    Migration(
        2,
        "agent allow rules and actions",
        (
            """CREATE TABLE IF NOT EXISTS agent_allow_rules (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            project TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('exact', 'prefix')),
            pattern TEXT NOT NULL,
            created_at REAL NOT NULL,
            UNIQUE (project, kind, pattern)
        )""",
            """CREATE TABLE IF NOT EXISTS agent_actions (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            project TEXT NOT NULL,
            conversation_id TEXT,
            tool TEXT NOT NULL,
            command TEXT NOT NULL,
            decision TEXT NOT NULL DEFAULT 'pending',
            rule TEXT,
            reason TEXT,
            exit_code INTEGER,
            outcome TEXT,
            created_at REAL NOT NULL,
            decided_at REAL,
            finished_at REAL
        )""",
            "CREATE INDEX IF NOT EXISTS agent_actions_project ON agent_actions (project, created_at)",
        ),
    ),
    Migration(
        3,
        "per-project sandbox settings",
        (
            """CREATE TABLE IF NOT EXISTS agent_project_settings (
            project TEXT PRIMARY KEY,
            network INTEGER NOT NULL DEFAULT 0,
            updated_at REAL NOT NULL
        )""",
        ),
    ),
    Migration(
        4,
        "reply stats, grades and bench runs",
        (
            """CREATE TABLE IF NOT EXISTS stats_replies (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            source TEXT NOT NULL DEFAULT 'chat',          -- chat | api | bench
            route TEXT,                                   -- chat | search | shell (the agent's route)
            conversation_id TEXT,
            message_id INTEGER,
            backend TEXT,
            model TEXT,
            prompt_tokens INTEGER NOT NULL DEFAULT 0,     -- includes cached_tokens
            cached_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0,
            ttft_s REAL,
            prompt_tps REAL,
            decode_tps REAL,
            peak_memory_bytes INTEGER,
            peak_rss_bytes INTEGER,
            total_s REAL,
            flash_hit_rate REAL,
            flash_bytes_read INTEGER,
            finish_reason TEXT,
            bench_run_id INTEGER
        )""",
            "CREATE INDEX IF NOT EXISTS stats_replies_time ON stats_replies (created_at)",
            "CREATE INDEX IF NOT EXISTS stats_replies_conversation ON stats_replies (conversation_id, id)",
            """CREATE TABLE IF NOT EXISTS stats_grades (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            reply_id INTEGER REFERENCES stats_replies(id) ON DELETE SET NULL,
            conversation_id TEXT,
            message_id INTEGER,
            route TEXT,
            model TEXT,
            grade TEXT NOT NULL CHECK (grade IN ('good', 'bad')),
            note TEXT,
            excerpt TEXT
        )""",
            """CREATE TABLE IF NOT EXISTS stats_bench_runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            backend TEXT,
            model TEXT,
            prompts INTEGER NOT NULL,
            max_tokens INTEGER NOT NULL,
            decode_tps REAL,
            ttft_s REAL,
            prompt_tps REAL,
            peak_memory_bytes INTEGER,
            peak_rss_bytes INTEGER,
            total_s REAL,
            results TEXT
        )""",
        ),
    ),
    # projects (issue 15): everything before this step belonged to the one hard-wired project, which
    # becomes "Default" (its directory, '' here, is the scratch folder under the data directory)
    Migration(
        5,
        "projects",
        (
            """CREATE TABLE projects (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE COLLATE NOCASE,
            path TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL,
            opened_at REAL
        )""",
            "INSERT INTO projects (id, name, path, created_at) VALUES ('default', 'Default', '', 0)",
            "ALTER TABLE conversations ADD COLUMN project_id TEXT NOT NULL DEFAULT 'default'",
            "CREATE INDEX conversations_by_project ON conversations(project_id, updated_at)",
            "UPDATE OR IGNORE agent_allow_rules SET project = 'default'",
            "DELETE FROM agent_allow_rules WHERE project != 'default'",  # duplicates of a moved rule
            """INSERT OR REPLACE INTO agent_project_settings (project, network, updated_at)
            SELECT 'default', network, updated_at FROM agent_project_settings
            ORDER BY updated_at DESC LIMIT 1""",
            "DELETE FROM agent_project_settings WHERE project != 'default'",
            "UPDATE agent_actions SET project = 'default'",
            "ALTER TABLE stats_replies ADD COLUMN project_id TEXT",
            "UPDATE stats_replies SET project_id = 'default' WHERE source = 'chat'",
            "CREATE INDEX stats_replies_project ON stats_replies (project_id, created_at)",
        ),
    ),
    # issue 21: a conversation's mode and generation settings, its event log (everything the
    # transcript shows besides the messages), and app-wide settings (generation defaults)
    Migration(
        6,
        "conversation mode, generation settings, event log, app settings",
        (
            "ALTER TABLE conversations ADD COLUMN mode TEXT NOT NULL DEFAULT 'chat'",  # chat | agent
            "ALTER TABLE conversations ADD COLUMN generation TEXT",  # JSON: max_tokens, temperature, top_p, system
            """CREATE TABLE conversation_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            after_message INTEGER NOT NULL DEFAULT 0,  -- the conversation's newest message id when it happened
            type TEXT NOT NULL,
            data TEXT NOT NULL,                        -- the event's to_dict(), as JSON
            created_at REAL NOT NULL
        )""",
            "CREATE INDEX conversation_events_by_conversation ON conversation_events(conversation_id, id)",
            """CREATE TABLE app_settings (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL,                       -- JSON
            updated_at REAL NOT NULL
        )""",
        ),
    ),
    # issue 20: MCP servers per project (added in Settings, or the user's switches for a .mcp.json
    # server), and allow rules of kind 'tool' (an MCP tool, `server__tool`) in the agent's rule table
    # (SQLite cannot change a CHECK: the table is rebuilt with its rows and ids)
    Migration(
        7,
        "MCP servers and tool allow rules",
        (
            """CREATE TABLE mcp_servers (
            project TEXT NOT NULL,
            name TEXT NOT NULL,
            config TEXT,                               -- JSON mcpServers entry; NULL: the .mcp.json one
            enabled INTEGER NOT NULL DEFAULT 1,
            approved TEXT,                             -- .mcp.json: fingerprint of the config approved
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (project, name)
        )""",
            """CREATE TABLE agent_allow_rules_7 (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            project TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('exact', 'prefix', 'tool')),
            pattern TEXT NOT NULL,
            created_at REAL NOT NULL,
            UNIQUE (project, kind, pattern)
        )""",
            """INSERT INTO agent_allow_rules_7 (id, project, kind, pattern, created_at)
            SELECT id, project, kind, pattern, created_at FROM agent_allow_rules""",
            "DROP TABLE agent_allow_rules",
            "ALTER TABLE agent_allow_rules_7 RENAME TO agent_allow_rules",
        ),
    ),
    # issue 16: Settings' "auto-approve file edits in this project" (the agent's tool loop)
    Migration(
        8,
        "auto-approve file edits per project",
        ("ALTER TABLE agent_project_settings ADD COLUMN approve_edits INTEGER NOT NULL DEFAULT 0",),
    ),
    # the Trash: Delete moves a conversation there (`trashed_at`: when); Put Back, Empty Trash, and
    # those trashed over TRASH_DAYS ago deleted for good when the database opens
    Migration(
        9,
        "conversation trash",
        (
            "ALTER TABLE conversations ADD COLUMN trashed_at REAL",
            "CREATE INDEX conversations_by_trash ON conversations(trashed_at)",
        ),
    ),
    # what a file the agent's file tools wrote held before, so the write can be undone (`agent_actions.id`
    # of the write); the text it left is kept as a hash: an undo goes ahead only while the file still holds it
    Migration(
        10,
        "earlier text of the files the agent changed",
        (
            """CREATE TABLE IF NOT EXISTS agent_file_changes (
            action_id INTEGER PRIMARY KEY,
            project TEXT NOT NULL,
            conversation_id TEXT,
            path TEXT NOT NULL,                        -- relative to the project's folder
            before TEXT,                               -- NULL: the write made the file
            after_sha256 TEXT NOT NULL,
            created_at REAL NOT NULL,
            undone_at REAL
        )""",
            "CREATE INDEX IF NOT EXISTS agent_file_changes_by_project ON agent_file_changes (project, created_at)",
            "CREATE INDEX IF NOT EXISTS agent_file_changes_by_conversation ON agent_file_changes (conversation_id)",
            # a conversation deleted for good takes the earlier texts of its writes along (as its messages go)
            """CREATE TRIGGER IF NOT EXISTS agent_file_changes_of_deleted AFTER DELETE ON conversations
            BEGIN DELETE FROM agent_file_changes WHERE conversation_id = OLD.id; END""",
        ),
    ),
    # how many of the path's folders (the deepest) a write made: undoing the write that made the file
    # removes them too, when empty (they stayed behind); 0 for the writes kept before
    Migration(
        11,
        "the folders a write made",
        ("ALTER TABLE agent_file_changes ADD COLUMN made_dirs INTEGER NOT NULL DEFAULT 0",),
    ),
    # the id an imported conversation had in the export it came from: a saved context of that conversation,
    # exported and imported too, resumes on it (it said "its conversation was deleted")
    Migration(
        12,
        "where an imported conversation came from",
        (
            "ALTER TABLE conversations ADD COLUMN imported_from TEXT",
            "CREATE INDEX IF NOT EXISTS conversations_by_origin ON conversations (imported_from)",
        ),
    ),
]

LAST_MODEL_KEY = (
    "last_model"  # {"backend", "model"}: loaded from the model menu or /model; the next start loads it
)
TRASH_DAYS = 30  # a conversation in the Trash is deleted for good this long after it went there

SCHEMA_VERSION = MIGRATIONS[-1].version  # the newest step this flashcode knows


def latest_version() -> int:
    return max(m[0] for m in MIGRATIONS)


class NewerDatabaseError(RuntimeError):
    """The database was migrated by a newer flashcode than this one."""


class StorageError(RuntimeError):
    """The database could not be written for a reason outside the data (busy, disk full, read-only): one
    sentence that says what to do. Nothing was stored, and nothing stored before is lost."""


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN … COMMIT, rolled back on any error. SQLite may already have rolled back (a full disk, an I/O
    error): then there is nothing to undo, and the first error is the one raised."""
    conn.execute("BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


# SQLite's result codes (extended ones start with these) and, for an error made without one, its own words
_STORAGE_CODES = {
    "SQLITE_BUSY": "busy",
    "SQLITE_LOCKED": "busy",
    "SQLITE_FULL": "full",
    "SQLITE_READONLY": "readonly",
    "SQLITE_IOERR": "ioerror",
}
_STORAGE_WORDS = (
    ("database is locked", "busy"),
    ("database table is locked", "busy"),
    ("database or disk is full", "full"),
    ("attempt to write a readonly database", "readonly"),
    ("disk i/o error", "ioerror"),
)


def storage_kind(exc: BaseException) -> str | None:
    """ "busy", "full", "readonly" or "ioerror" when SQLite failed for a reason outside the data (by its result
    code: a column named `fullname` is not a full disk); None for any other error."""
    if not isinstance(exc, sqlite3.OperationalError):
        return None
    code = getattr(exc, "sqlite_errorname", None)
    if code:
        return next((k for c, k in _STORAGE_CODES.items() if code == c or code.startswith(c + "_")), None)
    text = str(exc).lower()
    return next((k for words, k in _STORAGE_WORDS if words in text), None)


def storage_problem(exc: BaseException, path: Path | str) -> str | None:
    """What to do, in one sentence, when writing the database at `path` failed for a reason outside the data
    being written; None for any other error."""
    kind = storage_kind(exc)
    if kind == "busy":
        return (
            f"the database {path} is busy: another program holds a write lock on it (a second flashcode, "
            "an sqlite3 shell, a backup tool) — try again once it lets go"
        )
    if kind == "full":
        return f"the disk holding {path} is full — free some space and try again"
    if kind == "readonly":
        return (
            f"the database {path} is read-only — make it and its folder writable (chmod u+w) for the user "
            "running flashcode"
        )
    if kind == "ioerror":
        return f"the disk holding {path} failed a write (disk I/O error) — check the disk"
    return None


def stored_version(conn: sqlite3.Connection) -> int:
    """The schema version a database holds: PRAGMA user_version, or its newest recorded migration."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    try:
        recorded = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
    except sqlite3.OperationalError:  # no such table: a new or foreign database
        recorded = None
    return max(version, int(recorded or 0))


def remembered_model(path: Path) -> tuple[str, str] | None:
    """The (backend, model) the user last loaded (`LAST_MODEL_KEY`), read without changing the database; None
    when there is none or it cannot be read (the start then loads the default)."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
        try:
            row = conn.execute("SELECT value FROM app_settings WHERE key=?", (LAST_MODEL_KEY,)).fetchone()
        finally:
            conn.close()
        value = json.loads(row[0]) if row else None
    except (sqlite3.Error, ValueError):
        return None
    if not isinstance(value, dict):
        return None
    backend, model = value.get("backend"), value.get("model")
    return (
        (backend, model)
        if isinstance(backend, str) and isinstance(model, str) and backend and model
        else None
    )


def quick_check(conn: sqlite3.Connection) -> None:
    """SQLite's own quick integrity check; DatabaseError (as SQLite words it) when pages are damaged."""
    verdict = conn.execute("PRAGMA quick_check").fetchone()
    if verdict is None or verdict[0] != "ok":
        first = str(verdict[0] if verdict else "no answer").splitlines()[0][:200]
        raise sqlite3.DatabaseError(f"database disk image is malformed: {first}")


def check_version(conn: sqlite3.Connection, path: Path | None = None) -> None:
    found, known = stored_version(conn), latest_version()
    if found > known:
        quick_check(conn)  # a damaged migrations table (random bytes) reads as "schema version 9159"
        where = f"the database {path}" if path else "the database"
        raise NewerDatabaseError(
            f"{where} was written by a newer flashcode (schema version {found}; this one knows up to "
            f"{known}): upgrade flashcode, or pass another --data-dir"
        )


@dataclass
class Conversation:
    id: str
    title: str
    model: str | None
    backend: str | None
    created_at: float
    updated_at: float
    project_id: str = "default"
    mode: str = "chat"  # chat | agent
    generation: str | None = None  # JSON of the conversation's own generation settings
    trashed_at: float | None = None  # in the Trash since (None: not in it)
    imported_from: str | None = None  # its id in the export it was imported from

    @property
    def generation_settings(self) -> dict[str, Any]:
        return json.loads(self.generation) if self.generation else {}


FIND_LIMIT = 200  # the most conversations a search lists
FIND_WORDS = 16  # the most words a search looks for (each one is a condition)


def _like(text: str) -> str:
    """A LIKE pattern (ESCAPE '\\') for `text` anywhere: its `%`, `_` and `\\` taken literally."""
    return "%" + re.sub(r"([\\%_])", r"\\\1", text) + "%"


def find_words(text: str) -> tuple[list[str], bool]:
    """The words a search looks for (each once, in order, at most FIND_WORDS), and whether words were left out."""
    words = list(dict.fromkeys(text.split()))
    return words[:FIND_WORDS], len(words) > FIND_WORDS


def fold_case(text: str) -> str:
    """Lower case for every script, with one form of sigma (ς ends a word that σ starts: "ΟΔΟΣ" is "οδος" alone
    and "οδοσ…" inside a longer word). Find compares words so (`_holds`)."""
    return text.lower().replace("ς", "σ")


def _lower(text: Any) -> Any:
    """SQL `ulower`: `fold_case` (SQLite's LIKE and lower() fold ASCII letters only)."""
    return fold_case(text) if isinstance(text, str) else text


def folded_span(text: str, needle: str) -> tuple[int, int] | None:
    """[start, end) of the first `needle` (folded) in `text` as `fold_case` reads it, in `text`'s own characters:
    the letters whose folds hold it (İ folds to two, so a match may end one letter sooner than its folded
    length says); None: nowhere."""
    folded = fold_case(text)
    at = folded.find(needle)
    if at < 0:
        return None
    if len(folded) == len(text):
        return at, at + len(needle)
    start, seen, stop = -1, 0, at + len(needle)
    for i, ch in enumerate(text):
        if start < 0 and seen + len(fold_case(ch)) > at:
            start = i
        seen += len(fold_case(ch))
        if seen >= stop:
            return start, i + 1
    return None


def _find(text: Any, needle: Any) -> int:
    """SQL `ufind`: where `folded_span` starts, from 1 as SQLite counts; 0: nowhere."""
    if not isinstance(text, str) or not isinstance(needle, str):
        return 0
    span = folded_span(text, needle)
    return span[0] + 1 if span else 0


def _holds(column: str, word: str, param: str) -> str:
    """The SQL condition that `column` holds `word` in any case, its pattern (`_pattern`) given as `param`. An
    ASCII word is matched by LIKE itself (fast); another through `ulower` (É finds é)."""
    return f"{column if word.isascii() else f'ulower({column})'} LIKE :{param} ESCAPE '\\'"


def _pattern(word: str) -> str:
    return _like(word if word.isascii() else fold_case(word))


class Found(NamedTuple):
    """A conversation a search found, and the start of a message that holds what it looked for (None: the title
    shows every word)."""

    conversation: Conversation
    message: str | None
    match: str | None = None  # what `message` is cut around: the whole text, or one of its words


@dataclass
class StoredEvent:
    """One entry of a conversation's event log: what the transcript showed besides a message."""

    id: int
    conversation_id: str
    after_message: int
    type: str
    data: dict[str, Any]
    created_at: float


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
    """One connection, used from the event loop thread — and read from a worker thread while a page is drawn
    (`ChatPages._page`). SQLite's serialized mode makes the calls themselves safe; being one connection, a
    read there may see a transaction the loop thread has open (an import half-stored): a page drawn at that
    moment may show it so. Nothing is written from there but the Default project's row (INSERT OR IGNORE)."""

    def __init__(self, path: Path, recover: bool = True) -> None:
        """`recover`: mark replies still `streaming` as cut by a crash — for the server only, which opens the
        database before it answers anything (serve.lock keeps a second one out). A command-line tool opening
        it beside a running server passes False: that server's reply is streaming, and would stop being
        saved as it grows (`save_partial` writes only `streaming` rows)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.create_function("ulower", 1, _lower, deterministic=True)  # Find, for words beyond ASCII
        self.conn.create_function("ufind", 2, _find, deterministic=True)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        check_version(self.conn, path)
        migrate(self.conn)
        self.recovered = self._mark_interrupted() if recover else 0
        self.purged = self.purge_trash(time.time() - TRASH_DAYS * 86400)

    def close(self) -> None:
        self.conn.close()

    def _mark_interrupted(self) -> int:
        """Replies a crash cut off are marked incomplete. One a Regenerate was writing (`replaces` in its stats)
        settles what the Regenerate would have: with text it replaces the old reply, without it goes and the old
        one stays (two replies in a row: templates that need turns to alternate would fail on each)."""
        for row in self.conn.execute(
            "SELECT id, content, stats FROM messages WHERE status='streaming' AND stats LIKE '%\"replaces\"%'"
        ).fetchall():
            old = json.loads(row["stats"] or "{}").get("replaces")
            if not isinstance(old, int) or isinstance(old, bool):
                continue
            replaced = self.get_message(old)
            if row["content"] and replaced is not None:
                self.replace_reply(replaced)  # folded in the transcript, as the Regenerate would have
            else:
                self.conn.execute("DELETE FROM messages WHERE id=?", (old if row["content"] else row["id"],))
        return self.conn.execute("UPDATE messages SET status='incomplete' WHERE status='streaming'").rowcount

    # ------------------------------------------------------------------ conversations
    def create_conversation(
        self,
        title: str = UNTITLED,
        model: str | None = None,
        backend: str | None = None,
        project_id: str = "default",
    ) -> Conversation:
        now = time.time()
        conv = Conversation(uuid.uuid4().hex[:12], title, model, backend, now, now, project_id)
        self.conn.execute(
            "INSERT INTO conversations (id, title, model, backend, created_at, updated_at, project_id) "
            "VALUES (?,?,?,?,?,?,?)",
            (conv.id, conv.title, conv.model, conv.backend, now, now, project_id),
        )
        return conv

    def get_conversation(self, conversation_id: str, trashed: bool = False) -> Conversation | None:
        """A conversation; one in the Trash only with `trashed` (for everything else it is gone)."""
        where = "" if trashed else " AND trashed_at IS NULL"
        row = self.conn.execute(
            f"SELECT * FROM conversations WHERE id=?{where}", (conversation_id,)
        ).fetchone()
        return Conversation(**dict(row)) if row else None

    def imported_as(self, project_id: str, original_id: str) -> Conversation | None:
        """The newest conversation of the project imported from an export of `original_id` (none in the Trash)."""
        row = self.conn.execute(
            "SELECT * FROM conversations WHERE imported_from=? AND project_id=? AND trashed_at IS NULL "
            "ORDER BY created_at DESC, id LIMIT 1",
            (original_id, project_id),
        ).fetchone()
        return Conversation(**dict(row)) if row else None

    def list_conversations(self, project_id: str | None = None) -> list[Conversation]:
        """Newest first: one project's, or every project's (None); none from the Trash."""
        where, args = ("AND project_id=? ", (project_id,)) if project_id is not None else ("", ())
        rows = self.conn.execute(
            f"SELECT * FROM conversations WHERE trashed_at IS NULL {where}ORDER BY updated_at DESC, id", args
        ).fetchall()
        return [Conversation(**dict(r)) for r in rows]

    def find_conversations(
        self,
        text: str,
        project_id: str | None = None,
        limit: int = FIND_LIMIT,
        around: int = 400,
        excerpts: bool = True,
    ) -> list[Found]:
        """The conversations (one project's, or all: None; none from the Trash) that hold every word of `text`,
        each in its title or in any of its messages, newest first, at most `limit`. A word matches as a plain
        substring (`%` and `_` are themselves), in any case (`_holds`). Words after the first FIND_WORDS are
        not looked for (`find_words` says so).

        Each comes with the words of a message around what it found (None when the title shows every word):
        `around` characters of the first message holding the whole text, else a word the title lacks, from a
        little before it (a message can be megabytes long), and that text (`Found.match`). `excerpts=False`: none
        (the command line lists conversations only)."""
        words = find_words(text)[0]
        # as typed, a word said twice too (an excerpt is best around all of it)
        phrase = " ".join(text.split())
        if not words:
            return []
        args: dict[str, Any] = {f"w{i}": _pattern(w) for i, w in enumerate(words)}
        held = [
            f"({_holds('c.title', w, f'w{i}')} OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id=c.id "
            f"AND {_holds('m.content', w, f'w{i}')}))"
            for i, w in enumerate(words)
        ]
        mine = "AND c.project_id=:project " if project_id is not None else ""
        rows = self.conn.execute(
            f"SELECT c.* FROM conversations c WHERE c.trashed_at IS NULL {mine}AND {' AND '.join(held)} "
            "ORDER BY c.updated_at DESC, c.id LIMIT :limit",
            {**args, "project": project_id, "limit": limit},
        ).fetchall()
        found = []
        for r in rows:
            conv = Conversation(**dict(r))
            title = fold_case(conv.title)
            missing = [w for w in words if fold_case(w) not in title]  # the title shows the rest
            looks = ([phrase] if phrase != words[0] else []) + missing if excerpts and missing else []
            message = match = None
            for wanted in looks:
                # where it starts: SQLite's lower() keeps an ASCII word's positions; beyond ASCII, `ufind`
                at = "instr(lower(content), :text)" if wanted.isascii() else "ufind(content, :text)"
                message = self.conn.execute(
                    f"SELECT substr(content, max(1, {at} - :before), :around) "
                    f"FROM messages WHERE conversation_id=:id AND {_holds('content', wanted, 'pattern')} "
                    "ORDER BY id LIMIT 1",
                    {
                        "text": fold_case(wanted),
                        "pattern": _pattern(wanted),
                        "before": around // 4,
                        "around": around,
                        "id": conv.id,
                    },
                ).fetchone()
                if message is not None:
                    message, match = message[0], wanted
                    break
            found.append(Found(conv, message, match))
        return found

    def rename_conversation(self, conversation_id: str, title: str) -> bool:
        cur = self.conn.execute(
            "UPDATE conversations SET title=?, updated_at=? WHERE id=?", (title, time.time(), conversation_id)
        )
        return cur.rowcount == 1

    # ------------------------------------------------------------------ the Trash
    def trash_conversation(self, conversation_id: str) -> bool:
        """Move a conversation to the Trash (Put Back restores it whole)."""
        return (
            self.conn.execute(
                "UPDATE conversations SET trashed_at=? WHERE id=? AND trashed_at IS NULL",
                (time.time(), conversation_id),
            ).rowcount
            == 1
        )

    def restore_conversation(self, conversation_id: str, project_id: str | None = None) -> bool:
        """Put a conversation back from the Trash (into `project_id` when given: its own was removed)."""
        return (
            self.conn.execute(
                "UPDATE conversations SET trashed_at=NULL, project_id=COALESCE(?, project_id) "
                "WHERE id=? AND trashed_at IS NOT NULL",
                (project_id, conversation_id),
            ).rowcount
            == 1
        )

    def trashed_conversations(self) -> list[Conversation]:
        """Everything in the Trash, every project's, the most recently trashed first."""
        rows = self.conn.execute(
            "SELECT * FROM conversations WHERE trashed_at IS NOT NULL ORDER BY trashed_at DESC, id"
        ).fetchall()
        return [Conversation(**dict(r)) for r in rows]

    def delete_conversation(self, conversation_id: str) -> bool:
        """Delete a conversation for good: its messages and events go with it (cascade)."""
        return self.conn.execute("DELETE FROM conversations WHERE id=?", (conversation_id,)).rowcount == 1

    def purge_trash(self, before: float | None = None, ids: Sequence[str] | None = None) -> int:
        """Delete for good from the Trash: those of `ids` still in it (Empty Trash: what the user saw and
        confirmed), what went there before `before` (the 30-day rule), or all of it (neither given)."""
        if ids is not None:
            marks = ",".join("?" * len(ids))
            return self.conn.execute(
                f"DELETE FROM conversations WHERE trashed_at IS NOT NULL AND id IN ({marks})", tuple(ids)
            ).rowcount
        if before is None:
            return self.conn.execute("DELETE FROM conversations WHERE trashed_at IS NOT NULL").rowcount
        return self.conn.execute("DELETE FROM conversations WHERE trashed_at < ?", (before,)).rowcount

    def touch(self, conversation_id: str, model: str | None = None, backend: str | None = None) -> None:
        self.conn.execute(
            "UPDATE conversations SET updated_at=?, model=COALESCE(?, model), backend=COALESCE(?, backend) WHERE id=?",
            (time.time(), model, backend, conversation_id),
        )

    # ------------------------------------------------------------------ messages
    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        status: MessageStatus = "complete",
        stats: dict[str, Any] | None = None,
    ) -> StoredMessage:
        """`stats`: a reply's numbers, or — for a user message — what its bubble shows besides `content`
        (the files attached to it; `content` is what the model reads)."""
        now = time.time()
        cur = self.conn.execute(
            "INSERT INTO messages (conversation_id, role, content, status, stats, created_at) VALUES (?,?,?,?,?,?)",
            (conversation_id, role, content, status, json.dumps(stats) if stats else None, now),
        )
        self.touch(conversation_id)
        return StoredMessage(
            int(cur.lastrowid or 0), conversation_id, role, content, status, now, dict(stats or {})
        )

    def save_partial(self, message_id: int, content: str) -> None:
        self.conn.execute(
            "UPDATE messages SET content=? WHERE id=? AND status='streaming'", (content, message_id)
        )

    def finish_message(
        self, message_id: int, content: str, status: MessageStatus, stats: dict[str, Any] | None = None
    ) -> None:
        self.conn.execute(
            "UPDATE messages SET content=?, status=?, stats=? WHERE id=?",
            (content, status, json.dumps(stats) if stats else None, message_id),
        )

    def delete_message(self, message_id: int) -> None:
        self.conn.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def replace_reply(self, old: StoredMessage) -> None:
        """Regenerate's new reply is stored: the old one leaves the messages (the model's context; templates need
        turns to alternate) and stays in the transcript, folded where it was (`REPLACED`, after the message
        before it): nothing the model wrote is thrown away."""
        if old.content:
            row = self.conn.execute(
                "SELECT COALESCE(MAX(id), 0) FROM messages WHERE conversation_id=? AND id<?",
                (old.conversation_id, old.id),
            ).fetchone()
            self.conn.execute(
                "INSERT INTO conversation_events (conversation_id, after_message, type, data, created_at) "
                "VALUES (?,?,?,?,?)",
                (old.conversation_id, int(row[0]), REPLACED, json.dumps(replaced_data(old)), time.time()),
            )
        self.delete_message(old.id)

    # ------------------------------------------------------------------ mode, generation settings
    def set_mode(self, conversation_id: str, mode: str) -> None:
        self.conn.execute("UPDATE conversations SET mode=? WHERE id=?", (mode, conversation_id))

    def set_generation(self, conversation_id: str, values: dict[str, Any]) -> None:
        self.conn.execute(
            "UPDATE conversations SET generation=? WHERE id=?",
            (json.dumps(values) if values else None, conversation_id),
        )

    def get_setting(self, key: str, default: Any = None) -> Any:
        row = self.conn.execute("SELECT value FROM app_settings WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def remember_model(self, backend: str | None, model: str | None) -> None:
        """The user loaded `model` on `backend` (the model menu, /model): the next start loads it too."""
        if backend and model:
            self.set_setting(LAST_MODEL_KEY, {"backend": backend, "model": model})

    def forget_model(self) -> None:
        """The model last loaded could not load again: the next start loads the default."""
        self.conn.execute("DELETE FROM app_settings WHERE key=?", (LAST_MODEL_KEY,))

    def set_setting(self, key: str, value: Any) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO app_settings (key, value, updated_at) VALUES (?,?,?)",
            (key, json.dumps(value), time.time()),
        )

    # ------------------------------------------------------------------ the event log
    def add_event(self, conversation_id: str, type: str, data: dict[str, Any]) -> StoredEvent:
        """Log an event after the conversation's newest message (the transcript draws it there)."""
        now = time.time()
        row = self.conn.execute(
            "SELECT COALESCE(MAX(id), 0) FROM messages WHERE conversation_id=?", (conversation_id,)
        ).fetchone()
        after = int(row[0])
        cur = self.conn.execute(
            "INSERT INTO conversation_events (conversation_id, after_message, type, data, created_at) "
            "VALUES (?,?,?,?,?)",
            (conversation_id, after, type, json.dumps(data, default=str), now),
        )
        return StoredEvent(int(cur.lastrowid or 0), conversation_id, after, type, data, now)

    def events(self, conversation_id: str, type: str | None = None) -> list[StoredEvent]:
        """The conversation's logged events in order (`type`: only those of that type)."""
        rows = self.conn.execute(
            "SELECT * FROM conversation_events WHERE conversation_id=? AND (? IS NULL OR type=?) ORDER BY id",
            (conversation_id, type, type),
        ).fetchall()
        return [StoredEvent(**(dict(r) | {"data": json.loads(r["data"])})) for r in rows]

    def context_start(self, conversation_id: str) -> int:
        """Messages with a larger id are the model's context: those after the latest /clear."""
        row = self.conn.execute(
            "SELECT MAX(after_message) FROM conversation_events WHERE conversation_id=? AND type='clear'",
            (conversation_id,),
        ).fetchone()
        return int(row[0] or 0)

    def messages(self, conversation_id: str) -> list[StoredMessage]:
        rows = self.conn.execute(
            "SELECT * FROM messages WHERE conversation_id=? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [_message(r) for r in rows]

    def get_message(self, message_id: int) -> StoredMessage | None:
        row = self.conn.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        return _message(row) if row else None

    def branch_conversation(self, message: StoredMessage, notice: str = "") -> Conversation:
        """A NEW conversation holding what came before `message` in its conversation (its messages, and the
        events the transcript drew among them, /clear marks included), with the same project, mode, model and
        generation settings, titled "TITLE (edited)": where an edited `message` is sent instead (Edit… on a
        user message). The conversation it comes from is not touched. `notice`: said at the top of the new one.
        The replies' numbers stay in their footers; the Stats window counts each generation once (the
        original's)."""
        conv = self.get_conversation(message.conversation_id)
        if conv is None:
            raise StorageError("the conversation is gone (deleted, or in the Trash)")
        now = time.time()
        # an untitled one stays untitled: the message sent there names it, as in a new conversation
        title = (
            UNTITLED if conv.title == UNTITLED else _free_title(self, conv.project_id, conv.title, "edited")
        )
        new = Conversation(
            uuid.uuid4().hex[:12],
            title,
            conv.model,
            conv.backend,
            now,
            now,
            conv.project_id,
            conv.mode,
            conv.generation,
        )
        ids: dict[int, int] = {0: 0}  # the original's message ids -> the copies'
        with transaction(self.conn):
            self.conn.execute(
                "INSERT INTO conversations (id, title, model, backend, created_at, updated_at, project_id, mode, "
                "generation) VALUES (?,?,?,?,?,?,?,?,?)",
                (new.id, new.title, new.model, new.backend, now, now, new.project_id, new.mode, new.generation),
            )  # fmt: skip
            if notice:
                self.conn.execute(
                    "INSERT INTO conversation_events (conversation_id, after_message, type, data, created_at) "
                    "VALUES (?,0,'notice',?,?)",
                    (new.id, json.dumps({"type": "notice", "text": notice, "level": "info"}), now),
                )
            for m in self.messages(conv.id):
                if m.id >= message.id:
                    break
                status = "incomplete" if m.status == "streaming" else m.status
                cur = self.conn.execute(
                    "INSERT INTO messages (conversation_id, role, content, status, stats, created_at) "
                    "VALUES (?,?,?,?,?,?)",
                    (
                        new.id,
                        m.role,
                        m.content,
                        status,
                        json.dumps(m.stats) if m.stats else None,
                        m.created_at,
                    ),
                )
                ids[m.id] = int(cur.lastrowid or 0)
            kept = sorted(ids)
            for e in self.events(conv.id):
                if e.after_message >= message.id:
                    continue
                # after a message since deleted (a regenerated reply): after the copy of the one before it
                after = ids[kept[bisect.bisect_right(kept, e.after_message) - 1]]
                self.conn.execute(
                    "INSERT INTO conversation_events (conversation_id, after_message, type, data, created_at) "
                    "VALUES (?,?,?,?,?)",
                    (new.id, after, e.type, json.dumps(e.data, default=str), e.created_at),
                )
        return new


def replaced_data(old: StoredMessage) -> dict[str, Any]:
    """The `REPLACED` event's data for a reply Regenerate replaced."""
    return {
        "type": REPLACED,
        "text": old.content,
        "message_id": old.id,
        "model": str(old.stats.get("model") or ""),
    }


def _message(row: sqlite3.Row) -> StoredMessage:
    d = dict(row)
    d["stats"] = json.loads(d["stats"]) if d.get("stats") else {}
    return StoredMessage(**d)


def migrate(conn: sqlite3.Connection) -> list[int]:
    """Apply the steps newer than the database, each in its own transaction; returns their versions."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
    )
    have = stored_version(conn)
    applied = []
    for version, name, statements in sorted(MIGRATIONS, key=lambda m: m[0]):
        if version <= have:
            continue
        with transaction(conn):
            for statement in (statements,) if isinstance(statements, str) else statements:
                conn.execute(statement)
            conn.execute(
                "INSERT OR REPLACE INTO schema_migrations VALUES (?,?,?)", (version, name, time.time())
            )
            conn.execute(f"PRAGMA user_version = {int(version)}")
        applied.append(version)
    return applied


def connect_memory() -> sqlite3.Connection:
    """A private in-memory database with the whole schema (an agent or a test without the app's)."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    migrate(conn)
    return conn


def _fenced(text: str, lang: str = "") -> list[str]:
    """`text` in a code fence longer than any backtick run inside it (its content cannot close it)."""
    run = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, run + 1)
    return [f"{fence}{lang}", text.rstrip("\n"), fence]


def _event_markdown(e: StoredEvent, output: dict[int, list[str]]) -> list[str]:
    """What an agent's logged event adds to a Markdown export (its tool steps, approvals, outcomes); []
    for what the export shows elsewhere or not at all. `output`: each action's command output, joined."""
    d, t = e.data, e.type
    if t == "tool_step":
        args = json.dumps(d.get("arguments") or {}, ensure_ascii=False)
        return [f"**Step {d.get('step')}: `{d.get('tool')}`**", *_fenced(args, "json"), ""]
    if t == "tool_step_done":
        verdict = "worked" if d.get("ok") else "failed"
        return [f"_Step {d.get('step')} {verdict}_", *_fenced(str(d.get("result") or "")), ""]
    if t == "proposal":
        lines = [f"**Proposed ({d.get('tool')}):** `{d.get('command')}`"]
        return [*lines, *(_fenced(d["diff"], "diff") if d.get("diff") else []), ""]
    if t == "decided":
        reason = f": {d['reason']}" if d.get("reason") else ""
        rule = f" (rule `{d['rule']}`)" if d.get("rule") else ""
        return [f"_Decision: {d.get('decision')}{rule}{reason}_", ""]
    if t == "exit":
        text = "".join(output.get(int(d.get("action_id") or 0), []))
        return [
            *(_fenced(text) if text else []),
            f"_{d.get('description')}, {float(d.get('duration_s') or 0):.1f} s_",
            "",
        ]
    if t == "file_written":
        return [f"_Wrote {d.get('path')}_", ""]
    if t == "file":
        return [f"**{d.get('path')}**", *_fenced(str(d.get("content") or "")), ""]
    if t == "search_results":
        hits = [f"{i}. {r.get('title')} — {r.get('url')}" for i, r in enumerate(d.get("results") or (), 1)]
        return [f"**Web search:** {d.get('query')}", *hits, ""]
    if t in ("notice", "search_unavailable", "context_trimmed", "file_undone"):
        return [f"_{d.get('text') or d.get('message') or d.get('note')}_", ""]
    if t == "mode":
        note = f" — {d['no_tools']}" if d.get("no_tools") else ""
        return [f"_Mode: {'agent' if d.get('mode') == 'agent' else 'chat'}{note}_", ""]
    if t == "help":
        return [*_fenced(str(d.get("text") or "")), ""]
    if t == "clear":
        return ["_Context cleared: the agent started over_", ""]
    if t == "model":
        return [f"_Switching to {d.get('name')}_", ""]
    if t == "slash_output":  # another feature's answer to a slash command (/stats), logged as its HTML
        return [*_fenced(_html_text(str(d.get("html") or ""))), ""]
    if t == REPLACED:
        quoted = [f"> {line}" if line else ">" for line in str(d.get("text") or "").splitlines()]
        return ["_Earlier reply, replaced by Regenerate:_", "", *quoted, ""]
    if t == "step_limit":
        return [
            f"_Step limit reached ({d.get('steps')} of {d.get('max_steps')}): /continue gives it more_",
            "",
        ]
    return []


class _TextOf(HTMLParser):
    """The text of an HTML fragment: its data, one line per block element."""

    BLOCKS = frozenset({"p", "div", "li", "tr", "br", "h1", "h2", "h3", "h4", "table", "ul", "ol", "pre"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.BLOCKS:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def _html_text(fragment: str) -> str:
    parser = _TextOf()
    parser.feed(fragment)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def _safe_event_markdown(e: StoredEvent, output: dict[int, list[str]]) -> list[str]:
    """`_event_markdown`, or — for an event whose values are not what it expects (an imported file's) —
    its type and fields as JSON: an export never fails on one event."""
    try:
        return _event_markdown(e, output)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError):
        return [
            f"_Event `{e.type}`_",
            *_fenced(json.dumps(e.data, ensure_ascii=False, default=str), "json"),
            "",
        ]


def _plain_markdown(text: str) -> str:
    """Plain text on one Markdown line, shown as typed: HTML and Markdown's inline marks backslash-escaped
    (`\\<b>` renders as `<b>`, and reads almost as typed in the file itself, where `&lt;b&gt;` did not)."""
    return re.sub(r"([\\`*_\[\]#|!<>&])", r"\\\1", " ".join(text.split()))


def _user_attachments(m: StoredMessage) -> list[dict[str, Any]] | None:
    """The files a user message was sent with (its bubble's list), or None."""
    files = m.stats.get("attachments") if m.role == "user" else None
    start = m.stats.get("typed_from")
    if not files or not isinstance(files, list) or isinstance(start, bool) or not isinstance(start, int):
        return None
    named = [f for f in files if isinstance(f, dict) and isinstance(f.get("name"), str)]
    return named or None


def export_markdown(
    conv: Conversation, messages: list[StoredMessage], events: Sequence[StoredEvent] = ()
) -> str:
    """The conversation as Markdown: its messages and, where an agent worked, its steps, approvals and results
    in the order they came."""
    lines = [f"# {_plain_markdown(conv.title)}", ""]  # a title is plain text: `<b>` in it stays `<b>`
    used = [(m.stats.get("model"), m.stats.get("backend")) for m in messages if m.role == "assistant"]
    models = list(dict.fromkeys((str(n), str(b or "?")) for n, b in used if n)) or (
        [(conv.model, conv.backend or "?")] if conv.model else []
    )  # every model that replied, in order (a /model switch midway): not only the last one
    if models:
        said = ", ".join(f"{_plain_markdown(n)} ({_plain_markdown(b)})" for n, b in models)
        lines += [f"_{'models' if len(models) > 1 else 'model'}: {said}_", ""]
    output: dict[int, list[str]] = {}
    for e in events:
        if e.type == "output":
            action = e.data.get("action_id")
            key = action if isinstance(action, int) and not isinstance(action, bool) else 0
            output.setdefault(key, []).append(str(e.data.get("text") or ""))
    after: dict[int, list[StoredEvent]] = {}
    for e in events:
        after.setdefault(e.after_message, []).append(e)
    for e in after.pop(0, []):
        lines += _safe_event_markdown(e, output)
    for m in messages:
        note = "" if m.status == "complete" else f" _({m.status})_"
        if m.status == "complete" and m.role == "assistant" and m.stats.get("finish_reason") == "length":
            note = " _(stopped at the token limit)_"  # as its footer says (walkthrough)
        lines += [f"## {m.role.capitalize()}{note}", ""]
        files = _user_attachments(m)
        if files is not None:  # as the bubble showed it: the files' names, then the typed words
            start = int(m.stats["typed_from"])
            named = ", ".join(_plain_markdown(f["name"]) for f in files)
            lines += [f"_attached: {named}_", "", m.content[start:], ""]
        else:
            lines += [m.content, ""]
        logged = after.pop(m.id, [])
        replaced = [line for e in logged if e.type == REPLACED for line in _safe_event_markdown(e, output)]
        steps = [line for e in logged if e.type != REPLACED for line in _safe_event_markdown(e, output)]
        if steps and m.role == "user":  # what the agent did for this message: not under the user's heading
            lines += ["### Agent", ""]
        lines += steps + replaced  # a replaced reply after the steps, just above the reply that replaced it
    for rest in after.values():  # after a message since deleted
        for e in rest:
            lines += _safe_event_markdown(e, output)
    return "\n".join(lines)


def export_json(
    conv: Conversation, messages: list[StoredMessage], events: Sequence[StoredEvent] = ()
) -> dict[str, Any]:
    """The conversation as JSON (`import_json` reads it back, as a new conversation)."""
    return {
        "format": EXPORT_FORMAT,
        "id": conv.id,
        "title": conv.title,
        "model": conv.model,
        "backend": conv.backend,
        "mode": conv.mode,
        "generation": conv.generation_settings,  # its own max_tokens, temperature, top_p, system prompt
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
        "messages": [
            {
                "id": m.id,
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created_at": m.created_at,
                "stats": m.stats,
            }
            for m in messages
        ],
        # what the transcript showed besides messages (an agent's steps, approvals, output), each after the
        # message whose id is `after_message` (0: before the first)
        "events": [
            {"type": e.type, "after_message": e.after_message, "created_at": e.created_at, "data": e.data}
            for e in events
        ],
    }


# ---------------------------------------------------------------------- import
EXPORT_FORMAT = "flashcode-conversation-1"
IMPORT_STATUSES = frozenset(
    {"complete", "stopped", "incomplete", "error"}
)  # "streaming" comes in as incomplete
MAX_IMPORT_MESSAGES = 20_000
MAX_IMPORT_BYTES = 64 << 20  # a conversation file to import, at most
MAX_IMPORT_ATTACHMENTS = 100  # files named in one user message's bubble, at most
# a reply footer's numbers (the template formats them) and words; anything else in an imported `stats` is dropped
_STAT_NUMBERS = ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "decode_tps", "continued")
_STAT_WORDS = ("finish_reason", "model", "backend", "turn", "error")

EventConverter = Callable[[str, dict[str, Any]], "tuple[str, dict[str, Any]] | None"]


class ConversationImportError(ValueError):
    """The file is not a conversation flashcode can import; the message says what is wrong."""


def parse_import(body: bytes) -> Any:
    """A conversation file's JSON (a BOM allowed), or ConversationImportError saying why it is not."""
    if len(body) > MAX_IMPORT_BYTES:
        raise ConversationImportError(f"it is over {MAX_IMPORT_BYTES >> 20} MB")
    try:
        return json.loads(body.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConversationImportError(
            f"it is not JSON ({exc}): only a JSON export imports (File › Export as JSON, or `flashcode "
            "conversations export ID`; a Markdown export is for reading)"
        ) from None


@dataclass
class Imported:
    conversation: Conversation
    messages: int
    events: int
    skipped: list[str]  # what was left out, in words


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)  # an integer of 400 digits is too large for a float: not a number here
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _text(value: str) -> str:
    """A string SQLite can store: JSON's lone surrogates (`"\\ud800"`) become U+FFFD."""
    return value.encode("utf-8", "replace").decode("utf-8", "replace") if value else value


def _texts(value: Any) -> Any:
    """`value` with every string in it (keys too, at any depth) made storable by `_text`."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict):
        return {_texts(k): _texts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_texts(v) for v in value]
    return value


def _key(value: Any) -> int | str | None:
    """An id from the file, if it can be one (a number or a string; a list or an object cannot)."""
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


# a conversation's own generation settings as a file may give them: (cast, least, most) per number
_GENERATION_NUMBERS = {
    "max_tokens": (int, 1, 32768),
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.01, 1.0),
}


def _imported_generation(values: Any) -> dict[str, Any]:
    """Only settings the Generation Settings window could have saved: numbers in their ranges, a system
    prompt of at most 8,000 characters; anything else is left out."""
    if not isinstance(values, dict):
        return {}
    out: dict[str, Any] = {}
    for key, (cast, low, high) in _GENERATION_NUMBERS.items():
        n = _number(values.get(key))
        if n is not None and low <= n <= high and (cast is float or float(n).is_integer()):
            out[key] = cast(n)
    system = values.get("system")
    if isinstance(system, str) and system.strip() and len(system) <= 8000:
        out["system"] = _text(system.strip())
    return out


def _imported_stats(stats: Any) -> dict[str, Any]:
    if not isinstance(stats, dict):
        return {}
    out: dict[str, Any] = {}
    for key in _STAT_NUMBERS:
        n = _number(stats.get(key))
        if n is not None and n >= 0:
            out[key] = int(n) if key.endswith("tokens") or key == "continued" else n
    for key in _STAT_WORDS:
        if isinstance(stats.get(key), str):
            out[key] = _text(stats[key][:500])
    return out


def _imported_user_stats(stats: Any, content: str) -> dict[str, Any]:
    """A user message's bubble: the files attached to it (names and sizes; the model read them quoted at the
    start of `content`) and where the typed words start. Anything else, or a `typed_from` outside the
    content, is left out: the bubble then shows the whole content."""
    if not isinstance(stats, dict) or not isinstance(stats.get("attachments"), list):
        return {}
    files = []
    for f in stats["attachments"][:MAX_IMPORT_ATTACHMENTS]:
        if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"].strip():
            size = _number(f.get("size"))
            ok = size is not None and size >= 0 and size.is_integer()
            files.append(
                {"name": _text(f["name"][:1000]), "size": int(size) if ok and size is not None else None}
            )
    start = stats.get("typed_from")
    if not files or isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(content):
        return {}
    if not _is_quoting(content[:start], len(files)):  # else the bubble would hide words the model reads
        return {}
    return {"attachments": files, "typed_from": start}


_QUOTED = re.compile(r'<untrusted source="file ([^"\n]*)">\n(.*?)\n</untrusted>\n\n', re.S)
_TAG = re.compile(r"<\s*/?\s*untrusted", re.I)


def _is_quoting(hidden: str, files: int) -> bool:
    """Whether `hidden` is what the app puts before a message sent with `files` files: one quoted block a file
    (its text holding no untrusted tag: nothing can step out of it), and nothing else."""
    blocks, at = [], 0
    while at < len(hidden) and (m := _QUOTED.match(hidden, at)) is not None:
        blocks.append(m)
        at = m.end()
    return at == len(hidden) and len(blocks) == files and not any(_TAG.search(m.group(2)) for m in blocks)


def _imported_title(db: Database, project_id: str, title: str) -> str:
    """`title`, or "TITLE (imported)" (then "(imported 2)", ...) when the project has a conversation of that
    title (its own export brought back): two identical rows in the list could not be told apart."""
    return _free_title(db, project_id, title, "imported", bare=True)


def _free_title(db: Database, project_id: str, title: str, word: str, bare: bool = False) -> str:
    """ "TITLE (WORD)", then "(WORD 2)", ...: the first the project has no conversation of (`bare`: TITLE itself
    first). A TITLE that ends in "(WORD)" or "(WORD N)" already (a copy's copy, an import's export brought back)
    is numbered on, not given a second "(WORD)"."""
    base = _without_suffix(title, word)[:120]
    taken = {
        row[0]
        for row in db.conn.execute(
            "SELECT title FROM conversations WHERE project_id = ? AND title LIKE ?", (project_id, f"{base}%")
        )
    }
    if bare and title not in taken:
        return title
    n, candidate = 2, f"{base} ({word})"
    while candidate in taken:
        candidate, n = f"{base} ({word} {n})", n + 1
    return candidate


def _without_suffix(name: str, word: str) -> str:
    """`name` without a last " (WORD)" or " (WORD N)", what `_free_title` adds."""
    return re.sub(rf" \({re.escape(word)}(?: \d+)?\)$", "", name)


def _origin(given: Any) -> str | None:
    """The export's conversation id, when it is one flashcode writes (12 hex digits): untrusted, kept as a label."""
    return given if isinstance(given, str) and re.fullmatch(r"[0-9a-f]{12}", given) else None


def import_json(
    db: Database, data: Any, project_id: str, convert_event: EventConverter | None = None
) -> Imported:
    """Add a conversation from `export_json`'s shape (or any JSON object with a `messages` list of
    `{"role": "user" | "assistant", "content": "..."}`) as a NEW conversation of `project_id`: nothing
    already stored is touched. Everything in the file is untrusted: roles, statuses and reply numbers are
    checked, events go through `convert_event` (None: left out) and their action ids are renumbered
    below zero (they cannot meet this database's). Raises ConversationImportError before writing anything."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ConversationImportError(
            "this is not a conversation export: expected a JSON object with a 'messages' list "
            "(File › Export as JSON writes one)"
        )
    raw = data["messages"]
    if len(raw) > MAX_IMPORT_MESSAGES:
        raise ConversationImportError(
            f"it has {len(raw)} messages; at most {MAX_IMPORT_MESSAGES} can be imported"
        )
    skipped: list[str] = []
    given = data.get("format")
    if isinstance(given, str) and given != EXPORT_FORMAT:  # a newer flashcode's, or another program's
        skipped.append(
            f"whatever its format {_text(given[:60])!r} holds beyond {EXPORT_FORMAT!r} (what this flashcode reads)"
        )
    messages: list[tuple[Any, str, str, str, dict[str, Any], float | None]] = []
    for i, m in enumerate(raw, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConversationImportError(f"message {i} is not an object with a text 'content'")
        role = m.get("role")
        if role not in ("user", "assistant"):
            skipped.append(
                f"message {i} (role {str(role)[:40]!r}: only user and assistant messages are kept)"
            )
            continue
        status = m.get("status") if m.get("status") in IMPORT_STATUSES else "complete"
        if m.get("status") == "streaming":
            status = "incomplete"
        created = _number(m.get("created_at"))
        if role == "assistant":
            stats = _imported_stats(m.get("stats"))
        else:
            stats = _imported_user_stats(m.get("stats"), m["content"])
        messages.append((_key(m.get("id")), role, _text(m["content"]), status, stats, created))
    if not messages:
        raise ConversationImportError("it has no user or assistant messages to import")
    title = data.get("title") if isinstance(data.get("title"), str) else ""
    # on one line, without controls, bidi or zero-width characters (a title with escape sequences was printed as
    # it stood by `flashcode conversations`; U+202E turned it around in the list)
    shown = "".join(c if c.isprintable() else " " for c in _text(title))
    title = _imported_title(db, project_id, " ".join(shown.split())[:120] or "Imported conversation")
    events = data.get("events") if isinstance(data.get("events"), list) else []
    # always chat mode: continued, the file's messages are the model's context as they are, so the tools
    # (and this project's allow rules) wait until the user switches it to agent mode
    mode = "chat"
    generation = _imported_generation(data.get("generation"))

    now = time.time()
    conv = Conversation(uuid.uuid4().hex[:12], title, None, None, now, now, project_id, mode)
    for key in ("model", "backend"):
        if isinstance(data.get(key), str):
            setattr(conv, key, _text(data[key][:200]))
    ids: dict[Any, int] = {}  # the file's message ids -> the new ones
    actions: dict[Any, int] = {}  # the file's action ids -> new ones below zero
    known: list[int] | None = None  # the file's integer message ids, sorted (for events after a missing one)
    kept = 0
    try:
        with transaction(db.conn):
            db.conn.execute(
                "INSERT INTO conversations (id, title, model, backend, created_at, updated_at, project_id, mode, "
                "generation, imported_from) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (conv.id, conv.title, conv.model, conv.backend, now, now, project_id, mode,
                 json.dumps(generation) if generation else None, _origin(data.get("id"))),
            )  # fmt: skip

            def notice(text: str, level: str = "warning") -> None:  # at the top of the transcript
                db.conn.execute(
                    "INSERT INTO conversation_events (conversation_id, after_message, type, data, created_at) "
                    "VALUES (?,0,'notice',?,?)",
                    (conv.id, json.dumps({"type": "notice", "text": text, "level": level}), now),
                )

            if data.get("mode") == "agent":  # the page would show Chat with no word why
                notice(
                    "Exported in agent mode; imported, it continues in chat mode: the tools (and this project's "
                    "allow rules) wait until you choose Agent in the Mode menu.",
                    "info",
                )
            if generation.get("system"):  # the model reads it first: the transcript says so, at the top
                notice(
                    "Imported with its own system prompt, which the model reads before every message (Special › "
                    f"Generation Settings… shows and changes it): “{generation['system'][:400]}”"
                )
            for old_id, role, content, status, stats, created in messages:
                cur = db.conn.execute(
                    "INSERT INTO messages (conversation_id, role, content, status, stats, created_at) "
                    "VALUES (?,?,?,?,?,?)",
                    (conv.id, role, content, status, json.dumps(stats) if stats else None, created or now),
                )
                if old_id is not None:
                    ids.setdefault(old_id, int(cur.lastrowid or 0))
            for i, e in enumerate(events, 1):
                if (
                    not isinstance(e, dict)
                    or not isinstance(e.get("type"), str)
                    or not isinstance(e.get("data"), dict)
                ):
                    skipped.append(f"event {i} (not an object with a 'type' and a 'data' object)")
                    continue
                converted = convert_event(e["type"], _texts(e["data"])) if convert_event else None
                if converted is None:
                    skipped.append(f"event {i} ({e['type'][:40]!r})")
                    continue
                type_, event = converted
                if "action_id" in event:
                    old_action = _key(event["action_id"])
                    new_action = (
                        None if old_action is None else actions.setdefault(old_action, -1 - len(actions))
                    )
                    event = event | {"action_id": new_action}
                after = _key(e.get("after_message"))
                if after in (0, None):
                    after_new = 0
                elif after in ids:
                    after_new = ids[after]
                else:  # a message left out or since deleted: after the newest one before it
                    if known is None:  # once, sorted: a file of many such events is not events x messages
                        known = sorted(k for k in ids if isinstance(k, int) and not isinstance(k, bool))
                    at = bisect.bisect_right(known, after) if isinstance(after, int) else 0
                    after_new = ids[known[at - 1]] if at else 0
                db.conn.execute(
                    "INSERT INTO conversation_events (conversation_id, after_message, type, data, created_at) "
                    "VALUES (?,?,?,?,?)",
                    (
                        conv.id,
                        after_new,
                        _text(type_),
                        json.dumps(event, default=str),
                        _number(e.get("created_at")) or now,
                    ),
                )
                kept += 1
            if skipped:  # the page goes straight to the conversation: it says so there, at the top
                left = "; ".join(skipped[:20]) + (
                    f"; and {len(skipped) - 20} more" if len(skipped) > 20 else ""
                )
                notice(f"Left out of the import: {left}.")
    except (sqlite3.Error, ValueError, TypeError, RecursionError) as exc:  # nothing is kept
        if (problem := storage_problem(exc, db.path)) is not None:  # not the file's fault
            raise StorageError(problem) from exc
        # a value nothing above foresaw
        raise ConversationImportError(
            f"it holds a value flashcode cannot store ({type(exc).__name__}: {exc})"
        ) from exc
    return Imported(conv, len(messages), kept, skipped)
