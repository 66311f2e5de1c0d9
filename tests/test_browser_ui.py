"""The page's own behaviour in Chromium, against the app served with a scripted FakeBackend (fast):
hostile model output stays text in the real DOM, auto-scroll follows the stream, stops when the
user scrolls up and resumes at the bottom, Shift+Return makes a newline, Regenerate works."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.servers import free_port, serve_app
from tests.test_browser_webapp import ARGS, CHROMIUM, watched
from webapp.app import create_app
from webapp.settings import Settings

pytestmark = [pytest.mark.browser]


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[tuple[str, FakeBackend]]:
    fake = FakeBackend(delay=0.01)
    worker = Worker(lambda: fake)
    port = free_port()
    app = create_app(Settings(port=port, data_dir=tmp_path, load_model=False), worker=worker)
    with serve_app(app, port) as url:
        yield url, fake
    worker.close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (make test installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, request: pytest.FixtureRequest):
    context = browser.new_context(viewport={"width": 1100, "height": 700})
    pg = context.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("dialog", lambda d: pg.errors.append(f"unexpected dialog: {d.message}"))
    with watched(pg, request):
        yield pg
    context.close()


def send_and_wait(page, text: str) -> None:
    done = page.locator(".msg-assistant:not(.status-streaming)").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        f"() => document.querySelectorAll('.msg-assistant:not(.status-streaming)').length > {done}"
    )
    page.wait_for_selector("#status[data-state=idle]")


def test_browser_hostile_output_renders_as_text(fake_server, page) -> None:
    url, fake = fake_server
    fake.enqueue("<script>window.pwned=1</script>", ' <img src=x onerror="window.pwned=2">', " **ok**")
    page.goto(url)
    send_and_wait(page, '<img src=y onerror="window.pwned=3">')
    body = page.locator(".msg-assistant .body").last
    assert "<script>window.pwned=1</script>" in body.inner_text()
    assert page.locator(".msg img, .msg script").count() == 0
    assert page.evaluate("() => window.pwned") is None
    assert body.locator("strong").inner_text() == "ok"  # markdown still renders
    assert not page.errors, page.errors


def test_browser_autoscroll_follows_pauses_and_resumes(fake_server, page) -> None:
    url, fake = fake_server
    fake.enqueue(*[f"line {i}\n\n" for i in range(120)])
    page.goto(url)
    send_and_wait(page, "many lines please")
    at_bottom = "() => { const t = document.querySelector('#transcript'); return t.scrollHeight - t.scrollTop - t.clientHeight < 30 }"
    assert page.evaluate(at_bottom)

    fake.delay = 0.03
    fake.enqueue(*[f"more {i}\n\n" for i in range(150)])
    page.fill("#prompt", "again")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => document.querySelector('.msg-assistant .body.streaming')?.textContent.length > 20"
    )
    page.evaluate(
        "() => { const t = document.querySelector('#transcript'); t.scrollTop = 0; t.dispatchEvent(new Event('scroll')) }"
    )
    page.wait_for_timeout(400)
    assert (
        page.evaluate("() => document.querySelector('#transcript').scrollTop") < 50
    )  # left where the user put it
    page.evaluate(
        "() => { const t = document.querySelector('#transcript'); t.scrollTop = t.scrollHeight; t.dispatchEvent(new Event('scroll')) }"
    )
    page.wait_for_selector("#status[data-state=idle]", timeout=20_000)
    assert page.evaluate(at_bottom)  # followed again once back at the bottom


def test_browser_shift_return_newline_and_regenerate(fake_server, page) -> None:
    url, fake = fake_server
    fake.enqueue("first answer")
    fake.enqueue("second answer")
    page.goto(url)
    page.click("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    page.keyboard.press("Enter")
    page.wait_for_selector("#status[data-state=idle] #regenerate-button:not([disabled])")
    assert page.inner_text(".msg-user .body") == "line one\nline two"
    page.click("#regenerate-button")
    page.wait_for_function(
        "() => document.querySelector('.msg-assistant:last-child .body')?.textContent.includes('second answer')"
    )
    assert page.locator(".msg-assistant").count() == 1
    # the replaced reply stays, folded above the new one (nothing the model wrote is thrown away)
    folded = page.locator("details.reply-replaced")
    assert folded.count() == 1 and "replaced by Regenerate" in folded.locator("summary").inner_text()
    folded.locator("summary").click()
    assert "first answer" in folded.inner_text()
    assert not page.errors, page.errors


def test_browser_a_second_tab_follows_the_conversation_and_a_stale_one_keeps_its_text(
    fake_server, page, browser
) -> None:
    """Two tabs on one conversation. Tab one's turn appears in tab two without a reload, and what tab two
    has typed stays, focus and all. When tab two has still missed a turn (the word lost or late: here its
    signal target is taken away), its message is not sent: the missed messages appear, an alert says why,
    and the text stays in the box (it had been wiped: the other tab's user message was taken for its own)."""
    url, fake = fake_server
    fake.enqueue("first answer").enqueue("second answer").enqueue("third answer").enqueue("fourth answer")
    page.goto(url)
    send_and_wait(page, "hello")
    cid = page.evaluate("() => location.pathname.split('/')[2]")
    other = browser.new_context(viewport={"width": 1100, "height": 700}).new_page()
    other_errors: list[str] = []
    other.on("pageerror", lambda e: other_errors.append(str(e)))
    other.goto(f"{url.rstrip('/')}/c/{cid}")
    other.wait_for_selector("#messages .msg-assistant")
    other.fill("#prompt", "a draft in tab two")
    other.click("#chat-window [data-zoom]")  # the window as the user arranged it
    other.focus("#prompt")
    send_and_wait(page, "from tab one")
    other.wait_for_selector(".msg-assistant:has-text('second answer')", timeout=10_000)
    assert "from tab one" in other.inner_text("#messages")
    assert other.input_value("#prompt") == "a draft in tab two"
    assert other.evaluate("() => document.activeElement && document.activeElement.id") == "prompt"
    assert "zoomed" in (other.get_attribute("#chat-window", "class") or "")  # only what changed was redrawn
    # (what it was told is all acted on, a redraw still on its way included, before its signal is taken away)
    other.wait_for_selector("body[data-following=idle]", timeout=10_000)
    other.evaluate(
        "() => document.getElementById('conversation-changed').remove()"
    )  # tab two misses the next
    send_and_wait(page, "from tab one again")
    other.fill("#prompt", "from tab two")
    other.press("#prompt", "Enter")
    other.locator("#alerts .alert-box", has_text="changed in another window").wait_for(timeout=10_000)
    assert other.input_value("#prompt") == "from tab two"
    assert "third answer" in other.inner_text("#messages")
    other.click("#alerts .alert-ok")
    other.press("#prompt", "Enter")  # sent again, now that it has seen them: it goes
    other.wait_for_selector(".msg-assistant:has-text('fourth answer')", timeout=10_000)
    assert other.input_value("#prompt") == ""
    page.wait_for_selector(".msg-assistant:has-text('fourth answer')", timeout=10_000)  # and tab one follows
    assert not other_errors, other_errors
    other.context.close()
    assert not page.errors, page.errors


def test_browser_undo_stays_in_the_window_after_a_long_title(fake_server, page, tmp_path: Path) -> None:
    """A conversation named with a long word (no spaces) moved to the Trash: the note's text could not wrap and
    pushed Undo past the window's edge, out of reach (walkthrough). The text wraps; Undo stays in the window."""
    import re

    from engine.paths import database_path
    from webapp.db import Database

    url, fake = fake_server
    fake.enqueue("an answer")
    page.goto(url)
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    page.wait_for_url(re.compile(r".*/c/[0-9a-f]+$"))
    page.wait_for_selector("#status[data-state=idle]")
    cid = page.url.rsplit("/", 1)[1]
    db = Database(database_path(tmp_path))
    db.rename_conversation(cid, "Fix-subtract-" + "x" * 160)
    db.close()
    page.reload()
    page.dispatch_event("nav [data-open=conversations-window]", "click")
    page.click("#conversations-window [data-action=delete]")
    page.press(".alert-box.modal .dialog-ok", "Enter")
    undo = page.locator("#conversation-list .trash-note .undo-trash")
    undo.wait_for()
    button, window = undo.bounding_box(), page.locator("#conversations-window").bounding_box()
    assert button["x"] + button["width"] <= window["x"] + window["width"], (button, window)
    undo.click()
    page.wait_for_selector(f"#conversation-list li[data-id='{cid}']")
    assert not page.errors, page.errors


def test_browser_special_regenerate_says_why_when_there_is_nothing_to_regenerate(fake_server, page) -> None:
    """Special › Regenerate did nothing at all where the Regenerate button was off (after a command turn, in a
    new conversation): it says why, as the button's tooltip does."""
    url, fake = fake_server
    page.goto(url)
    page.wait_for_selector("#regenerate-button[disabled]", state="attached")
    page.dispatch_event("nav [data-action=regenerate]", "click")
    # no reply at all yet: said so (the button's words about command turns read as nonsense there: walkthrough)
    box = page.locator("#alerts .alert-box", has_text="There is no reply to regenerate yet")
    box.wait_for(timeout=5_000)
    assert box.get_attribute("data-kind") == "note" and box.locator(".alert-ok").inner_text() == "OK"
    # Return presses the alert's OK, as on a Mac (with the message box empty: with words in it, Return sends)
    page.press("#prompt", "Enter")
    box.wait_for(state="detached", timeout=5_000)
    assert page.locator(".msg-user").count() == 0  # nothing was sent
    page.dispatch_event("nav [data-action=regenerate]", "click")
    box.wait_for(timeout=5_000)
    page.locator("#prompt").blur()  # nothing focused: Return is still the alert's OK
    page.keyboard.press("Enter")
    box.wait_for(state="detached", timeout=5_000)
    # the Conversations window's Rename… with none open: "send a message first" read wrong beside a list of them
    page.click("#conversations-window .list-actions [data-action=rename]")
    none = page.locator(
        "#alerts .alert-box", has_text="No conversation is open: click one in the Conversations"
    )
    none.wait_for(timeout=5_000)
    none.locator(".alert-ok").click()
    fake.enqueue("a reply")
    send_and_wait(page, "hi")
    page.fill("#prompt", "/help")
    page.press("#prompt", "Enter")
    page.wait_for_selector("#status[data-state=idle] #regenerate-button[disabled]", state="attached")
    page.dispatch_event("nav [data-action=regenerate]", "click")
    box = page.locator("#alerts .alert-box", has_text="Regenerate rewrites the last chat reply")
    box.wait_for(timeout=5_000)
    assert not page.errors, page.errors


def test_browser_edit_opens_a_copy_with_the_message_in_the_box(fake_server, page) -> None:
    """Edit… on a sent message: a new conversation opens with what came before it and the message's text in
    the box; sent changed, it gets its own reply; the first conversation keeps both of its turns."""
    url, fake = fake_server
    fake.enqueue("first answer")
    fake.enqueue("second answer")
    fake.enqueue("answer to the edit")
    page.goto(url)
    send_and_wait(page, "first question")
    send_and_wait(page, "second question")
    original = page.url
    page.locator(".msg-user .msg-edit").nth(1).click()
    page.wait_for_url(lambda u: u != original and "/c/" in u)
    page.locator("#prompt").wait_for()
    assert page.input_value("#prompt") == "second question"
    page.locator(".msg-assistant .body", has_text="first answer").wait_for()  # the transcript replayed
    assert page.locator(".msg-user .body").all_inner_texts() == ["first question"]
    assert "original conversation is unchanged" in page.inner_text("#transcript")
    assert page.inner_text("#chat-title") == "first question (edited)"
    page.fill("#prompt", "second question, changed")
    page.press("#prompt", "Enter")
    page.locator(".msg-assistant:not(.status-streaming) .body", has_text="answer to the edit").wait_for()
    assert page.locator(".msg-user .body").all_inner_texts() == ["first question", "second question, changed"]
    page.goto(original)
    page.locator(".msg-assistant .body", has_text="second answer").wait_for()
    assert page.locator(".msg-user .body").all_inner_texts() == ["first question", "second question"]
    assert not page.errors, page.errors


def test_browser_stop_works_after_going_to_another_conversation_and_back(fake_server, page) -> None:
    """(walkthrough) A window writing a reply that went to another conversation and came back showed "A reply is
    being written in another window" with Stop greyed out: nothing stopped the reply. Its socket now gives the
    window its controls back, in any conversation it shows."""
    url, fake = fake_server
    fake.enqueue("first answer")
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    page.goto(url)
    send_and_wait(page, "an earlier conversation")
    earlier = page.url
    page.click("a.new-link")
    page.locator("#chat-title", has_text="New Conversation").wait_for()
    fake.enqueue(*[f"word{i} " for i in range(3000)])  # 30 s at 10 ms a token
    page.fill("#prompt", "a long list")
    page.press("#prompt", "Enter")
    page.locator("#status[data-state=generating]").wait_for()
    page.locator(".msg-assistant.status-streaming .body", has_text="word5").wait_for()
    writing = page.url
    page.locator(f'#conversation-list li[data-id="{earlier.rsplit("/", 1)[-1]}"] a').click()
    page.wait_for_url(earlier)
    page.locator("#status .status-text", has_text="another conversation of this window").wait_for()
    assert page.locator("#stop-button").is_enabled()
    page.locator(f'#conversation-list li[data-id="{writing.rsplit("/", 1)[-1]}"] a').click()
    page.wait_for_url(writing)
    page.locator("#status[data-state=generating] #stop-button:not([disabled])").wait_for()
    page.click("#stop-button")
    page.locator("#status[data-state=idle]").wait_for()
    page.locator(".msg-assistant.status-stopped").wait_for()
    assert not page.errors, page.errors
    # the reply drawn again on the way back found its message: the page says "showing" once its transcript is
    # replayed (it said it at the swap, and the redraw could come before the transcript was there)
    assert not [m for m in console if "oobErrorNoTarget" in m], console


def test_browser_edit_while_a_reply_is_written_leaves_that_reply_running(fake_server, page) -> None:
    """(walkthrough) Edit… reloaded the page, which closed its socket and so stopped the reply being written. The
    copy opens in the same page now: the reply goes on to its end."""
    url, fake = fake_server
    fake.enqueue("first answer")
    page.goto(url)
    send_and_wait(page, "first question")
    original = page.url
    fake.enqueue(*[f"w{i} " for i in range(300)])  # 3 s
    page.fill("#prompt", "second question")
    page.press("#prompt", "Enter")
    page.locator(".msg-assistant.status-streaming .body", has_text="w5").wait_for()
    page.locator(".msg-user .msg-edit").nth(1).click()
    page.wait_for_url(lambda u: u != original and "/c/" in u)
    assert page.input_value("#prompt") == "second question"
    new_id = page.url.rsplit("/", 1)[-1]
    page.locator(f'#conversation-list li[data-id="{new_id}"]').wait_for()  # listed without a reload
    page.locator(f'#conversation-list li[data-id="{original.rsplit("/", 1)[-1]}"] a').click()
    page.wait_for_url(original)
    page.locator(".msg-assistant.status-complete .body", has_text="w299").wait_for(timeout=30_000)
    # a first message's Edit…: a new conversation with its text, no empty copy
    page.locator(".msg-user .msg-edit").first.click()
    page.locator("#chat-title", has_text="New Conversation").wait_for()
    assert page.input_value("#prompt") == "first question"
    assert page.locator(".msg-assistant.status-stopped").count() == 0
    assert not page.errors, page.errors


def test_browser_continue_is_offered_under_the_last_reply_only(fake_server, page) -> None:
    """(walkthrough) A stopped reply kept its Continue after the talk went on, and pressing it said "only the
    last reply can be continued"."""
    url, fake = fake_server
    fake.enqueue(*[f"w{i} " for i in range(2000)])
    page.goto(url)
    page.fill("#prompt", "a long one")
    page.press("#prompt", "Enter")
    page.locator(".msg-assistant.status-streaming .body", has_text="w3").wait_for()
    page.keyboard.press("Escape")
    page.locator(".msg-assistant.status-stopped .continue-button").wait_for()
    assert page.locator(".continue-button").is_visible()
    fake.enqueue("you are welcome")
    send_and_wait(page, "thanks")
    assert page.locator(".continue-button").count() == 1 and not page.locator(".continue-button").is_visible()
    assert page.locator(".msg-edit").first.evaluate("e => getComputedStyle(e).opacity") == "1"  # not greyed
    assert not page.errors, page.errors


def test_browser_a_blank_rename_says_why_nothing_changed(fake_server, page) -> None:
    """(walkthrough) Rename with the title cleared did nothing, and said nothing."""
    url, fake = fake_server
    fake.enqueue("a reply")
    page.goto(url)
    send_and_wait(page, "name me")
    page.click("#conversations-window .list-actions [data-action=rename]")
    page.fill(".alert-box .dialog-input", "   ")
    page.click(".alert-box .dialog-ok")
    page.locator("#alerts .alert-box", has_text="a title cannot be empty").wait_for(timeout=5_000)
    assert page.inner_text("#chat-title") == "name me"
    assert not page.errors, page.errors


def test_browser_a_dialog_keeps_the_page_behind_it_until_it_is_answered(fake_server, page) -> None:
    """(walkthrough) While a confirm was open, the forms behind it could be filled and sent. A dialog is modal,
    as System 7's were: nothing behind it takes a click until it is answered; then everything does again."""
    url, fake = fake_server
    fake.enqueue("a reply")
    page.goto(url)
    send_and_wait(page, "name me")
    page.click("#conversations-window .list-actions [data-action=rename]")
    page.wait_for_selector(".alert-box .dialog-input")
    with pytest.raises(Exception, match="inert"):  # Playwright waits for it to take clicks: it never does
        page.click("#prompt", timeout=1_500)
    page.keyboard.press("Control+n")  # no new window drawn over it, outside the hold (review)
    with pytest.raises(Exception, match="inert"):
        page.click("#prompt", timeout=1_000)
    assert page.inner_text("#chat-title") == "name me"
    page.fill(".alert-box .dialog-input", "renamed")  # the dialog itself takes them
    page.click(".alert-box .dialog-ok")
    page.wait_for_selector("#chat-title:has-text('renamed')", timeout=5_000)
    page.click("#prompt", timeout=5_000)  # answered: the page is back
    page.fill("#prompt", "typed after")
    assert page.input_value("#prompt") == "typed after"
    assert not page.errors, page.errors


def test_browser_a_reload_while_a_command_waits_for_approval_ends_its_turn_in_the_new_page(
    fake_server, page
) -> None:
    """(walkthrough) A reload while the approval dialog was open: the new page said "A reply is being written in
    another window…" with Stop greyed and the step "Waiting for approval…", until a second reload."""
    url, _ = fake_server
    page.goto(url)
    page.fill("#prompt", "/shell sleep 30")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".approval-form", timeout=10_000)
    page.reload()
    page.wait_for_selector("#prompt")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = page.get_attribute("#status", "data-state")
        text = page.inner_text("#status .status-text")
        if state == "idle" and text == "Ready" and page.locator("text=not decided").count():
            break
        time.sleep(0.1)
    assert (state, text) == ("idle", "Ready"), (state, text)
    assert page.locator("#messages", has_text="Not run: not decided: the page was closed or reloaded").count()
    assert not page.errors, page.errors


