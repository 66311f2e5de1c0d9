"""The expert cache: which experts of each MoE layer sit in memory, under one byte budget.

What it knows: a fixed number of slots per layer (the budget divided by layers x expert bytes),
which expert id holds which slot, and the eviction policy that frees a slot for a miss — `lru`
(first), `lfu` (counts since load, recency breaks ties) and `s3fifo` (small FIFO + main FIFO + ghost,
Yang et al., SOSP'23). It never evicts an expert the current call needs. Hits and misses per layer.
`simulate` replays a recorded routing trace through each policy at the same size, so policies are
compared on the very same accesses (the engine runs one policy live).

What it does not know: where expert bytes live (moe.py owns the banks and the reads).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("lru", "lfu", "s3fifo")


class Policy:
    """Maps keys to slots 0..capacity-1; `access` makes every key resident and says which were hits."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("an expert cache needs at least one slot per layer")
        self.capacity = capacity
        self.slot: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slot)

    def access(self, keys: Sequence[int]) -> list[tuple[int, int, bool]]:
        """[(key, slot, hit)] for `keys` (distinct, at most `capacity`), all resident afterwards."""
        if len(keys) > self.capacity:
            raise ValueError(f"{len(keys)} experts requested at once but only {self.capacity} slots")
        need = set(keys)
        out = []
        for k in keys:
            hit = k in self.slot
            if hit:
                self._hit(k)
            else:
                s = self.free.pop() if self.free else self._evict(need)
                self.slot[k] = s
                self._insert(k)
            out.append((k, self.slot[k], hit))
        return out

    def _take(self, k: int) -> int:
        return self.slot.pop(k)

    def forget(self, keys: Sequence[int]) -> None:
        """Drop `keys` (their bytes never arrived): their slots are free again, and a later access is a miss."""
        for k in keys:
            if k in self.slot:
                self.free.append(self.slot.pop(k))
                self._forget(k)

    def _forget(self, k: int) -> None: ...

    def _hit(self, k: int) -> None: ...
    def _insert(self, k: int) -> None: ...
    def _evict(self, protect: set[int]) -> int:
        raise NotImplementedError


