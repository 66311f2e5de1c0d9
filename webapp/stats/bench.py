"""The fixed bench set of `/bench` and `flashcode bench run`, run on the current backend and model.

What it knows: the prompts (short coding questions of increasing prompt length, fixed so runs can
be compared), the sampling (greedy, fixed seed, a fixed reply budget), how to run them through the
engine `Worker` (sync for the CLI, async for the web app), and how to summarize a run (stored by
`store.record_bench_run`).

What it does not know: HTML, the chat. Generation goes through the Worker, so MLX stays on the
engine thread. Prompts are sent one after another as chat requests, so an engine that keeps its
prompt cache warm (MLX) reuses the shared system prompt, as it would in the chat.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.base import Done, GenerationRequest, Message, SamplingParams
from engine.worker import Worker

from . import store

SYSTEM = "You are a concise coding assistant."
PROMPTS: tuple[str, ...] = (
    "Write a Python function that reverses a string.",
    "Explain in two sentences what a Python generator is.",
    "What does `git rebase -i HEAD~3` do?",
    "Write a bash one-liner that counts the lines of every .py file under the current directory, "
    "sorted from largest to smallest.",
    "Here is a function:\n\n```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / len(xs)\n```\n\nWhat happens when `xs` is empty, and how would you fix it? "
    "Show the corrected function and one test for it.",
)
DEFAULT_MAX_TOKENS = 64
SEED = 1234


def requests(
    max_tokens: int = DEFAULT_MAX_TOKENS, prompts: tuple[str, ...] = PROMPTS
) -> list[GenerationRequest]:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=SEED)
    return [GenerationRequest(messages=_messages(p), sampling=sampling) for p in prompts]


def _messages(prompt: str) -> tuple[Message, ...]:
    return ({"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt})


def result_row(index: int, done: Done) -> dict[str, Any]:
    s = done.stats
    if done.error:
        raise RuntimeError(f"bench prompt {index + 1} failed: {done.error}")
    return {
        "prompt": index,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "completion_tokens": s.completion_tokens,
        "ttft_s": s.ttft_s,
        "prompt_tps": s.prompt_tps,
        "decode_tps": s.decode_tps,
        "peak_memory_bytes": s.peak_memory_bytes,
        "peak_rss_bytes": s.peak_rss_bytes,
        "total_s": s.total_s,
        "finish_reason": done.finish_reason,
        "extra": {k: v for k, v in s.extra.items() if isinstance(v, int | float | str | bool)},
    }


def run_sync(
    worker: Worker, max_tokens: int = DEFAULT_MAX_TOKENS, prompts: tuple[str, ...] = PROMPTS
) -> list[dict[str, Any]]:
    """Run every prompt in turn from a plain thread (the CLI)."""
    out = []
    for i, req in enumerate(requests(max_tokens, prompts)):
        done = next(ev for ev in worker.submit(req) if isinstance(ev, Done))
        out.append(result_row(i, done))
    return out


async def run_async(
    worker: Worker, max_tokens: int = DEFAULT_MAX_TOKENS, prompts: tuple[str, ...] = PROMPTS
) -> list[dict[str, Any]]:
    """The same from the event loop (`/bench` in the chat); cancelling the task cancels the reply."""
    out = []
    loop = asyncio.get_running_loop()
    for i, req in enumerate(requests(max_tokens, prompts)):
        gen = worker.submit(req, loop=loop)
        done: Done | None = None
        try:
            async for ev in gen:
                if isinstance(ev, Done):
                    done = ev
        finally:
            if done is None:
                gen.cancel()
        assert done is not None
        out.append(result_row(i, done))
    return out


def engine_names(worker: Worker) -> tuple[str | None, str | None]:
    b = worker.backend
    if b is None:
        return None, None
    return b.name, (b.model.name if b.model else None)


def format_run(run: store.BenchRun, previous: store.BenchRun | None = None) -> str:
    """Plain-text summary (CLI; the chat shows it in a code block)."""
    mem = run.peak_memory_bytes or run.peak_rss_bytes
    lines = [
        f"bench #{run.id}: {run.model} on {run.backend}, {run.prompts} prompts x {run.max_tokens} tokens",
        f"  decode {run.decode_tps:.1f} tok/s   TTFT {run.ttft_s * 1000:.0f} ms   prefill {run.prompt_tps:.0f} tok/s"
        f"   peak memory {mem / 2**20:.0f} MiB   total {run.total_s:.1f} s  (medians)",
    ]
    if previous is not None and previous.decode_tps:
        ratio = run.decode_tps / previous.decode_tps
        lines.append(
            f"  vs bench #{previous.id} ({previous.model} on {previous.backend}): decode x{ratio:.2f}, "
            f"TTFT {run.ttft_s * 1000:.0f} vs {previous.ttft_s * 1000:.0f} ms"
        )
    return "\n".join(lines)
