"""One model across several processes or machines: pipeline parallelism over `mlx.distributed`.

Not a home-made cluster: the ranks are launched the way MLX launches jobs (`mlx.launch` with a
hostfile, the ring backend over TCP), each loads only its own layers (mlx-lm's `pipeline()` where the
architecture has one, a small one here for Llama), and activations travel between ranks with
`mx.distributed` send/recv inside the model's forward pass.

Every rank runs the same `MLXBackend.stream` on the same request (SPMD): greedy decoding is exact,
the prompt caches stay the same on every rank, and the ranks agree on when to stop through one
collective per token (`SharedStop`). Rank 0 runs on this machine and talks to the server over a
loopback socket that needs a per-launch token: it forwards requests to the other ranks (through
`mx.distributed`, see `broadcast_json`) and streams the events back. `PipelineBackend` is the
server's side: a `Backend` whose `stream` sends the request and yields rank 0's events; a host that
drops ends the reply with a clear error (the text so far kept) and the next turn launches again.

The cluster's own links (the ring backend's TCP connections) are not authenticated: they are bound to
the addresses in the hostfile, and belong on a trusted network only (docs/distributed.md).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .base import (
    BackendUnavailableError,
    Done,
    EngineError,
    Event,
    GenerationRequest,
    GenerationStats,
    ModelInfo,
    ModelLoadError,
    PrefillProgress,
    SamplingParams,
    TextDelta,
    ToolCall,
)
from .hostfile import hostfile_backend, load_hostfile, mlx_hostfile
from .mlx_backend import MLXBackend

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ENV = "FLASHCODE_PIPELINE_TOKEN"
RING_PORT = 5670  # the first port of the ring backend's links (one per rank and address)


# --------------------------------------------------------------------------- the model, split by layer
def pipeline_model(model: Any, group: Any) -> tuple[int, int]:
    """Keep only this rank's layers of `model` (lazy: the others are never read from disk) and wire
    its forward pass to the other ranks. Returns (first layer, end) of this rank's slice."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "pipeline"):  # mlx-lm's own (qwen2, qwen3_moe, deepseek…)
        inner.pipeline(group)
        return int(inner.start_idx), int(inner.end_idx)
    if type(inner).__name__ == "LlamaModel" and set(getattr(inner, "layer_types", ())) == {"full_attention"}:
        return _pipeline_llama(model, group)
    kind = getattr(model, "model_type", type(model).__name__)
    raise EngineError(
        f"{kind}: mlx-lm has no pipeline parallelism for this architecture (it has for Llama here, "
        "Qwen2, Qwen3-MoE, DeepSeek and GLM-MoE): run it on one machine, or use llama-server"
    )


def layer_span(n_layers: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s layers [start, end) of `n_layers` over `size` ranks, as mlx-lm's `pipeline()` splits
    them: evenly, the low ranks taking the extra layers, rank 0 the last layers."""
    base, extra = divmod(n_layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def _pipeline_llama(model: Any, group: Any) -> tuple[int, int]:
    """mlx-lm's `PipelineMixin` split for Llama (full attention only), which mlx-lm's llama.py lacks:
    rank r holds the layers after those of ranks r+1…, the last rank the first layers."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    inner = model.model
    rank, size = group.rank(), group.size()
    start, end = layer_span(len(inner.layers), rank, size)
    local = inner.layers[start:end]
    inner.layers = [None] * start + local  # keep the layer numbers for loading the weights
    inner.start_idx, inner.end_idx = start, end  # as mlx-lm's PipelineMixin: the flash engine numbers by them

    def forward(inputs: Any, cache: Any = None, input_embeddings: Any = None) -> Any:
        h = input_embeddings if input_embeddings is not None else inner.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(local)
        mask = create_attention_mask(h, cache[0])
        if rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1, group=group)
        for layer, c in zip(local, cache, strict=True):
            h = layer(h, mask, cache=c)
        if rank != 0:
            h = mx.distributed.send(h, (rank - 1) % size, group=group)
            if cache[-1] is not None:
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
        return inner.norm(h)

    class PipelinedLlama(type(model)):  # type: ignore[misc]
        @property
        def layers(self) -> list[Any]:
            return local

        def make_cache(self) -> list[Any]:
            from mlx_lm.models.cache import KVCache

            return [KVCache() for _ in local]

    model.__class__ = PipelinedLlama
    inner.__class__ = type(
        "PipelinedLlamaModel", (type(inner),), {"__call__": lambda _self, *a, **k: forward(*a, **k)}
    )
    return start, end


