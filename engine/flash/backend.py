"""FlashBackend: the MLX engine with each layer's FFN streamed from a split on disk.

What it knows: loading a split (pinned weights into the model's own modules, FFNs left on disk),
checking it (pinned checksum always; every unit's checksum on load for splits up to
`verify_limit` bytes, otherwise on each unit's first read), sizing everything to the memory
budget, and adding flash numbers (bytes read, bytes/s, read latency, the budget) to the stats.
Generation, tokenization and prompt caching are MLXBackend's, unchanged: same tokens as in RAM.

The memory budget is the process's: `load` loads the tokenizer first, measures what the process then
holds (RSS: Python, MLX, the tokenizer and whatever else lives in it), adds `TRANSIENT_ALLOWANCE`, and
plans the engine in what is left; peak RSS (VmHWM, reset at load) is reported against the budget.

What it does not know: threads (the worker owns it), HTTP, how MoE routing works (moe.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import cpu_fast
from ..base import BudgetError, Done, EngineError, Event, GenerationRequest, ModelInfo, ModelLoadError
from ..mlx_backend import MLXBackend, compute_dtype, peak_rss_bytes
from ..worker import release_memory
from .budget import TRANSIENT_ALLOWANCE, BudgetPlan, fmt, fmt_up, plan_budget, plan_residency
from .dense import LayerStream, attach, load_resident
from .inplace import open_reader, scratch_bytes
from .moe import MOE_CONTEXT, expert_floor, has_experts, load_experts, moe_counters, moe_extra, top_k_of
from .predict import predict_pass
from .reader import UnitReader
from .split import Manifest, SplitError, check_unit, load_manifest, split_model, verify_pinned

log = logging.getLogger(__name__)


def current_rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0


def reset_peak_rss() -> bool:
    """Linux: restart this process's peak-RSS counter (VmHWM, and ru_maxrss with it) from its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    """The peak resident set since `reset_peak_rss` (VmHWM on Linux; elsewhere the process's lifetime peak)."""
    return peak_rss_bytes()


def cast_pinned(model: Any) -> None:
    """Float params to float32 on CPU (as MLXBackend does), except quantized linears' scales/biases:
    `quantized_matmul` gives bit-identical float32 results from float16 scales at half the memory."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    if mx.default_device() != mx.cpu:
        return
    quantized = {name for name, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    updates = []
    for key, v in tree_flatten(model.parameters()):
        owner, _, leaf = key.rpartition(".")
        if not mx.issubdtype(v.dtype, mx.floating) or v.dtype == mx.float32:
            continue
        if owner in quantized and leaf in ("scales", "biases"):
            continue
        updates.append((key, v.astype(mx.float32)))
    model.update(tree_unflatten(updates))


def stream_model(model: Any, man: Manifest, reader: UnitReader, plan: BudgetPlan, budget: int | None, *,
                 verify: bool = False, prefetch: int = 2, policy: str = "lru", top_k: int | None = None,
                 expert_prefetch: bool = False, routing_bias: float = 0.0, float_bytes: int = 2,
                 context_asked: bool = False, expert_predict: int = 0) -> tuple[LayerStream | None, Any]:  # fmt: skip
    """Attach the streamed layers to a pinned-only model: MoE layers read their routed experts (moe.py),
    dense layers — all of a dense model, a MoE model's `mlp_only_layers` — their FFN pieces (dense.py)."""
    stream, experts = None, None
    if has_experts(man):
        experts = load_experts(model, man, reader, plan, budget, policy, top_k, verify=verify,
                               prefetch_next=expert_prefetch, routing_bias=routing_bias,
                               context_asked=context_asked, predict=expert_predict)  # fmt: skip
    if man.dense_units():
        keep = set(plan.resident_layers)
        resident = load_resident(man, reader, [u for u in man.dense_units() if u.layer in keep], float_bytes)
        streamed = [u for u in man.dense_units() if u.layer not in keep]
        if streamed:
            stream = LayerStream(man, reader, depth=prefetch, verify=verify, units=streamed)
        attach(model, stream, set(experts.layers) if experts is not None else set(), resident)
    return stream, experts


def _with_predict(exc: BudgetError, man: Manifest, units: int) -> BudgetError:
    """A refused budget that counts --expert-predict's staging says how much of it that is: fewer units, or none,
    is the other fix."""
    if not units or not has_experts(man):
        return exc
    pool = units * max(u.padded for u in man.units if u.kind == "expert")
    return BudgetError(f"{exc} (--expert-predict {units} takes {fmt(pool)} of it: fewer units need less)",
                       need=exc.need)  # fmt: skip


def _under_cgroup(exc: BudgetError, cgroup: int | None, budget: int | None) -> BudgetError:
    """A budget already at its memory cgroup's limit (`auto` takes it) cannot be raised: the kernel kills the
    process at the cgroup's limit, so the refusal says that the cgroup's limit is what must be raised."""
    at_limit = cgroup is not None and budget is not None and budget >= cgroup - (1 << 20)
    if not at_limit or exc.need is None:  # `need`: raising --memory-budget is the fix
        return exc
    return BudgetError(
        f"{exc}; this process's memory cgroup allows {fmt(cgroup)}, so raise the cgroup's limit to at least "
        f"{fmt_up(exc.need)} first (or use a smaller model)",
        need=exc.need,
    )


class FlashBackend(MLXBackend):
    name = "flash"
    yield_first = True  # building a step reads its weights (and a MoE layer's router choice): engine.decode

    def __init__(
        self,
        memory_budget: int | str | None = None,
        io_threads: int = 4,
        prefetch: int = 2,
        verify_limit: int = 2 << 30,
        auto_split: bool = True,
        expert_policy: str = "lru",
        top_k: int | None = None,
        expert_prefetch: bool = False,
        expert_predict: int = 0,
        routing_bias: float = 0.0,
        direct_io: bool = True,
        runtime_bytes: int | None = None,
        residency: bool = True,
        **kwargs: Any,
    ) -> None:
        if expert_predict and expert_prefetch:  # said before anything loads
            raise ValueError("--expert-predict and --expert-prefetch read ahead two ways: choose one")
        super().__init__(**kwargs)
        # --ctx-size, kept apart from _context_override, which a load sets to the context it planned
        self._context_asked: int | None = self._context_override
        # bytes, None (no budget: stream everything) or "auto" (memory.py: resolved at each load)
        self.budget_setting = memory_budget
        self.memory_budget: int | None = None if memory_budget == "auto" else memory_budget  # type: ignore[assignment]
        self.auto_budget: dict[str, Any] | None = None
        self._budget_cut_context = False  # the budget left room for less context than the model's
        # ... because a MoE model keeps MOE_CONTEXT tokens unless asked (moe.py)
        self._moe_cut_context = False
        self.lossy: list[str] = []  # the lossy MoE options in effect, in words (_lossy_options)
        self.io_threads = io_threads
        self.prefetch = prefetch
        self.verify_limit = verify_limit
        self.auto_split = auto_split
        self.expert_policy, self.top_k = (
            expert_policy,
            top_k,
        )  # MoE: cache policy; top_k < the model's is lossy
        self.expert_prefetch = expert_prefetch  # MoE: exact next-layer guess-and-read (moe.py)
        # MoE: the exact predict pass's staging units, 0 = off (predict.py)
        self.expert_predict = expert_predict
        self.routing_bias = routing_bias  # MoE: > 0 is lossy cache-aware routing (moe.py)
        self.direct_io = direct_io  # False: read units through the page cache (measured, off by default)
        # what the process holds besides the engine: None = measured at load (RSS after the tokenizer, plus
        # TRANSIENT_ALLOWANCE); 0 = the budget covers the engine only (tests that share a process with others)
        self.runtime_bytes = runtime_bytes
        self.residency = residency  # under a budget: keep dense FFNs resident as far as it goes (exact)
        self.runtime: dict[str, int] = {}
        self.expert_stream: Any = None
        self.manifest: Manifest | None = None
        self.reader: UnitReader | None = None
        self.layer_stream: LayerStream | None = None
        self.plan: BudgetPlan | None = None
        self._live = {"t": time.perf_counter(), "bytes": 0, "Bps": 0.0}

    # ------------------------------------------------------------------ loading
    def _split_dir(self, model: ModelInfo) -> Path:
        if model.split_path is not None:
            return model.split_path
        if (model.path / "manifest.json").exists():  # pointed straight at a split directory
            return model.path
        if not self.auto_split:
            raise ModelLoadError(
                f"model {model.name} has no split layout: run `flashcode split {model.name}`"
            )
        log.info("model %s has no split layout yet: splitting it into %s", model.name, model.path / "split")
        return split_model(model.path, progress=False)

    def load(self, model: ModelInfo) -> None:
        import mlx.core as mx
        from mlx_lm.utils import load_config, load_model, load_tokenizer

        self.close()
        root = self._split_dir(model)
        full = man = load_manifest(root)
        span = self._layer_span(man)
        if span is not None:  # a pipeline rank: only its own layers stream, under its own budget
            man = man.shard(*span)
        release_memory()  # the RSS measured below is the runtime the budget pays first
        if self.budget_setting == "auto":
            from .memory import auto_budget

            auto = auto_budget()
            self.memory_budget, self.auto_budget = auto.budget, auto.as_dict()
            log.info("flash: --memory-budget auto = %.2f GB (%s)", auto.budget / 1e9, auto.detail)
        from .memory import cgroup_limit

        cgroup = cgroup_limit() if self.memory_budget else None
        # (the kernel keeps a cgroup's limit in whole pages: a budget equal to the cap is a few KB above it)
        if cgroup is not None and self.budget_setting != "auto" and self.memory_budget > cgroup + (1 << 20):  # type: ignore[operator]
            raise BudgetError(
                f"the memory budget {fmt(self.memory_budget)} is more than this process's memory cgroup allows "  # type: ignore[arg-type]
                f"({fmt(cgroup)}): the kernel would kill it before the budget is reached; use --memory-budget auto "
                f"(the cgroup's limit) or at most {fmt(cgroup)}, or raise the cgroup's limit"
            )
        if self.memory_budget and self.budget_setting != "auto":
            import psutil

            total = psutil.virtual_memory().total
            if self.memory_budget > total:  # not a limit: the system runs out first
                log.warning("flash: the memory budget %s is more than this machine's memory (%s): it swaps or is "
                            "killed before the budget is reached; use --memory-budget auto", fmt(self.memory_budget),
                            fmt(total))  # fmt: skip
        if self.memory_budget:
            reset_peak_rss()  # peak RSS is reported against the budget from here, the tokenizer's load included
        # the tokenizer first: it is part of the runtime the budget pays before the engine
        tokenizer = load_tokenizer(model.path, eos_token_ids=load_config(root).get("eos_token_id"))
        runtime = self._measure_runtime()
        float_bytes = 4 if compute_dtype() == mx.float32 else 2
        ctx = self._context_asked or int(man.config.get("max_position_embeddings", 4096))
        if self.memory_budget and self.prefill_step_size > 128:
            self.prefill_step_size = 128  # prefill activations grow with the step; keep them small
        args = (ctx, self.prefill_step_size, float_bytes)
        scratch = (
            scratch_bytes(self.io_threads) if man.in_place else 0
        )  # in place: aligned reads land there first
        try:
            plan = plan_budget(man, self.memory_budget, self.prefetch, *args, runtime=runtime,
                               reserve=self._expert_floor(man, self.prefetch), scratch=scratch)  # fmt: skip
        except BudgetError as exc:
            if self.prefetch <= 1:
                raise self._refused(exc, man, cgroup) from exc
            log.info("flash: budget too tight for %d read-ahead buffers, using 1", self.prefetch)
            self.prefetch = 1
            try:
                plan = plan_budget(
                    man,
                    self.memory_budget,
                    1,
                    *args,
                    runtime=runtime,
                    reserve=self._expert_floor(man, 1),
                    scratch=scratch,
                )
            except BudgetError as exc:
                raise self._refused(exc, man, cgroup) from exc
        if self.memory_budget and self.residency and not has_experts(man):
            # keep what the budget allows; stream only the rest
            plan_residency(plan, man.dense_units(), float_bytes=float_bytes)
        verify_pinned(full)
        verify_now = man.streamed_bytes <= self.verify_limit
        reader = open_reader(man, threads=self.io_threads, direct=self.direct_io)
        try:
            if verify_now:
                self._verify_units(man, reader)
            obj, cfg = load_model(man.weights_root, lazy=True, strict=False)
            self._own_layers(obj)
            self.lossy = self._lossy_options(model.name, top_k_of(obj))
            stream, experts = stream_model(obj, man, reader, plan, self.memory_budget, verify=not verify_now,
                                           prefetch=self.prefetch, policy=self.expert_policy, top_k=self.top_k,
                                           expert_prefetch=self.expert_prefetch, routing_bias=self.routing_bias,
                                           float_bytes=float_bytes, expert_predict=self.expert_predict,
                                           context_asked=self._context_asked is not None)  # fmt: skip
        except SplitError:
            reader.close()
            raise
        except BudgetError as exc:
            reader.close()
            raise _with_predict(exc, man, self.expert_predict) from exc
        except Exception as exc:
            reader.close()
            raise ModelLoadError(f"could not load the split of {model.name} from {root}: {exc}") from exc
        if self.expert_predict and experts is not None and stream is not None:
            log.warning("flash: --expert-predict runs each token twice, so %s's streamed dense layers are read twice "
                        "a token", model.name)  # fmt: skip
        cast_pinned(obj)
        # CPU: large pinned matrices spread over the cores (float16 scales: no dequantized copies)
        cpu_fast.patch_model(obj)
        mx.eval(obj.parameters())
        if self.memory_budget:  # freed unit arrays are recycled, not hoarded by MLX's buffer cache
            mx.set_cache_limit(plan.in_flight + plan.activations)
        mx.clear_cache()  # the float16 originals of cast weights
        self.tokenizer = tokenizer
        self.model_obj, self.config = obj, cfg
        self.manifest, self.reader, self.layer_stream, self.plan = man, reader, stream, plan
        self.expert_stream = experts
        if self.memory_budget:
            self._context_override = plan.context
            self._budget_cut_context = plan.context < ctx
            # MoE keeps MOE_CONTEXT tokens unless asked for more: then --ctx-size, not the budget, is the fix
            self._moe_cut_context = (
                experts is not None and self._context_asked is None and plan.context == min(ctx, MOE_CONTEXT)
            )
            if plan.context < ctx:  # said: a prompt too long for it is told what to raise
                log.warning("flash: %s", self._cut_words(ctx))
        self._model_info = model
        self.prompt_cache.reset()
        log.info("flash: %s, %.1f MB pinned, %d units of up to %.1f MB, direct I/O %s, runtime %.1f MB",
                 model.name, plan.pinned / 1e6, len(man.units), man.max_unit_bytes / 1e6, reader.direct,
                 self.runtime.get("rss_bytes", 0) / 1e6)  # fmt: skip

    def _lossy_options(self, name: str, model_k: int) -> list[str]:
        """The lossy MoE options that take effect (each said once at load, and in every reply's stats); the
        ones that do not are said as ignored, not run silently."""
        moe_only = [f for f, on in (("--top-k-experts", self.top_k is not None), ("--routing-bias", bool(self.routing_bias)),
                                    ("--expert-prefetch", self.expert_prefetch), ("--expert-predict", bool(self.expert_predict)),
                                    (f"--expert-policy {self.expert_policy}", self.expert_policy != "lru")) if on]  # fmt: skip
        if not model_k:
            if moe_only:
                log.warning(
                    "flash: %s ignored: %s has no experts (they apply to MoE models)",
                    ", ".join(moe_only),
                    name,
                )
            return []
        lossy = []
        if self.top_k is not None and self.top_k >= model_k:
            log.warning("flash: --top-k-experts %d is not fewer than the model's %d: the model's own routing runs "
                        "(exact)", self.top_k, model_k)  # fmt: skip
        elif self.top_k is not None:
            lossy.append(f"{self.top_k} of the model's {model_k} experts a token")
        if self.routing_bias:
            lossy.append(f"cache-aware routing (bias {self.routing_bias:g})")
        if lossy:
            log.warning("flash: lossy options on: %s; replies differ from the model's own", "; ".join(lossy))
        return lossy

    def _cut_words(self, ctx: int) -> str:
        """Why the context is shorter than `ctx`, the model's or the one asked, and what gives more."""
        assert self.plan is not None and self.memory_budget
        if self._moe_cut_context:
            return (f"a MoE model gets a {self.plan.context}-token context of the model's {ctx} (the rest of the "
                    f"memory budget holds experts); ask for more with --ctx-size (it then comes out of the budget)")  # fmt: skip
        whose = f"the {ctx} asked (--ctx-size)" if self._context_asked else f"the model's {ctx}"
        return (f"the memory budget of {fmt(self.memory_budget)} leaves room for a {self.plan.context}-token context "
                f"of {whose}; raise --memory-budget for more")  # fmt: skip

    def context_fix(self) -> str:
        if self._budget_cut_context and self.memory_budget and self._moe_cut_context:
            return (f"ask for a longer context with --ctx-size when you start flashcode (a MoE model gets "
                    f"{MOE_CONTEXT} tokens unless asked)")  # fmt: skip
        if self._budget_cut_context and self.memory_budget:
            return (f"raise the memory budget (--memory-budget, or Settings in the web app: the budget of "
                    f"{fmt(self.memory_budget)} leaves room for this context)")  # fmt: skip
        return ""

    def _layer_span(self, man: Manifest) -> tuple[int, int] | None:
        """The layers [start, end) this process holds: None for all (a pipeline rank overrides both)."""
        return None

    def _own_layers(self, model: Any) -> None:
        """Drop the layers other processes hold from the lazily loaded `model` (before anything is read)."""

    def _refused(self, exc: BudgetError, man: Manifest, cgroup: int | None) -> BudgetError:
        """A plan the budget refused, with the fixes beside raising it (fewer predict units; the cgroup's limit)."""
        return _under_cgroup(_with_predict(exc, man, self.expert_predict), cgroup, self.memory_budget)

    def _expert_floor(self, man: Manifest, n_buffers: int) -> int:
        if not has_experts(man):
            return 0
        return expert_floor(man, self.top_k, self.expert_prefetch, n_buffers, self.expert_predict)

    def _measure_runtime(self) -> int:
        """Bytes of the budget the process holds besides the engine: RSS now (the tokenizer loaded) + the allowance."""
        rss = current_rss_bytes()
        allowance = TRANSIENT_ALLOWANCE if self.runtime_bytes is None else 0
        runtime = rss + allowance if self.runtime_bytes is None else self.runtime_bytes
        self.runtime = {"rss_bytes": rss, "allowance_bytes": allowance, "runtime_bytes": runtime}
        return runtime

    def _verify_units(self, man: Manifest, reader: UnitReader) -> None:
        from .reader import AlignedBuffer

        buf = AlignedBuffer(man.max_unit_bytes)
        try:
            for u in man.units:
                reader.read(buf, u.offset, u.length).result()
                check_unit(man, u, buf.view)
        finally:
            buf.close()

    # ------------------------------------------------------------------ generation
    def stream(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        self._require()
        assert self.reader is not None
        b0, r0 = self.reader.stats.bytes, self.reader.stats.read_s
        m0 = moe_counters(self.expert_stream) if self.expert_stream else None
        for ev in super().stream(request, cancel):
            if isinstance(ev, Done):
                s = ev.stats
                read = self.reader.stats.bytes - b0
                read_s = self.reader.stats.read_s - r0
                passes = max(1, self.last_passes)  # the prompt's pass and one per later token
                s.extra.update({
                    "bytes_read": read,
                    "bytes_per_token": read / passes,
                    "read_bandwidth_Bps": read / read_s if read_s else 0.0,
                    "bytes_per_s": read / s.total_s if s.total_s else 0.0,
                    "direct_io": self.reader.direct,
                    "budget": self.plan.as_dict() if self.plan else None,
                    "rss_bytes": current_rss_bytes(),
                    **self.memory_report(),
                })  # fmt: skip
                if self.lossy:
                    s.extra["lossy"] = "; ".join(self.lossy)
                if self.expert_stream and m0 is not None:
                    s.extra.update(moe_extra(self.expert_stream, m0, passes))
                s.peak_rss_bytes = s.extra["peak_rss_bytes"]
            yield ev

    def live_stats(self) -> dict[str, Any]:
        """For the UI: disk bytes/s since the last call, bytes read so far, current RSS."""
        # read once, before the counter: a page's call beside the meter's never goes negative
        last = self._live
        now = time.perf_counter()
        total = self.reader.stats.bytes if self.reader else 0
        dt = now - last["t"]
        if dt > 0.2:
            self._live = {"t": now, "bytes": total, "Bps": max(0.0, (total - last["bytes"]) / dt)}
        live = {"bytes_read": total, "bytes_per_s": self._live["Bps"], "rss_bytes": current_rss_bytes(),
                **self.memory_report()}  # fmt: skip
        if self.expert_stream is not None:
            live["hit_rate"] = self.expert_stream.cache.hit_rate()
        return live

    def memory_report(self) -> dict[str, Any]:
        """Peak RSS since load against the budget, and the runtime measured at load (the budget's first part)."""
        peak = peak_rss_since_reset()
        out: dict[str, Any] = {"memory_budget": self.memory_budget, "peak_rss_bytes": peak,
                               "runtime_rss_bytes": self.runtime.get("rss_bytes"),
                               "runtime_allowance_bytes": self.runtime.get("allowance_bytes")}  # fmt: skip
        if self.memory_budget:
            out["peak_rss_of_budget"] = round(peak / self.memory_budget, 4)
        if self.auto_budget is not None:
            out["memory_budget_auto"] = self.auto_budget["detail"]
        return out

    def _before_step(self) -> Any:
        """The predict pass before each decode step (opt-in, `expert_predict`; predict.py)."""
        es = self.expert_stream
        if es is None or es.predictor is None:
            return None
        model, predictor = self.model_obj, es.predictor

        def predict(inputs: Any, cache: list[Any]) -> None:
            t0 = time.perf_counter()
            predict_pass(model, predictor, inputs, cache)
            es.prof.add("predict", time.perf_counter() - t0)

        return predict

    def close(self) -> None:
        if self.layer_stream is not None:
            self.layer_stream.close()
        if self.expert_stream is not None:
            self.expert_stream.close()
        if self.reader is not None:
            self.reader.close()
        self.layer_stream = self.reader = self.manifest = self.expert_stream = None
        if self.model_obj is not None or self._model_info is not None:
            super().close()

    def _require(self) -> None:
        if self.model_obj is None or self.reader is None:
            raise EngineError("no model is loaded: pick one with --model or in the model menu")
