"""Websocket delivery benchmark: what a browser tab sees vs what the engine itself measured.

For each backend (llama-server and MLX by default) it starts the real `flashcode serve` with the
default model (a fresh data directory sharing the installed models), connects as a browser would
(Origin header, the JSON messages htmx sends) and measures two kinds of turn, both streamed
through the web app's one reply pipeline (`webapp/chat/pipeline.py`):

  chat   a plain message: the chat's own generation
  agent  the same message in agent mode (`/agent`): routed by the model, answered by the agent
         (the route must come out `chat`, so the answer is generated; else the run is refused)

Within the same generation it compares:

  delivery_ratio = client tok/s / engine decode tok/s
      client tok/s = tokens / (arrival of the last token frame - arrival of the first), which is
      how mlx-lm computes the engine's generation_tps
  ttft_added_ms  = client TTFT - engine TTFT (the backend's ttft_s for that reply)
      client TTFT: chat, message sent -> first token frame; agent, the route's frame (sent just
      before the answer is requested from the engine) -> first token frame

llama-server runs with `--llama-threads 1` unless told otherwise: on a small machine shared with
other work, llama.cpp's spinning threads collapse (0.5 tok/s with 2 threads on 2 busy cores here,
60 with one), and the point is the web app's overhead at the engine's full speed.

Goals: delivery_ratio >= 0.98 and ttft_added_ms <= 20 (medians). The script writes
bench/results/websocket.json itself: provenance (command, commit, machine), every raw run, and
the medians per backend and turn kind.

    .venv/bin/python bench/websocket.py [--backend llama --backend mlx] [--runs 5] [--max-tokens 64]
    flashcode bench websocket [same options]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from engine import paths  # noqa: E402
from tests.servers import serve_cli  # noqa: E402

PROMPT = "Tell me a story about a robot who learns to paint."  # routed to chat by the default model
GOAL = {"delivery_ratio": ">= 0.98", "ttft_added_ms": "<= 20"}
TOKEN_FRAME = re.compile(r'id="msg-\d+-tail" hx-swap-oob="innerHTML">')
IDLE = 'id="status" class="controls" data-state="idle"'


def frames_until(ws: ClientConnection, pattern: str) -> list[tuple[float, str]]:
    out = []
    while True:
        frame = str(ws.recv(timeout=600))
        out.append((time.perf_counter(), frame))
        if pattern in frame:
            return out


def send(ws: ClientConnection, **message: Any) -> float:
    ws.send(json.dumps({"type": "send", **message}))
    return time.perf_counter()


def conversation_id(frames: list[tuple[float, str]]) -> str | None:
    for _, frame in frames:
        if m := re.search(r'id="conversation-id" value="([0-9a-f]+)"', frame):
            return m.group(1)
    return None


def measure(base: str, cid: str, frames: list[tuple[float, str]], start: float) -> dict[str, float]:
    """The numbers of the reply whose frames are `frames`, the client's clock starting at `start`."""
    # the tail's "Reading your prompt… N / M tokens" frames (prefill progress) are not tokens
    tokens = [t for t, f in frames if TOKEN_FRAME.search(f) and "prefill-progress" not in f]
    stats = httpx.get(f"{base}/c/{cid}/export.json", timeout=30).json()["messages"][-1]["stats"]
    first, last = (tokens[0], tokens[-1]) if tokens else (0.0, 0.0)
    n = stats["completion_tokens"]
    client_tps = n / (last - first) if last > first else 0.0
    engine_ttft = stats["ttft_s"]
    return {
        "tokens": n,
        "token_frames": len(tokens),
        "engine_decode_tps": stats["decode_tps"],
        "client_tps": client_tps,
        "delivery_ratio": client_tps / stats["decode_tps"] if stats["decode_tps"] else 0.0,
        "engine_ttft_ms": engine_ttft * 1000,
        "client_ttft_ms": (first - start) * 1000 if tokens else 0.0,
        "ttft_added_ms": ((first - start) - engine_ttft) * 1000 if tokens else 0.0,
        # message in -> first token frame handed to the socket, on the server (agent: routing included)
        "server_ttft_ms": stats.get("server_ttft_s", 0.0) * 1000,
    }


