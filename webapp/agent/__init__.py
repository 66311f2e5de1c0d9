"""The agent: route each turn to chat, web search or a shell command; tools run only after approval.

`agent.py` is the turn loop (`AgentSession`); `router.py` picks the route; `shell.py` decides when a
command needs asking (the policy), `sandbox.py` what it can do if run, `runner.py` runs it; `files.py`
reads and writes project files; `search.py` searches the web; `store.py` keeps rules and the audit
trail; `slash.py` parses slash commands; `events.py` is what a turn yields and `views.py` draws it;
`web.py` is the agent inside the web app. See docs/agent.md.
"""

from .agent import AgentSession
from .events import Decision, Proposal
from .router import ROUTES, RouteDecision, route, route_step
from .search import DDGSProvider, LocalSearchProvider, SearchProvider, SearchResult, SearchUnavailableError
from .slash import SlashCommand, SlashCommands
from .store import AgentStore

__all__ = [
    "ROUTES",
    "AgentSession",
    "AgentStore",
    "DDGSProvider",
    "Decision",
    "LocalSearchProvider",
    "Proposal",
    "RouteDecision",
    "SearchProvider",
    "SearchResult",
    "SearchUnavailableError",
    "SlashCommand",
    "SlashCommands",
    "route",
    "route_step",
]
