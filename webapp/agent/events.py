"""What an agent turn yields (typed events the websocket renders) and the approval vocabulary.

Every event is a frozen dataclass with a `type` string and `to_dict()`; the web layer switches on
the class (or `type`) and renders `templates/agent/*.html`. `Proposal` is what the approval dialog
shows; `Decision` is the user's answer (default: deny).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .runner import CommandExit, OutputChunk
from .visible import diff_rows, proposal_warnings

DecisionKind = Literal["deny", "once", "always_exact", "always_prefix"]
DECISIONS: tuple[DecisionKind, ...] = ("deny", "once", "always_exact", "always_prefix")


class _Event:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class RouteChosen(_Event):
    route: str
    scores: dict[str, float]
    probabilities: dict[str, float]
    forced: bool = False
    type: str = "route"


@dataclass(frozen=True)
class Notice(_Event):
    """`facts`: what the turn's tools did, shown after `text` (a CLI that prints its own summary leaves it out)."""

    text: str
    level: Literal["info", "warning", "error"] = "info"
    facts: str = ""
    type: str = "notice"


@dataclass(frozen=True)
class ReplyReplaced(_Event):
    """A reply that Regenerate replaced: kept in the transcript, folded, above the new one (never in the model's
    context). Logged by the chat's reply pipeline, drawn here."""

    text: str
    message_id: int = 0  # the replaced reply's (the id of its folded block on the page)
    model: str = ""
    type: str = "reply_replaced"


@dataclass(frozen=True)
class ModeChanged(_Event):
    mode: Literal["agent", "raw"]
    no_tools: str = ""  # agent mode on a model without tools: why its turns are routed, and what would work
    offer: str = ""  # the model that would, when it is not the loaded one: the note has a button to load it
    type: str = "mode"


@dataclass(frozen=True)
class HelpShown(_Event):
    text: str
    type: str = "help"


@dataclass(frozen=True)
class Cleared(_Event):
    type: str = "clear"


@dataclass(frozen=True)
class ModelRequested(_Event):
    name: str
    type: str = "model"


@dataclass(frozen=True)
class SlashUnhandled(_Event):
    """A registered command the agent does not implement (e.g. /stats): the web app handles it."""

    name: str
    arg: str
    type: str = "slash"


@dataclass(frozen=True)
class SearchStarted(_Event):
    query: str
    kind: str
    provider: str
    type: str = "search_started"


@dataclass(frozen=True)
class SearchResults(_Event):
    query: str
    results: tuple[dict[str, Any], ...]  # title, url, site, snippet, kind, date, source; cited as [i+1]
    type: str = "search_results"


@dataclass(frozen=True)
class SearchUnavailable(_Event):
    message: str  # "web search is unavailable: ..."
    type: str = "search_unavailable"


@dataclass(frozen=True)
class Proposal(_Event):
    """An action waiting for approval (or already allowed by a rule: `allowed_by_rule`)."""

    action_id: int
    tool: Literal["shell", "write", "mcp"]
    command: str  # the exact command, the file path for a write, `server__tool {arguments}` for MCP
    cwd: str
    timeout_s: float
    allowed_by_rule: bool = False
    rule_text: str = ""  # which rule matched, or why none did
    parse_error: str | None = None
    prefix: str | None = None  # what "Always allow this prefix" would save
    prefix_blocked: str | None = None  # why that button is disabled
    diff: str | None = None  # for writes
    choices: tuple[DecisionKind, ...] = DECISIONS
    warnings: tuple[str, ...] = ()  # shown first in the dialog; invisible characters and .git/ add theirs
    sandbox: str = ""  # "sandboxed: writes only in <project>, network off", or why it is not sandboxed
    sandboxed: bool = True
    network: bool = False  # whether the project's commands may use the network
    typed: bool = False  # the user typed it (/shell COMMAND), not the model
    type: str = "proposal"

    def __post_init__(self) -> None:
        found = proposal_warnings(self.tool, self.command, self.diff)
        object.__setattr__(self, "warnings", tuple(dict.fromkeys((*self.warnings, *found))))

    @property
    def diff_rows(self) -> int:
        """The change's rows when its box scrolls (the dialog says so), else 0."""
        return diff_rows(self.diff)


@dataclass(frozen=True)
class Decision(_Event):
    kind: DecisionKind = "deny"
    reason: str = ""
    network: bool | None = None  # the project's network switch as the dialog left it (None: unchanged)
    type: str = "decision"

    @classmethod
    def deny(cls, reason: str = "") -> Decision:
        return cls("deny", reason)

    @classmethod
    def once(cls) -> Decision:
        return cls("once")

    @classmethod
    def always_exact(cls) -> Decision:
        return cls("always_exact")

    @classmethod
    def always_prefix(cls) -> Decision:
        return cls("always_prefix")

    @classmethod
    def from_answer(cls, choice: str, note: str = "", network: bool | None = None) -> Decision:
        """A dialog answer from the client; anything unexpected is a deny."""
        if choice in DECISIONS and choice != "deny":
            return cls(choice, network=network)  # type: ignore[arg-type]
        return cls.deny(note.strip()[:2000] if choice == "deny" else f"unknown choice {choice[:40]!r}")


@dataclass(frozen=True)
class Decided(_Event):
    action_id: int
    decision: str  # deny | once | always_exact | always_prefix | rule | timeout
    rule: str | None = None  # the rule that allowed it, or the one saved now
    reason: str = ""
    tool: str = ""  # the proposal's (a command's approval enables its Stop button); "" in older logs
    type: str = "decided"


