"""`flashcode bench mlx` / `python -m engine.bench_mlx`: the MLX backend's prefill and decode speed on
a 637-token coding prompt, in one run, against
- `mlx_lm.stream_generate` called directly on the same loaded model (`decode_ratio`: the backend's
  overhead; goal >= 0.95),
- llama-server on the GGUF the model was imported from, fed the same prompt token ids, with one
  thread and with its default (all cores); the headline ratio is against the faster of the two
  (`prefill_ratio_vs_llama`: goal >= 0.5; `decode_ratio_vs_llama`),
- the reference path: the backend in a child process with FLASHCODE_CPU_FAST=0 (one run per repeat,
  interleaved with the others), i.e. the wheel's reference BLAS and `quantized_matmul` for every row,
  as before `engine.cpu_fast` (speedups, `decode_vs_reference`, `same_tokens_as_reference`).

Runs alternate (mlx-lm, backend, llama-server, ...) after a warm-up so that load on a shared machine
hits every side alike; medians are the summary, every run is kept with its token ids and the load
average it saw. Writes bench/results/mlx.json with the provenance (command, commit, machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .base import GenerationRequest, SamplingParams, collect
from .mlx_backend import MLXBackend, peak_rss_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "mlx.json"

# a realistic coding-agent prompt: 637 tokens through SmolLM2's chat template
CODE = '''import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    name: str
    command: list[str]
    retries: int = 3
    timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    last_error: str | None = None


class JobQueue:
    """A tiny persistent job queue: jobs are kept in a JSON file and run one at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.jobs: list[Job] = []
        if path.exists():
            self.load()

    def load(self) -> None:
        data = json.loads(self.path.read_text())
        self.jobs = [Job(**item) for item in data["jobs"]]

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"jobs": [job.__dict__ for job in self.jobs]}, indent=2))
        os.replace(tmp, self.path)

    def add(self, name: str, command: list[str], **options) -> Job:
        if any(job.name == name for job in self.jobs):
            raise ValueError(f"a job named {name!r} is already queued")
        job = Job(name, command, **options)
        self.jobs.append(job)
        self.save()
        return job

    def next_job(self) -> Job | None:
        for job in self.jobs:
            if job.attempts < job.retries:
                return job
        return None

    def run_once(self, runner) -> bool:
        job = self.next_job()
        if job is None:
            return False
        job.attempts += 1
        started = time.monotonic()
        try:
            runner(job.command, env={**os.environ, **job.env}, timeout=job.timeout_s)
        except Exception as exc:
            job.last_error = f"{type(exc).__name__}: {exc}"
        else:
            self.jobs.remove(job)
        finally:
            elapsed = time.monotonic() - started
            print(f"{job.name}: attempt {job.attempts} took {elapsed:.1f}s")
            self.save()
        return True
