"""Routing accuracy of a model on the labelled set `tests/data/routing.jsonl`.

    .venv/bin/python bench/routing.py [--model NAME] [--backend mlx] [--out bench/results/routing.json]

Loads the model once, routes every prompt with `webapp.agent.router.route_step` (the same code the
agent uses), and writes accuracy, per-label recall, the confusion matrix, the mean time per route
and every prediction. It reports a number; it asserts nothing about how high it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "data" / "routing.jsonl"


def load_set(path: Path = DATA) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate(backend, rows: list[dict[str, str]], system: str | None = None) -> dict:
    from webapp.agent.router import ROUTES, ROUTING_SYSTEM, route_step

    preds = []
    t0 = time.perf_counter()
    for row in rows:
        d = route_step(backend, row["prompt"], system=system or ROUTING_SYSTEM)
        preds.append(
            {
                "prompt": row["prompt"],
                "expected": row["route"],
                "route": d.route,
                "scores": {k: round(v, 3) for k, v in d.scores.items()},
            }
        )
    elapsed = time.perf_counter() - t0
    correct = sum(p["route"] == p["expected"] for p in preds)
    confusion = Counter((p["expected"], p["route"]) for p in preds)
    recall = {}
    for label in ROUTES:
        n = sum(1 for p in preds if p["expected"] == label)
        recall[label] = (
            round(sum(1 for p in preds if p["expected"] == label and p["route"] == label) / n, 3)
            if n
            else None
        )
    return {
        "n": len(rows),
        "correct": correct,
        "accuracy": round(correct / len(rows), 3),
        "majority_baseline": round(max(Counter(r["route"] for r in rows).values()) / len(rows), 3),
        "recall": recall,
        "confusion": {f"{e}->{r}": n for (e, r), n in sorted(confusion.items())},
        "predicted_counts": dict(Counter(p["route"] for p in preds)),
        "mean_route_ms": round(elapsed / len(rows) * 1000, 1),
        "predictions": preds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="mlx")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing.json"))
    ap.add_argument(
        "--system", default=None, help="file with an alternative routing instruction (to compare prompts)"
    )
    args = ap.parse_args(argv)

    from webapp.engine_host import make_loaded_backend

    backend = make_loaded_backend(args.backend, args.model)
    try:
        rows = load_set()
        system = Path(args.system).read_text().strip() if args.system else None
        result = evaluate(backend, rows, system)
    finally:
        name = backend.model.name if backend.model else None
        backend.close()
    from engine.provenance import provenance

    result = {
        **provenance(),
        "model": name,
        "backend": args.backend,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "system_prompt": "custom: " + args.system if args.system else "router.ROUTING_SYSTEM",
        **result,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{name} on {args.backend}: routing accuracy {result['accuracy']:.1%} ({result['correct']}/{result['n']}), "
        f"majority baseline {result['majority_baseline']:.1%}, recall {result['recall']}, "
        f"{result['mean_route_ms']} ms/route"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
