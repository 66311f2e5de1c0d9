"""The agent (issue 4): route each turn to chat, web search or a shell command; tools run only
after approval. Entry point: `AgentSession` (agent.py); the web app's side is `web.AgentBridge`.
See docs/agent.md."""

from .agent import AgentSession
from .events import Decision, Proposal
from .router import ROUTES, RouteDecision, route, route_step
from .search import DDGSProvider, LocalSearchProvider, SearchProvider, SearchResult, SearchUnavailableError
from .store import MIGRATIONS, AgentStore, ensure_schema

__all__ = [
    "MIGRATIONS", "ROUTES", "AgentSession", "AgentStore", "DDGSProvider", "Decision", "LocalSearchProvider",
    "Proposal", "RouteDecision", "SearchProvider", "SearchResult", "SearchUnavailableError", "ensure_schema",
    "route", "route_step",
]  # fmt: skip
