"""Direct-I/O reads of whole units into preallocated, aligned, reused buffers.

What it knows: `os.preadv` from a small thread pool (the syscall releases the GIL, so reads run
while MLX computes), O_DIRECT on Linux / F_NOCACHE on macOS so streamed weights neither fill nor
lean on the page cache, and counting bytes and latency. No mmap: a cold weight is never a page
fault. What it does not know: what the bytes mean (dense.py) or which unit comes next.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .split import ALIGN

log = logging.getLogger(__name__)


def open_direct(path: Path, direct: bool = True) -> tuple[int, bool]:
    """(fd, direct?) — falls back to buffered reads, with a log line, where the filesystem refuses.
    `direct=False` reads through the page cache on purpose (measured: docs/flash-moe.md)."""
    flags = os.O_RDONLY
    if not direct:
        return os.open(path, flags), False
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as exc:
            log.warning("O_DIRECT refused for %s (%s, e.g. tmpfs): reading through the page cache", path, exc)
            return os.open(path, flags), False
    fd = os.open(path, flags)
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, 48, 1)  # F_NOCACHE
        return fd, True
    return fd, False


def buffer_address(view: memoryview) -> int:
    """Where a writable buffer's first byte is (the ctypes object holding the export is dropped at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


DIO = 4096  # direct I/O's granularity: file offsets, lengths and memory addresses (sectors are <= 4 KiB)


class AlignedBuffer:
    """Page-aligned anonymous memory (what O_DIRECT needs), allocated once and reused.

    `view` (`size` bytes) starts on a page unless a reader `rebase`s it: an in-place split's units lie in
    their shards at offsets that are off a page by the same few bytes (the safetensors header's length), so
    `InPlaceReader` starts the view that far into the page and reads straight into it (inplace.py). Take
    `view` after the read has finished; it is one page longer than `size` for that."""

    def __init__(self, size: int) -> None:
        self.size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        self._map = mmap.mmap(-1, self.size + DIO)
        self.shift = 0
        self.view = memoryview(self._map)[: self.size]

    def rebase(self, shift: int) -> None:
        """Start `view` `shift` (0 <= shift < DIO) bytes into the first page."""
        if shift != self.shift:
            self.view = memoryview(self._map)[shift : shift + self.size]
            self.shift = shift

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a view is still held (e.g. by a traceback's frames): unmapped when it goes
            log.debug("staging still viewed at close; it is unmapped once the last view goes")


@dataclass
class ReadStats:
    bytes: int = 0
    reads: int = 0  # unit reads
    read_s: float = 0.0  # summed wall time of unit reads (submit -> last byte)
    max_latency_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "bytes_read": self.bytes,
            "unit_reads": self.reads,
            "read_s": round(self.read_s, 4),
            "read_bandwidth_Bps": self.bytes / self.read_s if self.read_s else 0.0,
            "mean_read_latency_ms": 1000 * self.read_s / self.reads if self.reads else 0.0,
            "max_read_latency_ms": 1000 * self.max_latency_s,
        }


