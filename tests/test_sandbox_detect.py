"""Sandbox detection on a busy machine: a probe that runs out of time is no verdict. It used to be
cached for the life of the process as "no sandbox", so every later command asked, even one a saved
allow rule covers (the flaky `test_agent_ws_run_once_deny_and_always`: a saved `ls` rule still asked
once on a loaded machine). Here the probe's time limit is made too short on purpose, once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_agent_ws import ask, send, until
from webapp.agent import sandbox

pytest_plugins = ["tests.test_agent_ws"]


@pytest.fixture
def fresh_detection() -> Iterator[None]:
    sandbox.detect.cache_clear()
    yield
    sandbox.detect.cache_clear()


def test_a_probe_out_of_time_is_asked_again(fresh_detection: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "PROBE_TIMEOUT_S", 1e-6)
    slow = sandbox.detect()
    assert not slow.available and not slow.settled and "did not start within" in slow.reason
    monkeypatch.setattr(sandbox, "PROBE_TIMEOUT_S", 60.0)
    status = sandbox.detect()
    assert status.available and status.settled and status.kind == "bubblewrap", status.reason
    assert sandbox.detect() is status  # a settled answer is kept


def test_a_saved_rule_allows_after_a_slow_first_probe(
    fresh_detection: None, ws, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "PROBE_TIMEOUT_S", 1e-6)  # the machine is busy at the first command
    conv: list[str] = []
    frames, dialog = ask(ws, "/shell ls -a", conv)
    assert "NOT sandboxed" in frames and "did not start within" in frames
    send(ws, type="answer", dialog_id=dialog, choice="always_prefix")
    frames = until(ws, r'data-state="idle"')
    assert "saved rule <code>ls</code>" in frames
    monkeypatch.setattr(sandbox, "PROBE_TIMEOUT_S", 60.0)  # and less busy at the next
    send(ws, type="send", text="/shell ls -la", conversation_id=conv[0])
    frames = until(ws, r'data-state="idle"')
    assert (
        "dialog-" not in frames and "Allowed by rule: <code>ls</code>" in frames and "Exit code 0" in frames
    )