def test_browser_find_filters_the_list_and_keeps_it_filtered_and_trash_keeps_typed_text(
    fake_server, page
) -> None:
    """Find in the Conversations window lists the conversations holding the words (a message's, not only a
    title's), and the list stays filtered when a reply draws it again; Move to Trash of the open conversation
    then Undo gives back what was typed in its box."""
    import re

    url, fake = fake_server
    fake.enqueue("the sky is blue today")
    fake.enqueue("apples are red")
    page.goto(url)
    send_and_wait(page, "What colour is it up there?")
    sky = page.url.rsplit("/", 1)[1]
    page.dispatch_event("nav [data-open=conversations-window]", "click")
    page.click("#conversations-window [data-action=new]")
    page.wait_for_selector("#messages .msg-assistant", state="detached")
    send_and_wait(page, "And fruit?")
    page.wait_for_url(re.compile(rf".*/c/(?!{sky})[0-9a-f]+$"))
    rows = page.locator("#conversation-list li[data-id]")
    assert rows.count() == 2
    page.fill("#conversation-find", "SKY is")
    page.wait_for_selector('#conversation-list[data-query="SKY is"]')
    assert rows.count() == 1 and rows.first.get_attribute("data-id") == sky
    assert page.inner_text("#conversation-count") == "1 found"
    assert page.inner_text("#conversation-list mark") == "sky is"
    fake.enqueue("pears too")
    send_and_wait(page, "More fruit?")  # the reply draws the list again (every conversation), out of band
    deadline = time.monotonic() + 10
    while not (page.get_attribute("#conversation-list", "data-query") == "SKY is" and rows.count() == 1):
        assert time.monotonic() < deadline, "the list was not filtered again"
        time.sleep(0.05)
    page.fill("#conversation-find", "")
    page.wait_for_selector('#conversation-list[data-query=""]')
    assert rows.count() == 2
    page.fill("#prompt", "half a thought")
    trashed = page.url.rsplit("/", 1)[1]
    page.click("#conversations-window [data-action=delete]")
    page.press(".alert-box.modal .dialog-ok", "Enter")
    undo = page.locator("#conversation-list .trash-note .undo-trash")
    undo.wait_for()
    assert page.input_value("#prompt") == ""  # the page went to a new conversation
    undo.click()
    deadline = time.monotonic() + 10
    while page.input_value("#prompt") != "half a thought":
        assert time.monotonic() < deadline, page.input_value("#prompt")
        time.sleep(0.05)
    page.wait_for_url(re.compile(rf".*/c/{trashed}$"))  # the address names it again (a reload finds it)
    assert page.locator("#conversation-list li.selected").count() == 1
    assert not page.errors, page.errors


