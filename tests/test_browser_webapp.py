"""The real thing: `flashcode serve --backend mlx` with the default model, driven by Chromium.

Send a message and watch tokens arrive, stop the (long) reply with Esc, reload and find the
conversation, open it from the Conversations window, export it, and save screenshots under
tests/artifacts/. One generation is started and stopped, so this stays around half a minute.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.models import AGENT_MODEL
from tests.conftest import ARTIFACTS, failed
from tests.servers import serve_cli

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def server(data_dir: Path) -> Iterator[str]:
    with serve_cli(data_dir) as served:
        yield served.url


def record_frames(pg, keep: int = 40) -> deque[str]:
    """The page's latest websocket frames, both ways (`> ` sent, `< ` received), each cut to 400 characters."""
    frames: deque[str] = deque(maxlen=keep)

    def watch(ws) -> None:
        ws.on("framesent", lambda f: frames.append("> " + str(f)[:400]))
        ws.on("framereceived", lambda f: frames.append("< " + str(f)[:400]))
        ws.on("close", lambda _ws: frames.append("(socket closed)"))

    pg.on("websocket", watch)
    return frames


@contextmanager
def watched(pg, request: pytest.FixtureRequest) -> Iterator[None]:
    """Around a test's use of `pg`: its frames recorded, and the evidence printed if the test failed."""
    frames = record_frames(pg)
    yield
    if failed(request):
        print(f"--- the page when {request.node.name} failed ---\n{evidence(pg, frames, request.node.name)}")


def evidence(pg, frames: deque[str], name: str) -> str:
    """What a failed browser test leaves: the page's status line, alerts and latest frames, and a screenshot."""
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"failed-{name}.png"
    try:
        pg.screenshot(path=str(shot), full_page=True)
        status = (
            pg.locator("#status").first.get_attribute("data-state"),
            pg.locator("#status").first.inner_text(),
        )
        alerts = pg.locator("#alerts").first.inner_text()
    except Exception as exc:  # noqa: BLE001 - the page itself may be what broke
        return f"(no evidence from the page: {exc})"
    return "\n".join(
        [f"url {pg.url}", f"status {status}", f"alerts {alerts!r}", f"screenshot {shot}", *frames]
    )


@pytest.fixture
def page(artifacts: Path, request: pytest.FixtureRequest):
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (make test installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 800}, accept_downloads=True)
        pg.errors = []
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))
        pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)
        with watched(pg, request):
            yield pg
        browser.close()


def body_text(page) -> str:
    return page.locator("#messages .msg-assistant .body").last.inner_text()