# --------------------------------------------------------------------------- requests and events as JSON
def request_to_json(req: GenerationRequest) -> dict[str, Any]:
    d = asdict(req)
    d["messages"] = list(req.messages) if req.messages is not None else None
    d["tools"] = list(req.tools)
    return d


def request_from_json(d: dict[str, Any]) -> GenerationRequest:
    sp = dict(d["sampling"])
    sp["stop"] = tuple(sp.get("stop") or ())
    return GenerationRequest(
        messages=tuple(d["messages"]) if d.get("messages") is not None else None,
        prompt=d.get("prompt"),
        sampling=SamplingParams(**sp),
        tools=tuple(d.get("tools") or ()),
        constrain_tools=bool(d.get("constrain_tools", True)),
        tool_choice=d.get("tool_choice", "auto"),
        progress=bool(d.get("progress")),
        continue_final=bool(d.get("continue_final")),
    )


def event_to_json(ev: Event) -> dict[str, Any]:
    if isinstance(ev, Done):
        return {"t": "done", "stats": ev.stats.to_dict(), "finish": ev.finish_reason, "text": ev.text,
                "error": ev.error}  # fmt: skip
    return {"t": type(ev).__name__} | asdict(ev)


def event_from_json(d: dict[str, Any]) -> Event:
    kind = d.pop("t")
    if kind == "done":
        return Done(GenerationStats(**d["stats"]), d["finish"], d.get("text") or "", d.get("error"))
    if kind == "TextDelta":
        return TextDelta(d["text"], tuple(d["token_ids"]), d.get("kind", "text"))
    if kind == "ToolCall":
        return ToolCall(**d)
    if kind == "PrefillProgress":
        return PrefillProgress(**d)
    raise EngineError(f"unknown event from the pipeline: {kind!r}")


def same_draws(request: GenerationRequest) -> GenerationRequest:
    """The request with a seed when it samples: every rank draws the same tokens (each process's random
    state differs, and a rank that fed its layers another token than rank 0 would write nonsense)."""
    sp = request.sampling
    if sp.temperature == 0 or sp.seed is not None:
        return request
    return replace(request, sampling=replace(sp, seed=secrets.randbits(31)))


