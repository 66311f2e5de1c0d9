"""An MCP tool called by the agent, the approvals clicked in Chromium (issue 20): a project whose
`.mcp.json` names the SDK test server (`tests/data/mcp_server.py`, in the real sandbox). Settings ›
MCP servers shows it not approved yet and what it would run; *Approve and enable*; the agent's call
opens the dialog (the MCP wording, `server__tool {arguments}`, the sandbox, "untrusted"); *Call
once* runs it and the step card shows the result; the next call is denied with a reason, and the
denial reaches the model as a denial.

Twice: with a scripted model (FakeBackend, the app in this process) and with the real agent model
(Qwen2.5-Coder-0.5B on llama-server, constrained tool calls; `slow`, `llama`). The page's CSP
forbids eval, so waits are polls from Python; nothing is timed. Screenshots: tests/artifacts/mcp_*.png.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.worker import Worker
from tests.conftest import FakeBackend
from tests.test_mcp import SERVER
from tests.test_mcp_real import llama_worker  # noqa: F401 - the module's real-model worker fixture

pytestmark = [pytest.mark.browser]
ARTIFACTS = Path(__file__).parent / "artifacts"


def until(check: Callable[[], bool], what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached: {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def browser():
    from tests.test_browser_webapp import ARGS, CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (make test installs it)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def make_project(tmp_path: Path, server: str, only: str) -> tuple[Path, Path]:
    """(data dir, project): the project registered and open, its .mcp.json naming the test server."""
    from engine.paths import database_path
    from webapp.db import Database
    from webapp.projects.store import ProjectStore

    project = tmp_path / "proj"
    project.mkdir()
    (project / ".mcp.json").write_text(
        json.dumps({"mcpServers": {server: {"command": sys.executable, "args": [SERVER, f"--only={only}"]}}})
    )
    data = tmp_path / "data"
    data.mkdir()
    db = Database(database_path(data))
    projects = ProjectStore(db.conn, data)
    projects.open(projects.add(project).id)
    db.close()
    return data, project


def approve_in_settings(page, server: str, shot: str) -> None:
    page.locator("nav.menubar li[role=menu-item]:has-text('View')").first.click()
    page.locator("nav.menubar button[data-open=settings-window]").click()
    row = page.locator(f"#mcp-server-{server}")
    row.wait_for(timeout=60_000)
    assert "not approved yet: approve it only if you trust this command" in row.inner_text()
    assert "mcp_server.py" in row.locator("code.mcp-runs").inner_text()
    row.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / f"{shot}_settings.png"))
    row.locator("button[data-action=approve]").click()
    until(lambda: page.locator(f"#mcp-server-{server}[data-status=enabled]").count() == 1, "approved")
    page.click("#settings-window [data-close]")


def send(page, text: str) -> None:
    if page.input_value("#mode-picker") != "agent":
        page.select_option("#mode-picker", "agent")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def idle(page) -> bool:
    return page.locator("#status[data-state=idle]").count() == 1


def run_turn(page, text: str, answer: Callable[[object], None], seen: list[dict]) -> None:
    """Send `text` in agent mode; answer every dialog with `answer(dialog)` (recording what it
    showed in `seen`) until the turn is over."""
    before = page.locator(".agent-step .step-status[data-decision]").count()
    send(page, text)
    until(
        lambda: page.locator(".agent-step").count() > 0 or page.locator(".agent-approval").count() > 0,
        "a step",
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        dialog = page.locator(".agent-approval")
        if dialog.count():
            d = dialog.first
            seen.append(
                {
                    "title": d.locator(".alert-text").inner_text(),
                    "command": d.locator("[data-field=command]").inner_text(),
                    "sandbox": d.locator("[data-field=sandbox]").inner_text(),
                    "untrusted": d.locator("[data-field=untrusted]").inner_text(),
                    "buttons": [b.inner_text() for b in d.locator(".approval-buttons button").all()],
                }
            )
            answer(d)
            until(lambda: page.locator(".agent-approval").count() == 0, "the dialog closed")
            continue
        if idle(page) and page.locator(".agent-step .step-status[data-decision]").count() > before:
            return
        time.sleep(0.25)
    raise AssertionError("the turn did not end")


def call_once(page, shot: str) -> Callable[[object], None]:
    def answer(d) -> None:  # noqa: ANN001
        page.screenshot(path=str(ARTIFACTS / f"{shot}_dialog.png"))
        d.locator("button[data-choice=once]").click()

    return answer


def deny(reason: str) -> Callable[[object], None]:
    def answer(d) -> None:  # noqa: ANN001
        d.locator("input[name=note]").fill(reason)
        d.locator("button[data-choice=deny]").click()

    return answer


def check_dialog(seen: dict, command: str) -> None:
    assert seen["title"] == "The agent wants to call this MCP tool (server__tool and its arguments):"
    assert seen["command"] == command
    assert seen["untrusted"].startswith("untrusted:")
    assert seen["buttons"][:2] == ["Deny", "Call once"]
    assert "Always allow this tool in this project" in seen["buttons"] or "NOT sandboxed" in seen["sandbox"]


def step_status(page, tool: str, n: int = 0):
    return page.locator(f'.agent-step[data-tool="{tool}"] .step-status').nth(n)


@contextmanager
def serve(data: Path, worker: Worker) -> Iterator[str]:
    from tests.servers import free_port, serve_app
    from webapp.app import create_app
    from webapp.settings import Settings

    port = free_port()
    settings = Settings(
        port=port, data_dir=data, load_model=False, agent_sampling={"temperature": 0.0, "max_tokens": 200}
    )
    with serve_app(create_app(settings, worker=worker), port) as url:
        yield url


# --------------------------------------------------------------------------- scripted model
def test_mcp_call_approved_and_denied_in_chromium(browser, tmp_path: Path) -> None:
    data, project = make_project(tmp_path, "demo", "add,echo")
    fake = FakeBackend(tools=True, context_length=32768)
    fake.enqueue_call("demo__add", a=2, b=40).enqueue("The sum is 42.")
    fake.enqueue_call("demo__echo", text="<b>hi</b>  x").enqueue("OK, I did not echo it.")
    worker = Worker(lambda: fake)
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    seen: list[dict] = []
    try:
        with serve(data, worker) as url:
            page.goto(url)
            approve_in_settings(page, "demo", "mcp")
            run_turn(page, "add 2 and 40", call_once(page, "mcp"), seen)
            ok = step_status(page, "demo__add")
            assert ok.get_attribute("data-ok") == "true" and ok.get_attribute("data-decision") == "once"
            assert "Done · approved" in ok.inner_text()
            ok.locator("summary").click()
            assert ok.locator("details.step-output pre").inner_text() == "42"
            card = page.locator('.agent-step[data-tool="demo__add"]')
            assert card.locator(".step-args").inner_text().split() == ["a", "2", "b", "40"]
            page.screenshot(path=str(ARTIFACTS / "mcp_result.png"), full_page=True)
            run_turn(page, "echo <b>hi</b>", deny("not now, thanks" + ", really" * 40), seen)
            no = step_status(page, "demo__echo")
            assert no.get_attribute("data-ok") == "false" and no.get_attribute("data-decision") == "deny"
            assert "Denied" in no.inner_text() and "Denied by the user: not now, thanks" in no.inner_text()
            # an argument as the model wrote it: its two spaces kept (an edit's old_text depends on them)
            args = page.locator('.agent-step[data-tool="demo__echo"] .step-args code')
            assert args.inner_text() == "<b>hi</b>  x", args.inner_text()
            # one long line wraps inside its card (it ran out of the window, cut off: a walkthrough)
            result = no.locator("pre.step-result")
            assert result.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), result.bounding_box()
            until(lambda: "OK, I did not echo it." in page.locator("#messages").inner_text(), "the answer")
            page.screenshot(path=str(ARTIFACTS / "mcp_denied.png"), full_page=True)
    finally:
        context.close()
        worker.close()
    assert len(seen) == 2
    check_dialog(seen[0], 'demo__add {"a": 2, "b": 40}')
    check_dialog(seen[1], 'demo__echo {"text": "<b>hi</b>  x"}')
    to_model = [m["content"] for m in fake.history[-1].messages if m.get("role") == "tool"]
    assert to_model[-1].startswith('<untrusted source="tool demo__echo">')
    assert "Denied by the user: not now, thanks" in to_model[-1]
    first = [m["content"] for m in fake.history[1].messages if m.get("role") == "tool"]
    assert first[0].startswith('<untrusted source="tool demo__add">') and "42" in first[0]
    assert not errors, errors


# --------------------------------------------------------------------------- the real agent model
@pytest.mark.slow
@pytest.mark.llama
def test_real_model_mcp_call_in_chromium(browser, tmp_path: Path, llama_worker: Worker) -> None:  # noqa: F811
    task = "Use the calc__add tool to add 1234 and 4321, then tell me the sum."
    data, project = make_project(tmp_path, "calc", "add")
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    seen: list[dict] = []
    try:
        with serve(data, llama_worker) as url:
            page.goto(url)
            approve_in_settings(page, "calc", "mcp_real")
            run_turn(page, task, call_once(page, "mcp_real"), seen)
            ok = step_status(page, "calc__add")
            assert ok.get_attribute("data-ok") == "true" and ok.get_attribute("data-decision") == "once"
            ok.locator("summary").click()
            assert ok.locator("details.step-output pre").inner_text() == "5555"
            page.screenshot(path=str(ARTIFACTS / "mcp_real_result.png"), full_page=True)
            first_turn = [d["command"] for d in seen]
            steps = page.locator('.agent-step[data-tool="calc__add"]')
            first_steps = [steps.nth(i).inner_text() for i in range(steps.count())]
            page.click("a.new-link")  # a fresh conversation: the model does not know the sum yet
            page.locator("#chat-title", has_text="New Conversation").wait_for()
            run_turn(page, task, deny("use mental arithmetic instead"), seen)
            no = step_status(page, "calc__add")
            assert no.get_attribute("data-decision") == "deny"
            assert "Denied by the user: use mental arithmetic instead" in no.inner_text()
            page.screenshot(path=str(ARTIFACTS / "mcp_real_denied.png"), full_page=True)
    finally:
        context.close()
    call = 'calc__add {"a": 1234, "b": 4321}'
    check_dialog(seen[0], call)  # constrained: integers, as the schema says
    # the same call again right after (a small model's loop) is refused without asking the user again
    repeats = [t for t in first_steps if "already did exactly this and it worked" in t]
    assert len(first_turn) == len(first_steps) - len(repeats), (first_turn, first_steps)
    assert not errors, errors
