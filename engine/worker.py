"""One long-lived inference thread that owns the backend; a queue in, per-request results out.

Why a thread of its own: since mlx 0.31.2 a stream belongs to the thread that created it, so MLX
called from `asyncio.to_thread` or a pool fails. Everything that touches the backend (load,
tokenize, generate, save a cache) is a job on this one thread, run in order. The thread's last act frees
MLX's per-thread state (`cpu_fast.end_thread`): left to thread exit, it aborts the process at exit.

Callers get results two ways: `call()` blocks a plain thread (the CLI), `acall()` / `submit(loop=)`
deliver into an asyncio loop with `call_soon_threadsafe` (the web app). Cancellation is a
`threading.Event` the backend checks between tokens.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from . import cpu_fast
from .base import (
    Backend,
    Done,
    EngineError,
    Event,
    GenerationRequest,
    GenerationStats,
    TextDelta,
    listening,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_STOP = object()


class Generation:
    """A handle on one streaming request: iterate it (sync or async) and `cancel()` it."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request = request
        self.cancel_event = threading.Event()
        self._loop = loop
        self._sync_q: queue.Queue[Event] = queue.Queue()
        self._async_q: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._lock = threading.Lock()
        self._closed = False
        self._text: list[str] = []
        self._tokens = 0
        self._first_sent = False
        self.done = threading.Event()
        # the engine's own Done, kept even after a cancel answered first (its numbers: prompt, memory, extras)
        self.engine_done: Done | None = None

    def cancel(self) -> None:
        """Stop now: the consumer gets `Done("cancelled")` at once, with the text so far. The engine
        thread stops at its next token boundary; whatever it still sends for this request is dropped."""
        with self._lock:
            if not self._closed:
                self._closed = True
                stats = GenerationStats(completion_tokens=self._tokens)
                self._deliver(Done(stats, "cancelled", "".join(self._text)))
        self.cancel_event.set()  # after our Done is queued, so the engine's own Done cannot overtake it

    async def with_engine_numbers(self, cancelled: Done, wait_s: float = 1.0) -> Done:
        """A cancel's `Done` (text and token count so far, nothing else) with the engine's own numbers once its
        Done arrives, waiting at most `wait_s` (it stops at its next token boundary): prompt and cache counts,
        TTFT, rates, memory. The text and token count stay the cancel's, which the consumer showed."""
        deadline = time.monotonic() + wait_s
        while self.engine_done is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        own = self.engine_done
        if own is None or own is cancelled:
            return cancelled
        stats = dataclasses.replace(own.stats, completion_tokens=cancelled.stats.completion_tokens)
        return dataclasses.replace(cancelled, stats=stats)

    def _put(self, event: Event) -> None:
        """Called on the worker thread."""
        with self._lock:
            if isinstance(event, Done):
                self.engine_done = event
            if self._closed:
                return
            if isinstance(event, TextDelta):
                self._text.append(event.text)
                self._tokens += event.count
            elif isinstance(event, Done):
                self._closed = True
            self._deliver(event)

    def _deliver(self, event: Event) -> None:
        if self._loop is not None and self._async_q is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_q.put_nowait, event)
            except RuntimeError:  # the loop closed under us: nobody is listening any more
                self.cancel_event.set()
            # Yield the GIL: the engine thread goes straight back into MLX, which holds it while it
            # computes, so without this the event loop can wait a whole token (~100-250 ms here) to
            # forward a token. The first token gets a few ms so the loop can send it (TTFT).
            first = isinstance(event, TextDelta) and not self._first_sent
            self._first_sent = self._first_sent or first
            time.sleep(0.005 if first else 0)
        else:
            self._sync_q.put(event)
        if isinstance(event, Done):
            self.done.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._sync_q.get()
            yield event
            if isinstance(event, Done):
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        assert self._async_q is not None, "submit(..., loop=loop) for async iteration"
        while True:
            event = await self._async_q.get()
            yield event
            if isinstance(event, Done):
                return


