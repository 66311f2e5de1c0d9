"""`flashcode bench mlx`: the MLX backend's decode speed and TTFT against calling
`mlx_lm.stream_generate` directly on the same loaded model and prompt, in one run.

Runs alternate (mlx-lm, backend, mlx-lm, backend, ...) after a warm-up so that drift in machine load
hits both sides alike; the medians are reported.
"""

from __future__ import annotations

import platform
import statistics
import threading
import time
from typing import Any

from .base import GenerationRequest, SamplingParams
from .mlx_backend import MLXBackend, peak_rss_bytes

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def _raw_mlx_lm(backend: MLXBackend, prompt_ids: list[int], tokens: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    t0 = time.perf_counter()
    ttft = 0.0
    last = None
    for resp in stream_generate(backend.model_obj, backend.tokenizer, mx.array(prompt_ids), max_tokens=tokens,
                                sampler=make_sampler(0.0)):  # fmt: skip
        if not ttft:
            ttft = time.perf_counter() - t0
        last = resp
    assert last is not None
    return {"decode_tps": last.generation_tps, "ttft_s": ttft, "tokens": last.generation_tokens}


def _backend(backend: MLXBackend, messages: tuple[dict[str, str], ...], tokens: int) -> dict[str, float]:
    backend.prompt_cache.reset()  # prefill like mlx-lm does, no warm cache
    req = GenerationRequest(messages=messages, sampling=SamplingParams(temperature=0, max_tokens=tokens))
    done = list(backend.stream(req, threading.Event()))[-1]
    s = done.stats
    return {"decode_tps": s.decode_tps, "ttft_s": s.ttft_s, "tokens": s.completion_tokens}


def run_mlx_bench(model: Any, tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    import mlx.core as mx

    backend = MLXBackend()
    backend.load(model)
    messages = ({"role": "user", "content": PROMPT},)
    prompt_ids = backend.apply_chat_template(messages)
    _raw_mlx_lm(backend, prompt_ids, 8)  # warm-up both paths
    _backend(backend, messages, 8)
    raw, ours = [], []
    for _ in range(repeats):
        raw.append(_raw_mlx_lm(backend, prompt_ids, tokens))
        ours.append(_backend(backend, messages, tokens))
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    result = {
        "benchmark": "mlx",
        "model": model.name,
        "device": str(mx.default_device()),
        "machine": f"{platform.system()} {platform.machine()}",
        "prompt_tokens": len(prompt_ids),
        "tokens": tokens,
        "repeats": repeats,
        "mlx_lm": {"decode_tps": med(raw, "decode_tps"), "ttft_s": med(raw, "ttft_s"), "runs": raw},
        "backend": {"decode_tps": med(ours, "decode_tps"), "ttft_s": med(ours, "ttft_s"), "runs": ours},
        "peak_rss_bytes": peak_rss_bytes(),
    }
    result["decode_ratio"] = result["backend"]["decode_tps"] / result["mlx_lm"]["decode_tps"]
    result["ttft_added_ms"] = (result["backend"]["ttft_s"] - result["mlx_lm"]["ttft_s"]) * 1000
    backend.close()
    return result
