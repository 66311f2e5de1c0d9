"""Saved-context benchmark: resuming a saved KV cache vs re-reading (re-prefilling) the context.

For contexts of about 1k, 4k and 8k tokens of the default model (nested prefixes of one long chat
turn made of this repository's source code), on one MLX backend:

  reprefill_s   time to read the context from scratch (the reply's TTFT with an empty cache; the
                larger contexts are read on top of the smaller ones, chunk by chunk, which costs the
                same 512-token prefill steps as reading them whole)
  resume_s      `ContextStore.resume` on a second, freshly loaded backend (a restarted flashcode):
                read meta.json and tokens.json, checksum and load the cache file, check it
                against the model, make it the live cache
  speedup       reprefill_s / resume_s          (goal: >= 50x at 4k: `resume_speedup_4k`)
  ttft_*        the next message's TTFT: live session, resumed session, and after re-reading

For each saved precision (the cache's own float32 on CPU, 16, 8 and 4 bits, group 64): the file
size and the greedy agreement of the next 64 tokens with the live session's (unquantized) reply:
the share of positions equal, and the first position that differs.

    .venv/bin/python bench/resume.py [--sizes 1024 4096 8000] [--gen 64] [--out bench/results/resume.json]

Results are written after each size, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.base import Done, GenerationRequest, SamplingParams  # noqa: E402
from engine.mlx_backend import MLXBackend  # noqa: E402
from engine.models import find_model  # noqa: E402
from engine.provenance import provenance  # noqa: E402
from engine.sessions import ContextStore  # noqa: E402

SUFFIX_MESSAGE = "Summarize what the code above does in two sentences."
PRECISIONS: list[int | None] = [None, 16, 8, 4]


def long_text() -> str:
    files = sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "webapp").rglob("*.py"))
    return "\n\n".join(f"# file: {f.relative_to(ROOT)}\n{f.read_text()}" for f in files)


def run_ids(backend: MLXBackend, ids: list[int], max_tokens: int) -> tuple[list[int], Done]:
    """One greedy generation on exactly these prompt token ids, through `MLXBackend.stream`."""
    backend.prompt_tokens = lambda request: list(ids)  # type: ignore[method-assign]
    out: list[int] = []
    done = None
    req = GenerationRequest(prompt="-", sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for ev in backend.stream(req, threading.Event()):
        if isinstance(ev, Done):
            done = ev
        else:
            out.extend(ev.token_ids)
    assert done is not None
    return out, done


def trim_to(backend: MLXBackend, ids: list[int]) -> None:
    """Make the live cache hold exactly `ids` (it holds them plus the reply)."""
    from mlx_lm.models.cache import trim_prompt_cache

    from engine.mlx_backend import cache_offset

    pc = backend.prompt_cache
    assert pc.tokens[: len(ids)] == ids, "the live cache does not start with the context"
    trim_prompt_cache(pc.cache, cache_offset(pc.cache) - len(ids))
    pc.tokens = list(ids)


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    n = max(len(a), len(b))
    same = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if len(a) == len(b) and first == len(a):
        first = -1  # identical
    return (same / n if n else 1.0), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "resume.json")
    ap.add_argument(
        "--shape-only",
        type=int,
        metavar="TOKENS",
        help="only file sizes and resume time, on a cache of TOKENS random tokens' KV of the "
        "model's shape (when prefilling that many tokens would take too long); merged into --out",
    )
    args = ap.parse_args()
    if args.shape_only:
        shape_only(args.shape_only, args.out)
        return

    model = find_model(None)
    live = MLXBackend()
    live.load(model)
    t = time.perf_counter()
    restarted = MLXBackend()
    restarted.load(model)
    load_s = time.perf_counter() - t

    text_ids = live.tokenize(long_text())
    # SmolLM2's chat template, opened for a long user turn that the next message closes
    prefix = live.tokenize(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHere is some code.\n\n"
    )
    full = prefix + text_ids
    if len(full) < max(args.sizes):
        raise SystemExit(f"only {len(full)} tokens of source text; sizes up to {max(args.sizes)} asked")
    closing = live.tokenize(
        "\n<|im_end|>\n<|im_start|>user\n" + SUFFIX_MESSAGE + "<|im_end|>\n<|im_start|>assistant\n"
    )

    home = Path(tempfile.mkdtemp(prefix="flashcode-bench-resume-"))
    store = ContextStore(home, quota_bytes=64 << 30)
    result: dict[str, Any] = {
        "model": model.name,
        "device": "cpu" if "cpu" in str(__import__("mlx.core").core.default_device()).lower() else "gpu",
        **provenance(),
        "load_avg_start": os.getloadavg(),
        "backend_load_s": round(load_s, 2),
        "gen_tokens": args.gen,
        "next_message_tokens": len(closing),
        "sizes": {},
    }
    read_s = 0.0  # cumulative prefill time: the contexts are nested prefixes
    for n in sorted(args.sizes):
        ctx = full[:n]
        _, d = run_ids(live, ctx, 1)
        read_s += d.stats.ttft_s
        trim_to(live, ctx)
        saved = {}
        for bits in PRECISIONS:
            t = time.perf_counter()
            saved[bits] = store.save(
                live, "bench", f"bench {n} tokens at {bits or 'native'} bits", kv_bits=bits
            )
            saved[bits] = (saved[bits], time.perf_counter() - t)
        next_ids = ctx + closing
        ref, d_live = run_ids(live, next_ids, args.gen)
        row: dict[str, Any] = {
            "tokens": n,
            "reprefill_s": round(read_s, 3),
            "prefill_tps": round(n / read_s, 1),
            "cached_before": d.stats.cached_tokens,
            "ttft_live_s": round(d_live.stats.ttft_s, 3),
            "precisions": {},
        }
        for bits in PRECISIONS:
            sc, save_s = saved[bits]
            res = store.resume(restarted, "bench", sc.id)
            out, d_res = run_ids(restarted, next_ids, args.gen)
            share, first = agreement(ref, out)
            row["precisions"][str(sc.kv_bits)] = {
                "requested": bits or "native",
                "file_bytes": sc.size_bytes,
                "file_mb": round(sc.size_bytes / 1e6, 1),
                "save_s": round(save_s, 3),
                "resume_s": round(res.seconds, 3),
                "speedup": round(read_s / res.seconds, 1),
                "ttft_resumed_s": round(d_res.stats.ttft_s, 3),
                "cached_tokens": d_res.stats.cached_tokens,
                "agreement_64": round(share, 4),
                "first_divergence": first,
            }
        native = row["precisions"][str(saved[None][0].kv_bits)]
        row["resume_s"] = native["resume_s"]
        row["speedup"] = native["speedup"]
        result["sizes"][str(n)] = row
        key = {1024: "1k", 4096: "4k"}.get(n, "8k" if n >= 7000 else str(n))
        result[f"resume_speedup_{key}"] = row["speedup"]
        result["load_avg_end"] = os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(row), flush=True)
    for ctx in store.list("bench"):
        store.delete("bench", ctx.id)


def shape_only(n: int, out: Path) -> None:
    """Sizes and resume time for `n` tokens without prefilling them: random KV of the model's shape.
    Both depend on the shape alone; re-prefill time and agreement need the real thing and are left out."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx_backend import compute_dtype, kv_shape

    model = find_model(None)
    live, restarted = MLXBackend(), MLXBackend()
    live.load(model)
    restarted.load(model)
    layers, heads, head_dim = kv_shape(live.model_obj)
    cache = make_prompt_cache(live.model_obj)
    for c in cache:
        k = mx.random.normal((1, heads, n, head_dim)).astype(compute_dtype())
        c.update_and_fetch(k, mx.random.normal((1, heads, n, head_dim)).astype(compute_dtype()))
    mx.eval([c.state for c in cache])
    live.prompt_cache.cache, live.prompt_cache.tokens = cache, [1] * n
    store = ContextStore(Path(tempfile.mkdtemp(prefix="flashcode-bench-resume-")), quota_bytes=64 << 30)
    row: dict[str, Any] = {"tokens": n, "synthetic_kv": True, "reprefill_s": None, "precisions": {}}
    for bits in PRECISIONS:
        t = time.perf_counter()
        sc = store.save(live, "bench", f"shape {n} at {bits}", kv_bits=bits)
        save_s = time.perf_counter() - t
        res = store.resume(restarted, "bench", sc.id)
        row["precisions"][str(sc.kv_bits)] = {
            "requested": bits or "native",
            "file_bytes": sc.size_bytes,
            "file_mb": round(sc.size_bytes / 1e6, 1),
            "save_s": round(save_s, 3),
            "resume_s": round(res.seconds, 3),
        }
        store.delete("bench", sc.id)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.setdefault("sizes", {})[str(n)] = row
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
