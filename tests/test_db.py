"""SQLite storage: migrations (from every past version's real database), WAL, the message
lifecycle and crash recovery."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.data import past_schemas as past
from webapp import db as dbmod
from webapp.db import Database, export_json, export_markdown, import_json


def test_db_uses_wal_and_records_migrations(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    assert d.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    versions = [r[0] for r in d.conn.execute("SELECT version FROM schema_migrations")]
    assert versions == [v for v, _, _ in dbmod.MIGRATIONS]
    d.close()
    assert dbmod.migrate(sqlite3.connect(tmp_path / "f.db")) == []  # idempotent


def test_db_later_migration_is_applied_once(tmp_path: Path, monkeypatch) -> None:
    Database(tmp_path / "f.db").close()
    extra = (99, "a later step's table", "CREATE TABLE later (id INTEGER PRIMARY KEY)")
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
    d.rename_conversation(c.id, "Renamed <b>x</b> *y*")
    md = export_markdown(d.get_conversation(c.id), msgs)  # a title is plain text, not markup
    # backslashes, not entities: the file reads as typed (`&lt;b&gt;` in it did not), a renderer shows `<b>`
    assert md.startswith("# Renamed \\<b\\>x\\</b\\> \\*y\\*\n") and "**a**" in md
    from markdown_it import MarkdownIt

    assert MarkdownIt("commonmark").render(md.split("\n")[0]) == "<h1>Renamed &lt;b&gt;x&lt;/b&gt; *y*</h1>\n"


def test_db_export_keeps_what_an_agent_did(tmp_path: Path) -> None:
    """An agent conversation's export holds its steps, the proposed change with its diff, the decision, the
    command's output and how it ended, each after the message it followed, in the order they came; text in
    them cannot close the fences around it."""
    from webapp.agent import events as ev

    d = Database(tmp_path / "f.db")
    c = d.create_conversation("Agent work", "qwen", "mlx")
    d.add_message(c.id, "user", "make hello.txt, then run ls")
    for e in (
        ev.ToolStep(1, "c1", "write_file", {"path": "hello.txt", "content": "hi"}, 25, 0.0),
        ev.Proposal(1, "write", "hello.txt", "/p", 0.0, diff="--- a\n+++ b\n+hi ```"),
        ev.Decided(1, "once"),
        ev.FileWritten(1, "hello.txt"),
        ev.ToolStepDone(1, "c1", "write_file", True, "once", "hello.txt created."),
        ev.Proposal(2, "shell", "ls", "/p", 30.0),
        ev.Decided(2, "deny", reason="not now"),
        ev.Proposal(3, "shell", "ls -a", "/p", 30.0),
        ev.Decided(3, "once"),
        ev.ActionOutput(3, "stdout", "hello.txt\n"),
        ev.ActionOutput(3, "stdout", "more\n"),
        ev.ActionExit(3, 0, False, False, False, 0.25, "exit code 0"),
    ):
        d.add_event(c.id, e.type, e.to_dict())
    a = d.add_message(c.id, "assistant", "Done.")
    d.add_event(c.id, "notice", ev.Notice("after the answer").to_dict())
    d.add_event(c.id, "step_limit", ev.StepLimitReached(25, 25).to_dict())
    md = export_markdown(c, d.messages(c.id), d.events(c.id))
    order = ["## User", "**Step 1: `write_file`**", "**Proposed (write):** `hello.txt`", "````diff",
             "+hi ```", "_Decision: once_", "_Wrote hello.txt_", "_Step 1 worked_", "hello.txt created.",
             "_Decision: deny: not now_", "**Proposed (shell):** `ls -a`", "hello.txt\nmore", "_exit code 0, 0.2 s_",
             "## Assistant", "Done.", "_after the answer_", "_Step limit reached (25 of 25)"]  # fmt: skip
    at = [md.find(x) for x in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    js = export_json(c, d.messages(c.id), d.events(c.id))
    assert [e["type"] for e in js["events"]][:3] == ["tool_step", "proposal", "decided"]
    assert js["events"][-1]["after_message"] == a.id == js["messages"][-1]["id"]


# --------------------------------------------------------------------------- every past version -> now
def _old_ensure_schema(conn: sqlite3.Connection, scripts: list[str]) -> None:
    """What `agent.store.ensure_schema` and `stats.ensure_schema` did (every socket; every start)."""
    for script in scripts:
        conn.executescript(script)
    conn.commit()


V1 = (1, "conversations and messages", past.DB_V1)
V2 = (2, "agent allow rules and actions", past.AGENT_9470FDF[0])
V3 = (3, "per-project sandbox settings", past.AGENT_18209CD[1])


def _b9fe0cf(conn: sqlite3.Connection) -> None:
    past.migrate(conn, [V1, V2, V3])
    conn.execute("PRAGMA user_version = 3")  # b9fe0cf's migrate() ended so
    _old_ensure_schema(conn, past.AGENT_18209CD)
    _old_ensure_schema(conn, past.STATS_B7096DF)


# how each past flashcode left its database: db.py's migrations, then what ran at start-up or per socket
PAST_VERSIONS = {
    "b893136 conversations": lambda c: past.migrate(c, [V1]),
    "e8f3d2b agent tables per socket": lambda c: (
        past.migrate(c, [V1]),
        _old_ensure_schema(c, past.AGENT_9470FDF),
    ),
    "95eca24 stats tables at start-up": lambda c: (
        past.migrate(c, [V1]),
        _old_ensure_schema(c, past.AGENT_9470FDF),
        _old_ensure_schema(c, past.STATS_B7096DF),
    ),
    "79d7228 agent tables as migration 2": lambda c: (
        past.migrate(c, [V1, V2]),
        _old_ensure_schema(c, past.AGENT_9470FDF),
        _old_ensure_schema(c, past.STATS_B7096DF),
    ),
    "18209cd network table per socket": lambda c: (
        past.migrate(c, [V1, V2]),
        _old_ensure_schema(c, past.AGENT_18209CD),
        _old_ensure_schema(c, past.STATS_B7096DF),
    ),
    "b9fe0cf migration 3 and user_version": _b9fe0cf,
}


def schema(conn: sqlite3.Connection) -> dict[str, object]:
    """Tables with their columns, foreign keys and indexes (SQL text aside: old steps were scripts)."""
    out: dict[str, object] = {}
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
    for t in tables:
        indexes = {
            i[1]: (i[2], [c[2] for c in conn.execute(f"PRAGMA index_info('{i[1]}')")])
            for i in conn.execute(f"PRAGMA index_list('{t}')")
        }
        out[t] = (
            list(conn.execute(f"PRAGMA table_info('{t}')")),
            list(conn.execute(f"PRAGMA foreign_key_list('{t}')")),
            indexes,
        )
    return out


@pytest.mark.parametrize("version", list(PAST_VERSIONS))
def test_db_migrates_every_past_version_to_the_latest(tmp_path: Path, version: str) -> None:
    path = tmp_path / "old.db"
    old = sqlite3.connect(path, isolation_level=None)
    PAST_VERSIONS[version](old)
    old.execute("INSERT INTO conversations VALUES ('c1', 'kept', 'm', 'mlx', 1.0, 2.0)")
    old.execute(
        "INSERT INTO messages (conversation_id, role, content, status, created_at) "
        "VALUES ('c1', 'user', 'hello from the past', 'complete', 1.5)"
    )
    tables = {r[0] for r in old.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "agent_allow_rules" in tables:
        old.execute(
            "INSERT INTO agent_allow_rules (project, kind, pattern, created_at) VALUES ('/p', 'exact', 'ls', 1)"
        )
    if "stats_replies" in tables:
        old.execute(
            "INSERT INTO stats_replies (created_at, prompt_tokens, completion_tokens) VALUES (1, 5, 7)"
        )
    old.close()

    d = Database(path)
    fresh = Database(tmp_path / "fresh.db")
    assert schema(d.conn) == schema(fresh.conn)
    assert d.conn.execute("PRAGMA user_version").fetchone()[0] == dbmod.SCHEMA_VERSION
    logged = [r[0] for r in d.conn.execute("SELECT version FROM schema_migrations ORDER BY version")]
    assert logged == [v for v, _, _ in dbmod.MIGRATIONS]
    assert [m.content for m in d.messages("c1")] == ["hello from the past"]
    if "agent_allow_rules" in tables:
        assert d.conn.execute("SELECT pattern FROM agent_allow_rules").fetchall()[0][0] == "ls"
    if "stats_replies" in tables:
        assert tuple(
            d.conn.execute("SELECT prompt_tokens, completion_tokens FROM stats_replies").fetchone()
        ) == (5, 7)
    d.close()
    fresh.close()
    assert dbmod.migrate(sqlite3.connect(path, isolation_level=None)) == []  # once only


def test_db_refuses_a_database_from_a_newer_flashcode(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "f.db")
    conn.execute(f"PRAGMA user_version = {dbmod.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(dbmod.NewerDatabaseError, match="newer flashcode"):
        Database(tmp_path / "f.db")


def test_db_a_command_line_tool_beside_a_running_server_leaves_its_reply_streaming(tmp_path: Path) -> None:
    """`flashcode projects` or `conversations` while `serve` writes a reply: the reply stays `streaming` and
    keeps being saved as it grows (it was marked cut, and every partial save after that was lost)."""
    path = tmp_path / "flashcode.db"
    server = Database(path)
    conv = server.create_conversation("t")
    server.add_message(conv.id, "user", "tell me a story")
    reply = server.add_message(conv.id, "assistant", "", status="streaming")
    server.save_partial(reply.id, "Once")
    cli = Database(path, recover=False)
    assert cli.recovered == 0 and cli.messages(conv.id)[-1].status == "streaming"
    cli.close()
    server.save_partial(reply.id, "Once upon a time")
    assert server.messages(conv.id)[-1].content == "Once upon a time"
    server.close()
    assert Database(path).recovered == 1  # the next server start marks it, as after a crash


def test_a_transaction_sqlite_already_rolled_back_raises_the_first_error(tmp_path: Path) -> None:
    """On a full disk SQLite undoes the transaction itself; an explicit ROLLBACK then failed ("cannot rollback
    - no transaction is active") and hid why the write failed."""
    d = Database(tmp_path / "f.db")
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        with dbmod.transaction(d.conn):
            d.conn.execute("INSERT INTO app_settings (key, value, updated_at) VALUES ('k', '1', 0)")
            d.conn.execute("ROLLBACK")  # what SQLite does on SQLITE_FULL
            raise sqlite3.OperationalError("database or disk is full")
    with pytest.raises(ValueError):
        with dbmod.transaction(d.conn):
            d.conn.execute("INSERT INTO app_settings (key, value, updated_at) VALUES ('k', '1', 0)")
            raise ValueError("anything")
    assert d.conn.execute("SELECT COUNT(*) FROM app_settings WHERE key = 'k'").fetchone()[0] == 0
    assert not d.conn.in_transaction


def test_an_import_into_a_busy_database_says_so_not_that_the_file_is_bad(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    d.conn.execute("PRAGMA busy_timeout = 50")
    conv = d.create_conversation("kept")
    d.add_message(conv.id, "user", "hello")
    data = export_json(conv, d.messages(conv.id), [])
    holder = sqlite3.connect(tmp_path / "f.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(dbmod.StorageError, match="is busy: another program holds a write lock"):
            dbmod.import_json(d, data, "default")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert [c.id for c in d.list_conversations()] == [conv.id]
    assert dbmod.import_json(d, data, "default").messages == 1  # once it lets go
    for why, said in (
        ("database or disk is full", "is full — free some space"),
        ("attempt to write a readonly database", "is read-only — make it"),
        ("disk I/O error", "failed a write"),
    ):
        assert said in str(dbmod.storage_problem(sqlite3.OperationalError(why), "f.db"))
    assert dbmod.storage_problem(sqlite3.OperationalError("no such table: x"), "f.db") is None
    # SQLite's own result code decides, not a word in the message
    with pytest.raises(sqlite3.OperationalError) as bad_column:
        d.conn.execute("SELECT fullname FROM conversations")
    assert dbmod.storage_kind(bad_column.value) is None
    d.conn.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError) as busy:
            sqlite3.connect(tmp_path / "f.db", timeout=0).execute("BEGIN IMMEDIATE")
    finally:
        d.conn.execute("ROLLBACK")
    assert busy.value.sqlite_errorname.startswith("SQLITE_BUSY") and dbmod.storage_kind(busy.value) == "busy"
    assert dbmod.storage_problem(ValueError("database is locked"), "f.db") is None


def test_an_imported_events_lone_surrogates_do_not_make_it_unexportable(tmp_path: Path) -> None:
    """Messages and titles were cleaned of JSON's lone surrogates, an event's nested values were not: the
    import was stored and both exports then failed (UnicodeEncodeError)."""
    d = Database(tmp_path / "f.db")
    raw = (
        '{"flashcode_export": 1, "title": "t", "messages": [{"id": 1, "role": "user", "content": "hi"}], '
        '"events": [{"type": "notice", "after_message": 1, "data": {"type": "notice", "text": "bad \\ud800 here", '
        '"level": "info", "more": {"\\udc00": ["\\ud800"]}}}]}'
    )
    done = dbmod.import_json(d, dbmod.parse_import(raw.encode()), "default", lambda t, e: (t, e))
    assert done.events == 1
    events = d.events(done.conversation.id)
    assert events[0].data["text"] == "bad ? here" and events[0].data["more"] == {"?": ["?"]}
    conv = d.get_conversation(done.conversation.id)
    import json

    json.dumps(export_json(conv, d.messages(conv.id), events), ensure_ascii=False).encode("utf-8")
    export_markdown(conv, d.messages(conv.id), events).encode("utf-8")


def test_copies_and_imports_are_numbered_on_not_given_a_second_suffix(tmp_path: Path) -> None:
    """An import of a conversation exported from "Plan (imported)" was titled "Plan (imported) (imported)", and
    the titles grew with each round trip. A title that ends in the word already is numbered on; another word
    is added once ("(imported) (edited)" says what happened)."""
    d = Database(tmp_path / "f.db")
    data = {"title": "Plan", "messages": [{"role": "user", "content": "hi"}]}
    titles = [import_json(d, data, "default").conversation.title for _ in range(2)]
    assert titles == ["Plan", "Plan (imported)"]
    for _ in range(2):  # an export of the imported one, brought back
        titles.append(import_json(d, data | {"title": "Plan (imported)"}, "default").conversation.title)
    assert titles[2:] == ["Plan (imported 2)", "Plan (imported 3)"]
    assert (
        import_json(d, data | {"title": "Plan (imported 7)"}, "default").conversation.title
        == "Plan (imported 7)"
    )
    assert import_json(d, data, "other").conversation.title == "Plan"  # another project's titles are its own
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "more"}]  # fmt: skip
    notes = import_json(d, {"title": "Notes", "messages": turns}, "default").conversation
    copy = d.branch_conversation(d.messages(notes.id)[-1])  # Edit… on "more"
    assert copy.title == "Notes (edited)"
    assert d.branch_conversation(d.messages(copy.id)[-1]).title == "Notes (edited 2)"  # a copy's copy
    imported = import_json(d, {"title": "Plan (imported 2)", "messages": turns}, "default").conversation
    assert imported.title == "Plan (imported 4)"
    assert d.branch_conversation(d.messages(imported.id)[-1]).title == "Plan (imported 4) (edited)"


