"""One rank of a pipeline (`engine.pipeline`), started by `mlx.launch` on each host of the hostfile.

Every rank loads its own layers and runs the same `MLXBackend.stream` on each request. Rank 0 connects
back to the server (127.0.0.1, with the launch's token), takes its requests and its Stop, hands the
requests to the other ranks through `mx.distributed`, and streams the events back.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .base import Done, EngineError, GenerationStats, ModelInfo
from .mlx_backend import MLXBackend, cast_for_device, peak_rss_bytes
from .pipeline import TOKEN_ENV, event_to_json, layer_span, pipeline_model, request_from_json


def _stream() -> Any:
    """The stream mlx-lm generates on: the ranks' own collectives (requests, Stop, stats) are queued there
    too, behind the model's send/recv/all-gather, so every rank runs them all in the same order. (On
    another stream they ran beside the next token's forward pass and read each other's bytes.)"""
    from mlx_lm.generate import generation_stream

    return generation_stream


def broadcast_json(group: Any, obj: Any) -> Any:
    """Rank 0's `obj` on every rank (others pass None): its JSON bytes summed over the group."""
    import mlx.core as mx
    import numpy as np

    data = json.dumps(obj).encode() if group.rank() == 0 else b""
    n = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=group, stream=_stream())
    n = int(n.item())
    buf = np.frombuffer(data, dtype=np.uint8).astype(np.int32) if data else np.zeros(n, dtype=np.int32)
    got = mx.distributed.all_sum(mx.array(buf), group=group, stream=_stream())
    return json.loads(np.array(got).astype(np.uint8).tobytes())


