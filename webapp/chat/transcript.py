"""The chat window's state that must survive a reload: the transcript (messages and the event log,
replayed as the fragments that drew them live), the conversation's mode, its generation settings,
the context gauge, and every place that names the loaded model and engine.

What it knows: how to merge messages and logged events in order, and which macro of
`templates/transcript.html` draws the toolbar's mode, the engine's names and the settings forms.
What it does not know: how an agent event looks (it is handed `render_event`, the agent's
`webapp.turns.EventRenderer`), sockets, HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..db import UNTITLED, Database
from ..engine_host import EngineState
from ..settings import Settings
from ..turns import NEW_MODE_KEY, EventRenderer

DEFAULTS_KEY = "generation_defaults"  # app_settings: the generation defaults (the Settings window)
GENERATION_FIELDS = ("max_tokens", "temperature", "top_p", "system")
MODES = ("chat", "agent")
CHAT_MODE_SYSTEM = (
    "You are flashcode, a concise coding assistant. This conversation is in chat mode: you have no "
    "tools here. You cannot run commands, read or write files, or search the web, and nothing you "
    "write is executed. Never say that you ran a command or looked something up."
)


class TranscriptViews:
    """Mixed into `ChatViews` (which supplies `db`, `engine`, `settings`, `env`, `ui`, `csrf_token`)."""

    db: Database
    engine: EngineState
    settings: Settings
    env: Any
    ui: Any
    csrf_token: str
    render_event: EventRenderer | None = None  # set by create_app: the agent's events, drawn as live
    slash_commands: tuple[Mapping[str, str], ...] = ()  # set by create_app: name, usage, help (completion)

    @property
    def tx(self) -> Any:
        return self.env.get_template("transcript.html").module

    def trust_context(self, conversation_id: str | None) -> dict[str, Any]:
        conv = self.db.get_conversation(conversation_id) if conversation_id else None
        return {
            "transcript": self.transcript(conv.id) if conv else [],
            "mode": conv.mode if conv else self.new_mode(),
            "generation": self.generation(conv.id if conv else None),
            "generation_defaults": self.generation(None),
            "base_model": self.engine.is_base_model,
            "slash_commands": list(self.slash_commands),
        }

    def transcript(self, conversation_id: str) -> list[str]:
        """The conversation as the fragments that drew it live, in order: each message, then each
        event logged after it (the page replays them into #messages, as the websocket did)."""
        items: list[tuple[int, int, int, str]] = [
            (m.id, 0, 0, str(self.ui.appended_message(m))) for m in self.db.messages(conversation_id)
        ]
        if self.render_event is not None:
            render = self.render_event
            items += [
                (e.after_message, 1, e.id, render(e.type, e.data)) for e in self.db.events(conversation_id)
            ]
        return [html for *_, html in sorted(items, key=lambda i: i[:3])]

    def context_used(self, conversation_id: str | None) -> int:
        """The last prompt's size plus its reply, as the engine counted them, or the largest of its turn's and
        later agent steps' (a turn of tool calls may end with no reply, or with an answer written from a prompt
        of its own: its steps logged what the gauge showed); 0 after a /clear. What the live gauge showed."""
        if not conversation_id:
            return 0
        start = self.db.context_start(conversation_id)
        turn_at, used = start, 0
        newer_first = [m for m in reversed(self.db.messages(conversation_id)) if m.id > start]
        for n, m in enumerate(newer_first):
            if m.role == "assistant" and m.stats.get("prompt_tokens"):
                used = int(m.stats["prompt_tokens"]) + int(m.stats.get("completion_tokens") or 0)
                # the steps of the turn this reply ends count too (logged after its user message): an agent
                # that stalled answers from a small prompt of its own, while its steps' prompts filled the context
                turn_at = next((u.id for u in newer_first[n + 1 :] if u.role == "user"), m.id)
                break
        step = 0
        for e in self.db.events(conversation_id):
            if e.type == "clear":
                step = 0
            elif e.type == "tool_step" and e.after_message >= turn_at:
                step = _count(e.data.get("context_tokens")) or step
        return max(used, step)

    def generation(self, conversation_id: str | None, own: bool = True) -> dict[str, Any]:
        """Generation settings in force: the app's (an agent conversation's: the agent's), the Settings window's
        defaults, the conversation's. `own=False`: without the last level (the conversation's; for None, the
        Settings window's defaults)."""
        conv = self.db.get_conversation(conversation_id) if conversation_id else None
        agent = conv is not None and conv.mode == "agent"
        values: dict[str, Any] = {"top_p": 1.0} | dict(self.settings.sampling)
        if agent:
            values |= dict(self.settings.agent_sampling)
        values["system"] = ""
        if conv is not None or own:
            values |= _given(self.db.get_setting(DEFAULTS_KEY) or {})
        if conv is not None and own:
            values |= _given(conv.generation_settings)
        return values

    def changed(
        self, conversation_id: str | None, values: Mapping[str, Any], inherited: str | None = None
    ) -> dict[str, Any]:
        """What a saved Generation Settings form sets: the values that differ from those in force without it
        (`inherited`: as the form was drawn, its hidden field; the mode may have changed since). The form shows
        every value in force, so saving it unchanged (or for the system prompt alone) had pinned the chat's 0.7
        and 1024 over an agent turn's greedy 512, and over later changes of the defaults."""
        base = self.generation(conversation_id, own=False)
        try:
            drawn = json.loads(inherited or "null")
        except ValueError:
            drawn = None
        if isinstance(drawn, dict):
            base |= {k: v for k, v in drawn.items() if k in GENERATION_FIELDS}
        return {k: v for k, v in values.items() if base.get(k) != v}

    def sampling(self, conversation_id: str | None) -> dict[str, Any]:
        """The sampling part of `generation` (what `SamplingParams` and the agent take)."""
        return {k: v for k, v in self.generation(conversation_id).items() if k != "system"}

    # ------------------------------------------------------------------ fragments
    def gauge_for(self, conversation_id: str | None) -> str:
        return str(self.ui.gauge(self.context_used(conversation_id), self.engine.context_length, oob=True))

    def new_mode(self) -> str:
        """The mode a new conversation starts in: the one last chosen (Agent stays Agent after Ctrl+N)."""
        mode = self.db.get_setting(NEW_MODE_KEY, "chat")
        return mode if mode in MODES else "chat"

    def mode_picker(self, mode: str) -> str:
        return str(self.tx.mode_picker(mode, self.engine.is_base_model, oob=True))

    def engine_state(self) -> str:
        """Every place that names the loaded model and engine, redrawn from the one `EngineState`."""
        e = self.engine
        picker = self.ui.model_picker(self.model_choices(), f"{e.backend}:{e.model}", oob=True)  # type: ignore[attr-defined]
        return "".join(
            str(x)
            for x in (
                picker,
                self.ui.menubar_model(e.model, oob=True),
                self.tx.settings_rows(self.settings_rows(), oob=True),  # type: ignore[attr-defined]
                self.tx.about_engine(e.backend, e.model, oob=True),
                self.tx.completion_hint(e.is_base_model, oob=True),
                self.tx.written_with(None, oob=True),  # the model was just picked: no need to offer one
            )
        )

    def generation_form(self, conversation_id: str | None, note: str = "") -> str:
        values = self.generation(conversation_id)
        inherited = json.dumps(self.generation(conversation_id, own=False))  # what `changed` compares with
        return str(self.tx.generation_form(conversation_id, values, self.csrf_token, note, inherited))


def make_title(text: str, limit: int = 60) -> str:
    """A conversation's title from its first message: the first line, cut at a word within `limit`."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = " ".join(line.split())
    if len(line) <= limit:
        return line or UNTITLED
    cut = line[: limit - 1]
    if " " in cut[limit // 2 :]:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,.;:-") + "…"


def _count(value: Any) -> int:
    """A token count from the event log (an imported conversation's may hold anything): 0 if not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31 else 0


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k in GENERATION_FIELDS and v not in (None, "")}


def parse_generation(form: Mapping[str, Any]) -> dict[str, Any]:
    """Generation settings from a form: empty fields are left out (the defaults apply); bad values raise
    ValueError with a sentence that names the field and its range."""
    out: dict[str, Any] = {}
    for key, cast, low, high in (
        ("max_tokens", int, 1, 32768),
        ("temperature", float, 0.0, 2.0),
        ("top_p", float, 0.01, 1.0),
    ):
        raw = str(form.get(key) or "").strip()
        if not raw:
            continue
        try:
            value = cast(raw)
        except ValueError:
            raise ValueError(f"{key.replace('_', ' ')} must be a number") from None
        if not low <= value <= high:
            raise ValueError(f"{key.replace('_', ' ')} must be between {low} and {high}")
        out[key] = value
    system = str(form.get("system") or "").strip()
    if len(system) > 8000:
        raise ValueError("the system prompt is longer than 8,000 characters")
    if system:
        out["system"] = system
    return out
