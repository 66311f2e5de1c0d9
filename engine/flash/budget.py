"""Byte accounting for a flash-streamed model under `--memory-budget`.

What it knows: what the engine itself holds — pinned weights (as they sit in memory after the
CPU float32 cast), the reader's aligned buffers, the unit arrays in flight, activations, and the
KV cache per token — and how much context is left once those are paid for. It refuses a budget
that the pinned weights alone (or pinned + streaming machinery) cannot meet, saying by how much.

What it does not know: the Python/MLX runtime itself (~150-250 MB of RSS on CPU, libraries and
tokenizer), which the process pays whatever the engine does; peak RSS is reported beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..base import BudgetError
from .dense import max_piece_bytes
from .split import Manifest, dtype_size

MIN_CONTEXT = 256  # below this the model is useless for the agent


def fmt(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def pinned_resident_bytes(man: Manifest, float_bytes: int) -> int:
    """Pinned tensors in memory: floats cast to the compute dtype, except quantized-linear scales/biases."""
    total = 0
    for name, t in man.pinned_tensors.items():
        size = dtype_size(t["dtype"])
        if t["dtype"] in ("F16", "BF16", "F32") and (not name.endswith((".scales", ".biases")) or "embed" in name):
            total += t["nbytes"] // size * float_bytes
        else:
            total += t["nbytes"]
    return total


@dataclass
class BudgetPlan:
    budget: int | None
    pinned: int
    buffers: int
    in_flight: int
    activations: int
    kv_per_token: int
    context: int

    @property
    def fixed(self) -> int:
        return self.pinned + self.buffers + self.in_flight + self.activations

    @property
    def total(self) -> int:
        return self.fixed + self.kv_per_token * self.context

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fixed": self.fixed, "total": self.total}


def plan_budget(
    man: Manifest,
    budget: int | None,
    n_buffers: int,
    context_length: int,
    prefill_step: int,
    float_bytes: int = 4,
) -> BudgetPlan:
    cfg = man.config
    hidden = int(cfg["hidden_size"])
    inter = int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or hidden * 4)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    pinned = pinned_resident_bytes(man, float_bytes)
    unit = max_piece_bytes(man) if man.dense_units() else man.max_unit_bytes  # dense: one projection at a time
    buffers = n_buffers * unit
    in_flight = unit  # the piece being computed, in MLX arrays the stream reuses (dense.py)
    activations = prefill_step * (3 * inter + 6 * hidden) * float_bytes + int(cfg["vocab_size"]) * float_bytes * 4
    kv_per_token = layers * 2 * kv_heads * head_dim * float_bytes
    plan = BudgetPlan(budget, pinned, buffers, in_flight, activations, kv_per_token, context_length)
    if budget is None:
        return plan
    if pinned > budget:
        raise BudgetError(
            f"the pinned weights alone need {fmt(pinned)} but the memory budget is {fmt(budget)}: "
            f"{fmt(pinned - budget)} over; raise --memory-budget to at least {fmt(plan.fixed + MIN_CONTEXT * kv_per_token)}"
        )
    room = budget - plan.fixed
    if room < MIN_CONTEXT * kv_per_token:
        short = MIN_CONTEXT * kv_per_token - room
        raise BudgetError(
            f"the memory budget {fmt(budget)} covers the pinned weights ({fmt(pinned)}) but not the streaming "
            f"buffers ({fmt(buffers + in_flight)}), activations ({fmt(activations)}) and a {MIN_CONTEXT}-token "
            f"KV cache: {fmt(short)} short; raise --memory-budget to at least {fmt(budget + short)}"
        )
    plan.context = min(context_length, room // kv_per_token)
    return plan
