"""The contract every flashcode engine implements, and the values that cross it.

What this module knows: the request a caller hands an engine (messages or raw prompt tokens plus
sampling), the events an engine streams back (text deltas with their token ids, then one `Done`
with the stats), the error hierarchy, and the `Backend` protocol itself.

What it does not know: MLX, llama.cpp, HTTP, threads. It imports nothing heavy, so
`import engine` stays cheap; the engines live in their own modules and are looked up lazily
through `engine.registry`.

Threading: a Backend is driven by exactly one thread (see `engine.worker`): MLX streams belong to
the thread that made them. Only `cancel` (a `threading.Event`) crosses threads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

# {"role": "system"|"user"|"assistant"|"tool", "content": "..."}; an assistant message that called tools
# also has "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": {...}}}]
Message = dict[str, Any]
FinishReason = Literal["stop", "length", "cancelled", "error"]


# --------------------------------------------------------------------------- errors
class EngineError(Exception):
    """Base class: every engine failure a user can see. The message says what to do."""


class ModelNotFoundError(EngineError):
    pass


class ModelLoadError(EngineError):
    pass


class ContextLimitError(EngineError):
    """The prompt (plus the reply budget) does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int, fix: str = "") -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        super().__init__(
            f"the prompt is {prompt_tokens} tokens and the model's context is {context_length}: "
            f"start a new conversation, shorten the message, or {fix or 'load the model with a larger context'}"
        )


class BackendUnavailableError(EngineError):
    """The engine cannot run here (missing binary, missing package, crashed server)."""


class BudgetError(EngineError):
    """A memory budget cannot be met. `need` is the least --memory-budget that would run, when raising it is the
    fix (None when it is not, or not known: a budget above the memory cgroup, say)."""

    def __init__(self, message: str, need: int | None = None) -> None:
        super().__init__(message)
        self.need = need


class CacheMismatchError(EngineError):
    """A saved prompt cache does not belong to the loaded model or is damaged."""


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of `messages` (chat, templated by the backend) or `prompt` (raw text) is set."""

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # OpenAI-format tools given to the model's chat template (`ToolCallingBackend`); calls come back as
    # `ToolCall` events. `constrain_tools`: once the model opens a call, only a valid call can follow.
    tools: tuple[dict[str, Any], ...] = ()
    constrain_tools: bool = True
    tool_choice: Literal["auto", "required"] = "auto"  # required: the reply must be a call
    progress: bool = False  # also stream `PrefillProgress` while the prompt is read (the chat window)
    # the last message is the assistant's unfinished reply (cut at the token limit): the model goes on
    # writing it — the prompt ends with its text, no end of turn, no new generation prompt; the events
    # carry only the new text
    continue_final: bool = False

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("GenerationRequest needs exactly one of messages= or prompt=")
        if self.continue_final and (not self.messages or self.messages[-1].get("role") != "assistant"):
            raise ValueError("continue_final needs messages that end with the assistant's reply")


# --------------------------------------------------------------------------- events
@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...]
    kind: Literal["text", "reasoning"] = "text"
    n_tokens: int | None = None  # tokens this text came from, when the engine knows it without their ids

    @property
    def count(self) -> int:
        """How many generated tokens this delta stands for (its ids, or the engine's count)."""
        return self.n_tokens if self.n_tokens is not None else len(self.token_ids)


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model made (native tool calling). `error` is set when its text could not be
    read as a call (the unconstrained decoder's malformed JSON); `raw` is the text as written."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str = ""
    error: str | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a cache instead of prefilled
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prompt_tps: float = 0.0
    decode_tps: float = 0.0
    peak_memory_bytes: int = 0  # engine-level peak (MLX allocator / server RSS)
    peak_rss_bytes: int = 0  # this process's peak resident set
    total_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # engine specifics (flash: hit rate, bytes read)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PrefillProgress:
    """How much of the prompt the engine has read before its first token: `processed` of `total`
    prompt tokens (tokens served from a cache count as read). Sent only when the request asks; the last
    one is (total, total), once the prompt is read: from there the model writes (a tool call being
    written sends nothing else until it is whole)."""

    processed: int
    total: int


@dataclass(frozen=True)
class Done:
    stats: GenerationStats
    finish_reason: FinishReason
    text: str = ""  # the whole reply
    error: str | None = None


Event = TextDelta | ToolCall | PrefillProgress | Done


def collect(events: Iterable[Event]) -> tuple[list[int], Done]:
    """A stream run to its end: the token ids of its text, and its Done (an error Done raises)."""
    ids: list[int] = []
    done = None
    for ev in events:
        if isinstance(ev, TextDelta):
            ids += ev.token_ids
        elif isinstance(ev, Done):
            done = ev
    if done is None or done.error is not None:
        raise EngineError(f"the stream ended without a result: {done.error if done else 'no Done'}")
    return ids, done


_listener = threading.local()


def emit(event: Event) -> None:
    """Hand `event` to whoever consumes the stream running on this thread, at once: for an engine
    whose library reports from inside a call that cannot yield (mlx-lm's prefill callback). Nobody
    listening (a `Backend.stream` iterated directly): dropped. `engine.worker` listens."""
    sink = getattr(_listener, "sink", None)
    if sink is not None:
        sink(event)


@contextmanager
def listening(sink: Callable[[Event], None]) -> Iterator[None]:
    """Events `emit`ted on this thread inside the `with` go to `sink` (between the stream's own)."""
    _listener.sink = sink
    try:
        yield
    finally:
        _listener.sink = None


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path  # an MLX model directory (config.json, *.safetensors, tokenizer.json)
    architecture: str
    size_bytes: int
    gguf_path: Path | None = None  # the GGUF it was imported from, when kept (llama-server uses it)
    split_path: Path | None = None  # a `flashcode split` layout, when made

    @property
    def has_chat_template(self) -> bool:
        """Whether the model directory carries a chat template; a model without one is a base model:
        it continues raw text (`GenerationRequest(prompt=...)`), and no backend applies a template."""
        if not self.path.is_dir():  # not a model directory (a scripted engine): the backend decides
            return True
        if (self.path / "chat_template.jinja").exists() or (self.path / "chat_template.json").exists():
            return True
        try:
            config = json.loads((self.path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(config.get("chat_template"))


# --------------------------------------------------------------------------- protocol
@runtime_checkable
class Backend(Protocol):
    """One engine holding one model. Every method runs on the backend's own worker thread."""

    name: str

    def load(self, model: ModelInfo) -> None: ...

    @property
    def model(self) -> ModelInfo | None: ...

    @property
    def context_length(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]: ...

    def stream(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        """Yield TextDelta events, then exactly one Done. Stops within one token of `cancel`."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class PromptCacheBackend(Protocol):
    """Capability: the backend can save and restore its prompt (KV) cache."""

    def save_prompt_cache(self, path: Path, metadata: dict[str, str]) -> dict[str, Any]: ...

    def load_prompt_cache(self, path: Path) -> dict[str, Any]: ...


@runtime_checkable
class ToolCallingBackend(Protocol):
    """Capability: the loaded model's chat template takes `tools=`; `GenerationRequest.tools` are
    passed through it and the model's calls come back as `ToolCall` events."""

    def supports_tools(self) -> bool: ...


@runtime_checkable
class ScoringBackend(Protocol):
    """Capability: log-probabilities of candidate continuations (used by the agent's router)."""

    def score_continuations(
        self, prompt_tokens: list[int], continuations: list[list[int]]
    ) -> list[float]: ...
