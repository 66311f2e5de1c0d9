"""Byte accounting for a flash-streamed model under `--memory-budget`: the budget is the whole process's.

What it knows: what the process holds besides the engine — the runtime (Python, MLX, the tokenizer:
measured by the backend as RSS at load, plus `TRANSIENT_ALLOWANCE` for transient buffers) — and what the
engine holds: pinned weights (as they sit in memory after the CPU float32 cast), the reader's aligned
buffers, the unit arrays in flight, activations, and per token of context the KV cache plus one
prefill chunk's attention scores; and how much context is left once those are paid for. It refuses a
budget that the runtime and the pinned weights alone (or with the streaming machinery) cannot meet,
saying by how much and what to raise it to.

What it does not know: how the runtime is measured (backend.py) or where the bytes are (dense.py, moe.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..base import BudgetError
from ..cpu_fast import dequant_in_flight_bytes
from .dense import max_piece_bytes
from .split import Manifest, Unit, dtype_size

MIN_CONTEXT = 256  # below this the model is useless for the agent
# Partial residency keeps this much context (tokens, or the model's, if less) before FFNs take the rest
RESIDENT_CONTEXT = 4096
# What the process allocates beyond the runtime measured at load and the engine's own accounting:
# allocator slack after MLX frees buffers, library code pages first touched while generating, the
# tokenizer's and chat template's work per request, reader threads. Measured (bench/flash_budget.py,
# docs/flash.md "Memory budget"): at most 27 MB over SmolLM2, Qwen2.5-Coder-0.5B and a synth MoE.
TRANSIENT_ALLOWANCE = 48_000_000


def fmt(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def fmt_up(n: float) -> str:
    """Rounded up to 0.1 MB: a budget of this many MB is enough."""
    return f"{math.ceil(n / 1e5) / 10:.1f} MB"


def pinned_resident_bytes(man: Manifest, float_bytes: int) -> int:
    """Pinned tensors in memory: floats cast to the compute dtype, except quantized-linear scales/biases."""
    total = 0
    for name, t in man.pinned_tensors.items():
        size = dtype_size(t["dtype"])
        if t["dtype"] in ("F16", "BF16", "F32") and (
            not name.endswith((".scales", ".biases")) or "embed" in name
        ):
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
    runtime: int = 0  # the process outside the engine: RSS at load + TRANSIENT_ALLOWANCE (0: engine only)
    scores_per_token: int = 0  # attention scores (and softmax) of one prefill chunk, per token of context
    experts: int = 0  # MoE: expert banks + staging (set by moe.load_experts)
    resident: int = 0  # dense FFN units kept in memory (plan_residency): never read again after load
    resident_layers: list[int] = field(default_factory=list)

    @property
    def per_token(self) -> int:
        return self.kv_per_token + self.scores_per_token

    @property
    def fixed(self) -> int:
        held = self.runtime + self.pinned + self.buffers + self.in_flight + self.activations
        return held + self.experts + self.resident

    @property
    def total(self) -> int:
        return self.fixed + self.per_token * self.context

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fixed": self.fixed, "total": self.total}


def moe_pair_floats(cfg: dict[str, Any]) -> int:
    """Per prompt token of a prefill chunk, the floats a MoE layer holds for its top-k (token, expert) pairs
    (0 for a dense model): each pair's gathered input, gate, up and their product, and its output three
    times over (the groups' outputs, their concatenation, the same put back in the model's order;
    moe.py `_grouped_pairs`). 128 tokens of Qwen3-30B-A3B: 43 MB."""
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        return 0
    k = int(cfg.get("num_experts_per_tok") or 8)
    hidden = int(cfg["hidden_size"])
    expert_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or hidden * 4)
    return k * (4 * hidden + 3 * expert_inter)


def plan_budget(
    man: Manifest,
    budget: int | None,
    n_buffers: int,
    context_length: int,
    prefill_step: int,
    float_bytes: int = 4,
    runtime: int = 0,
    reserve: int = 0,
    scratch: int = 0,
) -> BudgetPlan:
    """What the process will hold with `budget` bytes in all; `runtime` is what it holds besides the engine,
    `reserve` the least the engine needs beyond this plan (MoE: the smallest expert cache and its staging)."""
    cfg = man.config
    hidden = int(cfg["hidden_size"])
    inter = int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or hidden * 4)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    pinned = pinned_resident_bytes(man, float_bytes)
    unit = (
        max_piece_bytes(man) if man.dense_units() else man.max_unit_bytes
    )  # dense: one projection at a time
    buffers = n_buffers * unit + scratch  # scratch: an in-place reader's aligned bounce buffers (inplace.py)
    in_flight = unit  # the piece being computed, in MLX arrays the stream reuses (dense.py)
    activations = (
        prefill_step * (3 * inter + 6 * hidden) * float_bytes + int(cfg["vocab_size"]) * float_bytes * 4
    )
    activations += prefill_step * moe_pair_floats(cfg) * float_bytes
    if float_bytes == 4:  # the CPU: prefill's dequantized weight blocks in flight (cpu_fast.quantized_matmul)
        activations += dequant_in_flight_bytes()
    kv_per_token = layers * 2 * kv_heads * head_dim * float_bytes
    scores_per_token = 2 * heads * prefill_step * float_bytes
    plan = BudgetPlan(budget, pinned, buffers, in_flight, activations, kv_per_token, context_length,
                      runtime=runtime, scores_per_token=scores_per_token)  # fmt: skip
    if budget is None:
        return plan
    # the least budget quoted below has a tenth of the runtime on top: it is measured again at each load and
    # moves by tens of MB between runs (imports, the allocator), so the figure quoted still runs next time
    need = (
        plan.fixed + reserve + MIN_CONTEXT * plan.per_token
    )  # the smallest budget that runs: a 256-token context
    if pinned > budget:
        raise BudgetError(
            f"the pinned weights alone need {fmt(pinned)} but the memory budget is {fmt(budget)}: "
            f"{fmt(pinned - budget)} over; raise --memory-budget to at least {fmt_up(need + runtime // 10)}",
            need=need + runtime // 10,
        )
    if runtime + pinned > budget:
        raise BudgetError(
            f"this process holds {fmt(runtime)} before the engine loads anything (Python, MLX, the tokenizer and "
            f"room for transient buffers) and the pinned weights need {fmt(pinned)}: with the streaming buffers"
            f"{', the smallest expert cache' if reserve else ''} and a {MIN_CONTEXT}-token context the memory budget "
            f"of {fmt(budget)} is {fmt(need - budget)} short; "
            f"raise --memory-budget to at least {fmt_up(need + runtime // 10)}",
            need=need + runtime // 10,
        )
    room = budget - plan.fixed
    if room < reserve + MIN_CONTEXT * plan.per_token:
        runtime_part = f"the runtime ({fmt(runtime)}) and " if runtime else ""
        experts = f", the smallest expert cache ({fmt(reserve)})" if reserve else ""
        raise BudgetError(
            f"the memory budget {fmt(budget)} covers {runtime_part}the pinned weights ({fmt(pinned)}) but not the "
            f"streaming buffers ({fmt(buffers + in_flight)}), activations ({fmt(activations)}){experts} and a "
            f"{MIN_CONTEXT}-token context: {fmt(need - budget)} short; raise --memory-budget to at least {fmt_up(need + runtime // 10)}",
            need=need + runtime // 10,
        )
    plan.context = min(context_length, room // plan.per_token)
    return plan


def resident_unit_bytes(u: Unit, float_bytes: int = 2) -> int:
    """A dense unit kept in memory: its stored bytes, float16/bfloat16 scales and biases as `float_bytes`
    each (float32 on the CPU: dense.load_resident casts them once, as MLXBackend holds them)."""
    extra = sum(
        t.nbytes // 2 * (float_bytes - 2)
        for t in u.tensors
        if t.dtype in ("F16", "BF16") and t.name.endswith((".scales", ".biases"))
    )
    return u.length + extra


def plan_residency(
    plan: BudgetPlan, units: list[Unit], context_target: int = RESIDENT_CONTEXT, float_bytes: int = 2
) -> list[Unit]:
    """Dense FFN units to keep in memory, in layer order, from what the budget has left once the plan's
    fixed part and `context_target` tokens of context (or the plan's context, if less) are paid for. Updates
    `plan` (resident bytes, layers; the context then takes whatever is still left). A unit is resident at
    `resident_unit_bytes` (the arrays a streamed piece makes, scales and biases cast to `float_bytes`)."""
    if plan.budget is None or not units:
        return []
    keep = min(plan.context, max(MIN_CONTEXT, context_target))
    spare = plan.budget - plan.fixed - keep * plan.per_token
    chosen, used = [], 0
    for u in units:
        size = resident_unit_bytes(u, float_bytes)
        if used + size > spare:
            break  # in layer order: the streamed ones stay one run, read back to back
        chosen.append(u)
        used += size
    plan.resident, plan.resident_layers = used, [u.layer for u in chosen]
    plan.context = min(plan.context, (plan.budget - plan.fixed) // plan.per_token)
    return chosen