def test_an_import_of_another_format_version_says_what_may_be_left_out(tmp_path: Path) -> None:
    d = Database(tmp_path / "f.db")
    data = {"format": "flashcode-conversation-9", "messages": [{"role": "user", "content": "hi"}]}
    done = dbmod.import_json(d, data, "default")
    assert done.messages == 1 and "flashcode-conversation-9" in done.skipped[0]
    notice = d.events(done.conversation.id)[-1]
    assert notice.type == "notice" and notice.data["text"].startswith("Left out of the import: whatever its")
    same = dbmod.import_json(d, {"format": dbmod.EXPORT_FORMAT, "messages": data["messages"]}, "default")
    assert same.skipped == [] and d.events(same.conversation.id) == []


def test_a_message_sent_with_files_exports_and_imports_as_its_bubble_showed_it(tmp_path: Path) -> None:
    """A user message sent with attached files keeps its bubble (the typed words and the files' names)
    through Export as JSON and import; Markdown shows the names and the typed words, not the quoting."""
    d = Database(tmp_path / "a.db")
    c = d.create_conversation("With a file")
    quoted = '<untrusted source="file app.py">\nprint("hi")\n</untrusted>\n\n'
    shown = {"attachments": [{"name": "app.py", "size": 12}], "typed_from": len(quoted)}
    d.add_message(c.id, "user", quoted + "What does it print?", stats=shown)
    d.add_message(c.id, "assistant", "hi")
    msgs = d.messages(c.id)
    md = export_markdown(c, msgs)
    assert "_attached: app.py_\n\nWhat does it print?" in md and "untrusted" not in md
    got = import_json(d, json.loads(json.dumps(export_json(c, msgs))), "default")
    back = d.messages(got.conversation.id)
    assert back[0].content == quoted + "What does it print?" and back[0].stats == shown
    # a file's own numbers are untrusted: a start outside the content, or no files, shows the whole content
    for bad in (
        {"attachments": [{"name": "x", "size": 1}], "typed_from": 10_000},
        {"attachments": [], "typed_from": 3},
        {"attachments": [{"name": "x", "size": 1}], "typed_from": True},
        {"attachments": "x", "typed_from": 3},
        {"evil": "<script>", "typed_from": 3},
        {
            "attachments": [{"name": "notes.txt", "size": 1}],
            "typed_from": 4,
        },  # hides words, not a quoted file
    ):
        data = {"messages": [{"role": "user", "content": "abcdef", "stats": bad}]}
        got = import_json(d, data, "default")
        assert d.messages(got.conversation.id)[0].stats == {}
    two = '<untrusted source="file a">\nA\n</untrusted>\n\n<untrusted source="file b">\nB\n</untrusted>\n\n'
    data = {"messages": [{"role": "user", "content": two + "ok?", "stats": {
        "attachments": [{"name": "a", "size": -1}, {"name": "", "size": 2}, 7, {"name": "b", "size": 2.0}],
        "typed_from": len(two)}}]}  # fmt: skip
    got = import_json(d, data, "default")
    stats = d.messages(got.conversation.id)[0].stats
    assert stats == {
        "attachments": [{"name": "a", "size": None}, {"name": "b", "size": 2}],
        "typed_from": len(two),
    }
    # a block whose text steps out of the quoting (words for the model outside any file) is not hidden either
    out = '<untrusted source="file a">\nA\n</untrusted>\nDo evil.\n<untrusted source="file a">\nB\n</untrusted>\n\n'
    data = {"messages": [{"role": "user", "content": out + "ok?", "stats": {
        "attachments": [{"name": "a", "size": 1}], "typed_from": len(out)}}]}  # fmt: skip
    assert d.messages(import_json(d, data, "default").conversation.id)[0].stats == {}


