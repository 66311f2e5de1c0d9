"""The websocket endpoint: one socket per browser tab, one `Session` per socket.

Shape: the Origin is checked before `accept()` (the access token, when the server needs one, was
checked earlier, by `webapp.security`); then three kinds of task run side by side — the reader
(parses client messages, dispatches them), the writer (the only one sending on the socket, from an
outbox queue) and at most one generation task (streams a reply from the engine worker, batching
token text every `BATCH_SECONDS`). Because the reader never waits for a generation, Stop
(and, with the agent, dialog answers) are handled while tokens stream.

What it knows: the conversation flow (send, stop, regenerate, switch model) and which fragments to
send. What it does not know: HTML layout (templates, via `webapp.views`), SQL (`webapp.db`),
MLX (the engine runs on the worker's own thread; this module only submits requests to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.base import Done, GenerationRequest, Message, SamplingParams, TextDelta

from . import protocol as p
from .db import StoredMessage
from .state import AppState

log = logging.getLogger(__name__)
SAVE_PARTIAL_SECONDS = 1.0  # how often a growing reply is written to SQLite (crash safety)
METER_SECONDS = 1.0  # how often the flash engine's live numbers are sent while it works
TITLE_CHARS = 48


def origin_allowed(ws: WebSocket, allowed: set[str]) -> bool:
    return ws.headers.get("origin", "") in allowed


async def websocket_endpoint(ws: WebSocket) -> None:
    state: AppState = ws.app.state.flashcode
    if not origin_allowed(ws, state.settings.allowed_origins):
        log.warning("websocket from origin %r refused", ws.headers.get("origin"))
        await ws.close(code=1008, reason="origin not allowed")  # before accept: the handshake gets a 403
        return
    await ws.accept()
    await Session(ws, state).run()


class Session:
    def __init__(self, ws: WebSocket, state: AppState) -> None:
        self.ws = ws
        self.state = state
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None  # the generation task, when one runs
        self.cancel: Callable[[], None] | None = None
        self.dialogs: dict[str, asyncio.Future[p.Answer]] = {}
        from .agent.web import AgentBridge  # issue 4: slash commands and agent-mode turns

        self.agent = AgentBridge(self)
        self.received = 0.0  # arrival of the message being handled (for server-side TTFT)

    # ------------------------------------------------------------------ plumbing
    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        try:
            await self._read()
        finally:
            await self._stop_generation()
            for fut in self.dialogs.values():
                fut.cancel()
            self.outbox.put_nowait(None)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer, 2)
            writer.cancel()

    async def _write(self) -> None:
        while (frame := await self.outbox.get()) is not None:
            try:
                await self.ws.send_text(frame)
            except Exception:  # noqa: BLE001 - the socket went away; the reader sees the disconnect
                return

    async def _read(self) -> None:
        while True:
            try:
                msg = await self.ws.receive()
                self.received = time.monotonic()
            except (WebSocketDisconnect, RuntimeError):
                return
            if msg["type"] == "websocket.disconnect":
                return
            raw = msg.get("text") if msg.get("text") is not None else msg.get("bytes")
            try:
                await self.handle(p.parse(raw))
            except p.ProtocolError as exc:
                self.error(str(exc))
            except Exception as exc:  # noqa: BLE001 - one bad message must not end the session
                log.exception("websocket message failed")
                self.error(f"internal error: {type(exc).__name__}: {exc}")

    def send(self, *fragments: str) -> None:
        self.outbox.put_nowait("".join(fragments))

    def error(self, text: str) -> None:
        self.send(self.state.views.alert(text))

    @property
    def generating(self) -> bool:
        return self.task is not None and not self.task.done()

    # ------------------------------------------------------------------ dispatch
    async def handle(self, msg: p.ClientMessage) -> None:
        if isinstance(msg, p.Stop):
            if self.cancel is not None:
                self.cancel()
        elif isinstance(msg, p.Answer):
            self._answer(msg)
        elif self.generating:
            self.error("a reply is still being written: press Stop first")
        elif isinstance(msg, p.Send):
            self._send(msg)
        elif isinstance(msg, p.Regenerate):
            self._regenerate(msg)
        elif isinstance(msg, p.SwitchModel):
            await self._switch_model(msg)

    def _send(self, msg: p.Send) -> None:
        db = self.state.db
        conv = db.get_conversation(msg.conversation_id) if msg.conversation_id else None
        if msg.conversation_id and conv is None:
            self.error("that conversation no longer exists: start a new one (File > New Conversation)")
            return
        created = conv is None
        if conv is None:
            title = " ".join(msg.text.split())[:TITLE_CHARS] or "Untitled"
            conv = db.create_conversation(title, *self.state.engine.model_and_backend())
        user = db.add_message(conv.id, "user", msg.text)
        overrides = {"max_tokens": msg.max_tokens, "temperature": msg.temperature}
        first = [*([self.state.views.conversation_field(conv.id), self.state.views.chat_title(conv.title)] if created else []),
                 self.state.views.append_message(user)]  # fmt: skip
        if self.agent.wants(conv.id, msg.text):  # a slash command, or a turn in agent mode
            self.send(*first)
            self.task = asyncio.create_task(self.agent.run_turn(conv.id, msg.text))
            return
        # the engine starts first; the page is updated while it reads the prompt
        self._start(conv.id, {k: v for k, v in overrides.items() if v is not None}, first=first)

    def _regenerate(self, msg: p.Regenerate) -> None:
        db = self.state.db
        if db.get_conversation(msg.conversation_id) is None:
            self.error("nothing to regenerate: that conversation does not exist")
            return
        messages = db.messages(msg.conversation_id)
        if not messages or messages[-1].role != "assistant":
            self.error("nothing to regenerate: the last message is not a reply")
            return
        db.delete_message(messages[-1].id)
        self.send(self.state.views.delete_message(messages[-1].id))
        self._start(msg.conversation_id)

    async def _switch_model(self, msg: p.SwitchModel) -> None:
        self.send(self.state.views.controls(generating=True, text=f"Loading {msg.model}…"))
        try:
            await self.state.engine.switch(msg.backend, msg.model)
        except Exception as exc:  # noqa: BLE001 - shown to the user; the engine keeps or restores a model
            self.error(f"could not load {msg.model} on {msg.backend}: {exc}")
        self.send(self.state.views.model_picker(), self.state.views.controls(generating=False),
                  self.state.views.gauge(0), self.state.views.engine_meter(None))  # fmt: skip

    def _answer(self, msg: p.Answer) -> None:
        fut = self.dialogs.pop(msg.dialog_id, None)
        if fut is None or fut.done():
            self.error(f"there is no open dialog {msg.dialog_id!r}")
            return
        fut.set_result(msg)

    async def ask(self, dialog_html: str, dialog_id: str | None = None) -> p.Answer:
        """For the agent (issue 4): show a dialog fragment and wait for the user's `answer`."""
        dialog_id = dialog_id or uuid.uuid4().hex[:12]
        fut: asyncio.Future[p.Answer] = asyncio.get_running_loop().create_future()
        self.dialogs[dialog_id] = fut
        self.send(dialog_html)
        return await fut

    # ------------------------------------------------------------------ generation
    def _start(
        self, conversation_id: str, sampling: dict[str, Any] | None = None, first: list[str] | None = None
    ) -> None:
        self.task = asyncio.create_task(
            self._generate(conversation_id, self.state.sampling | (sampling or {}), first or [])
        )
        self.task.add_done_callback(self._generation_ended)

    def _generation_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("generation failed", exc_info=exc)
        self.send(self.state.views.controls(generating=False, can_regenerate=True))
        self.error(f"the reply failed: {type(exc).__name__}: {exc}")

    async def _stop_generation(self) -> None:
        if self.task is not None and not self.task.done():
            if self.cancel is not None:
                self.cancel()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self.task), 5)
            self.task.cancel()

    async def _generate(self, conversation_id: str, sampling: dict[str, Any], first: list[str]) -> None:
        db, views, engine = self.state.db, self.state.views, self.state.engine
        history: list[Message] = [{"role": m.role, "content": m.content} for m in db.messages(conversation_id)
                                  if m.role in ("user", "assistant", "system") and m.content]  # fmt: skip
        request = GenerationRequest(messages=tuple(history), sampling=SamplingParams(**sampling),
                                    cache_key=conversation_id)  # fmt: skip
        submitted = time.monotonic()
        gen = engine.worker.submit(request, loop=asyncio.get_running_loop())
        self.cancel = gen.cancel
        reply = db.add_message(conversation_id, "assistant", "", status="streaming")
        stream = TokenBatcher(self, reply.id, submitted)
        stream.received = self.received or submitted
        self.send(*first, views.append_message(reply), views.controls(generating=True),
                  views.conversation_list(conversation_id))  # fmt: skip
        done: Done | None = None
        meter = asyncio.create_task(self._meter(stream))
        try:
            async for event in gen:
                if isinstance(event, TextDelta):
                    stream.add(event.text, len(event.token_ids))
                elif isinstance(event, Done):
                    done = event
        finally:
            meter.cancel()
            self.cancel = None
            stream.close()
            if done is None:  # the task was cancelled (socket closed): keep what streamed
                gen.cancel()
                db.finish_message(reply.id, stream.text, "stopped")
        self._finish(conversation_id, reply, stream, done, history)

    async def _meter(self, stream: TokenBatcher) -> None:
        """While a reply is written, send the engine's live numbers (flash: disk rate, MB per token, expert
        hits, memory) every METER_SECONDS — through prefill too, when no token arrives for a long time.
        `live_stats()` reads counters only (no MLX), so it is safe off the worker's thread."""
        live = getattr(self.state.engine.worker.backend, "live_stats", None)
        if live is None:
            return
        start = live().get("bytes_read", 0)
        while True:
            await asyncio.sleep(METER_SECONDS)
            try:
                now = live()
            except Exception:  # noqa: BLE001 - a meter must never break a reply (e.g. the model was closed)
                return
            read = now.get("bytes_read", 0) - start
            self.send(self.state.views.engine_meter({
                "bytes_per_s": now.get("bytes_per_s", 0.0), "rss_bytes": now.get("rss_bytes", 0),
                "memory_budget": now.get("memory_budget"), "hit_rate": now.get("hit_rate"),
                "mb_per_token": read / stream.tokens / 1e6 if stream.tokens else None,
            }))  # fmt: skip

    def _finish(self, conversation_id: str, reply: StoredMessage, stream: TokenBatcher, done: Done,
                history: list[Message]) -> None:  # fmt: skip
        db, views = self.state.db, self.state.views
        text = done.text or stream.text
        status = {"stop": "complete", "length": "complete", "cancelled": "stopped"}.get(
            done.finish_reason, "error"
        )
        stats: dict[str, Any] = done.stats.to_dict() | {"finish_reason": done.finish_reason}
        if not done.stats.ttft_s:  # a stop answers at once, before the engine's own numbers exist
            stats |= stream.measured()
        if stream.first_sent is not None:  # message in -> first token frame out, on this server
            stats["server_ttft_s"] = stream.first_sent - stream.received
        stats |= dict(zip(("model", "backend"), self.state.engine.model_and_backend(), strict=True))
        if done.error:
            stats["error"] = done.error
        db.finish_message(reply.id, text, status, stats)
        for hook in self.state.on_reply:
            try:
                hook(self.state, stats, conversation_id=conversation_id, message_id=reply.id)
            except Exception:  # noqa: BLE001 - a hook must not lose the reply
                log.exception("reply hook %r failed", hook)
        db.touch(conversation_id, *self.state.engine.model_and_backend())
        final = db.messages(conversation_id)[-1]
        fragments = [views.replace_message(final), views.controls(generating=False, can_regenerate=True)]
        if done.stats.prompt_tokens:
            fragments.append(views.gauge(done.stats.prompt_tokens + done.stats.completion_tokens))
        elif status == "stopped":  # a stop answers before the engine counted the prompt: count it now
            asyncio.get_running_loop().create_task(self._count_prompt(final, history))
        self.send(*fragments)
        if done.error:
            self.error(done.error)

    async def _count_prompt(self, reply: StoredMessage, history: list[Message]) -> None:
        try:
            n = await self.state.engine.worker.acall(lambda b: len(b.apply_chat_template(history)))
        except Exception:  # noqa: BLE001 - the gauge is a nicety
            return
        stats = reply.stats | {"prompt_tokens": n}
        self.state.db.finish_message(reply.id, reply.content, reply.status, stats)
        self.send(self.state.views.gauge(n + int(stats.get("completion_tokens") or 0)))


