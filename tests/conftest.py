"""Shared fixtures and the one scripted engine. The real default model is imported once per run
into $FLASHCODE_HOME (`make test` / CI set it up); each test that writes user data gets its own data
directory whose `models/` points at that shared one, so no test touches another's conversations.

`FakeBackend` stands in for an engine wherever the model's choices are not what is tested: replies
are scripted with `enqueue(*tokens)`, the agent router's picks with `enqueue_route(label)`, and
`history` records every request it was given. Servers for tests and benchmarks: `tests/servers.py`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.base import (
    Done,
    GenerationRequest,
    GenerationStats,
    Message,
    ModelInfo,
    PrefillProgress,
    TextDelta,
    ToolCall,
)
from webapp.agent.router import ROUTES

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ARTIFACTS = Path(__file__).parent / "artifacts"


class FakeBackend:
    """A scripted engine (the Backend protocol, plus scoring for the agent's router).

    `enqueue("Hi", " there")` queues one reply streamed as those tokens (`delay` seconds apart);
    with nothing queued a reply is "Hello world.". `enqueue_route("shell")` makes the router's next
    pick that label. `history` holds every `GenerationRequest`; `threads` the threads it ran on.
    A token is a word: `tokenize` gives one id per word (its length). With `tools=True` its "chat
    template" takes tools (the agent runs its tool loop): `enqueue_call("read_file", path="a.py")`
    queues a reply that is that call (`enqueue(ToolCall(...), ...)` mixes calls and text)."""

    name = "fake"

    def __init__(
        self,
        delay: float = 0.0,
        context_length: int = 2048,
        model: str | None = "fake-model",
        default_reply: Sequence[str] = ("Hello", " world", "."),
        tools: bool = False,
    ) -> None:
        self.delay = delay
        self._context_length = context_length
        self._model = (
            ModelInfo(name=model, path=Path("/nonexistent"), architecture="fake", size_bytes=0)
            if model
            else None
        )
        self.default_reply = list(default_reply)
        self.tools = tools
        self.replies: list[list[str | ToolCall]] = []
        self.routes: list[str] = []
        self.history: list[GenerationRequest] = []
        self.threads: set[str] = set()
        self.closed = False

    def enqueue(self, *tokens: str) -> FakeBackend:
        self.replies.append(list(tokens))
        return self

    def enqueue_call(self, name: str, raw: str | None = None, **arguments: object) -> FakeBackend:
        """A reply that calls `name` with `arguments`; `raw` makes it a malformed call (unreadable text)."""
        n = sum(len(r) for r in self.replies)
        error = "the tool call is not valid JSON" if raw is not None else None
        self.replies.append([ToolCall(f"call_{n}", name, dict(arguments), raw or "", error)])
        return self

    def supports_tools(self) -> bool:
        return self.tools

    def enqueue_route(self, label: str) -> FakeBackend:
        self.routes.append(label)
        return self

    # ------------------------------------------------------------------ the Backend protocol
    def load(self, model: ModelInfo) -> None:
        self._model = model

    @property
    def model(self) -> ModelInfo | None:
        return self._model

    @property
    def context_length(self) -> int:
        return self._context_length

    def tokenize(self, text: str) -> list[int]:
        self.threads.add(threading.current_thread().name)
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        return self.tokenize(" ".join(str(m.get("content") or "") for m in messages))

    def score_continuations(self, prompt_tokens: list[int], continuations: list[list[int]]) -> list[float]:
        label = self.routes.pop(0)
        return [-0.1 if r == label else -5.0 for r in ROUTES]

    def stream(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[TextDelta | Done]:
        self.threads.add(threading.current_thread().name)
        self.history.append(request)
        tokens = self.replies.pop(0) if self.replies else list(self.default_reply)
        start, out = time.monotonic(), []
        prompt = len(self.apply_chat_template(request.messages or ()))
        for i, tok in enumerate(tokens):
            if cancel.is_set():
                yield Done(self._stats(prompt, len(out), start), "cancelled", "".join(out))
                return
            if self.delay:
                time.sleep(self.delay)
            if isinstance(tok, ToolCall | PrefillProgress):  # a scripted call, or the prompt being read
                yield tok
                continue
            out.append(tok)
            yield TextDelta(tok, (i,))
        yield Done(self._stats(prompt, len(out), start), "stop", "".join(out))

    def _stats(self, prompt: int, n: int, start: float) -> GenerationStats:
        total = time.monotonic() - start
        return GenerationStats(
            prompt_tokens=prompt,
            completion_tokens=n,
            ttft_s=0.001,
            decode_tps=n / max(total, 1e-6),
            total_s=total,
        )

    def close(self) -> None:
        self.closed = True


FRAME_WAIT = 300.0  # seconds a websocket test waits for one frame (a real model's slowest step is far less)


def next_frame(ws, seconds: float = FRAME_WAIT) -> str:
    """The test client websocket's next text frame; an AssertionError when none comes within `seconds`, not a
    hang until pytest-timeout's dump (Starlette's `receive_text()` waits forever)."""
    import anyio

    stream = getattr(ws, "_send_rx", None)  # Starlette's test session: an anyio stream since 0.41
    if stream is None:  # pragma: no cover - another Starlette: no time limit, the same frames
        return ws.receive_text()

    async def receive() -> dict:
        with anyio.fail_after(seconds):
            return await stream.receive()

    try:
        message = ws.portal.call(receive)
    except TimeoutError:
        raise AssertionError(f"no websocket frame came within {seconds:g} s") from None
    ws._raise_on_close(message)
    return message["text"]


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="session")
def model_home() -> Path:
    """The data directory holding the imported default model (imported here if missing)."""
    from engine import paths
    from engine.models import ensure_default_model

    root = paths.home()
    ensure_default_model(root, quiet=True)
    return root


@pytest.fixture(scope="session")
def default_model(model_home: Path):
    from engine.models import find_model

    return find_model(None, model_home)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """Each phase's report on the item (`item.rep_call`), for fixtures that leave evidence when a test failed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def failed(request: pytest.FixtureRequest) -> bool:
    rep = getattr(request.node, "rep_call", None)
    return rep is not None and rep.failed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that runs the real model through `mlx_backend` is `slow` by that marker's definition
    (`make check` leaves it out; `make test` runs it), wherever it is."""
    for item in items:
        if "mlx_backend" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def mlx_backend(default_model):
    """One loaded in-RAM MLX backend for the whole run (loading costs seconds on CPU)."""
    from engine.mlx_backend import MLXBackend

    b = MLXBackend()
    b.load(default_model)
    yield b
    b.close()


@pytest.fixture
def data_dir(tmp_path: Path, model_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh $FLASHCODE_HOME for one test, sharing the imported models read-only."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_home / "models", target_is_directory=True)
    (home / "gguf").symlink_to(model_home / "gguf", target_is_directory=True)
    monkeypatch.setenv("FLASHCODE_HOME", str(home))
    yield home


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# MLX can crash while the interpreter tears down after several engine threads (each with its own
# MLX streams) have come and gone: every test passes, then the process dies with SIGSEGV at exit
# (seen with the agent and stats real-model modules in one run; each alone exits cleanly). A user's
# process has one engine thread, so this only bites the test runner: once pytest has reported,
# leave without running interpreter teardown, keeping pytest's exit status.
_exit_status = {"code": 0}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status["code"] = int(exitstatus)
    # `make test` sets FLASHCODE_NO_SKIP=1: it installs llama-server and Chromium and runs as root,
    # so a skip there means a part went untested; fail instead of passing quietly.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("FLASHCODE_NO_SKIP") == "1" and skipped and _exit_status["code"] == 0:
        print(f"\nFLASHCODE_NO_SKIP=1: {skipped} test(s) skipped; each skip is a part left untested here")
        _exit_status["code"] = 1
        session.exitstatus = 1


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("FLASHCODE_TEST_HARD_EXIT", "1") == "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status["code"])
