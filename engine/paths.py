"""Where flashcode keeps what the user makes: `$FLASHCODE_HOME` (default ~/.local/share/flashcode).

models/<name>/      MLX model directories (config.json, *.safetensors, tokenizer, flashcode.json)
gguf/               GGUF files flashcode downloaded itself (the default model)
projects/<id>/      per-project saved contexts
flashcode.db        SQLite: conversations, messages, stats
logs/               llama-server logs and the like
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "FLASHCODE_HOME"


# the numbers a user may set in the environment, and what they are (checked once at start by the CLI)
# (what it counts, the least it may be); FLASHCODE_BLAS_THREADS and _DEQUANT_ROWS fall back on their own
ENV_NUMBERS = {
    "FLASHCODE_CONTEXT_QUOTA_MB": ("MB of saved contexts per project", 0),
    "FLASHCODE_AUTOSAVE_QUOTA_MB": ("MB of automatic saves per project", 0),
    "FLASHCODE_MCP_START_TIMEOUT_S": ("seconds an MCP server has to start", 0),
    "FLASHCODE_MCP_CALL_TIMEOUT_S": ("seconds an MCP tool call may take", 0),
    "FLASHCODE_LLAMA_THREADS": ("llama-server's threads", -1),  # -1: llama.cpp picks
}


def env_number(name: str, default: float) -> float:
    """A number from the environment (unset or empty: `default`); ValueError naming the variable when it is
    not a finite number of at least its least value (ENV_NUMBERS; 0 for others)."""
    import math

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    what, least = ENV_NUMBERS.get(name, ("a number", 0))
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < least:
        raise ValueError(f"${name}={raw!r} is not a number of {what} ({least} or more): fix it, or unset it")
    return value


def default_home() -> Path:
    """The data directory when neither `--data-dir` nor $FLASHCODE_HOME names one."""
    return Path.home() / ".local" / "share" / "flashcode"


def home(override: str | Path | None = None) -> Path:
    if override is not None:
        root = Path(override)
    elif os.environ.get(ENV_HOME):
        root = Path(os.environ[ENV_HOME])
    else:
        root = default_home()
    return _made(root.expanduser().resolve())


def _made(d: Path) -> Path:
    """`d`, made if missing; one that exists is returned as it is (a read-only disk can still be read)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        if not d.is_dir():
            raise
    return d


def models_dir(root: Path | None = None) -> Path:
    return _made((root or home()) / "models")


def gguf_dir(root: Path | None = None) -> Path:
    d = (root or home()) / "gguf"
    d.mkdir(parents=True, exist_ok=True)
    return d


def logs_dir(root: Path | None = None) -> Path:
    d = (root or home()) / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def projects_dir(root: Path | None = None) -> Path:
    d = (root or home()) / "projects"
    d.mkdir(parents=True, exist_ok=True)
    return d


def database_path(root: Path | None = None) -> Path:
    return (root or home()) / "flashcode.db"


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux), else by setting it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` whole or not at all: a temporary file beside it, synced, renamed over it.
    A failure (a full disk) leaves what was there as it was, and no partial file. A symlink is written through
    (its file is replaced), a file keeps its permissions (a new one gets the umask's), and what is not a
    regular file (/dev/null, a pipe) is written to as it is."""
    import stat
    import tempfile

    path = Path(path).resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with path.open("w", encoding="utf-8") as out:
            out.write(text)
        return
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        Path(tmp).unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (the rename of a file into it is durable only then)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)
