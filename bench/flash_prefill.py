"""Issue 18: the flash engine's prefill on the CPU against MLX in RAM, on the same model and prompt.

    .venv/bin/python bench/flash_prefill.py --out bench/results/flash-prefill.json

One installed model (default: the default model), one ~300-token prompt through its chat template, greedy.
Modes, each loaded once and run `--repeats` times (the prompt cache reset before every run, so each run reads
the whole prompt):
- `ram`: MLXBackend, the model in memory (its quantized linears fed many rows dequantize for the BLAS);
- `flash_resident`: FlashBackend under `--memory-budget auto` (every FFN kept resident);
- `flash_streamed`: FlashBackend under the smallest budget it takes (nothing resident: every FFN piece
  read from disk for every forward);
- `flash_resident_plain`, `flash_streamed_plain`: the same under `cpu_fast.plain_path()`, every matmul
  through MLX's `quantized_matmul`: the path flash prefilled on before its FFNs and its pinned layers took
  the dequantize-then-BLAS path (MLX's CPU `quantized_matmul` costs per row what decode does).
Per run: TTFT, prompt tok/s, decode tok/s, bytes read, the generated token ids. Summary (medians of the
runs): `prefill_tps` and `ttft_s` per mode, `prefill_ratio_vs_ram` (flash_resident / ram) and
`prefill_ratio_streamed_vs_ram`, `speedup_vs_plain` per flash mode, `same_tokens_as_ram` per mode.
The file is written only by this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import provenance  # noqa: E402

PROMPT = (
    "Review this Python module and list its bugs, one line each, then give the fixed code.\n\n"
    + "\n".join(
        f"def step_{i}(values, scale={i}):\n"
        f"    total = 0\n"
        f"    for v in values:\n"
        f"        total += v * scale - {i}\n"
        f"    return total / len(values)\n"
        for i in range(9)
    )
)
MODES = ("ram", "flash_resident", "flash_streamed", "flash_resident_plain", "flash_streamed_plain")


def smallest_budget(info: Any) -> int:
    """The least FlashBackend takes for this model with nothing resident (as bench/flash_residency.py's `min`)."""
    import mlx.core as mx

    from engine.flash.budget import RESIDENT_CONTEXT, plan_budget
    from engine.flash.inplace import scratch_bytes
    from engine.flash.split import load_manifest, split_model
    from engine.mlx_backend import compute_dtype

    split = info.path / "split"
    man = load_manifest(
        split if (split / "manifest.json").exists() else split_model(info.path, progress=False)
    )
    ctx = int(man.config.get("max_position_embeddings", 4096))
    float_bytes = 4 if compute_dtype() == mx.float32 else 2
    base = plan_budget(man, None, 2, ctx, 128, float_bytes, scratch=scratch_bytes(4))
    return base.fixed + min(ctx, RESIDENT_CONTEXT) * base.per_token + 1_000_000


def backend_for(mode: str, info: Any) -> Any:
    from engine.flash.backend import FlashBackend
    from engine.mlx_backend import MLXBackend

    if mode == "ram":
        return MLXBackend()
    if mode.startswith("flash_resident"):
        return FlashBackend(memory_budget="auto")
    return FlashBackend(memory_budget=smallest_budget(info), runtime_bytes=0)


def one_run(backend: Any, tokens: int) -> dict[str, Any]:
    from engine.base import GenerationRequest, SamplingParams, collect

    backend.prompt_cache.reset()  # the whole prompt is read every run
    req = GenerationRequest(
        messages=({"role": "user", "content": PROMPT},),
        sampling=SamplingParams(temperature=0.0, max_tokens=tokens),
    )
    ids, done = collect(backend.stream(req, threading.Event()))
    s = done.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "ttft_s": s.ttft_s,
        "prefill_tps": s.prompt_tps,
        "decode_tps": s.decode_tps,
        "bytes_read": s.extra.get("bytes_read"),
        "tokens": ids,
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The summary keys, from the raw runs alone (tests/test_bench_results.py recomputes them)."""

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    ram_tokens = runs["ram"][0]["tokens"]
    out: dict[str, Any] = {
        "prefill_tps": {m: round(med(m, "prefill_tps"), 2) for m in runs},
        "ttft_s": {m: round(med(m, "ttft_s"), 3) for m in runs},
        "decode_tps": {m: round(med(m, "decode_tps"), 2) for m in runs},
        "same_tokens_as_ram": {m: all(r["tokens"] == ram_tokens for r in runs[m]) for m in runs},
    }
    out["prefill_ratio_vs_ram"] = round(med("flash_resident", "prefill_tps") / med("ram", "prefill_tps"), 3)
    out["prefill_ratio_streamed_vs_ram"] = round(
        med("flash_streamed", "prefill_tps") / med("ram", "prefill_tps"), 3
    )
    out["speedup_vs_plain"] = {
        m: round(med(m, "prefill_tps") / med(f"{m}_plain", "prefill_tps"), 2)
        for m in ("flash_resident", "flash_streamed")
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="installed model name (default: the default model)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens after the prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/flash-prefill.json")
    args = ap.parse_args()

    import engine  # noqa: F401 - the fast BLAS is loaded before MLX is
    from engine.cpu_fast import blas_status, plain_path
    from engine.models import DEFAULT_MODEL, find_model

    info = find_model(args.model or DEFAULT_MODEL)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in MODES:
        backend = backend_for(mode, info)
        backend.load(info)
        try:
            with plain_path() if mode.endswith("_plain") else contextlib.nullcontext():
                runs[mode] = []
                for k in range(args.repeats):
                    runs[mode].append(one_run(backend, args.tokens))
                    r = runs[mode][-1]
                    print(f"{mode:22} run {k + 1}: prefill {r['prefill_tps']:7.1f} tok/s  ttft {r['ttft_s']:6.2f} s  "
                          f"decode {r['decode_tps']:5.1f} tok/s", flush=True)  # fmt: skip
        finally:
            backend.close()
    result = {
        **provenance(sys.argv),
        "model": info.name,
        "prompt_tokens": runs["ram"][0]["prompt_tokens"],
        "tokens": args.tokens,
        "repeats": args.repeats,
        "blas": blas_status().library,
        "runs": runs,
        **summarize(runs),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("prefill_tps", "prefill_ratio_vs_ram", "prefill_ratio_streamed_vs_ram",
                                              "speedup_vs_plain", "same_tokens_as_ram")}, indent=1))  # fmt: skip
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
