"""Projects: the registry, the migration of a database made by the previous code, scoping of
conversations, rules and stats per project, the dialogs' path checks, the Files window, attachments,
and the command line. Real SQLite, real files, the app in-process (TestClient) with FakeBackend."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from engine.worker import Worker
from tests.conftest import FakeBackend
from webapp import db as dbmod
from webapp.agent.store import AgentStore
from webapp.app import create_app
from webapp.db import Database
from webapp.projects.files import ATTACH_LIMIT, FilesError, ProjectTree
from webapp.projects.store import DEFAULT_ID, ProjectError, ProjectStore, check_directory, project_id_for
from webapp.settings import Settings

BASE = "http://127.0.0.1:8000"
ORIGIN = {"origin": BASE}
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the registry
def test_projects_check_directory_says_why_a_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "home" / "me" / "code").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "me"))
    for raw, message in [
        ("", "type the path"),
        ("relative/dir", "not an absolute path"),
        (str(tmp_path / "missing"), "does not exist"),
        (str(tmp_path / "file.txt"), "is a file, not a directory"),
        ("/", "root directory cannot be a project"),
        *(
            [("/proc/self", "kernel's view"), ("/sys/kernel", "kernel's view"), ("/dev/shm", "kernel's view")]
            if sys.platform.startswith("linux")
            else []
        ),  # fmt: skip
        (str(tmp_path / "home" / "me"), "is your home folder"),
        ("~", "is your home folder"),
        (str(tmp_path / "home"), "holds your home folder"),
    ]:
        with pytest.raises(ProjectError, match=message):
            check_directory(raw)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        import os

        if os.geteuid() != 0:  # root reads anything
            with pytest.raises(ProjectError, match="not readable"):
                check_directory(str(locked))
    finally:
        locked.chmod(0o700)
    assert (
        check_directory(str(tmp_path / "home" / "me" / "code"))
        == (tmp_path / "home" / "me" / "code").resolve()
    )
    assert check_directory("~/code") == (tmp_path / "home" / "me" / "code").resolve()
    with pytest.raises(ProjectError, match="flashcode's own data directory"):
        check_directory(str(tmp_path / "home" / "me" / "code"), data_dir=tmp_path / "home" / "me" / "code")
    # inside the data directory, or holding it: a project's commands and file tools could reach the
    # conversations and saved contexts there (a project at .../data/projects once emptied them)
    data = tmp_path / "home" / "me" / "code" / "data"
    (data / "projects").mkdir(parents=True)
    with pytest.raises(ProjectError, match="is inside flashcode's own data directory"):
        check_directory(str(data / "projects"), data_dir=data)
    with pytest.raises(ProjectError, match="holds flashcode's own data directory"):
        check_directory(str(tmp_path / "home" / "me" / "code"), data_dir=data)
    assert check_directory(str(tmp_path / "home" / "me" / "code"), data_dir=tmp_path / "elsewhere")


def test_projects_first_start_is_the_scratch_project_never_the_cwd(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    current = store.current()
    assert current.id == DEFAULT_ID and current.name == "Default"
    assert current.path == (tmp_path / "data" / "projects" / "scratch").resolve()
    assert current.path.is_dir() and current.path != tmp_path


def test_projects_add_open_remove_keeps_the_directory_and_brings_data_back(tmp_path: Path) -> None:
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    p = store.add(str(work))
    assert p.name == "work" and p.path == work.resolve()
    assert store.add(str(work)).id == p.id  # the same directory is the same project
    (tmp_path / "other").mkdir()
    with pytest.raises(ProjectError, match="already exists"):
        store.add(str(tmp_path / "other"), name="work")
    store.open(p.id)
    assert store.current().id == p.id
    conv = d.create_conversation("in work", project_id=p.id)
    AgentStore(d.conn).add_rule(p.id, "exact", "ls")

    store.remove(p.id)  # keep the data
    assert store.get(p.id) is None and (work / "keep.txt").read_text() == "mine"
    assert store.current().id == DEFAULT_ID
    again = store.add(str(work))
    assert again.id == p.id and [c.id for c in d.list_conversations(p.id)] == [conv.id]

    contexts = tmp_path / "data" / "projects" / p.id / "contexts"
    contexts.mkdir(parents=True)
    store.remove(p.id, delete_data=True)
    assert (work / "keep.txt").read_text() == "mine"  # never the directory
    assert d.list_conversations(p.id) == [] and AgentStore(d.conn).list_rules(p.id) == []
    assert not contexts.exists()
    assert (tmp_path / "data" / "projects" / "scratch").is_dir()
    with pytest.raises(ProjectError, match="stays on the list"):
        store.remove(DEFAULT_ID)


def test_projects_a_name_too_long_is_refused_in_words_one_from_a_long_folder_name_is_cut(
    tmp_path: Path,
) -> None:
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    long_folder = tmp_path / ("w" * 120)
    long_folder.mkdir()
    (tmp_path / "short").mkdir()
    with pytest.raises(ProjectError, match=r"at most 80 characters \(this one has 81\)"):
        store.add(str(tmp_path / "short"), name="n" * 81)
    assert store.add(str(long_folder)).name == "w" * 80  # taken from the folder: cut, as Finder would
    p = store.add(str(tmp_path / "short"), name="n" * 80)
    with pytest.raises(ProjectError, match="at most 80 characters"):
        store.rename(p.id, "r" * 200)
    assert store.get(p.id).name == "n" * 80
    conv = d.create_conversation("x", project_id=p.id)
    d.trash_conversation(conv.id)  # the Trash's are not counted on the list
    assert store.conversation_counts().get(p.id, 0) == 0


def test_projects_a_moved_project_leaves_its_old_folder_free_and_its_data_follows_it(tmp_path: Path) -> None:
    """`projects move` keeps the project's id, which came from its old folder: adding that folder again
    must not collide with it (it raised IntegrityError: a 500 in the Open dialog), and once the moved
    project is removed (data kept), its data comes back with its new folder, never with a new project
    that happens to be at the old place."""
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    old, new = tmp_path / "a", tmp_path / "b"
    old.mkdir()
    p = store.add(str(old))
    conv = d.create_conversation("in a", project_id=p.id)
    AgentStore(d.conn).add_rule(p.id, "exact", "ls")
    (tmp_path / "data" / "projects" / p.id / "contexts").mkdir(parents=True)
    old.rename(new)
    moved = store.move(p.id, str(new))
    assert moved.id == p.id and moved.path == new.resolve()
    old.mkdir()  # a new, unrelated folder where the project was
    fresh = store.add(str(old), name="a again")
    assert fresh.id != p.id and d.list_conversations(fresh.id) == []
    store.remove(fresh.id)
    store.remove(p.id)  # data kept: it follows the folder the project was in last
    assert d.list_conversations(p.id) == []
    stranger = store.add(str(old))
    assert d.list_conversations(stranger.id) == [] and AgentStore(d.conn).list_rules(stranger.id) == []
    back = store.add(str(new))
    assert [c.id for c in d.list_conversations(back.id)] == [conv.id]
    assert [r.pattern for r in AgentStore(d.conn).list_rules(back.id)] == ["ls"]
    assert (tmp_path / "data" / "projects" / back.id / "contexts").is_dir()


def test_projects_listed_before_the_data_directory_rule_stay_usable_with_their_data_guarded(
    tmp_path: Path,
) -> None:
    """A project that holds the data directory (FLASHCODE_HOME inside it), listed before that was refused:
    adding it again returns it (serve --project keeps working), the scratch folder is Default, and the
    agent's file tools treat the data directory as out of bounds (it was read and written there)."""
    from webapp.agent.files import PathOutsideProjectError, ProjectFiles
    from webapp.agent.tools import ReadTools
    from webapp.agent.web import hidden_paths

    app = tmp_path / "myapp"
    data = app / ".flashcode"
    data.mkdir(parents=True)
    d = Database(data / "f.db")
    store = ProjectStore(d.conn, data)
    with pytest.raises(ProjectError, match="holds flashcode's own data directory"):
        store.add(str(app))
    d.conn.execute(
        "INSERT INTO projects (id, name, path, created_at) VALUES (?, 'myapp', ?, 0)",
        (project_id_for(app.resolve()), str(app.resolve())),
    )
    assert store.add(str(app)).name == "myapp"
    assert store.add(str(store.scratch_dir())).id == DEFAULT_ID
    (app / "main.py").write_text("secret = 1\n")
    (data / "notes.txt").write_text("secret = 2\n")
    tools = ReadTools(ProjectFiles(app, hidden_paths(data)))
    for call in (
        lambda: tools.read_file(".flashcode/notes.txt"),
        lambda: tools.files.resolve(".flashcode/f.db"),
    ):
        with pytest.raises(PathOutsideProjectError, match="in a flashcode data directory"):
            call()
    assert ".flashcode" not in tools.list_files(".") and tools.search_text("secret") == "main.py:1:secret = 1"
    scratch = ReadTools(ProjectFiles(store.scratch_dir(), hidden_paths(data)))  # the data dir holds it: fine
    (store.scratch_dir() / "a.txt").write_text("x")
    assert scratch.read_file("a.txt").endswith("x")


