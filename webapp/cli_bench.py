"""`flashcode bench ...`: benchmarks that print numbers and write JSON under bench/results/.

`bench run` runs the fixed bench set (`webapp.stats.bench`, the same as `/bench` in the chat) and
stores it with the stats; `mlx` and `flash` are engine benchmarks; `llama` and `websocket` run the
scripts under bench/ (a source checkout).
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import Any

from engine import paths
from engine.worker import Worker

from . import engine_host
from .db import Database
from .stats import bench, store
from .units import parse_size, positive_int

RESULTS = Path("bench") / "results"


def write_result(result: dict[str, Any], out: str | None, default_name: str) -> Path:
    path = Path(out) if out else RESULTS / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def cmd_bench_mlx(args: argparse.Namespace) -> int:
    from engine.bench_mlx import run_mlx_bench
    from engine.models import find_model

    result = run_mlx_bench(find_model(args.model), tokens=args.tokens, repeats=args.repeats)
    path = write_result(result, args.out, "mlx.json")
    print(
        f"mlx-lm  decode {result['mlx_lm']['decode_tps']:.2f} tok/s  ttft {result['mlx_lm']['ttft_s'] * 1000:.0f} ms"
    )
    print(
        f"backend decode {result['backend']['decode_tps']:.2f} tok/s  ttft {result['backend']['ttft_s'] * 1000:.0f} ms"
    )
    print(f"decode_ratio {result['decode_ratio']:.3f}  (goal >= 0.95)  -> {path}")
    return 0


def _flash(args: argparse.Namespace) -> int:
    from engine.flash.bench import main

    argv = [
        "--model",
        args.model,
        "--memory-cap",
        args.memory_cap,
        "--tokens",
        args.tokens,
        "--out",
        args.out or str(RESULTS / "flash-dense.json"),
    ]
    if args.prefetch:
        argv += ["--prefetch", args.prefetch]
    for s in args.skip:
        argv += ["--skip", s]
    return int(main(argv) or 0)


def _script(name: str) -> Any:
    """Benchmarks kept as scripts under bench/ (they run from a source checkout)."""

    def run(args: argparse.Namespace) -> int:
        script = Path(__file__).resolve().parent.parent / "bench" / name
        if not script.exists():
            print(f"flashcode: {script} not found: run benchmarks from a source checkout", file=sys.stderr)
            return 2
        sys.argv = [str(script), *args.rest]
        runpy.run_path(str(script), run_name="__main__")
        return 0

    return run


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="run a benchmark; JSON goes to bench/results/")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    p = bsub.add_parser("mlx", help="MLX backend vs mlx_lm.stream_generate on the same model")
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=cmd_bench_mlx)
    p = bsub.add_parser(
        "flash", help="flash engine under a cgroup memory cap vs RAM, lazy mmap and llama-server"
    )
    p.add_argument("--model", required=True, help="model directory (e.g. made by `flashcode synth llama-8b`)")
    p.add_argument("--memory-cap", required=True, help="cgroup memory cap, e.g. 1.75GB (needs root)")
    p.add_argument("--tokens", default="8")
    p.add_argument("--prefetch", default=None)
    p.add_argument("--skip", action="append", default=[], choices=["ram", "mmap", "llama"])
    p.add_argument("--out", default=None, help="default bench/results/flash-dense.json")
    p.set_defaults(func=_flash)
    _add_run(bsub)
    for name, script, help_text in (
        ("llama", "llama.py", "llama-server adapter vs raw llama-server"),
        ("websocket", "websocket.py", "tokens delivered to a websocket client vs the backend"),
        ("agent", "agent.py", "the agent's tool loop on small coding tasks: success rate, steps, time"),
        ("projects", "projects.py", "reopening a conversation: auto-resumed KV cache vs re-prefill (TTFT)"),
    ):
        p = bsub.add_parser(name, help=help_text, add_help=False)  # --help reaches the script: its options
        p.add_argument("rest", nargs=argparse.REMAINDER, help="the script's own options (--help lists them)")
        p.set_defaults(func=_script(script), passes_options_on=True)


# --------------------------------------------------------------------------- bench run
def cmd_bench_run(args: argparse.Namespace) -> int:
    """`flashcode bench run`: load the backend and model, run the set, store and print the run."""
    options = engine_host.backend_options(args)
    worker = Worker(lambda: engine_host.make_loaded_backend(args.backend, args.model, options))
    try:
        backend, model = bench.engine_names(worker)
        results = bench.run_sync(worker, args.max_tokens)
    finally:
        worker.close()
    db = Database(paths.database_path(paths.home()), recover=False)  # a server may be writing a reply
    try:
        earlier = store.bench_runs(db.conn, limit=1)
        run = store.record_bench_run(
            db.conn, backend=backend, model=model, max_tokens=args.max_tokens, results=results
        )
    finally:
        db.close()
    print(bench.format_run(run, earlier[0] if earlier else None))
    if args.out:
        summary = store.summarize(results)
        data = {
            "id": run.id,
            "backend": backend,
            "model": model,
            "max_tokens": run.max_tokens,
            "summary": summary,
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        print(f"-> {args.out}", file=sys.stderr)
    return 0


def _add_run(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "run", help="the fixed /bench prompt set on a backend and model; stored with the stats"
    )
    p.add_argument("--backend", default="auto", choices=["auto", "mlx", "llama", "flash"])
    p.add_argument("--model", default=None, help="installed model name (default: the default model)")
    p.add_argument(
        "--max-tokens", type=positive_int, default=bench.DEFAULT_MAX_TOKENS, help="reply budget per prompt"
    )
    p.add_argument(
        "--memory-budget", type=parse_size, default=None, help="flash backend: hard memory budget, e.g. 300MB"
    )
    p.add_argument("--llama-url", default=None)
    p.add_argument("--ctx-size", type=positive_int, default=None)
    p.add_argument("--out", default=None, help="also write the run as JSON here")
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=cmd_bench_run)
