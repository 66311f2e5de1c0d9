"""The one reply pipeline: how a reply streams to the page and into the database, for every turn.

A `ReplyStream` is one assistant reply being written, whoever produces its text — the chat's own
generation or an agent turn's answer. It owns:

- the row: inserted as `streaming` when the reply starts, its text saved every
  `SAVE_PARTIAL_SECONDS` while it grows (a crash keeps what streamed), finished with a status and
  the stats;
- batching: token text is sent as one token frame (`tokens` in `templates/macros.html`) at most
  every `BATCH_SECONDS`, the first at once; before it, the engine's prefill progress ("Reading your
  prompt… N / M tokens", `prefill`) at most every `PROGRESS_SECONDS`;
- server-side TTFT: from the user's message arriving to the first token frame handed to the socket
  (`server_ttft_s` in the stats), and TTFT / decode rate measured here when the engine has none;
- the hooks: each `ReplyHook` is called once the reply is stored; one that raises is logged and
  the others still run.

What it does not know: where the text comes from, sockets (it is given `send`), SQL (`Database`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..db import Database, StoredMessage, replaced_data
from ..engine_host import EngineState
from ..turns import ReplyHook
from .views import ChatViews

log = logging.getLogger(__name__)

BATCH_SECONDS = 0.04  # token text is flushed to the socket at most every 40 ms (first token at once)
SAVE_PARTIAL_SECONDS = 1.0  # how often a growing reply is written to SQLite (crash safety)
PROGRESS_SECONDS = 0.2  # prefill progress ("Reading your prompt… N / M") at most 5 times a second
STATUS_OF = {"stop": "complete", "length": "complete", "cancelled": "stopped"}  # anything else: error


_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.M)


def stable_cut(text: str, start: int = 0) -> int:
    """Where the finished markdown blocks of a growing text end: after its last blank line that is
    outside a code fence (at least `start`). What follows may still change as tokens arrive."""
    cut = text.rfind("\n\n", start)
    while cut >= start:
        if len(_FENCE.findall(text, 0, cut)) % 2 == 0:
            return cut + 2
        cut = text.rfind("\n\n", start, cut)
    return start


class ReplyStream:
    """One reply: `add()` text as it comes, then `finish()` once, or `abandon()` if cut off."""

    def __init__(
        self,
        *,
        db: Database,
        views: ChatViews,
        engine: EngineState,
        hooks: Sequence[ReplyHook],
        send: Callable[..., None],
        conversation_id: str,
        route: str | None = None,
        received: float | None = None,
        started: float | None = None,
        continuing: StoredMessage | None = None,
        turn: str = "chat",
        replacing: StoredMessage | None = None,
    ) -> None:
        self.db, self.views, self.engine, self.hooks, self.send = db, views, engine, hooks, send
        self.conversation_id, self.route = conversation_id, route
        self.turn = turn  # "agent": an agent turn's answer (not regenerated or continued as a chat reply)
        self.continuing = continuing
        # Regenerate: the reply this one replaces, deleted once this one is stored with text; one that ends
        # before any text (an engine error, Stop at once, a crash) leaves it as it was
        self.replacing = replacing
        if continuing is None:
            # an agent's answer says so from its start: one cut off (a stop, a crash) is not continued as a chat reply
            marks = ({"turn": turn} if turn != "chat" else {}) | (
                {"replaces": replacing.id} if replacing is not None else {}  # a crash recovery settles it
            )
            self.message = db.add_message(
                conversation_id, "assistant", "", status="streaming", stats=marks or None
            )
            self.prefix = ""
        else:  # Continue: the reply cut at the token limit grows in its own row (streaming again)
            db.finish_message(continuing.id, continuing.content, "streaming", continuing.stats)
            self.message = replace(continuing, status="streaming")
            self.prefix = continuing.content
        self.started = started if started is not None else time.monotonic()
        self.received = received or self.started  # arrival of the user's message
        self.first_sent: float | None = None
        self.first: float | None = None  # arrival of the first and the latest token
        self.latest = 0.0
        self.tokens = 0
        self.parts: list[str] = []
        self.done_upto = stable_cut(self.prefix)  # the text before this is sent as finished markdown blocks
        self.pending: list[str] = []
        self.last_flush = 0.0
        self.last_save = time.monotonic()
        self.partial_failed = False  # a save so far failed: no more tries for this reply
        self.last_progress: float | None = None
        self.prompt_read = 0  # of which the engine has read this much (its last report shown)
        self.prompt_total = 0  # the prompt's size, once the engine reports its progress
        self.timer: asyncio.TimerHandle | None = None
        self.finished = False

    @property
    def message_id(self) -> int:
        return self.message.id

    def redraw(self) -> list[str]:
        """The reply as written so far, for a page that shows its conversation again (drawn meanwhile from
        the part last saved): its finished blocks in the body, the rest as its tail (as Continue reopens one),
        and the status line as it was ("Reading your prompt…" and its progress while no token has come)."""
        if self.finished:
            return []
        body = replace(self.message, content=self.text[: self.done_upto], status="streaming")
        frames = [
            self.views.replace_message(body),
            self.views.tokens(self.message.id, "", self.text[self.done_upto :]),
        ]
        reading = self.first_sent is None and self.last_progress is not None
        if reading:
            frames.append(self.views.prefill(self.message.id, self.prompt_read, self.prompt_total))
        frames.append(self.views.controls(generating=True, text="Reading your prompt…" if reading else None))
        return frames

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)

    def opening(self) -> list[str]:
        """The fragments that show this reply starting: a new empty reply, or the cut one reopened
        (its finished blocks in the body, its unfinished tail where new text will join it)."""
        if self.continuing is None:
            gone = []
            if self.replacing is not None:  # shown folded above the new one (stored so once the new one is)
                gone = [self.views.delete_message(self.replacing.id)]
                if self.replacing.content:
                    gone.append(self.views.replaced_reply(replaced_data(self.replacing)))
            return [*gone, self.views.append_message(self.message)]
        body = replace(self.message, content=self.prefix[: self.done_upto])
        return [
            self.views.replace_message(body),
            self.views.tokens(self.message.id, "", self.prefix[self.done_upto :]),
        ]

    # ------------------------------------------------------------------ streaming
    def progress(self, processed: int, total: int) -> None:
        """The engine has read `processed` of `total` prompt tokens: shown in the reply until its first
        token, the first report at once, then at most one every PROGRESS_SECONDS."""
        self.prompt_total = total  # the context gauge counts it while the reply is written
        if processed >= total and self.last_progress is None:
            return  # read at once (the engine's last report says the prompt is read): nothing to show
        now = time.monotonic()
        if self.first is not None or (
            self.last_progress is not None and now - self.last_progress < PROGRESS_SECONDS
        ):
            return
        first = self.last_progress is None
        self.last_progress, self.prompt_read = now, processed
        self.send(self.views.prefill(self.message.id, processed, total))
        if first:  # the status bar says what the reply says: the prompt is being read, nothing written yet
            self.send(self.views.controls(generating=True, text="Reading your prompt…"))

    def add(self, text: str, tokens: int = 1) -> None:
        self.latest = time.monotonic()
        if self.first is None:
            self.first = self.latest
        self.tokens += tokens
        self.parts.append(text)
        self.pending.append(text)
        wait = self.last_flush + BATCH_SECONDS - time.monotonic()
        if wait <= 0:
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(wait, self.flush)

    def flush(self) -> None:
        self.timer = None
        if not self.pending:
            return
        self.pending.clear()
        self.last_flush = time.monotonic()
        text = self.text
        cut = stable_cut(text, self.done_upto)
        done, self.done_upto = text[self.done_upto : cut], cut
        self.send(self.views.tokens(self.message.id, done, text[cut:]))
        # the prompt's size is known from the engine's progress (a long prompt): the gauge fills as it writes
        if self.prompt_total:
            self.send(self.views.gauge(self.prompt_total + self.tokens))
        if self.first_sent is None:
            self.first_sent = self.last_flush
            if self.last_progress is not None:  # back from "Reading your prompt…"
                self.send(self.views.controls(generating=True))
        if self.last_flush - self.last_save >= SAVE_PARTIAL_SECONDS and not self.partial_failed:
            self.last_save = self.last_flush
            try:
                self.db.save_partial(self.message.id, self.text)
            except sqlite3.Error:  # a full disk, a lock held elsewhere: streams on, stored at its end
                # once: each try on a locked database waits out SQLite's busy timeout on the event loop
                self.partial_failed = True
                log.warning("could not save the reply so far; it is saved when it ends", exc_info=True)

    def close(self) -> None:
        """Send what is pending and stop the batching timer."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.flush()

    def measured(self) -> dict[str, Any]:
        """Time to first token and decode rate as seen here (used when the engine's are missing)."""
        if self.first is None:
            return {}
        span = self.latest - self.first
        return {
            "ttft_s": self.first - self.started,
            "completion_tokens": self.tokens,
            "decode_tps": (self.tokens - 1) / span if span > 0 and self.tokens > 1 else 0.0,
        }

    # ------------------------------------------------------------------ the end
    def finish(
        self,
        text: str,
        finish_reason: str,
        stats: Mapping[str, Any],
        error: str | None = None,
        then: Iterable[str] = (),
    ) -> StoredMessage | None:
        """Store the reply with its stats, run the hooks, and send it rendered (with `then`); None when
        nothing new was stored: the conversation was deleted while the reply streamed (nothing left to store or
        show), or a Regenerate wrote no text (the reply it was to replace is shown again). A conversation
        moved to the Trash meanwhile keeps its reply (Put Back shows it)."""
        self.close()
        self.finished = True
        if self.db.get_conversation(self.conversation_id, trashed=True) is None:
            log.info("conversation %s was deleted while its reply streamed", self.conversation_id)
            if then:
                self.send(*then)  # the controls go back to idle all the same
            return None
        status = STATUS_OF.get(finish_reason, "error")
        numbers: dict[str, Any] = dict(stats) | {"finish_reason": finish_reason}
        if self.turn != "chat":
            numbers["turn"] = self.turn
        if self.continuing is not None:  # the numbers are this part's; the footer says it was continued
            numbers["continued"] = int(self.continuing.stats.get("continued") or 0) + 1
        # a stop answers at once, before the engine's own numbers exist; words no model wrote have none
        if not numbers.get("ttft_s") and not numbers.get("not_generated"):
            numbers |= self.measured()
        if self.first_sent is not None:  # message in -> first token frame out, on this server
            numbers["server_ttft_s"] = self.first_sent - self.received
        model, backend = self.engine.model_and_backend()
        numbers |= {"model": model, "backend": backend}
        if error:
            numbers["error"] = error
        content = self.prefix + text if text else self.text
        if (not content or status == "error") and self._keep_replaced(*then):
            return None  # nothing written, or an engine error midway: the old reply is the better one
        self.db.finish_message(self.message.id, content, status, numbers)
        self._drop_replaced()
        self.run_hooks(numbers)
        self.db.touch(self.conversation_id, model, backend)
        final = self.db.messages(self.conversation_id)[-1]
        self.send(self.views.replace_message(final), *then)
        return final

    def abandon(self) -> None:
        """Cut off (Stop, a closed socket, a failed turn): keep what streamed, marked stopped."""
        if self.finished:
            return
        self.close()
        self.finished = True
        if not self.text and self._keep_replaced():
            return
        marks = {k: v for k, v in self.message.stats.items() if k != "replaces"}  # settled below
        self.db.finish_message(self.message.id, self.text, "stopped", marks or None)
        self._drop_replaced()

    def _keep_replaced(self, *then: str) -> bool:
        """A Regenerate that wrote nothing: its empty row goes and the reply it was to replace is shown again
        (True); False when this reply replaces none."""
        if self.replacing is None:
            return False
        self.db.delete_message(self.message.id)
        self.send(
            self.views.delete_message(self.message.id),
            self.views.delete_replaced(self.replacing.id),
            self.views.append_message(self.replacing),
            *then,
        )
        return True

    def _drop_replaced(self) -> None:
        if self.replacing is not None:  # this reply is stored: the one it replaces goes, kept folded
            self.db.replace_reply(self.replacing)
            self.replacing = None

    def run_hooks(self, stats: Mapping[str, Any], completed: bool = False) -> None:
        """Each `ReplyHook` on this reply's numbers (`completed`: a stopped reply's, completed since)."""
        for hook in self.hooks:
            try:
                hook(
                    stats,
                    conversation_id=self.conversation_id,
                    message_id=self.message.id,
                    route=self.route,
                    completed=completed,
                )
            except Exception:  # noqa: BLE001 - a hook must not lose the reply
                log.exception("reply hook %r failed", hook)