def test_projects_removing_a_project_never_merges_its_data_into_a_listed_one(tmp_path: Path) -> None:
    """The project at a moved project's old folder has an id of its own; removed with its data kept, that
    data stays its own (it had been merged into the moved project, network switch included). A removed
    project's kept files beside an earlier one's of the same folder are merged, never overwritten."""
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    agent = AgentStore(d.conn)
    old, new = tmp_path / "a", tmp_path / "b"
    old.mkdir()
    p1 = store.add(str(old))
    old.rename(new)
    store.move(p1.id, str(new))
    old.mkdir()
    p2 = store.add(str(old), name="a again")
    c2 = d.create_conversation("in the new a", project_id=p2.id)
    agent.set_network_allowed(p2.id, True)
    (tmp_path / "data" / "projects" / p2.id / "contexts" / "ctx2").mkdir(parents=True)
    store.remove(p2.id)
    assert d.list_conversations(p1.id) == [] and not agent.network_allowed(p1.id)
    assert not (tmp_path / "data" / "projects" / p1.id / "contexts" / "ctx2").exists()
    assert [c.id for c in d.list_conversations(store.add(str(old)).id)] == [c2.id]  # it comes back with a
    # an earlier project of folder b kept files; the moved one's are added beside them on removal
    kept = tmp_path / "data" / "projects" / project_id_for(new.resolve()) / "contexts" / "ctx-b"
    kept.mkdir(parents=True)
    (tmp_path / "data" / "projects" / p1.id / "contexts" / "ctx1").mkdir(parents=True)
    store.remove(p1.id)
    merged = tmp_path / "data" / "projects" / project_id_for(new.resolve()) / "contexts"
    assert sorted(x.name for x in merged.iterdir()) == ["ctx-b", "ctx1"]


# --------------------------------------------------------------------------- migration
def _previous_code_database(path: Path, project_dir: Path) -> None:
    """A database as the code before projects made it: its own four migration steps (steps are never
    edited, so MIGRATIONS[:4] is that code's list), rows keyed by the directory serve ran in."""
    conn = sqlite3.connect(path, isolation_level=None)
    previous = [m for m in dbmod.MIGRATIONS if m.version <= 4]
    saved = dbmod.MIGRATIONS
    try:
        dbmod.MIGRATIONS = previous
        dbmod.migrate(conn)
    finally:
        dbmod.MIGRATIONS = saved
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    conn.execute("INSERT INTO conversations VALUES ('c1', 'old chat', 'm', 'mlx', 1.0, 2.0)")
    conn.execute(
        "INSERT INTO messages (conversation_id, role, content, status, created_at) "
        "VALUES ('c1', 'user', 'hello from before projects', 'complete', 1.5)"
    )
    key = str(project_dir)
    conn.execute(
        "INSERT INTO agent_allow_rules (project, kind, pattern, created_at) VALUES (?, 'exact', 'ls -la', 1)",
        (key,),
    )
    conn.execute("INSERT INTO agent_project_settings VALUES (?, 1, 5)", (key,))
    conn.execute(
        "INSERT INTO stats_replies (created_at, source, conversation_id, prompt_tokens, completion_tokens) "
        "VALUES (1, 'chat', 'c1', 5, 7)"
    )
    conn.close()


def test_projects_migrates_a_database_made_by_the_previous_code(tmp_path: Path, fake: FakeBackend) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _previous_code_database(data / "flashcode.db", tmp_path / "old-cwd")
    ctx = data / "projects" / "default" / "contexts" / "20260101-000000-abcdef"
    ctx.mkdir(parents=True)
    (ctx / "meta.json").write_text("{}")

    worker = Worker(lambda: fake)
    app = create_app(Settings(data_dir=data, load_model=False), worker=worker)
    with TestClient(app, base_url=BASE) as client:
        parts = app.state.flashcode
        d = parts.db
        assert d.conn.execute("PRAGMA user_version").fetchone()[0] >= 5
        default = parts.projects.current()
        assert (default.id, default.name) == ("default", "Default")
        assert default.path == (data / "projects" / "scratch").resolve()
        assert [c.id for c in d.list_conversations("default")] == ["c1"]
        assert [m.content for m in d.messages("c1")] == ["hello from before projects"]
        store = AgentStore(d.conn)
        assert [r.pattern for r in store.list_rules("default")] == ["ls -la"]
        assert store.network_allowed("default")
        assert d.conn.execute("SELECT project_id FROM stats_replies").fetchone()[0] == "default"
        page = client.get("/").text
        assert "old chat" in page and 'id="menubar-project"' in page and ">Default<" in page
        assert ctx.is_dir()  # saved contexts stay where they were: projects/default/contexts
        assert "ls -la" in client.get("/agent/rules").text
    worker.close()


