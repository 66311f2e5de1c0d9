"""The predict pass (opt-in, exact): know a token's expert misses before its routers run, and read them at once.

Without it a decode token's misses are found one layer at a time: layer i's router runs, its choice is read
back, its misses are read, and only then can layer i+1 start. The disk sees a shallow queue (skewed routing
misses ~0.35 experts a layer), and no compute overlaps a read: the serial bound (reads + compute) is all a
token can reach.

The predict pass runs the token once first, as one graph, on the experts already resident: each MoE layer
looks its router's ids up in a device-side id-to-slot table, and a missing expert adds nothing (its output
is masked to zero). One host sync at its end reads every layer's choice back. Those choices are the
predictions: each layer's predicted experts are made resident in the cache (`ExpertCache.access`, not
counted as hits or misses), and the misses among them are read in layer order into a pool of pinned
staging units, each copied into its bank slot as it lands (a freed unit takes the next read). The KV
cache's offset is rolled back, and the exact pass runs as before: each layer waits only for its own
predicted reads, then reads whatever the prediction missed.

Exact: the exact pass is unchanged. A wrong prediction costs disk time and may evict an expert that is
needed (read again); the tokens are those of RAM. The hit rate a run reports is still the exact pass's: an
expert read this token on a prediction counts as a miss when the exact pass uses it.

Cost: one more pass over the resident weights per token (on a GPU a decode token in memory is ~16 ms for
the 48-layer MoE headline), paid to turn ~50 ms of one-at-a-time reads into one deep queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np

from .reader import AlignedBuffer, buffer_address, when_landed


class Predictor:
    """The predict pass's state for one `ExpertStream` (`stream`): the pool, the queue of predicted reads, and
    which layers are still waited for. The compute thread calls `begin`, `layer` (per MoE layer, inside the
    pass), `finish`, then `wait_layer` from each layer's `ensure`; reader threads land the reads."""

    def __init__(self, stream: Any, units: int) -> None:
        if units < 1:
            raise ValueError(f"the predict pass needs at least one staging unit, not {units}")
        if stream.pf_k:
            raise ValueError("--expert-predict and --expert-prefetch read ahead two ways: choose one")
        self.stream, self.units = stream, units
        self.check_path()
        self.staging = AlignedBuffer(units * stream.unit_bytes)
        if stream.copier is not None:
            stream.copier.register(buffer_address(self.staging.view), self.staging.size)
        self.active = False  # inside the pass: MoE layers compute on resident experts only
        self.table: Any = None  # (layers, experts) int32 device array: slot, or -1 when not resident
        self.ops: list[Any] = []  # each layer's router ids (lazy) in the pass
        self._lock = threading.Lock()
        self._free = list(range(units))
        self._todo: deque[tuple[int, int, int, Future[None]]] = deque()  # (layer index, expert, slot, done)
        self._urgent = -1  # the layer the compute waits on: its reads go ahead of guesses
        self.pending: dict[int, list[tuple[int, Future[None]]]] = {}  # layer index -> [(expert, done)]
        self.read_now: list[set[int]] = [set() for _ in stream.layers]  # read on a prediction this token
        # (layer index, expert) -> its read, from its issue until it has landed (for `promote`)
        self.reads: dict[tuple[int, int], Future[float]] = {}
        self.predicted = 0  # experts read on a prediction
        self.used = 0  # of which the exact pass used
        self.passes = 0
        self.skipped = 0  # decode steps the pass could not run (predict_pass)

    def check_path(self) -> None:
        """Reader threads write predicted experts straight into bank memory: the CPU's numpy views, or CUDA's
        copier on the `direct` path (the other device paths replace the bank arrays as they update them, so the
        copier's addresses would go stale)."""
        st = self.stream
        if st.copier is not None and st.pipeline != "direct":
            raise ValueError(f"--expert-predict needs the direct device path, not --pipeline {st.pipeline}")
        if not st.host_writes and st.copier is None:
            raise ValueError(
                "--expert-predict needs direct bank writes: the CPU's, or CUDA's copier (libcuda), which this "
                "process does not have (on Metal it is not built; on CUDA the log says why the copier is off): "
                "leave --expert-predict off here"
            )

    # ------------------------------------------------------------------ the pass (compute thread)
    def begin(self) -> None:
        """Before the pass: every earlier predicted read settled; the resident experts' table on the device."""
        import mlx.core as mx

        self.check_path()
        self.settle()
        st = self.stream
        table = np.full((len(st.layers), st.n_experts), -1, dtype=np.int32)
        for i, pol in enumerate(st.cache.layers):
            if pol.slot:
                table[i, list(pol.slot)] = list(pol.slot.values())
        self.table = mx.array(table)
        self.ops = [None] * len(st.layers)
        self.active = True

    def layer(self, glu: Any, x: Any, indices: Any) -> Any:
        """A MoE layer inside the pass: its router's ids kept (lazy), its output from resident experts only."""
        import mlx.core as mx

        self.ops[glu.index] = indices
        slots = self.table[glu.index][indices]
        y = glu._glu(x, mx.maximum(slots, 0).astype(mx.uint32), indices.shape)
        return mx.where((slots >= 0)[..., None], y, mx.zeros_like(y))  # (not y * mask: slot 0 may hold inf)

    def finish(self) -> int:
        """After the pass: its one host sync (every layer's choice), then the predicted misses' reads start, in
        layer order. Returns how many were issued or queued."""
        import mlx.core as mx

        self.active = False
        ops, self.ops, self.table = self.ops, [], None
        if any(o is None for o in ops):  # a layer the pass did not reach: nothing to predict from
            return 0
        picks = np.array(mx.concatenate([o.reshape(1, -1) for o in ops]))  # one readback for every layer
        st = self.stream
        self.passes += 1
        todo = []
        for i, row in enumerate(picks):
            ids = np.unique(row)
            if len(ids) > st.cache.slots:
                continue
            res = st.cache.access(i, ids.tolist(), count=False)
            st.slot_of[i, [k for k, _, _ in res]] = [s for _, s, _ in res]
            misses = [(k, s) for k, s, hit in res if not hit]
            self.read_now[i] = {k for k, _ in misses}
            for k, s in misses:
                done: Future[None] = Future()
                self.pending.setdefault(i, []).append((k, done))
                todo.append((i, k, s, done))
        self.predicted += len(todo)
        st.stats.experts_read += len(todo)
        with self._lock:
            self._urgent = -1
            self._todo.extend(todo)
        self._pump()
        return len(todo)

    # ------------------------------------------------------------------ the reads (any thread)
    def _pump(self) -> None:
        """Start queued reads while pool units are free (a unit is free once its copy has finished)."""
        while True:
            with self._lock:
                if not self._free or not self._todo:
                    return
                pos, item = self._free.pop(), self._todo.popleft()
                urgent = item[0] <= self._urgent
            self._issue(pos, item, speculative=not urgent)

    def _issue(self, pos: int, item: tuple[int, int, int, Future[None]], speculative: bool) -> None:
        st = self.stream
        i, k, s, done = item
        ub = st.unit_bytes
        u = st.units[st.layers[i]][k]
        view = self.staging.view[pos * ub : (pos + 1) * ub]
        try:  # a guess: runs while no read the compute waits for is queued
            read = st.reader.read(SimpleNamespace(size=ub, view=view), u.offset, u.length, st.read_chunk,
                                  speculative=speculative)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - the reader is closed: handed to whoever waits
            self._release(pos)
            done.set_exception(exc)
            return
        with self._lock:
            self.reads[(i, k)] = read
            late = speculative and i <= self._urgent  # the compute came to this layer while it was issued
        if late and hasattr(st.reader, "promote"):
            st.reader.promote([read])

        def after() -> None:
            with self._lock:
                self.reads.pop((i, k), None)
            self._release(pos)

        when_landed(read, view, lambda mine: st.store(i, k, s, mine), done, after)

    def _release(self, pos: int) -> None:
        with self._lock:
            self._free.append(pos)
        self._pump()

    # ------------------------------------------------------------------ the exact pass (compute thread)
    def wait_layer(self, i: int) -> set[int]:
        """Before layer index `i`'s cache access: its predicted reads are in its bank (they were given slots the
        exact pass may reuse). Returns the experts read on a prediction for it this token (a failed one is
        forgotten by the cache, so the exact pass reads it again if it needs it)."""
        mine = self.pending.get(i, [])
        failed: list[int] = []
        if mine:
            with self._lock:
                self._urgent = max(self._urgent, i)
                queued = [self.reads[(i, k)] for k, _ in mine if (i, k) in self.reads]
            if queued and hasattr(self.stream.reader, "promote"):
                self.stream.reader.promote(queued)  # needed now: ahead of later layers' guesses
            t0 = time.perf_counter()
            failed = [k for k, done in mine if done.exception() is not None]
            self.stream._waited(t0)
        self.pending.pop(i, None)  # (only now: an interrupted wait leaves them for `settle`)
        read_now, self.read_now[i] = self.read_now[i], set()
        if failed:
            self.stream.cache.forget(i, failed)
            read_now -= set(failed)
        return read_now

    def settle(self) -> None:
        """Wait for every predicted read still pending (an exact pass that stopped early left them)."""
        for i in list(self.pending):
            self.wait_layer(i)

    def close(self) -> None:
        """Reads not started are not made (their experts are forgotten); those in flight are waited for."""
        with self._lock:
            dropped, self._todo = list(self._todo), deque()
        for *_, done in dropped:
            done.set_exception(RuntimeError("the expert stream closed before this predicted read started"))
        self.settle()
        if self.stream.copier is not None:
            self.stream.copier.unregister(buffer_address(self.staging.view))
        self.staging.close()


