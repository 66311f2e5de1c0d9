"""SQLite storage: migrations, WAL, the message lifecycle and crash recovery."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from webapp import db as dbmod
from webapp.db import Database, export_json, export_markdown


def test_db_uses_wal_and_records_migrations(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    assert d.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    versions = [r[0] for r in d.conn.execute("SELECT version FROM schema_migrations")]
    assert versions == [v for v, _, _ in dbmod.MIGRATIONS]
    d.close()
    assert dbmod.migrate(sqlite3.connect(tmp_path / "f.db")) == []  # idempotent


def test_db_later_migration_is_applied_once(tmp_path: Path, monkeypatch) -> None:
    Database(tmp_path / "f.db").close()
    extra = (99, "a later issue's table", "CREATE TABLE later (id INTEGER PRIMARY KEY)")
    monkeypatch.setattr(dbmod, "MIGRATIONS", [*dbmod.MIGRATIONS, extra])
    d = Database(tmp_path / "f.db")
    assert d.conn.execute("SELECT name FROM schema_migrations WHERE version=99").fetchone()[0] == extra[1]
    d.close()
    Database(tmp_path / "f.db").close()


def test_db_conversation_crud_and_cascade(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    c = d.create_conversation("Hello", "m", "mlx")
    d.add_message(c.id, "user", "hi")
    assert d.rename_conversation(c.id, "Renamed")
    assert d.get_conversation(c.id).title == "Renamed"
    assert [x.id for x in d.list_conversations()] == [c.id]
    assert d.delete_conversation(c.id)
    assert d.get_conversation(c.id) is None
    assert d.conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0


def test_db_reply_cut_by_crash_is_kept_and_marked_incomplete(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    c = d.create_conversation("x")
    d.add_message(c.id, "user", "tell me")
    reply = d.add_message(c.id, "assistant", "", status="streaming")
    d.save_partial(reply.id, "Once upon a")
    d.conn.close()  # the process dies here: no finish_message
    d2 = Database(tmp_path / "f.db")
    assert d2.recovered == 1
    last = d2.messages(c.id)[-1]
    assert (last.status, last.content) == ("incomplete", "Once upon a")


def test_db_finish_message_stores_stats_and_exports(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    c = d.create_conversation("Export me", "m", "mlx")
    d.add_message(c.id, "user", "q")
    r = d.add_message(c.id, "assistant", "", status="streaming")
    d.finish_message(r.id, "**a**", "complete", {"completion_tokens": 2})
    msgs = d.messages(c.id)
    assert msgs[-1].stats == {"completion_tokens": 2}
    md = export_markdown(c, msgs)
    assert md.startswith("# Export me") and "## User" in md and "**a**" in md
    js = export_json(c, msgs)
    assert js["title"] == "Export me" and js["messages"][1]["content"] == "**a**"
