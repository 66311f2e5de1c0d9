"""Saved project contexts: a project's KV cache on disk, listed, renamed, deleted, resumed, moved.

What this module knows: the layout under `$FLASHCODE_HOME/projects/<project_id>/contexts/<id>/`
(`meta.json`, the cache file, `tokens.json` with the token ids the cache holds), how to write it
atomically (a hidden temp directory, fsync, one rename), which model a context belongs to (name and
weights hash), the per-project size quota, and the portable one-file export (`.flashctx`, a zip).

What it does not know: threads, HTTP, the database, conversations. `save` and `resume` call into the
backend, so they run on the engine's worker thread (`await worker.acall(lambda b: store.save(b, ...))`);
the rest is plain file work, safe from any thread. Resuming never touches a conversation: when it
fails (another model, a damaged file) the caller keeps the conversation and re-reads it (re-prefill);
`try_resume` returns the message to show for that.

Display names are free text and never become paths; project and context ids must match a strict
pattern, and every path is checked to stay inside the project's own folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import stat
import struct
import tempfile
import time
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import __version__, paths
from .base import CacheMismatchError, EngineError, Message, ModelInfo, PromptCacheBackend
from .paths import fsync_path, write_text_atomic

CONTEXT_FORMAT = "flashcode-context/1"
EXPORT_SUFFIX = ".flashctx"
DEFAULT_QUOTA_BYTES = 4 << 30  # per project; FLASHCODE_CONTEXT_QUOTA_MB overrides
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_CTX_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")
_MEMBERS = {"meta.json", "tokens.json", "cache.safetensors", "cache.bin"}
_CACHE_OF = {"mlx": "cache.safetensors", "llama": "cache.bin"}  # backend -> its cache file
_MAX_NAME = 100
# An import inflates nothing before checking what its zip header declares (a zip bomb is refused unread).
MAX_META_BYTES = 64 << 10
MAX_TOKENS_BYTES = 64 << 20  # ~6M token ids as JSON
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_SHA = re.compile(r"[A-Za-z0-9_-]{1,128}")


class ContextNameError(EngineError):
    """A project id, context id or name that is not allowed (path traversal, odd characters)."""


class ContextNotFoundError(EngineError):
    pass


class QuotaExceededError(EngineError):
    """`adding`: the bytes the refused save needed; `quota`: the project's quota. A save larger than the whole
    quota cannot be made room for."""

    def __init__(self, message: str, adding: int = 0, quota: int = 0) -> None:
        super().__init__(message)
        self.adding, self.quota = adding, quota


class ContextImportError(EngineError):
    """An export file that is not a flashcode context, or whose model is not installed here."""


@dataclass(frozen=True)
class SavedContext:
    id: str
    project_id: str
    name: str
    model: str
    model_sha256: str
    backend: str
    token_count: int
    kv_bits: int
    size_bytes: int
    created: str  # ISO 8601, UTC
    flashcode_version: str
    cache_file: str
    cache_crc32: int
    conversation_id: str | None = None
    problem: str | None = None  # set by `list` when a cheap check fails ("damaged: ...")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ResumeResult:
    resumed: bool
    message: str  # what to show the user either way
    context: SavedContext | None
    tokens: int = 0  # tokens now in the live cache
    seconds: float = 0.0


# --------------------------------------------------------------------------- names and model identity
def check_id(value: str, what: str = "project id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ContextNameError(f"{what} {value!r} is not allowed: use 1-64 letters, digits, '-' or '_'")
    return value


def check_context_id(value: str) -> str:
    if not isinstance(value, str) or not _CTX_ID.fullmatch(value):
        raise ContextNameError(
            f"context id {value!r} is not a saved-context id (like 20261122-113000-a1b2c3)"
        )
    return value


def clean_name(name: str) -> str:
    """A display name: printable, one line, at most 100 characters. Never used as a path."""
    text = "".join(ch if unicodedata.category(ch)[0] != "C" else " " for ch in str(name))
    text = " ".join(text.split())[:_MAX_NAME]
    if not text:
        raise ContextNameError("a saved context needs a name")
    return text


def slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", unicodedata.normalize("NFKD", name)).strip("-").lower()
    return s[:48] or "context"


_fingerprints: dict[tuple[str, float], str] = {}


def model_identity(model: ModelInfo) -> str:
    """The weights hash that ties a context to a model: the imported GGUF's sha256 (`flashcode.json`),
    else a fingerprint of config.json and the safetensors headers and sizes (names renamed models alike)."""
    meta = model.path / "flashcode.json"
    if meta.exists():
        sha = json.loads(meta.read_text()).get("source_sha256")
        if sha:
            return str(sha)
    key = (str(model.path), (model.path / "config.json").stat().st_mtime)
    if key not in _fingerprints:
        h = hashlib.sha256((model.path / "config.json").read_bytes())
        for f in sorted(model.path.glob("*.safetensors")):
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(min(n, 64 << 20)))
        _fingerprints[key] = "fp-" + h.hexdigest()
    return _fingerprints[key]


def crc32_file(path: Path) -> int:
    crc = 0
    with path.open("rb") as fh:
        while chunk := fh.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def quota_from_env() -> int:
    mb = paths.env_number("FLASHCODE_CONTEXT_QUOTA_MB", -1)
    return int(mb * (1 << 20)) if mb >= 0 else DEFAULT_QUOTA_BYTES


# --------------------------------------------------------------------------- import checks
def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _shown(value: Any) -> str:
    return f"{_clip(repr(value))} ({type(value).__name__})"


def _whole(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high  # not a bool, not a float


def _plain(value: Any, limit: int) -> bool:
    """One line of printable text, 1..limit characters (no controls, no bidi overrides)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= limit
        and not any(unicodedata.category(ch)[0] == "C" for ch in value)
    )