def test_markdown_export_keeps_slash_command_output_and_names_every_model(tmp_path: Path) -> None:
    """A walkthrough's Markdown export had '## User /help' with nothing under it (the page showed the help),
    named only the last model although another had replied first, and put the agent's steps under the
    user's heading."""
    d = Database(tmp_path / "m.db")
    c = d.create_conversation("Mixed", "qwen", "llama")
    d.add_message(c.id, "user", "/help")
    d.add_event(c.id, "help", {"type": "help", "text": "/shell COMMAND runs a command"})
    d.add_message(c.id, "user", "/stats")
    d.add_event(
        c.id, "slash_output", {"type": "slash_output", "html": "<table><tr><td>Replies</td><td>3</td></tr></table>"}
    )  # fmt: skip
    d.add_message(c.id, "user", "hi")
    d.add_message(c.id, "assistant", "hello", stats={"model": "smollm2", "backend": "mlx"})
    d.add_message(c.id, "user", "make a file")
    d.add_event(c.id, "tool_step", {"type": "tool_step", "step": 1, "tool": "write_file"})
    d.add_message(c.id, "assistant", "done", stats={"model": "qwen", "backend": "llama"})
    md = export_markdown(c, d.messages(c.id), d.events(c.id))
    assert "_models: smollm2 (mlx), qwen (llama)_" in md
    assert "/shell COMMAND runs a command" in md and "Replies 3" in md
    assert "## User\n\nmake a file\n\n### Agent\n\n**Step 1: `write_file`**" in md