# --------------------------------------------------------------------------- the web app
@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "alpha", tmp_path / "beta"
    for p in (a, b):
        p.mkdir()
    (a / "main.py").write_text("def hello():\n    return '<b>hi</b>'\n")
    (a / ".gitignore").write_text("build/\n*.log\n")
    (a / "build").mkdir()
    (a / "build" / "out.txt").write_text("x")
    (a / "debug.log").write_text("x")
    (a / "pkg").mkdir()
    (a / "pkg" / ".gitignore").write_text("secret.txt\n")
    (a / "pkg" / "secret.txt").write_text("x")
    (a / "pkg" / "mod.py").write_text("X = 1\n")
    (a / "big.txt").write_text("y" * (ATTACH_LIMIT + 1))
    (a / ".git").mkdir()
    (a / ".git" / "config").write_text("[core]")
    (b / "notes.md").write_text("# beta\n")
    return a, b


@pytest.fixture
def client(tmp_path: Path, fake: FakeBackend) -> Iterator[TestClient]:
    worker = Worker(lambda: fake)
    app = create_app(Settings(data_dir=tmp_path / "data", load_model=False), worker=worker)
    with TestClient(app, base_url=BASE) as c:
        c.headers["X-CSRF-Token"] = app.state.flashcode.csrf_token
        c.headers["origin"] = BASE
        yield c
    worker.close()


def _open(client: TestClient, path: Path | str, **extra: str):
    return client.post("/projects/open", data={"path": str(path), **extra}, headers={"HX-Request": "true"})


def _chat(client: TestClient, text: str) -> str:
    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers=ORIGIN) as sock:
        sock.send_text(json.dumps({"type": "send", "text": text}))
        frames = ""
        for _ in range(200):  # until the reply is done: the controls go idle (the user's message is
            frames += sock.receive_text()  # "complete" from its first frame, before the engine has it)
            if 'data-state="idle"' in frames:
                break
    m = re.search(r'id="conversation-id" value="(\w+)"', frames)
    assert m, frames[-500:]
    return m.group(1)


def test_projects_open_dialog_refuses_a_bad_directory_with_its_message(client, tmp_path: Path) -> None:
    r = _open(client, tmp_path / "nope", mode="open")
    assert r.status_code == 200 and "HX-Redirect" not in r.headers
    assert "does not exist" in r.text and "data-error" in r.text
    r = client.post("/projects/open", data={"path": "x"}, headers={"origin": BASE, "X-CSRF-Token": "bad"})
    assert r.status_code == 403  # the CSRF check covers the new POSTs


def test_new_project_makes_a_folder_that_does_not_exist_yet(client, tmp_path: Path) -> None:
    """Seen in a walkthrough: File > New Project… with a new folder's path said "does not exist: … create the
    folder first". New makes the last folder of the path (Open does not); a missing parent is said, and a folder
    refused once made (here: inside the data directory) is removed again."""
    fresh = tmp_path / "work" / "newapp"
    (tmp_path / "work").mkdir()
    r = _open(client, tmp_path / "work" / "nope", mode="open")
    assert "does not exist" in r.text and not (tmp_path / "work" / "nope").exists()  # Open makes nothing
    r = _open(client, fresh, mode="new", name="New app")
    assert r.headers.get("HX-Redirect") == "/" and fresh.is_dir()
    assert client.app.state.flashcode.projects.current().path == fresh.resolve()
    r = _open(client, tmp_path / "missing" / "deeper", mode="new")
    assert "HX-Redirect" not in r.headers and "New Project makes only the last folder" in r.text
    assert not (tmp_path / "missing").exists()
    (tmp_path / "afile.txt").write_text("x")  # below a file: said as such (it said the file did not exist)
    r = _open(client, tmp_path / "afile.txt" / "sub" / "deeper", mode="new")
    assert f"{tmp_path / 'afile.txt'} is a file, not a directory, so no folder can be made in it" in r.text
    assert "afile.txt does not exist" not in r.text and (tmp_path / "afile.txt").read_text() == "x"
    inside = tmp_path / "data" / "mine"
    r = _open(client, inside, mode="new")
    assert "HX-Redirect" not in r.headers and "data-error" in r.text and not inside.exists()


def test_projects_conversations_rules_and_stats_are_per_project(client, two) -> None:
    a, b = two
    assert _open(client, a, mode="new", name="Alpha").headers["HX-Redirect"] == "/"
    conv_a = _chat(client, "question in alpha")
    page_a = client.get("/").text
    assert "Alpha" in page_a and "question in alpha" in page_a
    rules = AgentStore(client.app.state.flashcode.db.conn)
    project_a = client.app.state.flashcode.projects.current()
    rules.add_rule(project_a.id, "exact", "pwd")
    assert "pwd" in client.get("/agent/rules").text

    _open(client, b)
    page_b = client.get("/").text
    assert ">beta<" in page_b and "question in alpha" not in page_b
    assert "pwd" not in client.get("/agent/rules").text  # alpha's rule is not beta's
    conv_b = _chat(client, "question in beta")
    assert conv_b != conv_a
    assert "question in alpha" not in client.get("/conversations").text
    assert "question in beta" in client.get("/conversations").text
    # a conversation keeps its project: alpha's page shows alpha's list and name
    assert "question in alpha" in client.get(f"/c/{conv_a}").text

    stats_all = client.get("/stats/window").text
    stats_b = client.get(
        "/stats/window", params={"project": client.app.state.flashcode.projects.current().id}
    )
    assert 'data-stat="replies">2<' in stats_all and 'data-stat="replies">1<' in stats_b.text
    assert ">All projects<" in stats_all


def test_projects_the_stats_window_opens_on_the_project_the_page_shows(client, two) -> None:
    """It opened on All projects: it opens on the page's project (a conversation's page: its project's),
    with All projects still in its menu."""
    a, b = two
    _open(client, a, mode="new", name="Alpha")
    conv_a = _chat(client, "question in alpha")
    _open(client, b)
    _chat(client, "question in beta")
    projects = client.app.state.flashcode.projects
    alpha, beta = projects.by_path(a).id, projects.current().id

    def loader(page: str) -> str:
        m = re.search(r'<div class="stats-loader" hx-get="([^"]+)"', page)
        assert m, "no Stats loader on the page"
        return m.group(1).replace("&amp;", "&")

    for page, shown in ((client.get("/").text, beta), (client.get(f"/c/{conv_a}").text, alpha)):
        url = loader(page)
        assert url == f"/stats/window?project={shown}"
        window = client.get(url).text
        assert re.search(rf'<option value="{shown}" selected>', window)
        assert '<option value="all">All projects</option>' in window  # still there to pick
        assert 'data-stat="replies">1<' in window  # that project's reply only
    everyone = client.get("/stats/window", params={"project": "all"}).text
    assert (
        '<option value="all" selected>All projects</option>' in everyone
        and 'data-stat="replies">2<' in everyone
    )
    # saving the price table or its defaults draws the window again for the project it showed (the form
    # sends the menu's value: hx-include), not for All projects
    assert 'hx-post="/stats/prices" hx-include="#stats-project"' in window
    form = {
        "name": ["Mine"],
        "input": ["1"],
        "cached_input": ["0.1"],
        "output": ["2"],
        "as_of": ["2026-11-01"],
    }
    for url, data in (("/stats/prices", form), ("/stats/prices/reset", {})):
        again = client.post(url, data={**data, "project": alpha}).text
        assert re.search(rf'<option value="{alpha}" selected>', again) and 'data-stat="replies">1<' in again


