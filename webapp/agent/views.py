"""Agent events -> HTML fragments (`templates/agent/fragments.html`), for the websocket to send.

What it knows: which macro draws which event. Everything goes through Jinja2 autoescaping: commands,
output, search results and file contents are untrusted. Answer text is not drawn here — the web
app streams and renders it like any reply. What it does not know: sockets, the database.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from ..render import invisible_parts, markdown_markup, web_url
from . import events as ev


class AgentViews:
    def __init__(self, env: Environment) -> None:
        env.filters.setdefault("invisible_parts", invisible_parts)  # an environment not from make_environment
        env.filters.setdefault("web_url", web_url)
        env.filters.setdefault("markdown", markdown_markup)  # a replaced reply's text, drawn as a reply is
        self.ui: Any = env.get_template("agent/fragments.html").module
        self.toolbar: Any = env.get_template("transcript.html").module

    def approval_dialog(self, proposal: ev.Proposal, dialog_id: str) -> str:
        return str(self.ui.approval_dialog(proposal, dialog_id))

    def step_waiting(self, call_id: str, waiting: bool) -> str:
        return str(self.ui.step_waiting(call_id, waiting))

    def dialog_closed(self, dialog_id: str) -> str:
        return str(self.ui.dialog_closed(dialog_id))

    def step_counter(self, step: int = 0, max_steps: int = 0) -> str:
        """The chat toolbar's "Step N/M" while a tool-loop turn runs (0: hidden)."""
        return str(self.toolbar.step_counter(step, max_steps, oob=True))

    def notice(self, text: str, level: str = "info") -> str:
        return str(self.ui.notice(text, level))

    def stored(self, type: str, data: Mapping[str, Any]) -> str:
        """A logged event drawn as it was live (`webapp.turns.EventRenderer`): the event class is
        found by its `type`, so an event type added later is stored and redrawn with no change here."""
        if type == SLASH_OUTPUT:  # another feature's answer to its slash command, drawn when it ran
            return str(Markup(str(data.get("html", ""))))  # noqa: S704 - our own escaped fragment
        cls = event_classes().get(type)
        if cls is None:
            return str(self.ui.stored_event(type, data))
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            e = cls(**{k: v for k, v in data.items() if k in names})
            return self.event(e) or str(self.ui.stored_event(type, data))
        except Exception:  # noqa: BLE001
            # logged by an older shape of the event, or an imported file's values a template cannot format:
            # drawn as its fields (escaped) rather than failing the whole transcript
            return str(self.ui.stored_event(type, data))

    def importable(self, type: str, data: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        return importable(type, data)

    def event(self, e: ev._Event) -> str:
        """The fragment for one event; "" for those the web app draws itself (answer text, turn end)."""
        ui = self.ui
        match e:
            case ev.RouteChosen():
                return str(ui.route_badge(e))
            case ev.SearchResults():
                return str(ui.search_cards(e))
            case ev.SearchUnavailable():
                return str(ui.search_unavailable(SEARCH_DOWN, e.message))
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
            case ev.FileUndone():
                return str(ui.notice(e.text))
            case ev.HelpShown():
                return str(ui.help(e))
            case ev.Notice():
                return str(ui.notice(f"{e.text} {e.facts}" if e.facts else e.text, e.level))
            case ev.ReplyReplaced():
                return str(ui.reply_replaced(e))
            case ev.ModeChanged():
                if e.mode != "agent":
                    return str(
                        ui.notice("Chat mode: messages go straight to the model, which has no tools here.")
                    )
                if e.no_tools:
                    return str(
                        ui.notice(
                            f"Agent mode: {e.no_tools} Anything with a side effect asks you first.",
                            offer=e.offer,
                        )
                    )
                return str(
                    ui.notice(
                        "Agent mode: the model works on the project with tools (files, commands, web search); "
                        "anything with a side effect asks you first."
                    )
                )
            case ev.Cleared():
                return str(ui.notice("Context cleared: the model starts over from your next message."))
            case ev.ModelRequested():
                return str(ui.notice(f"Switching to {e.name}…"))
            case ev.ToolStep():
                return str(ui.tool_step(e))
            case ev.ToolStepDone():
                return str(ui.tool_step_done(e))
            case ev.StepLimitReached():
                return str(ui.step_limit(e))
            case ev.ContextTrimmed():
                return str(ui.notice(e.note))
            case ev.SlashUnhandled():
                return str(ui.notice(f"/{e.name} is not available here yet.", "warning"))
        return ""


SLASH_OUTPUT = "slash_output"  # the logged fragment of a slash command another feature answered


def importable(type: str, data: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """An event from an imported conversation file, as it may be logged here (`webapp.db.import_json`).
    The file is untrusted: a slash command's logged HTML comes in as its plain text (a notice); every
    other event is redrawn by `AgentViews.stored`, through the autoescaping templates."""
    if type == SLASH_OUTPUT:
        text = " ".join(Markup(str(data.get("html", ""))).striptags().split())  # noqa: S704 - text out
        return ("notice", ev.Notice(text[:20_000]).to_dict()) if text else None
    return type, dict(data)


def event_classes() -> dict[str, type[ev._Event]]:
    """Every event class by its `type` (subclasses of `events._Event`, however deep)."""
    found: dict[str, type[ev._Event]] = {}
    todo: list[type[ev._Event]] = list(ev._Event.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if dataclasses.is_dataclass(cls):
            default = {f.name: f.default for f in dataclasses.fields(cls)}.get("type")
            if isinstance(default, str):
                found.setdefault(default, cls)
    return found


SEARCH_DOWN = (
    "Web search is unavailable right now: this computer may be offline, or the search service did not answer."
)
