"""Native tool calls: the schema a call must match, a constrained decoder for MLX, and parsing.

What it knows: the OpenAI tool format (`{"type": "function", "function": {name, description,
parameters}}`), how a call looks once a model's chat template has opened it (`{"name": ...,
"arguments": {...}}`), how to restrict decoding to exactly such a call — a JSON object naming one of
the given tools with arguments valid for that tool's schema — with llguidance (`ToolCallConstraint`,
an mlx-lm logits processor that wakes only once the model has written its template's call-opening
tag), and how to parse a call's text with mlx-lm's tool parsers.

What it does not know: which tools exist or what they do (the agent's `webapp/agent/tools.py`),
MLX internals beyond the logits processor signature `(tokens, logits) -> logits`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .base import ToolCall

_LL_TOKENIZERS: dict[int, Any] = {}  # id(hf tokenizer) -> llguidance tokenizer (building one takes ~2 s)


def call_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call: `{"name": <one of the tools>, "arguments": <its parameters>}`."""
    options = []
    for t in tools:
        fn = t["function"]
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        params.setdefault("additionalProperties", False)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    # bounded whitespace between tokens: the template's own style (`{"name": ...}`, or indented), never
    # a run of blanks a sampler can wander into
    return {"anyOf": options, "x-guidance": {"whitespace_pattern": "[ \\n]{0,8}", "lenient": True}}


def call_grammar(
    tools: Sequence[dict[str, Any]], start_token: int | None = None, required: bool = False
) -> str:
    """An llguidance grammar for what follows the call-opening tag: an optional newline (templates put
    one there), then the call. With `start_token`, the grammar of a whole reply's beginning instead:
    either that tag and a call, or an answer that does not begin like an improvised call (a brace, a
    code fence or a tag) - small models otherwise write calls as fenced JSON the template never opened.
    `required`: the reply must be a call (OpenAI's `tool_choice="required"`)."""
    from llguidance import LLMatcher

    body = "body: %json " + json.dumps(call_schema(tools))
    if start_token is None:
        return LLMatcher.grammar_from_lark('start: "\\n"? body\n' + body)
    if required:
        return LLMatcher.grammar_from_lark(f'start: <[{start_token}]> "\\n"? body\n{body}')
    return LLMatcher.grammar_from_lark(
        f'start: call | answer\ncall: <[{start_token}]> "\\n"? body\n{body}\nanswer: / ?[^{{`<\\s](?s:.)*/\n'
    )


_OPENINGS: dict[int, Any] = {}  # id(hf tokenizer) -> bool array: the token starts an improvised call


def _improvised_openings(hf_tokenizer: Any) -> Any:
    """Which tokens begin a call the template never opened: a code fence, a brace, a tag."""
    import numpy as np

    key = id(hf_tokenizer)
    if key not in _OPENINGS:
        pieces = hf_tokenizer.convert_ids_to_tokens(list(range(len(hf_tokenizer))))
        added = set(getattr(hf_tokenizer, "added_tokens_decoder", {}) or ())  # EOS and friends: not text
        _OPENINGS[key] = np.array(
            [
                i not in added
                and bool(t)
                and t.lstrip("\u0120\u010a\u0109 \n\t\u2581").startswith(("```", "{", "<"))
                for i, t in enumerate(pieces)
            ]
        )  # byte-level BPE writes a space as U+0120, a newline as U+010A; sentencepiece a space as U+2581
    return _OPENINGS[key]


def make_call(name: str, arguments: Any, raw: str = "", error: str | None = None) -> ToolCall:
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(_call_id(), name, {}, raw or arguments, f"the arguments are not JSON: {exc}")
    if not isinstance(arguments, dict):
        return ToolCall(_call_id(), name, {}, raw, error or "the arguments are not a JSON object")
    return ToolCall(_call_id(), name, arguments, raw, error)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:12]


def parse_call_text(
    text: str, parser: Callable[[str, Any], Any] | None, tools: Sequence[dict[str, Any]]
) -> ToolCall:
    """The call written between a template's tags, read by `parser` (an mlx-lm tool parser's
    `parse_tool_call`; mlx-lm's `json_tools` when None). Unreadable text is a call with `error` set,
    so the agent can tell the model what was wrong."""
    if parser is None:
        from mlx_lm.tool_parsers.json_tools import parse_tool_call as parser
    try:
        parsed = parser(text, list(tools))
    except Exception as exc:  # noqa: BLE001 - any parser failure is the model's malformed call
        return ToolCall(_call_id(), "", {}, text, f"the tool call is not valid JSON: {exc}")
    if isinstance(parsed, list):
        parsed = parsed[0] if parsed else {}
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return ToolCall(_call_id(), "", {}, text, "the tool call names no tool")
    return make_call(parsed["name"], parsed.get("arguments", {}), text)