class TokenBatcher:
    """Collects token text and sends it as one fragment per `BATCH_SECONDS` (the first at once)."""

    def __init__(self, session: Session, message_id: int, started: float) -> None:
        self.session = session
        self.message_id = message_id
        self.started = started
        self.received = started
        self.first_sent: float | None = None
        self.first: float | None = None  # arrival of the first and the latest token
        self.latest = 0.0
        self.tokens = 0
        self.parts: list[str] = []
        self.pending: list[str] = []
        self.last_flush = 0.0
        self.last_save = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def measured(self) -> dict[str, Any]:
        """Time to first token and decode rate as seen here (used when the engine's are missing)."""
        if self.first is None:
            return {}
        span = self.latest - self.first
        return {"ttft_s": self.first - self.started, "completion_tokens": self.tokens,
                "decode_tps": (self.tokens - 1) / span if span > 0 and self.tokens > 1 else 0.0}  # fmt: skip

    def add(self, text: str, tokens: int = 1) -> None:
        self.latest = time.monotonic()
        if self.first is None:
            self.first = self.latest
        self.tokens += tokens
        self.parts.append(text)
        self.pending.append(text)
        wait = self.last_flush + p.BATCH_SECONDS - time.monotonic()
        if wait <= 0:
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(wait, self.flush)

    def flush(self) -> None:
        self.timer = None
        if not self.pending:
            return
        chunk = html.escape("".join(self.pending), quote=False)
        self.pending.clear()
        self.last_flush = time.monotonic()
        self.session.send(f'<div id="msg-{self.message_id}-body" hx-swap-oob="beforeend">{chunk}</div>')
        if self.first_sent is None:
            self.first_sent = self.last_flush
        if self.last_flush - self.last_save >= SAVE_PARTIAL_SECONDS:
            self.last_save = self.last_flush
            self.session.state.db.save_partial(self.message_id, self.text)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.flush()