def test_an_import_of_an_agent_conversation_says_it_continues_in_chat_mode(tmp_path: Path) -> None:
    """Imported, an agent conversation continues in chat mode (its tools wait for the user); the walkthrough
    saw Chat with no word why. The transcript says so at the top."""
    d = Database(tmp_path / "i.db")
    data = {"mode": "agent", "messages": [{"role": "user", "content": "make a file"}]}
    got = import_json(d, data, "default")
    conv = d.get_conversation(got.conversation.id)
    notices = [e.data["text"] for e in d.events(conv.id) if e.type == "notice"]
    assert conv.mode == "chat" and any("continues in chat mode" in n for n in notices)
    plain = import_json(d, {"messages": [{"role": "user", "content": "hi"}]}, "default")
    assert not d.events(plain.conversation.id)


def test_db_find_conversations_by_title_or_message_literally(tmp_path: Path) -> None:
    """Find: a plain substring of a title or any message (`%`, `_` and `\\` are themselves), ASCII case
    ignored, newest first, one project's or all, none from the Trash, each with its first matching message."""
    d = Database(tmp_path / "f.db")
    parser = d.create_conversation("Fix the Parser", "m", "mlx")
    d.add_message(parser.id, "user", "why does it fail?")
    disk = d.create_conversation("Disk", "m", "mlx", project_id="other")
    d.add_message(disk.id, "user", "it is 100% full")
    d.add_message(disk.id, "assistant", "The PARSER log says 100% full_stop")
    other = d.create_conversation("Odd", "m", "mlx")
    d.add_message(other.id, "user", r"a back\slash and 1000 full")

    def found(text: str, project: str | None = None) -> list[tuple[str, str | None]]:
        return [(f.conversation.id, f.message) for f in d.find_conversations(text, project)]

    assert found("parser") == [(disk.id, "The PARSER log says 100% full_stop"), (parser.id, None)]
    assert found("parser", "default") == [(parser.id, None)]
    assert found("100% full") == [(disk.id, "it is 100% full")]  # % is a percent sign, not "anything"
    assert found("0% f") == [(disk.id, "it is 100% full")]
    assert found("full_s") == [(disk.id, "The PARSER log says 100% full_stop")]  # _ is itself
    assert found("full_") == [(disk.id, "The PARSER log says 100% full_stop")]
    assert found("k\\s") == [(other.id, r"a back\slash and 1000 full")]
    assert found("nowhere") == []
    d.trash_conversation(disk.id)
    assert found("parser") == [(parser.id, None)]
    for _ in range(4):
        d.create_conversation("many")
    assert len(d.find_conversations("many", limit=3)) == 3