def test_browser_a_reload_while_a_reply_is_written_shows_it_going_on_with_stop(
    fake_server, page, tmp_path: Path
) -> None:
    """A reload (or a closed tab) stopped the reply being written. Now the reloaded page shows the reply as
    written so far, then its tokens as they come, with Stop enabled; Stop stops it there."""
    import re

    from engine.paths import database_path
    from webapp.db import Database

    url, fake = fake_server
    fake.enqueue(*[f" word{i}" for i in range(600)])
    page.goto(url)
    page.fill("#prompt", "a long one")
    page.press("#prompt", "Enter")
    page.wait_for_url(re.compile(r".*/c/[0-9a-f]+$"))
    page.locator(".msg-assistant .body", has_text="word20").wait_for()
    cid = page.url.rsplit("/", 1)[1]
    page.reload()
    page.wait_for_selector("#status[data-state=generating]")
    page.wait_for_selector("#stop-button:not([disabled])")
    body = page.locator(".msg-assistant .body").last
    body.filter(has_text="word30").wait_for()
    seen = len(body.inner_text())
    deadline = time.monotonic() + 10
    while len(body.inner_text()) <= seen:  # tokens still arrive, in the reloaded page
        assert time.monotonic() < deadline, "no token arrived after the reload"
        time.sleep(0.05)
    page.click("#stop-button")
    page.wait_for_selector("#status[data-state=idle]")
    db = Database(database_path(tmp_path))
    assert db.messages(cid)[-1].status == "stopped"
    db.close()
    assert not page.errors, page.errors