def test_projects_recent_dialog_lists_and_reopens(client, two) -> None:
    a, b = two
    _open(client, a)
    _open(client, b)
    dialog = client.get("/projects/dialog", params={"mode": "recent"}).text
    assert dialog.index(">beta<") < dialog.index(">alpha<")  # newest first
    pid = client.app.state.flashcode.projects.by_path(a).id
    r = client.post("/projects/open", data={"project_id": pid}, headers={"HX-Request": "true"})
    assert r.headers["HX-Redirect"] == "/" and client.app.state.flashcode.projects.current().id == pid


def test_projects_recent_lists_default_though_never_opened_and_marks_a_missing_folder(
    client, two, tmp_path: Path
) -> None:
    """A first start works in Default without opening it: after a New Project its conversations must stay
    one click away. A project whose folder was moved or deleted says so and how to point it at the new place."""
    a, b = two
    conv = _chat(client, "question in default")
    _open(client, a, mode="new")
    _open(client, b)
    shutil.rmtree(a)
    dialog = client.get("/projects/dialog", params={"mode": "recent"}).text
    assert dialog.index(">beta<") < dialog.index(">alpha<") < dialog.index(">Default<")
    assert dialog.count("folder missing") == 1 and "flashcode projects move alpha NEW-FOLDER" in dialog
    store = client.app.state.flashcode.projects
    r = client.post("/projects/open", data={"project_id": "default"}, headers={"HX-Request": "true"})
    assert r.headers["HX-Redirect"] == "/" and store.current().id == "default"
    assert "question in default" in client.get(f"/c/{conv}").text


def test_projects_folder_browser_stays_under_home(client, tmp_path: Path, monkeypatch) -> None:
    web = next(
        r.endpoint.__self__
        for r in client.app.routes
        if getattr(r, "path", "") == "/projects/browse"  # the ProjectsWeb of this app
    )
    web.home = tmp_path
    (tmp_path / "visible").mkdir()
    (tmp_path / ".hidden").mkdir()
    html = client.get("/projects/browse", params={"dir": "/etc"}).text
    assert f'data-dir="{tmp_path}"' in html and "visible" in html and ".hidden" not in html
    assert "Show hidden folders (1)" in html
    shown = client.get("/projects/browse", params={"dir": str(tmp_path), "hidden": "1"}).text
    assert (
        'data-pick-folder="{}"'.format(tmp_path / ".hidden") in shown and "Hide hidden folders (1)" in shown
    )
    # the choice to show them rides along into the folders it lists
    assert '{&#34;hidden&#34;: &#34;1&#34;, "dir": "' + str(tmp_path / "visible") in shown


def test_projects_folder_browser_at_a_home_of_hidden_folders_says_so(client, tmp_path: Path) -> None:
    """A home holding only dot-folders (a fresh account) says so and offers to show them."""
    web = next(r.endpoint.__self__ for r in client.app.routes if getattr(r, "path", "") == "/projects/browse")
    web.home = tmp_path / "fresh"
    (web.home / ".config").mkdir(parents=True)
    (web.home / ".cache").mkdir()
    html = client.get("/projects/browse").text
    assert "No folders here, only 2 hidden." in html and "Show hidden folders (2)" in html
    assert ">.config<" in client.get("/projects/browse", params={"hidden": "1"}).text


def test_projects_files_window_lists_respecting_gitignore_and_views_escaped(client, two) -> None:
    a, _ = two
    _open(client, a)
    listing = client.get("/files/window").text
    names = re.findall(r'<tr data-path="([^"]+)"', listing)
    assert names == ["pkg", ".gitignore", "big.txt", "main.py"]  # folders first; build/, *.log, .git hidden
    inner = re.findall(r'<tr data-path="([^"]+)"', client.get("/files/list", params={"dir": "pkg"}).text)
    assert inner == ["pkg/.gitignore", "pkg/mod.py"]  # the nested .gitignore hides secret.txt
    view = client.get("/files/view", params={"path": "main.py"}).text
    assert "<b>hi</b>" not in view and "&lt;b&gt;" in view and 'class="highlight"' in view
    for bad, why in [
        ("../beta/notes.md", "outside the project"),
        ("build/out.txt", "ignored"),
        (".git/config", "ignored"),
    ]:
        assert why in client.get("/files/view", params={"path": bad}).text


def test_projects_files_window_reads_the_disk_off_the_event_loop_and_a_bounded_gitignore(
    client, two, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cloned repository's .gitignore of 100,000 patterns held every request 14 s per listing (a red-team
    pass): the listing now runs off the event loop — here one held open still lets /health answer — and each
    ignore file counts for at most IGNORE_LINES patterns (past them a file is shown, not hidden)."""
    import threading

    from webapp.projects import files

    a, _ = two
    _open(client, a)
    lines = [f"pat{i}_*/x{i}" for i in range(files.IGNORE_LINES)] + ["late.txt"]
    (a / "pkg" / ".gitignore").write_text("\n".join(lines) + "\n")
    (a / "pkg" / "late.txt").write_text("x")
    inner = re.findall(r'<tr data-path="([^"]+)"', client.get("/files/list", params={"dir": "pkg"}).text)
    assert "pkg/late.txt" in inner and "pkg/mod.py" in inner
    entered, release = threading.Event(), threading.Event()
    listing = files.ProjectTree.list

    def held(self, rel_dir=""):
        entered.set()
        assert release.wait(30)
        return listing(self, rel_dir)

    monkeypatch.setattr(files.ProjectTree, "list", held)
    got: list[str] = []
    slow = threading.Thread(target=lambda: got.append(client.get("/files/list", params={"dir": "pkg"}).text))
    slow.start()
    try:
        assert entered.wait(30)
        assert client.get("/health").status_code == 200  # answered while the listing is held
        assert not got
    finally:
        release.set()
        slow.join(30)
    assert got and "pkg/mod.py" in got[0]


def test_projects_hidden_characters_in_file_names_and_titles_are_marked(client, two) -> None:
    """A file name or a conversation title with a right-to-left override (a model or a cloned repo can
    make either) cannot pass for another name: the hidden character shows as a <U+202E> mark."""
    a, _ = two
    (a / "report\u202egpj.exe").write_text("x")
    _open(client, a)
    listing = client.get("/files/window").text
    assert (
        'report<mark class="invisible-char" title="invisible character">&lt;U+202E&gt;</mark>gpj.exe'
        in listing
    )
    from webapp.render import make_environment

    ui = make_environment().get_template("macros.html").module
    title = "invoice\u202efdp.exe"
    html = str(ui.conversation_list([SimpleNamespace(id="c1", title=title)], "c1")) + str(
        ui.chat_title(title)
    )
    assert html.count('<mark class="invisible-char" title="invisible character">&lt;U+202E&gt;</mark>') == 2
    assert f'data-title="{title}"' in html  # what Rename starts from: the title as it is


def _last_prompt(fake: FakeBackend) -> str:
    request = fake.history[-1]
    return request.messages[-1]["content"] if request.messages else str(request.prompt)


def test_projects_attached_files_reach_the_model_quoted_with_their_path(client, two, fake) -> None:
    """Quoted with the path alone, as read_file quotes a file: with its size in the source ("file main.py (294
    bytes)"), the agent model took "main.py (294 bytes)" for the file's path."""
    a, _ = two
    _open(client, a)
    chip = client.post("/files/attach", data={"path": ["main.py", "big.txt"]}).text
    assert 'data-path="main.py"' in chip and "big.txt is" in chip and "at most" in chip
    _chat(client, "what does this do?")
    prompt = _last_prompt(fake)
    assert prompt.startswith('<untrusted source="file main.py">')
    assert prompt.rstrip().endswith("what does this do?") and "return '<b>hi</b>'" in prompt
    _chat(client, "and now?")  # attachments go with one message only
    assert _last_prompt(fake) == "and now?"


