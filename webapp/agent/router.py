"""Route a user turn to `chat`, `search` or `shell` as a constrained choice by the model itself.

How: build a routing prompt (a chat with a short instruction and a few examples), then ask the
backend for the log-probability of each label as the assistant's first word
(`ScoringBackend.score_continuations`: one forward pass when, as with SmolLM2, each label is one
token). The best score wins, so the route is always one of the three, whatever the model or its
quantization. What it does not know: what the routes do (`agent.py`), threads (callers run
`route_step` on the engine worker via `route()`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.base import Message, ScoringBackend

Route = Literal["chat", "search", "shell"]
ROUTES: tuple[Route, ...] = ("chat", "search", "shell")

ROUTING_SYSTEM = """Route each request with one word:
chat: explain, write or review code, talk.
search: look up the web (news, prices, latest versions, docs).
shell: run a command here (files, git, tests, build, install)."""

ASSISTANT_PREFIX = ""  # text the assistant "already wrote" before the label


class RoutingUnavailableError(TypeError):
    """The loaded engine cannot score continuations (no `ScoringBackend`)."""


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    scores: dict[str, float]  # label -> sum of log-probs
    forced: bool = False  # chosen by a slash command, not the model

    @property
    def probabilities(self) -> dict[str, float]:
        """Scores renormalized over the three labels (what the UI shows as percentages)."""
        if not self.scores:
            return {}
        m = max(self.scores.values())
        exp = {k: math.exp(v - m) for k, v in self.scores.items()}
        total = sum(exp.values())
        return {k: v / total for k, v in exp.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "scores": self.scores,
            "probabilities": self.probabilities,
            "forced": self.forced,
        }


def routing_messages(text: str, system: str = ROUTING_SYSTEM) -> list[Message]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"{text.strip()} ->"}]


def route_step(
    backend: Any, text: str, labels: Sequence[str] = ROUTES, system: str = ROUTING_SYSTEM
) -> RouteDecision:
    """Score the labels after the routing prompt. Runs on the thread that owns `backend`."""
    if not isinstance(backend, ScoringBackend) or not callable(getattr(backend, "score_continuations", None)):
        name = getattr(backend, "name", type(backend).__name__)
        raise RoutingUnavailableError(f"the {name} engine cannot score continuations, so it cannot route")
    prompt = list(backend.apply_chat_template(routing_messages(text, system)))
    if ASSISTANT_PREFIX:
        prompt += backend.tokenize(ASSISTANT_PREFIX)
    conts = [backend.tokenize(label) for label in labels]
    scores = score_labels(backend, prompt, conts)
    table = {label: float(s) for label, s in zip(labels, scores, strict=True)}
    best = max(labels, key=lambda lab: table[lab])
    return RouteDecision(best, table)  # type: ignore[arg-type]


def score_labels(backend: Any, prompt: list[int], conts: list[list[int]]) -> list[float]:
    """`score_continuations`, with a fast path for in-RAM MLX models and one-token labels: the KV
    cache of the routing instructions (the same every turn) is kept and trimmed back after each
    route, so a route prefills only the user's words. Same numbers as the plain call."""
    model = getattr(backend, "model_obj", None)
    if getattr(backend, "name", "") != "mlx" or model is None or any(len(c) != 1 for c in conts):
        return list(backend.score_continuations(prompt, conts))
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    state = _PREFIX.get(id(backend))
    if state is None or state[0]() is not model:
        state = (weakref.ref(model), [], make_prompt_cache(model))
    ref, tokens, cache = state
    n = 0
    while n < min(len(tokens), len(prompt) - 1) and tokens[n] == prompt[n]:
        n += 1
    trim_prompt_cache(cache, len(tokens) - n)
    logits = model(mx.array(prompt[n:])[None], cache=cache)[0, -1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits)
    _PREFIX[id(backend)] = (ref, list(prompt), cache)
    return [float(logp[c[0]].item()) for c in conts]


# id(backend) -> (weak ref to the model, tokens in the cache, cache); weak: a switched-out model is freed
_PREFIX: dict[int, tuple[Any, list[int], Any]] = {}


async def route(worker: Any, text: str) -> RouteDecision:
    """Route on the engine worker's thread (MLX must stay there)."""
    return await worker.acall(lambda b: route_step(b, text))
