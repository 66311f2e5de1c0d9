"""The seams where features meet: small typed interfaces that `webapp.app.create_app` wires.

Features never import each other. The chat owns the websocket and the one reply pipeline; the
agent answers the messages it wants as a `TurnHandler`, through the `Turn` the chat lends it for
one message; stats records finished replies as a `ReplyHook` and answers its slash commands as a
`SlashHandler`. A feature that needs another's work asks for one of these in its constructor.

What it knows: the shapes of those calls. What it does not know: any feature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# app_settings: the mode last chosen (picker or /agent, /raw), which a new conversation starts in
NEW_MODE_KEY = "new_conversation_mode"
# A conversation whose project was taken off the list keeps its place (adding the folder again brings it
# back), but nothing runs in it meanwhile: the open project's folder, rules and network switch are not its.
PROJECT_REMOVED = (
    "This conversation's project was removed from the list (its conversations are kept): nothing was sent or run. "
    "Add its folder again with File › Open Project… (or flashcode projects add FOLDER) to go on with it."
)


class ReplyHook(Protocol):
    """Called once a chat reply is stored (`stats` holds the engine's numbers, finish_reason, model
    and backend; `message_id` None: a generation that wrote no reply, an agent step's tool calls), and again with `completed` when a stopped reply's numbers are completed after its
    generation has ended (the prompt count, memory): the same reply, not a new one. A hook that raises
    is logged; the reply is never lost for it."""

    def __call__(
        self,
        stats: Mapping[str, Any],
        *,
        conversation_id: str,
        message_id: int | None,
        route: str | None = None,
        completed: bool = False,
    ) -> object: ...


class SlashHandler(Protocol):
    """Answers a slash command another feature owns, as an HTML fragment for the transcript."""

    async def __call__(self, name: str, arg: str, conversation_id: str | None) -> str: ...


@dataclass(frozen=True)
class SlashSpec:
    """A slash command a feature contributes to `/help`: `/name usage — help`."""

    name: str
    usage: str
    help: str


class EventRenderer(Protocol):
    """Draws one logged transcript event (its `type` and `to_dict()` data) as the fragment it was
    live: the chat replays a conversation's event log through it on load, reload and reopen."""

    def __call__(self, type: str, data: Mapping[str, Any]) -> str: ...


class DialogAnswer(Protocol):
    """The user's answer to a dialog the server opened."""

    @property
    def choice(self) -> str: ...
    @property
    def note(self) -> str: ...
    @property
    def network(self) -> bool: ...


class ReplyWriter(Protocol):
    """A stored, streamed reply of the one reply pipeline (`webapp.chat.pipeline.ReplyStream`)."""

    @property
    def message_id(self) -> int: ...

    def add(self, text: str, tokens: int = 1) -> None: ...

    def finish(
        self, text: str, finish_reason: str, stats: Mapping[str, Any], error: str | None = None
    ) -> object: ...

    def abandon(self) -> None: ...


class Turn(Protocol):
    """What the chat lends a `TurnHandler` for one user message (already stored and shown)."""

    @property
    def conversation_id(self) -> str: ...

    @property
    def sampling(self) -> Mapping[str, Any]:
        """The message's own sampling overrides (`max_tokens`, `temperature`), if it carried any."""
        ...

    def send(self, *fragments: str) -> None: ...

    def error(self, text: str) -> None: ...

    async def ask(self, dialog_html: str, dialog_id: str) -> DialogAnswer: ...

    def on_stop(self, stop: Callable[[], None] | None) -> None: ...

    @property
    def closing(self) -> bool:
        """Whether the page went away (closed, reloaded): a stop then is not the user's Stop."""
        ...

    @property
    def attached(self) -> str:
        """The files the user attached to the message, quoted as untrusted data ("" when none): context for
        the answer, never words to route, search for or run."""
        ...

    def start_reply(self, route: str | None = None) -> ReplyWriter: ...

    def model_changed(self) -> None: ...

    def context_used(self, tokens: int) -> None:
        """The context gauge, mid-turn: the last prompt plus its reply, as the engine counted them."""

    def status(self, text: str | None) -> None:
        """The status bar while the turn runs: `text` (e.g. the prompt being read), or None for "Writing…"."""

    def count(self, stats: Mapping[str, Any], route: str | None = None) -> None:
        """The numbers of a generation that wrote no reply (an agent step that only called tools): the
        `ReplyHook`s get them with no message, so Stats counts its tokens and time too."""


class TurnHandler(Protocol):
    """Answers the chat messages it `wants` (the agent: slash commands and agent-mode turns)."""

    def wants(self, conversation_id: str, text: str) -> bool: ...

    async def run(self, turn: Turn, text: str) -> None: ...

    async def mode_note(self, conversation_id: str | None) -> tuple[str, str]:
        """Agent mode was chosen for the conversation (None: the next one): what to say about it now ("" if
        nothing), and a model to offer with it (its name, or "")."""
        ...


TurnHandlerFactory = Callable[[], TurnHandler]  # one handler per websocket


@dataclass(frozen=True)
class ProjectRef:
    """A project as the features see it: its id (the key of its rows and files), name and directory."""

    id: str
    name: str
    path: Path


class ProjectLookup(Protocol):
    """Which project is open, and which project a conversation belongs to (`webapp.projects`)."""

    def current(self) -> ProjectRef: ...

    def get(self, project_id: str) -> ProjectRef | None: ...

    def of_conversation(self, conversation_id: str | None) -> ProjectRef:
        """The conversation's project; the current one for a new (None) or unknown conversation."""
        ...

    def all(self) -> list[ProjectRef]: ...


def is_slash_command(text: str) -> bool:
    """Whether a message is a slash command (`/stats`, `/model qwen`), not words for the model; `//` at its
    start is a message that begins with a slash."""
    stripped = text.lstrip()
    return stripped.startswith("/") and not stripped.startswith("//")


# Commands whose words are the work asked for (`/shell pytest -q`, `/search …`): they name a conversation
# begun with one, as a message would. The others (/model, /stats, /help, /clear) leave it to the first that does.
NAMING_COMMANDS = ("search", "shell", "read", "write")


def names_conversation(text: str) -> bool:
    """Whether a first message gives its conversation a title: words for the model, or a command with work."""
    if not is_slash_command(text):
        return True
    words = text.lstrip()[1:].split(None, 1)
    return len(words) == 2 and words[0].lower() in NAMING_COMMANDS


def for_the_model(text: str) -> bool:
    """Whether a stored user message goes into the model's context: words, or a command that asks for work
    (`/shell ls`, `/search …`), whose answer follows it. One that asks nothing of the model (`/model mlx:smol`,
    `/help`, `/stats`) stays in the transcript only: the model copied ":smol" from it into its replies."""
    return not is_slash_command(text) or names_conversation(text)
