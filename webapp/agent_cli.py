"""`flashcode route [--json] PROMPT`: the agent's routing decision for one prompt, with the three
label scores (log-probabilities after the routing prompt). For debugging and evaluation; the web
app routes through the same `webapp.agent.router.route_step`. Part of the command line."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from engine import paths

from . import engine_host
from .agent.router import route_step


def cmd_route(args: argparse.Namespace) -> int:
    if args.data_dir:
        os.environ[paths.ENV_HOME] = os.path.abspath(os.path.expanduser(args.data_dir))
    backend = engine_host.make_loaded_backend(args.backend, args.model)
    try:
        decision = route_step(backend, args.prompt)
        model = backend.model.name if backend.model else None
    finally:
        backend.close()
    if args.json:
        print(
            json.dumps({"prompt": args.prompt, "model": model, "backend": args.backend, **decision.to_dict()})
        )
    else:
        print(decision.route)
        probs = decision.probabilities
        for label, score in decision.scores.items():
            mark = "*" if label == decision.route else " "
            print(f"{mark} {label:<7} logprob {score:8.3f}   {probs[label]:6.1%}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "route", help="show how the agent routes PROMPT (chat, search or shell) and the label scores"
    )
    p.add_argument("prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None, help="installed model name (default: the default model)")
    p.add_argument(
        "--backend",
        default="mlx",
        choices=["mlx", "llama"],
        help="engine that scores the labels (default mlx; llama uses llama-server's token probabilities)",
    )
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=cmd_route)
