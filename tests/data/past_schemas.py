"""Schema SQL and migration code of past flashcode versions, verbatim, as test data.

Copied from git history (the commit is named at each value) so tests can build real databases the way
those versions did, without needing git or the old code at test time. Never edit: a past version
is what users' databases were made by."""

from __future__ import annotations

import sqlite3
import time

# b893136 webapp/db.py MIGRATIONS[0] (version 1, "conversations and messages")
DB_V1 = "\n        CREATE TABLE conversations (\n            id TEXT PRIMARY KEY,\n            title TEXT NOT NULL,\n            model TEXT,\n            backend TEXT,\n            created_at REAL NOT NULL,\n            updated_at REAL NOT NULL\n        );\n        CREATE TABLE messages (\n            id INTEGER PRIMARY KEY AUTOINCREMENT,\n            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,\n            role TEXT NOT NULL,\n            content TEXT NOT NULL,\n            status TEXT NOT NULL DEFAULT 'complete',\n            stats TEXT,\n            created_at REAL NOT NULL\n        );\n        CREATE INDEX messages_by_conversation ON messages(conversation_id, id);\n        CREATE INDEX conversations_by_update ON conversations(updated_at);\n        "

# 9470fdf webapp/agent/store.py MIGRATIONS (run by ensure_schema on every websocket from e8f3d2b)
AGENT_9470FDF = [
    "\n    CREATE TABLE IF NOT EXISTS agent_allow_rules (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        project TEXT NOT NULL,\n        kind TEXT NOT NULL CHECK (kind IN ('exact', 'prefix')),\n        pattern TEXT NOT NULL,\n        created_at REAL NOT NULL,\n        UNIQUE (project, kind, pattern)\n    );\n    CREATE TABLE IF NOT EXISTS agent_actions (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        project TEXT NOT NULL,\n        conversation_id TEXT,\n        tool TEXT NOT NULL,\n        command TEXT NOT NULL,\n        decision TEXT NOT NULL DEFAULT 'pending',\n        rule TEXT,\n        reason TEXT,\n        exit_code INTEGER,\n        outcome TEXT,\n        created_at REAL NOT NULL,\n        decided_at REAL,\n        finished_at REAL\n    );\n    CREATE INDEX IF NOT EXISTS agent_actions_project ON agent_actions (project, created_at);\n    "
]

# 18209cd webapp/agent/store.py MIGRATIONS (the network table added)
AGENT_18209CD = [
    "\n    CREATE TABLE IF NOT EXISTS agent_allow_rules (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        project TEXT NOT NULL,\n        kind TEXT NOT NULL CHECK (kind IN ('exact', 'prefix')),\n        pattern TEXT NOT NULL,\n        created_at REAL NOT NULL,\n        UNIQUE (project, kind, pattern)\n    );\n    CREATE TABLE IF NOT EXISTS agent_actions (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        project TEXT NOT NULL,\n        conversation_id TEXT,\n        tool TEXT NOT NULL,\n        command TEXT NOT NULL,\n        decision TEXT NOT NULL DEFAULT 'pending',\n        rule TEXT,\n        reason TEXT,\n        exit_code INTEGER,\n        outcome TEXT,\n        created_at REAL NOT NULL,\n        decided_at REAL,\n        finished_at REAL\n    );\n    CREATE INDEX IF NOT EXISTS agent_actions_project ON agent_actions (project, created_at);\n    ",
    "\n    CREATE TABLE IF NOT EXISTS agent_project_settings (\n        project TEXT PRIMARY KEY,\n        network INTEGER NOT NULL DEFAULT 0,\n        updated_at REAL NOT NULL\n    );\n    ",
]

# b7096df webapp/stats.py MIGRATIONS (run by stats_view.install at start-up from 95eca24)
STATS_B7096DF = [
    "\n    CREATE TABLE IF NOT EXISTS stats_replies (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        created_at REAL NOT NULL,\n        source TEXT NOT NULL DEFAULT 'chat',          -- chat | api | bench\n        route TEXT,                                   -- chat | search | shell (the agent's route)\n        conversation_id TEXT,\n        message_id INTEGER,\n        backend TEXT,\n        model TEXT,\n        prompt_tokens INTEGER NOT NULL DEFAULT 0,     -- includes cached_tokens\n        cached_tokens INTEGER NOT NULL DEFAULT 0,\n        completion_tokens INTEGER NOT NULL DEFAULT 0,\n        ttft_s REAL,\n        prompt_tps REAL,\n        decode_tps REAL,\n        peak_memory_bytes INTEGER,\n        peak_rss_bytes INTEGER,\n        total_s REAL,\n        flash_hit_rate REAL,\n        flash_bytes_read INTEGER,\n        finish_reason TEXT,\n        bench_run_id INTEGER\n    );\n    CREATE INDEX IF NOT EXISTS stats_replies_time ON stats_replies (created_at);\n    CREATE INDEX IF NOT EXISTS stats_replies_conversation ON stats_replies (conversation_id, id);\n    CREATE TABLE IF NOT EXISTS stats_grades (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        created_at REAL NOT NULL,\n        reply_id INTEGER REFERENCES stats_replies(id) ON DELETE SET NULL,\n        conversation_id TEXT,\n        message_id INTEGER,\n        route TEXT,\n        model TEXT,\n        grade TEXT NOT NULL CHECK (grade IN ('good', 'bad')),\n        note TEXT,\n        excerpt TEXT\n    );\n    CREATE TABLE IF NOT EXISTS stats_bench_runs (\n        id INTEGER PRIMARY KEY AUTOINCREMENT,\n        created_at REAL NOT NULL,\n        backend TEXT,\n        model TEXT,\n        prompts INTEGER NOT NULL,\n        max_tokens INTEGER NOT NULL,\n        decode_tps REAL,\n        ttft_s REAL,\n        prompt_tps REAL,\n        peak_memory_bytes INTEGER,\n        peak_rss_bytes INTEGER,\n        total_s REAL,\n        results TEXT\n    );\n    "
]


# b893136 webapp/db.py migrate(), verbatim but for MIGRATIONS, which is passed in
def migrate(conn: sqlite3.Connection, MIGRATIONS: list) -> list[int]:  # noqa: N803
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
    return applied
