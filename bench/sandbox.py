"""What the OS sandbox costs per command: the same commands run with and without bubblewrap.

Runs each command through the agent's own `CommandRun` (spawn, stream, exit), sandboxed and not,
interleaved, and reports the median wall time of each and the added milliseconds per command.

    .venv/bin/python bench/sandbox.py [--runs 30] [--folders 24000 --out bench/results/sandbox-folders.json]

`--folders N` fills the project with N empty folders first (a node_modules' shape: packages of nested
folders), which the sandbox's set-up walks for git and data directories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from webapp.agent.runner import CommandRun  # noqa: E402
from webapp.agent.sandbox import SandboxPolicy, detect  # noqa: E402

COMMANDS = ["true", "ls -la | wc -l", "git status --short"]


async def one(command: str, project: Path, sandboxed: bool) -> float:
    run = CommandRun(command, project, sandbox=SandboxPolicy(project) if sandboxed else None)
    t0 = time.perf_counter()
    async for item in run.stream():
        if item.type == "exit" and item.exit_code != 0:
            raise RuntimeError(f"{command!r} failed: {item.describe()} {run.transcript()}")
    return (time.perf_counter() - t0) * 1000


def fill(project: Path, folders: int) -> None:
    """`folders` empty folders: node_modules/pkgI/{lib,dist,src}/{a,b,c}, 13 a package."""
    made = 0
    for i in range(folders):
        package = project / "node_modules" / f"pkg{i}"
        for part in ("lib", "dist", "src"):
            for sub in ("a", "b", "c"):
                (package / part / sub).mkdir(parents=True)
        made += 13
        if made >= folders:
            return


async def measure(runs: int, folders: int = 0) -> dict[str, list[dict[str, float]]]:
    with tempfile.TemporaryDirectory(prefix="flashcode-bench-sandbox-") as tmp:
        project = Path(tmp)
        (project / "a.txt").write_text("x\n")
        fill(project, folders)
        await asyncio.create_subprocess_exec("git", "init", "-q", cwd=project)
        await asyncio.sleep(0.2)
        raw: dict[str, list[dict[str, float]]] = {}
        for command in COMMANDS:
            await one(command, project, True)  # warm-up
            await one(command, project, False)
            rows = []
            for _ in range(runs):
                rows.append(
                    {
                        "sandboxed_ms": await one(command, project, True),
                        "plain_ms": await one(command, project, False),
                    }
                )
            raw[command] = rows
        return raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--folders", type=int, default=0, help="empty folders in the project (default 0)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sandbox.json"))
    args = ap.parse_args()
    status = detect()
    if not status.available:
        print(f"no sandbox here: {status.reason}", file=sys.stderr)
        return 1
    raw = asyncio.run(measure(args.runs, args.folders))
    summary = {}
    for command, rows in raw.items():
        sb = statistics.median(r["sandboxed_ms"] for r in rows)
        plain = statistics.median(r["plain_ms"] for r in rows)
        summary[command] = {
            "sandboxed_ms": round(sb, 2),
            "plain_ms": round(plain, 2),
            "added_ms": round(sb - plain, 2),
        }
        print(f"{command:24s} sandboxed {sb:7.1f} ms   plain {plain:7.1f} ms   added {sb - plain:6.1f} ms")
    result = {
        **provenance(),
        "sandbox": status.kind,
        "runs_per_command": args.runs,
        "project_folders": args.folders,
        "added_ms_per_command": round(statistics.median(s["added_ms"] for s in summary.values()), 2),
        "summary": summary,
        "raw_runs": raw,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"added_ms_per_command": result["added_ms_per_command"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