'''
PROMPT = (
    "Review the following Python module. Explain what it does, point out any bugs or edge cases that are "
    "not handled, and suggest a cleaner design where you see one.\n\n```python\n" + CODE + "```\n\n"
    "Keep the answer short and concrete.\n"
)
MESSAGES = ({"role": "user", "content": PROMPT},)


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


# --------------------------------------------------------------------------- one run of each side
def run_mlx_lm(backend: MLXBackend, prompt_ids: list[int], tokens: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    load, t0, ttft, last, ids = _load1(), time.perf_counter(), 0.0, None, []
    for resp in stream_generate(
        backend.model_obj,
        backend.tokenizer,
        mx.array(prompt_ids),
        max_tokens=tokens,
        sampler=make_sampler(0.0),
    ):
        if not ttft:
            ttft = time.perf_counter() - t0
        last = resp
        ids.append(int(resp.token))
    assert last is not None
    return {
        "prefill_tps": last.prompt_tps,
        "decode_tps": last.generation_tps,
        "ttft_s": ttft,
        "tokens": last.generation_tokens,
        "token_ids": ids,
        "load1": load,
    }


def run_backend(backend: MLXBackend, tokens: int) -> dict[str, Any]:
    backend.prompt_cache.reset()  # prefill the whole prompt, as mlx-lm does: no warm cache
    req = GenerationRequest(messages=MESSAGES, sampling=SamplingParams(temperature=0, max_tokens=tokens))
    load = _load1()
    ids, done = collect(backend.stream(req, threading.Event()))
    s = done.stats
    return {
        "prefill_tps": s.prompt_tps,
        "decode_tps": s.decode_tps,
        "ttft_s": s.ttft_s,
        "tokens": s.completion_tokens,
        "prompt_tokens": s.prompt_tokens,
        "token_ids": ids,
        "load1": load,
    }


def run_llama(server: Any, prompt_ids: list[int], tokens: int) -> dict[str, Any]:
    """One greedy /completion on the prompt's token ids, nothing reused from the slot's cache."""
    body = {
        "prompt": prompt_ids,
        "n_predict": tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
    }
    load, t0 = _load1(), time.perf_counter()
    out = server.client.completion(body)
    wall = time.perf_counter() - t0
    t = out["timings"]
    assert t["prompt_n"] == len(prompt_ids), f"llama-server reused {len(prompt_ids) - t['prompt_n']} tokens"
    return {
        "prefill_tps": t["prompt_per_second"],
        "decode_tps": t["predicted_per_second"],
        "ttft_s": t["prompt_ms"] / 1000,
        "wall_s": wall,
        "tokens": t["predicted_n"],
        "token_ids": [int(i) for i in out.get("tokens", [])],
        "load1": load,
    }


class ReferenceProcess:
    """The backend with FLASHCODE_CPU_FAST=0 in a child process (the BLAS is chosen at import), kept
    alive so that its runs interleave with the others: one JSON line per `run`."""

    def __init__(self, model_name: str) -> None:
        cmd = [sys.executable, "-m", "engine.bench_mlx", "--reference-child", "--model", model_name]
        env = {**os.environ, "FLASHCODE_CPU_FAST": "0"}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the reference child exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _reference_child(model_name: str) -> int:
    from .cpu_fast import blas_status
    from .models import find_model

    backend = MLXBackend()
    backend.load(find_model(model_name))
    for line in sys.stdin:
        run = run_backend(backend, int(line))
        run["blas"] = blas_status().reason
        print(json.dumps(run), flush=True)
    return 0


# --------------------------------------------------------------------------- the benchmark
def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("prefill_tps", "decode_tps", "ttft_s")
    return {**{k: _median(runs, k) for k in keys}, "runs": runs}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The summary keys, computed from the raw runs only (a test recomputes them the same way)."""
    mlx_lm, ours = result["mlx_lm"]["runs"], result["backend"]["runs"]
    out: dict[str, Any] = {
        "decode_ratio": _median(ours, "decode_tps") / _median(mlx_lm, "decode_tps"),
        "ttft_added_ms": (_median(ours, "ttft_s") - _median(mlx_lm, "ttft_s")) * 1000,
        "same_tokens_mlx_lm_backend": all(r["token_ids"] == ours[0]["token_ids"] for r in mlx_lm + ours),
    }
    sides = result.get("llama") or {}
    if sides:  # against each thread setting; the headline ratio is the stricter (the faster llama-server)
        ratios = {
            k: _median(ours, "prefill_tps") / _median(v["runs"], "prefill_tps") for k, v in sides.items()
        }
        fastest = min(ratios, key=lambda k: ratios[k])
        llama = sides[fastest]["runs"]
        out["prefill_ratio_vs_llama"] = ratios[fastest]
        out["prefill_ratio_vs_llama_by_threads"] = ratios
        out["llama_threads_compared"] = fastest
        out["decode_ratio_vs_llama"] = _median(ours, "decode_tps") / _median(llama, "decode_tps")
        out["paired_prefill_ratios_vs_llama"] = [
            o["prefill_tps"] / w["prefill_tps"] for o, w in zip(ours, llama, strict=True)
        ]
        out["tokens_agreeing_with_llama"] = _common_prefix(ours[0]["token_ids"], llama[0]["token_ids"])
    if result.get("reference"):
        ref = result["reference"]["runs"]
        out["prefill_speedup_vs_reference"] = _median(ours, "prefill_tps") / _median(ref, "prefill_tps")
        out["decode_vs_reference"] = _median(ours, "decode_tps") / _median(ref, "decode_tps")
        out["same_tokens_as_reference"] = all(r["token_ids"] == ref[0]["token_ids"] for r in ours + ref)
    return out


def run_mlx_bench(
    model: Any,
    tokens: int = 64,
    repeats: int = 3,
    llama_threads: tuple[int | None, ...] = (1, None),
    reference: bool = True,
) -> dict[str, Any]:
    """`llama_threads`: a llama-server per setting (None: the server's default, all cores); () for none."""
    import mlx.core as mx

    from .cpu_fast import blas_status, min_rows

    backend = MLXBackend()
    backend.load(model)
    prompt_ids = backend.apply_chat_template(MESSAGES)
    servers = {_threads_label(t): _start_llama(model, t) for t in llama_threads}
    ref = ReferenceProcess(model.name) if reference else None
    raw: list[dict[str, Any]] = []
    ours: list[dict[str, Any]] = []
    served: dict[str, list[dict[str, Any]]] = {k: [] for k in servers}
    refs: list[dict[str, Any]] = []
    try:
        run_mlx_lm(backend, prompt_ids, 8)  # warm-up (the reference child's prefill alone takes a minute)
        run_backend(backend, 8)
        for server in servers.values():
            run_llama(server, prompt_ids, 8)
        for _ in range(repeats):
            raw.append(run_mlx_lm(backend, prompt_ids, tokens))
            ours.append(run_backend(backend, tokens))
            for k, server in servers.items():
                served[k].append(run_llama(server, prompt_ids, tokens))
            if ref is not None:
                refs.append(ref.run(tokens))
    finally:
        for server in servers.values():
            server.close()
        if ref is not None:
            ref.close()
    backend.close()
    status = blas_status()
    result: dict[str, Any] = {
        **_provenance(),
        "benchmark": "mlx",
        "model": model.name,
        "device": str(mx.default_device()),
        "blas": {
            "active": status.active,
            "library": Path(status.library).name,
            "symbol": status.symbol,
            "threads": status.threads,
            "reason": status.reason,
            "dequant_min_rows": min_rows(),
        },
        "prompt_tokens": len(prompt_ids),
        "tokens": tokens,
        "repeats": repeats,
        "mlx_lm": _side(raw),
        "backend": _side(ours),
        "llama": {k: _side(v) for k, v in served.items()},
        "reference": _side(refs) if refs else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "load1_end": _load1(),
    }
    result.update(summarize(result))
    return result


def _threads_label(threads: int | None) -> str:
    return f"-t {threads}" if threads else "server default"


def _start_llama(model: Any, threads: int | None) -> Any:
    from .llama_server import LlamaServerBackend

    # None: llama.cpp's own choice (-t -1), not flashcode's default of a core fewer
    server = LlamaServerBackend(context_length=2048, threads=threads if threads is not None else -1)
    server.load(model)
    return server


def _provenance() -> dict[str, Any]:
    from .provenance import provenance

    return provenance()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true", help="skip the FLASHCODE_CPU_FAST=0 process")
    ap.add_argument(
        "--llama-threads",
        default="1,default",
        help="llama-server -t settings to compare, comma-separated ('default': the server's; '': none)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--reference-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reference_child:
        return _reference_child(args.model)

    from .models import find_model

    model = find_model(args.model)
    threads = tuple(None if t == "default" else int(t) for t in args.llama_threads.split(",") if t)
    result = run_mlx_bench(model, args.tokens, args.repeats, threads, not args.no_reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict) or k == "blas"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