def can_roll_back(cache: list[Any]) -> bool:
    """Every layer's cache can be trimmed back by a token (mlx-lm's KVCache and QuantizedKVCache; a
    RotatingKVCache until it is full; not ArraysCache, the recurrent layers' state, nor CacheList)."""
    return all(
        hasattr(c, "is_trimmable") and c.is_trimmable() and isinstance(getattr(c, "offset", None), int)
        for c in cache
    )


def check_model(model: Any) -> None:
    """At load: refuse the predict pass for a model whose KV cache cannot be rolled back (a fresh one)."""
    from mlx_lm.models.cache import make_prompt_cache

    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if not can_roll_back([c])})
    if kinds:
        raise ValueError(
            f"--expert-predict runs each token twice and rolls the KV cache back between, which this model's "
            f"{', '.join(kinds)} cannot: leave --expert-predict off for it"
        )


def predict_pass(model: Any, predictor: Predictor, inputs: Any, cache: list[Any]) -> int:
    """Run the predict pass for a decode step: `model` on `inputs` (the token) with `cache`, then roll every
    layer's KV cache back to where it was. Returns the reads started; 0 (nothing done) for a cache that
    cannot be rolled back now (a sliding window that is full; counted in `predictor.skipped`)."""
    if not can_roll_back(cache):
        predictor.skipped += 1
        return 0
    offsets = [c.offset for c in cache]
    predictor.begin()
    try:
        model(inputs, cache=cache)
        return predictor.finish()
    finally:
        predictor.active = False
        for c, before in zip(cache, offsets, strict=True):
            if c.offset > before:
                c.trim(c.offset - before)