class LRU(Policy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()

    def _hit(self, k: int) -> None:
        self.order.move_to_end(k)

    def _insert(self, k: int) -> None:
        self.order[k] = None

    def _evict(self, protect: set[int]) -> int:
        victim = next(k for k in self.order if k not in protect)
        del self.order[victim]
        return self._take(victim)

    def _forget(self, k: int) -> None:
        del self.order[k]


class LFU(Policy):
    """Least frequently used since load; among equals the least recently used goes."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.clock = 0

    def _touch(self, k: int) -> None:
        self.clock += 1
        self.count[k] = self.count.get(k, 0) + 1  # counts survive eviction: popularity, not residency
        self.last[k] = self.clock

    _hit = _touch
    _insert = _touch

    def _evict(self, protect: set[int]) -> int:
        victim = min((k for k in self.slot if k not in protect), key=lambda k: (self.count[k], self.last[k]))
        return self._take(victim)


class S3FIFO(Policy):
    """Small FIFO (10%) for new keys, main FIFO for keys seen twice, a ghost FIFO of recent evictions."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_cap = max(1, capacity // 10)
        self.small: deque[int] = deque()
        self.main: deque[int] = deque()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def _hit(self, k: int) -> None:
        self.freq[k] = min(3, self.freq.get(k, 0) + 1)

    def _insert(self, k: int) -> None:
        self.freq[k] = 0
        if k in self.ghost:
            del self.ghost[k]
            self.main.append(k)
        else:
            self.small.append(k)

    def _forget(self, k: int) -> None:
        for q in (self.small, self.main):
            if k in q:
                q.remove(k)
        self.freq.pop(k, None)

    def _evict(self, protect: set[int]) -> int:
        for _ in range(8 * self.capacity + 8):
            small_ok = any(k not in protect for k in self.small)
            main_ok = any(k not in protect for k in self.main)
            use_small = small_ok and (len(self.small) >= self.small_cap or not main_ok)
            q = self.small if use_small else self.main
            k = q.popleft()
            if k in protect:
                q.append(k)
                continue
            if q is self.small:
                if self.freq.get(k, 0) > 0:
                    self.main.append(k)
                    continue
                self.ghost[k] = None
                while len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
                return self._take(k)
            if self.freq.get(k, 0) > 0:
                self.freq[k] -= 1
                self.main.append(k)
                continue
            return self._take(k)
        raise RuntimeError("s3fifo: every resident expert is protected")


def make_policy(name: str, capacity: int) -> Policy:
    classes = {"lru": LRU, "lfu": LFU, "s3fifo": S3FIFO}
    if name not in classes:
        raise ValueError(f"unknown expert cache policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return classes[name](capacity)


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


@dataclass
class ExpertCache:
    """One policy per MoE layer, `slots` experts each, `unit_bytes` per expert; never over `capacity_bytes`."""

    n_layers: int
    slots: int
    unit_bytes: int
    policy: str = "lru"
    layers: list[Policy] = field(init=False)
    stats: list[LayerStats] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = [make_policy(self.policy, self.slots) for _ in range(self.n_layers)]
        self.stats = [LayerStats() for _ in range(self.n_layers)]

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        n_layers: int,
        n_experts: int,
        unit_bytes: int,
        min_slots: int,
        policy: str = "lru",
    ) -> ExpertCache:
        """As many slots per layer as `budget_bytes` pays for (at least `min_slots`, at most all experts)."""
        slots = min(n_experts, budget_bytes // max(1, n_layers * unit_bytes))
        if slots < min_slots:
            need = min_slots * n_layers * unit_bytes
            from ..base import BudgetError

            raise BudgetError(
                f"the expert cache needs {min_slots} experts x {n_layers} layers = {need / 1e6:.1f} MB "
                f"but {budget_bytes / 1e6:.1f} MB is left for it; raise --memory-budget by "
                f"{(need - budget_bytes) / 1e6:.1f} MB"
            )
        return cls(n_layers, slots, unit_bytes, policy)

    @property
    def capacity_bytes(self) -> int:
        return self.n_layers * self.slots * self.unit_bytes

    @property
    def used_bytes(self) -> int:
        return sum(len(p) for p in self.layers) * self.unit_bytes

    def access(self, layer: int, ids: Sequence[int], count: bool = True) -> list[tuple[int, int, bool]]:
        """[(id, slot, hit)], every id resident afterwards; `count`: in the layer's hit and miss counts."""
        res = self.layers[layer].access(ids)
        if count:
            hits = sum(hit for _, _, hit in res)
            self.count(layer, hits, len(res) - hits)
        return res

    def count(self, layer: int, hits: int, misses: int) -> None:
        st = self.stats[layer]
        st.hits += hits
        st.misses += misses

    def forget(self, layer: int, ids: Sequence[int]) -> None:
        """Experts of `layer` whose load failed: no longer resident (stats keep their misses)."""
        self.layers[layer].forget(ids)

    def hit_rate(self) -> float:
        h = sum(s.hits for s in self.stats)
        n = h + sum(s.misses for s in self.stats)
        return h / n if n else 0.0

    def report(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "slots_per_layer": self.slots,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "hit_rate": round(self.hit_rate(), 4),
            "hit_rate_per_layer": [round(s.hit_rate, 4) for s in self.stats],
        }


def simulate(
    trace: Iterable[tuple[int, Sequence[int]]], n_layers: int, slots: int, policy: str
) -> dict[str, Any]:
    """Replay [(layer, distinct expert ids)] through `policy` with `slots` per layer; hit rates."""
    cache = ExpertCache(n_layers, slots, 1, policy)
    for layer, ids in trace:
        ids = list(ids)
        for i in range(0, len(ids), slots):
            cache.access(layer, ids[i : i + slots])
    rep = cache.report()
    rep["hits"], rep["misses"] = sum(s.hits for s in cache.stats), sum(s.misses for s in cache.stats)
    return rep
