"""The MoE expert sniper: streamed experts give mlx-lm's in-RAM answer, within the cache's budget."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.flash.experts import POLICIES, ExpertCache, simulate

PROMPT = [[1, 5, 300, 77, 9000, 5, 12, 44, 1000, 3] * 4]  # 40 tokens x top-4: the sorted gather path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Path:
    from engine.flash.split import split_model
    from engine.flash.synth_moe import synth_moe

    model = synth_moe("moe-tiny", tmp_path_factory.mktemp("moe") / "m", skew=2.0, progress=False)
    split_model(model, progress=False)
    return model


def streamed_model(model: Path, slots: int, policy: str = "lru", prefetch: bool = False) -> tuple[Any, Any]:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.flash.backend import cast_pinned
    from engine.flash.inplace import open_reader
    from engine.flash.moe import ExpertStream, attach_moe
    from engine.flash.split import load_manifest

    man = load_manifest(model / "split")
    obj, _ = load_model(man.weights_root, lazy=True, strict=False)
    unit = max(u.padded for u in man.units)
    stream = ExpertStream(
        man, open_reader(man), ExpertCache(3, slots, unit, policy), verify=True, record=True
    )
    attach_moe(obj, stream, prefetch_next=prefetch)
    cast_pinned(obj)
    mx.eval(obj.parameters())
    return obj, stream


def greedy(
    model: Any, n: int = 8, prompt: list[list[int]] = PROMPT, before: Any = None
) -> tuple[list[int], Any]:
    """`n` greedy tokens and their logits; `before(inputs, cache)`: run before each decode step's model call."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = model(mx.array(prompt), cache=cache)[:, -1]
    out, logits = [], []
    for _ in range(n):
        t = mx.argmax(y, -1)
        out.append(t.item())
        logits.append(y)
        if before is not None:
            before(t[:, None], cache)
        y = model(t[:, None], cache=cache)[:, -1]
    return out, mx.concatenate(logits)


@pytest.fixture(scope="module")
def reference(tiny_moe: Path) -> tuple[Any, list[int], Any]:
    """mlx-lm's own in-RAM model (float32 on CPU, as MLXBackend runs it) and its greedy reply."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    ref, _ = load_model(tiny_moe)
    ref.set_dtype(mx.float32)
    return ref, *greedy(ref)


@pytest.mark.parametrize(
    "slots,policy,decode,prefetch",
    [(6, "lru", True, False), (5, "lru", True, True), (16, "s3fifo", False, False), (4, "lfu", False, False)],
)
def test_moe_streamed_matches_mlx_lm(
    tiny_moe: Path, reference: Any, slots: int, policy: str, decode: bool, prefetch: bool
) -> None:
    """Same greedy tokens, logits within 1e-4, whether the bank holds every expert or fewer than a chunk needs."""
    import mlx.core as mx

    ref, toks_ref, logits_ref = reference
    streamed, stream = streamed_model(tiny_moe, slots, policy, prefetch)
    full_ref, full = ref(mx.array(PROMPT)), streamed(mx.array(PROMPT))
    assert mx.abs(full_ref - full).max().item() <= 1e-4
    if decode:
        toks, logits = greedy(streamed)
        assert toks == toks_ref
        assert mx.abs(logits - logits_ref).max().item() <= 1e-4
        assert not prefetch or stream.stats.prefetched > 0
    assert stream.cache.used_bytes <= stream.cache.capacity_bytes
    assert stream.stats.experts_read > 0


def test_moe_guessing_only_the_layers_that_miss_stays_exact(tiny_moe: Path, reference: Any) -> None:
    """`pf_min_misses`: a layer is guessed only while its decode calls miss that many experts on average. Above
    every layer's average nothing is guessed (no router matvec, no read ahead); at 0 every layer is; between,
    some; the tokens and logits are the in-RAM model's either way."""
    import mlx.core as mx

    _, toks_ref, logits_ref = reference
    guessed = {}
    for floor in (0.0, 0.5, 99.0):
        streamed, stream = streamed_model(tiny_moe, 5, "lru", True)
        stream.pf_min_misses = floor
        streamed(mx.array(PROMPT))
        toks, logits = greedy(streamed)
        assert toks == toks_ref and mx.abs(logits - logits_ref).max().item() <= 1e-4, floor
        assert (stream.miss_avg > 0).any()  # decode calls missed, so there was something to guess
        guessed[floor] = stream.stats.prefetched
    assert guessed[99.0] == 0 < guessed[0.5] < guessed[0.0]  # (the average starts at 0: guessing starts late)


