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
TOKENS = 32  # greedy tokens per prompt: each step's logits are compared, not only the tokens


@pytest.fixture(scope="module", params=["streamed", "resident"])
def flash(request, default_model, tmp_path_factory: pytest.TempPathFactory):
    """Every FFN streamed (residency off), or every FFN resident (a budget the whole model fits in: float32
    scales, one graph per token, as MLXBackend computes it)."""
    from engine.flash.backend import FlashBackend
    from engine.flash.split import split_model

    split = split_model(default_model.path, tmp_path_factory.mktemp("flash") / "split", progress=False)
    if request.param == "streamed":  # engine-only budgets: pytest's own RSS varies
        b = FlashBackend(memory_budget=300_000_000, runtime_bytes=0, residency=False)
    else:
        b = FlashBackend(memory_budget=2_000_000_000, runtime_bytes=0)
    b.load(dataclasses.replace(default_model, split_path=split))
    b.kind = request.param
    yield b
    b.close()


class LogitRecorder:
    """Wraps a model so that every forward's last-position logits are kept (stream() is unchanged)."""

    def __init__(self, model) -> None:
        self.model = model
        self.logits: list = []

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.logits.append(out[:, -1].astype(__import__("mlx.core").core.float32))
        return out

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def run_stream(backend, request: GenerationRequest) -> tuple[list[int], Done, list]:
    rec = LogitRecorder(backend.model_obj)
    backend.model_obj = rec
    backend.prompt_cache.reset()
    ids: list[int] = []
    done = None
    try:
        for ev in backend.stream(request, threading.Event()):
            if isinstance(ev, Done):
                done = ev
            else:
                ids += ev.token_ids
    finally:
        backend.model_obj = rec.model
    assert done is not None and done.error is None
    return ids, done, rec.logits


def request_for(i: int, prompt: str) -> GenerationRequest:
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    if (
        i == 0
    ):  # one through the chat template, the rest raw (short prompts keep MLX's slow CPU prefill cheap)
        return GenerationRequest(messages=({"role": "user", "content": prompt},), sampling=greedy)
    return GenerationRequest(prompt=prompt, sampling=greedy)


REFERENCE: dict[int, tuple[list[int], Done, list]] = {}  # prompt -> the in-RAM run, shared by both params


def reference_run(mlx_backend, i: int, req: GenerationRequest) -> tuple[list[int], Done, list]:
    """The in-RAM backend's run of prompt `i`, computed once for the streamed and the resident engine (the
    reference path on this CPU is the slow half of the test)."""
    if i not in REFERENCE:  # both engines prefill through the same CPU path (dequantize, then the BLAS)
        REFERENCE[i] = run_stream(mlx_backend, req)
    return REFERENCE[i]


def test_flash_greedy_tokens_and_logits_match_mlx(flash, mlx_backend) -> None:
    """5 prompts x 32 greedy tokens through each engine's own stream(): identical tokens and text,
    and the logits of every forward (prefill and each decode step) within 1e-4."""
    import mlx.core as mx

    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        req = request_for(i, prompt)
        ref_ids, ref_done, ref_logits = reference_run(mlx_backend, i, req)
        ids, done, logits = run_stream(flash, req)
        assert ids == ref_ids, f"tokens differ for {prompt!r}"
        assert done.text == ref_done.text
        assert len(ids) == TOKENS or ref_done.finish_reason == "stop"
        # flash hands each token out before it builds the next step (engine.decode): one forward fewer
        assert len(logits) == len(ref_logits) - 1 >= len(ids)
        worst = max(worst, max(float(mx.abs(a - b).max()) for a, b in zip(ref_logits, logits, strict=False)))
        extra = done.stats.extra
        if flash.kind == "streamed":
            assert extra["bytes_read"] >= done.stats.completion_tokens * flash.manifest.streamed_bytes
            assert extra["budget"]["total"] <= 300_000_000
        else:
            assert extra["bytes_per_token"] == 0 and len(extra["budget"]["resident_layers"]) == 30
    assert worst <= 1e-4, f"max logit difference {worst}"


def test_flash_refuses_a_budget_below_its_pinned_weights(default_model, tmp_path: Path) -> None:
    from engine.base import BudgetError
    from engine.flash.backend import FlashBackend
    from engine.flash.split import split_model

    split = split_model(default_model.path, tmp_path / "split", progress=False)
    with pytest.raises(BudgetError, match=r"pinned weights alone need .* but the memory budget is 10\.0 MB"):
        FlashBackend(memory_budget=10_000_000).load(dataclasses.replace(default_model, split_path=split))