def chat_run(base: str, max_tokens: int) -> dict[str, float]:
    with connect(base.replace("http", "ws") + "/ws", origin=base, max_size=None) as ws:
        start = send(ws, text=PROMPT, temperature=0, max_tokens=max_tokens)
        frames = frames_until(ws, IDLE)
    cid = conversation_id(frames)
    assert cid, "the first reply names its conversation"
    return measure(base, cid, frames, start)


def agent_run(base: str, max_tokens: int) -> dict[str, float]:
    with connect(base.replace("http", "ws") + "/ws", origin=base, max_size=None) as ws:
        send(ws, text="/agent")
        cid = conversation_id(frames_until(ws, IDLE))
        assert cid, "/agent starts a conversation"
        send(ws, text=PROMPT, conversation_id=cid, temperature=0, max_tokens=max_tokens)
        frames = frames_until(ws, IDLE)
    routed = [(t, f) for t, f in frames if 'class="agent-route' in f]
    assert routed, "an agent-mode message shows its route"
    route = re.search(r'data-route="(\w+)"', routed[0][1]).group(1)  # type: ignore[union-attr]
    if route != "chat":
        raise RuntimeError(f"the model routed the prompt to {route!r}: pick a PROMPT it routes to chat")
    after = [(t, f) for t, f in frames if t >= routed[0][0]]
    return measure(base, cid, after, routed[0][0])


def bench_backend(
    backend: str, kinds: list[str], runs: int, max_tokens: int, serve_args: tuple[str, ...] = ()
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flashcode-bench-ws-") as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(paths.models_dir(paths.home()), target_is_directory=True)
        (home / "gguf").symlink_to(paths.home() / "gguf", target_is_directory=True)
        with serve_cli(home, *serve_args, backend=backend) as served:
            base = served.base
            chat_run(base, 4)  # warm-up: first-call compilation and caches are not what we measure
            if "agent" in kinds:
                agent_run(base, 4)
            out: dict[str, Any] = {}
            for kind in kinds:
                run = chat_run if kind == "chat" else agent_run
                raw = [run(base, max_tokens) for _ in range(runs)]
                for r in raw:
                    print(
                        f"  {backend:5} {kind:5} " + "  ".join(f"{k}={v:.2f}" for k, v in r.items()),
                        flush=True,
                    )
                out[kind] = {
                    "delivery_ratio": round(statistics.median(r["delivery_ratio"] for r in raw), 4),
                    "ttft_added_ms": round(statistics.median(r["ttft_added_ms"] for r in raw), 2),
                    "engine_decode_tps": round(statistics.median(r["engine_decode_tps"] for r in raw), 2),
                    "runs": raw,
                }
            return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--backend",
        action="append",
        choices=["llama", "mlx", "flash"],
        help="repeatable; default: llama and mlx",
    )
    ap.add_argument("--kind", action="append", choices=["chat", "agent"], help="repeatable; default: both")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-threads", type=int, default=1, help="llama-server's threads (0: its default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "websocket.json"))
    args = ap.parse_args()
    backends, kinds = args.backend or ["llama", "mlx"], args.kind or ["chat", "agent"]
    result: dict[str, Any] = {
        **provenance(),
        "goal": GOAL,
        "model": "default",
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "llama_threads": args.llama_threads or None,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backends": {},
    }
    for backend in backends:
        threads = (
            ("--llama-threads", str(args.llama_threads)) if backend == "llama" and args.llama_threads else ()
        )
        result["backends"][backend] = bench_backend(backend, kinds, args.runs, args.max_tokens, threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        f"{b}/{k}": {m: v[m] for m in ("delivery_ratio", "ttft_added_ms", "engine_decode_tps")}
        for b, kinds_ in result["backends"].items()
        for k, v in kinds_.items()
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