def _iso_time(value: Any) -> bool:
    try:
        return _plain(value, 40) and bool(datetime.fromisoformat(value))
    except ValueError:
        return False


_META_RULES: list[tuple[str, str, Callable[[Any], bool]]] = [
    ("format", repr(CONTEXT_FORMAT), lambda v: v == CONTEXT_FORMAT),
    ("name", "text", lambda v: isinstance(v, str)),
    ("model", "a model name (text, 1-200 characters)", lambda v: _plain(v, 200)),
    (
        "model_sha256",
        "a weights hash (letters, digits, '-', '_')",
        lambda v: isinstance(v, str) and bool(_SHA.fullmatch(v)),
    ),
    ("backend", "'mlx' or 'llama'", lambda v: isinstance(v, str) and v in _CACHE_OF),
    ("token_count", "a whole number of tokens >= 0", lambda v: _whole(v, 0, 1 << 31)),
    ("kv_bits", "a whole number of bits, 1-64", lambda v: _whole(v, 1, 64)),
    ("cache_bytes", "a whole number of bytes >= 0", lambda v: _whole(v, 0, 1 << 50)),
    ("cache_crc32", "a CRC-32 (a whole number below 2**32)", lambda v: _whole(v, 0, 0xFFFFFFFF)),
    ("cache_file", "the cache file's name", lambda v: isinstance(v, str) and v in _CACHE_OF.values()),
    ("created", "an ISO 8601 time", _iso_time),
    ("flashcode_version", "a version (text, 1-40 characters)", lambda v: _plain(v, 40)),
    (
        "conversation_id",
        "a conversation id or null",
        lambda v: v is None or (isinstance(v, str) and bool(_ID.fullmatch(v))),
    ),
]


def check_meta(meta: Any, source: str) -> dict[str, Any]:
    """An imported meta.json, field by field: the known fields, the name cleaned. Raises
    ContextImportError naming the field, the value found and what it must be."""
    fix = "re-export it with flashcode"
    if not isinstance(meta, dict):
        raise ContextImportError(
            f"{source} has a bad meta.json: it must be a JSON object, found {_shown(meta)}: {fix}"
        )
    for field, want, ok in _META_RULES:
        if field == "conversation_id" and field not in meta:
            continue  # optional
        if field not in meta:
            raise ContextImportError(f"{source} has a bad meta.json: the field {field!r} is missing: {fix}")
        if not ok(meta[field]):
            raise ContextImportError(
                f"{source} has a bad meta.json: {field!r} must be {want}, found {_shown(meta[field])}: {fix}"
            )
    if meta["cache_file"] != _CACHE_OF[meta["backend"]]:
        raise ContextImportError(
            f"{source} has a bad meta.json: 'cache_file' of a {meta['backend']} context is "
            f"{_CACHE_OF[meta['backend']]!r}, found {_shown(meta['cache_file'])}: {fix}"
        )
    out = {field: meta.get(field) for field, _, _ in _META_RULES}
    try:
        out["name"] = clean_name(meta["name"])
    except ContextNameError as exc:
        raise ContextImportError(
            f"{source} has a bad meta.json: 'name' is empty without its control characters: {fix}"
        ) from exc
    return out