def gather_ints(group: Any, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same length on each), row r from rank r: a sum of one-row matrices
    (an all-sum, which the ring backend does for any size; its all-gather of a few bytes did not)."""
    import mlx.core as mx
    import numpy as np

    rows = np.zeros((group.size(), len(values)), dtype=np.int32)
    rows[group.rank()] = values
    return mx.distributed.all_sum(mx.array(rows), group=group, stream=_stream()).tolist()


class SharedStop:
    """A `cancel` every rank agrees on: each check is one all-sum of the ranks' own flags (rank 0's is
    the server's Stop). The ranks run the same code, so they check at the same points. The same all-sum
    carries each rank's live counters (`counters()`: KB read from disk, MB resident), which rank 0 hands
    to `on_rows` (the server's live meter), so the meter costs no collective of its own."""

    def __init__(
        self,
        group: Any,
        counters: Callable[[], list[int]] | None = None,
        on_rows: Callable[[list[list[int]]], None] | None = None,
    ) -> None:
        self.group = group
        self.local = threading.Event()
        self.agreed = False
        self.counters = counters or (lambda: [0, 0])
        self.on_rows = on_rows

    def is_set(self) -> bool:
        if not self.agreed:
            got = gather_ints(self.group, [1 if self.local.is_set() else 0, *self.counters()])
            self.agreed = any(row[0] for row in got)
            if self.on_rows is not None:
                self.on_rows([[r, *row[1:]] for r, row in enumerate(got)])
        return self.agreed


class RankBackend(MLXBackend):
    """The MLX backend holding one rank's layers (loaded lazily: the others are never read)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.layers = (0, 0)

    def load(self, model: ModelInfo) -> None:
        import mlx.core as mx
        from mlx_lm import load as mlx_load

        obj, tok, cfg = mlx_load(str(model.path), return_config=True, lazy=True)
        self.layers = pipeline_model(obj, self.group)
        cast_for_device(obj)
        mx.eval(obj.parameters())
        self.model_obj, self.tokenizer, self.config = obj, tok, cfg
        self._model_info = model
        self.prompt_cache.reset()


def flash_rank(group: Any, memory_budget: int | str | None) -> Any:
    """The flash engine holding one rank's layers: it streams only their FFNs or experts from this
    host's disk, under this host's budget (`auto`: what this host can spare)."""
    from .flash.backend import FlashBackend

    class RankFlashBackend(FlashBackend):
        def _layer_span(self, man: Any) -> tuple[int, int]:
            self.layers = layer_span(int(man.config["num_hidden_layers"]), group.rank(), group.size())
            return self.layers

        def _own_layers(self, model: Any) -> None:
            got = pipeline_model(model, group)
            if got != self.layers:
                raise EngineError(
                    f"rank {group.rank()}: the model split as {got}, the flash split as {self.layers}"
                )

    return RankFlashBackend(memory_budget=memory_budget)


def read_kb(backend: Any) -> int:
    """KB the backend (flash) has read from disk so far, as an int32 all-sum carries it."""
    reader = getattr(backend, "reader", None)
    return min((reader.stats.bytes >> 10) if reader is not None else 0, 2**31 - 1)


def rank_stats(group: Any, backend: Any, done: Done) -> list[dict[str, Any]]:
    """Every rank's peak memory and (flash) its disk reads for this reply, from one all-sum."""
    x = done.stats.extra
    read_kb = int(x.get("bytes_read") or 0) >> 10
    rate_kb = int(x.get("read_bandwidth_Bps") or 0) >> 10
    budget_mb = int(x.get("memory_budget") or 0) >> 20
    mine = [
        group.rank(),
        peak_rss_bytes() >> 20,
        read_kb,
        int(x.get("bytes_per_token") or 0) >> 10,
        rate_kb,
        budget_mb,
    ]
    out = []
    for r, mb, kb, per_token_kb, rate, budget in gather_ints(group, mine):
        row: dict[str, Any] = {"rank": r, "peak_rss_mb": mb}
        if backend.name == "flash":
            row |= {"bytes_read": kb << 10, "bytes_per_token": per_token_kb << 10, "read_Bps": rate << 10,
                    "memory_budget_mb": budget or None}  # fmt: skip
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model directory (the same path on every host)")
    ap.add_argument("--connect", required=True, help="rank 0: the server's HOST:PORT")
    ap.add_argument("--engine", choices=["mlx", "flash"], default="mlx")
    ap.add_argument("--dist-backend", default="ring", help="mx.distributed's backend (ring, jaccl, nccl)")
    ap.add_argument("--memory-budget", default=None, help="flash: this host's budget in bytes, or auto")
    ap.add_argument("--gpus", default=None, help="nccl: each rank's GPU on its host (ranks sharing a host)")
    args = ap.parse_args(argv)
    if args.gpus and "MLX_RANK" in os.environ:  # before MLX starts CUDA: mlx.launch gives every rank GPU 0
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus.split(",")[int(os.environ["MLX_RANK"])]
    import mlx.core as mx

    dist = "jaccl" if args.dist_backend.startswith("jaccl") else args.dist_backend
    group = mx.distributed.init(backend=dist, strict=True)
    rank = group.rank()
    path = Path(args.model)
    t0 = time.perf_counter()
    if args.engine == "flash":
        budget = args.memory_budget
        backend = flash_rank(group, int(budget) if budget and budget.isdigit() else budget)
    else:
        backend = RankBackend(group)
    from .models import model_info

    backend.load(model_info(path))  # with its split, when it has one (flash)
    load_s = time.perf_counter() - t0
    # flash: what the load read (the meter counts from here)
    mine = [
        rank,
        backend.layers[0],
        backend.layers[1],
        peak_rss_bytes() >> 20,
        int(load_s * 1000),
        read_kb(backend),
    ]
    ranks = [
        {"rank": r, "layers": [a, b], "load_rss_mb": m, "load_s": ms / 1000, "load_read_kb": kb}
        for r, a, b, m, ms, kb in gather_ints(group, mine)
    ]

    import psutil

    requests: queue.Queue[dict[str, Any]] = queue.Queue()
    conn = None
    live_sent = [0.0]

    def counters() -> list[int]:
        return [read_kb(backend), psutil.Process().memory_info().rss >> 20]

    def on_rows(rows: list[list[int]]) -> None:  # rank 0: to the server's meter, at most twice a second
        now = time.monotonic()
        if conn is not None and now - live_sent[0] >= 0.5:
            live_sent[0] = now
            send({"t": "live", "rows": rows})

    stop = SharedStop(group, counters, on_rows if rank == 0 else None)
    if rank == 0:
        host, port = args.connect.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)))
        hello = {"token": os.environ.get(TOKEN_ENV, ""), "ranks": ranks}
        conn.sendall(json.dumps(hello).encode() + b"\n")

        def listen() -> None:
            for line in conn.makefile("rb"):
                msg = json.loads(line)
                if msg.get("op") == "cancel":
                    stop.local.set()
                else:
                    requests.put(msg)
            requests.put({"op": "quit"})  # the server went away

        threading.Thread(target=listen, daemon=True).start()

    def send(obj: dict[str, Any]) -> None:
        if conn is not None:
            conn.sendall(json.dumps(obj).encode() + b"\n")

    while True:
        msg = broadcast_json(group, requests.get() if rank == 0 else None)
        if msg.get("op") == "reset":  # forget the prompt cache on every rank (the next prompt is prefilled)
            backend.prompt_cache.reset()
            continue
        if msg.get("op") != "generate":
            break
        stop.local.clear()
        stop.agreed = False
        try:
            for ev in backend.stream(request_from_json(msg["request"]), stop):  # type: ignore[arg-type]
                if isinstance(ev, Done):
                    ev.stats.extra["rank_stats"] = rank_stats(group, backend, ev)
                send(event_to_json(ev))
        except Exception as exc:  # noqa: BLE001 - the same on every rank (same code, same input): reported
            # a host dropped (the backend's own words, e.g. "[ring] connection to a peer was lost"): the job is over
            lost = isinstance(exc, RuntimeError) and f"[{dist}]" in str(exc)
            why = f"a host of the pipeline dropped ({exc})" if lost else f"{type(exc).__name__}: {exc}"
            send(event_to_json(Done(GenerationStats(), "error", "", why)) | {"fatal": lost})
            if lost:
                return 1
    if conn is not None:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
