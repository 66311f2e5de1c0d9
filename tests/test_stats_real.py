"""Stats for real: the default model on the MLX backend through a real Worker.

One module-scoped server (uvicorn in a thread on a free loopback port, the real web app) serves
three tests: a real reply's stats
are recorded, the official `openai` client works against `/v1` (streaming and not), and the Stats
window renders with its charts in Chromium (screenshot in tests/artifacts/stats_window.png).
Replies are kept to a few tokens: this CPU is shared, and MLX on CPU decodes a few tok/s here.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import paths
from engine.base import Done, GenerationRequest, SamplingParams
from engine.worker import Worker
from tests.servers import free_port, serve_app
from webapp.app import create_app
from webapp.db import migrate
from webapp.engine_host import make_loaded_backend
from webapp.settings import Settings
from webapp.stats import store as stats

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
TOKENS = 4


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("stats-home")
    (root / "models").symlink_to(model_home / "models", target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(paths.ENV_HOME, str(root))
        yield root


@pytest.fixture(scope="module")
def worker(home: Path) -> Iterator[Worker]:
    w = Worker(lambda: make_loaded_backend("mlx", None))
    yield w
    w.close()


@pytest.fixture(scope="module")
def server(home: Path, worker: Worker) -> Iterator[str]:
    port = free_port()
    app = create_app(Settings(port=port, data_dir=home, load_model=False), worker=worker)
    with serve_app(app, port) as url:
        yield url


def db(home: Path) -> sqlite3.Connection:
    return sqlite3.connect(paths.database_path(home))


def test_stats_recorded_for_a_real_reply(home: Path, worker: Worker) -> None:
    request = GenerationRequest(
        messages=({"role": "user", "content": "Say hi."},),
        sampling=SamplingParams(temperature=0.0, max_tokens=TOKENS),
    )

    async def reply() -> Done:
        gen = worker.submit(request, loop=asyncio.get_running_loop())
        return [ev async for ev in gen if isinstance(ev, Done)][0]

    done = asyncio.run(reply())
    assert done.error is None, done.error
    conn = db(home)
    migrate(conn)
    rid = stats.record_reply(
        conn,
        done.stats,
        backend=worker.backend.name,
        model=worker.backend.model.name,
        conversation_id="c1",
        message_id=1,
        finish_reason=done.finish_reason,
    )
    row = conn.execute(
        "SELECT backend, model, prompt_tokens, completion_tokens, ttft_s, decode_tps, peak_memory_bytes, "
        "total_s FROM stats_replies WHERE id=?",
        (rid,),
    ).fetchone()
    backend, model, prompt, completion, ttft, tps, peak, total = row
    assert (backend, model) == ("mlx", "smollm2-135m-instruct-q4_1")
    assert prompt > 5 and 1 <= completion <= TOKENS
    assert ttft > 0 and tps > 0 and peak > 10 << 20 and total >= ttft
    assert stats.totals(conn).replies >= 1


def test_openai_client_streaming_and_not(server: str, home: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list()
    assert "smollm2-135m-instruct-q4_1" in [m.id for m in models.data]
    out = client.chat.completions.create(
        model="smollm2-135m-instruct-q4_1",
        max_tokens=TOKENS,
        temperature=0,
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 5 and 1 <= out.usage.completion_tokens <= TOKENS
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct-q4_1",
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content  # greedy: the same reply both ways
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert stats.totals(db(home), source="api").replies == 2


def seed(home: Path) -> None:
    """Replies over the last hours on three backends, a bench run and grades (real rows, made-up times)."""
    conn = db(home)
    now = time.time()
    for i in range(18):
        backend, tps, ttft = [("mlx", 9.0, 0.35), ("llama", 97.0, 0.08), ("flash", 4.0, 1.2)][i % 3]
        s = {
            "prompt_tokens": 200 + 40 * i,
            "cached_tokens": 120 if i % 2 else 0,
            "completion_tokens": 150 + 10 * i,
            "ttft_s": ttft * (1 + 0.1 * (i % 4)),
            "decode_tps": tps * (1 - 0.03 * (i % 5)),
            "total_s": 20.0,
            "peak_memory_bytes": (300 + i) << 20,
            "extra": {"bytes_read": (40 << 20) * i} if backend == "flash" else {},
        }
        rid = stats.record_reply(
            conn,
            s,
            backend=backend,
            model="smollm2-135m-instruct-q4_1",
            route=("chat", "search", "shell")[i % 3],
            conversation_id="seed",
            message_id=i + 1,  # each a reply a message shows (a step that only called tools has none)
            project_id="default",  # the window opens on the page's project: the default one here
        )
        conn.execute("UPDATE stats_replies SET created_at=? WHERE id=?", (now - (18 - i) * 1200, rid))
    conn.commit()
    stats.grade_last(conn, "bad", "ran the wrong command", conversation_id="seed", excerpt="ls -la /")
    stats.record_bench_run(
        conn,
        backend="mlx",
        model="smollm2-135m-instruct-q4_1",
        max_tokens=64,
        results=[
            {
                "decode_tps": 9.1,
                "ttft_s": 0.3,
                "peak_memory_bytes": 310 << 20,
                "total_s": 7.0,
                "prompt_tokens": 40,
                "completion_tokens": 64,
            }
        ],
    )
    conn.close()


@pytest.mark.browser
def test_stats_window_renders_in_chromium(server: str, home: Path, artifacts: Path) -> None:
    from playwright.sync_api import sync_playwright

    seed(home)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server)
            page.evaluate("document.querySelector('[data-open=stats-window]').click()")
            page.wait_for_selector("#stats-window #stats-pane svg", timeout=15_000)
            window = page.locator("#stats-window")
            # the web app's htmx:afterSwap handler focuses the chat window after any swap: bring Stats back
            window.locator(".title-bar .title").dispatch_event("pointerdown")
            assert window.locator("svg.chart").count() == 4
            assert window.locator("svg.chart polyline").count() >= 3  # one line per backend
            assert window.locator("svg.chart g.bar").count() >= 3
            assert "Claude Sonnet 4.5" in window.locator("#stats-savings").inner_text()
            assert window.locator("[data-stat=replies]").inner_text().strip() != "0"
            box = window.bounding_box()
            assert box and box["width"] >= 500, "the Stats window did not grow to fit its content"
            window.screenshot(path=str(artifacts / "stats_window.png"))
            window.locator(".window-pane").evaluate("el => el.scrollTop = 900")
            window.screenshot(path=str(artifacts / "stats_window_lower.png"))
            page.screenshot(path=str(artifacts / "stats_desktop.png"))
            assert not errors, errors
        finally:
            browser.close()


@pytest.mark.llama
def test_stats_a_stopped_llama_reply_keeps_its_numbers(home: Path, model_home: Path) -> None:
    """Stop a chat reply on the real llama-server: the reply's footer and the stats have its generated and
    prompt tokens (the chat endpoint streams no token ids: they were 0 and 0, and no stats row was written,
    so totals and the cloud cost left the reply out)."""
    import re

    from starlette.testclient import TestClient

    from tests.test_ws import BASE, connect, conversation_id, send, until

    if not (home / "gguf").exists():
        (home / "gguf").symlink_to(model_home / "gguf", target_is_directory=True)
    w = Worker(lambda: make_loaded_backend("llama", None))
    try:
        app = create_app(Settings(data_dir=home / "llama-stop", load_model=False), worker=w)
        with TestClient(app, base_url=BASE) as c, connect(c) as ws:
            send(ws, type="send", text="Write a detailed essay about the history of the Roman empire.")
            cid = conversation_id(until(ws, r'data-state="generating"', 400))
            tokens = 0
            while tokens < 5:  # token frames (not "Reading your prompt…")
                frame = ws.receive_text()
                tokens += bool(re.search(r'-tail" hx-swap-oob="innerHTML"', frame)) and "prefill" not in frame
            send(ws, type="stop")
            until(ws, r'data-state="idle"', 400)
            db = app.state.flashcode.db
            deadline = time.monotonic() + 20
            # the row is written at the stop, and gets the engine's prompt count once its generation ended
            while not (
                rows := db.conn.execute("SELECT * FROM stats_replies WHERE prompt_tokens > 0").fetchall()
            ):
                assert time.monotonic() < deadline, (
                    f"the stopped reply was never recorded: {db.messages(cid)}"
                )
                time.sleep(0.1)
            reply = db.messages(cid)[-1]
            assert reply.status == "stopped" and reply.content
            assert rows[0]["completion_tokens"] >= 2 and rows[0]["prompt_tokens"] > 20
            assert reply.stats["completion_tokens"] == rows[0]["completion_tokens"]
    finally:
        w.close()
