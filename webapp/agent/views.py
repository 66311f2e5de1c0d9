"""Agent events -> HTML fragments (`templates/agent/fragments.html`), for the websocket to send.

What it knows: which macro draws which event. Everything goes through Jinja2 autoescaping: commands,
output, search results and file contents are untrusted. Answer text is not drawn here — the web
app streams and renders it like any reply. What it does not know: sockets, the database.
"""

from __future__ import annotations

from typing import Any

from jinja2 import Environment

from . import events as ev
from .visible import invisible_parts


class AgentViews:
    def __init__(self, env: Environment) -> None:
        env.filters.setdefault("invisible_parts", invisible_parts)  # before the template compiles
        self.ui: Any = env.get_template("agent/fragments.html").module

    def approval_dialog(self, proposal: ev.Proposal, dialog_id: str) -> str:
        return str(self.ui.approval_dialog(proposal, dialog_id))

    def dialog_closed(self, dialog_id: str) -> str:
        return str(self.ui.dialog_closed(dialog_id))

    def notice(self, text: str, level: str = "info") -> str:
        return str(self.ui.notice(text, level))

    def event(self, e: ev._Event) -> str:
        """The fragment for one event; "" for those the web app draws itself (answer text, turn end)."""
        ui = self.ui
        match e:
            case ev.RouteChosen():
                return str(ui.route_badge(e))
            case ev.SearchResults():
                return str(ui.search_cards(e))
            case ev.SearchUnavailable():
                return str(ui.notice(e.message, "warning"))
            case ev.SearchStarted():
                return str(ui.notice(f"Searching the web ({e.provider}) for “{e.query}”…"))
            case ev.Proposal():
                return str(ui.action_block(e))
            case ev.Decided():
                return str(ui.decided(e))
            case ev.ActionOutput():
                return str(ui.output_chunk(e))
            case ev.ActionExit():
                return str(ui.exit_status(e))
            case ev.FileShown():
                return str(ui.file_shown(e))
            case ev.FileWritten():
                return str(ui.file_written(e))
            case ev.HelpShown():
                return str(ui.help(e))
            case ev.Notice():
                return str(ui.notice(e.text, e.level))
            case ev.ModeChanged():
                return str(
                    ui.notice(
                        "Agent mode: messages are routed to chat, web search or the shell."
                        if e.mode == "agent"
                        else "Raw mode: messages go straight to the model."
                    )
                )
            case ev.Cleared():
                return str(ui.notice("Context cleared: the agent starts over."))
            case ev.ModelRequested():
                return str(ui.notice(f"Switching to {e.name}…"))
            case ev.SlashUnhandled():
                return str(ui.notice(f"/{e.name} is not available here yet.", "warning"))
        return ""