def _inflate(zf: zipfile.ZipFile, info: zipfile.ZipInfo, out: Any, limit: int) -> int:
    """Copy one member into `out` (a binary file or a BytesIO), never more than its declared size
    nor `limit` bytes, whatever the compressed stream holds. Returns the bytes written."""
    if info.file_size > limit:
        raise ContextImportError(
            f"{info.filename} declares {_human(info.file_size)}; a context's "
            f"{info.filename} is at most {_human(limit)}: refused unread"
        )
    done = 0
    try:
        with zf.open(info) as src:
            while chunk := src.read(1 << 20):
                done += len(chunk)
                if done > info.file_size:
                    raise ContextImportError(f"{info.filename} inflates past its declared size: refused")
                out.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        raise ContextImportError(f"{info.filename} is damaged ({exc}): re-export it") from exc
    if done != info.file_size:
        raise ContextImportError(
            f"{info.filename} is truncated ({done} of {info.file_size} bytes): re-export it"
        )
    return done


def _starts_as_zip(file: Path) -> bool:
    try:
        with open(file, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _check_tokens(path: Path, meta: dict[str, Any], source: str) -> None:
    """tokens.json must hold whole token ids; an MLX cache holds exactly `token_count` of them."""
    try:
        tokens = json.loads(path.read_bytes())["tokens"]
    except (ValueError, RecursionError, KeyError, TypeError) as exc:
        raise ContextImportError(
            f"{source} has an unreadable tokens.json ({type(exc).__name__}): re-export it"
        ) from exc
    if not isinstance(tokens, list) or not all(_whole(t, 0, 1 << 31) for t in tokens):
        raise ContextImportError(
            f"{source} has a bad tokens.json: 'tokens' must be a list of token ids: re-export it"
        )
    if meta["backend"] == "mlx" and len(tokens) != meta["token_count"]:
        raise ContextImportError(
            f"{source} is damaged: its tokens.json holds {len(tokens)} token ids for {meta['token_count']} "
            "cached tokens: re-export it"
        )


def _human(n: float) -> str:
    from .models import human_size

    return human_size(n)


def _write_json(path: Path, data: Any) -> None:
    """Atomic: temp file in the same folder, fsync, rename, fsync the folder."""
    write_text_atomic(path, json.dumps(data, indent=1))


# --------------------------------------------------------------------------- backends
def _kind(backend: Any) -> str:
    if getattr(backend, "name", "") == "llama":
        return "llama"
    if isinstance(backend, PromptCacheBackend) and hasattr(backend, "prompt_cache"):
        return "mlx"
    raise EngineError(
        f"the {getattr(backend, 'name', '?')} engine cannot save contexts: use the mlx or llama engine"
    )


def _llama_kv_bits(backend: Any) -> int:
    kind = str(getattr(backend, "settings", {}).get("cache_type_k") or "f16")
    return {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "f32": 32}.get(kind, 16)


def _save_cache(
    backend: Any, folder: Path, kv_bits: int | None, meta: dict[str, str], snapshot: Any = None
) -> tuple[str, list[int], int, int]:
    """Write the backend's live cache (or its `snapshot`, MLX's, taken before) into `folder`: (file name,
    token ids, token count, KV bits). llama-server keeps the token ids inside its slot file, so its list is
    empty."""
    if _kind(backend) == "llama":
        if snapshot is not None:
            raise EngineError("a copy of another engine's cache cannot be saved by llama-server: not saved")
        if kv_bits is not None:
            raise EngineError("llama-server saves its slot as it is: set --cache-type-k/v to quantize its KV")
        res = backend.save_prompt_cache(folder / "cache.bin", meta)
        Path(str(folder / "cache.bin") + ".json").unlink(missing_ok=True)  # folded into meta.json
        return "cache.bin", [], int(res["n_saved"]), _llama_kv_bits(backend)
    extra = {"snapshot": snapshot} if snapshot is not None else {}
    res = backend.save_prompt_cache(folder / "cache.safetensors", meta, kv_bits=kv_bits, **extra)
    tokens = list(res["tokens"])
    return "cache.safetensors", tokens, len(tokens), int(res["metadata"]["kv_bits"])


def _load_cache(backend: Any, ctx: SavedContext, folder: Path, tokens: list[int]) -> int:
    if _kind(backend) != ctx.backend:
        raise CacheMismatchError(
            f"context {ctx.name!r} was saved by the {ctx.backend} engine and the "
            f"{backend.name} engine is running: switch engines to resume it"
        )
    if ctx.backend == "llama":
        return int(backend.load_prompt_cache(folder / ctx.cache_file)["n_restored"])
    return int(backend.load_prompt_cache(folder / ctx.cache_file, tokens=tokens)["tokens"])


@contextlib.contextmanager
def _unless_deleted(project_id: str, folder: Path) -> Iterator[None]:
    """A context deleted on another thread (another window, the autosave) while it is read or changed:
    ContextNotFoundError (a 404, "not found"), not a bare FileNotFoundError."""
    try:
        yield
    except FileNotFoundError as exc:
        if folder.is_dir():
            raise
        raise ContextNotFoundError(f"project {project_id} has no saved context {folder.name}") from exc


def _tree_files(folder: Path) -> list[os.stat_result]:
    """The regular files under `folder`, as `lstat` sees them. A file or folder removed while it is walked
    (a save deleted on another thread: the event loop drops a stale automatic save while the worker
    thread checks the quota) is left out instead of raising FileNotFoundError."""
    out = []
    for root, _dirs, names in os.walk(folder):  # os.walk skips a folder that vanishes under it
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(st.st_mode):
                    out.append(st)
    return out


def _tree_bytes(folder: Path) -> int:
    return sum(st.st_size for st in _tree_files(folder))


def installed_with(sha: str, root: Path | None = None) -> str | None:
    """The name of an installed model with these weights (`model_identity`; renamed models match), in the
    data directory `root` (the one the process runs on: `--data-dir` and $FLASHCODE_HOME set it alike)."""
    from .models import list_models

    for m in list_models(root):
        try:
            if model_identity(m) == sha:
                return m.name
        except (OSError, ValueError):
            continue
    return None


# --------------------------------------------------------------------------- the store
class ContextStore:
    """Saved contexts of every project under one data directory."""

    def __init__(self, root: Path | None = None, quota_bytes: int | None = None) -> None:
        self.root = paths.projects_dir(root)
        self.quota_bytes = quota_bytes if quota_bytes is not None else quota_from_env()

    # ------------------------------------------------------------------ paths
    def contexts_dir(self, project_id: str, create: bool = False) -> Path:
        d = self.root / check_id(project_id) / "contexts"
        if create:
            d.mkdir(parents=True, exist_ok=True)
        if d.exists() and d.resolve() != self.root.resolve() / project_id / "contexts":
            raise ContextNameError(f"{d} leads outside project {project_id}'s folder: refused")
        return d

    def context_dir(self, project_id: str, context_id: str) -> Path:
        d = self.contexts_dir(project_id) / check_context_id(context_id)
        if not (d / "meta.json").is_file() or d.is_symlink():
            raise ContextNotFoundError(f"project {project_id} has no saved context {context_id}")
        return d

    # ------------------------------------------------------------------ reading
    def list(self, project_id: str) -> list[SavedContext]:
        """Newest first. A context whose files fail a cheap check is listed with `problem` set."""
        d = self.contexts_dir(project_id)
        out = []
        for sub in d.iterdir() if d.is_dir() else []:
            if _CTX_ID.fullmatch(sub.name) and (sub / "meta.json").is_file() and not sub.is_symlink():
                try:
                    out.append(self._read(project_id, sub))
                except ContextNotFoundError:
                    continue  # deleted while the list was read
        return sorted(out, key=lambda c: c.created, reverse=True)

    def get(self, project_id: str, context_id: str) -> SavedContext:
        return self._read(project_id, self.context_dir(project_id, context_id))

    def usage(self, project_id: str) -> int:
        """Bytes on disk of the project's saved contexts (a save in progress not counted)."""
        d = self.contexts_dir(project_id)
        subs = [x for x in d.iterdir() if not x.name.startswith(".tmp-")] if d.is_dir() else []
        return sum(_tree_bytes(x) for x in subs)

    def _read(self, project_id: str, folder: Path) -> SavedContext:
        """The context's meta.json; one that cannot be read is still listed (its bytes count toward the
        quota), with `problem` saying so, so that it can be seen and deleted."""
        try:
            return self._parse(project_id, folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, FileNotFoundError) and not folder.is_dir():
                raise ContextNotFoundError(f"no saved context {folder.name} in project {project_id}") from exc
            files = _tree_files(folder)
            when = max((st.st_mtime for st in files), default=0.0)
            return SavedContext(
                id=folder.name,
                project_id=project_id,
                name=folder.name,
                model="?",
                model_sha256="",
                backend="?",
                token_count=0,
                kv_bits=0,
                size_bytes=sum(st.st_size for st in files),
                created=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)),
                flashcode_version="?",
                cache_file="",
                cache_crc32=0,
                problem="damaged: its meta.json cannot be read; delete it",
            )

    def _parse(self, project_id: str, folder: Path) -> SavedContext:
        m = json.loads((folder / "meta.json").read_text())
        cache = folder / m["cache_file"]
        problem = None
        if m["cache_file"] not in _MEMBERS or not cache.is_file():
            problem = "damaged: the cache file is missing"
        elif cache.stat().st_size != int(m["cache_bytes"]):
            problem = f"damaged: the cache file is {cache.stat().st_size} bytes, expected {m['cache_bytes']}"
        if problem and not folder.is_dir():  # deleted on another thread after its meta.json was read
            raise ContextNotFoundError(f"no saved context {folder.name} in project {project_id}")
        return SavedContext(
            id=folder.name,
            project_id=project_id,
            name=str(m["name"]),
            model=str(m["model"]),
            model_sha256=str(m["model_sha256"]),
            backend=str(m["backend"]),
            token_count=int(m["token_count"]),
            kv_bits=int(m["kv_bits"]),
            size_bytes=int(m["cache_bytes"]),
            created=str(m["created"]),
            flashcode_version=str(m["flashcode_version"]),
            cache_file=str(m["cache_file"]),
            cache_crc32=int(m["cache_crc32"]),
            conversation_id=m.get("conversation_id"),
            problem=problem,
        )

    # ------------------------------------------------------------------ saving (worker thread)
    def save(
        self,
        backend: Any,
        project_id: str,
        name: str,
        kv_bits: int | None = None,
        conversation_id: str | None = None,
        messages: Sequence[Message] | None = None,
        snapshot: Any = None,
    ) -> SavedContext:
        """Save the backend's live context (the last conversation it ran) under `project_id`; `snapshot`:
        a copy of it taken before (MLX's `snapshot_prompt_cache`), written instead of the live one.
        `kv_bits`: None keeps the cache's own precision; 16, 8 or 4 make the file smaller.
        `messages`: the conversation the user means; when given, the live cache must hold it (its
        prompt up to the last reply), else EngineError says to send a message in it first."""
        name = clean_name(name)
        model = backend.model
        if model is None:
            raise EngineError("no model is loaded: there is no context to save")
        if messages is not None:
            self._check_conversation(backend, messages)
        self._check_quota(project_id, 0)
        parent = self.contexts_dir(project_id, create=True)
        self._sweep(parent)
        now = datetime.now(UTC)
        cid = f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
        try:
            header = {
                "flashcode_context": CONTEXT_FORMAT,
                "model": model.name,
                "model_sha256": model_identity(model),
            }
            cache_file, tokens, count, bits = _save_cache(backend, tmp, kv_bits, header, snapshot)
            size = (tmp / cache_file).stat().st_size
            self._check_quota(project_id, size, kv_bits)
            meta = {
                "format": CONTEXT_FORMAT,
                "name": name,
                **header,
                "backend": _kind(backend),
                "token_count": count,
                "kv_bits": bits,
                "flashcode_version": __version__,
                "created": now.isoformat(timespec="seconds"),
                "cache_file": cache_file,
                "cache_bytes": size,
                "cache_crc32": crc32_file(tmp / cache_file),
                "conversation_id": conversation_id,
            }
            _write_json(tmp / "tokens.json", {"tokens": tokens})
            _write_json(tmp / "meta.json", meta)
            os.rename(tmp, parent / cid)  # the context appears whole or not at all
            fsync_path(parent)
        except (OSError, RuntimeError) as exc:  # a full disk: MLX's writer raises RuntimeError
            if isinstance(exc, EngineError):
                raise
            raise EngineError(
                f"the context could not be written to {parent} ({' '.join(str(exc).split())[:200]}): free some "
                "disk space, or save at a lower KV precision, and try again"
            ) from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return self.get(project_id, cid)

    @staticmethod
    def _check_conversation(backend: Any, messages: Sequence[Message]) -> None:
        """The live MLX cache must start with the conversation's prompt (llama-server keeps its own)."""
        if _kind(backend) != "mlx":
            return
        msgs = list(messages)
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()  # the reply is in the cache as generated tokens, not as templated text
        if not msgs:
            raise EngineError("the conversation is empty: there is no context to save yet")
        prompt = backend.apply_chat_template(msgs)
        if backend.prompt_cache.tokens[: len(prompt)] != prompt:
            raise EngineError(
                "the engine's live context belongs to another conversation (or was reset): "
                "send a message in this conversation, then save"
            )

    def _check_quota(self, project_id: str, adding: int, kv_bits: int | None = None) -> None:
        used = self.usage(project_id)
        if used + adding <= self.quota_bytes:
            return
        hint = " or save at a lower KV precision (8 or 4 bits)" if kv_bits not in (4,) else ""
        need = f"; this context needs {_human(adding)}" if adding else ""
        raise QuotaExceededError(
            f"project {project_id}'s saved contexts use {_human(used)} of its {_human(self.quota_bytes)} quota{need}: "
            f"delete or export older contexts{hint} (the quota is FLASHCODE_CONTEXT_QUOTA_MB)",
            adding,
            self.quota_bytes,
        )

    @staticmethod
    def sweep_leftovers(root: Path) -> int:
        """Remove every temp folder a crash mid-save left in the data directory's saved and automatic
        contexts (`projects/*/contexts|autosave/.tmp-*`); the bytes freed. Only for a process that holds the
        data directory's lock (`flashcode serve` at its start): no save of another can be in flight then. A
        176 MB leftover made the next save fail for lack of disk while the window said 2 MB used."""
        freed = 0
        for leftover in paths.projects_dir(root).glob("*/*/.tmp-*"):
            place = leftover.parent
            # projects/scratch is the Default project's working folder (the user's files), not a data folder
            if (
                place.name not in ("contexts", "autosave")
                or place.parent.name == "scratch"
                or leftover.is_symlink()
            ):
                continue
            if leftover.is_dir():
                freed += sum(
                    f.stat().st_size for f in leftover.rglob("*") if f.is_file() and not f.is_symlink()
                )
                shutil.rmtree(leftover, ignore_errors=True)
        return freed

    @staticmethod
    def _sweep(parent: Path) -> None:
        """Remove temp folders left by a crash mid-save (older than an hour, so never a live one)."""
        for d in parent.glob(".tmp-*"):
            try:
                age = time.time() - d.stat().st_mtime
            except FileNotFoundError:  # a delete's `.tmp-del-` folder, removed meanwhile on another thread
                continue
            if age > 3600:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ resuming (worker thread)
    def resume(self, backend: Any, project_id: str, context_id: str, verify: bool = True) -> ResumeResult:
        """Make a saved context the backend's live cache. Raises CacheMismatchError (another model, a
        damaged file) or ContextNotFoundError, leaving the backend's cache and every conversation as they were."""
        t0 = time.perf_counter()
        folder = self.context_dir(project_id, context_id)
        ctx = self._read(project_id, folder)
        if ctx.problem and not ctx.cache_file:  # its meta.json is unreadable: nothing to check a model by
            raise CacheMismatchError(f"saved context {ctx.name!r} is {ctx.problem}")
        self.check_model(ctx, backend.model)
        if ctx.problem:
            raise CacheMismatchError(f"saved context {ctx.name!r} is {ctx.problem}")
        if verify and crc32_file(folder / ctx.cache_file) != ctx.cache_crc32:
            raise CacheMismatchError(
                f"saved context {ctx.name!r} is damaged: its cache file fails its checksum"
            )
        try:
            tokens = [int(t) for t in json.loads((folder / "tokens.json").read_text())["tokens"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CacheMismatchError(
                f"saved context {ctx.name!r} is damaged: tokens.json is unreadable"
            ) from exc
        if ctx.backend == "mlx" and len(tokens) != ctx.token_count:
            raise CacheMismatchError(
                f"saved context {ctx.name!r} is damaged: {len(tokens)} token ids for "
                f"{ctx.token_count} cached tokens"
            )
        n = _load_cache(backend, ctx, folder, tokens)
        dt = time.perf_counter() - t0
        return ResumeResult(True, f"resumed {ctx.name!r}: {n} tokens in {dt:.2f} s", ctx, n, dt)

    @staticmethod
    def check_model(ctx: SavedContext, model: ModelInfo | None) -> None:
        if model is None:
            raise CacheMismatchError("no model is loaded: load the context's model to resume it")
        sha = model_identity(model)
        if sha != ctx.model_sha256:
            installed = installed_with(ctx.model_sha256)  # its name now (renamed), or None: the menu lacks it
            fix = (
                f"load {installed} to resume it"
                if installed
                else f"{ctx.model} is not installed any more: import it again (`flashcode import FILE.gguf --name "
                f"{ctx.model}`) to resume it"
            )
            raise CacheMismatchError(
                f"context {ctx.name!r} was saved with model {ctx.model} (weights {ctx.model_sha256[:12]}) and the "
                f"loaded model is {model.name} (weights {sha[:12]}): {fix}"
            )

    # ------------------------------------------------------------------ managing
    def rename(self, project_id: str, context_id: str, name: str) -> SavedContext:
        folder = self.context_dir(project_id, context_id)
        ctx = self._read(project_id, folder)
        if ctx.problem and not ctx.cache_file:
            raise EngineError(f"saved context {context_id} is {ctx.problem}: it cannot be renamed")
        with _unless_deleted(project_id, folder):
            meta = json.loads((folder / "meta.json").read_text())
            meta["name"] = clean_name(name)
            try:
                _write_json(folder / "meta.json", meta)  # atomic: a failed write leaves the old name
            except OSError as exc:  # a full disk: said as a save's is (a review saw a 500)
                if isinstance(exc, FileNotFoundError):
                    raise
                fix = "free some disk space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
                raise EngineError(
                    f"saved context {ctx.name!r} could not be renamed ({exc.strerror or exc}): {fix} and rename "
                    "it again; it keeps its name until then"
                ) from exc
        return self.get(project_id, context_id)

    def relink(self, project_id: str, context_id: str, conversation_id: str) -> SavedContext:
        """Say which conversation the context was saved from, when that conversation came back under another id
        (imported from an export of it): it resumes on that one. Only the label in meta.json changes."""
        folder = self.context_dir(project_id, context_id)
        with _unless_deleted(project_id, folder):
            meta = json.loads((folder / "meta.json").read_text())
            meta["conversation_id"] = conversation_id
            _write_json(folder / "meta.json", meta)  # atomic: a failed write leaves the old label
        return self.get(project_id, context_id)

    def delete(self, project_id: str, context_id: str) -> None:
        folder = self.context_dir(project_id, context_id)
        trash = folder.with_name(f".tmp-del-{context_id}")
        with _unless_deleted(project_id, folder):
            os.rename(folder, trash)  # gone from the list at once, even if the removal is interrupted
        shutil.rmtree(trash, ignore_errors=True)

    def export(self, project_id: str, context_id: str, dest: Path) -> Path:
        """One portable file (a zip: meta.json, tokens.json, the cache). `dest` is a folder or a file path."""
        folder = self.context_dir(project_id, context_id)
        ctx = self._read(project_id, folder)
        if ctx.problem:
            raise EngineError(f"saved context {ctx.name!r} is {ctx.problem}: nothing to export")
        dest = Path(dest)
        if dest.is_dir():
            dest = dest / f"{slug(ctx.name)}-{ctx.id}{EXPORT_SUFFIX}"
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=EXPORT_SUFFIX, dir=dest.parent)
        os.close(fd)
        try:
            with _unless_deleted(project_id, folder), zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
                # KV data does not compress
                for member in ("meta.json", "tokens.json", ctx.cache_file):
                    zf.write(folder / member, member)
            fsync_path(Path(tmp))
            os.replace(tmp, dest)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return dest

    def _free_name(self, project_id: str, name: str) -> str:
        """`name`, or `name (imported)`, `name (imported 2)`, … when a context of the project has it (a `name`
        ending in "(imported)" or "(imported N)" already is numbered on, not given a second one)."""
        taken = {c.name for c in self.list(project_id)}
        if name not in taken:
            return name
        base, n = re.sub(r" \(imported(?: \d+)?\)$", "", name), 1
        while (
            found := clean_name(f"{base[: _MAX_NAME - 16]} (imported{f' {n}' if n > 1 else ''})")
        ) in taken:
            n += 1
        return found

    def import_file(
        self, project_id: str, file: Path, name: str | None = None, require_model: bool = True
    ) -> SavedContext:
        """Add an exported context to `project_id` (a new id; nothing existing is overwritten). With
        `require_model`, an installed model must have the context's weights hash. Every check runs
        before the context appears; a refused import leaves nothing behind."""
        file = Path(file)
        try:
            zf = zipfile.ZipFile(file)
        except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as exc:
            if isinstance(exc, zipfile.BadZipFile) and _starts_as_zip(
                file
            ):  # its end, the zip's index, is missing
                raise ContextImportError(
                    f"{file.name} is incomplete: it begins as a context export but is cut short (a copy or download "
                    "that did not finish?): copy or export it again"
                ) from exc
            raise ContextImportError(f"{file.name} is not a flashcode context export ({exc})") from exc
        with zf:
            meta = self._check_export(zf, file)
            if require_model:
                self._require_installed(meta, file)
            if name is not None:
                meta["name"] = clean_name(name)
            else:  # the same export imported twice: two rows told apart (they were the same name and time)
                meta["name"] = self._free_name(project_id, clean_name(str(meta["name"])))
            self._check_quota(project_id, sum(i.file_size for i in zf.infolist()))
            parent = self.contexts_dir(project_id, create=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
            try:
                for member, limit in (("tokens.json", MAX_TOKENS_BYTES), (meta["cache_file"], 1 << 50)):
                    with (tmp / member).open("wb") as out:
                        _inflate(zf, zf.getinfo(member), out, limit)
                        out.flush()
                        os.fsync(out.fileno())
                _check_tokens(tmp / "tokens.json", meta, file.name)
                if crc32_file(tmp / meta["cache_file"]) != meta["cache_crc32"]:
                    raise ContextImportError(f"{file.name} is damaged: its cache fails its checksum")
                _write_json(tmp / "meta.json", meta)
                self._read(project_id, tmp)  # what `list` and `get` will read must read back
                cid = f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
                os.rename(tmp, parent / cid)
                fsync_path(parent)
            except (
                OSError
            ) as exc:  # a full disk, a folder it may not write: nothing of the import is left behind
                fix = "free some disk space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
                raise ContextImportError(
                    f"{file.name} could not be stored in {parent} ({exc.strerror or exc}): {fix} and import it "
                    "again"
                ) from exc
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        return self.get(project_id, cid)

    @staticmethod
    def _check_export(zf: zipfile.ZipFile, file: Path) -> dict[str, Any]:
        """The zip's directory and meta.json, checked from the declared sizes before anything is inflated."""
        infos = zf.infolist()
        names = [i.filename for i in infos]
        if not set(names) <= _MEMBERS or "meta.json" not in names:
            odd = sorted(set(names) - _MEMBERS)
            shown = ", ".join(_clip(repr(n), 40) for n in odd[:3])
            shown += f" and {len(odd) - 3} more" if len(odd) > 3 else ""
            raise ContextImportError(
                f"{file.name} is not a flashcode context export (unexpected entries [{shown}])"
            )
        if len(set(names)) != len(names):
            raise ContextImportError(f"{file.name} holds the same entry twice: re-export it")
        for info in infos:
            if info.compress_type not in _ZIP_METHODS or info.flag_bits & 0x1:
                raise ContextImportError(
                    f"{file.name}: {info.filename} is encrypted or compressed with method "
                    f"{info.compress_type}; flashcode reads stored or deflated entries: re-export it"
                )
        buf = io.BytesIO()
        _inflate(zf, zf.getinfo("meta.json"), buf, MAX_META_BYTES)
        try:
            raw = json.loads(buf.getvalue())
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
            raise ContextImportError(
                f"{file.name} has an unreadable meta.json ({type(exc).__name__}): re-export it"
            ) from exc
        meta = check_meta(raw, file.name)
        if meta["cache_file"] not in names or "tokens.json" not in names:
            raise ContextImportError(
                f"{file.name} is incomplete (it needs tokens.json and {meta['cache_file']}): re-export it"
            )
        if zf.getinfo(meta["cache_file"]).file_size != meta["cache_bytes"]:
            raise ContextImportError(f"{file.name} is incomplete or damaged: re-export it")
        return meta

    @staticmethod
    def _require_installed(meta: dict[str, Any], file: Path) -> None:
        if installed_with(str(meta["model_sha256"])):
            return
        raise ContextImportError(
            f"{file.name} was saved with model {meta['model']} (weights {str(meta['model_sha256'])[:12]}), "
            f"which is not installed here: import that model first (`flashcode import FILE.gguf`)"
        )


def try_resume(store: ContextStore, backend: Any, project_id: str, context_id: str) -> ResumeResult:
    """`resume`, but a failure becomes a result whose message says the conversation will be re-read."""
    try:
        return store.resume(backend, project_id, context_id)
    except (CacheMismatchError, ContextNotFoundError, ContextNameError) as exc:
        return ResumeResult(
            False, f"{exc}. The conversation is kept; its next reply re-reads it from the start.", None
        )
    except OSError as exc:  # a file the resume needed could not be read or copied (removed, a full disk)
        return ResumeResult(
            False,
            f"could not resume the saved context ({exc.strerror or exc}). The conversation is kept; its "
            "next reply re-reads it from the start.",
            None,
        )
