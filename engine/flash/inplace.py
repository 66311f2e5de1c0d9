"""Units read where the model's own safetensors shards hold them: a split that copies no weights.

What it knows: an in-place split (split.py, `layout: "in_place"`) lays its units out in a *virtual*
units.bin — the same offsets, lengths, tensor positions and checksums a copied split would have — and
maps every virtual byte range to where it lies in the shards (`extents`: virtual start, length, file,
file offset). `InPlaceReader` is a `UnitReader` for that address space: a read of a virtual range is
split into the physical ranges under it, each read with direct I/O (aligned, through a small per-thread
scratch buffer, `chunk` bytes at most) and copied to its virtual place. The engine (dense.py, moe.py)
cannot tell the two layouts apart; the model needs its own size on disk, not twice.

What it does not know: what the bytes mean, or which unit comes next.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .reader import AlignedBuffer, ReadStats, open_direct
from .split import ALIGN

SCRATCH_CHUNK = 1 << 20  # the most one physical read takes; per I/O thread this much (+ alignment) is held


def scratch_bytes(threads: int, chunk: int = SCRATCH_CHUNK) -> int:
    """Memory the reader's scratch buffers take (for the budget): one per thread, per pool."""
    return 2 * threads * (chunk + 2 * ALIGN)


class InPlaceReader:
    """`UnitReader`'s interface (read / stats / direct / close) over the extents of an in-place split."""

    def __init__(self, files: list[Path], extents: list[list[int]], threads: int = 4,
                 chunk: int = SCRATCH_CHUNK, direct: bool = True) -> None:  # fmt: skip
        self.path = files[0]
        opened = [open_direct(f, direct) for f in files]
        self.fds = [fd for fd, _ in opened]
        self.direct = all(d for _, d in opened)
        self.extents = sorted((int(v), int(n), int(fi), int(fo)) for v, n, fi, fo in extents)
        self.starts = [e[0] for e in self.extents]
        self.threads, self.chunk = threads, max(ALIGN, chunk // ALIGN * ALIGN)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flash-read")
        self._spec: ThreadPoolExecutor | None = None
        self.stats = ReadStats()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._scratch: list[AlignedBuffer] = []

    def _buffer(self) -> AlignedBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = AlignedBuffer(self.chunk + 2 * ALIGN)
            with self._lock:
                self._scratch.append(buf)
        return buf

    def _copy(self, dest: memoryview, fi: int, fpos: int, n: int) -> int:
        """Read file `fi` [fpos, fpos + n) (aligned around it) and copy it into `dest`; returns bytes read."""
        scratch = self._buffer()
        start = fpos // ALIGN * ALIGN
        shift = fpos - start
        want = -(-(shift + n) // ALIGN) * ALIGN
        got = 0
        while got < shift + n:
            k = os.preadv(self.fds[fi], [scratch.view[got:want]], start + got)
            if k == 0:
                raise OSError(f"file {fi} of the split ends at {start + got}, inside a unit")
            got += k
        dest[:n] = scratch.view[shift : shift + n]
        return want

    def pieces(self, offset: int, length: int, chunk: int) -> list[tuple[int, int, int, int]]:
        """(file, file offset, bytes, offset in the read) for the virtual range [offset, offset + length)."""
        out = []
        end = offset + length
        k = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while k < len(self.extents) and self.extents[k][0] < end:
            v, n, fi, fo = self.extents[k]
            lo, hi = max(v, offset), min(v + n, end)
            for s in range(lo, hi, chunk):
                e = min(hi, s + chunk)
                out.append((fi, fo + (s - v), e - s, s - offset))
            k += 1
        return out

    def read(self, buf: Any, offset: int, length: int, chunk: int | None = None,
             speculative: bool = False) -> Future[float]:  # fmt: skip
        """As `UnitReader.read`: bytes [offset, offset + length) of the virtual units.bin into `buf`."""
        length = -(-length // ALIGN) * ALIGN
        if length > buf.size:
            raise ValueError(f"read of {length} bytes does not fit a {buf.size}-byte buffer")
        step = self.chunk if chunk is None else max(ALIGN, min(self.chunk, chunk // ALIGN * ALIGN))
        pool = self.pool
        if speculative:
            if self._spec is None:
                self._spec = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="flash-guess")
            pool = self._spec
        t0 = time.perf_counter()
        view = buf.view
        parts = [
            pool.submit(self._copy, view[at : at + n], fi, fo, n)
            for fi, fo, n, at in self.pieces(offset, length, step)
        ]
        done: Future[float] = Future()
        left = [len(parts)]
        if not parts:
            done.set_result(0.0)
            return done

        def finished(f: Future[int]) -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
                if last:
                    dt = time.perf_counter() - t0
                    self.stats.bytes += sum(p.result() for p in parts if p.exception() is None)
                    self.stats.reads += 1
                    self.stats.read_s += dt
                    self.stats.max_latency_s = max(self.stats.max_latency_s, dt)
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

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self._spec is not None:
            self._spec.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        for b in self._scratch:
            b.close()
        self._scratch = []


def open_reader(man: Any, threads: int = 4, direct: bool = True) -> Any:
    """The reader for a split: `InPlaceReader` over the model's shards, or `UnitReader` over units.bin."""
    from .reader import UnitReader

    if man.in_place:
        return InPlaceReader(man.files, man.extents, threads=threads, direct=direct)
    return UnitReader(man.units_path, threads=threads, direct=direct)
