"""The engine worker: one thread owns the backend; results reach sync and async callers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.base import Done, GenerationRequest, SamplingParams, TextDelta
from engine.worker import Worker
from tests.conftest import FakeBackend

REQ = GenerationRequest(prompt="x", sampling=SamplingParams(max_tokens=10))
ROOT = Path(__file__).resolve().parent.parent


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
    fake = FakeBackend(delay=1.0).enqueue(*["w"] * 50)
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
        # Done comes before the engine's next token boundary (1 s away), not at it
        assert done.finish_reason == "cancelled" and done.text == "www" and elapsed < 0.5
        fake.delay = 0.0
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


def test_a_cancel_gets_the_engine_numbers_once_it_stops():
    """Stop answers at once with the text so far and nothing else (no prompt count, TTFT 0: the agent's stopped
    replies showed "TTFT 0 ms" and counted no prompt); `with_engine_numbers` adds the engine's own once its
    Done arrives, keeping the cancel's text and token count."""
    fake = FakeBackend(delay=0.02)
    fake.enqueue(*[f" w{i}" for i in range(200)])
    worker = Worker(lambda: fake)

    async def main() -> tuple[Done, Done]:
        gen = worker.submit(
            GenerationRequest(
                messages=({"role": "user", "content": "one two three four"},),
                sampling=SamplingParams(max_tokens=200),
            ),
            loop=asyncio.get_running_loop(),
        )
        async for ev in gen:
            if isinstance(ev, TextDelta) and ev.text == " w5":
                gen.cancel()
            if isinstance(ev, Done):
                return ev, await gen.with_engine_numbers(ev)
        raise AssertionError("no Done")

    try:
        cancelled, merged = asyncio.run(main())
    finally:
        worker.close()
    assert cancelled.finish_reason == merged.finish_reason == "cancelled"
    assert cancelled.stats.prompt_tokens == 0 and cancelled.stats.ttft_s == 0
    assert merged.stats.prompt_tokens > 0 and merged.stats.ttft_s > 0 and merged.stats.total_s > 0
    assert (
        merged.text == cancelled.text
        and merged.stats.completion_tokens == cancelled.stats.completion_tokens == 6
    )


# A process whose engine thread used MLX, closed its worker and exited. The thread left MLX state of its
# own (its streams, its random key: `mx.random.seed`, or mlx-lm's import) that C++ frees as the thread
# exits, taking the GIL; with the interpreter finalizing by then, Python stops the thread inside that
# destructor: "terminate called without an active exception", exit 134, after all work was done
# (bench/agent.py; 5 exits in 6 with the real model). A long switch interval keeps the GIL on the main
# thread once it has it, as a main thread busy at exit does.
MLX_WORKER_EXIT = """
import sys
sys.setswitchinterval(5.0)
import engine
from engine import cpu_fast
from engine.worker import Worker


class Backend:  # only what the worker calls: MLX work on its thread, then close()
    def __init__(self):
        import mlx.core as mx

        mx.random.seed(0)
        x = mx.random.normal((64, 64))
        mx.eval([x @ x, *[mx.add(x, 1, stream=s) for s in cpu_fast.cpu_streams()[1:]]])

    def close(self):
        pass


w = Worker(Backend)
w.close()
w.close()  # a second close is a no-op
print("exiting")
"""


def _exit_codes(code: str, runs: int, timeout: float) -> list[tuple[int, str]]:
    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        ok = proc.returncode == 0 and proc.stdout.split()[-1:] == ["exiting"]
        out.append((proc.returncode, "" if ok else proc.stderr[-600:]))
    return out


def test_a_process_whose_worker_used_mlx_exits_cleanly_after_close() -> None:
    """Before the worker's thread freed MLX's per-thread state itself (`cpu_fast.end_thread`), about 1 exit in
    4 of this child aborted (4, 6 and 5 of 20 in three batches; which thread gets the GIL first decides), so
    20 clean exits in a row say the fix holds."""
    codes = _exit_codes(MLX_WORKER_EXIT, runs=20, timeout=120)
    assert all(rc == 0 and not err for rc, err in codes), codes


MLX_MODEL_EXIT = """
import sys
from engine.base import GenerationRequest, SamplingParams
from engine.worker import Worker
from webapp import engine_host

w = Worker(lambda: engine_host.make_loaded_backend("mlx", None))
req = GenerationRequest(messages=({"role": "user", "content": "def add(a, b):"},),
                        sampling=SamplingParams(temperature=0.0, max_tokens=4))
done = list(w.submit(req))[-1]
assert done.finish_reason in ("length", "stop"), done
w.close()
print("exiting")
"""


@pytest.mark.slow
def test_bench_style_mlx_worker_exits_cleanly(model_home: Path) -> None:
    """bench/agent.py's shape: the real model loaded and run on a Worker's thread (mlx-lm imported there),
    the worker closed, the process exits. Before the fix: exit 134 in 5 runs of 6."""
    code = f"import os; os.environ['FLASHCODE_HOME'] = {str(model_home)!r}\n" + MLX_MODEL_EXIT
    codes = _exit_codes(code, runs=3, timeout=300)
    assert all(rc == 0 and not err for rc, err in codes), codes


SWITCH_BACK = """
import sys
from engine.base import GenerationRequest, SamplingParams
from engine.flash.backend import current_rss_bytes
from engine.worker import Worker
from webapp.engine_host import make_loaded_backend

class Probe:  # a backend that only notes the process's RSS when it is made (what flash plans its budget on)
    def __init__(self):
        self.rss = current_rss_bytes()
    def close(self):
        pass

w = Worker(lambda: make_loaded_backend("mlx", None))
before = w.switch(Probe).rss  # the model closed once: what a process that loaded one holds
w.switch(lambda: make_loaded_backend("mlx", None))
list(w.submit(GenerationRequest(prompt="Count to ten.", sampling=SamplingParams(max_tokens=24, temperature=0))))
after = w.switch(Probe).rss
print(before, after)
w.close()
"""


@pytest.mark.slow
def test_a_switch_hands_the_closed_models_memory_back(model_home: Path) -> None:
    """The pages a closed model held go back to the OS before the next one loads (`release_memory`): flash plans
    its budget on the RSS it finds at load, and a process that had run an MLX model kept ~110 MB of it, so each
    switch gave the next flash model a smaller context, then refused it (helper's finding)."""
    import os

    proc = subprocess.run(
        [sys.executable, "-c", SWITCH_BACK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLASHCODE_HOME": str(model_home)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = map(int, proc.stdout.split()[-2:])
    assert after - before < 36e6, (before / 1e6, after / 1e6)  # here: +21-23 MB; +51 MB before the fix
