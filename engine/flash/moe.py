"""The MoE expert sniper: each MoE layer reads only the experts its router picks, from the split.

What it knows: mlx-lm's `SwitchGLU` contract (`switch_mlp(x, indices)` -> per-(token, k) outputs,
weighted and summed by the model's own MoE block), and how to give the very same answer from
per-expert units: the router and top-k run on the device in the model's own block; one host sync
per layer reads the chosen ids; the expert cache (experts.py) says which are resident; the misses
are read in parallel (direct I/O, a few preadv calls per expert) into a staging buffer and copied into a
fixed-shape per-layer *bank* (`slots` experts per tensor, updated in place slot by slot); an
id-to-slot remap turns the router's ids into bank indices for `mx.gather_qmm`. No per-token
stacking. A prefill chunk reads each distinct expert once (in groups of at most `slots` when the
chunk needs more experts than a layer's bank holds; each (token, k) output comes from exactly one
group, so the result is unchanged).

Opt-in, off by default: `prefetch_next` (exact: layer i guesses layer i+1's experts with layer i+1's
router on its own input and starts reading the uncached guesses while it computes; a guess enters
the bank only if the router then picks it); `top_k` (lossy: fewer active experts per token).

What it does not know: budgets (backend.py sizes the cache), tokenization, attention.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..cpu_fast import cpu_streams, cuts
from .devcopy import BankCopier, address_of, open_device_copier
from .experts import ExpertCache
from .predict import Predictor, check_model
from .reader import AlignedBuffer, UnitReader, buffer_address, when_landed
from .safetensors_io import DTYPE_SIZES
from .split import ALIGN, Manifest, Unit, UnitTensor, check_unit, first_layer

_NP = {
    "U32": np.uint32,
    "U8": np.uint8,
    "F16": np.float16,
    "F32": np.float32,
    "BF16": np.uint16,
    "I32": np.int32,
}
PROJS = ("gate_proj", "up_proj", "down_proj")


_NO_STREAM = contextlib.nullcontext()


def expert_units(man: Manifest) -> dict[int, list[Unit]]:
    """layer -> its expert units indexed by expert id."""
    by_layer: dict[int, dict[int, Unit]] = {}
    for u in man.units:
        if u.kind == "expert" and u.expert is not None:
            by_layer.setdefault(u.layer, {})[u.expert] = u
    return {layer: [d[e] for e in range(len(d))] for layer, d in sorted(by_layer.items())}


def bank_dtype(dtype: str) -> str:
    """How a unit tensor sits in the bank: float16/bfloat16 scales and biases become float32 on the CPU,
    where `gather_qmm` runs ~1.5x faster with float32 ones (what the in-RAM model holds; same results)."""
    import mlx.core as mx

    return "F32" if dtype in ("F16", "BF16") and mx.default_device() == mx.cpu else dtype


def resident_expert_bytes(units: dict[int, list[Unit]]) -> int:
    """Bytes one expert takes in a bank (the cache's unit of account)."""
    return max(sum(t.nbytes // DTYPE_SIZES[t.dtype] * DTYPE_SIZES[bank_dtype(t.dtype)] for t in u.tensors)
               for us in units.values() for u in us)  # fmt: skip


def _mx_dtype(dtype: str) -> Any:
    import mlx.core as mx

    return {"U32": mx.uint32, "U8": mx.uint8, "F16": mx.float16, "F32": mx.float32, "BF16": mx.bfloat16,
            "I32": mx.int32}[dtype]  # fmt: skip


@dataclass
class MoEStats:
    calls: int = 0
    host_syncs: int = 0
    experts_read: int = 0
    read_wait_s: float = 0.0  # time the compute thread waited on reads
    prefetched: int = 0  # experts read ahead on a guess (opt-in)
    prefetch_used: int = 0  # of which the router then picked
    trace: list[tuple[int, list[int]]] = field(default_factory=list)  # (layer, distinct ids) when recording


PROFILE_PARTS = (
    "wait_input",
    "router",
    "cache",
    "issue",
    "read_wait",
    "h2d",
    "bank",
    "compute",
    "prefetch",
    "h2d_async",
    "predict",
)


@dataclass
class MoEProfile:
    """Where the MoE layers' time goes, in seconds summed over calls. Always counted on the host (a few
    `perf_counter` calls per layer); with `ExpertStream.profile` on, each part that queues device work is
    also evaluated on the spot (extra syncs), so device time lands in the part that caused it — a profiled
    run is slower than a plain one; its parts say where the time goes, the plain run says how fast it is.

    wait_input: profile only, the device finishing what precedes the router (this layer's attention, the
    previous layer's experts); router: router + top-k + reading the choice back (the layer's one host sync);
    cache: ids -> slots (unique, policy, slot table); issue: starting the missed experts' reads; read_wait:
    waiting for them (`direct`: and for their copies to be queued); h2d: host-to-device copies of their bytes
    (`direct`: queued on the compute thread); bank: bank updates (profile: evaluated; `direct`: waiting for
    the copies to finish); compute: the experts' matmuls (profile: evaluated); prefetch: guessing and issuing
    speculative reads (opt-in); h2d_async: the copies made off the compute thread (`threaded`: on the copy
    thread; `direct`: queued by the reader thread whose read landed), overlapped, not compute-thread time;
    predict: the predict pass (opt-in, predict.py): its graph, its one sync, and starting its reads."""

    calls: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PROFILE_PARTS, 0.0))

    def add(self, part: str, dt: float) -> None:
        self.seconds[part] += dt

    def snapshot(self) -> dict[str, Any]:
        return {"calls": self.calls, **{k: round(v, 6) for k, v in self.seconds.items()}}


