"""The chat's HTML: the page's values and the websocket's out-of-band fragments, all drawn by
`templates/page.html` and `templates/macros.html`.

What it knows: which macro draws what, and the model choices (installed models x available
backends). Every value goes through Jinja2 autoescaping or the `markdown` filter, so model output
and user text never reach the page as markup. What it does not know: sockets, HTTP, SQL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jinja2 import Environment
from jinja2_fragments import render_block

from engine.models import list_models
from engine.placement import has_gguf

from ..db import (
    FIND_LIMIT,
    FIND_WORDS,
    REPLACED,
    TRASH_DAYS,
    Conversation,
    Database,
    StoredMessage,
    find_words,
    fold_case,
    folded_span,
)
from ..engine_host import EngineState
from ..settings import Settings
from ..turns import ProjectLookup, ProjectRef
from .transcript import TranscriptViews

# fragments that belong to no one conversation (the status line, the list, alerts, the engine's meter): a window
# writing a reply in one conversation while it shows another gets these, not the reply's (`Session.send_for`)
PAGE_WIDE_IDS = frozenset(
    {"status", "conversation-list", "alerts", "engine-meter", "conversation-changed", "model-picker-box"}
)
PAGE_WIDE_PREFIXES = ("dialog-",)  # an approval dialog lives in #alerts: closing it is the page's too


def can_regenerate(messages: list[StoredMessage]) -> bool:
    """Whether Regenerate can rewrite the last reply: a chat reply, not an agent turn's answer (a
    command, search or slash command is not redone) — as the live page has it after each turn."""
    if not messages or messages[-1].role != "assistant" or messages[-1].stats.get("turn") == "agent":
        return False
    asked = next((m for m in reversed(messages) if m.role == "user"), None)
    return asked is None or not asked.content.lstrip().startswith("/")


MAX_QUERY_CHARS = 200  # the most of a search the list takes


def excerpt(text: str, query: str, before: int = 12, after: int = 60) -> tuple[str, str, str]:
    """The words of `text` around its first `query` (case-insensitive), on one line: (before, match, after),
    with an ellipsis where it was cut; little before it, as a narrow list shows only a line's start. No match
    as typed (SQLite matched it another way): its start."""
    line = " ".join(text.split())
    span = folded_span(line, fold_case(query))  # in the line's own characters, as the SQL's excerpt is
    if span is None:
        return "", "", line[:after] + ("…" if len(line) > after else "")
    at, end = span
    start, stop = max(0, at - before), min(len(line), end + after)
    if start and line[start - 1] != " ":  # cut in a word: from its start (back a little, else the next one)
        back, ahead = line.rfind(" ", max(0, start - 12), start), line.find(" ", start, at)
        start = back + 1 if back >= 0 else ahead + 1 if ahead >= 0 else start
    if stop < len(line) and line[stop] != " " and (space := line.find(" ", stop, stop + 12)) >= 0:
        stop = space  # to the end of the word it cut
    return (
        ("…" if start else "") + line[start:at],
        line[at:end],
        line[end:stop] + ("…" if stop < len(line) else ""),
    )


ENGINE_LABELS = {"mlx": "in RAM (MLX)", "flash": "from SSD (flash)", "llama": "llama-server"}


class ChatViews(TranscriptViews):
    def __init__(
        self,
        env: Environment,
        db: Database,
        engine: EngineState,
        settings: Settings,
        csrf_token: str,
        projects: ProjectLookup | None = None,
    ) -> None:
        self.env, self.db, self.engine, self.settings, self.csrf_token = env, db, engine, settings, csrf_token
        self.projects = projects
        self.ui: Any = env.get_template("macros.html").module
        # whether a window is writing a reply in a conversation (set by the socket's `ChatContext`): a page or a
        # sync drawn meanwhile says so, rather than Ready, in a window that did not start it
        self.writing: Callable[[str], bool] = lambda _conversation_id: False
        # whether any window is writing a reply (set by ChatContext): the engine meter's row, idle or not
        self.busy: Callable[[], bool] = lambda: False
        # a branch's edited message (Edit… on a user message), put in its box when its page is first drawn
        self.drafts: dict[str, str] = {}
        # an edited first message, by project: (text, mode) for the next new conversation drawn there
        self.new_drafts: dict[str, tuple[str, str]] = {}
        # what was typed in a conversation's box when it went to the Trash: in its box when it is next drawn
        self.kept: dict[str, str] = {}

    # ------------------------------------------------------------------ page
    def page(self, conversation_id: str | None = None, undo: Conversation | None = None) -> str:
        """The whole page: a new window (a tab, a reload), never the one writing (its socket is new)."""
        context = self.page_context(conversation_id, undo)
        conv = context["conversation"]
        context["written_elsewhere"] = conv is not None and self.writing(conv.id)
        return self.env.get_template("page.html").render(**context)

    def chat_window(self, conversation_id: str | None = None, project_id: str | None = None) -> str:
        """The chat window alone (a conversation opened, or a new one: `project_id`, the project the page
        shows, which another window may have left since)."""
        context = self.page_context(conversation_id, project_id=project_id)
        conv = context["conversation"]
        context["written_elsewhere"] = conv is not None and self.writing(conv.id)
        return render_block(self.env, "page.html", "chat_window", **context)

    def page_context(
        self,
        conversation_id: str | None = None,
        undo: Conversation | None = None,
        project_id: str | None = None,
    ) -> dict[str, Any]:
        """`undo`: a conversation just moved to the Trash (the list offers it back); `project_id`: the project
        of a new conversation, when it is not the open one."""
        db, engine = self.db, self.engine
        conv = db.get_conversation(conversation_id) if conversation_id else None
        messages = db.messages(conv.id) if conv else []
        project = self.project_of(conv.id if conv else None)
        if conv is None and project_id and self.projects is not None:
            project = self.projects.get(project_id) or project
        choices = self.model_choices()
        context: dict[str, Any] = {
            "conversation": conv,
            "messages": messages,
            "conversations": db.list_conversations(project.id if project else None),
            "project": project,
            "engine": engine,
            "model_choices": choices,
            "current_choice": f"{engine.backend}:{engine.model}",
            "context_used": self.context_used(conv.id if conv else None),
            "engine_meter": self.idle_meter(),
            **self.trust_context(conv.id if conv else None),
            "can_regenerate": can_regenerate(messages),
            "csrf_token": self.csrf_token,
            "project_id": project.id if project else "default",
            "settings_rows": self.settings_rows(),
            "written_with": self.written_with(conv, choices, messages),
            "undo": undo,
            "written_elsewhere": False,  # `page` and `sync` say so; the chat window alone may be the writer's
            "trash_items": self.trash_items(),
            "trash_days": TRASH_DAYS,
            # an Edit… copy's text: until a message is sent there (a reload shows it again)
            "draft": (self.drafts.get(conv.id) or self.kept.pop(conv.id, "")) if conv else "",
        }
        if conv is None and (edited := self.new_drafts.pop(project.id if project else "default", None)):
            context["draft"], context["mode"] = edited  # an edited first message, once, in its mode
        return context

    def written_with(
        self, conv: Conversation | None, menu: list[dict[str, Any]], messages: list[StoredMessage]
    ) -> dict[str, Any] | None:
        """The model a conversation was written with, when another one is loaded now (the window says so, and
        offers to load it: its choice in the `menu`, None when it is not installed any more). None when no
        model wrote any of its `messages` (only commands ran there: `/help`, `/shell` denied)."""
        if conv is None or not conv.model or conv.model == self.engine.model:
            return None
        if not any(m.role == "assistant" and not m.stats.get("not_generated") for m in messages):
            return None
        choices = [v for g in menu if g["model"] == conv.model for v, _, _ in g["options"]]
        wanted = f"{conv.backend}:{conv.model}"
        return {"model": conv.model, "now": self.engine.model,
                "choice": wanted if wanted in choices else (choices[0] if choices else None)}  # fmt: skip

    def settings_rows(self) -> list[tuple[str, str]]:
        s, e = self.settings, self.engine
        return [
            ("Engine", e.backend or "none"),
            ("Model", e.model or "none"),
            ("Context", f"{e.context_length} tokens"),
            ("Memory budget (flash)", e.budget_summary()),
            ("Listening on", f"{s.host}:{s.port}"),
            ("Data", str(self.db.path.parent)),
        ]

    def model_choices(self) -> list[dict[str, Any]]:
        """One group per model — its size in RAM and whether it fits with room to spare (the rule of
        `flashcode serve --model`: engine.placement) — with an option per engine: in RAM, from SSD, llama."""
        infos = list_models()
        models = [m.name for m in infos]
        no_gguf = {i.name for i in infos if not has_gguf(i)}  # llama-server cannot load these: not offered
        base = {i.name for i in infos if not i.has_chat_template}  # marked: completion mode only
        if self.engine.model and self.engine.model not in models:
            models.insert(0, self.engine.model)
        backends = self.engine.menu_backends()
        fits = self.engine.menu_fits(infos)
        groups = []
        for m in models:
            p = fits.get(m)
            given = p is not None and p.source == "given"  # --memory-budget: the fit is against it
            where = "the memory budget" if given else "RAM"
            fit = (
                None if p is None else f"fits in {where}" if p.fits else f"does not fit in {where}: from SSD"
            )
            size = (
                None
                if p is None
                else (f"{p.need / 1e9:.2f} GB" if p.need >= 1e9 else f"{p.need / 1e6:.1f} MB")
            )
            options = [
                (f"{b}:{m}", f"{m} · {ENGINE_LABELS.get(b, b)}" + (" · base model" if m in base else ""),
                 p is not None and p.backend == b)
                for b in backends
                if not (b == "llama" and m in no_gguf and (self.engine.backend, self.engine.model) != (b, m))
            ]  # fmt: skip
            groups.append(
                {"model": m, "size": size, "fit": fit, "fits": p.fits if p else None, "options": options}
            )
        return groups

    def budget_form(self, note: str = "") -> str:
        return str(self.ui.budget_form(self.engine.budget_setting(), self.csrf_token, note))

    # ------------------------------------------------------------------ fragments (all out-of-band)
    def append_message(self, m: StoredMessage) -> str:
        return str(self.ui.appended_message(m))

    def replace_message(self, m: StoredMessage) -> str:
        return str(self.ui.message(m, oob=True))

    def delete_message(self, message_id: int) -> str:
        return str(self.ui.deleted_message(int(message_id)))

    def replaced_reply(self, data: dict[str, Any]) -> str:
        """The folded block of a reply Regenerate replaced (`REPLACED` data), drawn as the transcript does."""
        return self.render_event(REPLACED, data) if self.render_event is not None else ""

    def delete_replaced(self, message_id: int) -> str:
        return str(self.ui.deleted_replaced(int(message_id)))

    def tokens(self, message_id: int, done: str, tail: str) -> str:
        """A token frame: `done` markdown blocks to add for good, `tail` the unfinished rest."""
        return str(self.ui.tokens(message_id, done, tail))

    def prefill(self, message_id: int, processed: int, total: int) -> str:
        """The reply being written says how much of the prompt the engine has read."""
        return str(self.ui.prefill(message_id, int(processed), int(total)))

    def controls(
        self, generating: bool, can_regenerate: bool = False, text: str | None = None, elsewhere: bool = False
    ) -> str:
        """`elsewhere`: another window is writing in the conversation (its status says so)."""
        return str(self.ui.controls(generating, can_regenerate, oob=True, text=text, elsewhere=elsewhere))

    def gauge(self, used: int) -> str:
        return str(self.ui.gauge(used, self.engine.context_length, oob=True))

    def engine_meter(self, meter: dict[str, Any] | None) -> str:
        return str(self.ui.engine_meter(meter, oob=True))

    def idle_meter(self, idle: bool | None = None) -> dict[str, Any] | None:
        """The flash engine's meter between replies (memory, expert hits so far, the disk idle): its row stays,
        so the transcript under it does not move down when a reply starts and back when it ends. While a reply
        is written (in any window) the disk's rate, not "idle". None for an engine without live numbers (no
        row). `idle`: said by the caller (a reply that just ended), else whether no window writes one now.
        `live_stats()` reads counters only: safe off the worker's thread."""
        live = getattr(self.engine.worker.backend, "live_stats", None)
        if live is None:
            return None
        try:
            return meter_numbers(live(), idle=not self.busy() if idle is None else idle)
        except Exception:  # noqa: BLE001 - a meter must never break a page (e.g. the model is being closed)
            return None

    def project_of(self, conversation_id: str | None) -> ProjectRef | None:
        """The project a page shows: the conversation's, or the open one (None: projects not wired)."""
        return self.projects.of_conversation(conversation_id) if self.projects else None

    def conversation_list(
        self, current_id: str | None, oob: bool = True, undo: Conversation | None = None, query: str = ""
    ) -> str:
        """The open project's conversations (`undo`: one just moved to the Trash, offered back at the top;
        `query`: only those whose title or a message holds it, each with the words around it), with the item
        count and the Trash window, both out-of-band."""
        project = self.project_of(current_id)
        project_id = project.id if project else None
        asked, query = query[:MAX_QUERY_CHARS], " ".join(query.split())[:MAX_QUERY_CHARS]
        if query:
            found = self.db.find_conversations(query, project_id)
            conversations = [f.conversation for f in found]
            excerpts = {  # the words around it in a message; none when the title shows every word
                f.conversation.id: excerpt(f.message, f.match or query)
                for f in found
                if f.message is not None
            }
        else:
            conversations, excerpts = self.db.list_conversations(project_id), {}
        count = str(
            self.ui.conversation_count(
                len(conversations),
                oob=True,
                query=query,
                limit=FIND_LIMIT,
                words=FIND_WORDS if query and find_words(query)[1] else 0,
            )
        )
        listed = self.ui.conversation_list(
            conversations,
            current_id,
            oob=oob,
            undo=undo,
            query=query,
            asked=asked,
            excerpts=excerpts,
            now=time.time(),
        )
        return str(listed) + count + self.trash(oob=True)

    def trash_items(self) -> list[dict[str, Any]]:
        """The Trash's conversations (every project's, the last trashed first), each with its project's name."""
        items = []
        for c in self.db.trashed_conversations():
            project = self.projects.get(c.project_id) if self.projects else None
            items.append({"conversation": c, "project": project.name if project else None})
        return items

    def trash(self, oob: bool = False, note: str = "") -> str:
        """The Trash window's pane."""
        return str(self.ui.trash_pane(self.trash_items(), TRASH_DAYS, oob=oob, note=note))

    def conversation_field(self, conversation_id: str) -> str:
        return str(self.ui.conversation_field(conversation_id, oob=True))

    def chat_title(self, title: str) -> str:
        return str(self.ui.chat_title(title, oob=True))

    def model_picker(self) -> str:
        e = self.engine
        picker = self.ui.model_picker(self.model_choices(), f"{e.backend}:{e.model}", oob=True)
        return str(picker) + str(self.ui.menubar_model(e.model, oob=True))

    def sync(self, conversation_id: str) -> str:
        """What another window changed in a conversation, as out-of-band fragments for a window that shows it:
        the transcript, the newest message id, the controls, the gauge, the title, the mode and the list — and
        nothing else of the window (its position, what is typed, attachments stay as they are)."""
        conv = self.db.get_conversation(conversation_id)
        if conv is None:
            return self.alert("this conversation was deleted or moved to the Trash in another window")
        messages = self.db.messages(conv.id)
        return "".join(
            (
                str(self.ui.transcript_pane(self.transcript(conv.id), oob=True)),
                str(self.ui.seen_field(messages[-1].id if messages else 0, oob=True)),
                self.controls(
                    generating=False, can_regenerate=can_regenerate(messages), elsewhere=self.writing(conv.id)
                ),
                self.gauge_for(conv.id),
                self.chat_title(conv.title),
                self.mode_picker(conv.mode),
                self.conversation_list(conv.id),
            )
        )

    def conversation_changed(self, conversation_id: str) -> str:
        """Told to every other window when a conversation changes (`static/trust.js` acts on it)."""
        return str(self.ui.conversation_changed(conversation_id, oob=True))

    def alert(self, text: str, kind: str = "error") -> str:
        return str(self.ui.alert(text, kind))


def meter_numbers(
    live: dict[str, Any], mb_per_token: float | None = None, idle: bool = False
) -> dict[str, Any]:
    """The engine meter's numbers from a backend's `live_stats()`: while a reply is written (`mb_per_token`: read
    from disk per token of it, None before its first token), or between replies (`idle`)."""
    hosts = live.get("hosts")
    if idle and hosts:  # each host's rate is its last token's: idle too
        hosts = [{**h, "bytes_per_s": 0.0} for h in hosts]
    return {
        "idle": idle,
        "bytes_per_s": 0.0 if idle else live.get("bytes_per_s", 0.0),
        "rss_bytes": live.get("rss_bytes", 0),
        "memory_budget": live.get("memory_budget"),
        "memory_budget_auto": live.get("memory_budget_auto"),
        "hit_rate": live.get("hit_rate"),
        "peak_rss_bytes": live.get("peak_rss_bytes"),
        "mb_per_token": mb_per_token,
        "hosts": hosts,
    }
