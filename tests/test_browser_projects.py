"""Projects through the real browser (Chromium): two projects in two temp directories, opened with
File > New Project… and Open Project…; `/shell pwd` prints each one's own directory (the real
sandboxed runner); a rule allowed in one does not apply in the other; conversations and the Projects
window are per project; the Files window lists, opens and attaches a file; a bad directory gets its
message. The engine is scripted (FakeBackend); the page's CSP forbids eval, so waits poll from Python."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.servers import free_port, serve_app
from tests.test_browser_ui import browser  # noqa: F401 - fixture
from webapp.app import create_app
from webapp.settings import Settings

pytestmark = [pytest.mark.browser]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, FakeBackend, object]]:
    fake = FakeBackend(delay=0.005)
    worker = Worker(lambda: fake)
    port = free_port()
    app = create_app(Settings(port=port, data_dir=tmp_path / "data", load_model=False), worker=worker)
    with serve_app(app, port) as url:
        yield url, fake, app
    worker.close()


def wait_for(page, selector: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loc = page.locator(selector)
        if loc.count() and loc.first.is_visible():
            return loc.first
        time.sleep(0.1)
    raise AssertionError(f"{selector} did not appear in {timeout_s} s")


def wait_text(page, selector: str, text: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loc = page.locator(selector)
        got = loc.first.inner_text() if loc.count() else ""
        if text in got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{selector} never showed {text!r}")


def menu(page, top: str, item: str) -> None:
    page.locator(f"nav.menubar li[role=menu-item]:has-text('{top}')").first.click()
    page.locator(f"nav.menubar {item}").click()


def open_project(page, mode: str, path: Path | str, name: str = "") -> None:
    menu(page, "File", f"[data-project-dialog={mode}]")
    wait_for(page, "#project-path").fill(str(path))
    if name:
        page.fill("#project-name", name)
    page.locator("#project-dialog .dialog-ok").click()


def shell_pwd(page, choice: str) -> str:
    before = page.locator(".action-output").count()
    page.fill("#prompt", "/shell pwd")
    page.press("#prompt", "Enter")
    dialog = wait_for(page, ".agent-approval")
    dialog.locator(f"button[data-choice={choice}]").click()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        outs = page.locator(".action-output")
        if outs.count() > before and outs.nth(before).inner_text().strip():
            return outs.nth(before).inner_text().strip()
        time.sleep(0.1)
    raise AssertionError("no command output")


def test_browser_projects_two_directories(server, browser, tmp_path: Path) -> None:  # noqa: F811
    url, fake, app = server
    alpha, beta = tmp_path / "alpha", tmp_path / "beta"
    for d in (alpha, beta):
        d.mkdir()
    (alpha / "app.py").write_text("def greet(name):\n    return f'hello {name}'\n")
    (alpha / ".gitignore").write_text("*.secret\n")
    (alpha / "keys.secret").write_text("nope")
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    assert page.locator("#menubar-project").inner_text() == "Default"

    # a bad directory gets its message, in the dialog (New makes only the last folder of a path)
    open_project(page, "new", tmp_path / "missing" / "deeper")
    assert "does not exist" in wait_for(page, "#project-dialog [data-error]").inner_text()
    assert not (tmp_path / "missing").exists()
    page.screenshot(path=str(ARTIFACTS / "projects-bad-directory.png"))
    page.fill("#project-path", str(alpha))
    page.fill("#project-name", "Alpha")
    page.locator("#project-dialog .dialog-ok").click()
    wait_text(page, "#menubar-project", "Alpha")
    assert page.locator("#chat-project").inner_text() == "Alpha"

    out_a = shell_pwd(page, "always_exact")  # and allow it in Alpha
    assert out_a == str(alpha.resolve())
    page.screenshot(path=str(ARTIFACTS / "projects-alpha-shell.png"))
    conv_a = page.locator("#conversation-id").input_value()
    assert conv_a

    # the Files window: .gitignore respected, a file opened (highlighted), attached to the next message
    menu(page, "View", "[data-open=files-window]")
    wait_for(page, "#files-window tr[data-path='app.py']")
    assert page.locator("#files-window tr[data-path='keys.secret']").count() == 0
    # it opens on the right: it had opened in the top-left corner, over the chat window's title and model menu
    files, model = page.locator("#files-window").bounding_box(), page.locator("#model-picker").bounding_box()
    assert files and model and files["x"] > model["x"] + model["width"], (files, model)
    page.locator("#files-window tr[data-path='app.py'] .file-name").click()
    code = wait_for(page, "#file-view .highlight")
    assert "def greet" in code.inner_text()
    page.locator("#file-view [data-close-view]").click()  # the viewer took the list's place: back to it
    page.locator("#files-window tr[data-path='app.py'] td.pick label").click()
    assert page.locator("#files-window tr[data-path='app.py'] input[type=checkbox]").is_checked()
    page.locator("#attach-button").click()
    wait_for(page, "#attachments .attachment[data-path='app.py']")
    page.screenshot(path=str(ARTIFACTS / "projects-files-window.png"))
    page.fill("#prompt", "what does this file do?")
    page.press("#prompt", "Enter")
    wait_for(page, "#status[data-state=idle]")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        "what does this file do?" in str(r.messages or r.prompt) for r in fake.history
    ):
        time.sleep(0.1)
    request = fake.history[-1]
    sent = request.messages[-1]["content"] if request.messages else str(request.prompt)
    assert '<untrusted source="file app.py">' in sent and "return f'hello {name}'" in sent
    # the bubble shows what was typed and the file's name, not the quoting the model reads
    bubble = page.locator("article.msg-user").last
    bubble.screenshot(path=str(ARTIFACTS / "projects-attachment-sent.png"))
    assert bubble.locator(".user-text").inner_text() == "what does this file do?"
    assert (
        "untrusted" not in bubble.inner_text() and "app.py" in bubble.locator(".msg-attachment").inner_text()
    )
    # attachments go with one message: the page clears them when the server's reply to the send lands,
    # which can be after the engine has the request
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and page.locator("#attachments .attachment").count():
        time.sleep(0.1)
    assert page.locator("#attachments .attachment").count() == 0
    # and the Files window unticks it: ticked, the next Attach would have sent it again
    pick = page.locator("#files-window tr[data-path='app.py'] input[type=checkbox]")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pick.is_checked():
        time.sleep(0.1)
    assert not pick.is_checked()

    # Beta: its own directory, no Alpha rule, its own conversations and contexts
    open_project(page, "open", beta)
    wait_text(page, "#menubar-project", "beta")
    out_b = shell_pwd(page, "once")  # the dialog appeared: Alpha's rule does not apply here
    assert out_b == str(beta.resolve())
    projects = app.state.flashcode.projects
    beta_id, alpha_id = projects.current().id, projects.by_path(alpha).id
    menu(page, "View", "[data-open=conversations-window]")
    conv_b = page.locator("#conversation-id").input_value()
    listed = [li.get_attribute("data-id") for li in page.locator("#conversation-list li[data-id]").all()]
    assert listed == [conv_b] and conv_b != conv_a
    assert beta_id in page.locator(".contexts-loader").get_attribute("hx-get")
    page.screenshot(path=str(ARTIFACTS / "projects-beta.png"))

    # back to Alpha through Open Recent: the rule allows pwd without a dialog
    menu(page, "File", "[data-project-dialog=recent]")
    wait_for(page, f"#project-dialog .recent-project[data-project='{alpha_id}']").click()
    wait_text(page, "#menubar-project", "Alpha")
    page.fill("#prompt", "/shell pwd")
    page.press("#prompt", "Enter")
    wait_text(page, "#messages", "Allowed by rule")
    assert page.locator(".agent-approval").count() == 0

    page.set_viewport_size({"width": 900, "height": 700})
    menu(page, "File", "[data-project-dialog=open]")
    wait_for(page, "#folder-browser")
    page.screenshot(path=str(ARTIFACTS / "projects-open-dialog-900.png"))
    assert not errors, errors
    context.close()


def test_browser_deleting_a_projects_data_asks_once_more_and_return_cancels(
    server,
    browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    """(walkthrough) Remove Project… with "Delete flashcode's data" deleted the project's conversations for good on
    Return (Remove is the dialog's default button), with no word that they skip the Trash. A second dialog now says
    what goes, for good, with Cancel the default: Return keeps everything; Delete deletes."""
    url, _, app = server
    alpha = tmp_path / "alpha"
    alpha.mkdir()
    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    open_project(page, "new", alpha, "Alpha")
    wait_text(page, "#menubar-project", "Alpha")
    page.fill("#prompt", "hello there")
    page.press("#prompt", "Enter")
    wait_for(page, ".msg-assistant.status-complete")  # (the idle status could be the one before the send)
    parts = app.state.flashcode
    pid = parts.projects.current().id
    assert parts.projects.conversation_counts().get(pid) == 1

    def ask_to_delete() -> None:
        menu(page, "File", "[data-project-dialog=remove]")
        wait_for(page, "#remove-dialog label[for=delete-data]").click()
        page.locator("#remove-dialog .dialog-ok").click()
        wait_text(page, "#remove-dialog", "for good?")

    ask_to_delete()
    said = page.locator("#remove-dialog").inner_text()
    assert "1 conversation," in said and "do not go to the Trash" in said and "cannot be undone" in said, said
    page.screenshot(path=str(ARTIFACTS / "projects-delete-data-confirm.png"))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not page.locator("#remove-dialog .dialog-cancel:focus").count():
        time.sleep(0.05)
    page.keyboard.press("Enter")  # Cancel has the focus: Return keeps everything
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and page.locator("#remove-dialog").count():
        time.sleep(0.05)
    assert page.locator("#remove-dialog").count() == 0
    assert parts.projects.get(pid) is not None and parts.projects.conversation_counts().get(pid) == 1

    ask_to_delete()
    page.locator("#remove-dialog button[type=submit]", has_text="Delete").click()
    wait_text(page, "#menubar-project", "Default")
    assert parts.projects.get(pid) is None and parts.projects.conversation_counts().get(pid) is None
    assert alpha.is_dir()  # its directory is never touched
    assert not errors, errors
    page.context.close()


def test_browser_a_long_project_name_stays_on_one_menu_bar_line_and_inside_its_dialogs(
    server,
    browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    """(walkthrough) An 80-character project name wrapped the menu bar's right side onto three lines, over the
    Conversations window's title, and ran past Open Recent's edge, cutting off its Recent button and path."""
    url, _, _ = server
    name = "A very long project name " + "x" * 30 + " that goes on and on and on"
    name = name[:80]
    folder = tmp_path / "long"
    folder.mkdir()
    page = browser.new_context(viewport={"width": 1024, "height": 768}).new_page()
    page.goto(url)
    open_project(page, "new", folder, name)
    wait_text(page, "#menubar-project", name[:20])
    bar = page.locator("nav.menubar").bounding_box()
    assert bar and bar["height"] <= 24, bar
    for part in ("#menubar-project", "#menubar-model", "#clock"):
        box = page.locator(part).bounding_box()
        assert box and box["y"] + box["height"] <= bar["y"] + bar["height"] + 1, (part, box, bar)
    assert page.locator("#menubar-project").get_attribute("title").startswith(name)  # the whole name, hovered
    menu(page, "File", "[data-project-dialog=recent]")
    dialog = wait_for(page, "#project-dialog").bounding_box()
    page.screenshot(path=str(ARTIFACTS / "projects-long-name.png"))
    for part in (".dialog-current", ".recent-project", ".recent-list li"):
        box = page.locator(f"#project-dialog {part}").first.bounding_box()
        assert dialog and box and box["x"] + box["width"] <= dialog["x"] + dialog["width"], (
            part,
            box,
            dialog,
        )
    path = page.locator(
        "#project-dialog .recent-list li .muted"
    ).first.bounding_box()  # its start shows, "…" at its end
    assert dialog and path and path["x"] < dialog["x"] + dialog["width"] - 60, (path, dialog)
    page.context.close()


def test_browser_rename_project_from_the_file_menu(
    server,
    browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    """(walkthrough) File › Rename… renamed the conversation, and nothing renamed the project. File › Rename
    Project… asks for the name (the System 7 dialog), and every place that names the project says the new one;
    a name taken says why; Default keeps its name."""
    url, _, app = server
    alpha, beta = tmp_path / "alpha", tmp_path / "beta"
    alpha.mkdir()
    beta.mkdir()
    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.locator("nav.menubar li[role=menu-item]:has-text('File')").first.click()
    item = page.locator("nav.menubar [data-action=rename-project]")
    assert (
        item.get_attribute("aria-disabled") == "true"
    )  # greyed on Default; chosen all the same, it says why
    item.click(force=True)
    assert "keeps its name" in wait_for(page, "#alerts .alert-box .alert-text").inner_text()
    page.locator("#alerts .alert-box .alert-ok").click()
    open_project(page, "new", beta, "Beta")
    wait_text(page, "#menubar-project", "Beta")
    open_project(page, "new", alpha, "Alpha")
    wait_text(page, "#menubar-project", "Alpha")

    def rename_to(name: str) -> None:
        menu(page, "File", "[data-action=rename-project]")
        field = wait_for(page, "#alerts .alert-box.modal input")
        assert field.input_value() == "Alpha"
        field.fill(name)
        page.locator("#alerts .alert-box.modal .dialog-ok").click()

    rename_to("Beta")
    assert "already exists" in wait_for(page, "#alerts [role=alert] .alert-text").inner_text()
    page.locator("#alerts [role=alert] .alert-ok").click()
    rename_to("Alpha Two")
    wait_text(page, "#menubar-project", "Alpha Two")
    assert page.locator("#chat-project").inner_text() == "Alpha Two"
    assert app.state.flashcode.projects.current().name == "Alpha Two"
    assert not errors, errors
    page.context.close()
