"""What constrained tool calls cost on MLX, per token: the llguidance logits processor
(`engine.tool_calls.ToolCallConstraint`) against the same decode without it.

The agent model writes one tool call (`tool_choice="required"`, the agent's tools, temperature 0)
with the constraint on, then the same request with it off; each run is repeated. Recorded: the
processor's own time per constrained token (mask computation + applying it, `constraint_ms_per_token`
in the reply's stats), decode tok/s with and without, and the raw runs. Results go to
bench/results/agent-constraint.json, written by this script only.

    .venv/bin/python bench/agent_constraint.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from engine.base import GenerationRequest, SamplingParams, ToolCall  # noqa: E402
from webapp.agent.loop import DEFAULT_AGENT_MODEL, LOOP_SYSTEM  # noqa: E402
from webapp.agent.tools import openai_tools  # noqa: E402

OUT = ROOT / "bench" / "results" / "agent-constraint.json"
TASK = "Create the file notes.txt whose only line is: buy milk"


def one(backend: Any, constrained: bool) -> dict[str, Any]:
    request = GenerationRequest(
        messages=({"role": "system", "content": LOOP_SYSTEM}, {"role": "user", "content": TASK}),
        sampling=SamplingParams(temperature=0.0, max_tokens=96),
        tools=openai_tools(),
        constrain_tools=constrained,
        tool_choice="required",
    )
    calls, done = [], None
    for ev in backend.stream(request, threading.Event()):
        if isinstance(ev, ToolCall):
            calls.append({"name": ev.name, "arguments": ev.arguments, "error": ev.error})
        elif hasattr(ev, "stats"):
            done = ev
    assert done is not None
    extra = done.stats.extra
    return {
        "constrained": constrained,
        "completion_tokens": done.stats.completion_tokens,
        "decode_tps": round(done.stats.decode_tps, 3),
        "constrained_tokens": extra.get("constrained_tokens", 0),
        "constraint_ms_per_token": round(extra.get("constraint_ms_per_token", 0.0), 3),
        "calls": calls,
        "text": done.text[:300],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=DEFAULT_AGENT_MODEL)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from engine.mlx_backend import MLXBackend
    from engine.models import find_model

    backend = MLXBackend()
    backend.load(find_model(args.model))
    runs = []
    one(backend, True)  # warm-up: builds llguidance's tokenizer (~2 s) and fills the prompt cache
    for _ in range(args.repeats):
        for constrained in (True, False):
            runs.append(one(backend, constrained))
            print(json.dumps(runs[-1])[:200], flush=True)
    backend.close()
    on = [r for r in runs if r["constrained"]]
    off = [r for r in runs if not r["constrained"]]
    doc = {
        **provenance(),
        "model": args.model,
        "backend": "mlx",
        "task": TASK,
        "constraint_ms_per_token": statistics.median(r["constraint_ms_per_token"] for r in on),
        "decode_tps_constrained": statistics.median(r["decode_tps"] for r in on),
        "decode_tps_unconstrained": statistics.median(r["decode_tps"] for r in off),
        "valid_calls_constrained": sum(bool(r["calls"]) and not r["calls"][0]["error"] for r in on) / len(on),
        "valid_calls_unconstrained": sum(bool(r["calls"]) and not r["calls"][0]["error"] for r in off)
        / len(off),
        "raw_runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "raw_runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
