"""Prefill progress (issue 21): "Reading your prompt… N / M tokens" in the reply being written, before
its first token. The real default model on MLX in-process through the websocket (mlx-lm's
`prompt_progress_callback`, emitted on the engine thread into the worker's event stream), the real
llama-server (`return_progress`), and the pipeline's throttle (at most one frame per
`PROGRESS_SECONDS`, on a scripted clock). No timed asserts.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.base import Done, GenerationRequest, PrefillProgress, SamplingParams, TextDelta
from engine.worker import Worker
from tests.test_ws import BASE, connect, conversation_id, send, until
from webapp.app import create_app
from webapp.chat import pipeline
from webapp.db import Database
from webapp.engine_host import make_loaded_backend
from webapp.settings import Settings

# ~1,300 tokens: more than two of the MLX backend's 512-token prefill steps
LONG = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(80)
)
PROGRESS = re.compile(r'class="prefill-progress" data-processed="(\d+)" data-total="(\d+)"')


def progress_in(frames: list[str]) -> list[tuple[int, int]]:
    return [(int(n), int(m)) for f in frames for n, m in PROGRESS.findall(f)]


@pytest.fixture
def mlx_app(data_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, object]]:
    worker = Worker(lambda: make_loaded_backend("mlx", None))
    (tmp_path / "proj").mkdir(exist_ok=True)  # a project never holds the data directory
    settings = Settings(data_dir=data_dir, load_model=False, project_dir=tmp_path / "proj")
    app = create_app(settings, worker=worker)
    with TestClient(app, base_url=BASE) as c:
        yield c, app.state.flashcode
    worker.close()


@pytest.mark.slow
def test_mlx_reply_shows_prefill_progress_then_the_reply(mlx_app) -> None:
    client, parts = mlx_app
    with connect(client) as ws:
        send(ws, type="send", text=f"Count the lines.\n{LONG}", max_tokens=8, temperature=0)
        frames = until(ws, r'data-state="idle"', limit=400)
        cid = conversation_id(frames)
        reply = parts.db.messages(cid)[-1]
        assert reply.role == "assistant" and reply.status == "complete" and reply.content
        total = int(reply.stats["prompt_tokens"])
        assert total > 1024  # more than two prefill steps
        seen = progress_in(frames)
        assert seen and all(m == total for _, m in seen), seen
        assert any(n < m for n, m in seen)
        assert [n for n, _ in seen] == sorted(n for n, _ in seen)  # it only goes forward
        first_progress = next(i for i, f in enumerate(frames) if "prefill-progress" in f)
        first_token = next(
            i
            for i, f in enumerate(frames)
            if f'id="msg-{reply.id}-tail" hx-swap-oob="innerHTML"' in f and "prefill-progress" not in f
        )
        assert first_progress < first_token  # progress, then the reply replaces it
        status = [(i, "Reading your prompt…" in f) for i, f in enumerate(frames) if 'id="status"' in f]
        reading = [i for i, r in status if r]
        assert reading and first_progress <= reading[0] < first_token  # the status bar says so too
        assert any(i >= first_token and not r for i, r in status)  # then back to "Writing…"
        final = next(f for f in reversed(frames) if f'id="msg-{reply.id}" data-status="complete"' in f)
        assert "Reading your prompt" not in final
        # while it writes, the context gauge counts the prompt and the reply so far (not only at the end)
        done_at = next(i for i, f in enumerate(frames) if f'id="msg-{reply.id}" data-status="complete"' in f)
        writing = [int(u) for f in frames[first_token:done_at] for u in re.findall(r'gauge-text">(\d+) /', f)]
        assert writing and total < writing[0] <= writing[-1] <= total + 8, writing

        # the next turn reuses the cached prefix: what was cached counts as read
        send(ws, type="send", text="And the first line?", conversation_id=cid, max_tokens=4, temperature=0)
        frames = until(ws, r'data-state="idle"', limit=400)
        again = progress_in(frames)
        assert again and again[0][0] >= total, again  # started past the previous prompt
        second = parts.db.messages(cid)[-1]
        assert second.stats["cached_tokens"] >= total and again[0][1] == second.stats["prompt_tokens"]
    print(f"\nMLX prefill progress for {total} tokens: {seen}; next turn: {again}")


class Views:
    def prefill(self, message_id: int, processed: int, total: int) -> str:
        return f"{processed}/{total}"

    def tokens(self, message_id: int, done: str, tail: str) -> str:
        return f"tokens:{done}{tail}"

    def controls(self, generating: bool, text: str | None = None) -> str:
        return f"status:{text or 'Writing…'}"

    def gauge(self, used: int) -> str:
        return f"gauge:{used}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_throttled_and_stops_at_the_first_token(tmp_path: Path, monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(pipeline.time, "monotonic", clock)
    db = Database(tmp_path / "flashcode.db")
    conv = db.create_conversation("t")
    sent: list[str] = []
    stream = pipeline.ReplyStream(
        db=db,
        views=Views(),
        engine=None,
        hooks=(),
        send=lambda *f: sent.extend(f),
        conversation_id=conv.id,  # type: ignore[arg-type]
    )
    for i in range(50):  # one report every 1/64 s (exact in binary) for 0.78 s
        stream.progress(i * 10, 1000)
        clock.now += 1 / 64
    # the first at once (and the status bar says so), then <= 5 a second
    assert sent == ["0/1000", "status:Reading your prompt…", "130/1000", "260/1000", "390/1000"]
    stream.add("Hi")
    stream.progress(990, 1000)
    clock.now += 1
    stream.progress(995, 1000)
    # once the reply writes, no more progress; the gauge counts the prompt and the reply so far
    assert sent[5:] == ["tokens:Hi", "gauge:1001", "status:Writing…"]
    db.close()


# --------------------------------------------------------------------------- llama-server
@pytest.mark.llama
@pytest.mark.slow
def test_llama_server_streams_prefill_progress(data_dir: Path) -> None:
    llama_server = pytest.importorskip("engine.llama_server")
    try:
        llama_server.find_llama_server()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no llama-server: {exc}")
    from engine.models import find_model

    b = llama_server.LlamaServerBackend(context_length=4096, threads=1)
    b.load(find_model(None))
    try:
        events = []
        request = GenerationRequest(
            messages=({"role": "user", "content": f"Count the lines.\n{LONG}"},),
            sampling=SamplingParams(temperature=0.0, max_tokens=4),
            progress=True,
        )
        for ev in b.stream(request, threading.Event()):
            events.append(ev)
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason in ("stop", "length"), done
        progress = [e for e in events if isinstance(e, PrefillProgress)]
        assert progress and all(p.total == done.stats.prompt_tokens for p in progress), progress
        # then (total, total) once, the prompt read: a tool call being written shows nothing else
        assert (
            all(p.processed < p.total for p in progress[:-1]) and progress[-1].processed == progress[-1].total
        )
        # one a batch of 512 (the chat endpoint's progress chunks carry a role "delta": the first was taken for
        # the first token, and the bar said "read" at once, from 38 of 1,740)
        steps = [p.processed for p in progress]
        assert steps == sorted(set(steps)) and len(steps) >= 1 + done.stats.prompt_tokens // 512, steps
        first_text = next(i for i, e in enumerate(events) if isinstance(e, TextDelta) and e.text)
        assert max(i for i, e in enumerate(events) if isinstance(e, PrefillProgress)) < first_text
        assert all(
            e.token_ids != (0,) for e in events if isinstance(e, TextDelta)
        )  # no progress chunk as a token

        # not asked: no progress, and the raw completion path takes it too
        plain = list(
            b.stream(
                GenerationRequest(prompt=LONG[:200], sampling=SamplingParams(max_tokens=3)), threading.Event()
            )
        )
        assert not any(isinstance(e, PrefillProgress) for e in plain)
        raw = list(
            b.stream(
                GenerationRequest(
                    prompt=LONG, sampling=SamplingParams(max_tokens=3, temperature=0), progress=True
                ),
                threading.Event(),
            )
        )
        raw_progress = [e for e in raw if isinstance(e, PrefillProgress)]
        assert any(e.processed < e.total for e in raw_progress)
        assert [e.processed == e.total for e in raw_progress].count(True) == 1 and raw_progress[
            -1
        ].processed == (raw_progress[-1].total)
        assert all(e.token_ids != (0,) for e in raw if isinstance(e, TextDelta))
    finally:
        b.close()
    print(f"\nllama-server prefill progress: {[(p.processed, p.total) for p in progress]}")
