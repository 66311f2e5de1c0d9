"""The flash backend computes what the in-RAM MLX backend computes: same greedy tokens, same logits."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from engine.base import Done, GenerationRequest, SamplingParams

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a race condition is, with an example.",
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    ",
    "List three ways to speed up a slow SQL query:",
]


@pytest.fixture(scope="module")
def flash(default_model, tmp_path_factory: pytest.TempPathFactory):
    from engine.flash.backend import FlashBackend
    from engine.flash.split import split_model

    split = split_model(default_model.path, tmp_path_factory.mktemp("flash") / "split", progress=False)
    b = FlashBackend(memory_budget=300_000_000)
    b.load(dataclasses.replace(default_model, split_path=split))
    yield b
    b.close()


def run_stream(backend, prompt: str) -> tuple[list[int], Done]:
    req = GenerationRequest(messages=({"role": "user", "content": prompt},),
                            sampling=SamplingParams(temperature=0.0, max_tokens=64))  # fmt: skip
    ids: list[int] = []
    done = None
    for ev in backend.stream(req, threading.Event()):
        if isinstance(ev, Done):
            done = ev
        else:
            ids += ev.token_ids
    assert done is not None and done.error is None
    return ids, done


def all_logits(model, tokens: list[int]):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    out = model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    mx.eval(out)
    return out


def test_flash_greedy_tokens_and_logits_match_mlx(flash, mlx_backend) -> None:
    """5 prompts x 64 greedy tokens through each engine's own stream(): the same tokens and text;
    then the logits at every position of prompt + reply (one forward each) within 1e-4."""
    import mlx.core as mx

    worst = 0.0
    for prompt in PROMPTS:
        ref_ids, ref_done = run_stream(mlx_backend, prompt)
        ids, done = run_stream(flash, prompt)
        assert ids == ref_ids, f"tokens differ for {prompt!r}"
        assert done.text == ref_done.text
        assert len(ids) == 64 or ref_done.finish_reason == "stop"
        seq = mlx_backend.apply_chat_template([{"role": "user", "content": prompt}]) + ids
        worst = max(worst, float(mx.abs(all_logits(mlx_backend.model_obj, seq) - all_logits(flash.model_obj, seq)).max()))
        extra = done.stats.extra
        assert extra["bytes_read"] >= done.stats.completion_tokens * flash.manifest.streamed_bytes
        assert extra["budget"]["total"] <= 300_000_000
    assert worst <= 1e-4, f"max logit difference {worst}"


def test_flash_refuses_a_budget_below_its_pinned_weights(default_model, tmp_path: Path) -> None:
    from engine.base import BudgetError
    from engine.flash.backend import FlashBackend
    from engine.flash.split import split_model

    split = split_model(default_model.path, tmp_path / "split", progress=False)
    with pytest.raises(BudgetError, match=r"pinned weights alone need .* but the memory budget is 10\.0 MB"):
        FlashBackend(memory_budget=10_000_000).load(dataclasses.replace(default_model, split_path=split))
