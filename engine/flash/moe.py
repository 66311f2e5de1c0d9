"""The MoE expert sniper: each MoE layer reads only the experts its router picks, from the split.

What it knows: mlx-lm's `SwitchGLU` contract (`switch_mlp(x, indices)` -> per-(token, k) outputs,
weighted and summed by the model's own MoE block), and how to give the very same answer from
per-expert units: the router and top-k run on the device in the model's own block; one host sync
per layer reads the chosen ids; the expert cache (experts.py) says which are resident; the misses
are read in parallel (direct I/O, one preadv per expert) into a staging buffer and copied into a
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

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from .experts import ExpertCache
from .reader import AlignedBuffer, UnitReader
from .safetensors_io import DTYPE_SIZES
from .split import Manifest, Unit, UnitTensor, check_unit

_NP = {
    "U32": np.uint32,
    "U8": np.uint8,
    "F16": np.float16,
    "F32": np.float32,
    "BF16": np.uint16,
    "I32": np.int32,
}
PROJS = ("gate_proj", "up_proj", "down_proj")


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


class ExpertStream:
    """Per-layer banks + the cache + parallel reads of misses. One instance serves every MoE layer."""

    def __init__(self, man: Manifest, reader: UnitReader, cache: ExpertCache, max_misses: int = 16,
                 verify: bool = False, record: bool = False) -> None:  # fmt: skip
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
        self.banks: list[dict[str, Any]] = []
        for li in self.layers:
            bank = {
                t.name: mx.zeros((cache.slots, *t.shape), dtype=_mx_dtype(bank_dtype(t.dtype)))
                for t in self.template[li]
            }
            mx.eval(list(bank.values()))
            self.banks.append(bank)
        # CPU: misses are written into the banks' memory directly (numpy views); GPU: as MLX slice updates
        # that join the layer's graph (every extra sync there serialises Python with the device).
        self.host_writes = mx.default_device() == mx.cpu
        # CPU: writable numpy views of the banks (MLX arrays, evaluated once, never replaced on the CPU).
        # Safe: a layer's bank is written only after its router readback, which has evaluated every
        # earlier use of it (the previous token's), and grouped prefill evaluates each group first.
        self.bank_np = (
            [{k: np.array(v, copy=False) for k, v in b.items()} for b in self.banks]
            if self.host_writes
            else []
        )
        self.slot_of = np.zeros((len(self.layers), self.n_experts), dtype=np.uint32)
        self.verified: set[tuple[int, int]] | None = set() if verify else None
        self.stats = MoEStats()
        self.record = record

    @property
    def bank_bytes(self) -> int:
        return sum(a.nbytes for b in self.banks for a in b.values())

    def ensure(self, i: int, ids: np.ndarray) -> None:
        """Make experts `ids` (distinct, at most `slots`) of MoE layer index `i` resident; updates slot_of[i]."""
        res = self.cache.access(i, [int(k) for k in ids])
        misses = [(k, s) for k, s, hit in res if not hit]
        for k, s, _ in res:
            self.slot_of[i, k] = s
        ready = self._take_prefetched(i)
        for j in range(0, len(misses), self.max_misses):
            self._load(i, misses[j : j + self.max_misses], ready)

    # ------------------------------------------------------------------ opt-in next-layer prefetch
    def enable_prefetch(self, k: int) -> None:
        """Guess layer i+1's experts from layer i's input and start reading the uncached ones (exact: a
        wrong guess costs only bandwidth; prefetched bytes enter the bank only when the router picks them)."""
        self.pf_staging = AlignedBuffer(k * self.unit_bytes)
        self.pf_k = k
        self.pf: dict[int, tuple[int, Any]] = {}  # expert -> (position in pf_staging, future)
        self.pf_layer = -1

    def prefetch(self, i: int, guess: np.ndarray) -> None:
        if getattr(self, "pf_k", 0) == 0 or i >= len(self.layers):
            return
        self._take_prefetched(-1)  # drain the previous guesses before their buffer is reused
        layer, ub, resident = self.layers[i], self.unit_bytes, self.cache.layers[i].slot
        todo = [int(k) for k in guess if int(k) not in resident][: self.pf_k]
        for j, k in enumerate(todo):
            u = self.units[layer][k]
            part = SimpleNamespace(size=ub, view=self.pf_staging.view[j * ub : (j + 1) * ub])
            self.pf[k] = (j, self.reader.read(part, u.offset, u.length))  # type: ignore[arg-type]
        self.pf_layer = i
        self.stats.prefetched += len(todo)

    def _take_prefetched(self, i: int) -> dict[int, memoryview]:
        """Completed prefetches for layer index `i` (all pending ones are waited for and dropped)."""
        if not getattr(self, "pf", None):
            return {}
        ub, out = self.unit_bytes, {}
        for k, (j, fut) in self.pf.items():
            fut.exception()
            if self.pf_layer == i:
                out[k] = self.pf_staging.view[j * ub : (j + 1) * ub]
        self.pf = {}
        return out

    def _load(
        self, i: int, misses: list[tuple[int, int]], ready: dict[int, memoryview] | None = None
    ) -> None:
        import mlx.core as mx

        layer = self.layers[i]
        ub, ready = self.unit_bytes, ready or {}
        futs, views = [], []
        for j, (k, _) in enumerate(misses):  # all reads in flight at once: the pool spreads them
            if k in ready:
                views.append(ready[k])
                self.stats.prefetch_used += 1
                continue
            u = self.units[layer][k]
            view = self.staging.view[j * ub : (j + 1) * ub]
            futs.append(self.reader.read(SimpleNamespace(size=ub, view=view), u.offset, u.length))  # type: ignore[arg-type]
            views.append(view)
        t0 = time.perf_counter()
        for f in futs:
            f.result()
        self.stats.read_wait_s += time.perf_counter() - t0
        self.stats.experts_read += len(futs)
        if self.verified is not None:
            for (k, _), view in zip(misses, views, strict=True):
                if (layer, k) not in self.verified:
                    check_unit(self.man, self.units[layer][k], view)
                    self.verified.add((layer, k))
        bank = self.banks[i]
        if self.host_writes:  # CPU: straight into the bank's memory through numpy views (no MLX op, no sync)
            for (_, s), view in zip(misses, views, strict=True):
                raw = np.frombuffer(view, dtype=np.uint8, count=ub)
                for t in self.template[layer]:
                    src = raw[t.offset : t.offset + t.nbytes].view(_NP[t.dtype]).reshape(t.shape)
                    dst = self.bank_np[i][t.name][s]
                    if t.dtype == "BF16" and dst.dtype == np.float32:  # bfloat16 = the top half of a float32
                        dst.view(np.uint32)[...] = src.astype(np.uint32) << 16
                    else:
                        np.copyto(dst, src)
            return
        for (_, s), view in zip(misses, views, strict=True):
            raw = np.frombuffer(view, dtype=np.uint8, count=ub)
            for t in self.template[layer]:
                # a contiguous view: mx.array copies just these bytes (a strided one copies its whole span)
                new = mx.array(raw[t.offset : t.offset + t.nbytes].view(_NP[t.dtype]).reshape(1, *t.shape))
                if t.dtype == "BF16":
                    new = new.view(mx.bfloat16)
                if new.dtype != bank[t.name].dtype:
                    new = new.astype(bank[t.name].dtype)  # CPU: float32 scales/biases (exact, faster)
                bank[t.name][s : s + 1] = new  # slice update: in place once evaluated, O(expert)
        # GPU: no sync here; the updates (`mx.array` copied the bytes already) ride in the layer's graph

    def close(self) -> None:
        self._take_prefetched(-1)
        self.banks = []
        self.staging.close()
        if getattr(self, "pf_k", 0):
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
        self.next_gate: Any = None  # the next MoE block's router, when next-layer prefetch is on

    def _proj(self, x: Any, idx: Any, p: str, sort: bool) -> Any:
        import mlx.core as mx

        b, q = self.stream.banks[self.index], self.q[p]
        return mx.gather_qmm(x, b[f"{p}.weight"], b[f"{p}.scales"], b.get(f"{p}.biases"), rhs_indices=idx,
                             transpose=True, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                             sorted_indices=sort)  # fmt: skip

    def _glu(self, x: Any, idx: Any, indices_shape: tuple[int, ...]) -> Any:
        """SwitchGLU.__call__ with bank indices (mirrors mlx-lm so results match bit for bit)."""
        import mlx.core as mx
        from mlx_lm.models.activations import swiglu
        from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

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

    def __call__(self, x: Any, indices: Any) -> Any:
        import mlx.core as mx

        st = self.stream
        chosen = np.array(indices)  # the one host sync of the layer: the router's choice
        st.stats.calls += 1
        st.stats.host_syncs += 1
        ids = np.unique(chosen)
        if st.record:
            st.stats.trace.append((self.index, ids.tolist()))
        slots = st.cache.slots
        if len(ids) <= slots:
            st.ensure(self.index, ids)
            if (
                self.next_gate is not None and chosen.size <= 64
            ):  # opt-in: decode-sized calls guess the next layer
                logits = np.array(self.next_gate(x.reshape(-1, x.shape[-1])[-1:]))[0]
                st.stats.host_syncs += 1
                st.prefetch(self.index + 1, np.argsort(-logits)[: chosen.shape[-1]])
            y = self._glu(x, mx.array(st.slot_of[self.index][chosen]), chosen.shape)
            if not st.host_writes:  # GPU: start this layer now, while Python builds the next one's graph
                mx.async_eval(y)
            return y
        out = None  # a prefill chunk needing more experts than the bank: groups of `slots`, each read once
        for g in range(0, len(ids), slots):
            group = ids[g : g + slots]
            st.ensure(self.index, group)
            mine = np.isin(chosen, group)
            table = st.slot_of[self.index]
            idx = np.where(mine, table[chosen], table[group[0]]).astype(np.uint32)
            y = self._glu(x, mx.array(idx), chosen.shape)
            out = y if out is None else mx.where(mx.array(mine)[..., None], y, out)
            mx.eval(out)  # before the bank's slots are reused by the next group
            st.stats.host_syncs += 1
        return out


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
    return [(i, getattr(layer, name)) for i, layer in enumerate(model.layers) if (name := _block_name(layer))]


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
    prefetch_next: bool = False,
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
        block.switch_mlp = StreamedSwitchGLU(stream, index, _block_name(model.layers[i]) or "mlp")
        if top_k is not None:  # opt-in, lossy: fewer active experts per token
            set_block_top_k(block, top_k)
        if routing_bias:  # opt-in, lossy: cache-aware routing (the router module stays in the parameter tree)
            if not isinstance(getattr(block, "gate", None), nn.Module):
                raise ValueError(f"{type(block).__name__} has no router `gate` to bias")
            object.__setattr__(block, "gate", CacheAwareRouter(block["gate"], stream, index, routing_bias))
    if prefetch_next and len(blocks) > 1:  # opt-in: layer i guesses layer i+1's experts with i+1's router
        for index in range(len(blocks) - 1):
            blocks[index][1].switch_mlp.next_gate = blocks[index + 1][1].gate
        stream.enable_prefetch(block_top_k(blocks[0][1]) or 8)


def top_k_of(model: Any) -> int:
    blocks = moe_blocks(model)
    return (block_top_k(blocks[0][1]) or 8) if blocks else 0


def has_experts(man: Manifest) -> bool:
    return any(u.kind == "expert" for u in man.units)


def expert_floor(man: Manifest, top_k: int | None, prefetch_next: bool, n_buffers: int) -> int:
    """The least the expert cache and its staging take under a budget (top-k experts per layer), as
    `load_experts` sizes them: what `plan_budget` must leave for a MoE split (its `reserve`)."""
    units = expert_units(man)
    if not units:
        return 0
    unit = max(u.padded for us in units.values() for u in us)
    k = int(man.config.get("num_experts_per_tok") or 8)
    k = k if top_k is None else min(top_k, k)
    staging = (2 * k + k * prefetch_next) * unit
    if not man.dense_units():  # as in load_experts: the plan's read-ahead buffers are never made
        staging = max(0, staging - n_buffers * man.max_unit_bytes)
    return k * len(units) * resident_expert_bytes(units) + staging


def load_experts(model: Any, man: Manifest, reader: UnitReader, plan: Any, budget: int | None, policy: str = "lru",
                 top_k: int | None = None, verify: bool = False, prefetch_next: bool = False,
                 routing_bias: float = 0.0) -> ExpertStream:  # fmt: skip
    """Size the expert cache from what the budget leaves (after pinned weights, buffers and a KV cache of
    up to 4096 tokens, else 256), build the banks and attach the streamed layers. Sets `plan.context`."""
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
        staging = (max_misses + k * prefetch_next) * unit
        if not man.dense_units():  # no dense layer: the plan's read-ahead buffers are never made
            staging = max(0, staging - plan.buffers)
        for ctx in (min(plan.context, 4096), MIN_CONTEXT):
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
                              f"raise --memory-budget to at least {fmt_up(budget + short)}")  # fmt: skip
        cache = ExpertCache.for_budget(left, n_layers, n_experts, resident, min_slots=k, policy=policy)
        plan.context = ctx
        plan.experts = cache.capacity_bytes + staging
    stream = ExpertStream(man, reader, cache, max_misses=max_misses, verify=verify)
    attach_moe(model, stream, top_k, prefetch_next, routing_bias)
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
    }


def moe_counters(stream: ExpertStream) -> dict[str, int]:
    return {"hits": sum(s.hits for s in stream.cache.stats), "misses": sum(s.misses for s in stream.cache.stats),
            "read": stream.stats.experts_read, "syncs": stream.stats.host_syncs}  # fmt: skip
