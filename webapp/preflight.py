"""Start-up checks for `flashcode serve` (and `setup`), run before uvicorn starts.

Each check either returns what it found or raises `StartupError` with one sentence that says what
is wrong and what to do; the CLI prints it without a traceback (unless `-v`). Order: the data
directory, its database, the model, the backend's binary, the port, then the engine load itself,
so uvicorn's "Application startup failed" never appears for any of these.

What it does not know: HTTP (the app), how engines generate (only how to load one).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import socket
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import paths
from engine.base import BackendUnavailableError, EngineError, ModelInfo, ModelNotFoundError
from engine.models import AGENT_MODEL, DEFAULT_MODEL, find_model, installed_by_start, list_models, source_gguf
from engine.worker import Worker

from .db import check_version, quick_check, storage_kind

log = logging.getLogger(__name__)


class StartupError(Exception):
    """One sentence for the user: what is wrong and what to do."""


def q(path: Path | str) -> str:
    return shlex.quote(str(path))


def mounted_read_only(path: Path) -> bool:
    """Whether `path` is on a file system mounted read-only (chmod cannot help there)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def not_utf8(text: str, what: str) -> str | None:
    """Why `text` (a prompt from the command line or stdin) cannot be sent to a model: bytes that are not
    UTF-8 arrive as lone surrogates (a Latin-1 file piped in), which no tokenizer takes. None when it is text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if 0xDC80 <= ord(bad) <= 0xDCFF else ""
        return (
            f"{what} is not UTF-8 text{byte}: convert it first, e.g. `iconv -f latin1 -t utf-8 FILE`, "
            "or set a UTF-8 locale in the terminal"
        )
    return None


def check_text(text: str, what: str) -> str:
    """`text`, or StartupError saying it is not UTF-8 (`not_utf8`)."""
    if (why := not_utf8(text, what)) is not None:
        raise StartupError(why)
    return text


# --------------------------------------------------------------------------- data directory
def data_dir() -> Path:
    """The data directory the CLI will use, without creating it."""
    root = os.environ.get(paths.ENV_HOME) or Path.home() / ".local" / "share" / "flashcode"
    return Path(root).expanduser().resolve()


def remove_empty_tree(root: Path) -> None:
    """Remove `root` and the folders under it if they hold no file at all (what a refused start made)."""
    if not root.is_dir() or any(p.is_file() or p.is_symlink() for p in root.rglob("*")):
        return
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        d.rmdir()
    root.rmdir()


def check_data_dir(root: Path) -> Path:
    """Exists (or can be made), is a directory, and this user may read, write and enter it."""
    if root.exists() and not root.is_dir():
        raise StartupError(f"the data directory {root} is a file, not a directory: pass another --data-dir")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(
            f"cannot create the data directory {root} ({exc.strerror}): create it yourself, "
            "or pass another --data-dir"
        ) from exc
    if mounted_read_only(root):
        raise StartupError(
            f"the data directory {root} is on a file system mounted read-only: flashcode writes its database "
            "and logs there, so remount it read-write, or copy it to a writable disk (`cp -a "
            f"{q(root)} ~/flashcode-copy`, everything in it comes along) and pass that (--data-dir or "
            "FLASHCODE_HOME)"
        )
    denied = [
        what
        for what, mode in (("readable", os.R_OK | os.X_OK), ("writable", os.W_OK))
        if not os.access(root, mode)
    ]
    if denied:
        raise StartupError(
            f"the data directory {root} is not {' or '.join(denied)} by you (permission denied): fix its "
            f"permissions (e.g. `chmod u+rwx {q(root)}`), or pass another --data-dir"
        )
    probe = root / f".flashcode-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(
            f"cannot write to the data directory {root} ({exc.strerror}): fix its permissions "
            "or free some space, or pass another --data-dir"
        ) from exc
    return root


_LOCKS: list[Any] = []  # the open lock files: held until this process ends


def lock_data_dir(root: Path) -> bool:
    """One `serve` per data directory: a second would take the first one's streaming reply for a
    crash's and mark it cut, and both would write the same conversations. The lock (flock) goes with
    the process, however it ends. False: this file system has no locks (said in the log)."""
    import fcntl

    path = root / "serve.lock"
    try:
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the process's life
    except OSError as exc:
        raise StartupError(
            f"cannot open {path} ({exc.strerror}): fix the data directory's permissions"
        ) from exc
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no flock on this file system
            log.warning(
                "the data directory %s cannot be locked (%s): run one serve on it at a time", root, exc
            )
            f.close()
            return False
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise StartupError(
            f"another flashcode serve (pid {pid}) is using the data directory {root}: use that one, stop it "
            "first, or give this one a data directory of its own (--data-dir or FLASHCODE_HOME)"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _LOCKS.append(f)
    return True


def unlock_data_dir(root: Path) -> None:
    """A refused start: the lock goes, and its file with it (a data directory this start made is removed)."""
    while _LOCKS:
        _LOCKS.pop().close()
    (root / "serve.lock").unlink(missing_ok=True)


def database_problem(path: Path, exc: BaseException) -> tuple[str, str]:
    """(what is wrong, what to do) about a database SQLite refuses: locked, damaged, not SQLite, no room."""
    text = " ".join(str(exc).split())[:300]
    kind = storage_kind(exc)  # SQLite's result code (db.py: the one reading of it)
    if kind == "busy":
        return (
            f"{path} is locked by another program ({text})",
            "close it (a `sqlite3` shell, a backup or sync tool) and start again",
        )
    if kind == "readonly":
        return read_only(path)
    if kind == "ioerror":
        return (
            f"cannot read or write {path} ({text})",
            "check the disk (a failing or removed one?) and start again",
        )
    if kind == "full" or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return f"cannot write {path} ({text})", "free some disk space and start again"
    if isinstance(exc, OSError):
        return f"cannot write {path} ({text})", "check its permissions and its disk, and start again"
    if "malformed" in text or "corrupt" in text:
        saved = path.with_name("flashcode-recovered.db")
        return (
            f"{path} is damaged ({text})",
            f"keep it, recover what it holds with `sqlite3 {q(path)} .recover | sqlite3 {q(saved)}`, then put "
            "the recovered file in its place (or pass another --data-dir)",
        )
    return (
        f"{path} is not a readable flashcode database ({text})",
        "move it aside to start with an empty history, or pass another --data-dir",
    )


def read_only(path: Path) -> tuple[str, str]:
    """(what is wrong, what to do) about a database this user may not write (its folder holds its journal)."""
    return (
        f"{path} is read-only for this user (flashcode writes it and, beside it, its journal)",
        f"make both writable (chmod u+w {q(path)} {q(path.parent)}) or run as the user who owns them; "
        "nothing in it is lost",
    )


def not_writable(path: Path) -> bool:
    """The database, or the folder its write-ahead log goes in, is not writable by this user."""
    return not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK)


def check_database(root: Path) -> None:
    """Refused before it is touched: a database from a newer flashcode, one that is not SQLite or is
    damaged, one another program holds locked."""
    path = paths.database_path(root)
    if not path.exists():
        return
    if not_writable(path):
        raise StartupError(": ".join(read_only(path)))
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
        try:
            quick_check(conn)  # first: a damaged page can read as a newer schema version
            check_version(conn, path)
        finally:
            conn.close()
        conn = sqlite3.connect(path, timeout=2, isolation_level=None)
        try:  # a write lock, given back at once: another program's open transaction says so now
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StartupError(": ".join(database_problem(path, exc))) from exc
    except RuntimeError as exc:  # NewerDatabaseError: its message says what to do
        raise StartupError(str(exc)) from exc


# --------------------------------------------------------------------------- the model
def check_model(name: str, root: Path) -> ModelInfo:
    """The model is installed and its directory is whole (config and weights as the files say)."""
    as_path = Path(name).expanduser()
    looks_like_path = os.sep in name or name.startswith((".", "~"))
    d = as_path if looks_like_path else paths.models_dir(root) / name
    if not looks_like_path and not d.is_dir() and name != DEFAULT_MODEL:  # the start of one installed name
        try:
            found = installed_by_start(name, root)
        except ModelNotFoundError as exc:
            raise StartupError(f"{exc} (`flashcode models` lists them)") from exc
        d = found.path if found is not None else d
    if looks_like_path and not d.is_dir():
        raise StartupError(
            f"no model directory at {d}: pass an installed model's name or a model directory "
            "to --model (`flashcode models` lists them)"
        )
    if not d.is_dir():
        installed = [m.name for m in list_models(root)]
        setup = f"`flashcode setup --data-dir {q(root)}`"
        if name == DEFAULT_MODEL and not installed:
            raise StartupError(
                f"no model is installed in {root}: run {setup} to fetch the default model "
                f"({DEFAULT_MODEL}), then start again"
            )
        if name == DEFAULT_MODEL:
            raise StartupError(
                f"the default model {DEFAULT_MODEL} is not installed in {root} (installed: "
                f"{', '.join(installed)}): run {setup}, or pick one with --model"
            )
        if name == AGENT_MODEL:  # `flashcode agent`'s default: setup fetches it too
            raise StartupError(
                f"the agent's model {AGENT_MODEL} is not installed in {root} (installed: "
                f"{', '.join(installed) or 'none'}): run {setup} to fetch it, or pick one with --model"
            )
        raise StartupError(
            f"model {name!r} is not installed in {root} (installed: {', '.join(installed) or 'none'}): "
            f"pick one of those with --model, or add yours with "
            f"`flashcode import FILE.gguf --name {q(name)} --data-dir {q(root)}`"
        )
    problem = model_dir_problem(d)
    if problem:
        raise StartupError(f"the model directory {d} is damaged ({problem}): {reinstall_hint(d, root)}")
    try:
        return find_model(str(d), root)
    except (OSError, ValueError, EngineError) as exc:
        raise StartupError(f"the model directory {d} is damaged ({exc}): {reinstall_hint(d, root)}") from exc


def model_dir_problem(d: Path) -> str | None:
    """What is wrong with a model directory, or None: config.json parses, every safetensors file
    is as long as its header says (a cut copy or download is the usual damage)."""
    config = d / "config.json"
    if not config.is_file():
        return "config.json is missing"
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            return "config.json is not a JSON object"
    except (OSError, ValueError) as exc:
        return f"config.json is not valid JSON: {exc}"
    weights = sorted(d.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors weights"
    for f in weights:
        problem = safetensors_problem(f)
        if problem:
            return f"{f.name} {problem}"
    return None


def safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > min(size, 100 << 20):
                return "has no valid header"
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error):
        return "has no valid header"
    ends = [
        int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
    ]
    need = 8 + n + max(ends, default=0)
    return f"is truncated: {size} of {need} bytes" if size < need else None


def reinstall_hint(d: Path, root: Path) -> str:
    if d.name == DEFAULT_MODEL and d.parent == paths.models_dir(root):
        return f"delete it and run `flashcode setup --data-dir {q(root)}`"
    source = source_gguf(d)
    gguf = q(source) if source else "FILE.gguf"
    return f"import it again with `flashcode import {gguf} --name {q(d.name)} --force --data-dir {q(root)}`"


# --------------------------------------------------------------------------- the backend
def check_backend(name: str, options: dict[str, Any]) -> None:
    """The llama backend needs llama-server (unless it attaches to a running one), and with --hosts the
    rpc-server built with it; --hosts needs a hostfile that names this machine first."""
    if options.get("hostfile"):
        from engine.hostfile import load_hostfile
        from engine.registry import backend_class

        try:
            load_hostfile(options["hostfile"])
            backend_class(name, options)
        except EngineError as exc:
            raise StartupError(str(exc)) from exc
    if name == "llama" and options.get("hostfile") and options.get("url"):
        raise StartupError(
            "--hosts starts llama-server itself with its RPC workers; it cannot attach to one already running: "
            "drop --llama-url, or drop --hosts and start that server with --rpc yourself"
        )
    if name != "llama" or options.get("url"):
        return
    from engine.llama_server import find_llama_server  # imports httpx: only for the llama backend

    binary = options.get("binary")
    try:
        found = find_llama_server(binary)
    except BackendUnavailableError as exc:
        if binary:
            raise StartupError(
                f"the llama-server binary {binary!r} (--llama-binary) is not there or not "
                "executable: check the path, or leave --llama-binary out"
            ) from exc
        raise StartupError(
            "llama-server is not installed: install it with `make llama` (or `pip install "
            "'.[llama]'`), put your own llama-server on PATH, or use --backend mlx"
        ) from exc
    if options.get("hostfile"):
        from engine.llama_rpc import find_rpc_server

        try:
            find_rpc_server(found)
        except BackendUnavailableError as exc:
            raise StartupError(str(exc)) from exc


def load_engine(make: Callable[[], Any], model: str, backend: str) -> Worker:
    """Start the engine worker and load the model now, so a failure is reported before serving."""
    worker = Worker()
    try:
        worker.switch(make)
    except EngineError as exc:
        worker.close()
        raise StartupError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - anything else the engine raised while loading
        worker.close()
        raise StartupError(
            f"could not load {model} on the {backend} backend ({type(exc).__name__}: {exc}): "
            "run `flashcode doctor`, or start again with -v for the details"
        ) from exc
    return worker


# --------------------------------------------------------------------------- the port
def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the server's socket; uvicorn serves on it. Port 0 picks a free one."""
    try:
        families = [info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        family = socket.AF_INET if socket.AF_INET in families else families[0]  # localhost: 127.0.0.1
    except socket.gaierror as exc:
        raise StartupError(
            f"cannot resolve --host {host} ({exc.strerror}): pass an address of this machine, "
            "e.g. 127.0.0.1 or 0.0.0.0"
        ) from exc
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(bind_error(host, port, exc)) from exc
    sock.set_inheritable(True)
    return sock


def bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        # `make run` sets FLASHCODE_VIA: its users pick the port with PORT=, not with the flag make passes
        flag = "make run PORT=" if os.environ.get("FLASHCODE_VIA") == "make run" else "--port "
        return (
            f"port {port} on {host} is already in use (another flashcode?): try "
            f"`{flag}{free_port_near(host, port)}`, or `{flag}0` to pick a free one"
        )
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port}: use a port above 1023, e.g. --port 8000"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{host} is not an address of this machine: pass one of its addresses to --host, e.g. 127.0.0.1"
        )
    return f"cannot listen on {host}:{port} ({exc.strerror}): try another --host or --port"


def free_port_near(host: str, port: int) -> int:
    for candidate in range(port + 1, min(port + 50, 65536)):
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, candidate))
                return candidate
        except OSError:
            continue
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
