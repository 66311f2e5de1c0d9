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
from concurrent.futures import Future, ThreadPoolExecutor
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


class UnitReader:
    """Reads [offset, offset+length) of one file into a buffer, split across `threads` preadv calls."""

    def __init__(self, path: Path, threads: int = 4, chunk: int = 4 << 20, direct: bool = True) -> None:
        self.path = Path(path)
        self.fd, self.direct = open_direct(self.path, direct)
        self.threads = threads
        self.chunk = max(ALIGN, chunk // ALIGN * ALIGN)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flash-read")
        # speculative reads (guesses) get a queue of their own, made on first use
        self._spec: ThreadPoolExecutor | None = None
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
        deepening the disk queue when few units are in flight). `speculative`: a guess, read on a queue of
        its own so that reads the compute waits for never queue behind it."""
        length = -(-length // ALIGN) * ALIGN
        if length > buf.size:
            raise ValueError(f"read of {length} bytes does not fit a {buf.size}-byte buffer")
        chunk = self.chunk if chunk is None else max(ALIGN, chunk // ALIGN * ALIGN)
        step = max(chunk, -(-length // self.threads // ALIGN) * ALIGN)
        pool = self.pool
        if speculative:
            if self._spec is None:
                self._spec = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="flash-guess")
            pool = self._spec
        if isinstance(buf, AlignedBuffer):
            buf.rebase(0)  # units.bin's units start on a page: so does the data
        t0 = time.perf_counter()
        parts = [
            pool.submit(self._pread, buf.view[s : min(s + step, length)], offset + s)
            for s in range(0, length, step)
        ]
        return join_reads(parts, t0, self._lock, self.stats, length)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self._spec is not None:
            self._spec.shutdown(wait=True)
        os.close(self.fd)


def join_reads(
    parts: list[Future[int]], t0: float, lock: threading.Lock, stats: ReadStats, nbytes: int | None = None
) -> Future[float]:
    """One future for a read cut into `parts` (each a pread's byte count): its result is the read's wall
    time from `t0`, or the first part's error. When the last part ends, `stats` (under `lock`) counts one
    read of `nbytes` (None: the bytes the parts read)."""
    done: Future[float] = Future()
    if not parts:
        done.set_result(0.0)
        return done
    left = [len(parts)]

    def finished(f: Future[int]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
            if last:
                dt = time.perf_counter() - t0
                ok = sum(p.result() for p in parts if p.exception() is None)
                stats.bytes += ok if nbytes is None else nbytes
                stats.reads += 1
                stats.read_s += dt
                stats.max_latency_s = max(stats.max_latency_s, dt)
        if not last or done.done():
            return
        errors = [p.exception() for p in parts if p.exception() is not None]
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
