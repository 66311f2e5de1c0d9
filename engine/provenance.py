"""Where a benchmark result came from: the command that wrote it, the commit, the machine.

Every script that writes a file in bench/results/ puts `provenance()` at the top of its JSON, beside
the raw runs its summary keys are computed from. Results are never edited by hand; tests/test_bench_results.py
checks every file. On a machine without the repository's .git (the GPU machine gets a copy of the work
tree), `FLASHCODE_GIT_COMMIT` names the commit the copy was made from.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """HEAD's hash, with `-dirty` when the work tree has uncommitted changes to tracked files
    (other than results under bench/results/)."""
    if os.environ.get("FLASHCODE_GIT_COMMIT"):
        return os.environ["FLASHCODE_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        # results written by an earlier benchmark of the same run do not make the code dirty
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", ".", ":(exclude)bench/results"],
            cwd=ROOT,
            capture_output=True,
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:  # pragma: no cover - psutil is a dependency
        pass
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every OS
        pass
    return info


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv if argv is None else argv
    # `flashcode bench llama` runs bench/llama.py under that name (webapp.cli_bench): kept as words, not quoted
    words = argv[0].split() if argv and argv[0].startswith("flashcode ") else argv[:1]
    return {"command": shlex.join([*words, *argv[1:]]), "git_commit": git_commit(), "machine": machine()}
