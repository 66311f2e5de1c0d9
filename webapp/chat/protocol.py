"""The websocket protocol: client messages as dataclasses and `parse()`.

Client -> server: one JSON object per text frame, `{"type": ..., ...fields}` (htmx's ws extension
sends a form's fields this way and adds a `HEADERS` object, which is ignored). Server -> client:
HTML fragments whose top-level elements carry `hx-swap-oob`, swapped by id (`templates/macros.html`,
`docs/websocket.md`).

What it knows: the message types, their fields and limits. What it does not know: sockets, the
database, engines, HTML. `parse` never raises anything but `ProtocolError`, whose message is shown
to the user in an error frame.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024  # larger frames get an error frame (uvicorn closes at ws_max_size, 1 MiB)
MAX_TEXT_CHARS = 32_000
MAX_ID_CHARS = 64


class ProtocolError(ValueError):
    """A client message that cannot be acted on; the text goes back in an error frame."""


@dataclass(frozen=True)
class Send:
    text: str
    conversation_id: str | None = None
    max_tokens: int | None = None  # optional sampling overrides (the Settings window, benchmarks)
    temperature: float | None = None
    mode: str | None = None  # chat | agent: the toolbar's mode, for a conversation this message starts
    top_p: float | None = None
    seen: int | None = None  # the newest message id the page shows (another tab may have added since)
    project_id: str | None = None  # the project the page shows: a conversation this message starts goes there
    # the page's own mark while it shows no conversation: the frames of one this message starts carry it, so a
    # page that went on to another new one (New, before the first frame came) does not take them
    draft: str | None = None
    type: str = "send"


@dataclass(frozen=True)
class Stop:
    type: str = "stop"


@dataclass(frozen=True)
class Regenerate:
    conversation_id: str
    seen: int | None = None  # the newest message id the page shows (the reply it means to rewrite)
    type: str = "regenerate"


@dataclass(frozen=True)
class Continue:
    """Go on writing the conversation's last reply, cut at the token limit (the same message grows)."""

    conversation_id: str
    message_id: int | None = None  # the reply the button belongs to: only the last one can go on
    type: str = "continue"


@dataclass(frozen=True)
class SwitchModel:
    backend: str
    model: str
    conversation_id: str | None = None  # the window's conversation (its context gauge is redrawn)
    type: str = "model"


@dataclass(frozen=True)
class SetMode:
    """The toolbar's mode switch: chat (no tools) or agent (the model calls tools; side effects are approved)."""

    mode: str
    conversation_id: str | None = None  # none: the next conversation starts in this mode
    type: str = "mode"


@dataclass(frozen=True)
class Answer:
    """The user's choice in a dialog the server opened (the agent's approval dialog)."""

    dialog_id: str
    choice: str
    note: str = ""
    network: bool = False  # the dialog's "network for this project" switch
    type: str = "answer"


@dataclass(frozen=True)
class Showing:
    """The window now shows this conversation (None: a new one): a window writing a reply gets its controls
    back, Stop included, wherever it went meanwhile (the chat window drawn over HTTP cannot tell it is the
    writer's and says "another window")."""

    conversation_id: str | None = None
    # the page was drawn while another window wrote in it ("A reply is being written in another window…"): if
    # that has ended by the time its socket opens, it is drawn again (a reload while an agent asked: walkthrough)
    drawn_elsewhere: bool = False
    type: str = "showing"


ClientMessage = Send | Stop | Regenerate | Continue | SwitchModel | Answer | SetMode | Showing
MODES = ("chat", "agent")