def test_browser_a_reply_frame_sent_after_the_page_left_its_conversation_is_not_drawn_there(
    fake_server, page
) -> None:
    """(walkthrough) The context gauge of a conversation left mid-reply showed in the one opened next: the page
    is drawn over HTTP and says "showing" on its socket after, so frames of the reply sent meanwhile landed in
    the conversation shown. Here "showing" never reaches the server (the widest such gap): every frame of the
    reply is still sent to the page, and none of them changes the conversation it shows now."""
    url, fake = fake_server
    fake.enqueue("first answer")

    def hold_showing(ws) -> None:  # the page's messages go on to the server, but for "showing"
        server = ws.connect_to_server()
        ws.on_message(lambda m: None if '"showing"' in str(m) else server.send(m))

    page.route_web_socket("**/ws", hold_showing)
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    page.goto(url)
    send_and_wait(page, "an earlier conversation")
    earlier = page.url
    gauge, title = page.inner_text("#context-gauge"), page.inner_text("#chat-title")
    page.click("a.new-link")
    page.locator("#chat-title", has_text="New Conversation").wait_for()
    fake.enqueue(*[f"word{i} " for i in range(300)])  # 3 s at 10 ms a token
    page.fill("#prompt", "a long list to write meanwhile")
    page.press("#prompt", "Enter")
    page.locator(".msg-assistant.status-streaming .body", has_text="word5").wait_for()
    writing = page.url
    page.locator(f'#conversation-list li[data-id="{earlier.rsplit("/", 1)[-1]}"] a').click()
    page.wait_for_url(earlier)
    page.locator("#messages", has_text="first answer").wait_for()
    messages = page.inner_text("#messages")
    deadline = time.monotonic() + 20
    while "word299" not in page.request.get(writing).text() and time.monotonic() < deadline:
        time.sleep(0.2)  # the reply is written to its end (a page drawn now shows all of it)
    time.sleep(0.5)  # its last frames (its end, its stats, its gauge) were sent to this page too
    assert page.inner_text("#context-gauge") == gauge
    assert page.inner_text("#chat-title") == title
    assert page.inner_text("#messages") == messages and "word" not in messages
    assert not page.errors, page.errors
    assert not [m for m in console if "oobErrorNoTarget" in m], console  # its tokens had no target here