class ExpertStream:
    """Per-layer banks + the cache + parallel reads of misses. One instance serves every MoE layer.

    Device path (`host_writes` False): on CUDA `pipeline = "direct"` (default there, `use_copier`): the staging
    is page-locked and each missed expert's tensors are copied straight into its bank slot's memory (devcopy.py)
    as its read lands; the layer waits for the copies, not for any MLX op. Elsewhere `"threaded"` (default)
    chains each missed expert's read to its host-to-device copy (one `mx.array` of the expert's bytes) on a
    copy thread of its own, so copies run while later reads are in flight and while the compute thread waits;
    the compute thread then points per-tensor views of it into the expert's bank slot and starts the update at
    once (`mx.async_eval`). `"overlap"` does the same copy on the compute thread as each read lands; `"legacy"`
    is the earlier path (all reads waited for, then one copy per tensor). Both are kept to measure against.
    No host sync per miss."""

    def __init__(self, man: Manifest, reader: UnitReader, cache: ExpertCache, max_misses: int = 16,
                 verify: bool = False, record: bool = False, copier: BankCopier | None = None) -> None:  # fmt: skip
        import mlx.core as mx

        self.man, self.reader, self.cache = man, reader, cache
        self.units = expert_units(man)
        self.layers = list(self.units)  # model layer numbers that are MoE
        if len(self.layers) != cache.n_layers:
            raise ValueError(
                f"the cache has {cache.n_layers} layers but the split has {len(self.layers)} MoE layers"
            )
        self.n_experts = len(self.units[self.layers[0]])
        self.unit_bytes = max(u.padded for us in self.units.values() for u in us)
        self.max_misses = max(1, min(max_misses, cache.slots))
        self.staging = AlignedBuffer(self.max_misses * self.unit_bytes)
        self.template: dict[int, list[UnitTensor]] = {li: self.units[li][0].tensors for li in self.layers}
        self.used_bytes = {li: max(t.offset + t.nbytes for t in ts) for li, ts in self.template.items()}
        # CPU: misses are written into the banks' memory directly (numpy views); CUDA: copied into it from
        # pinned staging (`direct`, devcopy.py); elsewhere as MLX slice updates joined to the layer's graph
        self.host_writes = mx.default_device() == mx.cpu
        self.banks: list[dict[str, Any]] = []
        self._make_banks(same_dtype=copier is not None)  # on a GPU bank_dtype keeps the dtypes on disk
        if copier is None and not self.host_writes:  # after MLX has set the device up (the banks are on it)
            copier = open_device_copier()
        # CPU: writable numpy views of the banks (MLX arrays, evaluated once, never replaced on the CPU).
        # Safe: a layer's bank is written only after its router readback, which has evaluated every
        # earlier use of it (the previous token's), and grouped prefill evaluates each group first.
        self.bank_np = (
            [{k: np.array(v, copy=False) for k, v in b.items()} for b in self.banks]
            if self.host_writes and copier is None
            else []
        )
        self.slot_of = np.zeros((len(self.layers), self.n_experts), dtype=np.uint32)
        self.verified: set[tuple[int, int]] | None = set() if verify else None
        self.stats = MoEStats()
        self.record = record
        self.pipeline = "threaded"  # device path: direct, threaded, overlap or legacy (class docstring)
        self._h2d_pool: ThreadPoolExecutor | None = None  # the copy thread (made on first use)
        # one expert read spread over several preadv calls: a single miss still keeps the disk queue deep.
        # `split_by_misses`: only as far as the layer's misses leave threads idle (`_chunk`); False: every read
        # in `read_chunk` parts (None: the reader's own)
        self.read_chunk: int | None = 512 << 10
        self.split_by_misses = True
        self.prof = MoEProfile()
        self.profile = False  # True: evaluate each part on the spot (MoEProfile)
        self.pf_k = 0  # opt-in next-layer prefetch: guesses per layer (0 = off), `pf_depth` layers ahead
        self.pf_depth = 0
        self.pf: dict[int, dict[int, tuple[int, Any]]] = {}  # layer index -> expert -> (staging slot, future)
        # guess a layer only while it misses: its decode calls' misses, a moving average (0 = guess every layer).
        # A guess costs the next router's matvec and readback in this layer's sync, and a wrong one disk time;
        # a layer that seldom misses (skewed routing: ~0.35 a call) has little to hide
        self.pf_min_misses = 0.0
        self.miss_avg = np.zeros(len(self.layers))
        self.last_misses = 0
        self.copier: BankCopier | None = None
        self.slot_addr: list[dict[str, tuple[int, int]]] = []  # per layer: tensor -> (address, slot bytes)
        self.predictor: Predictor | None = None  # opt-in: the predict pass (predict.py, `enable_predict`)
        if copier is not None:
            self.use_copier(copier)

    def _make_banks(self, same_dtype: bool) -> None:
        """One bank per MoE layer: `slots` experts per tensor, in the dtype on disk (`same_dtype`: what a
        byte copy needs) or in `bank_dtype`'s."""
        import mlx.core as mx

        self.banks = []
        for li in self.layers:
            bank = {
                t.name: mx.zeros((self.cache.slots, *t.shape),
                                 dtype=_mx_dtype(t.dtype if same_dtype else bank_dtype(t.dtype)))
                for t in self.template[li]
            }  # fmt: skip
            mx.eval(list(bank.values()))
            self.banks.append(bank)

    def use_copier(self, copier: BankCopier) -> None:
        """The `direct` device path: a missed expert's bytes go from its (pinned) staging straight into its bank
        slot, tensor by tensor (`copier`, devcopy.py), as its read lands; no MLX op, no new array, no page
        migration. Before any expert is loaded: banks not in the dtypes on disk are made again in them."""
        if self.cache.used_bytes:
            raise RuntimeError("use_copier must come before the first expert is loaded")
        on_disk = {li: {t.name: _mx_dtype(t.dtype) for t in ts} for li, ts in self.template.items()}
        if any(
            a.dtype != on_disk[li][n]
            for li, b in zip(self.layers, self.banks, strict=True)
            for n, a in b.items()
        ):
            self._make_banks(same_dtype=True)  # the CPU's float32 scales (tests of the device path)
        self.copier, self.host_writes, self.pipeline, self.bank_np = copier, False, "direct", []
        self.slot_addr = [
            {name: (address_of(arr), arr.nbytes // arr.shape[0]) for name, arr in bank.items()}
            for bank in self.banks
        ]
        copier.register(buffer_address(self.staging.view), self.staging.size)
        if self.pf_k:
            copier.register(buffer_address(self.pf_staging.view), self.pf_staging.size)

    def ensure(self, i: int, ids: np.ndarray, guesses: list[np.ndarray | None] | None = None) -> None:
        """Make experts `ids` (distinct, at most `slots`) of MoE layer index `i` resident; updates slot_of[i].
        `guesses`: opt-in, the likely experts of layers i+1, i+2, ... (read ahead once layer i's reads are issued)."""
        # the predict pass's reads for this layer first: they hold slots this access may give out again
        read_now = self.predictor.wait_layer(i) if self.predictor is not None else set()
        t0 = time.perf_counter()
        res = self.cache.access(i, ids.tolist(), count=not read_now)
        if read_now:  # read this token on a prediction: not resident when the layer needed it, so a miss
            late = sum(1 for k, _, hit in res if hit and k in read_now)
            hits = sum(hit for _, _, hit in res) - late
            self.cache.count(i, hits, len(res) - hits)
            self.predictor.used += late  # type: ignore[union-attr]
        misses = [(k, s) for k, s, hit in res if not hit]
        self.last_misses = len(misses)
        self.slot_of[i, [k for k, _, _ in res]] = [s for _, s, _ in res]
        self.prof.add("cache", time.perf_counter() - t0)
        ready = self._take_prefetched(i)
        if ready and hasattr(self.reader, "promote"):  # the guesses the router picked are needed now; the
            needed = {k for k, _ in misses}  # others are not read further
            self.reader.promote([fut for k, (_, fut) in ready.items() if k in needed])
            self.reader.drop([fut for k, (_, fut) in ready.items() if k not in needed])
        if not misses:
            self._drain(ready)
            if guesses:
                self.prefetch(i, guesses)
            return
        n, mm = len(misses), self.max_misses
        try:  # the guesses go out with the last group (they reuse this layer's region)
            for j in range(0, n, mm):
                self._load(i, misses[j : j + mm], ready, guesses if j + mm >= n else None)
        except BaseException:
            # a failed read (disk error, a unit that fails its check): these experts are not in the bank, so the
            # cache must not call them resident; the next call reads them again
            self.cache.forget(i, [k for k, _ in misses])
            raise

    # ------------------------------------------------------------------ opt-in predict pass (predict.py)
    def enable_predict(self, units: int) -> None:
        """The predict pass, with a pool of `units` staging units for its reads."""
        self.predictor = Predictor(self, units)

    def store(self, i: int, k: int, s: int, view: memoryview) -> None:
        """From any thread: expert k of layer index `i`, read into `view`, into bank slot `s`; returns once it
        is there (its staging is free). Only where banks are written directly (the CPU's views, CUDA's copier)."""
        if self.copier is not None:
            self._copy_to_bank(i, k, s, view, timed=False)
            self.copier.wait()
        else:
            self._verify(self.layers[i], k, view)
            self._write_host(i, s, view)

    def _write_host(self, i: int, s: int, view: memoryview) -> None:
        """CPU: an expert's bytes straight into bank slot `s`'s memory (numpy views: no MLX op, no sync)."""
        layer = self.layers[i]
        raw = np.frombuffer(view, dtype=np.uint8, count=self.unit_bytes)
        for t in self.template[layer]:
            src = raw[t.offset : t.offset + t.nbytes].view(_NP[t.dtype]).reshape(t.shape)
            dst = self.bank_np[i][t.name][s]
            if t.dtype == "BF16" and dst.dtype == np.float32:  # bfloat16 = the top half of a float32
                dst.view(np.uint32)[...] = src.astype(np.uint32) << 16
            else:
                np.copyto(dst, src)

    # ------------------------------------------------------------------ opt-in next-layer prefetch
    def enable_prefetch(self, k: int, depth: int = 1) -> None:
        """Guess the experts of the next `depth` layers from layer i's input (their routers on it) and start
        reading the uncached ones (exact: a wrong guess costs only bandwidth; prefetched bytes enter the
        bank only when the router picks them). Layer j's guesses use staging region j % depth."""
        self.pf_k, self.pf_depth = k, max(1, depth)
        self.pf_staging = AlignedBuffer(self.pf_depth * k * self.unit_bytes)
        self.pf = {}
        if self.copier is not None:
            self.copier.register(buffer_address(self.pf_staging.view), self.pf_staging.size)

    def guessed(self, i: int) -> list[bool]:
        """Which of the next `pf_depth` layers after layer index `i` are guessed: those whose decode calls
        miss `pf_min_misses` experts or more, on average."""
        nxt = range(i + 1, min(i + 1 + self.pf_depth, len(self.layers)))
        return [bool(self.miss_avg[j] >= self.pf_min_misses) for j in nxt]

    def prefetch(self, i: int, guesses: list[np.ndarray | None]) -> None:
        """Layer index `i` has consumed its own prefetches: read the guesses for layers i+1 .. i+len(guesses)."""
        if not self.pf_k:
            return
        t0 = time.perf_counter()
        ub = self.unit_bytes
        for d, guess in enumerate(guesses, start=1):
            j = i + d
            if j >= len(self.layers):
                break
            if guess is None:  # not guessed: that layer seldom misses (`pf_min_misses`)
                continue
            layer, resident = self.layers[j], self.cache.layers[j].slot
            mine = self.pf.setdefault(j, {})
            base = (j % self.pf_depth) * self.pf_k
            for k in (int(e) for e in guess):
                if len(mine) >= self.pf_k:
                    break
                if k in resident or k in mine:
                    continue
                pos = base + len(mine)
                u = self.units[layer][k]
                part = SimpleNamespace(size=ub, view=self.pf_staging.view[pos * ub : (pos + 1) * ub])
                mine[k] = (pos, self.reader.read(part, u.offset, u.length, self.read_chunk, speculative=True))  # type: ignore[arg-type]
                self.stats.prefetched += 1
        self.prof.add("prefetch", time.perf_counter() - t0)

    def _take_prefetched(self, i: int) -> dict[int, tuple[memoryview, Any]]:
        """Layer index `i`'s prefetches (expert -> (staging view, future)); its region is free once they are
        copied. A negative `i` waits for every pending guess and drops them all."""
        if not self.pf:
            return {}
        ub = self.unit_bytes
        if i < 0:
            pending = [fut for mine in self.pf.values() for _, fut in mine.values()]
            if hasattr(self.reader, "drop"):
                self.reader.drop(pending)
            for fut in pending:
                fut.exception()
            self.pf = {}
            return {}
        mine = self.pf.pop(i, {})
        return {k: (self.pf_staging.view[pos * ub : (pos + 1) * ub], fut) for k, (pos, fut) in mine.items()}

    def _load(
        self,
        i: int,
        misses: list[tuple[int, int]],
        ready: dict[int, tuple[memoryview, Any]] | None = None,
        guesses: list[np.ndarray | None] | None = None,
    ) -> None:
        layer = self.layers[i]
        ub, ready = self.unit_bytes, ready or {}
        t0 = time.perf_counter()
        chunk = self._chunk(sum(k not in ready for k, _ in misses))
        futs: dict[Any, tuple[int, int, memoryview]] = {}  # read -> (expert, slot, staging view)
        landed: list[tuple[int, int, memoryview]] = []  # guessed right: read ahead already
        for j, (k, s) in enumerate(misses):  # all reads in flight at once: the pool spreads them
            if k in ready:
                landed.append((k, s, ready[k][0]))
                self.stats.prefetch_used += 1
                continue
            u = self.units[layer][k]
            view = self.staging.view[j * ub : (j + 1) * ub]
            part = SimpleNamespace(size=ub, view=view)
            futs[self.reader.read(part, u.offset, u.length, chunk)] = (k, s, view)  # type: ignore[arg-type]
        self.stats.experts_read += len(futs)
        self.prof.add("issue", time.perf_counter() - t0)
        try:
            self._land(i, futs, landed, ready, guesses)
        except BaseException:
            # nothing that reads or writes the staging outlives the layer that issued it: it is reused next
            wait(futs)
            if self._h2d_pool is not None:  # one thread: every copy queued before this no-op has run
                self._h2d_pool.submit(int).result()
            raise

    def _chunk(self, reads: int) -> int | None:
        """The most bytes one preadv of a layer's `reads` misses takes: each miss cut into as many parts as leave
        none of the reader's threads idle (one miss on 4 threads: 4 parts, the disk queue stays deep; 4 or more:
        whole), never below `read_chunk`. Fewer parts are fewer calls to queue and fewer thread handoffs on the
        compute thread's critical path (`issue`)."""
        if not self.split_by_misses or self.read_chunk is None:
            return self.read_chunk
        parts = max(1, getattr(self.reader, "threads", 1) // max(1, reads))
        return max(self.read_chunk, -(-self.unit_bytes // parts // ALIGN) * ALIGN)

    def _land(
        self,
        i: int,
        futs: dict[Any, tuple[int, int, memoryview]],
        landed: list[tuple[int, int, memoryview]],
        ready: dict[int, tuple[memoryview, Any]],
        guesses: list[np.ndarray | None] | None,
    ) -> None:
        """The misses' reads are in flight (`futs`; `landed`: read ahead on a guess): into the bank, by the path."""
        layer = self.layers[i]
        self._drain(ready, {k for k, _, _ in landed})
        if self.copier is not None and self.pipeline == "direct":
            self._load_direct(i, futs, landed, guesses)
            return
        if not self.host_writes and self.pipeline == "threaded":
            if self._h2d_pool is None:
                self._h2d_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-h2d")
            copies = {self._h2d_pool.submit(self._copy_when_read, f, layer, view): (k, s, view)
                      for f, (k, s, view) in futs.items()}  # fmt: skip
            for k, s, view in landed:  # their region is reused by the guesses issued next
                self._to_bank(i, k, s, view)
            if guesses:
                self.prefetch(i, guesses)
            pending = set(copies)
            while pending:  # each expert's bank update starts as soon as its copy is on the device side
                done, pending = self._first_done(pending)
                for c in done:
                    k, s, view = copies[c]
                    self._to_bank(i, k, s, view, c.result())
            return
        if not self.host_writes and self.pipeline == "overlap":
            for k, s, view in landed:  # their region is reused by the guesses issued next
                self._to_bank(i, k, s, view)
            if guesses:
                self.prefetch(i, guesses)
            pending = set(futs)
            while pending:  # each expert goes to the device as its read lands, while the rest are in flight
                done, pending = self._first_done(pending)
                for f in done:
                    f.result()
                    self._to_bank(i, *futs[f])
            return
        self._wait_all(futs)
        todo = landed + list(futs.values())
        if self.verified is not None:
            for k, _, view in todo:
                self._verify(layer, k, view)
        if self.host_writes:  # CPU: straight into the bank's memory through numpy views (no MLX op, no sync)
            t0 = time.perf_counter()
            for _, s, view in todo:
                self._write_host(i, s, view)
            self.prof.add("h2d", time.perf_counter() - t0)
        else:
            self._legacy_to_bank(i, todo)
        if guesses:
            self.prefetch(i, guesses)

    def _load_direct(
        self,
        i: int,
        futs: dict[Any, tuple[int, int, memoryview]],
        landed: list[tuple[int, int, memoryview]],
        guesses: list[np.ndarray | None] | None,
    ) -> None:
        """`direct`: each expert is copied into its bank slot as its read lands, while the others are in flight;
        the layer returns once every copy is done (its compute is queued next, and its staging is reused). Building
        the layer's graph before this wait was measured on an H100 and gained nothing (docs/flash-moe.md)."""
        for k, s, view in landed:
            self._copy_to_bank(i, k, s, view)
        if landed and guesses and self.pf_k:  # the guesses issued next reuse the landed experts' region
            self._wait_copies()
        if guesses:
            self.prefetch(i, guesses)
        try:
            self._wait_all([self._copy_on_landing(f, i, *where) for f, where in futs.items()])
        finally:
            self._wait_copies()  # every queued copy, the landed ones too (they read the staging)

    def _copy_on_landing(self, read: Future[float], i: int, k: int, s: int, view: memoryview) -> Future[None]:
        """`direct`: expert k's copies are queued by the reader thread that finishes its read (the driver call
        releases the GIL), so the compute thread only waits; the future is done once they are queued."""
        return when_landed(read, view, lambda mine: self._copy_to_bank(i, k, s, mine, timed=False))

    def _copy_to_bank(self, i: int, k: int, s: int, view: memoryview, timed: bool = True) -> None:
        """Queue the copies of expert k's tensors from its staging `view` into bank slot `s` (`timed`: on the
        compute thread, counted as `h2d`)."""
        layer = self.layers[i]
        self._verify(layer, k, view)
        t0 = time.perf_counter()
        src, addr, copy = buffer_address(view), self.slot_addr[i], self.copier.copy  # type: ignore[union-attr]
        for t in self.template[layer]:
            base, stride = addr[t.name]
            copy(base + s * stride, src + t.offset, t.nbytes)
        self.prof.add("h2d" if timed else "h2d_async", time.perf_counter() - t0)

    def _wait_copies(self) -> None:
        t0 = time.perf_counter()
        self.copier.wait()  # type: ignore[union-attr]
        self.prof.add("bank", time.perf_counter() - t0)

    def _waited(self, t0: float) -> None:
        """Count the compute thread's wait since `t0` as read wait."""
        dt = time.perf_counter() - t0
        self.prof.add("read_wait", dt)
        self.stats.read_wait_s += dt

    def _wait_all(self, futs: Iterable[Future[Any]]) -> None:
        """Wait for every future, counted as read wait; then the first error raises (none is left running)."""
        t0 = time.perf_counter()
        errors = [f.exception() for f in futs]
        self._waited(t0)
        for exc in errors:
            if exc is not None:
                raise exc

    def _first_done(self, pending: set[Future[Any]]) -> tuple[set[Future[Any]], set[Future[Any]]]:
        """(done, still pending) once at least one has finished, the wait counted as read wait."""
        t0 = time.perf_counter()
        done, left = wait(pending, return_when=FIRST_COMPLETED)
        self._waited(t0)
        return done, left

    def _drain(self, ready: dict[int, tuple[memoryview, Any]], used: set[int] | None = None) -> None:
        """Wait for a layer's guessed reads (used or not) before their region is reused; a used one must have
        succeeded."""
        if not ready:
            return
        t0 = time.perf_counter()
        for k, (_, fut) in ready.items():
            if used and k in used:
                fut.result()
            else:
                fut.exception()
        self._waited(t0)

    def _verify(self, layer: int, k: int, view: memoryview) -> None:
        if self.verified is not None and (layer, k) not in self.verified:
            check_unit(self.man, self.units[layer][k], view)
            self.verified.add((layer, k))

    def _copy_when_read(self, read: Future[float], layer: int, view: memoryview) -> Any:
        """On the copy thread: wait for the read, then copy the expert's bytes to an MLX array."""
        import mlx.core as mx

        read.result()
        t0 = time.perf_counter()
        raw = mx.array(np.frombuffer(view, dtype=np.uint8, count=self.used_bytes[layer]))
        self.prof.add("h2d_async", time.perf_counter() - t0)
        return raw

    def _to_bank(self, i: int, k: int, s: int, view: memoryview, raw: Any = None) -> None:
        """Device path: one host-to-device copy of expert k's bytes (unless `raw` holds it already), views
        of it into bank slot `s`, started now."""
        import mlx.core as mx

        layer = self.layers[i]
        self._verify(layer, k, view)
        t0 = time.perf_counter()
        if raw is None:
            raw = mx.array(np.frombuffer(view, dtype=np.uint8, count=self.used_bytes[layer]))
        t1 = time.perf_counter()
        self.prof.add("h2d", t1 - t0)
        bank = self.banks[i]
        for t in self.template[layer]:
            new = raw[t.offset : t.offset + t.nbytes].view(_mx_dtype(t.dtype)).reshape(1, *t.shape)
            if new.dtype != bank[t.name].dtype:
                new = new.astype(bank[t.name].dtype)  # CPU (tests): float32 scales/biases
            bank[t.name][s : s + 1] = new  # slice update: in place once evaluated, O(expert)
        if self.profile:
            mx.eval(list(bank.values()))
        else:
            mx.async_eval(list(bank.values()))  # the device copies it while the other reads land
        self.prof.add("bank", time.perf_counter() - t1)

    def _legacy_to_bank(self, i: int, todo: list[tuple[int, int, memoryview]]) -> None:
        """The earlier device path: one `mx.array` per tensor, after every read has landed."""
        import mlx.core as mx

        layer, bank, ub = self.layers[i], self.banks[i], self.unit_bytes
        for _, s, view in todo:
            raw = np.frombuffer(view, dtype=np.uint8, count=ub)
            for t in self.template[layer]:
                # a contiguous view: mx.array copies just these bytes (a strided one copies its whole span)
                t0 = time.perf_counter()
                new = mx.array(raw[t.offset : t.offset + t.nbytes].view(_NP[t.dtype]).reshape(1, *t.shape))
                t1 = time.perf_counter()
                self.prof.add("h2d", t1 - t0)
                if t.dtype == "BF16":
                    new = new.view(mx.bfloat16)
                if new.dtype != bank[t.name].dtype:
                    new = new.astype(bank[t.name].dtype)  # CPU: float32 scales/biases (exact, faster)
                bank[t.name][s : s + 1] = new  # slice update: in place once evaluated, O(expert)
                self.prof.add("bank", time.perf_counter() - t1)
        if self.profile and todo:
            t0 = time.perf_counter()
            mx.eval(list(bank.values()))
            self.prof.add("bank", time.perf_counter() - t0)
        # GPU: no sync here; the updates (`mx.array` copied the bytes already) ride in the layer's graph

    def close(self) -> None:
        self._take_prefetched(-1)
        if self.predictor is not None:
            self.predictor.close()
        if self._h2d_pool is not None:
            self._h2d_pool.shutdown(wait=True)
        if self.copier is not None:
            self.copier.close()  # waits for its copies, unpins the staging
            self.copier = None
        self.banks = []
        self.staging.close()
        if self.pf_k:
            self.pf_staging.close()


class StreamedSwitchGLU:
    """Drop-in for mlx-lm's `SwitchGLU` (`switch_mlp`): the same math on the layer's expert bank."""

    def __init__(self, stream: ExpertStream, index: int, block_name: str = "mlp") -> None:
        self.stream = stream
        self.index = index
        layer = stream.layers[index]
        q = stream.man.quant
        self.q = {
            p: q.get(f"model.layers.{layer}.{block_name}.switch_mlp.{p}") or q["default"] for p in PROJS
        }
        self.next_gates: list[Any] = []  # the next MoE blocks' routers, when next-layer prefetch is on

    def _proj(self, x: Any, idx: Any, p: str, sort: bool, stream: Any = None) -> Any:
        import mlx.core as mx

        b, q = self.stream.banks[self.index], self.q[p]
        return mx.gather_qmm(x, b[f"{p}.weight"], b[f"{p}.scales"], b.get(f"{p}.biases"), rhs_indices=idx,
                             transpose=True, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                             sorted_indices=sort, stream=stream)  # fmt: skip

    def _glu(self, x: Any, idx: Any, indices_shape: tuple[int, ...], stream: Any = None) -> Any:
        """SwitchGLU.__call__ with bank indices (mirrors mlx-lm so results match bit for bit)."""
        import mlx.core as mx
        from mlx_lm.models.activations import swiglu
        from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

        with mx.stream(stream) if stream is not None else _NO_STREAM:
            x = mx.expand_dims(x, (-2, -3))
            do_sort = idx.size >= 64
            inv = None
            if do_sort:
                x, idx, inv = _gather_sort(x, idx)
            up, gate = self._proj(x, idx, "up_proj", do_sort), self._proj(x, idx, "gate_proj", do_sort)
            y = self._proj(swiglu(gate, up), idx, "down_proj", do_sort)
            if do_sort:
                y = _scatter_unsort(y, inv, indices_shape)
            return y.squeeze(-2)

    def _pairs(self, x_rows: Any, rows: np.ndarray, slots: np.ndarray) -> Any:
        """CPU: the outputs of the (row, slot) pairs, (pairs, 1, out), split over the CPU streams."""
        import mlx.core as mx

        # MLX runs a stream's ops on one thread: the pairs are split over the CPU streams, one per core (exact:
        # each pair's output is computed on its own, the same bits on any stream and in any company)
        streams = cpu_streams()
        n = len(rows)
        parts = min(len(streams), n)
        if parts <= 1:
            idx = slots.reshape(-1, 1)
            return self._glu(x_rows[mx.array(rows)], mx.array(idx), idx.shape)
        bounds = cuts(n, parts)
        outs = []
        for j in range(parts):
            a, b = bounds[j], bounds[j + 1]
            idx = slots[a:b].reshape(-1, 1)
            outs.append(self._glu(x_rows[mx.array(rows[a:b])], mx.array(idx), idx.shape, streams[j]))
        return mx.concatenate(outs, axis=0)

    def _guess_ops(self, x: Any, k: int) -> list[Any]:
        """Lazy top-k guesses of the next layers' experts: their routers on this layer's input (last token);
        None for a layer not guessed (`ExpertStream.guessed`)."""
        import mlx.core as mx

        xl = x.reshape(-1, x.shape[-1])[-1:]
        out: list[Any] = []
        for gate, wanted in zip(self.next_gates, self.stream.guessed(self.index), strict=False):
            if not wanted:
                out.append(None)
                continue
            logits = gate(xl)
            out.append(mx.argpartition(-logits, kth=k - 1, axis=-1)[0, :k] if k < logits.shape[-1] else
                       mx.argsort(-logits, axis=-1)[0])  # fmt: skip
        return out

    def __call__(self, x: Any, indices: Any) -> Any:
        import mlx.core as mx

        st = self.stream
        if st.predictor is not None and st.predictor.active:  # the predict pass: resident experts only
            return st.predictor.layer(self, x, indices)
        prof = st.prof
        t0 = time.perf_counter()
        if st.profile:
            mx.eval(x)  # the device finishes what precedes the router
            t1 = time.perf_counter()
            prof.add("wait_input", t1 - t0)
            t0 = t1
        k = indices.shape[-1]
        decode = indices.size <= 64
        guess_ops = self._guess_ops(x, k) if self.next_gates and decode else []
        if any(
            g is not None for g in guess_ops
        ):  # opt-in: decode calls guess the next layers, in the same sync
            mx.eval(indices, *(g for g in guess_ops if g is not None))
        chosen = np.array(indices)  # the one host sync of the layer: the router's choice
        guesses = [None if g is None else np.array(g) for g in guess_ops]
        if all(g is None for g in guesses):
            guesses = []
        st.stats.calls += 1
        st.stats.host_syncs += 1
        prof.calls += 1
        prof.add("router", time.perf_counter() - t0)
        ids = np.unique(chosen)
        if st.record:
            st.stats.trace.append((self.index, ids.tolist()))
        slots = st.cache.slots
        if len(ids) <= slots:
            st.ensure(self.index, ids, guesses)
            if decode:
                st.miss_avg[self.index] += 0.2 * (st.last_misses - st.miss_avg[self.index])
            t0 = time.perf_counter()
            if st.host_writes:  # CPU: every (token, k) pair, split over the CPU streams
                flat = chosen.reshape(-1)
                y = self._pairs(
                    x.reshape(-1, x.shape[-1]), np.arange(len(flat)) // k, st.slot_of[self.index][flat]
                )
                y = y.reshape(*chosen.shape, y.shape[-1])
            else:
                y = self._glu(x, mx.array(st.slot_of[self.index][chosen]), chosen.shape)
            if st.profile:
                mx.eval(y)
            elif not st.host_writes:  # GPU: start this layer now, while Python builds the next one's graph
                mx.async_eval(y)
            prof.add("compute", time.perf_counter() - t0)
            return y
        if st.host_writes:  # CPU: each group computes only its own (token, k) pairs
            return self._grouped_pairs(x, chosen, ids, slots)
        out = None  # a prefill chunk needing more experts than the bank: groups of `slots`, each read once
        for g in range(0, len(ids), slots):
            group = ids[g : g + slots]
            st.ensure(self.index, group)
            t0 = time.perf_counter()
            mine = np.isin(chosen, group)
            table = st.slot_of[self.index]
            idx = np.where(mine, table[chosen], table[group[0]]).astype(np.uint32)
            y = self._glu(x, mx.array(idx), chosen.shape)
            out = y if out is None else mx.where(mx.array(mine)[..., None], y, out)
            mx.eval(out)  # before the bank's slots are reused by the next group
            st.stats.host_syncs += 1
            prof.add("compute", time.perf_counter() - t0)
        return out

    def _grouped_pairs(self, x: Any, chosen: np.ndarray, ids: np.ndarray, slots: int) -> Any:
        """A prefill chunk needing more experts than the bank, on the CPU: groups of `slots` experts, each
        read once, and each group computes only the (token, k) pairs routed to it — not every pair masked,
        which did the chunk's whole expert compute once per group. The CPU's `gather_qmm` computes each pair
        on its own (one row against one expert), so a pair's output is the same bits in any company; the
        pairs' outputs are put back in the model's order at the end."""
        import mlx.core as mx

        st, prof = self.stream, self.stream.prof
        k = chosen.shape[-1]
        flat = chosen.reshape(-1)
        rows_x = x.reshape(-1, x.shape[-1])
        parts, order = [], []
        for g in range(0, len(ids), slots):
            group = ids[g : g + slots]
            st.ensure(self.index, group)
            t0 = time.perf_counter()
            pos = np.flatnonzero(np.isin(flat, group))
            y = self._pairs(rows_x, pos // k, st.slot_of[self.index][flat[pos]])  # (pairs, 1, out)
            mx.eval(y)  # before the bank's slots are reused by the next group
            parts.append(y)
            order.append(pos)
            st.stats.host_syncs += 1
            prof.add("compute", time.perf_counter() - t0)
        inv = np.empty(len(flat), dtype=np.int64)
        inv[np.concatenate(order)] = np.arange(len(flat))
        y = mx.concatenate(parts, axis=0)[mx.array(inv)]
        return y.reshape(*chosen.shape, y.shape[-1])


class CacheAwareRouter:
    """Opt-in, lossy: wraps a MoE block's router (`block.gate`) and adds `bias` to the logits of the
    experts resident in the layer's bank, before the block's own softmax and top-k. A near-tie then
    goes to an expert already in memory; a clear winner still wins. Generic over every block that
    computes `self.gate(x)` (qwen3_moe, qwen3_next, mixtral, olmoe)."""

    def __init__(self, gate: Any, stream: ExpertStream, index: int, bias: float) -> None:
        self.gate, self.stream, self.index, self.bias = gate, stream, index, float(bias)

    def __call__(self, x: Any) -> Any:
        import mlx.core as mx

        logits = self.gate(x)
        mask = np.zeros(self.stream.n_experts, dtype=np.float32)
        mask[list(self.stream.cache.layers[self.index].slot)] = self.bias
        return logits + mx.array(mask).astype(logits.dtype)


BLOCK_NAMES = ("mlp", "block_sparse_moe")  # where mlx-lm's MoE models keep the block (mixtral: the latter)
TOP_K_NAMES = ("top_k", "num_experts_per_tok")  # what they call its top-k (mixtral: the latter)


def _block_name(layer: Any) -> str | None:
    return next((n for n in BLOCK_NAMES if hasattr(getattr(layer, n, None), "switch_mlp")), None)


def moe_blocks(model: Any) -> list[tuple[int, Any]]:
    """(layer number, MoE block) for every block (`mlp` or `block_sparse_moe`) holding a SwitchGLU `switch_mlp`."""
    first = first_layer(model)  # a pipeline rank's layers keep their numbers
    return [
        (i, getattr(layer, name))
        for i, layer in enumerate(model.layers, first)
        if (name := _block_name(layer))
    ]


def block_top_k(block: Any) -> int | None:
    return next((int(getattr(block, n)) for n in TOP_K_NAMES if hasattr(block, n)), None)


def set_block_top_k(block: Any, k: int) -> None:
    name = next((n for n in TOP_K_NAMES if hasattr(block, n)), None)
    if name is None:
        raise ValueError(f"{type(block).__name__} has no top_k to lower")
    setattr(block, name, min(k, int(getattr(block, name))))


def attach_moe(
    model: Any,
    stream: ExpertStream,
    top_k: int | None = None,
    prefetch_next: bool | int = False,
    routing_bias: float = 0.0,
) -> None:
    """Replace each MoE block's `switch_mlp` with a StreamedSwitchGLU (placeholders leave the tree unevaluated)."""
    import mlx.nn as nn

    blocks = moe_blocks(model)
    if [i for i, _ in blocks] != stream.layers:
        raise ValueError(
            f"the split's MoE layers {stream.layers[:4]}... do not match the model's {[i for i, _ in blocks][:4]}..."
        )
    for index, (i, block) in enumerate(blocks):
        if "switch_mlp" in block:
            del block["switch_mlp"]
        block.switch_mlp = StreamedSwitchGLU(
            stream, index, _block_name(model.layers[i - first_layer(model)]) or "mlp"
        )
        if top_k is not None:  # opt-in, lossy: fewer active experts per token
            set_block_top_k(block, top_k)
        if routing_bias:  # opt-in, lossy: cache-aware routing (the router module stays in the parameter tree)
            if not isinstance(getattr(block, "gate", None), nn.Module):
                raise ValueError(f"{type(block).__name__} has no router `gate` to bias")
            object.__setattr__(block, "gate", CacheAwareRouter(block["gate"], stream, index, routing_bias))
    depth = int(prefetch_next)  # True = 1; an int = that many layers ahead
    if depth and len(blocks) > 1:  # opt-in: layer i guesses layers i+1..i+depth's experts with their routers
        for index in range(len(blocks) - 1):
            blocks[index][1].switch_mlp.next_gates = [
                b.gate for _, b in blocks[index + 1 : index + 1 + depth]
            ]
        stream.enable_prefetch(block_top_k(blocks[0][1]) or 8, depth)


def top_k_of(model: Any) -> int:
    blocks = moe_blocks(model)
    return (block_top_k(blocks[0][1]) or 8) if blocks else 0


def has_experts(man: Manifest) -> bool:
    return any(u.kind == "expert" for u in man.units)


def expert_floor(
    man: Manifest, top_k: int | None, prefetch_next: bool | int, n_buffers: int, predict: int = 0
) -> int:
    """The least the expert cache and its staging take under a budget (top-k experts per layer), as
    `load_experts` sizes them: what `plan_budget` must leave for a MoE split (its `reserve`)."""
    units = expert_units(man)
    if not units:
        return 0
    unit = max(u.padded for us in units.values() for u in us)
    k = int(man.config.get("num_experts_per_tok") or 8)
    k = k if top_k is None else min(top_k, k)
    staging = (2 * k + k * prefetch_next + predict) * unit
    if not man.dense_units():  # as in load_experts: the plan's read-ahead buffers are never made
        staging = max(0, staging - n_buffers * man.max_unit_bytes)
    return k * len(units) * resident_expert_bytes(units) + staging


# the KV cache a MoE model gets unless a longer context is asked for (--ctx-size): the rest of the budget holds
# experts, where a bigger cache saves reads at every token
MOE_CONTEXT = 4096


def load_experts(model: Any, man: Manifest, reader: UnitReader, plan: Any, budget: int | None, policy: str = "lru",
                 top_k: int | None = None, verify: bool = False, prefetch_next: bool | int = False,
                 routing_bias: float = 0.0, context_asked: bool = False, predict: int = 0) -> ExpertStream:  # fmt: skip
    """Size the expert cache from what the budget leaves (after pinned weights, buffers and a KV cache of
    up to MOE_CONTEXT tokens — the whole `plan.context` when `context_asked`, the user's --ctx-size — else
    256), build the banks and attach the streamed layers. Sets `plan.context`. `predict`: the predict pass's
    staging units (0: off; predict.py)."""
    from .budget import MIN_CONTEXT

    units = expert_units(man)
    n_layers, n_experts = len(units), len(next(iter(units.values())))
    unit = max(u.padded for us in units.values() for u in us)  # on disk and in staging
    resident = resident_expert_bytes(units)  # in a bank
    k = top_k_of(model) if top_k is None else min(top_k, top_k_of(model))
    max_misses = 2 * k
    if routing_bias < 0:
        raise ValueError(f"routing_bias must be >= 0 (a logit bonus for cached experts), not {routing_bias}")
    if budget is None:
        cache = ExpertCache(
            n_layers, n_experts, resident, policy
        )  # no budget: every expert may stay, as in RAM
    else:
        staging = (max_misses + k * prefetch_next + predict) * unit
        if not man.dense_units():  # no dense layer: the plan's read-ahead buffers are never made
            staging = max(0, staging - plan.buffers)
        for ctx in (plan.context if context_asked else min(plan.context, MOE_CONTEXT), MIN_CONTEXT):
            left = budget - plan.fixed - staging - ctx * plan.per_token
            if left >= k * n_layers * resident:
                break
        if left < k * n_layers * resident:
            from ..base import BudgetError
            from .budget import fmt, fmt_up

            short = k * n_layers * resident - left
            raise BudgetError(f"the expert cache needs {k} experts x {n_layers} layers = {fmt(k * n_layers * resident)} "
                              f"but the memory budget {fmt(budget)} leaves {fmt(max(0, left))} for it (runtime, pinned "
                              f"weights, staging and a {MIN_CONTEXT}-token context come first): {fmt(short)} short; "
                              f"raise --memory-budget to at least {fmt_up(budget + short)}", need=budget + short)  # fmt: skip
        cache = ExpertCache.for_budget(left, n_layers, n_experts, resident, min_slots=k, policy=policy)
        plan.context = ctx
        plan.experts = cache.capacity_bytes + staging
    stream = ExpertStream(man, reader, cache, max_misses=max_misses, verify=verify)
    attach_moe(model, stream, top_k, prefetch_next, routing_bias)
    if predict:
        try:
            check_model(model)
            stream.enable_predict(predict)
        except BaseException:
            stream.close()  # its staging (pinned on CUDA) and the copier's context
            raise
    return stream


def moe_extra(stream: ExpertStream, since: dict[str, int], tokens: int) -> dict[str, Any]:
    """What a request adds to `Done.stats.extra`: hit rate over the request, experts read per token, the cache."""
    hits = sum(s.hits for s in stream.cache.stats) - since["hits"]
    misses = sum(s.misses for s in stream.cache.stats) - since["misses"]
    return {
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "experts_read_per_token": (stream.stats.experts_read - since["read"]) / max(1, tokens),
        "expert_cache": stream.cache.report(),
        "moe_host_syncs": stream.stats.host_syncs - since["syncs"],
        **(
            {  # --expert-prefetch's reads, beside experts_read_per_token's (the router's misses)
                "experts_prefetched": stream.stats.prefetched - since["prefetched"],
                "experts_prefetch_used": stream.stats.prefetch_used - since["prefetch_used"],
            }
            if stream.pf_k
            else {}
        ),
        **(
            {
                "predict_passes": pr.passes - since["passes"],
                "experts_predicted": pr.predicted - since["predicted"],
                "experts_predicted_used": pr.used - since["predicted_used"],
                "predict_skipped": pr.skipped - since["predict_skipped"],
            }
            if (pr := stream.predictor) is not None
            else {}
        ),
    }


def moe_counters(stream: ExpertStream) -> dict[str, int]:
    pr = stream.predictor
    return {"hits": sum(s.hits for s in stream.cache.stats), "misses": sum(s.misses for s in stream.cache.stats),
            "read": stream.stats.experts_read, "syncs": stream.stats.host_syncs,
            "passes": pr.passes if pr else 0, "predicted": pr.predicted if pr else 0,
            "predicted_used": pr.used if pr else 0, "predict_skipped": pr.skipped if pr else 0,
            "prefetched": stream.stats.prefetched, "prefetch_used": stream.stats.prefetch_used}  # fmt: skip