_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class _Queues:
    """What a `ReadQueue`'s threads share (not the queue itself: a reader dropped without close() is collected,
    and its finalizer stops them)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.needed: deque[_Task] = deque()
        self.guesses: deque[_Task] = deque()
        self.closed = False

    def stop(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()


def _work(q: _Queues) -> None:
    """A reader thread: needed reads first, then guesses; after stop(), what is queued, then it ends."""
    while True:
        with q.cv:
            while not q.needed and not q.guesses and not q.closed:
                q.cv.wait()
            if q.needed:
                fut, fn, args = q.needed.popleft()
            elif q.guesses:
                fut, fn, args = q.guesses.popleft()
            else:  # stopped, and every queued read has run
                return
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the read
            fut.set_exception(exc)
        else:
            fut.set_result(result)


class ReadQueue:
    """The reader's threads and their two queues. A read the compute waits for goes first; a guess (a
    speculative read) runs only while none of those is waiting, so it takes the disk's idle time and never
    its bandwidth from a needed read for longer than one part in flight. A guess not started yet can be
    promoted (the router picked it: it is needed now) or dropped (it did not: the bytes are not read)."""

    def __init__(self, threads: int, name: str = "flash-read") -> None:
        self._q = _Queues()
        self._threads = [
            threading.Thread(target=_work, args=(self._q,), name=f"{name}-{n}", daemon=True)
            for n in range(threads)
        ]
        for t in self._threads:
            t.start()
        weakref.finalize(self, self._q.stop)  # a reader never closed does not keep its threads

    def submit(self, fn: Callable[..., Any], *args: Any, speculative: bool = False) -> Future[Any]:
        fut: Future[Any] = Future()
        q = self._q
        with q.cv:
            if q.closed:
                raise RuntimeError("the reader is closed")
            (q.guesses if speculative else q.needed).append((fut, fn, args))
            q.cv.notify()
        return fut

    def _take(self, parts: Iterable[Future[Any]]) -> list[_Task]:
        """Remove `parts` still waiting in the guess queue (under the lock); return them."""
        ids = {id(p) for p in parts}
        q = self._q
        taken = [t for t in q.guesses if id(t[0]) in ids]
        if taken:
            q.guesses = deque(t for t in q.guesses if id(t[0]) not in ids)
        return taken

    def promote(self, parts: Iterable[Future[Any]]) -> None:
        """Guessed parts not started yet are needed now: they join the needed reads' queue."""
        with self._q.cv:
            taken = self._take(parts)
            self._q.needed.extend(taken)
            self._q.cv.notify(len(taken))

    def drop(self, parts: Iterable[Future[Any]]) -> None:
        """Guessed parts not started yet are not needed: cancelled, never read."""
        with self._q.cv:
            taken = self._take(parts)
        for fut, _, _ in taken:
            fut.cancel()

    def close(self) -> None:
        """Run what is queued, then stop the threads."""
        self._q.stop()
        for t in self._threads:
            t.join()