def test_browser_new_pressed_before_a_new_conversations_first_frame_stays_blank(fake_server, page) -> None:
    """(the last note's race) A message sent from a blank window makes a conversation; New pressed before that
    conversation's first frame reached the page drew a blank window again, and the frame then gave it the
    conversation just made (its id, title and messages). The frames are held here until New has drawn the
    window: the blank window stays blank, and the list shows the conversation made."""
    url, fake = fake_server
    held: list[object] = []
    holding = [False]

    def hold_frames(ws) -> None:  # the server's frames wait while `holding`, then go on in order
        server = ws.connect_to_server()
        ws.on_message(lambda m: server.send(m))
        server.on_message(lambda m: held.append(m) if holding[0] else ws.send(m))
        page.release = lambda: [ws.send(m) for m in held]

    page.route_web_socket("**/ws", hold_frames)
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.wait_for_selector("#status[data-state=idle]")
    fake.enqueue(*[f"word{i} " for i in range(100)])
    holding[0] = True
    page.fill("#prompt", "a message sent just before New")
    page.press("#prompt", "Enter")
    deadline = time.monotonic() + 10
    while not any('id="conversation-id"' in str(m) for m in held):
        assert time.monotonic() < deadline, "the new conversation's first frame was not sent"
        page.wait_for_timeout(50)
    assert page.input_value("#prompt")  # the message stays in the box until its frame comes
    page.click("a.new-link")
    deadline = time.monotonic() + 10
    while page.input_value("#prompt"):  # the window drawn again
        assert time.monotonic() < deadline, "New did not draw the window again"
        page.wait_for_timeout(50)
    holding[0] = False
    page.release()
    deadline = time.monotonic() + 10
    while page.locator("#conversation-list li[data-id]").count() < 1:  # the list (page-wide) still comes
        assert time.monotonic() < deadline, "the list did not show the conversation made"
        page.wait_for_timeout(50)
    page.wait_for_timeout(1500)  # the reply goes on meanwhile (1 s at 10 ms a token)
    assert page.input_value("#conversation-id") == ""
    assert page.inner_text("#chat-title") == "New Conversation"
    assert page.locator("#messages .msg").count() == 0
    assert page.url.rstrip("/") == url.rstrip("/")
    assert page.locator("#conversation-list li.selected").count() == 0  # the list marks none: none is shown
    assert not page.errors, page.errors
    assert not [m for m in console if "oobErrorNoTarget" in m], console
    fake.enqueue("its own answer")  # the blank window still makes a conversation of its own
    page.wait_for_selector("#status[data-state=idle]")
    send_and_wait(page, "and now one here")
    assert page.input_value("#conversation-id") != ""
    page.locator("#messages", has_text="its own answer").wait_for()
    assert "word" not in page.inner_text("#messages")