def greedy_predicting(model: Any, stream: Any, n: int = 8) -> tuple[list[int], Any]:
    """`greedy` with the predict pass before each decode step, as engine.decode runs it (`before_step`)."""
    from engine.flash.predict import predict_pass

    return greedy(model, n, before=lambda inputs, cache: predict_pass(model, stream.predictor, inputs, cache))


@pytest.mark.parametrize("units,copier", [(1, False), (6, False), (6, True)])
def test_moe_predict_pass_reads_ahead_and_gives_the_same_tokens(
    tiny_moe: Path, reference: Any, units: int, copier: bool
) -> None:
    """The predict pass (opt-in): each decode token first runs on the resident experts only, its routers' picks
    are read at once (through a pool of `units` staging units, reused as reads land; or copied into the banks as
    on CUDA, landing only when waited for), and the exact pass gives mlx-lm's tokens and logits. Experts read on
    a prediction that the exact pass used count as its misses, not hits."""
    import mlx.core as mx

    from engine.flash.devcopy import HostCopier

    _, toks_ref, logits_ref = reference
    streamed, stream = streamed_model(tiny_moe, 5)
    if copier:
        stream.use_copier(HostCopier(queued=True))
    stream.enable_predict(units)
    toks, logits = greedy_predicting(streamed, stream)
    assert toks == toks_ref and mx.abs(logits - logits_ref).max().item() <= 1e-4
    pr = stream.predictor
    assert pr.passes == 8 and pr.predicted > 0 and 0 < pr.used <= pr.predicted
    assert not pr.pending and sorted(pr._free) == list(range(units))  # every read landed, every unit free
    misses = sum(s.misses for s in stream.cache.stats)
    assert misses >= pr.used  # (the prompt's misses besides)
    assert stream.cache.used_bytes <= stream.cache.capacity_bytes
    stream.close()


def test_moe_a_layer_that_does_not_wait_for_its_predicted_reads_gives_another_answer(
    tiny_moe: Path, reference: Any
) -> None:
    """The control for the test above: with slow reads, and each layer not waiting for its predicted reads
    before its cache access, the answer changes. So the agreement there comes from that wait."""
    import time

    import mlx.core as mx

    _, _, logits_ref = reference
    streamed, stream = streamed_model(tiny_moe, 5)
    stream.enable_predict(6)
    pread = stream.reader._pread

    def slow(*args: Any) -> int:
        time.sleep(0.05)
        return pread(*args)

    stream.reader._pread = slow
    stream.predictor.wait_layer = lambda i: set()
    _, logits = greedy_predicting(streamed, stream)
    assert mx.abs(logits - logits_ref).max().item() > 1e-2
    stream.predictor.wait_layer = type(stream.predictor).wait_layer.__get__(stream.predictor)
    stream.close()


