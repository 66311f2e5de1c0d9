"""Issue 19: one model in one process vs its layers split over N processes (`--hosts`, mlx.distributed's ring
backend; here over loopback on one machine, so it measures the pipeline's overhead, not a gain).

    .venv/bin/python bench/distributed.py --out bench/results/distributed.json
    .venv/bin/python bench/distributed.py --model qwen2.5-coder-0.5b-instruct-q4_k_m --reps 2 --hosts 2

Per configuration (`single`: MLXBackend in this process; `pipeline-N`: PipelineBackend with N ranks on
127.0.0.1), the same greedy prompt `--reps` times after one warm-up: TTFT, decode tok/s, the generated
token ids, and memory — the single process's peak RSS, each rank's peak RSS and layers. The prompt cache
is cleared before each run so every TTFT is a full prefill. Summary keys: `same_tokens_as_single` (every
pipeline run's ids equal the single process's), `hosts`, and the medians and ratios (pipeline / single).
With `--engine flash --memory-budget B` both sides run the flash engine (one process under B; each rank
under its own B, streaming only its layers), and each run records the bytes read per token (per rank in
`hosts`). `--dist-backend nccl` (CUDA GPUs) or `jaccl` (Macs over Thunderbolt) swaps mx.distributed's
backend; ring over TCP is the default.

    .venv/bin/python bench/distributed.py --engine flash --memory-budget 800MB --model DIR --out ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flash_moe import device_name  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from engine.base import GenerationRequest, SamplingParams, collect  # noqa: E402
from engine.models import find_model  # noqa: E402

PROMPT = "Explain in a few sentences how a lighthouse works and why ships need one."


def one(backend: Any, tokens: int) -> dict[str, Any]:
    req = GenerationRequest(
        messages=({"role": "user", "content": PROMPT},),
        sampling=SamplingParams(temperature=0, max_tokens=tokens),
    )
    t0 = time.perf_counter()
    ids, done = collect(backend.stream(req, threading.Event()))
    s = done.stats
    return {
        "ttft_s": round(s.ttft_s, 4),
        "decode_tps": round(s.decode_tps, 3),
        "wall_s": round(time.perf_counter() - t0, 3),
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "token_ids": ids,
        "peak_rss_bytes": s.peak_rss_bytes,
        "bytes_per_token": s.extra.get("bytes_per_token"),
        "hosts": s.extra.get("hosts"),
    }


def measure(make: Any, reps: int, tokens: int, fresh_cache: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    b = make()
    load_s = time.perf_counter() - t0
    try:
        fresh_cache(b)
        one(b, 4)  # warm-up
        runs = []
        for i in range(reps):
            fresh_cache(b)
            r = one(b, tokens) | {"run": i}
            runs.append(r)
            print(f"  run {i}: ttft {r['ttft_s']:.2f} s, {r['decode_tps']:.2f} tok/s", flush=True)
        return {"load_s": round(load_s, 2), "runs": runs}
    finally:
        b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an installed model (default: the default model)")
    ap.add_argument(
        "--hosts", type=int, action="append", default=None, help="ranks on 127.0.0.1 (default: 2)"
    )
    ap.add_argument("--engine", choices=["mlx", "flash"], default="mlx")
    ap.add_argument(
        "--memory-budget", default=None, help="flash: the budget of the one process and of each rank"
    )
    ap.add_argument("--dist-backend", choices=["ring", "nccl", "jaccl"], default="ring")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "distributed.json"))
    args = ap.parse_args(argv)
    from engine.flash.backend import FlashBackend
    from engine.mlx_backend import MLXBackend
    from engine.pipeline import PipelineBackend
    from webapp.units import parse_budget

    model = find_model(args.model)
    budget = parse_budget(args.memory_budget) if args.memory_budget else None

    def single() -> Any:
        b = FlashBackend(memory_budget=budget) if args.engine == "flash" else MLXBackend()
        b.load(model)
        return b

    def reset_single(b: Any) -> None:
        b.prompt_cache.reset()

    configs: dict[str, Any] = {}
    print("single process", flush=True)
    configs["single"] = measure(single, args.reps, args.tokens, reset_single)
    with tempfile.TemporaryDirectory(prefix="flashcode-bench-hosts-") as tmp:
        for n in args.hosts or [2]:
            hostfile = Path(tmp) / f"hosts-{n}.json"
            hostfile.write_text(json.dumps({"backend": args.dist_backend,
                                            "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * n}))  # fmt: skip

            def pipeline(h: Path = hostfile) -> Any:
                b = PipelineBackend(h, engine=args.engine, memory_budget=budget)
                b.load(model)
                return b

            print(f"pipeline over {n} processes", flush=True)
            configs[f"pipeline-{n}"] = measure(pipeline, args.reps, args.tokens, lambda b: b.reset_cache())
    ref = configs["single"]["runs"][0]["token_ids"]

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in configs[name]["runs"])

    summary: dict[str, Any] = {}
    for name, c in configs.items():
        summary[name] = {"ttft_s_median": med(name, "ttft_s"), "decode_tps_median": med(name, "decode_tps"),
                         "load_s": c["load_s"]}  # fmt: skip
        if name != "single":
            summary[name] |= {
                "ttft_ratio_vs_single": round(med(name, "ttft_s") / med("single", "ttft_s"), 4),
                "decode_ratio_vs_single": round(med(name, "decode_tps") / med("single", "decode_tps"), 4),
                "peak_rss_mb_per_rank": [h.get("peak_rss_mb") for h in c["runs"][-1]["hosts"]],
                "layers_per_rank": [h["layers"] for h in c["runs"][-1]["hosts"]],
                "bytes_per_token_per_rank": [h.get("bytes_per_token") for h in c["runs"][-1]["hosts"]],
            }
        if args.engine == "flash":
            summary[name]["bytes_per_token_median"] = med(name, "bytes_per_token")
    out = {
        **provenance(argv if argv is not None else sys.argv),
        "model": model.name,
        "engine": args.engine,
        "memory_budget": budget,
        "dist_backend": args.dist_backend,
        "device": device_name(),
        "what": f"one process vs the model's layers split over N local processes ({args.dist_backend} backend)",
        "prompt": PROMPT,
        "tokens": args.tokens,
        "same_tokens_as_single": all(r["token_ids"] == ref for c in configs.values() for r in c["runs"]),
        "hosts": {name: len(c["runs"][-1]["hosts"] or []) or 1 for name, c in configs.items()},
        "single_peak_rss_mb": configs["single"]["runs"][-1]["peak_rss_bytes"] >> 20,
        "summary": summary,
        "configs": configs,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("same_tokens_as_single", "hosts", "summary")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