def test_browser_menus_grey_what_they_cannot_do_now_and_stop_says_why(fake_server, page) -> None:
    """(walkthrough) Stop, Regenerate, Rename… were never greyed, and Special › Stop with nothing being written
    did nothing at all. As System 7's menus do, an item that cannot act now is grey as its menu opens; chosen all
    the same, it says why."""
    url, fake = fake_server
    page.goto(url)

    def greyed() -> dict[str, bool]:
        page.mouse.move(600, 400)  # off the menus, then onto one: it opens, and its state is set
        page.hover("nav.menubar [role=menu-bar] > li:has-text('Special')")
        items = page.locator("nav.menubar [role=menu] [data-action]")
        return {
            items.nth(i).get_attribute("data-action"): items.nth(i).get_attribute("aria-disabled") == "true"
            for i in range(items.count())
            if items.nth(i).get_attribute("aria-disabled") is not None
        }

    blank = greyed()
    assert all(
        blank[a] for a in ("rename", "export-md", "export-json", "delete", "stop", "regenerate", "copy-last")
    )
    assert "new" not in blank and "import" not in blank  # always available: never greyed
    stop = page.locator("nav [data-action=stop]")
    assert stop.evaluate("e => getComputedStyle(e).color") == "rgb(153, 153, 153)"
    page.dispatch_event("nav [data-action=stop]", "click")
    page.locator("#status .status-text", has_text="Nothing to stop: no reply is being written.").wait_for()

    fake.enqueue(*[f"word{i} " for i in range(3000)])  # 30 s at 10 ms a token
    page.fill("#prompt", "a long list")
    page.press("#prompt", "Enter")
    page.locator(".msg-assistant.status-streaming .body", has_text="word5").wait_for()
    writing = greyed()
    assert not writing["stop"] and not writing["rename"], writing
    page.dispatch_event("nav [data-action=stop]", "click")  # the menu item stops the reply
    page.locator(".msg-assistant.status-stopped").wait_for()
    page.locator("#status[data-state=idle]").wait_for()
    fake.enqueue("a whole reply")
    send_and_wait(page, "again")
    after = greyed()
    assert after["stop"] and not any(after[a] for a in ("rename", "delete", "regenerate", "copy-last")), after
    # the export links name the conversation shown now, not the one the page was drawn with (walkthrough)
    shown = page.get_attribute("#conversation-id", "value")
    greyed()
    assert page.get_attribute("nav [data-action=export-md]", "href") == f"/c/{shown}/export.md"
    assert not page.errors, page.errors