def test_projects_attached_files_reach_the_model_in_agent_mode_too(client, two, fake) -> None:
    """In agent mode the turn was handed the typed words alone: the files attached to the message never
    reached the model. They go with it, quoted, as in a chat reply."""
    a, _ = two
    _open(client, a)
    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers=ORIGIN) as sock:
        frames = _send(sock, {"text": "/agent"})
        cid = re.search(r'id="conversation-id" value="(\w+)"', frames).group(1)
        client.post("/files/attach", data={"path": ["main.py"]})
        before, fake.routes = len(fake.history), ["chat"]  # the router's choice, scripted
        frames = _send(sock, {"text": "what does this do?", "conversation_id": cid})
    asked = [str(r.messages or r.prompt) for r in fake.history[before:]]
    assert asked and all("what does this do?" in q for q in asked if "main.py" in q)
    assert any('<untrusted source="file main.py' in q and "return" in q for q in asked), asked
    # context, not words: a search is for what was typed, never the files' text (it would leave the machine)
    from webapp.agent.store import AgentStore

    db = client.app.state.flashcode.db
    AgentStore(db.conn).set_network_allowed(db.get_conversation(cid).project_id, True)  # else no search runs
    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers=ORIGIN) as sock:
        client.post("/files/attach", data={"path": ["main.py"]})
        fake.routes = ["search"]
        frames = _send(sock, {"text": "python hello", "conversation_id": cid})
    searched = re.findall(r"Searching the web[^<]*", frames)  # the notice names the query
    assert searched and all("hello" in q and "return" not in q and "untrusted" not in q for q in searched)


def test_projects_an_agent_turn_saves_the_live_chat_conversation_before_its_router_scores(
    client, fake
) -> None:
    """An agent turn's router scores its routes on the engine (llama-server: on the slot holding the chat
    conversation) before any generation is submitted, so the conversation's cache was saved after the slot had
    been overwritten (78 router tokens saved for a 120-token conversation; 3 cached after a restart). The save
    of the live conversation is queued when the turn starts, ahead of the router."""
    state = client.app.state.flashcode
    order: list[str] = []
    state.resume._save_before_taken = lambda cid: order.append(f"save {cid}")
    score = fake.score_continuations
    fake.score_continuations = lambda *args: (order.append("route"), score(*args))[1]
    cid = _chat(client, "hello")  # a chat reply: its conversation is the engine's live cache
    fake.routes = ["chat"]  # the router's choice, scripted
    with client.websocket_connect(
        "ws://127.0.0.1:8000/ws", headers=ORIGIN
    ) as sock:  # a new agent conversation
        frames = _send(sock, {"text": "what next?", "mode": "agent"})
    assert 'class="agent-route' in frames and order[:2] == [f"save {cid}", "route"], order


def _send(sock, message: dict[str, str]) -> str:
    """Send one chat message on an open socket; the frames until the turn is over (the controls go idle)."""
    sock.send_text(json.dumps({"type": "send", **message}))
    frames = ""
    while 'data-state="idle"' not in frames:
        frames += sock.receive_text()
    return frames


def _user_bubble(html: str) -> str:
    m = re.search(r'<article[^>]*class="msg msg-user.*?</article>', html, re.S)
    assert m, html[-500:]
    return m.group(0)


def test_projects_an_attached_files_bubble_shows_the_typed_words_and_its_name_not_the_quoting(
    client, two, fake
) -> None:
    """The user's bubble showed the `<untrusted source=…>` block the model is sent: it shows what was typed
    and each file's name and size (escaped), live and after a reload; the model and the database keep the
    quoted text."""
    from tests.test_transcript import replayed

    a, _ = two
    (a / "a<b>.txt").write_text("tag in the name\n")
    _open(client, a)
    client.post("/files/attach", data={"path": ["main.py", "a<b>.txt"]})
    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers=ORIGIN) as sock:
        frames = _send(sock, {"text": "what does this do?"})
    cid = re.search(r'id="conversation-id" value="(\w+)"', frames).group(1)
    live = _user_bubble(frames)
    size = (a / "main.py").stat().st_size
    body = re.search(r'class="body user-text"[^>]*>(.*?)</div>', live, re.S).group(1)
    assert body == "what does this do?"  # the words typed, nothing else
    assert "untrusted" not in live and "return" not in live  # neither the quoting nor the file's text
    assert 'data-path="main.py"' in live and f'main.py <span class="muted">({size:,} bytes)</span>' in live
    assert 'data-path="a&lt;b&gt;.txt"' in live and "a&lt;b&gt;.txt" in live and "a<b>" not in live
    assert _last_prompt(fake).startswith('<untrusted source="file main.py">')  # the model's
    stored = client.app.state.flashcode.db.messages(cid)[0]
    assert stored.content.startswith('<untrusted source="file main.py') and stored.content.endswith(
        "what does this do?"
    )
    page = client.get(f"/c/{cid}").text
    assert _user_bubble("".join(replayed(page))) == live  # reloaded: the same bubble
    assert client.get(f"/c/{cid}/export.json").json()["messages"][0]["content"] == stored.content