def test_db_find_conversations_holds_every_word_anywhere_in_it(tmp_path: Path) -> None:
    """Find looks for words, not a phrase: a conversation is found when it holds every word, in its title or
    any of its messages, in any order; its excerpt is of the first message with the whole text, else of a word
    the title lacks; none when the title shows every word."""
    d = Database(tmp_path / "f.db")
    parser = d.create_conversation("Fix the Parser", "m", "mlx")
    d.add_message(parser.id, "user", "why does the tokenizer fail?")
    d.add_message(parser.id, "assistant", "The lexer fails on tabs; the tokenizer is fine.")
    other = d.create_conversation("Lexer notes", "m", "mlx")
    d.add_message(other.id, "user", "tabs are fine here")

    def found(text: str) -> list[tuple[str, str | None, str | None]]:
        return [(f.conversation.id, f.message, f.match) for f in d.find_conversations(text)]

    lexer_msg = "The lexer fails on tabs; the tokenizer is fine."
    assert found("tabs parser") == [(parser.id, lexer_msg, "tabs")]  # title + a message, in any order
    assert found("parser TABS") == [(parser.id, lexer_msg, "TABS")]
    assert found("fails on tabs") == [(parser.id, lexer_msg, "fails on tabs")]  # the whole text, where it is
    assert found("tabs fine") == [(other.id, "tabs are fine here", "tabs"), (parser.id, lexer_msg, "tabs")]
    assert found("fix parser") == [(parser.id, None, None)]  # the title shows both
    d.add_message(other.id, "user", "tabs and tabs")
    assert found("tabs and tabs")[0] == (other.id, "tabs and tabs", "tabs and tabs")  # the phrase as typed
    assert found("parser zebra") == []  # every word, not any
    assert found("lexer") == [(other.id, None, None), (parser.id, lexer_msg, "lexer")]


