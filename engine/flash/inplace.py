"""Units read where the model's own safetensors shards hold them: a split that copies no weights.

What it knows: an in-place split (split.py, `layout: "in_place"`) lays its units out in a *virtual*
units.bin — the same offsets, lengths, tensor positions and checksums a copied split would have — and
maps every virtual byte range to where it lies in the shards (`extents`: virtual start, length, file,
file offset). `InPlaceReader` is a `UnitReader` for that address space: a read of a virtual range is
cut as `UnitReader` cuts one (a few large parts, all in flight at once) and each part's physical ranges
are read with direct I/O straight into the destination (the aligned bulk of a range in one preadv, moved
the few bytes its shard offset is off by; only unaligned heads and tails, and small ranges, go through a
small per-thread bounce buffer). The engine (dense.py, moe.py) cannot tell the two layouts apart; the
model needs its own size on disk, not twice, and reads it as fast (bench/flash_reader.py).

What it does not know: what the bytes mean, or which unit comes next.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .reader import (
    DIO,
    AlignedBuffer,
    ReadQueue,
    ReadStats,
    UnitReader,
    buffer_address,
    join_reads,
    open_direct,
    started_clock,
)
from .split import ALIGN

READ_CHUNK = 4 << 20  # as UnitReader: one preadv takes at least this much, or a thread's share of the read
SCRATCH_CHUNK = 16 * DIO  # a thread's bounce buffer: heads and tails of ranges, and small ranges whole
MIN_DIRECT = 4 * DIO  # a range read straight into the destination: at least this many aligned bytes of it


def scratch_bytes(threads: int, chunk: int = SCRATCH_CHUNK) -> int:
    """Memory the reader's scratch buffers take (for the budget): one per reader thread (guesses share them)."""
    return threads * (chunk + 2 * ALIGN)


