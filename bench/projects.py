"""Reopening a conversation: TTFT of its next turn when its KV cache is resumed automatically vs
when the whole conversation is re-read (re-prefilled), on llama-server and MLX.

A conversation of about `--tokens` tokens (alternating user/assistant turns made of this
repository's source text) is stored in a real database. Each run, on a freshly started engine (no
live cache: llama-server restarted, MLX's cache dropped):

- re-prefilled: the next user turn is generated without any saved cache (TTFT = the engine's);
- resumed: `AutoResume.before_reply` loads the conversation's automatic save (written once, by the
  same code the web app runs: 8-bit KV on MLX, llama-server's slot as its cache type keeps it),
  then the same turn is generated. Its TTFT counts the resume (reading and checking the file) plus
  the engine's TTFT.

`reopen_ttft_ratio` = median resumed / median re-prefilled (goal <= 0.05). Greedy; the two replies
must be the same tokens (`same_reply`). Writes bench/results/projects.json (every raw run, the
command, the git commit and the machine). MLX prefill on a small shared CPU is slow, so its
conversation is smaller by default (`--mlx-tokens`); both sizes are in the file.

    .venv/bin/python bench/projects.py            # or: flashcode bench projects
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from engine.base import Done, GenerationRequest, SamplingParams  # noqa: E402
from engine.models import find_model  # noqa: E402
from engine.worker import Worker  # noqa: E402
from webapp.db import Database  # noqa: E402
from webapp.projects.resume import AutoResume  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
NEXT = "Summarize what the code above does in one sentence."


def source_text() -> str:
    files = sorted((ROOT / "webapp").rglob("*.py"))
    return "\n".join(f.read_text() for f in files)


def build_conversation(db: Database, backend: Any, tokens: int) -> str:
    """A stored conversation of about `tokens` template tokens (user/assistant turns of source)."""
    text = source_text()
    cid = db.create_conversation("bench").id
    pos, turn = 0, 0
    while True:
        history = [{"role": m.role, "content": m.content} for m in db.messages(cid)]
        if history and len(backend.apply_chat_template(history)) >= tokens:
            return cid
        chunk = text[pos : pos + 1200]
        pos += 1200
        role = "user" if turn % 2 == 0 else "assistant"
        db.add_message(cid, role, f"Part {turn}:\n{chunk}" if role == "user" else f"Noted part {turn}.")
        turn += 1


def restart(backend: Any) -> None:
    if hasattr(backend, "close_process"):
        backend.close_process()
        backend.ensure_running()
    else:
        backend.prompt_cache.reset()


def generate(backend: Any, history: list[dict[str, str]]) -> Done:
    done = None
    for ev in backend.stream(GenerationRequest(messages=tuple(history), sampling=GREEDY), threading.Event()):
        if isinstance(ev, Done):
            done = ev
    assert done is not None and done.error is None, done
    return done


async def measure(name: str, make: Any, tokens: int, runs: int, home: Path) -> dict[str, Any]:
    worker = Worker(make)
    db = Database(home / f"{name}.db")
    resume = AutoResume(home, worker, db, idle_s=3600)
    try:
        cid = await worker.acall(lambda b: build_conversation(db, b, tokens))
        history = resume._history(cid)
        prompt_tokens = await worker.acall(lambda b: len(b.apply_chat_template(history)))
        # the conversation's live cache, saved automatically (as at a switch or after idle)
        await worker.acall(lambda b: generate(b, history))
        resume.live, resume.dirty = cid, True
        await resume.save_now()
        saved = resume.saved("default")[0].context
        nxt = [*history, {"role": "user", "content": NEXT}]
        raw = []
        for i in range(runs):
            await worker.acall(restart)
            t0 = time.perf_counter()
            cold = await worker.acall(lambda b: generate(b, nxt))
            cold_wall = time.perf_counter() - t0
            await worker.acall(restart)
            resume.live = None
            t0 = time.perf_counter()
            note = await resume.before_reply(cid)
            resumed_s = time.perf_counter() - t0
            warm = await worker.acall(lambda b: generate(b, nxt))
            raw.append(
                {
                    "run": i,
                    "reprefill_ttft_s": cold.stats.ttft_s,
                    "reprefill_wall_s": round(cold_wall, 4),
                    "resume_s": round(resumed_s, 4),
                    "resumed_engine_ttft_s": warm.stats.ttft_s,
                    "resumed_ttft_s": resumed_s + warm.stats.ttft_s,
                    "cached_tokens_resumed": warm.stats.cached_tokens,
                    "cached_tokens_reprefilled": cold.stats.cached_tokens,
                    "same_reply": warm.text == cold.text,
                    "note": note,
                }
            )
            print(name, raw[-1], flush=True)
        cold_med = statistics.median(r["reprefill_ttft_s"] for r in raw)
        warm_med = statistics.median(r["resumed_ttft_s"] for r in raw)
        return {
            "backend": name,
            "conversation_tokens": prompt_tokens,
            "saved_kv_bits": saved.kv_bits,
            "saved_bytes": saved.size_bytes,
            "reprefill_ttft_s_median": cold_med,
            "resumed_ttft_s_median": warm_med,
            "reopen_ttft_ratio": warm_med / cold_med,
            "same_reply": all(r["same_reply"] for r in raw),
            "runs": raw,
        }
    finally:
        db.close()
        worker.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="llama-server's conversation size")
    ap.add_argument("--mlx-tokens", type=int, default=1024, help="MLX's (its CPU prefill is slow here)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mlx-runs", type=int, default=2)
    ap.add_argument("--backend", action="append", choices=["llama", "mlx"], default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "projects.json"))
    args = ap.parse_args(argv)
    model = find_model(None)
    backends = args.backend or ["llama", "mlx"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="flashcode-bench-projects-") as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(model.path.parent, target_is_directory=True)
        os.environ["FLASHCODE_HOME"] = str(home)  # llama-server's slot files go here
        for name in backends:
            if name == "llama":
                from engine.llama_server import LlamaServerBackend

                def make(m=model) -> Any:
                    b = LlamaServerBackend(context_length=8192, threads=1)
                    b.load(m)
                    return b

                results[name] = asyncio.run(measure(name, make, args.tokens, args.runs, home))
            else:
                from engine.mlx_backend import MLXBackend

                def make(m=model) -> Any:
                    b = MLXBackend()
                    b.load(m)
                    return b

                results[name] = asyncio.run(measure(name, make, args.mlx_tokens, args.mlx_runs, home))
    out = {
        **provenance(),
        "model": model.name,
        "what": "TTFT of the next turn after reopening a conversation: resumed from its automatic KV "
        "save (resume time included) vs re-prefilled; ratio = resumed / re-prefilled (goal <= 0.05)",
        "reopen_ttft_ratio": {k: round(v["reopen_ttft_ratio"], 4) for k, v in results.items()},
        "backends": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["reopen_ttft_ratio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