def release_memory() -> None:
    """Hand what a closed model held back to the OS: Python's cycles, MLX's buffer cache and the C heap's free
    pages. Without it a process that switched models kept the old one's pages (RSS 171 -> 283 MB after an MLX
    model closed), and flash, which plans its budget on the RSS it finds at load, gave the next model a smaller
    context at every switch, then refused it."""
    gc.collect()
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].clear_cache()
    try:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).malloc_trim(0)  # glibc: free heap pages go back
        elif sys.platform == "darwin":
            ctypes.CDLL(None).malloc_zone_pressure_relief(None, 0)
    except (OSError, AttributeError):  # another C library (musl has no malloc_trim): nothing to hand back
        pass


class Worker:
    """Owns one Backend on one thread. `switch()` replaces it (closing the old one) on that thread."""

    def __init__(self, factory: Callable[[], Backend] | None = None, name: str = "flashcode-engine") -> None:
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._backend: Backend | None = None
        # called with each generation as it is queued (the web app: whose context the engine's cache holds)
        self.on_submit: list[Callable[[GenerationRequest], None]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if factory is not None:
            self.switch(factory)

    # ------------------------------------------------------------------ public API
    @property
    def backend(self) -> Backend | None:
        """For reading plain attributes (name, model); never call into it from another thread."""
        return self._backend

    def switch(self, factory: Callable[[], Backend]) -> Backend:
        def job(_: Backend | None) -> Backend:
            if self._backend is not None:
                self._backend.close()
                self._backend = None
            release_memory()  # also what a load that failed had taken, before the one restored after it
            self._backend = factory()
            return self._backend

        return self._call_raw(job)

    def call(self, fn: Callable[[Backend], T]) -> T:
        """Run `fn(backend)` on the worker thread and wait for its result (exceptions re-raised)."""
        return self._call_raw(lambda b: fn(self._require(b)))

    async def acall(self, fn: Callable[[Backend], T]) -> T:
        return await asyncio.wrap_future(self.queue(fn))

    def queue(self, fn: Callable[[Backend], T]) -> Future[T]:
        """Queue `fn(backend)` now, behind the jobs already queued and ahead of any queued after this returns
        (an `on_submit` hook's job runs before the generation being submitted); its result in the future."""
        fut: Future[T] = Future()
        self._jobs.put((lambda b: fn(self._require(b)), fut))
        return fut

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Generation:
        gen = Generation(request, loop)
        for hook in self.on_submit:
            hook(request)
        self._jobs.put(gen)
        return gen

    def close(self, timeout: float = 10.0) -> None:
        def job(_: Backend | None) -> None:
            if self._backend is not None:
                self._backend.close()
                self._backend = None

        if self._thread.is_alive():
            try:
                self._call_raw(job, timeout=timeout)
            finally:
                self._jobs.put(_STOP)
                self._thread.join(timeout)

    # ------------------------------------------------------------------ internals
    def _require(self, backend: Backend | None) -> Backend:
        if backend is None:
            raise EngineError("no backend is loaded: pick a model first")
        return backend

    def _call_raw(self, fn: Callable[[Backend | None], T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            return fn(self._backend)
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut.result(timeout)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX's per-thread state (streams, random key) freed here, on this thread, while Python runs:
            # left to C++ thread-exit destructors it aborts the process when close() is followed by exit
            cpu_fast.end_thread()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            if isinstance(job, Generation):
                self._generate(job)
                continue
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self._backend))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _generate(self, gen: Generation) -> None:
        if gen.cancel_event.is_set():
            gen._put(Done(GenerationStats(), "cancelled"))
            return
        try:
            backend = self._require(self._backend)
            with listening(gen._put):  # what a backend `emit`s mid-call (MLX's prefill progress)
                for event in backend.stream(gen.request, gen.cancel_event):
                    gen._put(event)
                    if isinstance(event, Done):
                        return
            gen._put(Done(GenerationStats(), "error", error="the engine ended the stream without a result"))
        except EngineError as exc:
            gen._put(Done(GenerationStats(), "error", error=str(exc)))
        except Exception as exc:  # noqa: BLE001 - an engine bug must not kill the worker thread
            log.exception("generation failed")
            gen._put(Done(GenerationStats(), "error", error=f"{type(exc).__name__}: {exc}"))