# --------------------------------------------------------------------------- the server's side
class PipelineBackend(MLXBackend):
    """The MLX backend with the model split over the hosts of a hostfile. This process holds the
    tokenizer only (chat templates, token counts); the ranks hold the layers."""

    # not over several hosts yet (each rank would save, restore or score only its own layers): without
    # these the app leaves saved contexts and the agent's router off for this engine
    save_prompt_cache = None  # type: ignore[assignment]
    load_prompt_cache = None  # type: ignore[assignment]
    score_continuations = None  # type: ignore[assignment]

    def __init__(
        self,
        hostfile: str | Path,
        engine: str = "mlx",
        memory_budget: int | str | None = None,
        load_timeout: float = 600.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if engine not in ("mlx", "flash"):
            raise BackendUnavailableError(
                f"--hosts runs the mlx or flash engine over several machines, not {engine} (docs/distributed.md)"
            )
        self.name = engine  # each rank runs this engine on its own layers
        self.memory_budget = memory_budget  # flash: each host's own budget (auto: what that host can spare)
        self.hostfile = Path(hostfile)
        self._live: dict[str, Any] = {}
        if engine == "flash":  # the flash meter, per host (the in-RAM engine has none)
            self.live_stats = self._live_stats
        self.hosts = load_hostfile(self.hostfile)
        self.dist_backend = hostfile_backend(self.hostfile)  # ring, or JACCL / NCCL where the hostfile says
        self.load_timeout = load_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: socket.socket | None = None
        self._buf = bytearray()
        self._log: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.ranks: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ load / launch
    def load(self, model: ModelInfo) -> None:
        from mlx_lm.utils import load_config, load_tokenizer

        self.close()
        try:
            self.config = load_config(model.path)
            self.tokenizer = load_tokenizer(model.path, eos_token_ids=self.config.get("eos_token_id"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load {model.name} from {model.path}: {exc}") from exc
        self._model_info = model
        if self.name == "flash" and model.split_path is None and not (model.path / "manifest.json").exists():
            from .flash.split import split_model

            log.info("model %s has no split layout yet: splitting it before the ranks start", model.name)
            split_model(model.path, progress=False)  # here, once, not by every rank at the same time
        self._launch()

    def _launch(self) -> None:
        assert self._model_info is not None
        launcher = Path(sys.executable).with_name("mlx.launch")
        if not launcher.exists():
            found = shutil.which("mlx.launch")
            if found is None:
                raise BackendUnavailableError("mlx.launch is not installed (it comes with the mlx package)")
            launcher = Path(found)
        self._tmp = tempfile.TemporaryDirectory(prefix="flashcode-pipeline-")
        tmp = Path(self._tmp.name)
        (tmp / "hosts.json").write_text(
            json.dumps(mlx_hostfile(self.hosts, self.hostfile, self.dist_backend))
        )
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(1.0)
        token = secrets.token_hex(16)
        argv = [
            str(launcher), "--backend", self.dist_backend, "--hostfile", str(tmp / "hosts.json"),
            "--starting-port", str(_free_port_base(len(self.hosts))), "--nccl-port", str(_free_port_base(1)),
            "--python", sys.executable,
            "--cwd", str(ROOT), "--env", f"{TOKEN_ENV}={token}", "--",
            "-m", "engine.pipeline_rank", "--model", str(self._model_info.path),
            "--connect", f"127.0.0.1:{listener.getsockname()[1]}", "--engine", self.name,
            "--dist-backend", self.dist_backend,
        ]  # fmt: skip
        if self.name == "flash" and self.memory_budget is not None:
            argv += ["--memory-budget", str(self.memory_budget)]
        if self.dist_backend == "nccl":  # ranks on one host take its GPUs in turn
            argv += [
                "--gpus",
                ",".join(str(sum(h.ip == me.ip for h in self.hosts[:r])) for r, me in enumerate(self.hosts)),
            ]
        self._log = open(tmp / "ranks.log", "w+b")  # noqa: SIM115 - read back on failure
        self._proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + self.load_timeout
        try:
            while True:
                if self._proc.poll() is not None:
                    raise ModelLoadError(f"the pipeline's ranks exited while loading: {self._log_tail()}")
                if time.monotonic() > deadline:
                    raise ModelLoadError(
                        f"the pipeline did not load in {self.load_timeout:.0f} s: {self._log_tail()}"
                    )
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(30)
                self._conn, self._buf = conn, bytearray()
                try:
                    hello = json.loads(self._readline(block=True) or b"{}")
                except (OSError, ValueError, EOFError):
                    hello = {}
                if not hmac.compare_digest(str(hello.get("token", "")), token):
                    conn.close()  # not our rank 0
                    self._conn = None
                    continue
                conn.settimeout(None)
                self.ranks = list(hello.get("ranks") or [])
                # the meter's baseline: what each rank read while loading (a reply's MB/token counts from here)
                self._live = {}
                self._take_live([[int(r["rank"]), int(r.get("load_read_kb") or 0), int(r.get("load_rss_mb") or 0)]
                                 for r in self.ranks])  # fmt: skip
                self.model_obj = "pipeline"  # the layers live in the ranks
                return
        except BaseException:
            self._stop_ranks()
            raise
        finally:
            listener.close()

    def _log_tail(self, n: int = 1500) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace").strip()
        return text[-n:] or "(no output)"

    # ------------------------------------------------------------------ generation
    def stream(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        self._require()
        t0 = time.perf_counter()
        text: list[str] = []
        started = False  # an event came back: a failure from here on ends this reply
        for attempt in (0, 1):  # a pipeline found dead before the reply starts is launched again, once
            try:
                if self._conn is None or self._proc is None or self._proc.poll() is not None:
                    self._stop_ranks()
                    self._launch()
                self._send({"op": "generate", "request": request_to_json(same_draws(request))})
                stop_sent = False
                while True:
                    if cancel.is_set() and not stop_sent:
                        self._send({"op": "cancel"})
                        stop_sent = True
                    line = self._readline(block=cancel.is_set())
                    if line is None:
                        continue
                    started = True
                    msg = json.loads(line)
                    if msg.get("t") == "live":  # the ranks' counters, for the live meter
                        self._take_live(msg["rows"])
                        continue
                    fatal = bool(msg.pop("fatal", False))
                    ev = event_from_json(msg)
                    if isinstance(ev, TextDelta):
                        text.append(ev.text)
                    if not isinstance(ev, Done):
                        yield ev
                        continue
                    hosts = ev.stats.extra["hosts"] = self.ranks_with(ev.stats.extra.pop("rank_stats", []))
                    if self.name == "flash" and hosts:  # the reply's reads are every host's, not rank 0's
                        ev.stats.extra["bytes_read"] = sum(int(h.get("bytes_read") or 0) for h in hosts)
                        ev.stats.extra["bytes_per_token"] = sum(
                            int(h.get("bytes_per_token") or 0) for h in hosts
                        )
                    if fatal:  # the ranks are gone: the next turn launches them again
                        self._stop_ranks()
                        ev = self._dropped(t0, text, ev.error or "a host of the pipeline dropped")
                    yield ev
                    return
            except (OSError, ValueError, EOFError) as exc:
                code = self._proc.poll() if self._proc is not None else None
                self._stop_ranks()
                if not started and attempt == 0:
                    log.warning("the pipeline was down (%s): launching it again", exc)
                    continue
                why = (
                    f"a rank exited with code {code}"
                    if code is not None
                    else f"the link to rank 0 broke: {exc}"
                )
                yield self._dropped(t0, text, f"a host of the pipeline dropped ({why})")
                return

    def _dropped(self, t0: float, text: list[str], why: str) -> Done:
        stats = GenerationStats(total_s=time.perf_counter() - t0)
        return Done(
            stats,
            "error",
            "".join(text),
            f"{why}; the reply so far is kept and the next turn starts the pipeline again",
        )

    def reset_cache(self) -> None:
        """Every rank forgets its prompt cache: the next prompt is prefilled in full."""
        if self._conn is not None:
            self._send({"op": "reset"})

    def _take_live(self, rows: list[list[int]]) -> None:
        now = time.monotonic()
        last, self._live = self._live, {"t": now, "rows": {int(r[0]): r for r in rows}}
        dt = now - last.get("t", now)
        rates = {}
        for rank, r in self._live["rows"].items():
            before = last.get("rows", {}).get(rank)
            rates[rank] = max(0, (r[1] - before[1]) << 10) / dt if before is not None and dt > 0 else 0.0
        self._live["rates"] = rates

    def _live_stats(self) -> dict[str, Any]:
        """For the flash meter: every host's disk rate and memory, from the counters the ranks send with
        their per-token all-sum (engine/pipeline_rank.py's SharedStop)."""
        rows, rates = self._live.get("rows", {}), self._live.get("rates", {})
        layers = {int(r["rank"]): r.get("layers") for r in self.ranks}
        hosts = [
            {"host": self.hosts[rank].ip if rank < len(self.hosts) else "?", "layers": layers.get(rank),
             "bytes_per_s": rates.get(rank, 0.0), "rss_bytes": r[2] << 20}
            for rank, r in sorted(rows.items())
        ]  # fmt: skip
        budget = self.memory_budget if isinstance(self.memory_budget, int) else None
        return {
            "bytes_read": sum(r[1] << 10 for r in rows.values()),
            "bytes_per_s": sum(h["bytes_per_s"] for h in hosts),
            "rss_bytes": max(
                (h["rss_bytes"] for h in hosts), default=0
            ),  # the fullest host, against its budget
            "memory_budget": budget,
            "hosts": hosts,
        }

    def ranks_with(self, stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
        by_rank = {int(s["rank"]): s for s in stats}
        out = []
        for r in self.ranks:
            host = self.hosts[int(r["rank"])] if int(r["rank"]) < len(self.hosts) else None
            out.append(r | by_rank.get(int(r["rank"]), {}) | {"host": host.ip if host else "?"})
        return out

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._conn is not None
        self._conn.sendall(json.dumps(msg).encode() + b"\n")

    def _readline(self, block: bool) -> bytes | None:
        """One line from rank 0; None after a short wait (not `block`): Stop may need sending."""
        assert self._conn is not None
        while b"\n" not in self._buf:
            if not block and not select.select([self._conn], [], [], 0.2)[0]:
                return None
            chunk = self._conn.recv(1 << 16)
            if not chunk:
                raise EOFError("rank 0 closed the link")
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        self._stop_ranks()
        super().close()

    def _stop_ranks(self) -> None:
        if self._conn is not None:
            try:
                self._send({"op": "quit"})
            except OSError:
                pass
            self._conn.close()
        self._conn, self._buf = None, bytearray()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(self._proc)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)


def _free_port_base(n: int) -> int:
    """A first port from which `n` consecutive ports are free on loopback (the ring's links)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            for i in range(1, n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    return RING_PORT