class UnitReader:
    """Reads [offset, offset+length) of one file into a buffer, split across `threads` preadv calls."""

    def __init__(self, path: Path, threads: int = 4, chunk: int = 4 << 20, direct: bool = True) -> None:
        self.path = Path(path)
        self.fd, self.direct = open_direct(self.path, direct)
        self.threads = threads
        self.chunk = max(ALIGN, chunk // ALIGN * ALIGN)
        self.queue = ReadQueue(threads)
        self.stats = ReadStats()
        self._lock = threading.Lock()

    def _pread(self, buf: memoryview, offset: int) -> int:
        got = 0
        while got < len(buf):
            n = os.preadv(self.fd, [buf[got:]], offset + got)
            if n == 0:
                raise OSError(f"{self.path}: unexpected end of file at {offset + got}")
            got += n
        return got

    def read(
        self,
        buf: AlignedBuffer,
        offset: int,
        length: int,
        chunk: int | None = None,
        speculative: bool = False,
    ) -> Future[float]:
        """Start reading; the future's result is the read's wall time. `length` is rounded up to ALIGN.
        `chunk`: the most bytes one preadv takes (a smaller one spreads a single unit over more threads,
        deepening the disk queue when few units are in flight). `speculative`: a guess, read only while no
        needed read waits (`ReadQueue`); `promote` or `drop` it once it is known to be needed or not."""
        length = -(-length // ALIGN) * ALIGN
        if length > buf.size:
            raise ValueError(f"read of {length} bytes does not fit a {buf.size}-byte buffer")
        chunk = self.chunk if chunk is None else max(ALIGN, chunk // ALIGN * ALIGN)
        step = max(chunk, -(-length // self.threads // ALIGN) * ALIGN)
        if isinstance(buf, AlignedBuffer):
            buf.rebase(0)  # units.bin's units start on a page: so does the data
        t0, started = time.perf_counter(), [] if speculative else None
        run = started_clock(self._pread, started) if started is not None else self._pread
        parts = [
            self.queue.submit(run, buf.view[s : min(s + step, length)], offset + s, speculative=speculative)
            for s in range(0, length, step)
        ]
        return join_reads(parts, t0, self._lock, self.stats, length, started)

    def promote(self, reads: Iterable[Future[float]]) -> None:
        """Guessed reads are needed now: their parts not started yet go ahead of the other guesses."""
        self.queue.promote([p for r in reads for p in getattr(r, "parts", ())])

    def drop(self, reads: Iterable[Future[float]]) -> None:
        """Guessed reads are not needed: their parts not started yet are never read (each read ends cancelled)."""
        self.queue.drop([p for r in reads for p in getattr(r, "parts", ())])

    def close(self) -> None:
        self.queue.close()
        os.close(self.fd)


def when_landed(
    read: Future[float],
    view: memoryview,
    put: Callable[[memoryview], None],
    out: Future[None] | None = None,
    after: Callable[[], None] | None = None,
) -> Future[None]:
    """Once `read` lands in `view`, `put(view)` runs on the reader thread that finished it, then `after()` (whatever
    happened); `out` (made if None) is done last, with the read's or put's error if either failed.
    The view is handed over once: a done future keeps its callbacks (and the reader's futures form reference
    cycles), and a view still held when the staging closes would keep it from being unmapped."""
    done: Future[None] = Future() if out is None else out
    held = [view]

    def landed(f: Future[float]) -> None:
        mine = held.pop()
        error: BaseException | None = None
        try:
            f.result()
            put(mine)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            error = exc
        finally:
            del mine
            try:
                if after is not None:
                    after()
            finally:
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(None)

    read.add_done_callback(landed)
    return done


def started_clock(fn: Callable[..., Any], started: list[float]) -> Callable[..., Any]:
    """`fn`, noting in `started` when the first part of a read began: a guess waits in its queue until the
    disk is free, and that wait is not the read's latency."""

    def run(*args: Any) -> Any:
        if not started:
            started.append(time.perf_counter())
        return fn(*args)

    return run


def join_reads(
    parts: list[Future[int]],
    t0: float,
    lock: threading.Lock,
    stats: ReadStats,
    nbytes: int | None = None,
    started: list[float] | None = None,
) -> Future[float]:
    """One future for a read cut into `parts` (each a pread's byte count): its result is the read's wall
    time from `t0` (or from its first part's start, noted in `started`), or the first part's error
    (CancelledError: a guess dropped before all of it was read). When the last part ends, `stats` (under
    `lock`) counts one read of `nbytes` (None: the bytes the parts read); a dropped guess counts only the
    bytes its parts read. The future keeps its `parts` (for `ReadQueue.promote` and `drop`)."""
    done: Future[float] = Future()
    done.parts = parts  # type: ignore[attr-defined]
    if not parts:
        done.set_result(0.0)
        return done
    left = [len(parts)]

    def error(p: Future[int]) -> BaseException | None:
        return CancelledError() if p.cancelled() else p.exception()

    def finished(f: Future[int]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
            if last:
                dt = time.perf_counter() - (started[0] if started else t0)
                ok = sum(p.result() for p in parts if error(p) is None)
                if any(p.cancelled() for p in parts):  # a dropped guess: its bytes, not a read's time
                    stats.bytes += ok
                else:
                    stats.bytes += ok if nbytes is None else nbytes
                    stats.reads += 1
                    stats.read_s += dt
                    stats.max_latency_s = max(stats.max_latency_s, dt)
        if not last or done.done():
            return
        errors = [e for p in parts if (e := error(p)) is not None]
        if errors:
            done.set_exception(errors[0])
        else:
            done.set_result(dt)

    for p in parts:
        p.add_done_callback(finished)
    return done


def measure_bandwidth(
    path: Path, unit_bytes: int, total: int = 1 << 30, threads: int = 4, depth: int = 2
) -> dict[str, float]:
    """Direct-read bandwidth for `unit_bytes`-sized reads over (up to) `total` bytes of `path`, with
    `depth` reads in flight: the engine's read-ahead keeps two units in flight, so measure the same."""
    size = os.path.getsize(path)
    unit = max(ALIGN, min(unit_bytes, size) // ALIGN * ALIGN)
    reader = UnitReader(path, threads=threads)
    bufs = [AlignedBuffer(unit) for _ in range(max(1, depth))]
    try:
        n = max(1, min(total, size) // unit)
        pending: list[Any] = []
        t0 = time.perf_counter()
        for i in range(n):
            if len(pending) == len(bufs):
                pending.pop(0).result()
            pending.append(
                reader.read(bufs[i % len(bufs)], (i * unit) % (size - unit + 1) // ALIGN * ALIGN, unit)
            )
        for fut in pending:
            fut.result()
        dt = time.perf_counter() - t0
        return {
            "bandwidth_Bps": n * unit / dt,
            "unit_bytes": unit,
            "reads": n,
            "direct": reader.direct,
            "depth": len(bufs),
        }
    finally:
        reader.close()
        for b in bufs:
            b.close()
