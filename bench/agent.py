"""Agent benchmark: small coding tasks solved by the agent's tool loop, end to end.

Each task in tests/data/agent/*.json is a tiny repository (`files`), an instruction and a `check`
command. For each backend (llama-server, MLX) and each decoding mode (constrained tool calls, and
unconstrained: the model's own text read for calls), every task runs in a fresh copy of its repo
through the same `AgentSession` the web app and `flashcode agent` use, with every edit and command
approved (`--approve all`; commands still sandboxed where bubblewrap is available), then the check
runs in the repo. Recorded per run: success, steps (tool, arguments, decision, ok, exit code),
seconds, the answer. The model is the agent model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) at
temperature 0.

Results go to bench/results/agent.json, written by this script only (after every run, so a cut-off
run still leaves what it measured): provenance (command, git commit, machine), `success_rate` per
backend and mode, `tasks` (each task's outcome per backend and mode), every raw run, and which
tasks each backend ran (`--mlx-tasks N` runs MLX on the first N tasks: it is ~5x slower here).

    .venv/bin/python bench/agent.py [--backend llama --backend mlx] [--max-steps 5] [--mlx-tasks 4]
    flashcode bench agent [same options]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from engine.base import SamplingParams  # noqa: E402
from engine.worker import Worker  # noqa: E402
from webapp import engine_host  # noqa: E402
from webapp.agent.agent import AgentSession, FilesAt  # noqa: E402
from webapp.agent.loop import DEFAULT_AGENT_MODEL  # noqa: E402
from webapp.agent.search import LocalSearchProvider  # noqa: E402
from webapp.agent.store import AgentStore  # noqa: E402
from webapp.agent_cli import run_agent_task, terminal_approval  # noqa: E402
from webapp.db import connect_memory  # noqa: E402

TASKS = ROOT / "tests" / "data" / "agent"
OUT = ROOT / "bench" / "results" / "agent.json"
# where each mode lists the project's files for the model (`AgentSession(project_files=…)`)
FILES_AT: dict[str, FilesAt] = {"constrained-nofiles": None, "constrained-filesys": "system"}


def load_tasks() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(TASKS.glob("*.json"))]


def make_repo(task: dict[str, Any], parent: Path) -> Path:
    repo = parent / task["name"]
    repo.mkdir()
    for rel, text in task["files"].items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return repo


def check(task: dict[str, Any], repo: Path) -> bool:
    proc = subprocess.run(["bash", "-c", task["check"]], cwd=repo, capture_output=True, timeout=60)
    return proc.returncode == 0


def run_one(
    worker: Worker,
    task: dict[str, Any],
    constrained: bool,
    max_steps: int,
    project_files: FilesAt = "task",
    show_on_miss: bool = True,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flashcode-agent-bench-") as tmp:
        repo = make_repo(task, Path(tmp))
        session = AgentSession(
            worker,
            repo,
            request_approval=terminal_approval("all"),
            store=AgentStore(connect_memory()),
            search=LocalSearchProvider(),
            max_steps=max_steps,
            constrained=constrained,
            approve_edits=True,
            project_files=project_files,
            sampling=SamplingParams(temperature=0.0, max_tokens=384),
        )
        session.files.show_on_miss = show_on_miss
        t0 = time.perf_counter()
        try:
            result = asyncio.run(run_agent_task(session, task["instruction"], echo=False))
            error = result["stats"].get("error")
        except Exception as exc:  # noqa: BLE001 - a crashed run is a failed run, recorded
            result, error = {"answer": "", "steps": [], "stats": {}}, f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - t0
        ok = check(task, repo)
    return {
        "task": task["name"],
        "success": ok,
        "steps": len(result["steps"]),
        "seconds": round(seconds, 2),
        "step_records": result["steps"],
        "answer": result["answer"][:500],
        "finish_reason": result["stats"].get("finish_reason"),
        "step_limit_reached": result["stats"].get("step_limit_reached"),
        "error": error,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "success_rate": round(sum(r["success"] for r in runs) / len(runs), 3) if runs else None,
        "median_steps": statistics.median(r["steps"] for r in runs) if runs else None,
        "median_seconds": statistics.median(r["seconds"] for r in runs) if runs else None,
    }


def write(doc: dict[str, Any], runs: list[dict[str, Any]], out: Path) -> None:
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(r["backend"], {}).setdefault(r["mode"], []).append(r)
    doc["success_rate"] = {
        b: {m: summarise(rs)["success_rate"] for m, rs in g.items()} for b, g in groups.items()
    }
    doc["summary"] = {b: {m: summarise(rs) for m, rs in g.items()} for b, g in groups.items()}
    tasks: dict[str, dict[str, Any]] = {}
    for r in runs:
        t = tasks.setdefault(r["task"], {"task": r["task"], "results": {}})
        t["results"][f"{r['backend']}/{r['mode']}"] = {
            "success": r["success"],
            "steps": r["steps"],
            "seconds": r["seconds"],
        }
    doc["tasks"] = list(tasks.values())
    doc["raw_runs"] = runs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", choices=["llama", "mlx"], help="default: llama and mlx")
    ap.add_argument(
        "--mode",
        action="append",
        choices=[
            "constrained",
            "unconstrained",
            "constrained-nofiles",
            "constrained-filesys",
            "constrained-noshow",
        ],
        help="constrained-nofiles: without the project's file list; constrained-filesys: the list in the system "
        "prompt (where it was first; default: in the task's message); constrained-noshow: an edit whose text is "
        "not in the file fails without the file's lines (as before they were shown)",
    )
    ap.add_argument("--model", default=DEFAULT_AGENT_MODEL)
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=None, help="run only the first N tasks (every backend)")
    ap.add_argument("--mlx-tasks", type=int, default=None, help="run MLX on the first N tasks only")
    ap.add_argument("--only", action="append", help="run only the task(s) with this name")
    ap.add_argument(
        "--llama-threads", type=int, default=1, help="llama-server threads (1: see bench/websocket.py)"
    )
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    backends = args.backend or ["llama", "mlx"]
    modes = args.mode or ["constrained", "unconstrained"]
    tasks = [t for t in load_tasks() if not args.only or t["name"] in args.only][: args.tasks]
    os.environ["FLASHCODE_LLAMA_THREADS"] = str(args.llama_threads)
    doc: dict[str, Any] = {
        **provenance(),
        "model": args.model,
        "max_steps": args.max_steps,
        "temperature": 0.0,
        "approve": "all (edits and commands approved; commands sandboxed where available)",
        "task_count": len(tasks),
        "tasks_per_backend": {},
        "note": "",
    }
    runs: list[dict[str, Any]] = []
    for backend in backends:
        chosen = tasks[: args.mlx_tasks] if backend == "mlx" and args.mlx_tasks else tasks
        doc["tasks_per_backend"][backend] = [t["name"] for t in chosen]
        if backend == "mlx" and len(chosen) < len(tasks):
            doc["note"] += (
                f"MLX ran the first {len(chosen)} of {len(tasks)} tasks (it decodes ~5x slower on this CPU). "
            )
        worker = Worker(lambda b=backend: engine_host.make_loaded_backend(b, args.model))
        try:
            for mode in modes:
                for task in chosen:
                    r = run_one(
                        worker,
                        task,
                        mode != "unconstrained",
                        args.max_steps,
                        FILES_AT.get(mode, "task"),
                        show_on_miss=mode != "constrained-noshow",
                    )
                    runs.append({"backend": backend, "mode": mode, **r})
                    print(f"{backend:5} {mode:13} {task['name']:20} {'PASS' if r['success'] else 'fail'} "
                          f"{r['steps']} steps {r['seconds']:.0f} s", flush=True)  # fmt: skip
                    write(doc, runs, Path(args.out))
        finally:
            worker.close()
    print(json.dumps(doc["success_rate"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