def test_projects_tree_refuses_symlinks_out(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir()
    (tmp_path / "outside.txt").write_text("secret")
    (root / "link.txt").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(FilesError, match="outside the project"):
        ProjectTree(root).read_text("link.txt")


# --------------------------------------------------------------------------- the command line
def _cli(
    home: Path, *args: str, user_home: Path | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    env = {"FLASHCODE_HOME": str(home), "PATH": "/usr/bin:/bin", "HOME": str(user_home or home)}
    if cwd != ROOT:
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "webapp.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_projects_cli_lists_adds_and_removes(tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    home.mkdir()
    out = _cli(home, "projects")
    assert out.returncode == 0 and out.stdout.splitlines() == [
        f"Default\t{(home / 'projects' / 'scratch').resolve()}\t0"
    ]
    assert _cli(home, "projects", "add", str(work), "--name", "Work").returncode == 0
    lines = _cli(home, "projects").stdout.splitlines()
    assert f"Work\t{work.resolve()}\t0" in lines and len(lines) == 2
    again = _cli(
        home, "projects", "add", str(work), "--name", "Dup"
    )  # a folder already listed: said, not silent
    assert (
        again.returncode == 0
        and f"{work.resolve()} was already a project (Dup, renamed from Work)" in again.stderr
    )
    assert _cli(home, "projects", "add", str(work), "--name", "Work").returncode == 0
    renamed = _cli(
        home, "projects", "rename", "Work", "Play"
    )  # (walkthrough) renaming had no command of its own
    assert renamed.returncode == 0 and renamed.stdout.strip() == f"renamed Work to Play ({work.resolve()})"
    assert _cli(home, "projects", "rename", "Play", "Work").returncode == 0
    refused = _cli(home, "projects", "rename", "Default", "Mine")
    assert refused.returncode == 2 and "keeps its name" in refused.stderr
    (tmp_path / "here").mkdir()
    here = _cli(home, "projects", "add", ".", cwd=tmp_path / "here")  # from where you are
    assert here.returncode == 0, here.stderr
    assert f"here\t{(tmp_path / 'here').resolve()}\t0" in _cli(home, "projects").stdout.splitlines()
    assert _cli(home, "projects", "remove", "here").returncode == 0
    bad = _cli(home, "projects", "add", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    gone = _cli(home, "projects", "remove", "Work", "--delete-data")
    assert gone.returncode == 0 and "was not touched" in gone.stdout and work.is_dir()
    # a folder whose name holds escape sequences (OSC 52 writes the clipboard): marked, never sent raw
    odd = tmp_path / "x\x1b]52;c;cm0gLXJmIH4=\x07y"
    odd.mkdir()
    added = _cli(home, "projects", "add", str(odd), "--name", "Odd")
    listed = _cli(home, "projects")
    assert added.returncode == 0 and "\x1b" not in added.stdout + listed.stdout + listed.stderr
    assert "x<U+001B>]52;c;cm0gLXJmIH4=<U+0007>y" in listed.stdout
    assert _cli(home, "projects", "remove", "Odd").returncode == 0
    assert len(_cli(home, "projects").stdout.splitlines()) == 1
    moved = tmp_path / "work-renamed"
    (tmp_path / "app").mkdir()
    assert _cli(home, "projects", "add", str(tmp_path / "app"), "--name", "App").returncode == 0
    (tmp_path / "app").rename(moved)
    out = _cli(home, "projects", "move", "App", str(moved))
    assert out.returncode == 0 and f"-> {moved.resolve()}" in out.stdout, out.stderr
    assert f"App\t{moved.resolve()}\t0" in _cli(home, "projects").stdout.splitlines()
    taken = _cli(home, "projects", "move", "Default", str(moved))
    assert taken.returncode == 2 and "does not move" in taken.stderr
    missing = _cli(home, "projects", "remove", "Nope")
    assert missing.returncode == 2 and "no project named 'Nope'" in missing.stderr
    own = _cli(home, "serve", "--project", str(home), "--port", "0", user_home=work)  # the data directory
    assert (
        own.returncode == 2 and "--project:" in own.stderr and "flashcode's own data directory" in own.stderr
    )
    assert "Traceback" not in own.stderr
    bad_serve = _cli(home, "serve", "--project", str(tmp_path / "missing"), "--port", "0")
    assert (
        bad_serve.returncode == 2
        and "--project:" in bad_serve.stderr
        and "does not exist" in bad_serve.stderr
    )


def test_projects_put_back_from_the_trash_after_its_project_was_removed_lands_in_the_open_one(
    client, two
) -> None:
    """A conversation trashed, then its project taken off the list: Put Back brings it into the open
    project (it went back to a project no list shows, where nothing could reach it)."""
    a, b = two
    _open(client, a, mode="new", name="Alpha")
    conv = _chat(client, "keep me")
    store = client.app.state.flashcode.projects
    alpha = store.current()
    assert client.post(f"/c/{conv}/delete").status_code == 200
    _open(client, b)
    store.remove(alpha.id)  # its data kept (a moved project's would follow its folder)
    trash = client.get("/trash").text
    assert "keep me" in trash and "a removed project" in trash
    r = client.post(f"/c/{conv}/restore")
    assert r.status_code == 200 and f'href="/c/{conv}"' in r.text
    assert client.app.state.flashcode.db.get_conversation(conv).project_id == store.current().id


def test_projects_data_kept_under_a_folders_second_id_comes_back_when_the_folder_is_added(
    tmp_path: Path,
) -> None:
    """A project moved away, a second one made in its old folder (the folder's second id), both removed with
    their data kept: adding the folder again brings the second one's conversations back (they were kept
    under an id no project would ever get: stranded)."""
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    app, old = tmp_path / "app", tmp_path / "app-old"
    app.mkdir()
    first = store.add(str(app))
    app.rename(old)
    store.move(first.id, str(old))
    app.mkdir()
    second = store.add(str(app))
    conv = d.create_conversation("in app 2", project_id=second.id)
    (tmp_path / "data" / "projects" / second.id / "contexts").mkdir(parents=True)
    store.remove(second.id)
    store.remove(first.id)
    again = store.add(str(app))
    assert [c.id for c in d.list_conversations(again.id)] == [conv.id]
    assert (tmp_path / "data" / "projects" / again.id / "contexts").is_dir()
    assert d.list_conversations(store.add(str(old)).id) == []


def test_projects_a_moved_project_removed_where_a_listed_one_holds_the_folders_id_comes_back(
    tmp_path: Path,
) -> None:
    """A review: Q added at lib, lib renamed lib-old and Q moved there; P's folder app renamed lib and P moved
    there; P removed with its data kept, lib added again: 0 conversations. Q still held lib's first id, so P's
    data stayed under app's id, which no folder would ever adopt. It is kept under the id adding lib gives."""
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    app, lib = tmp_path / "app", tmp_path / "lib"
    app.mkdir()
    lib.mkdir()
    p = store.add(str(app), name="P")
    conv = d.create_conversation("in P", project_id=p.id)
    (tmp_path / "data" / "projects" / p.id / "contexts").mkdir(parents=True)
    q = store.add(str(lib), name="Q")
    lib.rename(tmp_path / "lib-old")
    store.move(q.id, str(tmp_path / "lib-old"))
    app.rename(lib)
    store.move(p.id, str(lib))
    store.remove(p.id)
    again = store.add(str(lib))
    assert [c.id for c in d.list_conversations(again.id)] == [conv.id]
    assert (tmp_path / "data" / "projects" / again.id / "contexts").is_dir()
    assert d.list_conversations(q.id) == []  # Q's own are its own


def test_projects_a_file_name_that_is_not_utf8_is_listed_not_a_500(client, two) -> None:
    a, _ = two
    os.close(os.open(os.fsencode(a) + b"/caf\xe9.txt", os.O_CREAT | os.O_WRONLY, 0o644))
    _open(client, a)
    listing = client.get("/files/window")
    assert listing.status_code == 200 and "caf\ufffd.txt" in listing.text
    assert client.get("/files/list", params={"dir": ""}).status_code == 200


def test_projects_odd_folder_names_are_refused_in_words_and_a_path_names_the_project_at_it(
    tmp_path: Path,
) -> None:
    bad = os.fsencode(tmp_path) + b"/bad\xffname"
    os.mkdir(bad)
    with pytest.raises(ProjectError, match="not UTF-8 text"):
        check_directory(os.fsdecode(bad))
    (tmp_path / "tab\tx").mkdir()
    with pytest.raises(ProjectError, match="a tab or a line break"):
        check_directory(str(tmp_path / "tab\tx"))
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    p1, p3 = tmp_path / "p1", tmp_path / "p3"
    p1.mkdir()
    p3.mkdir()
    at_p1 = store.add(str(p1))
    named_like_p1 = store.add(str(p3), name=str(p1))  # a name that looks like the other's path
    assert store.resolve(str(p1)).id == at_p1.id  # the path names the project at that folder
    assert store.resolve(str(p3)).id == named_like_p1.id
    tilde = store.add(str(tmp_path / "p4" if (tmp_path / "p4").mkdir() is None else ""), name="~nosuchuser")
    assert store.resolve("~nosuchuser").id == tilde.id  # a name like `~user` (no such user) is a name


def test_projects_a_move_onto_a_removed_projects_folder_brings_its_kept_data_along(tmp_path: Path) -> None:
    """Alpha's folder was moved; a second project (Beta) was made at the new place; `projects move` said to
    remove Beta first, and did the move once it was. Beta's kept conversations and rules join Alpha (they
    were filed under an id no project had: no window showed them), and adding the folder again adopts any
    left over, as the Remove dialog promises."""
    d = Database(tmp_path / "data" / "f.db")
    store = ProjectStore(d.conn, tmp_path / "data")
    old, new = tmp_path / "projA", tmp_path / "projA2"
    old.mkdir()
    alpha = store.add(str(old), name="Alpha")
    mine = d.create_conversation("alpha's", project_id=alpha.id)
    old.rename(new)
    beta = store.add(str(new), name="Beta")
    theirs = d.create_conversation("beta's", project_id=beta.id)
    AgentStore(d.conn).add_rule(beta.id, "exact", "make")
    with pytest.raises(ProjectError, match="remove that one first"):
        store.move(alpha.id, str(new))
    store.remove(beta.id)  # data kept
    moved = store.move(alpha.id, str(new))
    assert {c.id for c in d.list_conversations(moved.id)} == {mine.id, theirs.id}
    assert [r.pattern for r in AgentStore(d.conn).list_rules(moved.id)] == ["make"]
    # the same through add(): a project already at the folder takes what a removed one kept there
    gamma = store.add(str(new), name="Gamma")  # the folder's project: Alpha, renamed
    assert gamma.id == alpha.id
    other = tmp_path / "other"
    other.mkdir()
    delta = store.add(str(other))
    later = d.create_conversation("delta's", project_id=delta.id)
    store.remove(delta.id)
    d.conn.execute(
        "INSERT INTO projects (id, name, path, created_at) VALUES ('x1', 'X', ?, 0)", (str(other),)
    )
    assert store.add(str(other)).id == "x1"
    assert [c.id for c in d.list_conversations("x1")] == [later.id]


def test_projects_files_window_says_the_folder_is_gone_or_unreadable_never_a_500(client, two) -> None:
    a, _ = two
    _open(client, a)
    (a / "locked.txt").write_text("secret")
    (a / "locked.txt").chmod(0o000)
    if os.geteuid() != 0:  # root reads anything
        view = client.get("/files/view", params={"path": "locked.txt"})
        assert view.status_code == 200 and "cannot be read" in view.text
        attach = client.post("/files/attach", data={"path": ["locked.txt"]})
        assert attach.status_code == 200 and "cannot be read" in attach.text
    (a / "locked.txt").chmod(0o600)
    shutil.rmtree(a)
    for listing in (client.get("/files/window"), client.get("/files/list", params={"dir": "pkg"})):
        assert listing.status_code == 200 and "is gone (moved or deleted)" in listing.text
    view = client.get("/files/view", params={"path": "main.py"})
    assert view.status_code == 200 and "is gone" in view.text
    a.write_text("now a file")
    assert "is gone" in client.get("/files/window").text


def test_projects_a_new_conversation_goes_in_the_project_the_page_shows(client, two) -> None:
    """A page shows Alpha; another window (or `flashcode ask --project`) opened Beta since: the conversation
    that page starts is Alpha's, where it will be listed; a page whose project was removed is told so."""
    a, b = two
    _open(client, a)
    alpha = client.app.state.flashcode.projects.current()
    _open(client, b)
    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers=ORIGIN) as sock:
        sock.send_text(json.dumps({"type": "send", "text": "hi", "project_id": alpha.id}))
        frames = ""
        for _ in range(200):
            frames += sock.receive_text()
            if 'data-state="idle"' in frames:
                break
        cid = re.search(r'id="conversation-id" value="(\w+)"', frames)
        assert cid, frames[-500:]
        db = client.app.state.flashcode.db
        assert db.get_conversation(cid.group(1)).project_id == alpha.id
        sock.send_text(json.dumps({"type": "send", "text": "hi", "project_id": "gone-1234"}))
        said = sock.receive_text()
        assert "was removed meanwhile: nothing was sent" in said
    page = client.get("/").text
    assert re.search(r'name="project_id" value="([^"]+)"', page).group(1) != alpha.id  # Beta is open
    # New Conversation (Ctrl+N) in the window that shows Alpha draws a chat window for Alpha, not the open one
    hx = {"HX-Request": "true", "HX-Target": "chat-window"}
    fresh = client.get("/", params={"project": alpha.id}, headers=hx).text
    assert re.search(r'name="project_id" value="([^"]+)"', fresh).group(1) == alpha.id
    assert (
        re.search(r'name="project_id" value="([^"]+)"', client.get("/", headers=hx).text).group(1) != alpha.id
    )


def test_projects_a_conversation_of_a_removed_project_runs_nothing_in_the_open_one(client, two) -> None:
    """Alpha was removed (its data kept) and Beta opened: a /shell sent in an Alpha conversation still open in
    a tab proposed its command in Beta's folder, under Beta's rules (red-team). Nothing is sent or run until
    Alpha's folder is added again, which brings the conversation back to it."""
    a, b = two
    _open(client, a)
    parts = client.app.state.flashcode
    alpha = parts.projects.current()

    def turn(sock, text: str, cid: str | None, until: str) -> str:
        sock.send_text(
            json.dumps({"type": "send", "text": text, **({"conversation_id": cid} if cid else {})})
        )
        frames = ""
        for _ in range(200):
            frames += sock.receive_text()
            if re.search(until, frames):
                return frames
        raise AssertionError(frames[-500:])

    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers=ORIGIN) as sock:
        frames = turn(sock, "hi", None, 'data-state="idle"')
        cid = re.search(r'id="conversation-id" value="(\w+)"', frames).group(1)  # type: ignore[union-attr]
        _open(client, b)
        parts.projects.remove(alpha.id)
        before = len(parts.db.messages(cid))
        said = turn(sock, "/shell touch made-here.txt", cid, "removed from the list|dialog-")
        assert "nothing was sent or run" in said and "dialog-" not in said
        assert len(parts.db.messages(cid)) == before and not (b / "made-here.txt").exists()
        assert parts.db.get_conversation(cid) is not None  # kept
        parts.projects.add(a)
        frames = turn(sock, "/shell touch made-here.txt", cid, r'id="dialog-[\w-]+"')
        assert str(a.resolve()) in frames and str(b.resolve()) not in frames


def test_projects_removing_a_project_waits_for_the_saves_being_written_first(client, two) -> None:
    """Saves written behind a reply land before a project is removed: one landing after would put the removed
    project's folder back, holding a deleted conversation's cache."""
    a, _ = two
    assert _open(client, a).status_code == 200
    parts = client.app.state.flashcode
    pid = parts.projects.current().id
    seen: list[bool] = []

    async def flush() -> None:
        seen.append(parts.projects.get(pid) is not None)  # still listed: its data not removed yet

    parts.resume.flush = flush
    r = client.post(
        "/projects/remove",
        data={"project_id": pid, "delete_data": "on", "confirmed": "yes"},
        headers={"HX-Request": "true"},
    )
    assert r.status_code == 200 and parts.projects.get(pid) is None
    assert seen == [True]


def test_deleting_a_projects_data_needs_a_second_yes(client, two) -> None:
    """(walkthrough) `delete_data=on` deleted a project's conversations for good from the first dialog. That post
    now answers with a second dialog (what goes, for good, Cancel the default) and deletes nothing; its Delete
    posts `confirmed=yes`. Keeping the data needs no second yes."""
    a, b = two
    assert _open(client, a).status_code == 200
    _chat(client, "hello")
    projects = client.app.state.flashcode.projects
    pid = projects.current().id
    r = client.post(
        "/projects/remove", data={"project_id": pid, "delete_data": "on"}, headers={"HX-Request": "true"}
    )
    assert r.status_code == 200 and "HX-Redirect" not in r.headers
    assert "for good?" in r.text and "cannot be undone" in r.text and 'name="confirmed" value="yes"' in r.text
    assert re.search(r'class="btn btn-default dialog-cancel"[^>]*autofocus', r.text), r.text
    assert projects.get(pid) is not None and projects.conversation_counts().get(pid) == 1
    r = client.post(
        "/projects/remove",
        data={"project_id": pid, "delete_data": "on", "confirmed": "yes"},
        headers={"HX-Request": "true"},
    )
    assert r.headers.get("HX-Redirect") == "/" and projects.get(pid) is None
    assert projects.conversation_counts().get(pid) is None
    assert _open(client, b).status_code == 200
    kept = projects.current().id
    r = client.post(
        "/projects/remove", data={"project_id": kept, "delete_data": "off"}, headers={"HX-Request": "true"}
    )
    assert r.headers.get("HX-Redirect") == "/" and projects.get(kept) is None


def test_rename_project_renames_the_one_shown_and_says_why_not(client, two) -> None:
    """(walkthrough) There was no way to rename a project in the page (New Project… with the same folder and
    another name did it, silently). File › Rename Project… posts here; the page is drawn again."""
    a, b = two
    projects = client.app.state.flashcode.projects
    assert _open(client, b).status_code == 200
    beta = projects.current().id
    assert _open(client, a).status_code == 200
    pid = projects.current().id

    def rename(project_id: str, name: str):
        return client.post(
            "/projects/rename", data={"project_id": project_id, "name": name}, headers={"HX-Request": "true"}
        )

    r = rename(pid, "  My <b>App</b>  ")
    assert r.status_code == 200 and r.headers.get("HX-Refresh") == "true"
    assert projects.get(pid).name == "My <b>App</b>"
    page = client.get("/").text
    assert "My &lt;b&gt;App&lt;/b&gt;" in page and "My <b>App</b>" not in page
    taken = rename(pid, projects.get(beta).name)
    assert taken.status_code == 400 and "already exists" in taken.text
    for project_id, name, said in [
        (pid, "   ", "cannot be empty"),
        (pid, "x" * 81, "at most 80 characters"),
        ("default", "Mine", "keeps its name"),
        ("nosuch", "Mine", "no longer on the list"),
    ]:
        refused = rename(project_id, name)
        assert refused.status_code == 400 and said in refused.text, (name, refused.text)
    assert projects.get(pid).name == "My <b>App</b>"


def test_open_recent_lists_a_project_added_from_the_command_line(tmp_path: Path) -> None:
    """(walkthrough) A project added with `flashcode projects add` and not opened yet was missing from Open
    Recent (only opened ones were listed). It counts from when it was added; adding does not open it."""
    import time as time_module

    d = Database(tmp_path / "db.sqlite")
    store = ProjectStore(d.conn, tmp_path / "data")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    opened = store.add(tmp_path / "a")
    store.open(opened.id)
    time_module.sleep(0.01)
    added = store.add(tmp_path / "b")
    assert [p.name for p in store.recent()] == [added.name, opened.name, "Default"]
    assert store.current().id == opened.id  # added, not opened
    time_module.sleep(0.01)
    store.open(opened.id)
    assert [p.name for p in store.recent()] == [opened.name, added.name, "Default"]


def test_remove_project_on_default_says_it_cannot_be_removed(client) -> None:
    """(walkthrough) Remove Project… on Default asked "Remove “Default” from the list?" with only Cancel to
    answer it: it says Default stays, and how to remove another, with OK."""
    r = client.get("/projects/remove")  # the open project: Default on a first start
    assert r.status_code == 200 and "“Default” cannot be removed" in r.text and "from the list?" not in r.text
    assert ">OK</button>" in r.text and "dialog-ok" not in r.text and "open it first" in r.text
