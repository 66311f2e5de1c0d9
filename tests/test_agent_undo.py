"""Undoing a write of the agent's file tools: the earlier text is kept in the database, and Undo puts it back
(or removes a file the write made) only while the file still holds what the write left, checked on descriptors
as a write is. The file tools on a real folder; the web app in-process, its model's calls scripted."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import FakeBackend
from tests.test_agent_ws import agent_conversation, send, until
from tests.test_transcript import replayed
from webapp.agent.files import FileToolError, ProjectFiles, StaleChange, text_sha256
from webapp.agent.store import AgentStore
from webapp.projects.store import project_id_for


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "proj"
    p.mkdir()
    (p / "app.py").write_text("def add(a, b):\n    return a - b\n")
    monkeypatch.chdir(tmp_path)
    return p


def test_undo_puts_back_the_earlier_text_and_keeps_the_files_mode(project: Path) -> None:
    files = ProjectFiles(project)
    os.chmod(project / "app.py", 0o751)
    change = files.propose_edit("app.py", "a - b", "a + b")
    files.apply(change)
    files.undo("app.py", change.old, text_sha256(change.new))
    assert (project / "app.py").read_text() == "def add(a, b):\n    return a - b\n"
    assert (project / "app.py").stat().st_mode & 0o777 == 0o751
    assert not [p.name for p in project.iterdir() if p.name.startswith(".flashcode-")]  # no temp file left


def test_undo_of_a_write_that_made_the_file_removes_it(project: Path) -> None:
    files = ProjectFiles(project)
    change = files.propose_write("pkg/new.py", "x = 1\n")
    files.apply(change)
    assert change.old is None and (project / "pkg" / "new.py").exists()
    assert files.undo("pkg/new.py", None, text_sha256(change.new)) == "removed"
    assert not (project / "pkg" / "new.py").exists() and (project / "pkg").is_dir()  # made_dirs not given


def test_undo_of_a_made_file_removes_the_folders_its_write_made_while_empty(project: Path) -> None:
    """`pkg/sub/new.py` in a project with neither folder: an undo left pkg/sub behind (a walkthrough's)."""
    files = ProjectFiles(project)
    (project / "kept").mkdir()  # a folder the user made, empty: no write made it, no undo removes it
    change = files.propose_write("kept/a/b/new.py", "x = 1\n")
    assert files.apply(change) == 2
    assert files.undo("kept/a/b/new.py", None, text_sha256(change.new), made_dirs=2) == "removed"
    assert not (project / "kept" / "a").exists() and (project / "kept").is_dir()

    change = files.propose_write("pkg/sub/new.py", "x = 1\n")
    assert files.apply(change) == 2
    (project / "pkg" / "mine.txt").write_text("put there since\n")  # pkg holds something now: it stays
    assert files.undo("pkg/sub/new.py", None, text_sha256(change.new), made_dirs=2) == "removed"
    assert not (project / "pkg" / "sub").exists()
    assert (project / "pkg" / "mine.txt").read_text() == "put there since\n"

    change = files.propose_write("gone/new.py", "x = 1\n")
    assert files.apply(change) == 1 and files.apply(files.propose_write("app.py", "y\n")) == 0
    (project / "gone" / "new.py").unlink()  # removed since: the undo has only its empty folder left to remove
    assert files.undo("gone/new.py", None, text_sha256(change.new), made_dirs=1) == "gone"
    assert not (project / "gone").exists()
    (project / "kept" / "c").mkdir()
    os.symlink(
        project / "kept", project / "link"
    )  # rmdir never follows a link: the link stays, as its target
    change = files.propose_write("link2/new.py", "x\n")
    files.apply(change)
    (project / "link2" / "new.py").unlink()
    (project / "link2").rmdir()
    os.symlink(project / "kept" / "c", project / "link2")
    files.undo("link2/new.py", None, text_sha256(change.new), made_dirs=1)
    assert (project / "link2").is_symlink() and (project / "kept" / "c").is_dir()


def test_a_write_keeps_how_many_folders_it_made_and_the_store_hands_it_to_undo(tmp_path: Path) -> None:
    from webapp.db import Database

    db = Database(tmp_path / "f.db")
    store = AgentStore(db.conn)
    store.record_file_change(1, "p", None, "a/b/c.py", None, "x\n", 2)
    store.record_file_change(2, "p", None, "d.py", "old\n", "x\n")
    assert [(c.action_id, c.made_dirs) for c in store.file_changes("p")] == [(2, 0), (1, 2)]
    db.close()


def test_undo_refuses_a_file_changed_since_and_writes_nothing(project: Path) -> None:
    files = ProjectFiles(project)
    change = files.propose_edit("app.py", "a - b", "a + b")
    files.apply(change)
    (project / "app.py").write_text("the user's own text\n")
    with pytest.raises(StaleChange, match="changed since that write.*nothing was put back"):
        files.undo("app.py", change.old, text_sha256(change.new))
    assert (project / "app.py").read_text() == "the user's own text\n"
    made = files.propose_write("made.txt", "made\n")
    files.apply(made)
    (project / "made.txt").write_text("made, then the user's\n")
    with pytest.raises(StaleChange):  # a file the write made is not removed once it holds other text
        files.undo("made.txt", None, text_sha256(made.new))
    assert (project / "made.txt").read_text() == "made, then the user's\n"
    (project / "made.txt").unlink()  # what undoing it would do is done: nothing left to undo, no error
    assert files.undo("made.txt", None, text_sha256(made.new)) == "gone"
    change = files.propose_edit("app.py", "the user's own", "an edit of the")
    files.apply(change)
    (project / "app.py").unlink()  # a file the write changed, gone since: its earlier text is not put back
    with pytest.raises(StaleChange, match="is gone"):
        files.undo("app.py", change.old, text_sha256(change.new))
    assert not (project / "app.py").exists()


def test_undo_never_removes_a_file_that_replaced_the_checked_one(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A made file replaced between the check and the removal (an editor's save, a formatter the agent runs):
    the newer file is never deleted; it keeps its name, and the undo says why nothing was removed."""
    files = ProjectFiles(project)
    made = files.propose_write("made.txt", "made\n")
    files.apply(made)
    read = ProjectFiles._text

    def read_then_replaced(fd: int, rel: str) -> tuple[str, int]:
        out = read(fd, rel)
        (project / "newer.tmp").write_text("the user's newer text\n")
        os.replace(project / "newer.tmp", project / "made.txt")  # the name now holds another file
        return out

    monkeypatch.setattr(ProjectFiles, "_text", staticmethod(read_then_replaced))
    with pytest.raises(StaleChange, match="was replaced while it was being undone: nothing was removed"):
        files.undo("made.txt", None, text_sha256(made.new))
    assert (project / "made.txt").read_text() == "the user's newer text\n"
    assert not [p.name for p in project.iterdir() if p.name.startswith(".flashcode-")]


def test_undo_never_follows_a_symlink_swapped_in_for_the_file(project: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("def add(a, b):\n    return a + b\n")  # what the write left: the hash matches
    files = ProjectFiles(project)
    change = files.propose_edit("app.py", "a - b", "a + b")
    files.apply(change)
    (project / "app.py").unlink()
    (project / "app.py").symlink_to(outside)
    with pytest.raises(FileToolError):
        files.undo("app.py", change.old, text_sha256(change.new))
    assert outside.read_text() == "def add(a, b):\n    return a + b\n"


def test_undo_in_the_page_puts_back_an_agent_edit_and_the_transcript_keeps_it(
    tmp_path: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's edit (auto-approved, as Settings allows) shows Undo on its card; Undo asks the server, which
    puts the earlier text back and logs a notice; reloaded, the card says undone; a second Undo changes nothing;
    a change made since is refused, with the earlier text offered to download."""
    from webapp import cli

    monkeypatch.setenv(
        "FLASHCODE_HOME", str(tmp_path / "data")
    )  # `cli.main --data-dir` sets it; restored after
    fake = FakeBackend(tools=True)
    fake.enqueue_call("edit_file", path="app.py", old_text="a - b", new_text="a + b").enqueue("Fixed.")
    fake.enqueue_call("write_file", path="notes.md", content="notes\n").enqueue("Noted.")
    with agent_conversation(tmp_path, project, fake) as (app, client, sock, cid):
        state = app.state.flashcode
        AgentStore(state.db.conn).set_edits_approved(state.projects.current().id, True)
        send(sock, type="send", text="fix add in app.py", conversation_id=cid)
        frames = until(sock, r"Fixed\.")
        until(sock, r'data-state="idle"')
        assert (project / "app.py").read_text() == "def add(a, b):\n    return a + b\n"
        action = re.search(r'hx-post="/agent/changes/(\d+)/undo"', frames)
        assert action, frames
        assert (
            'hx-confirm="Undo the write of app.py? It gets back' in frames
        )  # it named no file (walkthrough)
        url = f"/agent/changes/{action.group(1)}/undo"
        csrf = {"x-csrf-token": state.csrf_token}
        assert client.post(url).status_code == 403  # no CSRF token: nothing is undone
        assert (project / "app.py").read_text().endswith("a + b\n")
        r = client.post(url, headers=csrf)
        assert r.status_code == 200 and "undone" in r.text
        assert "Undid the write of app.py: it holds its earlier text again." in r.text
        assert (project / "app.py").read_text() == "def add(a, b):\n    return a - b\n"
        page = "".join(replayed(client.get(f"/c/{cid}").text))
        assert "Undid the write of app.py" in page and "· <em>undone</em>" in page
        assert f'hx-post="{url}"' not in page  # the card offers it no more
        r = client.post(url, headers=csrf)  # again: nothing more happens
        assert "undone" in r.text and (project / "app.py").read_text().endswith("a - b\n")

        send(sock, type="send", text="write notes", conversation_id=cid)
        frames = until(sock, r"Noted\.")
        until(sock, r'data-state="idle"')
        # the model is told, where it happened: it would take app.py for what it wrote
        told = [str(m["content"]) for m in fake.history[-1].messages]
        note = told.index("The write of app.py was undone: it holds what it held before that write.")
        assert told[note - 1] == "Fixed." and told[note + 2].endswith("write notes")
        made = re.search(r'hx-post="/agent/changes/(\d+)/undo"', frames)
        assert made and (project / "notes.md").read_text() == "notes\n"
        (project / "notes.md").write_text("notes, and the user's line\n")
        r = client.post(f"/agent/changes/{made.group(1)}/undo", headers=csrf)
        assert "Not undone: notes.md changed since that write (by you, a command, or a later write)" in r.text
        assert (project / "notes.md").read_text() == "notes, and the user's line\n"
        assert "Download its earlier text" not in r.text  # the write made it: there was none
        # after a reload the card says so at once, with no Undo that would only be refused (it offered one)
        page = "".join(replayed(client.get(f"/c/{cid}").text))
        assert "Wrote notes.md" in page and f'hx-post="/agent/changes/{made.group(1)}/undo"' not in page
        assert "Cannot be undone now: the file changed since." in page
        (project / "notes.md").write_text("notes\n")  # as the write left it again: Undo is offered again
        assert f'hx-post="/agent/changes/{made.group(1)}/undo"' in "".join(
            replayed(client.get(f"/c/{cid}").text)
        )
        (project / "notes.md").write_text("notes, and the user's line\n")
        before = client.get(f"/agent/changes/{made.group(1)}/before")
        assert before.status_code == 404 and "had no earlier text" in before.text
        before = client.get(f"/agent/changes/{action.group(1)}/before")
        assert before.text == "def add(a, b):\n    return a - b\n"
        assert "app.py.before" in before.headers["content-disposition"]
        # an imported copy's card names its write by an id of the database it came from (renumbered on import):
        # no Undo there, though here that id names a real write of this same file
        exported = client.get(f"/c/{cid}/export.json").text
        r = client.post(
            "/conversations/import",
            files={"file": ("c.json", exported, "application/json")},
            data={"project_id": state.projects.current().id},
            headers=csrf | {"HX-Request": "true"},
        )
        copy_id = r.headers["hx-redirect"].removeprefix("/c/")
        copy = "".join(replayed(client.get(f"/c/{copy_id}").text))
        assert "Wrote notes.md" in copy and "/undo" not in copy and "undone" not in copy
        # nor is its model told of an undo it logged: that names a write of the database it came from
        turns = state.agent.turns()
        state.db.add_message(copy_id, "user", "next")  # the turn being run (left out of the history)
        state.db.add_message(cid, "user", "next")
        assert not [m for m in turns._stored_history(copy_id) if "was undone" in m["content"]]
        assert [m for m in turns._stored_history(cid) if "The write of app.py was undone" in m["content"]]
        (project / "notes.md").write_text("notes\n")  # back to what the write left: now it can be undone
        r = client.post(f"/agent/changes/{made.group(1)}/undo", headers=csrf)
        assert "removed it (that write had made it)" in r.text and not (project / "notes.md").exists()
        # /write with no content would have asked to empty the file: refused, nothing asked (walkthrough)
        send(sock, type="send", text="/write app.py", conversation_id=cid)
        frames = until(sock, r"needs the file&#39;s new content")
        assert "dialog-" not in frames and (project / "app.py").read_text().endswith("a - b\n")
        until(sock, r'data-state="idle"')
        send(
            sock, type="send", text="/write pkg/__init__.py", conversation_id=cid
        )  # a new, empty file: asked
        frames = until(sock, r'id="dialog-[\w-]+"')
        dialog = re.search(r'id="dialog-([\w-]+)"', frames)
        assert dialog and "needs the file" not in frames and "pkg/__init__.py" in frames
        send(sock, type="answer", dialog_id=dialog.group(1), choice="deny")
        until(sock, r'data-state="idle"')
        # undone from a terminal: logged as the card's Undo is, so the model hears of it too
        fake.enqueue_call("write_file", path="late.txt", content="late\n").enqueue("Late.")
        send(sock, type="send", text="write late", conversation_id=cid)
        late = re.search(r'hx-post="/agent/changes/(\d+)/undo"', until(sock, r"Late\."))
        until(sock, r'data-state="idle"')
        assert (
            late and cli.main(["changes", "--data-dir", str(tmp_path / "data"), "undo", late.group(1)]) == 0
        )
        assert not (project / "late.txt").exists()
        assert [e.data["path"] for e in state.db.events(cid, "file_undone")] == [
            "app.py",
            "notes.md",
            "late.txt",
        ]
        state.db.add_message(cid, "user", "next")
        told = [m["content"] for m in state.agent.turns()._stored_history(cid)]
        assert told[-2] == "The write of late.txt was undone: it holds what it held before that write."
        # deleted for good, the conversation takes the earlier texts of its writes along (Empty Trash says
        # "for good"): nothing of its files is kept after it
        agents = AgentStore(state.db.conn)
        assert agents.file_change(int(action.group(1))) is not None
        state.db.delete_conversation(cid)
        assert agents.file_change(int(action.group(1))) is None and not agents.file_changes(
            state.projects.current().id
        )


def test_flashcode_changes_lists_the_agents_writes_and_undoes_one(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`flashcode agent --approve all` writes with no look at the diff (a walkthrough's 0.5B model overwrote the
    wrong file): it says how to undo each write, and `flashcode changes undo ID` does, as the page's Undo."""
    from webapp import cli, engine_host, preflight

    fake = FakeBackend(tools=True)
    fake.enqueue_call("read_file", path="app.py")  # write_file replaces only a file the agent read
    fake.enqueue_call("write_file", path="app.py", content="print('hello')\n")
    fake.enqueue_call("write_file", path="hello.py", content="print('hello')\n")
    fake.enqueue("Done.")
    monkeypatch.setattr(engine_host, "make_loaded_backend", lambda backend, model, options=None: fake)
    monkeypatch.setattr(preflight, "check_model", lambda name, root: None)  # the scripted engine is installed
    monkeypatch.setenv("FLASHCODE_HOME", str(project.parent / "home"))
    home = project.parent / "home"
    assert (
        cli.main(["agent", "--project", str(project), "--approve", "all", "--data-dir", str(home), "go"]) == 0
    )
    err = capsys.readouterr().err
    assert (project / "app.py").read_text() == "print('hello')\n"
    # the ids are that data directory's: the command says which (a walkthrough's hint dropped it)
    said = re.findall(
        rf"flashcode: to undo the write of (\S+): flashcode changes --data-dir {home} undo (\d+)", err
    )
    assert [p for p, _ in said] == ["app.py", "hello.py"], err
    first, second = (i for _, i in said)

    assert cli.main(["changes", "--project", str(project)]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [(x[0], x[2], x[3], x[4]) for x in lines] == [
        (second, "proj", "hello.py", "made the file (undo removes it)"),
        (first, "proj", "app.py", "changed it (undo puts it back)"),
    ]
    assert cli.main(["changes", "show", first]) == 0  # the earlier text, before anything is put back
    assert capsys.readouterr().out == "def add(a, b):\n    return a - b\n"
    assert cli.main(["changes", "show", second]) == 1 and "it had no earlier text" in capsys.readouterr().err
    assert cli.main(["changes", "undo", first]) == 0
    assert f"it holds its earlier text again. (write {first}, project proj)" in capsys.readouterr().out
    assert (project / "app.py").read_text() == "def add(a, b):\n    return a - b\n"
    assert cli.main(["changes", "undo", first]) == 0 and "undone already" in capsys.readouterr().out
    (project / "hello.py").write_text("mine now\n")
    assert cli.main(["changes", "undo", second, "--data-dir", str(home)]) == 1
    assert "not undone: hello.py changed since that write" in capsys.readouterr().err
    assert (project / "hello.py").read_text() == "mine now\n"
    assert cli.main(["changes", "undo", "999"]) == 2 and "no file change 999" in capsys.readouterr().err
    assert cli.main(["changes"]) == 0
    assert [x.split("\t")[4] for x in capsys.readouterr().out.splitlines()] == [
        "made the file; the file changed since, so it cannot be undone",  # it said "undo removes it"
        "undone",
    ]
    (project / "app.py").write_text("edited by hand\n")  # the undone write's file: "undone" all the same
    (project / "hello.py").unlink()  # the file the write made is gone: undoing it has nothing left to do
    assert cli.main(["changes"]) == 0
    assert [x.split("\t")[4] for x in capsys.readouterr().out.splitlines()] == [
        "made the file (undo removes it)",
        "undone",
    ]
    (project / "hello.py").write_text("print('hello')\n")
    # a removed project's writes stay listed (they were hidden), with why they cannot be undone now
    assert cli.main(["projects", "remove", "proj"]) == 0
    capsys.readouterr()
    assert cli.main(["changes"]) == 0
    removed = (
        f"(removed) {project_id_for(project.resolve())}"  # its id, not a name lost with it (walkthrough)
    )
    assert [(x[2], x[4]) for x in (line.split("\t") for line in capsys.readouterr().out.splitlines())] == [
        (removed, "made the file; its project was removed from flashcode, so it cannot be undone"),
        (removed, "undone"),
    ]
    # `--project` takes the id as listed (it said "there is no project named …" for every removed project)
    assert cli.main(["changes", "--project", removed.split()[1]]) == 0
    assert [x.split("\t")[3] for x in capsys.readouterr().out.splitlines()] == ["hello.py", "app.py"]
    assert cli.main(["projects", "add", str(project)]) == 0
    capsys.readouterr()
    assert cli.main(["changes", "--project", "nothing-like-it"]) == 2
    assert "there is no project named 'nothing-like-it'" in capsys.readouterr().err

    # a run that stops at its step limit wrote too: the hints come all the same, naming the data directory
    # that $FLASHCODE_HOME chose (no --data-dir given: the walkthrough's command would have opened the default)
    fake.enqueue_call("write_file", path="limit.txt", content="x\n")
    fake.enqueue_call("list_files")
    monkeypatch.setenv("FLASHCODE_HOME", str(home))
    assert cli.main(["agent", "--project", str(project), "--approve", "all", "--max-steps", "1", "go"]) == 3
    err = capsys.readouterr().err
    assert re.search(
        rf"to undo the write of limit\.txt: flashcode changes --data-dir {home} undo \d+", err
    ), err


def test_the_agents_write_of_a_new_folder_is_undone_with_its_folders(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Through the tool loop and `flashcode changes undo`: the folders the write made go with the file."""
    from webapp import cli, engine_host, preflight

    fake = FakeBackend(tools=True)
    fake.enqueue_call("write_file", path="docs/notes/todo.md", content="- one\n")
    fake.enqueue("Done.")
    monkeypatch.setattr(engine_host, "make_loaded_backend", lambda backend, model, options=None: fake)
    monkeypatch.setattr(preflight, "check_model", lambda name, root: None)
    home = project.parent / "home"
    monkeypatch.setenv("FLASHCODE_HOME", str(home))
    assert cli.main(["agent", "--project", str(project), "--approve", "all", "go"]) == 0
    assert (project / "docs" / "notes" / "todo.md").read_text() == "- one\n"
    write = re.search(r"flashcode changes --data-dir \S+ undo (\d+)", capsys.readouterr().err)
    assert write is not None
    assert cli.main(["changes", "undo", write.group(1)]) == 0
    assert "removed it" in capsys.readouterr().out
    assert sorted(p.name for p in project.iterdir()) == ["app.py"]  # docs/notes stayed behind