def test_browser_chat_stream_stop_reload_export(server: str, page, artifacts: Path, data_dir: Path) -> None:
    page.goto(server)
    page.wait_for_function("() => document.querySelector('#model-picker') && window.htmx")
    page.screenshot(path=str(artifacts / "browser_desktop.png"))

    # a message the server refuses (too long) stays in the composer, to be shortened
    page.fill("#prompt", "x" * 40_000)
    page.press("#prompt", "Enter")
    page.locator("#alerts .alert-box", has_text="too long").wait_for(timeout=10_000)
    assert len(page.input_value("#prompt")) == 40_000
    page.click("#alerts .alert-ok")
    page.wait_for_selector("#alerts .alert-box", state="detached")

    prompt = "Write a very long story about a lighthouse keeper and a robot."
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#status[data-state=generating]", timeout=10_000)
    assert page.input_value("#prompt") == ""  # sent and cleared

    # tokens arrive (after "Reading your prompt… N / M", which is progress, not reply): the body grows
    writing = "document.querySelector('.msg-assistant .body.streaming')"
    page.wait_for_function(
        f"() => {writing} && !{writing}.querySelector('.prefill-progress') && {writing}.textContent.length > 40",
        timeout=90_000,
    )
    # the finished blocks are final markdown: the newlines between them are not lines (a streamed reply
    # had a blank line between its paragraphs that the same reply reloaded did not)
    assert page.evaluate(f"() => getComputedStyle({writing}).whiteSpace") == "normal"
    first = len(body_text(page))
    page.wait_for_function(f"() => {writing}?.textContent.length > {first}", timeout=30_000)
    page.screenshot(path=str(artifacts / "browser_streaming.png"))

    # Esc stops it; the reply is kept, re-rendered and marked stopped
    t0 = time.monotonic()
    page.keyboard.press("Escape")
    page.wait_for_selector("#status[data-state=idle]", timeout=10_000)
    stop_s = time.monotonic() - t0
    page.wait_for_selector(".msg-assistant.status-stopped .body.markdown")
    assert stop_s < 3.0, f"stop took {stop_s:.2f} s"
    assert "tok/s" in page.inner_text(".msg-assistant .msg-stats")
    assert "Stopped" in page.inner_text(".msg-assistant .msg-stats")
    page.screenshot(path=str(artifacts / "browser_chat.png"))
    streamed = body_text(page)
    assert len(streamed) > 10

    # the URL names the conversation; a reload finds it, listed and open
    page.wait_for_function("() => location.pathname.startsWith('/c/')")
    cid = page.evaluate("() => location.pathname.split('/')[2]")
    page.reload()
    page.wait_for_selector(f"#conversation-list li[data-id='{cid}'].selected")
    assert prompt in page.inner_text("#messages")

    # a new conversation (Ctrl+N), then reopen the old one from the Conversations window
    page.keyboard.press("Control+n")
    page.wait_for_function("() => location.pathname === '/' && !document.querySelector('#messages .msg')")
    assert page.title() == "flashcode"  # the tab says what the window holds
    page.click(f"#conversation-list li[data-id='{cid}'] a")
    page.wait_for_selector("#messages .msg-user")
    assert page.input_value("#conversation-id") == cid
    assert page.title() == f"{page.inner_text('#chat-title')} — flashcode" != " — flashcode"

    # File › Export as Markdown: a copy to read
    with page.expect_download() as dl:
        page.dispatch_event("nav [data-action=export-md]", "click")
    text = Path(dl.value.path()).read_text()
    assert prompt in text and "## Assistant" in text and "(stopped)" in text
    # the Conversations window's Export, beside its Import…: the JSON that Import… reads back (it gave Markdown)
    with page.expect_download() as dl:
        page.click("#conversations-window .list-actions [data-action=export-json]")
    assert json.loads(Path(dl.value.path()).read_text())["messages"][0]["content"] == prompt

    # rename through the System 7 dialog (a CSRF-protected POST)
    page.click("#conversations-window [data-action=rename]")
    page.fill(".dialog-input", "Lighthouse story")
    page.press(".dialog-input", "Enter")
    page.wait_for_selector(f"#conversation-list li[data-id='{cid}']:has-text('Lighthouse story')")
    assert page.inner_text("#chat-title") == "Lighthouse story"

    # reopened while another model is loaded than the one that wrote it: the window says so and loads it
    assert page.locator("#written-with").is_hidden()
    with sqlite3.connect(data_dir / "flashcode.db") as db:
        db.execute("UPDATE conversations SET model = ?, backend = 'mlx' WHERE id = ?", (AGENT_MODEL, cid))
    page.reload()
    page.wait_for_selector("#written-with:not([hidden])")
    assert f"written with {AGENT_MODEL}" in page.inner_text("#written-with")
    page.screenshot(path=str(artifacts / "browser_written_with.png"))
    page.click(f"#written-with button:has-text('Load {AGENT_MODEL}')")
    page.wait_for_selector("#written-with[hidden]", state="attached", timeout=120_000)
    page.wait_for_selector(f"#menubar-model:has-text('{AGENT_MODEL}')", timeout=120_000)
    assert page.input_value("#model-picker") == f"mlx:{AGENT_MODEL}"

    # Export as JSON, then File > Import Conversation…: a new conversation with the same messages
    with page.expect_download() as dl:
        page.dispatch_event("nav [data-action=export-json]", "click")
    exported = Path(dl.value.path())
    page.dispatch_event("nav [data-action=import]", "click")  # opens the file chooser (headless: none shown)
    page.set_input_files("#import-file", str(exported))
    page.wait_for_function(f"() => location.pathname.startsWith('/c/') && location.pathname !== '/c/{cid}'")
    copy = page.evaluate("() => location.pathname.split('/')[2]")
    page.wait_for_selector(f"#conversation-list li[data-id='{copy}'].selected")
    assert (
        prompt in page.inner_text("#messages .msg-user")
        and page.inner_text("#chat-title") == "Lighthouse story (imported)"  # told apart from the original
    )
    assert "Stopped" in page.inner_text("#messages .msg-assistant .msg-stats")  # its reply's numbers came too
    # a file that is not an export: said in an alert, nothing added
    bad = artifacts / "not-a-conversation.json"
    bad.write_text('{"hello": 1}')
    page.set_input_files("#import-file", str(bad))
    page.locator("#alerts .alert-box", has_text="Could not import not-a-conversation.json").wait_for(
        timeout=10_000
    )
    page.click("#alerts .alert-ok")
    assert page.locator("#conversation-list li[data-id]").count() == 2

    # Move to Trash (the open conversation), Undo; again, then Delete Now… from the Trash window
    page.click("#conversations-window [data-action=delete]")
    assert "View › Trash puts it back" in page.inner_text(".alert-box.modal .alert-text")
    page.press(".alert-box.modal .dialog-ok", "Enter")
    page.wait_for_selector("#conversation-list .trash-note")
    assert page.locator(f"#conversation-list li[data-id='{copy}']").count() == 0
    page.screenshot(path=str(artifacts / "browser_trash_undo.png"))
    page.click("#conversation-list .trash-note button:has-text('Undo')")
    page.wait_for_selector(f"#conversation-list li[data-id='{copy}']")
    assert page.locator("#conversation-list .trash-note").count() == 0
    page.click(f"#conversation-list li[data-id='{copy}'] a")
    page.wait_for_function(f"() => location.pathname === '/c/{copy}'")
    page.click("#conversations-window [data-action=delete]")
    page.click(".alert-box.modal .dialog-ok")
    page.wait_for_selector("#conversation-list .trash-note")
    page.dispatch_event("nav [data-open=trash-window]", "click")
    page.wait_for_selector(f"#trash-window:not([hidden]) #trash-pane li[data-id='{copy}']")
    page.screenshot(path=str(artifacts / "browser_trash_window.png"))
    page.click(f"#trash-pane li[data-id='{copy}'] [data-action=delete-now]")
    assert "cannot be undone" in page.inner_text(".alert-box.modal .alert-text")
    page.click(".alert-box.modal .dialog-ok")
    page.wait_for_selector("#trash-pane .trash-status:has-text('for good')")
    assert page.locator("#trash-pane li[data-id]").count() == 0
    # a stale Trash window (another tab put the conversation back): Put Back says why nothing happened
    page.click(f"#conversation-list li[data-id='{cid}'] a")
    page.wait_for_function(f"() => location.pathname === '/c/{cid}'")
    page.click("#conversations-window [data-action=delete]")
    page.click(".alert-box.modal .dialog-ok")
    page.wait_for_selector(f"#trash-pane li[data-id='{cid}']", state="attached")
    page.dispatch_event("nav [data-open=trash-window]", "click")
    token = page.evaluate("() => JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    origin = server.split("?")[0].rstrip("/")
    assert page.request.post(
        f"{origin}/c/{cid}/restore", headers={"X-CSRF-Token": token, "Origin": origin}
    ).ok
    page.click(f"#trash-pane li[data-id='{cid}'] button:has-text('Put Back')")
    page.locator("#alerts .alert-box", has_text="Not done: no such conversation in the Trash").wait_for(
        timeout=10_000
    )
    page.click("#alerts .alert-ok")
    assert all("404" in e for e in page.errors), page.errors  # the browser's console notes that 404, only it
    page.errors.clear()
    with sqlite3.connect(data_dir / "flashcode.db") as db:
        assert db.execute("SELECT COUNT(*) FROM conversations WHERE id = ?", (copy,)).fetchone()[0] == 0
        assert (
            db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)).fetchone()[0] >= 2
        )

    # Special > Empty Trash…: asks, then deletes what the Trash showed
    page.goto(f"{origin}/c/{cid}")  # put back by the other "tab" above: listed once the page is drawn again
    page.wait_for_selector(f"#conversation-list li[data-id='{cid}'].selected")
    page.click("#conversations-window [data-action=delete]")
    page.click(".alert-box.modal .dialog-ok")
    page.wait_for_selector(f"#trash-pane li[data-id='{cid}']", state="attached")
    page.dispatch_event("nav [data-action=empty-trash]", "click")
    assert "Delete the 1 conversation in the Trash for good?" in page.inner_text(
        ".alert-box.modal .alert-text"
    )
    page.click(".alert-box.modal .dialog-ok")
    page.wait_for_selector(
        "#trash-pane .trash-status:has-text('Deleted 1 conversation for good.')", state="attached"
    )
    with sqlite3.connect(data_dir / "flashcode.db") as db:
        assert db.execute("SELECT COUNT(*) FROM conversations WHERE id = ?", (cid,)).fetchone()[0] == 0

    assert not page.errors, page.errors
    assert (data_dir / "logs" / "serve.log").exists()  # serve's warnings and errors outlive the terminal
    print(f"\nstop latency in the browser: {stop_s * 1000:.0f} ms")