def test_browser_a_new_send_closes_the_alerts_earlier_sends_left(fake_server, page) -> None:
    """(walkthrough) "Type a message first" stayed on screen while the next message was typed, and the next
    send's alert ("too long") came under it: two alerts at once. A send closes the alerts earlier sends left."""
    url, fake = fake_server
    page.goto(url)
    page.wait_for_selector("#status[data-state=idle]")
    for _ in range(2):
        page.fill("#prompt", "   ")
        page.click("#composer button[type=submit]")
        page.locator("#alerts [role=alert]", has_text="ype a message first").first.wait_for()
    time.sleep(0.5)  # a second alert would have come by now
    assert page.locator("#alerts [role=alert]").count() == 1
    fake.enqueue("an answer")
    send_and_wait(page, "hello")
    assert page.locator("#alerts [role=alert]").count() == 0  # the send that worked closed it too
    assert not page.errors, page.errors


def test_browser_the_agent_model_offered_but_not_installed_says_how_to_install_it(
    fake_server, page, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent mode on a model without tools offers the agent model; where it is not installed (an empty model
    folder here), its button says how to install it, and nothing is sent."""
    url, fake = fake_server
    (tmp_path / "home" / "models").mkdir(parents=True)
    monkeypatch.setenv(
        "FLASHCODE_HOME", str(tmp_path / "home")
    )  # the model menu lists what is installed here
    page.goto(url)
    page.select_option("#mode-picker", "agent")
    button = page.locator(".agent-notice button.load-model")
    button.wait_for(timeout=10_000)
    assert (
        page.locator("#model-picker optgroup[data-model='qwen2.5-coder-0.5b-instruct-q4_k_m']").count() == 0
    )
    before = page.input_value("#model-picker")
    button.click()
    page.locator("#alerts .alert-box", has_text="is not installed here: make setup").wait_for(timeout=5_000)
    assert page.input_value("#model-picker") == before and page.inner_text("#status .status-text") == "Ready"
    assert not page.errors, page.errors
