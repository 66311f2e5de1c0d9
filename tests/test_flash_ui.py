"""The flash engine in the web app: live disk rate, MB per token and memory while a reply is written.

Real parts: the default model, split and streamed by FlashBackend under a memory budget, on the
engine worker, behind the real app and websocket.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.worker import Worker
from tests.test_ws import BASE, connect, send, until
from webapp.app import create_app
from webapp.chat import socket as ws_module
from webapp.settings import Settings


@pytest.fixture
def flash_client(default_model, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:  # fmt: skip
    from engine.flash.backend import FlashBackend, current_rss_bytes
    from engine.flash.split import split_model

    split = split_model(default_model.path, tmp_path_factory.mktemp("flash-ui") / "split", progress=False)
    model = dataclasses.replace(default_model, split_path=split)
    budget = (
        current_rss_bytes() + 250_000_000
    )  # the budget is the process's: this pytest process + the engine

    def load() -> FlashBackend:
        b = FlashBackend(memory_budget=budget)
        b.load(model)
        return b

    monkeypatch.setattr(ws_module, "METER_SECONDS", 0.2)
    worker = Worker(load)
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    with TestClient(app, base_url=BASE) as c:
        yield c
    worker.close()


@pytest.mark.slow
def test_flash_reply_shows_live_disk_rate_and_memory(flash_client: TestClient) -> None:
    page = flash_client.get("/").text
    # before a reply: the meter's row is there, idle (the disk idle, memory against the budget), so the
    # transcript under it does not move down when a reply starts and up when it ends
    idle = re.search(r'<div id="engine-meter" class="engine-meter idle">(.*?)</div>', page, re.S)
    assert idle and "Disk idle" in idle[1] and re.search(r"Mem \d+\.\d\d / \d+\.\d\d GB", idle[1])
    assert "– MB/token" in idle[1]  # the same spans as while it works: the row keeps its length
    with connect(flash_client) as ws:
        send(ws, type="send", text="Write three sentences about the sea.", conversation_id="",
             max_tokens=48, temperature=0)  # fmt: skip
        frames = until(ws, r'data-state="idle"', limit=2000)
    meters = [f for f in frames if 'id="engine-meter"' in f]
    assert meters, "the meter is sent while the reply streams"
    last = [m for m in meters if "Disk idle" not in m][-1]
    assert re.search(r"Disk \d+\.\d\d GB/s", last) and re.search(r"Mem \d+\.\d\d / \d+\.\d\d GB", last)
    peak = re.search(
        r'data-meter="peak"[^>]*>Peak (\d+\.\d\d) / (\d+\.\d\d) GB', last
    )  # peak RSS vs the budget
    assert peak and 0 < float(peak[1]) <= float(peak[2])
    assert re.search(r"\d+\.\d MB/token", "".join(meters))  # once tokens arrived: bytes read per token
    footer = "".join(frames)
    assert re.search(
        r'data-stat="flash"[^>]*>\d+\.\d MB/token', footer
    )  # the finished reply keeps the number
    assert re.search(r'data-stat="memory"[^>]*>Peak \d+\.\d\d / \d+\.\d\d GB', footer)  # and its peak RSS
    # the meter is of a reply being written: idle once it is done (not hidden: its row stays), the footer stays
    assert (
        'class="engine-meter idle"' in meters[-1]
        and "Disk idle" in meters[-1]
        and " hidden" not in meters[-1]
    )


@pytest.mark.slow
def test_a_stopped_flash_reply_keeps_the_engine_numbers(flash_client: TestClient) -> None:
    """Stop answers at once, before the engine's own numbers exist; once the engine has stopped, the reply's
    footer gets them (disk per token, peak memory against the budget, the prompt's size) and keeps them."""
    with connect(flash_client) as ws:
        send(ws, type="send", text="Count from one to two hundred, in words.", conversation_id="",
             max_tokens=400, temperature=0)  # fmt: skip
        # a token frame (not the prompt's progress): the reply is being written
        first = until(ws, r'id="msg-\d+-tail" hx-swap-oob="innerHTML">(?!<p class="prefill)', limit=2000)
        send(ws, type="stop")
        frames = until(ws, r'data-state="idle"', limit=2000)
        assert "status-stopped" in "".join(frames)
        later = until(ws, r'data-stat="flash"', limit=2000)
    footer = later[-1]
    assert 'data-status="stopped"' in footer
    assert re.search(r'data-stat="flash"[^>]*>\d+\.\d MB/token', footer)
    assert re.search(r'data-stat="memory"[^>]*>Peak \d+\.\d\d / \d+\.\d\d GB', footer)
    cid = re.search(r'id="conversation-id" value="([0-9a-f]+)"', "".join(first + frames))[1]
    reply = flash_client.get(f"/c/{cid}/export.json").json()["messages"][-1]
    stats = reply.get("stats") or {}
    assert reply["status"] == "stopped" and stats.get("prompt_tokens", 0) > 10
    assert stats["extra"]["bytes_per_token"] > 0 and stats["extra"]["memory_budget"] > 0
    rows = flash_client.app.state.flashcode.db.conn.execute(
        "SELECT prompt_tokens, completion_tokens FROM stats_replies WHERE conversation_id = ?", (cid,)
    ).fetchall()  # Stats counts the reply once, with the prompt the engine counted after the stop
    assert [tuple(r) for r in rows] == [(stats["prompt_tokens"], stats["completion_tokens"])]


@pytest.mark.slow
def test_a_reply_that_fills_the_context_says_so_not_the_token_limit(default_model, tmp_path: Path) -> None:
    """A reply cut because the conversation filled the model's context (a flash budget's short context, say)
    said "Stopped at the token limit" with a Continue that could only fail: it says the context is full and
    what to do instead, the engine's own fix first (flash: a larger memory budget)."""
    import html

    from engine.mlx_backend import MLXBackend

    class BudgetCut(MLXBackend):  # as flash says when its budget cut the context (FlashBackend.context_fix)
        def context_fix(self) -> str:
            return "raise the memory budget (Settings)"

    def load() -> MLXBackend:
        b = BudgetCut(context_length=96)
        b.load(default_model)
        return b

    worker = Worker(load)
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url=BASE) as c, connect(c) as ws:
            send(ws, type="send", text="Count from one to one hundred in words.", conversation_id="",
                 max_tokens=400, temperature=0)  # fmt: skip
            shown = html.unescape("".join(until(ws, r'data-state="idle"', limit=2000)))
        assert 'data-flag="context"' in shown and "Stopped: the context is full (96 tokens)" in shown
        assert "For a longer one, raise the memory budget (Settings); or start a new conversation" in shown
        assert 'data-flag="length"' not in shown and "continue-button" not in shown
    finally:
        worker.close()