class InPlaceReader:
    """`UnitReader`'s interface (read / stats / direct / close) over the extents of an in-place split.

    A read is cut as `UnitReader` cuts one (`threads` parts of at least `chunk` bytes, all in flight at once)
    and each part's physical ranges are read by one thread, straight into the destination: the aligned bulk of
    a range with one large preadv, then moved by the few bytes (< 4 KiB) its shard offset and its place in the
    destination differ by (a memmove that releases the GIL); only the unaligned head and tail of a range, and
    ranges too small to be worth it, go through the thread's small bounce buffer."""

    def __init__(self, files: list[Path], extents: list[list[int]], threads: int = 4,
                 chunk: int = READ_CHUNK, direct: bool = True, scratch: int = SCRATCH_CHUNK) -> None:  # fmt: skip
        self.path = files[0]
        opened = [open_direct(f, direct) for f in files]
        self.fds = [fd for fd, _ in opened]
        self.direct = all(d for _, d in opened)
        self.extents = sorted((int(v), int(n), int(fi), int(fo)) for v, n, fi, fo in extents)
        self.starts = [e[0] for e in self.extents]
        self.threads, self.chunk = threads, max(ALIGN, chunk // ALIGN * ALIGN)
        self.scratch = max(2 * DIO, scratch // DIO * DIO)
        self.queue = ReadQueue(threads)
        self.stats = ReadStats()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._scratch: list[AlignedBuffer] = []

    def _buffer(self) -> AlignedBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = AlignedBuffer(self.scratch)
            with self._lock:
                self._scratch.append(buf)
        return buf

    def _pread(self, fi: int, view: memoryview, pos: int, need: int) -> int:
        """preadv into `view` from file `fi` at `pos` until at least `need` bytes are in; returns the bytes read."""
        got = 0
        while got < need:
            k = os.preadv(self.fds[fi], [view[got:]], pos + got)
            if k == 0:
                raise OSError(f"file {fi} of the split ends at {pos + got}, inside a unit")
            got += k
        return got

    def _bounce(self, dest: memoryview, at: int, fi: int, fpos: int, n: int) -> int:
        """File `fi` [fpos, fpos + n) -> dest[at : at + n] through the bounce buffer (aligned reads around it)."""
        scratch = self._buffer().view
        done = read = 0
        while done < n:
            start = (fpos + done) // DIO * DIO
            shift = fpos + done - start
            m = min(n - done, self.scratch - shift)
            read += self._pread(fi, scratch[: -(-(shift + m) // DIO) * DIO], start, shift + m)
            dest[at + done : at + done + m] = scratch[shift : shift + m]
            done += m
        return read

    def _range(
        self, dest: memoryview, base: int, at: int, fi: int, fpos: int, n: int, lo: int, hi: int
    ) -> int:
        """File `fi` [fpos, fpos + n) -> dest[at : at + n] (`base`: dest's address); returns bytes read.
        [lo, hi) (around the range, may start before dest): bytes no other range of the read lands in, where
        the bulk read may spill to take in the head or tail too."""
        if not self.direct:  # the page cache: no alignment to keep
            return self._pread(fi, dest[at : at + n], fpos, n)
        f0 = -(-fpos // DIO) * DIO  # the first aligned shard offset in the range ...
        t0 = at + (f0 - fpos)  # ... belongs here in dest
        p = t0 + (-(base + t0) % DIO)  # the first aligned address at or after it: read the bulk there
        bulk = min(fpos + n - f0, at + n - p) // DIO * DIO
        if bulk < MIN_DIRECT:
            return self._bounce(dest, at, fi, fpos, n)
        start, end = f0, f0 + bulk  # the shard bytes read straight in
        if p == t0:  # in place (a rebased buffer's largest range): spill into the free bytes around it
            if f0 > fpos and t0 - DIO >= lo:
                start -= DIO
            if end < fpos + n and t0 + bulk + DIO <= hi:
                end += DIO
        addr = base + p - (f0 - start)
        read = self._pread(fi, memoryview((ctypes.c_char * (end - start)).from_address(addr)).cast("B"), start,
                           min(end, fpos + n) - start)  # fmt: skip
        if p != t0:  # then move it the few bytes back to where it belongs
            ctypes.memmove(base + t0, base + p, bulk)
        if start > fpos:  # head: before the bulk (never written by it)
            read += self._bounce(dest, at, fi, fpos, f0 - fpos)
        if end < fpos + n:  # tail: after the moved bulk (the bulk read may have spilled into it)
            read += self._bounce(dest, t0 + bulk, fi, f0 + bulk, at + n - t0 - bulk)
        return read

    def _part(self, dest: memoryview, base: int, ranges: list[tuple[int, int, int, int, int, int]]) -> int:
        return sum(self._range(dest, base, at, fi, fo, n, lo, hi) for fi, fo, n, at, lo, hi in ranges)

    def ranges(self, offset: int, length: int) -> list[tuple[int, int, int, int]]:
        """(file, file offset, bytes, offset in the read) for the virtual range [offset, offset + length)."""
        out = []
        end = offset + length
        k = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while k < len(self.extents) and self.extents[k][0] < end:
            v, n, fi, fo = self.extents[k]
            lo, hi = max(v, offset), min(v + n, end)
            if lo < hi:
                out.append((fi, fo + (lo - v), hi - lo, lo - offset))
            k += 1
        return out

    def read(self, buf: Any, offset: int, length: int, chunk: int | None = None,
             speculative: bool = False) -> Future[float]:  # fmt: skip
        """As `UnitReader.read`: bytes [offset, offset + length) of the virtual units.bin into `buf`, in
        `threads` parts of at least `chunk` bytes (a part: the physical ranges under its virtual bytes). An
        `AlignedBuffer` is rebased first so that its largest range can be read straight in."""
        length = -(-length // ALIGN) * ALIGN
        if length > buf.size:
            raise ValueError(f"read of {length} bytes does not fit a {buf.size}-byte buffer")
        chunk = self.chunk if chunk is None else max(ALIGN, chunk // ALIGN * ALIGN)
        step = max(chunk, -(-length // self.threads // ALIGN) * ALIGN)
        t0 = time.perf_counter()
        ranges = self.ranges(offset, length)
        if ranges and self.direct and isinstance(buf, AlignedBuffer):
            _, fo, _, at = max(ranges, key=lambda r: r[2])
            buf.rebase((fo - at) % DIO)
        view = buf.view
        base = buffer_address(view)
        first = -base % DIO  # parts are cut where the destination is on a page: no head or tail there
        cut: list[tuple[int, int, int, int, int]] = []  # (part, file, file offset, bytes, offset in the read)
        for fi, fo, n, at in ranges:
            while n:
                k = max(0, (at - first) // step)
                m = min(n, first + (k + 1) * step - at)
                cut.append((k, fi, fo, m, at))
                fo, n, at = fo + m, n - m, at + m
        cut.sort(key=lambda c: c[4])
        # the bytes free around each range: up to its neighbours, or the buffer's ends (an AlignedBuffer's
        # slack page too: the memory before a rebased view's start and after its end)
        lows = [-buf.shift if isinstance(buf, AlignedBuffer) else 0] + [c[4] + c[3] for c in cut[:-1]]
        highs = [c[4] for c in cut[1:]] + [
            buf.size + DIO - buf.shift if isinstance(buf, AlignedBuffer) else length
        ]
        parts_of: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
        for (k, fi, fo, m, at), lo, hi in zip(cut, lows, highs, strict=False):  # cut may be empty
            parts_of.setdefault(k, []).append((fi, fo, m, at, lo, hi))
        started = [] if speculative else None
        run = started_clock(self._part, started) if started is not None else self._part
        parts = [self.queue.submit(run, view, base, rs, speculative=speculative) for rs in parts_of.values()]
        return join_reads(parts, t0, self._lock, self.stats, started=started)

    promote = UnitReader.promote
    drop = UnitReader.drop

    def close(self) -> None:
        self.queue.close()
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