def test_moe_grouped_prefill_is_bit_exact_and_computes_each_pair_once(tiny_moe: Path, reference: Any) -> None:
    """A chunk needing more experts than the bank (4 slots): on the CPU each group computes only its own
    (token, k) pairs, and the logits are the in-RAM model's to the bit, as with a bank holding them all."""
    import mlx.core as mx

    from engine.cpu_fast import CPU_PARTS, cpu_streams
    from engine.flash import moe

    ref = reference[0]
    calls: list[int] = []
    glu = moe.StreamedSwitchGLU._glu

    def counting(self: Any, x: Any, idx: Any, shape: tuple[int, ...], stream: Any = None) -> Any:
        calls.append(idx.size)
        return glu(self, x, idx, shape, stream)

    moe.StreamedSwitchGLU._glu = counting  # type: ignore[method-assign]
    try:
        streamed, stream = streamed_model(tiny_moe, 4)
        out = streamed(mx.array(PROMPT))
    finally:
        moe.StreamedSwitchGLU._glu = glu  # type: ignore[method-assign]
    assert mx.array_equal(out, ref(mx.array(PROMPT))).item()
    whole, _ = streamed_model(tiny_moe, 64)
    assert mx.array_equal(out, whole(mx.array(PROMPT))).item()
    pairs = mx.array(PROMPT).size * moe.top_k_of(streamed)
    assert len(cpu_streams()) == min(CPU_PARTS, os.cpu_count() or 1)  # the pairs spread over the cores
    assert len(calls) > 3  # grouped: more than one group in some layer
    assert sum(calls) == 3 * pairs  # every (token, k) pair of each of the 3 MoE layers computed once


def test_moe_a_layers_one_miss_is_read_in_parts_and_many_misses_whole(tiny_moe: Path, reference: Any) -> None:
    """A decode layer's misses are cut into preadv parts only as far as they leave reader threads idle: one miss
    on 4 threads in parts (the disk queue stays deep), 4 or more whole (fewer calls queued on the compute
    thread's critical path). `split_by_misses=False` cuts every read the same. The tokens stay mlx-lm's."""
    import mlx.core as mx

    def parts_by_misses(split: bool) -> dict[int, set[int]]:
        streamed, stream = streamed_model(tiny_moe, 4)
        stream.read_chunk, stream.split_by_misses = (
            16 << 10,
            split,
        )  # the 512 KB floor would bind on tiny experts
        assert stream.unit_bytes >= 4 * (16 << 10) and stream.reader.threads == 4
        seen: dict[int, set[int]] = {}
        load, read = stream._load, stream.reader.read
        layer_misses = [0]

        def counted_load(i: int, misses: list, *rest: Any) -> None:
            layer_misses[0] = len(misses)
            load(i, misses, *rest)

        def counted_read(*args: Any, **kw: Any) -> Any:
            fut = read(*args, **kw)
            seen.setdefault(layer_misses[0], set()).add(len(fut.parts))
            return fut

        stream._load, stream.reader.read = counted_load, counted_read
        toks, _ = greedy(streamed)
        assert toks == reference[1]
        mx.eval(streamed(mx.array(PROMPT)))  # a prefill too: many misses a layer
        return seen

    split = parts_by_misses(True)
    assert 1 in split and max(split) >= 4, split
    assert min(split[1]) > 1  # one miss: several parts
    assert all(p == {1} for n, p in split.items() if n >= 4)  # a thread each: whole
    fixed = parts_by_misses(False)
    assert len(set().union(*fixed.values())) == 1 and min(fixed[1]) > 1  # the same cut whatever the misses


def test_moe_prefill_reads_each_distinct_expert_once(tiny_moe: Path) -> None:
    import mlx.core as mx

    streamed, stream = streamed_model(tiny_moe, 16)
    streamed(mx.array(PROMPT))
    distinct = sum(len(ids) for _, ids in stream.stats.trace)
    assert stream.stats.experts_read == distinct
    assert stream.stats.host_syncs == 3  # one per MoE layer for the whole 40-token chunk


def test_moe_lower_top_k_is_opt_in_and_reads_less(tiny_moe: Path) -> None:
    import mlx.core as mx

    from engine.flash.moe import moe_blocks

    streamed, stream = streamed_model(tiny_moe, 16)
    assert all(b.top_k == 4 for _, b in moe_blocks(streamed))
    for _, b in moe_blocks(streamed):
        b.top_k = 2
    streamed(mx.array([[5, 6, 7]]))
    assert all(len(ids) <= 6 for _, ids in stream.stats.trace)


