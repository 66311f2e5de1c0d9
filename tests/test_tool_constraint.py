"""The constrained decoder (`engine.tool_calls.ToolCallConstraint`, llguidance) never lets a model
write an invalid tool call: over random logits (hypothesis), whatever token wins under the mask, the
reply is the template's opening tag and then a JSON object naming one of the agent's tools with
arguments its schema accepts. The real agent model's tokenizer (Qwen2.5-Coder, 151,936 tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tool_calls import ToolCallConstraint, call_schema, parse_call_text
from webapp.agent.tools import BY_NAME, check_arguments, openai_tools

mx = pytest.importorskip("mlx.core")
TOOLS = openai_tools()
CLOSE_AFTER = 48  # then closing characters are favoured, so strings and objects end


@pytest.fixture(scope="module")
def tokenizer(model_home):
    from transformers import AutoTokenizer

    from webapp.agent.loop import DEFAULT_AGENT_MODEL

    path = model_home / "models" / DEFAULT_AGENT_MODEL
    if not path.is_dir():
        pytest.skip(f"the agent model {DEFAULT_AGENT_MODEL} is not installed (`make setup`)")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def closers(tokenizer) -> np.ndarray:
    vocab = len(tokenizer)
    texts = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    return np.array([bool(t) and any(c in t for c in '"}]') for t in texts])


def decode(tokenizer, constraint: ToolCallConstraint, seed: int, required: bool, closers) -> list[int]:
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    tokens = [1, 2, 3]  # a prompt
    for step in range(400):
        logits = rng.standard_normal(vocab).astype(np.float32) * 4
        if step >= CLOSE_AFTER:
            logits = logits + 40 * closers
        out = np.array(constraint(mx.array(tokens), mx.array(logits[None]))[0])
        if constraint.complete:  # set as it took the last token in: the backend ends the reply here
            return tokens[3:]
        token = int(np.argmax(out))
        assert np.isfinite(out[token]), "the mask allowed no token"
        tokens.append(token)
        if step == 0 and not required and token != constraint.start[0]:
            return tokens[3:]  # an answer: free text, nothing to check
    raise AssertionError("the call never closed")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), required=st.booleans())
def test_constrained_decoder_yields_only_valid_calls(tokenizer, closers, seed: int, required: bool) -> None:
    start = tokenizer.convert_tokens_to_ids(["<tool_call>"])
    constraint = ToolCallConstraint(tokenizer, start, TOOLS, required=required)
    out = decode(tokenizer, constraint, seed, required, closers)
    if out[0] != start[0]:
        assert not required
        return
    call = parse_call_text(tokenizer.decode(out[1:]), None, TOOLS)
    assert call.error is None, (call.raw, call.error)
    assert call.name in BY_NAME
    assert check_arguments(BY_NAME[call.name], call.arguments) is None, call
    assert constraint.error is None


def test_call_schema_names_every_tool() -> None:
    schema = call_schema(TOOLS)
    assert schema["x-guidance"]["whitespace_pattern"]
    assert sorted(o["properties"]["name"]["const"] for o in schema["anyOf"]) == sorted(BY_NAME)
    assert json.loads(json.dumps(schema)) == schema


# --------------------------------------------------------------------------- llama-server's path
class ScriptedLlama:
    """`LlamaServerBackend` with its HTTP replaced: raw completions are scripted by prompt suffix."""

    def __new__(cls, replies: dict[str, str]):
        from engine.llama_server import LlamaServerBackend

        class Backend(LlamaServerBackend):
            def _require(self):
                class Client:
                    def apply_template(self, messages, tools=()):
                        return "PROMPT" + ("+TOOLS" if tools else "")

                return Client()

            def stream(self, request, cancel, json_schema=None):
                if request.tools:
                    yield from super().stream(request, cancel)
                    return
                self.seen.append((request.prompt, json_schema))
                from engine.base import Done, GenerationStats, TextDelta

                key = "call" if request.prompt.endswith("<tool_call>\n") else "first"
                for piece in replies[key]:
                    yield TextDelta(piece, ())
                yield Done(GenerationStats(), "stop", "".join(replies[key]))

        b = Backend()
        b.seen = []
        return b


def llama_events(replies: dict[str, object], **kw: object) -> tuple[list, object]:
    import threading

    from engine.base import GenerationRequest

    b = ScriptedLlama(replies)  # type: ignore[arg-type]
    req = GenerationRequest(messages=({"role": "user", "content": "x"},), tools=TOOLS, **kw)  # type: ignore[arg-type]
    return list(b.stream(req, threading.Event())), b


def test_llama_tools_answer_streams_as_text() -> None:
    from engine.base import Done, TextDelta, ToolCall

    events, b = llama_events({"first": ["Hel", "lo ", "there."]})
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello there."
    assert not [e for e in events if isinstance(e, ToolCall)] and isinstance(events[-1], Done)
    assert b.seen == [("PROMPT+TOOLS", None)]


def test_llama_tools_improvised_call_is_redone_under_the_schema() -> None:
    from engine.base import TextDelta, ToolCall

    call = '{"name": "read_file", "arguments": {"path": "a.py"}}'
    events, b = llama_events({"first": ["``", "`json\n{"], "call": [call]})
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, c.arguments, c.error) for c in calls] == [("read_file", {"path": "a.py"}, None)]
    assert not [e for e in events if isinstance(e, TextDelta) and e.text]  # the fence never shows
    assert b.seen[1][0] == "PROMPT+TOOLS<tool_call>\n" and "anyOf" in b.seen[1][1]


def test_llama_tools_required_goes_straight_to_the_call() -> None:
    from engine.base import ToolCall

    events, b = llama_events({"call": ['{"name": "list_files", "arguments": {}}']}, tool_choice="required")
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["list_files"]
    assert len(b.seen) == 1 and b.seen[0][1] is not None


def test_llama_tools_unconstrained_reads_calls_between_tags() -> None:
    from engine.base import TextDelta, ToolCall

    tagged = ['<tool_call>\n{"name": "read_file", ', '"arguments": {"path": "b"}}\n</tool_call>']
    events, _ = llama_events({"first": tagged}, constrain_tools=False)
    assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)] == [
        ("read_file", {"path": "b"})
    ]
    events, _ = llama_events({"first": ['```json\n{"name": "x"}\n```']}, constrain_tools=False)
    assert not [e for e in events if isinstance(e, ToolCall)]
    assert "```json" in "".join(e.text for e in events if isinstance(e, TextDelta))


def test_splitter_takes_calls_out_of_the_text_across_pieces() -> None:
    from engine.tool_calls import ToolCallSplitter

    s = ToolCallSplitter("<tool_call>", "</tool_call>", None, TOOLS)
    pieces = [
        "Let me look. <tool",
        '_call>\n{"name": "read_file", ',
        '"arguments": {"path": "x"}}\n</tool',
        "_call> ok",
    ]
    text, calls = "", []
    for p in pieces:
        t, c = s.feed(p)
        text, calls = text + t, calls + c
    held, more = s.close()
    assert text + held == "Let me look.  ok" and [c.arguments for c in calls + more] == [{"path": "x"}]
    s.feed('<tool_call>\n{"name": "list_files", "arguments": {}}')  # cut off: the constrained reply ended
    assert [c.name for c in s.close()[1]] == ["list_files"]
    s.feed("<tool_call>\n{not json")
    assert s.close()[1][0].error
