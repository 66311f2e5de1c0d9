"""The expert sniper on every SwitchGLU family it claims, and its opt-in cache-aware routing.

Each architecture is a tiny random model built from mlx-lm's own classes, quantized to 4 bits,
saved as an mlx-lm directory and split; the streamed model (a bank smaller than the experts, so
experts are read and evicted) must give mlx-lm's in-RAM logits and greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

PROMPT = [[1, 5, 300, 77, 400, 5, 12, 44, 100, 3] * 4]  # 40 tokens: the sorted gather path
COMMON = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 16},
    "qwen3_moe": {  # layer 1 is a dense MLP (`mlp_only_layers`): streamed as FFN pieces beside the experts
        "intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "head_dim": 16, "max_position_embeddings": 4096,
        "norm_topk_prob": True,
    },
    "qwen3_next": {
        "intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "shared_expert_intermediate_size": 64, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096, "full_attention_interval": 2, "norm_topk_prob": True,
    },
}  # fmt: skip


def make_model(arch: str, out: Path) -> Path:
    """A random 4-bit mlx-lm model directory of `arch` (router included in the quantization where it fits)."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    mx.random.seed(7)
    config = {"model_type": arch, **COMMON, **CONFIGS[arch]}
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    # random weights at a useful scale (the default init of a 64-wide model is fine), then 4-bit
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith("gate"),
    )
    config["quantization"] = {"group_size": 32, "bits": 4}
    out.mkdir(parents=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (out / "config.json").write_text(json.dumps(config))
    return out


def streamed(model_dir: Path, slots: int, routing_bias: float = 0.0, prefetch: int = 0) -> tuple[Any, Any]:
    """The split model as FlashBackend builds it (`stream_model`), with `slots` experts per layer's bank."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.flash.backend import cast_pinned, stream_model
    from engine.flash.budget import plan_budget
    from engine.flash.inplace import open_reader
    from engine.flash.moe import expert_units, resident_expert_bytes
    from engine.flash.split import load_manifest

    man = load_manifest(model_dir / "split")
    obj, _ = load_model(man.weights_root, lazy=True, strict=False)
    plan = plan_budget(man, None, 2, 256, 128)
    unit = max(u.padded for u in man.units if u.kind == "expert")
    layers = len(expert_units(man))
    # load_experts' staging for top-2 (+ the guessed reads' regions)
    staging = (2 + prefetch) * 2 * unit + (0 if man.dense_units() else -plan.buffers)
    budget = (
        plan.fixed
        + 256 * plan.per_token
        + max(0, staging)
        + slots * layers * resident_expert_bytes(expert_units(man))
    )
    _, experts = stream_model(
        obj,
        man,
        open_reader(man),
        plan,
        budget,
        verify=True,
        routing_bias=routing_bias,
        expert_prefetch=prefetch,
    )
    assert experts.cache.slots == slots
    experts.record = True
    cast_pinned(obj)
    mx.eval(obj.parameters())
    return obj, experts


def greedy(model: Any, n: int = 6) -> tuple[list[int], Any]:
    from tests.test_flash_moe import greedy as greedy_on

    return greedy_on(model, n, PROMPT)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_streamed_experts_match_mlx_lm_for(arch: str, tmp_path: Path, model_home: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.flash.split import load_manifest, split_model

    model_dir = make_model(arch, tmp_path / arch)
    split_model(model_dir, progress=False)
    man = load_manifest(model_dir / "split")
    moe_layers = 4 - len(CONFIGS[arch].get("mlp_only_layers", []))
    assert (
        sum(u.kind == "expert" for u in man.units) == moe_layers * 8
    )  # every MoE layer's 8 experts are units
    assert len(man.dense_units()) == 4 - moe_layers
    assert not any("switch_mlp" in n for n in man.pinned_tensors)
    ref, _ = load_model(model_dir)
    ref.set_dtype(mx.float32)
    model, stream = streamed(model_dir, slots=3)  # 3 of 8 experts per layer: reads and evictions
    assert mx.abs(ref(mx.array(PROMPT)) - model(mx.array(PROMPT))).max().item() <= 1e-4
    toks_ref, logits_ref = greedy(ref)
    toks, logits = greedy(model)
    assert toks == toks_ref
    assert mx.abs(logits - logits_ref).max().item() <= 1e-4
    assert (
        stream.stats.experts_read > 3 * moe_layers and stream.cache.used_bytes <= stream.cache.capacity_bytes
    )


def decode_hit_rate(model: Any, stream: Any, n: int) -> tuple[float, list[int]]:
    """Prefill PROMPT, then the hit rate over `n` greedy decode steps only."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = model(mx.array(PROMPT), cache=cache)[:, -1]
    h0, m0 = sum(s.hits for s in stream.cache.stats), sum(s.misses for s in stream.cache.stats)
    toks = []
    for _ in range(n):
        t = mx.argmax(y, -1)
        toks.append(t.item())
        y = model(t[:, None], cache=cache)[:, -1]
    hits = sum(s.hits for s in stream.cache.stats) - h0
    misses = sum(s.misses for s in stream.cache.stats) - m0
    return hits / (hits + misses), toks


def test_cache_aware_routing_is_opt_in_lossy_and_raises_the_hit_rate(
    tmp_path: Path, model_home: Path
) -> None:
    """A logit bonus for resident experts: more hits, fewer reads; the answer may change, so it is off by default."""
    from engine.flash.moe import CacheAwareRouter, moe_blocks
    from engine.flash.split import split_model

    model_dir = make_model("olmoe", tmp_path / "olmoe")
    split_model(model_dir, progress=False)
    rates = {}
    for bias in (0.0, 2.0, 1e4):
        model, stream = streamed(model_dir, slots=3, routing_bias=bias)
        rates[bias], _ = decode_hit_rate(model, stream, 12)
    assert rates[2.0] > rates[0.0], rates
    assert rates[1e4] == 1.0  # a huge bonus keeps every top-k inside the resident set: no reads at all
    plain, _ = streamed(model_dir, slots=3)
    assert not any(isinstance(b.gate, CacheAwareRouter) for _, b in moe_blocks(plain))  # off unless asked


def test_routing_bias_must_not_be_negative(tmp_path: Path, model_home: Path) -> None:
    from engine.flash.budget import plan_budget
    from engine.flash.inplace import open_reader
    from engine.flash.moe import load_experts
    from engine.flash.split import load_manifest, split_model

    model_dir = make_model("olmoe", tmp_path / "olmoe")
    split_model(model_dir, progress=False)
    man = load_manifest(model_dir / "split")
    from mlx_lm.utils import load_model

    obj, _ = load_model(man.weights_root, lazy=True, strict=False)
    with pytest.raises(ValueError, match="routing_bias must be >= 0"):
        load_experts(obj, man, open_reader(man), plan_budget(man, None, 1, 256, 128), None, routing_bias=-1.0)


def test_lazy_bank_updates_give_the_same_answer(tmp_path: Path, model_home: Path) -> None:
    """The GPU path (bank updates joined to the layer's graph, the layer started with async_eval) is exact too."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.flash.split import split_model

    model_dir = make_model("mixtral", tmp_path / "mixtral")
    split_model(model_dir, progress=False)
    ref, _ = load_model(model_dir)
    ref.set_dtype(mx.float32)
    model, stream = streamed(model_dir, slots=3)
    stream.host_writes = False
    toks_ref, logits_ref = greedy(ref)
    toks, logits = greedy(model)
    assert toks == toks_ref and mx.abs(logits - logits_ref).max().item() <= 1e-4
    assert stream.stats.experts_read > 3 * 4


def qwen3_next_reference(tmp_path: Path) -> tuple[Path, list[int], Any]:
    """A split tiny `qwen3_next` and mlx-lm's own greedy tokens and logits on it (float32, in RAM)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.flash.split import split_model

    model_dir = make_model("qwen3_next", tmp_path / "qwen3_next")
    split_model(model_dir, progress=False)
    ref, _ = load_model(model_dir)
    ref.set_dtype(mx.float32)
    return (model_dir, *greedy(ref))


def test_the_predict_pass_is_refused_where_it_cannot_be_exact(tmp_path: Path, model_home: Path) -> None:
    """--expert-predict rolls the KV cache back after its pass and writes experts into bank memory from reader
    threads: refused at load for a model whose cache cannot be rolled back (qwen3_next's recurrent layers), and
    on a device path that replaces the bank arrays (their addresses would go stale: the tokens changed)."""
    from engine.flash.devcopy import HostCopier
    from engine.flash.predict import check_model

    model_dir, _, _ = qwen3_next_reference(tmp_path)
    model, stream = streamed(model_dir, slots=3)
    with pytest.raises(ValueError, match="ArraysCache cannot: leave --expert-predict off"):
        check_model(model)
    stream.use_copier(HostCopier(queued=True))
    stream.pipeline = "threaded"
    with pytest.raises(ValueError, match="needs the direct device path, not --pipeline threaded"):
        stream.enable_predict(2)
    stream.pipeline = "direct"
    stream.enable_predict(2)
    stream.pipeline = "overlap"  # changed after: the pass checks again before it writes anything
    with pytest.raises(ValueError, match="not --pipeline overlap"):
        stream.predictor.begin()
    stream.pipeline = "direct"
    stream.close()


@pytest.mark.parametrize(
    "pipeline,prefetch",
    [("threaded", 0), ("threaded", 2), ("overlap", 1), ("legacy", 1), ("direct", 0), ("direct", 2)],
)  # fmt: skip
def test_device_pipelines_give_the_same_answer(
    pipeline: str, prefetch: int, tmp_path: Path, model_home: Path
) -> None:
    """The device paths — each expert copied as its read lands (overlap), after all (legacy), on a copy thread
    (threaded) or byte for byte into its bank slot from its staging (direct: CUDA's copies on the GPU, memmove
    here), with the exact multi-layer guess-ahead read in the router's own sync — give mlx-lm's tokens and
    logits, profiled or not. Its copies land only when waited for, as on a CUDA stream."""
    import mlx.core as mx

    from engine.flash.devcopy import HostCopier

    model_dir, toks_ref, logits_ref = qwen3_next_reference(tmp_path)
    syncs: set[int] = set()
    for profile in (False, True):
        model, stream = streamed(model_dir, slots=3, prefetch=prefetch)
        if pipeline == "direct":
            stream.use_copier(HostCopier(queued=True))
            assert stream.pipeline == "direct" and not stream.host_writes
        else:
            stream.host_writes, stream.pipeline = False, pipeline
        stream.profile = profile
        toks, logits = greedy(model)
        assert toks == toks_ref and mx.abs(logits - logits_ref).max().item() <= 1e-4
        assert stream.stats.experts_read > 3 * 4
        # only grouped prefill adds syncs, never the guesses
        syncs.add(stream.stats.host_syncs - stream.stats.calls)
        if prefetch:
            assert stream.stats.prefetched > 0 and stream.stats.prefetch_used > 0
        prof = stream.prof.snapshot()
        assert prof["calls"] == stream.stats.calls and prof["router"] > 0 and prof["read_wait"] > 0
        assert (prof["wait_input"] > 0) == profile
        stream.close()
    plain, plain_stream = streamed(model_dir, slots=3)
    greedy(plain)
    assert syncs == {plain_stream.stats.host_syncs - plain_stream.stats.calls}


def test_a_layer_computed_before_its_copies_land_gives_another_answer(
    tmp_path: Path, model_home: Path
) -> None:
    """The control for the test above: when each wait lands only the copies queued before the previous one (a
    layer computed before its own copies land), the answer changes. So the direct path's agreement with mlx-lm
    there comes from waiting before the compute."""
    import ctypes

    import mlx.core as mx

    from engine.flash.devcopy import HostCopier

    class OneWaitLate(HostCopier):
        def __init__(self) -> None:
            super().__init__(queued=True)
            self.held: list[tuple[int, int, int]] = []

        def wait(self) -> None:
            with self._lock:
                now, self.held, self._todo = self.held, self._todo, []
            for dst, src, nbytes in now:
                ctypes.memmove(dst, src, nbytes)

    model_dir, _, logits_ref = qwen3_next_reference(tmp_path)
    model, stream = streamed(model_dir, slots=3)
    stream.use_copier(OneWaitLate())
    _, logits = greedy(model)
    assert stream.stats.experts_read > 3 * 4
    assert mx.abs(logits - logits_ref).max().item() > 1e-2
    stream.close()


@pytest.mark.parametrize("pipeline", ["host", "direct", "threaded"])
def test_a_failed_expert_read_leaves_nothing_running_and_nothing_stale(
    pipeline: str, tmp_path: Path, model_home: Path
) -> None:
    """An expert read that fails (a disk error) raises out of the forward pass only once the layer's other
    reads have finished (the staging they write into is reused next), and the experts of that call are not
    left resident with bytes that never arrived: the next reply reads them again and gives mlx-lm's answer."""
    import threading
    from concurrent.futures import Future

    import mlx.core as mx

    from engine.flash.devcopy import HostCopier

    model_dir, toks_ref, logits_ref = qwen3_next_reference(tmp_path)
    model, stream = streamed(model_dir, slots=3)
    if pipeline == "direct":
        stream.use_copier(HostCopier(queued=True))
    elif pipeline == "threaded":
        stream.host_writes, stream.pipeline = False, "threaded"
    real_read, issued = stream.reader.read, []

    def failing_read(buf: Any, offset: int, length: int, *args: Any, **kwargs: Any) -> Future[float]:
        out: Future[float] = Future()
        if not issued:  # the first read fails at once; the layer's others land 0.3 s later
            out.set_exception(OSError("injected: input/output error"))
        else:

            def late() -> None:
                real = real_read(buf, offset, length, *args, **kwargs)
                real.add_done_callback(lambda f: out.set_result(f.result()))

            threading.Timer(0.3, late).start()
        issued.append(out)
        return out

    stream.reader.read = failing_read
    with pytest.raises(OSError, match="injected"):
        greedy(model)
    assert len(issued) > 1 and all(f.done() for f in issued)
    first = stream.stats.trace[0]
    assert not set(first[1]) & set(stream.cache.layers[first[0]].slot)  # none of them resident
    stream.reader.read = real_read
    toks, logits = greedy(model)
    assert toks == toks_ref and mx.abs(logits - logits_ref).max().item() <= 1e-4
    stream.close()
