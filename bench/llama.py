"""Decode speed of flashcode's llama-server adapter against a minimal raw streaming client, on the
same server, the same prompt and the same greedy reply, interleaved in one run.

    .venv/bin/python bench/llama.py [--model NAME] [--tokens 128] [--reps 5] [--threads N]

Decode tok/s is measured where the user sees it: (pieces - 1) / (last piece - first piece), on the
client. The server's own `timings.predicted_per_second` is recorded beside it. Writes
bench/results/llama.json with `decode_ratio` = adapter / raw (medians); the goal is >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.base import Done, GenerationRequest, SamplingParams, TextDelta  # noqa: E402
from engine.llama_server import LlamaServerBackend  # noqa: E402
from engine.models import find_model  # noqa: E402
from engine.provenance import provenance  # noqa: E402

PROMPT = "Write a long, detailed story about a dragon who learns to program computers."
RESULTS = Path(__file__).resolve().parent / "results" / "llama.json"


def rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 and stamps[-1] > stamps[0] else 0.0


def run_adapter(backend: LlamaServerBackend, tokens: int) -> dict[str, Any]:
    req = GenerationRequest(
        messages=({"role": "user", "content": PROMPT},),
        sampling=SamplingParams(temperature=0.0, max_tokens=tokens),
    )
    stamps: list[float] = []
    done = None
    for ev in backend.stream(req, threading.Event()):
        if isinstance(ev, TextDelta) and ev.text:
            stamps.append(time.perf_counter())
        elif isinstance(ev, Done):
            done = ev
    assert done is not None and done.error is None, done
    return {"client_tps": rate(stamps), "server_tps": done.stats.decode_tps, "pieces": len(stamps)}


def run_raw(url: str, tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
    }
    stamps: list[float] = []
    timings: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            timings = chunk.get("timings", timings)
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    return {
        "client_tps": rate(stamps),
        "server_tps": float(timings.get("predicted_per_second", 0)),
        "pieces": len(stamps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the server's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    backend = LlamaServerBackend(context_length=2048, threads=args.threads)
    model = find_model(args.model)
    backend.load(model)
    try:
        assert backend.url is not None
        run_adapter(backend, 8)  # warm-up: page in the weights, fill the prompt cache
        adapter, raw = [], []
        for _ in range(args.reps):  # interleaved, so load changes on a shared machine hit both alike
            raw.append(run_raw(backend.url, args.tokens))
            adapter.append(run_adapter(backend, args.tokens))
    finally:
        backend.close()

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 2)

    # the server's speed swings +-20% between runs on a shared machine: also give the median of the
    # ratios of neighbouring runs, and each client's rate against the server's own for the same run
    pairs = [a["client_tps"] / r["client_tps"] for a, r in zip(adapter, raw, strict=True)]
    result = {
        **provenance(),
        "decode_ratio": round(med(adapter, "client_tps") / med(raw, "client_tps"), 4),
        "paired_decode_ratio": round(statistics.median(pairs), 4),
        "adapter_client_vs_server": round(
            statistics.median(a["client_tps"] / a["server_tps"] for a in adapter), 4
        ),
        "raw_client_vs_server": round(statistics.median(r["client_tps"] / r["server_tps"] for r in raw), 4),
        "adapter_decode_tps": med(adapter, "client_tps"),
        "raw_decode_tps": med(raw, "client_tps"),
        "server_decode_tps_adapter_runs": med(adapter, "server_tps"),
        "server_decode_tps_raw_runs": med(raw, "server_tps"),
        "tokens": args.tokens,
        "reps": args.reps,
        "threads": args.threads or "server default",
        "model": model.name,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "runs": {"adapter": adapter, "raw": raw},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