def _str(d: dict[str, Any], key: str, *, required: bool = True, limit: int = MAX_ID_CHARS) -> str | None:
    value = d.get(key)
    if value is None or value == "":
        if required:
            raise ProtocolError(f"{key} is missing")
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{key} must be a string")
    if len(value) > limit:
        raise ProtocolError(f"{key} is longer than {limit} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" alone: no character, and SQLite cannot store it
        raise ProtocolError(
            f"{key} holds a broken character (half of a UTF-16 pair, as a bad paste can leave): remove it and "
            "send again"
        ) from None
    return value


def _number(d: dict[str, Any], key: str, cast: type, low: float, high: float) -> Any:
    value = d.get(key)
    if value is None or value == "":
        return None
    try:
        number = cast(value)
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError(f"{key} must be a number") from None
    if isinstance(value, bool) or not low <= number <= high:
        raise ProtocolError(f"{key} must be between {low} and {high}")
    return number


TOO_LONG = "shorten it, or put the text in a file of the project and ask about that file"


def _send(d: dict[str, Any]) -> Send:
    raw = d.get("text")
    if isinstance(raw, str) and len(raw) > MAX_TEXT_CHARS:
        raise ProtocolError(
            f"the message is too long ({len(raw):,} characters, at most {MAX_TEXT_CHARS:,}): {TOO_LONG}"
        )
    text = _str(d, "text", required=False, limit=MAX_TEXT_CHARS) or ""
    if not text.strip():
        raise ProtocolError("type a message first")
    return Send(
        text=text,
        conversation_id=_str(d, "conversation_id", required=False),
        max_tokens=_number(d, "max_tokens", int, 1, 32768),
        temperature=_number(d, "temperature", float, 0.0, 2.0),
        mode=_mode(d, required=False),
        top_p=_number(d, "top_p", float, 0.01, 1.0),
        seen=_number(d, "seen", int, 0, 2**63 - 1),
        project_id=_str(d, "project_id", required=False, limit=200),
        draft=_str(d, "draft", required=False, limit=64),
    )


def _mode(d: dict[str, Any], required: bool = True) -> str | None:
    mode = _str(d, "mode", required=required)
    if mode is not None and mode not in MODES:
        raise ProtocolError(f"mode must be one of {', '.join(MODES)}")
    return mode


def _model(d: dict[str, Any]) -> SwitchModel:
    # the picker sends one "backend:model" value; explicit fields work too
    choice = _str(d, "choice", required=False, limit=300)
    if choice and ":" in choice:
        backend, model = choice.split(":", 1)
        return SwitchModel(
            backend=backend, model=model, conversation_id=_str(d, "conversation_id", required=False)
        )
    return SwitchModel(
        backend=_str(d, "backend") or "",
        model=_str(d, "model", limit=300) or "",
        conversation_id=_str(d, "conversation_id", required=False),
    )


_PARSERS = {
    "send": _send,
    "stop": lambda d: Stop(),
    "showing": lambda d: Showing(
        conversation_id=_str(d, "conversation_id", required=False),
        drawn_elsewhere=d.get("drawn_elsewhere") == "1",
    ),
    "regenerate": lambda d: Regenerate(
        conversation_id=_str(d, "conversation_id") or "", seen=_number(d, "seen", int, 0, 2**63 - 1)
    ),
    "continue": lambda d: Continue(
        conversation_id=_str(d, "conversation_id") or "",
        message_id=_number(d, "message_id", int, 1, 2**62),
    ),
    "model": _model,
    "mode": lambda d: SetMode(
        mode=_mode(d) or "chat", conversation_id=_str(d, "conversation_id", required=False)
    ),
    "answer": lambda d: Answer(
        dialog_id=_str(d, "dialog_id") or "",
        choice=_str(d, "choice") or "",
        note=_str(d, "note", required=False, limit=2000) or "",
        network=d.get("network") in (True, "on", "true", "1"),
    ),
}
MESSAGE_TYPES = tuple(_PARSERS)


def parse(raw: str | bytes | None) -> ClientMessage:
    if raw is None or isinstance(raw, bytes):
        raise ProtocolError("send text frames holding one JSON object")
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_MESSAGE_BYTES:
        raise ProtocolError(  # the limit said is the one a shorter message then meets: characters of text
            f"the message is too long (at most {MAX_TEXT_CHARS:,} characters; this one is over "
            f"{MAX_MESSAGE_BYTES // 1024} KiB): {TOO_LONG}"
        )
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ProtocolError("not valid JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError("a message must be a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in _PARSERS:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {', '.join(MESSAGE_TYPES)}")
    return _PARSERS[kind](data)