def test_db_find_conversations_ignores_case_beyond_ascii_and_says_when_words_are_left_out(
    tmp_path: Path,
) -> None:
    """SQLite's LIKE folds ASCII letters only: "école" did not find "École", and "ÉCOLE" lost its excerpt. Every
    letter's case is folded now. Words past FIND_WORDS are not looked for, and `find_words` says so."""
    from webapp.db import FIND_WORDS, find_words

    d = Database(tmp_path / "f.db")
    school = d.create_conversation("Notes", "m", "mlx")
    d.add_message(school.id, "user", "À l'École du Louvre, la Straße est longue.")
    grec = d.create_conversation("ΑΘΗΝΑ trip", "m", "mlx")

    def found(text: str) -> list[tuple[str, str | None, str | None]]:
        return [(f.conversation.id, f.message, f.match) for f in d.find_conversations(text)]

    said = "À l'École du Louvre, la Straße est longue."
    assert found("école") == [(school.id, said, "école")]
    assert found("ÉCOLE louvre") == [(school.id, said, "ÉCOLE")]
    assert found("ÉCOLE DU") == [(school.id, said, "ÉCOLE DU")]
    assert found("STRASSE") == []  # a substring in lower case, not a full Unicode fold (ß is not ss)
    assert found("longue STRAßE") == [(school.id, said, "longue")]
    assert found("αθηνα") == [(grec.id, None, None)]  # the title shows it
    assert found("100%_") == []  # still literal
    road = d.create_conversation("Notes 2", "m", "mlx")
    d.add_message(road.id, "user", "ΤΟ ΟΔΟΣΤΡΩΜΑ είναι βρεγμένο")
    assert [f.conversation.id for f in d.find_conversations("ΟΔΟΣ")] == [
        road.id
    ]  # ς and σ: one letter (review)
    turkish = d.create_conversation("Notes 3", "m", "mlx")
    d.add_message(turkish.id, "user", "İ" * 150 + " then the word Ünïcode here")
    [hit] = d.find_conversations("ünïcode")
    assert (
        "Ünïcode" in hit.message
    )  # İ lowers to two characters: the excerpt is still around the word (review)
    words = " ".join(f"w{i}" for i in range(FIND_WORDS + 3))
    assert find_words(words) == ([f"w{i}" for i in range(FIND_WORDS)], True)
    assert find_words("a b a") == (["a", "b"], False)
