"""The engine worker: one thread owns the backend; results reach sync and async callers."""

from __future__ import annotations

import asyncio
import time

from engine.base import Done, GenerationRequest, SamplingParams, TextDelta
from engine.worker import Worker
from tests.conftest import FakeBackend

REQ = GenerationRequest(prompt="x", sampling=SamplingParams(max_tokens=10))


def test_all_backend_calls_run_on_the_worker_thread():
    fake = FakeBackend().enqueue("a", "b")
    w = Worker(lambda: fake, name="engine-thread")
    try:
        assert w.call(lambda b: b.tokenize("hello big world")) == [5, 3, 5]
        events = list(w.submit(REQ))
        assert [e.text for e in events if isinstance(e, TextDelta)] == ["a", "b"]
        assert isinstance(events[-1], Done) and events[-1].text == "ab"
        assert fake.threads == {"engine-thread"}
    finally:
        w.close()
    assert fake.closed


def test_async_consumer_and_immediate_cancel():
    fake = FakeBackend(delay=0.05).enqueue(*["w"] * 50)
    w = Worker(lambda: fake)

    async def main() -> tuple[Done, float]:
        gen = w.submit(REQ, loop=asyncio.get_running_loop())
        seen = 0
        t0 = 0.0
        async for ev in gen:
            if isinstance(ev, TextDelta):
                seen += 1
                if seen == 3:
                    t0 = time.perf_counter()
                    gen.cancel()
            else:
                return ev, time.perf_counter() - t0
        raise AssertionError("no Done")

    try:
        done, elapsed = asyncio.run(main())
        assert done.finish_reason == "cancelled" and done.text == "www" and elapsed < 0.05
        # the next request runs normally once the engine reaches its token boundary
        assert list(w.submit(REQ))[-1].finish_reason == "stop"
    finally:
        w.close()


def test_backend_exception_becomes_error_event_and_worker_survives():
    class Broken(FakeBackend):
        def stream(self, request, cancel):
            yield TextDelta("x", (0,))
            raise RuntimeError("kernel exploded")

    w = Worker(lambda: Broken())
    try:
        done = list(w.submit(REQ))[-1]
        assert done.finish_reason == "error" and "kernel exploded" in done.error
        assert w.call(lambda b: b.tokenize("a b")) == [1, 1]
    finally:
        w.close()


def test_switch_closes_the_old_backend():
    first, second = FakeBackend(), FakeBackend()
    w = Worker(lambda: first)
    try:
        w.switch(lambda: second)
        assert first.closed and w.backend is second
    finally:
        w.close()


def test_no_backend_gives_clear_error():
    w = Worker()
    try:
        done = list(w.submit(REQ))[-1]
        assert done.finish_reason == "error" and "no backend" in done.error
    finally:
        w.close()