@dataclass(frozen=True)
class ActionOutput(_Event):
    action_id: int
    stream: str
    text: str
    type: str = "output"

    @classmethod
    def of(cls, action_id: int, chunk: OutputChunk) -> ActionOutput:
        return cls(action_id, chunk.stream, chunk.text)


@dataclass(frozen=True)
class ActionExit(_Event):
    action_id: int
    exit_code: int | None
    timed_out: bool
    killed: bool
    truncated: bool
    duration_s: float
    description: str
    sandbox: str = (
        ""  # what it ran in, as the proposal words it (the dialog's network switch may have changed it)
    )
    type: str = "exit"

    @classmethod
    def of(cls, action_id: int, ex: CommandExit, sandbox: str = "") -> ActionExit:
        return cls(
            action_id,
            ex.exit_code,
            ex.timed_out,
            ex.killed,
            ex.truncated,
            ex.duration_s,
            ex.describe(),
            sandbox,
        )


@dataclass(frozen=True)
class FileShown(_Event):
    path: str
    content: str
    type: str = "file"


@dataclass(frozen=True)
class FileWritten(_Event):
    action_id: int
    path: str
    # "offer": its earlier text is kept and the card offers Undo; "done": undone since; "": no undo (written
    # before flashcode kept earlier text). A logged one is drawn with the state the database has now.
    undo: str = ""
    # set only when a logged one is drawn again (empty live, and whatever a stored one holds is replaced): why
    # an Undo would be refused now (state "refused": the file changed since, its project removed), and whether
    # its earlier text is kept to download; the card then offers no Undo
    undo_refused: str = ""
    undo_before: bool = False
    type: str = "file_written"


@dataclass(frozen=True)
class FileUndone(_Event):
    """A write undone from its card (`AgentWeb.undo_change`): the transcript says so, and the model's next
    request does (`AgentTurns._stored_history`), or it would take the file for what it wrote."""

    action_id: int
    path: str
    text: str
    type: str = "file_undone"


@dataclass(frozen=True)
class AnswerDelta(_Event):
    text: str
    type: str = "answer_delta"


@dataclass(frozen=True)
class AnswerDone(_Event):
    text: str
    finish_reason: str = "stop"
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    citations: tuple[int, ...] = ()  # result numbers cited in the text
    type: str = "answer_done"


@dataclass(frozen=True)
class Reading(_Event):
    """The engine is reading the prompt of what comes next (`processed` of `total` tokens): a long agent
    prompt on a slow machine takes minutes before the first token, and the status bar says so."""

    processed: int
    total: int
    type: str = "reading"


@dataclass(frozen=True)
class Generated(_Event):
    """A generation that wrote no reply (a step that only called tools): its numbers, for Stats."""

    stats: dict[str, Any] = field(default_factory=dict)
    type: str = "generated"


@dataclass(frozen=True)
class ToolStep(_Event):
    """The model called a tool (step `step` of at most `max_steps`): a step card opens."""

    step: int
    call_id: str
    tool: str
    arguments: dict[str, Any]
    max_steps: int
    started: float  # time.time()
    context_tokens: int = 0  # the prompt that chose this call plus the call: what the context gauge shows
    type: str = "tool_step"


DECISION_WORDS = {  # a step's decision in words: the transcript's step cards and `flashcode agent` say it so
    "none": "nothing to approve",
    "rule": "allowed by rule",  # a saved rule, or the project's auto-approve of file edits
    "once": "approved",
    "always_exact": "approved, rule saved",
    "always_prefix": "approved, rule saved",
    "deny": "denied",
    "timeout": "no answer: denied",
    "network": "network on for this project",
    "network_off": "network off for this project",
}


@dataclass(frozen=True)
class ToolStepDone(_Event):
    """What the call came to: the result the model gets back (`result`, quoted to it as untrusted
    data), the card's collapsible `output`, the approval `decision` and, for commands, `exit_code`."""

    step: int
    call_id: str
    tool: str
    ok: bool
    decision: str
    result: str
    output: str = ""
    exit_code: int | None = None
    action_id: int | None = None
    duration_s: float = 0.0  # the step's own time, without `waited_s`
    waited_s: float = 0.0  # in the approval dialog, for the user's answer
    type: str = "tool_step_done"

    @property
    def decision_words(self) -> str:
        return DECISION_WORDS.get(self.decision, self.decision)


@dataclass(frozen=True)
class StepLimitReached(_Event):
    """The loop stopped after `steps` steps; `/continue` (the Continue button) gives it more. `why`: set when
    it stopped before its limit (the model repeating a refused call), in words."""

    steps: int
    max_steps: int
    why: str = ""
    type: str = "step_limit"


@dataclass(frozen=True)
class ContextTrimmed(_Event):
    """The conversation neared the context limit: old tool outputs elided, then older steps summarised."""

    elided: int  # tool results replaced by a note
    summarised: int  # messages folded into a summary
    note: str
    type: str = "context_trimmed"


@dataclass(frozen=True)
class TurnDone(_Event):
    route: str | None
    type: str = "turn_done"


AgentEvent = (
    RouteChosen
    | Notice
    | ModeChanged
    | HelpShown
    | Cleared
    | ModelRequested
    | SlashUnhandled
    | SearchStarted
    | SearchResults
    | SearchUnavailable
    | Proposal
    | Decided
    | ActionOutput
    | ActionExit
    | FileShown
    | FileWritten
    | FileUndone
    | AnswerDelta
    | AnswerDone
    | ToolStep
    | ToolStepDone
    | StepLimitReached
    | ContextTrimmed
    | TurnDone
)
