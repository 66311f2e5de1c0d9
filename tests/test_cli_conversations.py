"""`flashcode conversations`: list, export and import from a terminal, run as a user would (the installed
script in a subprocess) on a real SQLite database — beside a web app's own export and import."""

from __future__ import annotations

import json
from pathlib import Path

from starlette.testclient import TestClient

from tests.test_cli import flashcode
from webapp.app import create_app
from webapp.db import Database
from webapp.settings import Settings


def lines(out: str) -> list[list[str]]:
    return [line.split("\t") for line in out.splitlines() if line]


def test_conversations_list_export_and_import_round_trip(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    project = tmp_path / "work"
    project.mkdir()
    db = Database(home / "flashcode.db")
    conv = db.create_conversation("Fix the <b>parser</b>", "qwen", "mlx")
    db.add_message(conv.id, "user", "why does it fail?")
    reply = db.add_message(conv.id, "assistant", "an off-by-one", status="streaming")
    db.finish_message(reply.id, "an off-by-one", "complete", {"completion_tokens": 5, "decode_tps": 9.5})
    db.add_event(
        conv.id, "slash_output", {"type": "slash_output", "html": "<b>shell</b> <script>x()</script>"}
    )
    db.close()

    listed = flashcode("conversations", home=home)
    assert listed.returncode == 0, listed.stderr
    [[cid, _when, count, project_name, title]] = lines(listed.stdout)
    assert (cid, count, project_name, title) == (conv.id, "2", "Default", "Fix the <b>parser</b>")

    out = tmp_path / "backup.json"
    done = flashcode("conversations", "export", cid[:5], "-o", str(out), home=home)  # a unique start will do
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["messages"][1]["content"] == "an off-by-one"
    again = flashcode("conversations", "export", cid, "-o", str(out), home=home)
    assert (
        again.returncode != 0 and "--force replaces it" in again.stderr
    )  # a file is never overwritten unasked
    for inside in (home / "flashcode.db", home / "flashcode.db-wal", home / "models" / "x.json"):
        wiped = flashcode("conversations", "export", cid, "-o", str(inside), "--force", home=home)
        assert wiped.returncode != 0 and "inside flashcode's data directory" in wiped.stderr, wiped.stderr
    kept = Database(home / "flashcode.db")
    assert kept.get_conversation(cid) is not None  # the export had replaced the database
    kept.close()
    md = flashcode("conversations", "export", cid, "--format", "md", home=home)
    assert "## Assistant\n\nan off-by-one" in md.stdout

    assert flashcode("projects", "add", str(project), "--name", "work", home=home).returncode == 0
    imported = flashcode("conversations", "import", str(out), "--project", "work", home=home)
    assert imported.returncode == 0, imported.stderr
    new_id = imported.stdout.strip()
    assert new_id != cid and "as a new conversation (2 messages" in imported.stderr
    assert [row[0] for row in lines(flashcode("conversations", "--project", "work", home=home).stdout)] == [
        new_id
    ]
    # `list`, the action a newcomer types, lists the same (its options before or after it)
    for argv in (("list", "--project", "work"), ("--project", "work", "list")):
        assert [row[0] for row in lines(flashcode("conversations", *argv, home=home).stdout)] == [new_id]
    assert len(lines(flashcode("conversations", "list", "--all", home=home).stdout)) == 2
    # --data-dir after the action as well (a walkthrough's `conversations import --data-dir D FILE` was refused)
    other = tmp_path / "elsewhere"
    listed = flashcode("conversations", "list", "--all", "--data-dir", str(home), home=other)
    assert listed.returncode == 0 and len(lines(listed.stdout)) == 2, listed.stderr
    both = flashcode("conversations", "--all", "list", "--trash", home=home)
    assert both.returncode != 0 and "--all and --trash cannot go together" in both.stderr
    # the option before the action names the project too (the action's own default had replaced it)
    before = flashcode("conversations", "--project", "work", "import", str(out), home=home)
    assert before.returncode == 0, before.stderr
    second = before.stdout.strip()
    assert len(lines(flashcode("conversations", "--project", "work", home=home).stdout)) == 2
    assert {row[0] for row in lines(flashcode("conversations", "--all", home=home).stdout)} == {
        cid,
        new_id,
        second,
    }

    db = Database(home / "flashcode.db")
    try:
        assert [m.content for m in db.messages(new_id)] == ["why does it fail?", "an off-by-one"]
        assert db.messages(new_id)[1].stats["decode_tps"] == 9.5
        [event] = db.events(new_id)  # the logged HTML came in as plain text, as the web app's import has it
        assert event.type == "notice" and "<" not in json.dumps(event.data)
        assert [m.content for m in db.messages(cid)] == ["why does it fail?", "an off-by-one"]  # untouched
    finally:
        db.close()

    # the web app opens what the terminal imported
    with TestClient(
        create_app(Settings(data_dir=home, load_model=False)), base_url="http://127.0.0.1:8000"
    ) as c:
        page = c.get(f"/c/{new_id}")
        assert page.status_code == 200 and "an off-by-one" in page.text


def test_conversations_bad_input_is_one_sentence_and_nothing_stored(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    not_json = tmp_path / "notes.json"
    not_json.write_text("these are my notes")
    no_messages = tmp_path / "other.json"
    no_messages.write_text('{"hello": 1}')
    for args, said in (
        (("import", str(not_json)), "it is not JSON"),
        (("import", str(no_messages)), "expected a JSON object with a 'messages' list"),
        (("import", str(tmp_path / "missing.json")), "could not read"),
        (("import", str(tmp_path)), "is a directory"),
        (("import", str(no_messages), "--project", "nowhere"), "there is no project named 'nowhere'"),
        (("export", "abc123"), "there is no conversation 'abc123'"),
    ):
        done = flashcode("conversations", *args, home=home)
        assert done.returncode != 0 and said in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert flashcode("conversations", "--all", home=home).stdout == ""


def test_conversations_export_and_import_keep_its_generation_settings_and_say_so(tmp_path: Path) -> None:
    """A conversation's own settings (a system prompt, temperature, max tokens) travel with it; the imported
    system prompt is said at the top of the transcript (the model reads it first); odd values are left out."""
    from webapp.db import export_json, import_json

    db = Database(tmp_path / "f.db")
    conv = db.create_conversation("tuned")
    db.add_message(conv.id, "user", "hi")
    db.set_generation(conv.id, {"system": "Answer in French.", "temperature": 0.2, "max_tokens": 77})
    data = export_json(db.get_conversation(conv.id), db.messages(conv.id), db.events(conv.id))
    assert data["generation"] == {"system": "Answer in French.", "temperature": 0.2, "max_tokens": 77}
    done = import_json(db, json.loads(json.dumps(data)), "default")
    assert db.get_conversation(done.conversation.id).generation_settings == data["generation"]
    [notice] = db.events(done.conversation.id)
    assert notice.type == "notice" and "Answer in French." in notice.data["text"]
    odd = {
        "messages": data["messages"],
        "generation": {"temperature": 9, "max_tokens": 2.5, "top_p": "1", "x": 1},
    }
    assert db.get_conversation(import_json(db, odd, "default").conversation.id).generation_settings == {}
    db.close()


def test_conversations_import_reads_no_more_than_the_limit_from_a_pipe_or_device(tmp_path: Path) -> None:
    """A pipe or a device says size 0: the size check passed and the whole stream was read, until
    "unexpected MemoryError"."""
    home = tmp_path / "home"
    home.mkdir()
    Database(home / "flashcode.db").close()
    done = flashcode("conversations", "import", "/dev/zero", home=home)
    assert done.returncode == 2 and "it is over 64 MB" in done.stderr, done.stderr


def test_an_export_that_fails_leaves_the_file_it_would_replace_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """`-o FILE --force` on a full disk truncated FILE (a backup) to what fit: writes are whole or nothing."""
    import errno
    import os

    from engine import paths

    backup = tmp_path / "backup.json"
    backup.write_text('{"kept": true}')

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    try:
        paths.write_text_atomic(backup, "x" * 100_000)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    else:
        raise AssertionError("the write should have failed")
    assert backup.read_text() == '{"kept": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["backup.json"]  # no temporary file left behind
    monkeypatch.undo()
    paths.write_text_atomic(backup, "new")
    assert backup.read_text() == "new"


def test_an_export_piped_into_head_ends_quietly(tmp_path: Path) -> None:
    """`flashcode conversations export ID --format md | head -5` printed "flashcode: [Errno 32] Broken pipe"."""
    import os
    import subprocess

    from tests.test_cli import FLASHCODE

    home = tmp_path / "home"
    home.mkdir()
    db = Database(home / "flashcode.db")
    conv = db.create_conversation("long")
    db.add_message(conv.id, "user", "line\n" * 200_000)  # more than a pipe holds
    db.close()
    proc = subprocess.run(
        f"{FLASHCODE} conversations export {conv.id} --format md | head -2",
        shell=True,
        capture_output=True,
        text=True,
        env={**os.environ, "FLASHCODE_HOME": str(home)},
        timeout=120,
    )
    assert proc.stdout.count("\n") == 2 and proc.stderr == "", proc.stderr


def test_an_atomic_write_keeps_the_files_mode_writes_through_a_symlink_and_to_a_device(
    tmp_path: Path,
) -> None:
    import os
    import stat

    from engine import paths

    kept = tmp_path / "kept.md"
    kept.write_text("old")
    kept.chmod(0o640)
    paths.write_text_atomic(kept, "new")
    assert kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o640
    link = tmp_path / "link.md"
    link.symlink_to(kept)
    paths.write_text_atomic(link, "through")
    assert link.is_symlink() and kept.read_text() == "through"
    fresh = tmp_path / "fresh.md"
    paths.write_text_atomic(fresh, "x")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask
    paths.write_text_atomic(Path("/dev/null"), "nothing")  # a device is written to, never replaced
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_title_with_escape_sequences_reaches_no_terminal(tmp_path: Path) -> None:
    """An imported conversation is untrusted text: its title loses controls and bidi characters on the way in,
    and the list shows any left (a title stored by an older flashcode) as <U+…> markers — a red-team pass
    cleared lines, set the window title and wrote the clipboard (OSC 52) with `flashcode conversations`."""
    home = tmp_path / "home"
    home.mkdir()
    evil = "Harmless \x1b[2K\x1b[1A\x1b]0;owned\x07\x1b]52;c;ZWNobyBwd25lZA==\x07\u202eevil"
    export = {
        "format": "flashcode-conversation",
        "title": evil,
        "messages": [{"role": "user", "content": "hi"}],
    }
    (tmp_path / "evil.json").write_text(json.dumps(export))
    done = flashcode("conversations", "import", str(tmp_path / "evil.json"), home=home)
    assert done.returncode == 0, done.stderr
    db = Database(home / "flashcode.db")
    stored = db.get_conversation(done.stdout.strip())
    assert stored is not None and stored.title.isprintable() and "\u202e" not in stored.title
    older = db.create_conversation(evil, "qwen", "mlx")  # as an older version stored it
    db.close()
    listed = flashcode("conversations", home=home)
    assert listed.returncode == 0 and "\x1b" not in listed.stdout and "\u202e" not in listed.stdout
    assert f"{older.id}\t" in listed.stdout and "<U+001B>]52;c;" in listed.stdout


def test_conversations_find_lists_those_holding_the_text(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    db = Database(home / "flashcode.db")
    a = db.create_conversation("Parser", "qwen", "mlx")
    b = db.create_conversation("Disk", "qwen", "mlx")
    db.add_message(b.id, "assistant", "the disk is 100% FULL")
    db.close()
    got = flashcode("conversations", "--find", "100% full", home=home)
    assert got.returncode == 0, got.stderr
    assert [row[0] for row in lines(got.stdout)] == [b.id]
    assert [
        row[0] for row in lines(flashcode("conversations", "list", "--find", "pars", home=home).stdout)
    ] == [a.id]
    none = flashcode("conversations", "--find", "zebra", home=home)  # piped, as a script would read it
    assert none.returncode == 0 and none.stdout == ""  # nothing to parse
    # said all the same, with the project looked in (the one the web app has open, unless --project says)
    assert "no conversation in project Default holds 'zebra' (--all looks in every project's)" in none.stderr
    assert "the Trash is empty" in flashcode("conversations", "--trash", home=home).stderr
    both = flashcode("conversations", "--trash", "--find", "x", home=home)
    assert both.returncode != 0 and "drop --trash" in both.stderr
