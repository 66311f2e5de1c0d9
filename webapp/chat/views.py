"""HTML for the page and for the websocket's out-of-band fragments, from `templates/`.

What it knows: which template or macro draws what, and the model choices (installed models x
available backends). Every value goes through Jinja2 autoescaping or `render_markdown`, so model
output and user text never reach the page as markup. What it does not know: sockets, HTTP.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from . import contexts, stats_view
from .db import StoredMessage
from .render import render_markdown

if TYPE_CHECKING:
    from .state import AppState


def find_dir(name: str) -> Path:
    """`templates/` and `static/` sit at the repo root in a checkout, inside `webapp/` in a wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / name, here / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"flashcode's {name}/ directory is missing (looked next to {here})")


def make_environment() -> Environment:
    return Environment(loader=FileSystemLoader(find_dir("templates")), autoescape=select_autoescape(["html"]))


PLACEHOLDERS = [
    ("projects-window", "Projects", contexts.window_pane_html("default")),
    ("stats-window", "Stats", stats_view.window_pane_html()),
]  # fmt: skip


class Views:
    def __init__(self, state: AppState, env: Environment | None = None) -> None:
        self.state = state
        self.env = env or make_environment()
        self.ui = self.env.get_template("macros.html").module

    # ------------------------------------------------------------------ page
    def page_context(self, conversation_id: str | None = None) -> dict[str, Any]:
        db, engine = self.state.db, self.state.engine
        conv = db.get_conversation(conversation_id) if conversation_id else None
        messages = db.messages(conv.id) if conv else []
        last_stats = next((m.stats for m in reversed(messages) if m.role == "assistant" and m.stats), {})
        return {
            "conversation": conv,
            "messages": messages,
            "rendered": {m.id: Markup(render_markdown(m.content)) for m in messages if m.role == "assistant"},
            "conversations": db.list_conversations(),
            "engine": engine,
            "model_choices": self.model_choices(),
            "current_choice": f"{engine.backend}:{engine.model}",
            "context_used": (last_stats.get("prompt_tokens", 0) + last_stats.get("completion_tokens", 0)),
            "can_regenerate": bool(messages) and messages[-1].role == "assistant",
            "csrf_token": self.state.csrf_token,
            "placeholders": PLACEHOLDERS + [("settings-window", "Settings", self.settings_html())],
        }

    def settings_html(self) -> str:
        s, e = self.state.settings, self.state.engine
        rows = [("Engine", f"{e.backend or 'none'}"), ("Model", e.model or "none"),
                ("Context", f"{e.context_length} tokens"), ("Listening on", f"{s.host}:{s.port}"),
                ("Data", str(self.state.db.path.parent))]  # fmt: skip
        items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in rows)
        return (
            f"<dl>{items}</dl><p>Pick another model or backend with the menu at the top of the chat window.</p>"
            "<h3>Shell allow rules</h3>"
            '<div hx-get="/agent/rules" hx-trigger="load" hx-swap="outerHTML"></div>'
        )

    def model_choices(self) -> list[tuple[str, str]]:
        from engine.models import list_models
        from engine.registry import available_backends

        models = [m.name for m in list_models()]
        if self.state.engine.model and self.state.engine.model not in models:
            models.insert(0, self.state.engine.model)
        backends = available_backends()
        if self.state.engine.backend and self.state.engine.backend not in backends:
            backends.insert(0, self.state.engine.backend)
        return [(f"{b}:{m}", f"{m} · {b}") for m in models for b in backends]

    # ------------------------------------------------------------------ fragments (all out-of-band)
    def message_html(self, m: StoredMessage) -> str:
        rendered = render_markdown(m.content) if m.role == "assistant" and m.status != "streaming" else ""
        return str(self.ui.message(m, Markup(rendered)))

    def append_message(self, m: StoredMessage) -> str:
        return f'<div id="messages" hx-swap-oob="beforeend">{self.message_html(m)}</div>'

    def replace_message(self, m: StoredMessage) -> str:
        return self.message_html(m).replace("<article ", '<article hx-swap-oob="true" ', 1)

    def delete_message(self, message_id: int) -> str:
        return f'<div id="msg-{int(message_id)}" hx-swap-oob="delete"></div>'

    def controls(self, generating: bool, can_regenerate: bool = False, text: str | None = None) -> str:
        out = str(self.ui.controls(generating, can_regenerate, oob=True))
        if text:
            out = out.replace("Writing…", html.escape(text), 1)
        return out

    def gauge(self, used: int) -> str:
        return str(self.ui.gauge(used, self.state.engine.context_length, oob=True))

    def engine_meter(self, meter: dict[str, Any] | None) -> str:
        return str(self.ui.engine_meter(meter, oob=True))

    def conversation_list(self, current_id: str | None, oob: bool = True) -> str:
        conversations = self.state.db.list_conversations()
        count = str(self.ui.conversation_count(len(conversations), oob=True))
        return str(self.ui.conversation_list(conversations, current_id, oob=oob)) + count

    def conversation_list_plain(self, current_id: str | None) -> str:
        return self.conversation_list(current_id, oob=False)

    def conversation_field(self, conversation_id: str) -> str:
        return (f'<input type="hidden" name="conversation_id" id="conversation-id" '
                f'value="{html.escape(conversation_id)}" hx-swap-oob="true">')  # fmt: skip

    def chat_title(self, title: str) -> str:
        return f'<h1 class="title" id="chat-title" hx-swap-oob="true">{html.escape(title)}</h1>'

    def model_picker(self) -> str:
        e = self.state.engine
        menubar = f'<span id="menubar-model" hx-swap-oob="true">{html.escape(e.model or "no model")}</span>'
        return str(self.ui.model_picker(self.model_choices(), f"{e.backend}:{e.model}", oob=True)) + menubar

    def alert(self, text: str, kind: str = "error") -> str:
        return str(self.ui.alert(text, kind))