def test_browser_agent_mode_offers_the_agent_model_and_its_button_loads_it(
    server: str, page, artifacts: Path
) -> None:
    """Agent mode with the default model (it takes no tools): the note said to load the agent model from the
    model menu or with /model; a newcomer looked for a way to do it there. Its button picks it in the menu."""
    page.goto(server)
    page.wait_for_selector("#model-picker")
    page.select_option("#mode-picker", "agent")
    note = page.locator(".agent-notice", has_text="does not take tools")
    note.wait_for(timeout=60_000)
    button = note.locator(f"button.load-model[data-model='{AGENT_MODEL}']")
    assert button.inner_text() == f"Load {AGENT_MODEL}"
    page.screenshot(path=str(artifacts / "browser_agent_mode_offer.png"))
    button.click()
    page.wait_for_selector(f"#menubar-model:has-text('{AGENT_MODEL}')", timeout=120_000)
    assert page.input_value("#model-picker").endswith(f":{AGENT_MODEL}")
    page.wait_for_selector("#status[data-state=idle]", timeout=60_000)
    # loaded now: the offer says so, and cannot be taken again (it stayed "Load …": walkthrough)
    for _ in range(50):
        if button.is_disabled():
            break
        time.sleep(0.1)
    assert button.is_disabled() and button.inner_text() == f"{AGENT_MODEL} is loaded"
    assert not page.errors, page.errors