class ToolCallConstraint:
    """An mlx-lm logits processor over the tokens of one reply.

    The reply's first token: when the model's favourite opens a call - the template's tag, or an
    improvised call (a code fence, a brace or a tag, as small models write them) - the reply becomes a
    call: the tag is forced, then the grammar. Otherwise the reply is a plain answer, free text.
    With `required` the reply is always a call. After an opening tag, wherever it comes, only tokens
    that keep the call a valid `call_schema(tools)` JSON object are allowed.
    `complete` turns true once a call's object is closed: the backend ends the reply there.
    `mask_s` / `masked_tokens` measure what the constraint costs per constrained token."""

    def __init__(
        self,
        hf_tokenizer: Any,
        start_tokens: Sequence[int],
        tools: Sequence[dict[str, Any]],
        required: bool = False,
    ):
        import llguidance.hf
        import numpy as np
        from llguidance import LLMatcher

        key = id(hf_tokenizer)
        if key not in _LL_TOKENIZERS:
            _LL_TOKENIZERS[key] = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.ll = _LL_TOKENIZERS[key]
        self.grammar = call_grammar(tools)
        self.start = tuple(start_tokens)
        self.generated: list[int] = []
        self.complete = False
        self.in_call = False
        self.error: str | None = None
        self.mask_s = 0.0
        self.masked_tokens = 0
        self._bitmask = np.full((1, (self.ll.vocab_size + 31) // 32), -1, dtype=np.int32)
        self._bits = np.arange(32, dtype=np.uint32)
        self._prompt_len: int | None = None
        self.tools = tools
        # the reply's first token: a call or an answer (only for a one-token opening tag)
        self._gate = len(self.start) == 1
        self.matcher: Any = (
            LLMatcher(self.ll, call_grammar(tools, self.start[0], True), log_level=0)
            if self._gate and required
            else None
        )
        if self._gate and not required:
            self.openings = _improvised_openings(hf_tokenizer)

    def __call__(self, tokens: Any, logits: Any) -> Any:
        n = int(tokens.shape[-1]) if hasattr(tokens, "shape") else len(tokens)
        if self._prompt_len is None:
            self._prompt_len = n
        elif n > self._prompt_len + len(self.generated):
            last = tokens[-1]
            self.feed(int(last.item() if hasattr(last, "item") else last))
        if self._gate and not self.generated and self.matcher is None:
            return self._first(logits)
        if self.matcher is None or self.complete:
            return logits
        return self.apply(logits)

    def _first(self, logits: Any) -> Any:
        """The reply's first token, unconstrained but for an improvised call: that becomes a real one."""
        import mlx.core as mx
        from llguidance import LLMatcher

        row = logits[0] if len(logits.shape) == 2 else logits
        top = int(mx.argmax(row).item())
        if top == self.start[0] or (top < len(self.openings) and self.openings[top]):
            self.matcher = LLMatcher(self.ll, call_grammar(self.tools, self.start[0], True), log_level=0)
            return self.apply(logits)
        self._gate = False
        return logits

    def feed(self, token: int) -> None:
        """One generated token: advances the matcher; wakes it after an opening tag in the text."""
        from llguidance import LLMatcher

        self.generated.append(token)
        if self.matcher is not None:
            self.matcher.consume_token(token)
            if len(self.generated) == 1 and self.start and token != self.start[0]:
                self.matcher = None  # the reply began as an answer: free text from here
                return
            self.in_call = True
            if self.matcher.is_error():
                self.error = self.matcher.get_error()
                self.matcher = None
            elif self.matcher.is_stopped() or self.matcher.is_accepting():
                self.complete = True
        elif self.start and tuple(self.generated[-len(self.start) :]) == self.start:
            self.matcher = LLMatcher(self.ll, self.grammar, log_level=0)
            self.in_call = True

    def allowed(self) -> Any:
        """A boolean numpy mask over the vocabulary: the tokens that may come next."""
        import llguidance.numpy
        import numpy as np

        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        words = self._bitmask[0].view(np.uint32)
        return ((words[:, None] >> self._bits) & 1).astype(bool).reshape(-1)

    def apply(self, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        t0 = time.perf_counter()
        vocab = logits.shape[-1]
        mask = self.allowed()[:vocab]
        if mask.shape[0] < vocab:  # the model's embedding is padded past the tokenizer's vocabulary
            mask = np.concatenate([mask, np.zeros(vocab - mask.shape[0], dtype=bool)])
        out = mx.where(mx.array(mask), logits, mx.array(-float("inf"), dtype=logits.dtype))
        self.mask_s += time.perf_counter() - t0
        self.masked_tokens += 1
        return out


class ToolCallSplitter:
    """Splits a reply's text into what the user reads and the tool calls between the template's tags
    (`<tool_call>` ... `</tool_call>` for Qwen and Hermes-style templates). A call left open when the
    reply ends (the constrained decoder stops at the closing brace) is parsed by `close()`."""

    def __init__(
        self,
        start: str,
        end: str,
        parser: Callable[[str, Any], Any] | None,
        tools: Sequence[dict[str, Any]],
    ) -> None:
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self.call_text: str | None = None  # inside a call: its text so far
        self.held = ""  # visible text that may be the beginning of the opening tag

    @property
    def in_call(self) -> bool:
        return self.call_text is not None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        visible, calls = [], []
        buf = self.held + text
        self.held = ""
        while buf:
            if self.call_text is None:
                i = buf.find(self.start)
                if i < 0:
                    keep = _prefix_overlap(buf, self.start)
                    visible.append(buf[: len(buf) - keep])
                    self.held = buf[len(buf) - keep :]
                    break
                visible.append(buf[:i])
                self.call_text, buf = "", buf[i + len(self.start) :]
            else:
                self.call_text += buf
                j = self.call_text.find(self.end)
                if j < 0:
                    break
                body, buf = self.call_text[:j], self.call_text[j + len(self.end) :]
                calls.append(parse_call_text(body, self.parser, self.tools))
                self.call_text = None
        return "".join(visible), calls

    def close(self) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: held-back text, and an unclosed call (parsed as it stands)."""
        held, self.held = self.held, ""
        if self.call_text is None or not self.call_text.strip():
            self.call_text = None
            return held, []
        body, self.call_text = self.call_text, None
        return held, [parse_call_text(body, self.parser, self.tools)]


def _prefix_overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` are the beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
