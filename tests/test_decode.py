"""engine.decode: each token handed out before the next step is built, with mlx-lm's very tokens.

The flash engine computes a step while it builds it (streamed weights are read, MoE routers read back),
so mlx-lm's loop (build step n+1, then yield token n) made every token, the first included, a whole
step late and computed one step past every reply. These run the real default model and a real
streamed MoE split.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from engine.base import Done, GenerationRequest, ModelInfo, SamplingParams

REQUESTS = [  # (request, how it ends)
    (GenerationRequest(messages=[{"role": "user", "content": "Say hi in three words."}],
                       sampling=SamplingParams(temperature=0.0, max_tokens=40)), "stop"),  # on EOS
    (GenerationRequest(prompt="The capital of France is",
                       sampling=SamplingParams(temperature=0.0, max_tokens=12)), "length"),
    (GenerationRequest(prompt="Once upon a time",
                       sampling=SamplingParams(temperature=0.9, max_tokens=16, seed=7)), "length"),
    (GenerationRequest(prompt="1, 2, 3,",
                       sampling=SamplingParams(temperature=0.0, max_tokens=12, stop=(" 6",))), "stop"),
]  # fmt: skip


def run(backend: Any, req: GenerationRequest) -> tuple[list[int], Done]:
    events = list(backend.stream(req, threading.Event()))
    ids = [t for ev in events for t in getattr(ev, "token_ids", [])]
    done = events[-1]
    assert isinstance(done, Done) and done.error is None
    return ids, done


@pytest.mark.parametrize(("req", "finish"), REQUESTS, ids=["eos", "length", "sampled", "stop-string"])
def test_yield_first_gives_mlx_lms_tokens_and_text(
    mlx_backend: Any, req: GenerationRequest, finish: str
) -> None:
    """Greedy, sampled (seeded), a reply that ends on EOS and one cut by a stop string: the same ids,
    text and finish either way; the yield-first loop runs one forward pass fewer."""
    got = {}
    try:
        for first in (False, True):
            mlx_backend.yield_first = first
            mlx_backend.prompt_cache.reset()  # both from the same (empty) cache
            ids, done = run(mlx_backend, req)
            got[first] = (
                ids,
                done.text,
                done.finish_reason,
                done.stats.completion_tokens,
                mlx_backend.last_passes,
            )
    finally:
        mlx_backend.yield_first = False
    assert got[True][:4] == got[False][:4]
    assert got[True][0], "the reply is empty: nothing was compared"
    assert got[True][2] == finish
    assert got[True][4] == got[False][4] - 1


def test_yield_first_passes_the_whole_history_to_logits_processors(mlx_backend: Any) -> None:
    """A logits processor sees the same token history at every step in both loops."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from engine.decode import stream_generate_yield_first

    prompt = mx.array(mlx_backend.encode_raw("def add(a, b):"))
    seen: dict[str, list[list[int]]] = {"mlx-lm": [], "yield-first": []}

    def recorder(name: str) -> Any:
        def processor(tokens: Any, logits: Any) -> Any:
            seen[name].append(tokens.tolist())
            return logits

        return processor

    for name, generate in (("mlx-lm", stream_generate), ("yield-first", stream_generate_yield_first)):
        for _ in generate(mlx_backend.model_obj, mlx_backend.tokenizer, prompt, max_tokens=6,
                          sampler=make_sampler(temp=0.0), logits_processors=[recorder(name)]):  # fmt: skip
            pass
    # mlx-lm's loop ran one step more (built before its last token was handed out)
    assert seen["yield-first"] == seen["mlx-lm"][:-1] and len(seen["yield-first"]) == 6
    assert seen["yield-first"][0] == prompt.tolist()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Path:
    from engine.flash.split import split_model
    from engine.flash.synth_moe import synth_moe

    model = synth_moe("moe-tiny", tmp_path_factory.mktemp("moe") / "m", skew=2.0, progress=False)
    split_model(model, progress=False)
    return model


def test_flash_hands_each_token_out_before_computing_the_next(tiny_moe: Path) -> None:
    """On a streamed MoE split, count the forward passes (MoE layer calls / layers) at each response:
    yield-first hands token k out after the prompt's passes + k; mlx-lm's loop had computed one more."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from engine.decode import stream_generate_yield_first
    from engine.flash.backend import FlashBackend

    backend = FlashBackend(memory_budget=60_000_000, runtime_bytes=0)
    backend.load(ModelInfo("moe-tiny", tiny_moe, "qwen3_moe", 0, split_path=tiny_moe / "split"))
    try:
        es = backend.expert_stream
        layers = len(es.layers)
        prompt = mx.array(backend.encode_raw("Once upon a time there was"))
        seen: dict[str, list[float]] = {}
        for name, generate in (("mlx-lm", stream_generate), ("yield-first", stream_generate_yield_first)):
            c0 = es.stats.calls
            seen[name] = [(es.stats.calls - c0) / layers
                          for _ in generate(backend.model_obj, backend.tokenizer, prompt, max_tokens=5,
                                            sampler=make_sampler(temp=0.0))]  # fmt: skip
        prefill = 2  # the prompt but its last token, then the last token's step (one chunk: a short prompt)
        assert seen["yield-first"] == [prefill + k for k in range(4)] + [prefill + 4]
        assert seen["mlx-lm"][:4] == [prefill + k + 1 for k in range(4)]

        ids, done = run(backend, GenerationRequest(prompt="Once upon a time",
                                                   sampling=SamplingParams(temperature=0.0, max_tokens=6)))  # fmt: skip
        assert backend.last_passes == len(ids) == 6  # the prompt's pass + 5: none past the reply
        extra = done.stats.extra
        assert extra["bytes_per_token"] == extra["bytes_read"] / 6
    finally:
        backend.close()


def test_a_follow_up_turn_on_flash_reuses_the_cache_and_answers_as_a_cold_start(
    default_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Yield-first never feeds a reply's last token (nothing asked for the step after it): the warm
    cache holds one token less than mlx-lm's loop left, and the next turn must prefill from there.
    The follow-up's tokens equal a cold start's, with the cache reused."""
    import dataclasses

    from engine.flash.backend import FlashBackend
    from engine.flash.split import split_model
    from engine.mlx_backend import cache_offset

    split = split_model(default_model.path, tmp_path_factory.mktemp("flash") / "split", progress=False)
    b = FlashBackend(memory_budget=300_000_000, runtime_bytes=0, residency=False)  # every FFN streamed
    b.load(dataclasses.replace(default_model, split_path=split))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        first = [{"role": "user", "content": "Name a fruit."}]
        ids1, done1 = run(b, GenerationRequest(messages=first, sampling=greedy))
        held = cache_offset(b.prompt_cache.cache)
        prompt = b.prompt_tokens(GenerationRequest(messages=first))
        assert b.prompt_cache.tokens == (prompt + ids1)[:held]
        # every sampled token but the last was fed (on EOS the last one sampled is the EOS itself)
        assert held == len(prompt) + len(ids1) - (0 if done1.finish_reason == "stop" else 1)
        follow = [
            *first,
            {"role": "assistant", "content": done1.text},
            {"role": "user", "content": "And a colour?"},
        ]
        warm, done_warm = run(b, GenerationRequest(messages=follow, sampling=greedy))
        assert done_warm.stats.cached_tokens > 0
        b.prompt_cache.reset()
        cold, done_cold = run(b, GenerationRequest(messages=follow, sampling=greedy))
        assert done_cold.stats.cached_tokens == 0
        assert warm == cold and done_warm.text == done_cold.text and warm
    finally:
        b.close()