def _trace(rng: np.random.Generator, skewed: bool, n: int = 400) -> list[tuple[int, list[int]]]:
    p = 1.0 / np.arange(1, 65) ** (1.2 if skewed else 0.0)
    p /= p.sum()
    return [(t % 4, sorted(set(rng.choice(64, size=8, replace=False, p=p).tolist()))) for t in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_expert_cache_never_exceeds_its_budget(policy: str) -> None:
    rng = np.random.default_rng(0)
    budget = 50_000_000
    cache = ExpertCache.for_budget(
        budget, n_layers=4, n_experts=64, unit_bytes=1_000_000, min_slots=8, policy=policy
    )
    assert cache.capacity_bytes <= budget and cache.slots == 12
    for layer, ids in _trace(rng, skewed=True):
        res = cache.access(layer, ids)
        assert [k for k, _, _ in res] == ids
        slots = [s for _, s, _ in res]
        assert len(set(slots)) == len(slots) and all(0 <= s < cache.slots for s in slots)
        assert all(cache.layers[layer].slot[k] == s for k, s, _ in res)
        assert cache.used_bytes <= cache.capacity_bytes <= budget


@pytest.mark.parametrize("policy", POLICIES)
def test_expert_cache_forgets_experts_whose_load_failed(policy: str) -> None:
    """Forgotten experts (their read failed) free their slots and miss on the next access; the cache stays
    consistent under every policy, with its slots distinct and its size within the capacity."""
    rng = np.random.default_rng(2)
    cache = ExpertCache(n_layers=4, slots=12, unit_bytes=1, policy=policy)
    for n, (layer, ids) in enumerate(_trace(rng, skewed=True)):
        res = cache.access(layer, ids)
        if n % 7 == 0:  # a failed load: none of this call's misses arrived
            lost = [k for k, _, hit in res if not hit]
            cache.forget(layer, lost)
            assert not set(lost) & set(cache.layers[layer].slot)
            assert all(not hit for k, _, hit in cache.access(layer, ids) if k in lost)
        pol = cache.layers[layer]
        assert len(pol.slot) + len(pol.free) == cache.slots
        assert sorted([*pol.slot.values(), *pol.free]) == list(range(cache.slots))


def test_expert_cache_refuses_a_budget_below_one_token() -> None:
    from engine.base import BudgetError

    with pytest.raises(BudgetError, match="raise --memory-budget"):
        ExpertCache.for_budget(10_000_000, n_layers=4, n_experts=64, unit_bytes=1_000_000, min_slots=8)


def test_expert_cache_skew_raises_hit_rates() -> None:
    rng = np.random.default_rng(1)
    uni = {p: simulate(_trace(rng, False), 4, 16, p)["hit_rate"] for p in POLICIES}
    skew = {p: simulate(_trace(rng, True), 4, 16, p)["hit_rate"] for p in POLICIES}
    assert all(skew[p] > uni[p] for p in POLICIES)
    assert all(0.1 < uni[p] < 0.4 for p in POLICIES)  # 16 of 64 slots, uniform routing: ~25%


def test_moe_gguf_export_has_the_same_weights(tiny_moe: Path, tmp_path: Path) -> None:
    import mlx.core as mx

    from engine.flash.synth_moe import export_gguf_moe

    gguf = export_gguf_moe(tiny_moe, tmp_path / "m.gguf", progress=False)
    meta = json.loads((tiny_moe / "flashcode.json").read_text())
    assert meta["source_gguf"] == str(gguf.resolve())  # --backend llama serves the model from it
    g = mx.load(str(gguf))
    src = mx.load(str(tiny_moe / "model.safetensors"))
    for name, mod in (
        ("blk.1.ffn_down_exps", "model.layers.1.mlp.switch_mlp.down_proj"),
        ("blk.0.attn_q", "model.layers.0.self_attn.q_proj"),
    ):
        got = mx.dequantize(
            g[f"{name}.weight"], g[f"{name}.scales"], g[f"{name}.biases"], group_size=32, bits=4
        )
        want = mx.dequantize(
            src[f"{mod}.weight"], src[f"{mod}.scales"], src[f"{mod}.biases"], group_size=64, bits=4
        )
        assert mx.array_equal(got, want)
    assert mx.array_equal(g["blk.2.ffn_gate_inp.weight"], src["model.layers.2.mlp.gate.weight"])


def test_flash_backend_serves_a_moe_split_like_mlx(tiny_moe: Path) -> None:
    """FlashBackend detects the MoE split: same greedy tokens as MLXBackend, hit rate and bytes in the stats."""
    import threading

    from engine.base import Done, GenerationRequest, ModelInfo, SamplingParams
    from engine.flash.backend import FlashBackend
    from engine.mlx_backend import MLXBackend

    req = GenerationRequest(prompt="Once upon a time", sampling=SamplingParams(temperature=0.0, max_tokens=6))
    info = ModelInfo("moe-tiny", tiny_moe, "qwen3_moe", 0, split_path=tiny_moe / "split")
    runs = {}
    for backend in (MLXBackend(), FlashBackend(memory_budget=60_000_000, runtime_bytes=0)):
        backend.load(info)
        events = list(backend.stream(req, threading.Event()))
        runs[backend.name] = [t for ev in events for t in getattr(ev, "token_ids", [])], events[-1]
        backend.close()
    (ram, _), (flash, done) = runs["mlx"], runs["flash"]
    assert flash == ram and len(ram) == 6
    assert isinstance(done, Done)
    extra = done.stats.extra
    assert 0.0 <= extra["hit_rate"] <= 1.0 and extra["bytes_read"] > 0
    assert extra["expert_cache"]["used_bytes"] <= extra["expert_cache"]["capacity_bytes"] < 60_000_000


def test_flash_backend_runs_the_predict_pass_before_each_decode_step(tiny_moe: Path) -> None:
    """`FlashBackend(expert_predict=N)`: the pass runs before each decode step of a reply (engine.decode's
    `before_step`), the tokens are the plain engine's, and the reply's stats say what it read ahead."""
    import threading

    from engine.base import GenerationRequest, ModelInfo, SamplingParams
    from engine.flash.backend import FlashBackend

    req = GenerationRequest(prompt="Once upon a time", sampling=SamplingParams(temperature=0.0, max_tokens=6))
    info = ModelInfo("moe-tiny", tiny_moe, "qwen3_moe", 0, split_path=tiny_moe / "split")
    runs = {}
    for predict in (0, 4):
        backend = FlashBackend(memory_budget=60_000_000, runtime_bytes=0, expert_predict=predict)
        backend.load(info)
        assert backend.plan is not None
        staging = backend.plan.experts - backend.expert_stream.cache.capacity_bytes
        unit = backend.expert_stream.unit_bytes
        events = list(backend.stream(req, threading.Event()))
        runs[predict] = (
            [t for ev in events for t in getattr(ev, "token_ids", [])],
            events[-1].stats.extra,
            staging,
        )
        backend.close()
    (plain, _, staging0), (predicted, extra, staging4) = runs[0], runs[4]
    assert predicted == plain and len(plain) == 6
    assert extra["predict_passes"] == 5  # one per token after the first
    assert 0 < extra["experts_predicted_used"] <= extra["experts_predicted"]
    assert staging4 - staging0 == 4 * unit  # the pool is in the budget


def test_a_moe_context_is_4096_unless_asked_and_the_fix_says_so(tiny_moe: Path, caplog) -> None:
    """A MoE model gets 4096 tokens of context whatever the budget (the rest holds experts): said as that, with
    --ctx-size as the fix (it said "raise --memory-budget", even under a 10 TB budget), and a --ctx-size the
    budget can hold is given whole (it was cut to 4096 too)."""
    import logging
    import threading

    from engine.base import ContextLimitError, GenerationRequest, ModelInfo, SamplingParams
    from engine.flash.backend import FlashBackend

    info = ModelInfo("moe-tiny", tiny_moe, "qwen3_moe", 0, split_path=tiny_moe / "split")
    roomy = FlashBackend(memory_budget=10**13, runtime_bytes=0)
    with caplog.at_level(logging.WARNING, logger="engine.flash.backend"):
        roomy.load(info)
    try:
        assert roomy.context_length == 4096
        assert "a MoE model gets a 4096-token context of the model's 8192" in caplog.text
        assert "raise --memory-budget" not in caplog.text
        assert "more than this machine's memory" in caplog.text  # 10 TB is no limit: said
        req = GenerationRequest(prompt="word " * 4200, sampling=SamplingParams(max_tokens=2))
        with pytest.raises(ContextLimitError, match="--ctx-size"):
            list(roomy.stream(req, threading.Event()))
    finally:
        roomy.close()
    asked = FlashBackend(memory_budget=10**13, runtime_bytes=0, context_length=6000)
    asked.load(info)
    try:
        assert asked.context_length == 6000
    finally:
        asked.close()


def test_lossy_moe_options_are_said_at_load_and_in_each_reply(tiny_moe: Path, caplog) -> None:
    """--top-k-experts below the model's and --routing-bias are said at load and in every reply's stats (the
    footer shows them); a top-k not below the model's, or MoE options on a model with no experts, are said as
    ignored (they ran silently)."""
    import html
    import logging
    import threading
    from types import SimpleNamespace

    from engine.base import Done, GenerationRequest, ModelInfo, SamplingParams
    from engine.flash.backend import FlashBackend
    from webapp.render import make_environment

    info = ModelInfo("moe-tiny", tiny_moe, "qwen3_moe", 0, split_path=tiny_moe / "split")
    req = GenerationRequest(prompt="Once upon a time", sampling=SamplingParams(temperature=0.0, max_tokens=3))
    lossy = FlashBackend(memory_budget=60_000_000, runtime_bytes=0, top_k=1, routing_bias=1.0)
    with caplog.at_level(logging.WARNING, logger="engine.flash.backend"):
        lossy.load(info)
    try:
        done = list(lossy.stream(req, threading.Event()))[-1]
    finally:
        lossy.close()
    assert isinstance(done, Done)
    said = "1 of the model's 4 experts a token; cache-aware routing (bias 1)"
    assert done.stats.extra["lossy"] == said and f"lossy options on: {said}" in caplog.text
    footer = (
        make_environment()
        .get_template("macros.html")
        .module.stats_footer(  # type: ignore[attr-defined]
            SimpleNamespace(
                id=1, status="complete", stats={"completion_tokens": 3, "extra": done.stats.extra}
            )
        )
    )
    assert 'data-stat="lossy"' in footer and f"Lossy: {said}" in html.unescape(footer)
    caplog.clear()
    exact = FlashBackend(memory_budget=60_000_000, runtime_bytes=0, top_k=4)
    with caplog.at_level(logging.WARNING, logger="engine.flash.backend"):
        exact.load(info)
    try:
        assert "lossy" not in list(exact.stream(req, threading.Event()))[-1].stats.extra
    finally:
        exact.close()
    assert "--top-k-experts 4 is not fewer than the model's 4: the model's own routing runs" in caplog.text


@pytest.mark.parametrize(
    "name",
    [
        "flash-moe-gpu.json",
        "flash-moe-gpu-h200.json",
        "flash-moe-gpu-h100.json",
        "flash-moe-gpu-064af62.json",
        "flash-moe-gpu-direct-first.json",
        "flash-moe-gpu-deferred.json",
        "flash-moe-gpu-build.json",
        "flash-moe-gpu-graphs.json",
        "flash-moe-gpu-graphs-h200.json",
        "flash-moe-gpu-speculation-skewed.json",
        "flash-moe-gpu-speculation-uniform.json",
        "flash-moe-cpu-chunks.json",  # the same script on this CPU
        "flash-moe-predict-cpu.json",  # ... with the predict pass beside it
    ],
)
def test_gpu_results_recompute_from_their_runs(name: str) -> None:
    """bench/results/flash-moe-gpu.json is bench/flash_moe.py's output: its summary keys recompute from the
    raw runs (median of the repeats against the same invocation's best disk probe and in-memory run), and
    every flash run gave the in-memory tokens."""
    import json

    from bench.flash_moe import ceiling_of

    result = json.loads((Path(__file__).resolve().parent.parent / "bench/results" / name).read_text())
    assert result["command"].startswith("bench/flash_moe.py") and result["git_commit"] and result["machine"]
    assert set(result["runs"]) <= {"skewed", "uniform"} and result["runs"]
    for routing, run in result["runs"].items():
        tps = [f["decode_tps"] for f in run["flash_runs"]]
        assert len(tps) == result["repeats"] and run["decode_tps"] == sorted(tps)[(len(tps) - 1) // 2]
        if "bandwidth_probes" in run:  # the disk limit: the best of the probes (written before: one probe)
            assert run["bandwidth"] == max(run["bandwidth_probes"], key=lambda b: b["bandwidth_Bps"])
            assert len(run["bandwidth_probes"]) > 1
        args = (run["bandwidth"]["bandwidth_Bps"], run["routed_bytes_per_token"], run["ram"]["decode_tps"])
        assert result[f"ceiling_ratio_{routing}"] == round(
            run["decode_tps"] / ceiling_of(run["flash"], *args), 3
        )
        assert run["ceiling_ratio_runs"] == [
            round(f["decode_tps"] / ceiling_of(f, *args), 3) for f in run["flash_runs"]
        ]
        profiled = [run["profile"]] if "profile" in run else []
        flash = [*run["flash_runs"], *run.get("warmup_runs", []), *profiled, *run.get("compare", {}).values()]
        assert all(
            f["tokens"] == run["ram"]["tokens"] and len(f["tokens"]) == result["tokens"] for f in flash
        )
    assert result["same_tokens_as_ram"] is True


def test_bench_compare_flags_that_name_a_variable_set_the_runs_environment() -> None:
    """`--compare "nographs:MLX_USE_CUDA_GRAPHS=0 --io-threads 8"`: MLX reads some switches only from the
    environment, so NAME=VALUE flags go there (ours kept) and the rest stay engine flags."""
    from bench.flash_moe import split_env

    env, flags = split_env(("MLX_USE_CUDA_GRAPHS=0", "--io-threads", "8", "--x=1", "A_B2=c=d"))
    assert flags == ("--io-threads", "8", "--x=1")
    assert env["MLX_USE_CUDA_GRAPHS"] == "0" and env["A_B2"] == "c=d"
    assert env["PATH"] == os.environ["PATH"] and "PYTHONPATH" in env
    assert split_env(("--pipeline", "legacy"))[1] == ("--pipeline", "legacy")


def test_bench_summary_says_the_most_an_engine_reading_after_its_router_can_reach() -> None:
    """`serial_bound_ratio`: with reads started only once a layer's router has chosen, reads and the rest
    of a token take turns, so at best 1 / (1/I/O + 1/compute) tok/s. On each headline's own numbers that is
    under 0.8 of the ceiling for skewed routing (flash-moe-gpu.json, H100: 0.75; flash-moe-gpu-h200.json: 0.61,
    0.74 with the uniform run's faster in-memory speed, docs/flash-moe.md): the 0.8 goal is out of reach of any
    engine that does not read on a guess."""
    import json

    from bench.flash_moe import summarize

    results = Path(__file__).resolve().parent.parent / "bench/results"
    bounds = {
        ("flash-moe-gpu.json", "skewed"): 0.753,
        ("flash-moe-gpu.json", "uniform"): 0.913,
        ("flash-moe-gpu-h200.json", "skewed"): 0.607,
        ("flash-moe-gpu-h200.json", "uniform"): 0.952,
    }
    for (name, routing), bound in bounds.items():
        run = json.loads((results / name).read_text())["runs"][routing]
        raw = {k: run[k] for k in ("flash", "ram", "bandwidth", "flash_runs")}
        got = summarize(raw, run["routed_bytes_per_token"])
        io, compute = got["io_ceiling_tps"], got["compute_ceiling_tps"]
        assert got["serial_bound_tps"] == pytest.approx(io * compute / (io + compute))
        assert got["serial_bound_ratio"] == bound
        assert got["ceiling_ratio"] == run["ceiling_ratio"] < got["serial_bound_ratio"]
