"""Prefill progress and Continue in Chromium (issue 21), against the real `flashcode serve` and the real
default model (MLX): a long prompt shows "Reading your prompt… N / M tokens" in the reply being
written, then the reply; a reply cut at the token limit goes on in the same message with Continue.
Waits are locator waits or polls from Python (the CSP forbids eval); nothing is timed. Screenshots:
tests/artifacts/trust_prefill_progress.png, trust_continued.png.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import paths
from tests.servers import serve_cli
from tests.test_browser_trust import LONG, connected, new_page, replies_done, send
from webapp.chat.transcript import DEFAULTS_KEY
from webapp.db import Database

pytest_plugins = ["tests.test_browser_trust"]
pytestmark = [pytest.mark.slow, pytest.mark.browser]

LINES = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(80)
)


def test_browser_prefill_progress_then_continue(home: Path, browser, artifacts: Path) -> None:
    db = Database(paths.database_path(home))
    db.set_setting(DEFAULTS_KEY, {"max_tokens": 12, "temperature": 0.0})
    db.close()
    with serve_cli(home, backend="mlx", timeout=300) as srv:
        page = new_page(browser)
        page.goto(srv.url)
        connected(page)

        send(page, f"Write a long story about these lines.\n{LINES}")
        progress = page.locator(".msg-assistant .prefill-progress")
        progress.first.wait_for(timeout=LONG)
        shown = progress.first.inner_text()
        page.screenshot(path=str(artifacts / "trust_prefill_progress.png"))
        m = re.search(r"Reading your prompt… (\d+) / (\d+) tokens", shown)
        assert m, shown
        assert int(m.group(1)) < int(m.group(2)) and int(m.group(2)) > 1024
        replies_done(page, 1)
        reply = page.locator(".msg-assistant").last
        assert reply.locator(".prefill-progress").count() == 0  # the reply took its place
        assert reply.locator('[data-flag="length"]').count() == 1
        reply_id = reply.get_attribute("id")
        cut = reply.locator(".body").inner_text()

        reply.locator(".continue-button").click()  # the same message goes on
        page.locator(f"#{reply_id}[data-status=streaming]").wait_for(timeout=60_000)
        replies_done(page, 1)
        grown = page.locator(f"#{reply_id}")
        assert page.locator(".msg-assistant").count() == 1 and page.locator(".msg-user").count() == 1
        text = grown.locator(".body").inner_text()
        assert text.startswith(cut.rstrip()[:20]) and len(text) > len(cut)
        assert grown.locator('[data-stat="continued"]').count() == 1
        page.screenshot(path=str(artifacts / "trust_continued.png"))

        page.reload()  # stored as one message
        connected(page)
        assert page.locator(".msg-assistant").count() == 1
        assert page.locator(f"#{reply_id} .body").inner_text() == text
    assert not page.errors
