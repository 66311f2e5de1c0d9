"""The websocket endpoint: one socket per browser tab, one `Session` per socket.

Shape: the Origin was checked before `accept()` and the access token before that (both by
`webapp.security`); then three kinds of task run side by side — the reader (parses client messages,
dispatches them), the writer (the only one sending on the socket, from an outbox queue) and at most
one turn task (a reply from the engine worker, or a turn another feature answers). Because the
reader never waits for a turn, Stop and dialog answers are handled while tokens stream.

A chat reply goes through the one reply pipeline (`pipeline.ReplyStream`). A message the
`TurnHandler` wants (the agent: slash commands, agent mode) is handed to it with a `SocketTurn`,
which lends it this socket's fragments, dialogs, Stop and the same pipeline.

What it knows: the conversation flow (send, stop, regenerate, switch model, answer) and which
fragments to send. What it does not know: HTML layout (`views.ChatViews`), SQL (`webapp.db`), MLX
(the engine runs on the worker's own thread; this module only submits requests to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.base import Done, GenerationRequest, Message, PrefillProgress, SamplingParams, TextDelta
from engine.worker import Generation

from ..db import UNTITLED, Conversation, Database, StoredMessage, storage_kind
from ..engine_host import EngineState
from ..turns import (
    NEW_MODE_KEY,
    PROJECT_REMOVED,
    DialogAnswer,
    ProjectLookup,
    ReplyHook,
    TurnHandler,
    TurnHandlerFactory,
    for_the_model,
    is_slash_command,
    names_conversation,
)
from . import protocol as p
from .pipeline import ReplyStream
from .transcript import CHAT_MODE_SYSTEM, make_title
from .views import PAGE_WIDE_IDS, PAGE_WIDE_PREFIXES, ChatViews, can_regenerate, meter_numbers

log = logging.getLogger(__name__)
METER_SECONDS = 1.0  # how often the flash engine's live numbers are sent while it works
SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens", "seed", "stop")
TITLE_CHARS = 60
# what a stopped reply takes from the engine's own Done once it comes (the rest stays the stop's)
ENGINE_NUMBERS = (
    "prompt_tokens",
    "cached_tokens",
    "prompt_tps",
    "peak_memory_bytes",
    "peak_rss_bytes",
    "extra",
)


SEND_AGAIN = "send again (what you typed is still in the box)"
# a reply that failed to be stored: its message was (the page cleared the box), so sending again made a copy
REGENERATE = "press Regenerate (your message was saved; its reply could not be)"
CONTINUE_FAILED = "reload the page (the reply keeps the text it had before Continue)"


def explain(exc: BaseException, db_path: Path, then: str = SEND_AGAIN) -> str | None:
    """A storage failure in words that say what to do (None: not one of them); `then`: how to try again."""
    kind = storage_kind(exc)  # SQLite's result code (db.py: the one reading of it)
    if kind == "ioerror":
        return (
            f"flashcode could not read or write its database ({db_path}): a disk I/O error (a failing or "
            "removed disk, or a file beside the database deleted?). Check the disk, then restart flashcode"
        )
    if kind == "full":
        return (
            f"flashcode could not save to its database ({db_path}): the disk is full. Free some space there, "
            f"then {then}"
        )
    if kind == "busy":
        return (
            f"flashcode's database ({db_path}) is held busy by another program (a sqlite3 shell, a backup "
            f"tool?): close it, then {then}"
        )
    if kind == "readonly":
        return f"flashcode's database ({db_path}) cannot be written (a read-only disk or folder): fix that, then restart it"
    if isinstance(exc, OSError) and exc.errno == 28:
        return f"the disk is full: free some space, then {then}"
    return None


@dataclass
class ChatContext:
    """What every socket of one app shares (built by `create_app`)."""

    db: Database
    engine: EngineState
    views: ChatViews
    sampling: dict[str, Any]
    hooks: list[ReplyHook] = field(default_factory=list)
    turns: TurnHandlerFactory | None = None
    sessions: set[Session] = field(default_factory=set)  # open sockets: all follow the one engine
    projects: ProjectLookup | None = None  # new conversations go to the open project
    # before a reply is generated for a conversation: e.g. resume its saved KV cache; a note to show
    before_reply: Callable[[str], Awaitable[str | None]] | None = None
    # before a turn another feature answers uses the engine (the agent's router scores on llama-server's slot
    # before any generation is submitted): e.g. save the live conversation's cache first
    before_turn: Callable[[], None] | None = None
    # files attached to the next message of a project: (them quoted as untrusted data, the fragment that
    # empties the attachment bar, their (name, size in bytes) pairs)
    take_attachments: Callable[[str], tuple[str, str, list[tuple[str, int]]]] | None = None

    def __post_init__(self) -> None:
        self.engine.listeners.append(self.engine_changed)  # the menu or a /v1 request switched the model
        self.views.writing = self.writing  # a window drawn while another writes says so, not Ready
        self.views.busy = lambda: any(s.generating for s in self.sessions)  # the engine meter: idle or not

    def writing(self, conversation_id: str) -> bool:
        """Whether a window is writing a reply (or running an agent turn) in `conversation_id`."""
        return any(s.generating and s.writing_in == conversation_id for s in self.sessions)

    def windows(self) -> list[Session]:
        """The sockets open now (not the replies left writing by a window that closed)."""
        return [s for s in self.sessions if not s.left]

    def engine_changed(self) -> None:
        """Every window names the engine that now answers, and shows its meter row (idle) or none."""
        for session in self.windows():
            frames = [session.views.engine_state()]
            if not session.generating:  # a window writing a reply has its meter from the reply
                frames.append(session.views.engine_meter(session.views.idle_meter()))
            session.send(*frames)

    def conversation_changed(self, conversation_id: str, source: Session | None = None) -> None:
        """A message was sent or a reply ended in `conversation_id`: every other window is told (one showing
        that conversation draws it again, keeping what is typed; the others their conversation list)."""
        frame = self.views.conversation_changed(conversation_id)
        for session in self.windows():
            if session is not source:
                session.send(frame)

    def writer_of(self, conversation_id: str, source: Session) -> Session | None:
        """Another window writing a reply (or running an agent turn) in `conversation_id`, if one is."""
        return next(
            (
                s
                for s in self.sessions
                if s is not source and s.generating and s.writing_in == conversation_id
            ),
            None,
        )

    def stop_left(self, conversation_id: str) -> None:
        """`conversation_id` went to the Trash (or was deleted): a reply left writing there by a window that
        closed is stopped — no window can show it now, so none could stop it."""
        for s in list(self.sessions):
            if s.left and s.left_in == conversation_id:
                s.stop()

    async def close_left(self) -> None:
        """The server stops: the replies left writing by closed windows are stopped and saved as they are."""
        await asyncio.gather(*(s._stop_turn() for s in list(self.sessions) if s.left), return_exceptions=True)

    def hand_on(self, left: Session, but: Session) -> None:
        """The window showing `left`'s reply (`but`) closed: another one showing that conversation takes it."""
        for w in self.windows():
            if (
                w is not but
                and not w.closing
                and w.shown == left.left_in
                and not w.generating
                and w.adopt(left)
            ):
                return

    def left_writing(self, conversation_id: str) -> Session | None:
        """The session of a window that closed (a reload, a closed tab) while it wrote a reply in
        `conversation_id`, if that reply is still being written."""
        return next(
            (s for s in self.sessions if s.left and s.generating and s.writing_in == conversation_id), None
        )

    async def endpoint(self, ws: WebSocket) -> None:
        await ws.accept()
        await Session(ws, self).run()


_TOP_ID = re.compile(r'\s*<\w+[^>]*?\bid="([^"]+)"')  # a fragment's top element's id


def _status_of(fragment: str) -> str | None:
    """A status line fragment's state ("idle" or "generating"); None for any other fragment."""
    found = _TOP_ID.match(fragment)
    if found is None or found.group(1) != "status":
        return None
    return "idle" if 'data-state="idle"' in fragment else "generating"


def page_wide(fragment: str) -> bool:
    """Whether a fragment belongs to the page (the status line, the list, alerts), not to one conversation."""
    found = _TOP_ID.match(fragment)
    return found is not None and (
        found.group(1) in PAGE_WIDE_IDS or found.group(1).startswith(PAGE_WIDE_PREFIXES)
    )


_MARK_SAFE = re.compile(r"[^0-9A-Za-z_-]")  # what a frame's mark may hold (ids and page marks are hex)


def for_conversation(conversation_id: str, draft: str | None = None) -> str:
    """The mark that starts a frame of one conversation's fragments (static/app.js drops such a frame where the
    page shows another conversation). `draft`: the mark of the page whose message made it (a page that shows no
    conversation takes only the frames of the one it made). Ids and marks are hex; anything else is left out."""
    made = f" new:{_MARK_SAFE.sub('', draft)}" if draft else ""
    return f"<!--for:{_MARK_SAFE.sub('', conversation_id)}{made}-->"


# the status line of a window writing a reply in one conversation while it shows another
ELSEWHERE_WRITING = "Writing a reply in another conversation of this window… Stop stops it."
WAITING = "Waiting for the engine…"


class Session:
    def __init__(self, ws: WebSocket, ctx: ChatContext) -> None:
        self.ws = ws
        self.ctx = ctx
        self.views = ctx.views
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None  # the turn task, when one runs
        self.cancel: Callable[[], None] | None = None
        self.dialogs: dict[str, asyncio.Future[p.Answer]] = {}
        self.turns: TurnHandler | None = ctx.turns() if ctx.turns is not None else None
        self.received = 0.0  # arrival of the message being handled (for server-side TTFT)
        self.closing = False  # the page went away (closed, reloaded)
        self.writing_in: str | None = None  # the conversation of the turn task (other windows wait for it)
        # the conversation the page shows ("showing", and what it sent in); None until it says: every frame goes
        self.shown: str | None = None
        # the reply being written (redrawn when its conversation is shown again)
        self.reply: ReplyStream | None = None
        self.made_from: dict[str, str] = {}  # a conversation a message of this window made -> the page's mark
        # a chat reply outlives its window (a reload, a closed tab): `left` once the socket closed with one
        # being written; `shown_by` the window now showing it (its frames go there, its Stop stops it), and
        # in that window `adopted` the reply's session
        self.chat_reply = False  # the turn is a plain chat reply (an agent's turn stops with its window)
        self.stop_asked = False  # Stop was pressed before the reply was submitted (it waited for the engine)
        self.left = False
        self.left_in: str | None = None  # the conversation of the reply it left writing
        self.shown_by: Session | None = None
        self.wrote_at = -1e9  # when a reply of this window last ended (monotonic)
        self.adopted: Session | None = None
        self._saying: set[asyncio.Task[None]] = set()  # mode changes being said (`_say_mode`)

    # ------------------------------------------------------------------ plumbing
    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        self.ctx.sessions.add(self)
        try:
            await self._read()
        finally:
            self.closing = True  # no reply is handed to this window from now on (`hand_on`, `ended`)
            if (
                self.adopted is not None and self.adopted.shown_by is self
            ):  # another window showing it takes it
                self.adopted.shown_by = None
                self.ctx.hand_on(self.adopted, but=self)
            if (
                self.task is not None
                and not self.task.done()
                and self.chat_reply
                and self.writing_in is not None
                and self.ctx.db.get_conversation(self.writing_in)
                is not None  # not one just moved to the Trash
            ):
                self._leave()  # the reply goes on; the window that opens its conversation next shows it
            else:
                await (
                    self._stop_turn()
                )  # still listed meanwhile: no other window starts a turn here before it ends
                self.ctx.sessions.discard(self)
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
                self.error(explain(exc, self.ctx.db.path) or f"internal error: {type(exc).__name__}: {exc}")

    def send(self, *fragments: str) -> None:
        if self.left:  # the reply's frames go to the window showing its conversation now, if one does
            if self.shown_by is not None and self.left_in is not None:
                self.shown_by.send_for(self.left_in)(*fragments)
            return
        self.outbox.put_nowait("".join(fragments))

    def stop(self) -> None:
        """Stop the turn being written (none: nothing happens); a chat reply still waiting for the engine
        stops as soon as it is submitted."""
        if self.cancel is not None:
            self.cancel()
        elif self.generating and self.chat_reply:
            self.stop_asked = True

    def _leave(self) -> None:
        """The socket closed while this session wrote a chat reply: the reply goes on to its end and is saved
        (a reload or a closed tab stopped it before); still listed, so no window writes in its conversation
        meanwhile, and the next window to show that conversation shows it live, with Stop (`_showing`)."""
        assert self.task is not None
        self.left, self.left_in, self.shown = True, self.writing_in, None
        task = self.task
        task.add_done_callback(lambda _task: self.ctx.sessions.discard(self))
        self.ctx.hand_on(
            self, but=self
        )  # a window waiting in its conversation ("another window") shows it now

    def send_for(self, conversation_id: str) -> Callable[..., None]:
        """`send` for one conversation's turn: while the page shows another one, that conversation's fragments
        (its messages, tokens, gauge, title) are left out, or they landed in the one shown; the page-wide ones
        go, and the idle controls at the turn's end are those of the conversation shown (its Regenerate)."""

        def send(*fragments: str) -> None:
            shown = self.shown
            if shown is None or shown == conversation_id:
                # the page may have gone to another conversation already (drawn over HTTP; its "showing" is
                # still on its way): the conversation's own fragments are marked, and such a page drops them. The
                # page-wide ones follow in a frame of their own, so a turn's last frame is still its status line.
                # A Busy status goes in the conversation's frame too: a page never shows the turn's conversation (a
                # new one's id, the message sent) with the status still Ready, to send its next message into
                own = [f for f in fragments if not page_wide(f)]
                wide = [f for f in fragments if page_wide(f)]
                busy = [f for f in wide if _status_of(f) == "generating"]
                if own:
                    mark = for_conversation(conversation_id, self.made_from.get(conversation_id))
                    self.send(mark, *busy[-1:], *own)
                if wide:
                    self.send(*wide)
                return
            kept = []
            for fragment in fragments:
                if not page_wide(fragment) or _TOP_ID.match(fragment) is None:
                    continue
                state = _status_of(fragment)
                if state == "idle":
                    fragment = self.views.controls(False, can_regenerate(self.ctx.db.messages(shown)))
                elif state is not None:  # still writing, in another conversation: said so
                    fragment = self.views.controls(generating=True, text=ELSEWHERE_WRITING)
                kept.append(fragment)
            if kept:
                self.send(*kept)

        return send

    def error(self, text: str) -> None:
        self.send(self.views.alert(text))

    @property
    def generating(self) -> bool:
        return self.task is not None and not self.task.done()

    # ------------------------------------------------------------------ dispatch
    async def handle(self, msg: p.ClientMessage) -> None:
        if isinstance(msg, p.Stop):
            if self.adopted is not None and self.adopted.shown_by is self and not self.generating:
                self.adopted.stop()  # the reply this window shows, begun in a window that closed
            else:
                self.stop()
        elif isinstance(msg, p.Answer):
            self._answer(msg)
        elif isinstance(msg, p.Showing):
            self._showing(msg)
        elif self.generating:
            self.error("A reply is still being written: press Stop first.")
            if isinstance(msg, p.SwitchModel):  # the picker goes back to the model that is still answering
                self.send(self.views.model_picker())
            elif isinstance(msg, p.SetMode) and msg.conversation_id:  # and the mode to the conversation's
                conv = self.ctx.db.get_conversation(msg.conversation_id)
                if conv is not None:
                    self.send(self.views.mode_picker(conv.mode))
        elif isinstance(msg, (p.Send, p.Regenerate, p.Continue, p.SetMode)) and self._busy_elsewhere(
            msg.conversation_id, kept=isinstance(msg, p.Send)
        ):
            if (
                isinstance(msg, p.SetMode) and msg.conversation_id
            ):  # the picker goes back to the conversation's
                conv = self.ctx.db.get_conversation(msg.conversation_id)
                if conv is not None:
                    self.send(self.views.mode_picker(conv.mode))
            return
        elif isinstance(msg, p.Send):
            self._send(msg)
        elif isinstance(msg, p.Regenerate):
            self._regenerate(msg)
        elif isinstance(msg, p.Continue):
            self._continue(msg)
        elif isinstance(msg, p.SwitchModel):
            await self._switch_model(msg)
        elif isinstance(msg, p.SetMode):
            self._set_mode(msg)

    def _showing(self, msg: p.Showing) -> None:
        """This window shows another conversation now. While it writes a reply, its controls come back as the
        writer's (Stop works), in that conversation (with the reply as written so far: the window was drawn
        from the part last saved) or, said so, in any other it went to meanwhile. A window drawn just before its
        reply ended gets the conversation as it is now."""
        cid = msg.conversation_id
        self.shown = cid or ""  # "": a window that shows no conversation (New) takes none of a reply's own
        adopted, self.adopted = self.adopted, None
        if adopted is not None and adopted.shown_by is self:  # its frames are for its conversation only
            adopted.shown_by = None
            if cid != adopted.left_in:  # another window waiting there shows it now
                self.ctx.hand_on(adopted, but=self)
        left = self.ctx.left_writing(cid) if cid and not self.generating else None
        if left is not None and self.adopt(left):  # a reply begun in a window since closed (a reload)
            return
        if not self.generating:
            # a reply of this window ended just now: the page may have been drawn before its end, or have taken
            # its last page-wide frames (its Regenerate) while going to another conversation: drawn as it is now
            # — or the page was drawn while a window since closed wrote in it, which has ended before this socket
            # opened (a reload while an agent asked: "being written in another window" until a second reload)
            now = time.monotonic()
            if cid and (now - self.wrote_at < 10 or (msg.drawn_elsewhere and not self.ctx.writing(cid))):
                self.send_for(cid)(self.views.sync(cid))
            return
        if cid and cid == self.writing_in:
            self.send_for(cid)(*self.drawn_again(cid))
        else:
            self.send(self.views.controls(generating=True, text=ELSEWHERE_WRITING))

    def adopt(self, left: Session) -> bool:
        """Show `left`'s reply here as it is written, with Stop. False: it has just ended, or another window
        shows it (this one waits, as for any window writing there, until that one closes or goes elsewhere)."""
        cid = left.left_in
        if cid is None or not left.generating or left.writing_in != cid:
            return False
        if left.shown_by is not None and left.shown_by is not self:
            return False
        self.adopted, left.shown_by = left, self
        self.send_for(cid)(*left.drawn_again(cid))
        return True

    def drawn_again(self, conversation_id: str) -> list[str]:
        """This session's reply in `conversation_id` as written so far, with the writer's controls."""
        reply = self.reply
        if reply is not None and reply.conversation_id == conversation_id and (frames := reply.redraw()):
            return frames
        return [self.views.controls(generating=True)]

    def _busy_elsewhere(self, conversation_id: str | None, kept: bool = False) -> bool:
        """Another window is writing in this conversation: nothing changes it from here until it has ended
        (`kept`: a message, which stays in the box)."""
        writer = self.ctx.writer_of(conversation_id, self) if conversation_id else None
        if writer is None:
            return False
        if writer is self.adopted and writer.shown_by is self:
            self.error(
                "A reply is still being written: press Stop first."
                + (" Your message is still in the box." if kept else "")
            )
            return True
        self.error(
            "A reply is being written in this conversation in another window: wait for it to end (this "
            "window shows it then), or press Stop there."
            + (" Your message is still in the box." if kept else "")
        )
        return True

    def _turn_began(self, conversation_id: str, task: asyncio.Task[None]) -> None:
        """The turn task runs: other windows are told now (they show the message sent) and when it ends."""
        self.task, self.writing_in = task, conversation_id
        self.ctx.conversation_changed(conversation_id, self)

        def ended(_task: asyncio.Task[None]) -> None:
            self.wrote_at = time.monotonic()
            self.ctx.conversation_changed(conversation_id, self)
            # the conversation this window shows has a reply left writing by a closed window: shown here now
            if (
                not self.left
                and not self.closing
                and self.shown
                and (left := self.ctx.left_writing(self.shown)) is not None
            ):
                self.adopt(left)

        task.add_done_callback(ended)

    def _new_in(self, shown: str | None) -> str | None:
        """The project a new conversation goes in: the one the page shows (another window, or a command
        line's --project, may have opened another since), else the open one; None (said) when the page's
        was removed meanwhile."""
        projects = self.ctx.projects
        if projects is None:
            return "default"
        if not shown:
            return projects.current().id
        if projects.get(shown) is None:
            self.error(
                "The project this window shows was removed meanwhile: nothing was sent — reload the page "
                "(it opens the current project) or open one with File › Open Project…"
            )
            return None
        return shown

    def _gone(self, conversation_id: str) -> bool:
        """True (and said) when the conversation is in the Trash, no longer exists, or its project was removed
        from the list (its commands would run in the open project's folder): nothing is written into it (a
        send, a regenerate, a continue)."""
        db, projects = self.ctx.db, self.ctx.projects
        conv = db.get_conversation(conversation_id)
        if conv is not None:
            if projects is not None and projects.get(conv.project_id) is None:
                self.error(PROJECT_REMOVED)
                return True
            return False
        if db.get_conversation(conversation_id, trashed=True) is not None:
            self.error("that conversation is in the Trash: put it back (View › Trash) to go on with it")
        else:
            self.error("that conversation no longer exists: start a new one (File › New Conversation)")
        return True

    def _send(self, msg: p.Send) -> None:
        db, views = self.ctx.db, self.views
        if msg.conversation_id and self._gone(msg.conversation_id):
            return
        if msg.conversation_id:  # an Edit… copy's text, put in its box at each drawing until now
            views.drafts.pop(msg.conversation_id, None)
            views.kept.pop(msg.conversation_id, None)
        conv = db.get_conversation(msg.conversation_id) if msg.conversation_id else None
        if conv is not None and msg.seen is not None and self._missed(conv.id, msg.seen):
            return
        created = conv is None
        # a slash command (/model, /stats) names no conversation: the first message for the model does, or
        # a command that asks for work (/shell pytest -q)
        command = self.turns is not None and is_slash_command(msg.text)
        naming = not command or names_conversation(msg.text)
        if conv is None:
            project_id = self._new_in(msg.project_id)
            if project_id is None:
                return
            title = make_title(msg.text, TITLE_CHARS) if naming else UNTITLED
            conv = db.create_conversation(title, *self.ctx.engine.model_and_backend(), project_id=project_id)
        self.shown = conv.id  # the page shows what it sends in (a new conversation once it exists)
        if created and msg.draft:
            self.made_from[conv.id] = msg.draft
        retitled = not created and naming and self._still_untitled(conv)
        if retitled:
            conv.title = make_title(msg.text, TITLE_CHARS)
            db.rename_conversation(conv.id, conv.title)
        if created and msg.mode:
            db.set_mode(conv.id, msg.mode)
        text, shown = msg.text, None
        if self.ctx.take_attachments is not None and not is_slash_command(text):
            quoted, cleared, files = self.ctx.take_attachments(conv.project_id)
            text = quoted + text
            if files:  # the bubble shows what was typed and the files' names; the model reads them quoted
                shown = {
                    "attachments": [{"name": n, "size": size} for n, size in files],
                    "typed_from": len(quoted),
                }
            self.send(cleared)
        user = db.add_message(conv.id, "user", text, stats=shown)
        given = {"max_tokens": msg.max_tokens, "temperature": msg.temperature, "top_p": msg.top_p}
        overrides = {k: v for k, v in given.items() if v is not None}
        first = [views.conversation_field(conv.id), views.chat_title(conv.title)] if created else []
        if retitled:
            first.append(views.chat_title(conv.title))
        if created or retitled:
            first.append(views.conversation_list(conv.id))
        first.append(views.append_message(user))
        completion = self.ctx.engine.is_base_model and not msg.text.lstrip().startswith("/")
        if self.turns is not None and not completion and self.turns.wants(conv.id, msg.text):
            # the frame that names the conversation also says it is busy (a model reply's does too): a page
            # that saw the id with the status still Ready could send its next message before this one was done
            self.send_for(conv.id)(*first, self.views.controls(generating=True))
            sampling = views.sampling(conv.id) | overrides
            # the files attached to it go with it as context (the typed words alone are routed and searched)
            attached = text[: len(text) - len(msg.text)]
            if self.ctx.before_turn is not None and not command:
                self.ctx.before_turn()
            self._turn_began(
                conv.id, asyncio.create_task(self._hand_over(conv.id, msg.text, sampling, attached))
            )
            return
        # the engine starts first; the page is updated while it reads the prompt
        self._start(conv.id, overrides, first=first)

    def _still_untitled(self, conv: Conversation) -> bool:
        """Whether `conv` still has the title it was made with because it began with slash commands only
        (a title given since, by Rename, is kept)."""
        if conv.title != UNTITLED:
            return False
        return all(m.role != "user" or is_slash_command(m.content) for m in self.ctx.db.messages(conv.id))

    def _missed(self, conversation_id: str, seen: int) -> bool:
        """Messages another tab added since this page's newest (`seen`): they are shown here and the message
        is not sent (it was written without them; it stays in the box, to send again). False: none."""
        new = [m for m in self.ctx.db.messages(conversation_id) if m.id > seen and m.status != "streaming"]
        if not new:
            return False
        said = (
            f"This conversation changed in another window: {len(new)} new message{'' if len(new) == 1 else 's'} "
            "now shown (reload for their tool steps). Yours was not sent: it is still in the box, to send if it "
            "still fits."
        )
        # one frame, the alert in it: the page keeps the box's text when a frame that shows a user message
        # also holds an alert (it is not this page's message coming back)
        self.send(*(self.views.append_message(m) for m in new), self.views.alert(said))
        return True

    def _regenerate(self, msg: p.Regenerate) -> None:
        db = self.ctx.db
        self.shown = msg.conversation_id
        if self._gone(msg.conversation_id):
            return
        if msg.seen is not None and self._missed(msg.conversation_id, msg.seen):
            return  # another window added since: the reply this page shows is not the last one any more
        messages = db.messages(msg.conversation_id)
        if messages and messages[-1].role == "user":  # its reply could not be stored (a full disk): write one
            self._start(msg.conversation_id)
            return
        if not messages or messages[-1].role != "assistant":
            self.error("nothing to regenerate: the last message is not a reply")
            return
        if not can_regenerate(messages):  # the button is off then; a page showing another's controls sent it
            self.error(
                "Regenerate rewrites the last chat reply; a command, search or slash-command turn (an agent's "
                "answer) is not redone: send it again"
            )
            return
        # stays until the new reply is stored (the page swaps them when it starts): a failure keeps it
        self._start(msg.conversation_id, replacing=messages[-1])

    def _continue(self, msg: p.Continue) -> None:
        """The reply cut at the token limit goes on: same message, the prompt ends with its text."""
        self.shown = msg.conversation_id
        if self._gone(msg.conversation_id):  # a red-team pass wrote into a trashed conversation this way
            return
        messages = self.ctx.db.messages(msg.conversation_id)
        last = messages[-1] if messages else None
        # a reply cut at the token limit, stopped, or cut short by a server that stopped
        if last is None or last.role != "assistant" or not last.content or last.status == "error":
            self.error("nothing to continue: the last message is not a reply with text")
            return
        if last.stats.get("turn") == "agent":
            self.error("an agent's answer cannot be continued: send a message instead")
            return
        if msg.message_id is not None and msg.message_id != last.id:
            self.error("only the last reply can be continued: send a message instead")
            return
        self._start(msg.conversation_id, continuing=last)

    async def _switch_model(self, msg: p.SwitchModel) -> None:
        views = self.views
        self.send(views.controls(generating=True, text=f"Loading {msg.model}…"))
        try:
            await self.ctx.engine.switch(msg.backend, msg.model)
        except Exception as exc:  # noqa: BLE001 - shown to the user; the engine keeps or restores a model
            self.error(f"could not load {msg.model} on {msg.backend}: {exc}")
        else:
            self.ctx.db.remember_model(self.ctx.engine.backend, self.ctx.engine.model)
        # every window was redrawn by ChatContext.engine_changed
        conv = self.ctx.db.get_conversation(msg.conversation_id) if msg.conversation_id else None
        # the page may show another conversation by now (loading takes seconds): this one's gauge and mode not there
        (self.send_for(conv.id) if conv else self.send)(
            views.controls(generating=False),
            views.gauge_for(msg.conversation_id),
            views.mode_picker(conv.mode if conv else views.new_mode()),
        )  # the meter's row: ChatContext.engine_changed, in every window

    def _set_mode(self, msg: p.SetMode) -> None:
        db = self.ctx.db
        db.set_setting(NEW_MODE_KEY, msg.mode)  # new conversations start in the mode last chosen
        known = bool(msg.conversation_id) and db.get_conversation(msg.conversation_id or "") is not None
        cid = msg.conversation_id if known else None  # None: the next conversation's mode (nothing to log in)
        if cid is not None:
            db.set_mode(cid, msg.mode)
        if msg.mode == "agent" and self.turns is not None:
            said = asyncio.get_running_loop().create_task(self._say_agent_mode(cid))
            self._saying.add(said)  # off this window's message loop: the note may wait for the engine
            said.add_done_callback(self._saying.discard)
        else:  # a new conversation's too (shown, not logged): after an Agent note, Chat says it is over
            self._say_mode(cid, {"type": "mode", "mode": "agent" if msg.mode == "agent" else "raw"})
        self.send(self.views.mode_picker(msg.mode))

    def _say_mode(self, conversation_id: str | None, data: dict[str, Any]) -> None:
        """The transcript says when the mode changed (logged in the conversation; a new one's: shown only)."""
        if conversation_id is not None:
            self.ctx.db.add_event(conversation_id, "mode", data)
        if self.views.render_event is not None:  # in its conversation only (the note may wait for the engine)
            send = self.send_for(conversation_id) if conversation_id is not None else self.send
            send(self.views.render_event("mode", data))

    async def _say_agent_mode(self, conversation_id: str | None) -> None:
        """Agent with a model that takes no tools says so now (and which model would work), not after the first
        message, in a new conversation too. Asking the engine waits for a generation running in another window:
        not this window's other messages."""
        data: dict[str, Any] = {"type": "mode", "mode": "agent"}
        try:
            note, offer = await self.turns.mode_note(conversation_id)  # type: ignore[union-attr]
            data |= {"no_tools": note, "offer": offer}
        except Exception:  # noqa: BLE001 - the mode changed all the same; the first turn says it then
            log.warning("the agent mode's note failed", exc_info=True)
        self._say_mode(conversation_id, data)

    def _answer(self, msg: p.Answer) -> None:
        fut = self.dialogs.pop(msg.dialog_id, None)
        if fut is None or fut.done():
            self.error(f"there is no open dialog {msg.dialog_id!r}")
            return
        fut.set_result(msg)

    async def ask(self, dialog_html: str, dialog_id: str | None = None) -> p.Answer:
        """Show a dialog fragment and wait for the user's `answer` (the agent's approvals)."""
        dialog_id = dialog_id or uuid.uuid4().hex[:12]
        fut: asyncio.Future[p.Answer] = asyncio.get_running_loop().create_future()
        self.dialogs[dialog_id] = fut
        self.send(dialog_html)
        try:
            return await fut
        finally:
            self.dialogs.pop(dialog_id, None)

    # ------------------------------------------------------------------ a turn another feature answers
    async def _hand_over(
        self, conversation_id: str, text: str, sampling: dict[str, Any], attached: str = ""
    ) -> None:
        assert self.turns is not None
        turn = SocketTurn(self, conversation_id, self.received, sampling, attached)
        try:
            await self.turns.run(turn, text)
        finally:
            self.cancel = None
            self.writing_in = None  # before the page says Ready: another window may write here from then on
            conv = self.ctx.db.get_conversation(conversation_id)
            # an agent turn's prompt (its last reply's, or its last tool step's when that came later), 0 after /clear
            used = self.views.context_used(conversation_id)
            send = self.send_for(
                conversation_id
            )  # the page may show another one now (it answered from there)
            send(
                self.views.controls(generating=False, can_regenerate=False),
                self.views.gauge(max(used, turn.context) if used else turn.context),
                self.views.mode_picker(conv.mode if conv else self.views.new_mode()),
            )

    # ------------------------------------------------------------------ a chat reply
    def _start(
        self,
        conversation_id: str,
        sampling: dict[str, Any] | None = None,
        first: list[str] | None = None,
        continuing: StoredMessage | None = None,
        replacing: StoredMessage | None = None,
    ) -> None:
        task = asyncio.create_task(
            self._generate(
                conversation_id,
                self.views.sampling(conversation_id) | (sampling or {}),
                first or [],
                continuing,
                replacing,
            )
        )
        task.add_done_callback(
            functools.partial(self._generation_ended, conversation_id, continuing=continuing is not None)
        )
        self.chat_reply, self.stop_asked = (
            True,
            False,
        )  # from now on (its cache resumed too) it outlives the window
        self._turn_began(conversation_id, task)

    def _generation_ended(
        self, conversation_id: str, task: asyncio.Task[None], continuing: bool = False
    ) -> None:
        if task is self.task:  # not a reply begun since (its callbacks can run after the next is started)
            self.chat_reply = False
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("generation failed", exc_info=exc)
        self.send_for(conversation_id)(self.views.controls(generating=False, can_regenerate=True))
        said = (
            explain(exc, self.ctx.db.path, CONTINUE_FAILED if continuing else REGENERATE)
            if exc is not None
            else None
        )
        self.error(said or f"the reply failed: {type(exc).__name__}: {exc}")

    async def _stop_turn(self) -> None:
        self.closing = True  # the socket closed: what the turn was waiting for, nobody decided
        if self.task is not None and not self.task.done():
            self.stop()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self.task), 5)
            self.task.cancel()

    def reply_stream(
        self,
        conversation_id: str,
        route: str | None = None,
        received: float = 0.0,
        started: float | None = None,
        continuing: StoredMessage | None = None,
        turn: str = "chat",
        replacing: StoredMessage | None = None,
    ) -> ReplyStream:
        """A reply through the one pipeline (the chat's, or one a `TurnHandler` writes)."""
        ctx = self.ctx
        self.reply = ReplyStream(
            db=ctx.db,
            views=self.views,
            engine=ctx.engine,
            hooks=ctx.hooks,
            send=self.send_for(conversation_id),
            conversation_id=conversation_id,
            route=route,
            received=received or None,
            started=started,
            continuing=continuing,
            turn=turn,
            replacing=replacing,
        )
        return self.reply

    async def _generate(
        self,
        conversation_id: str,
        sampling: dict[str, Any],
        first: list[str],
        continuing: StoredMessage | None = None,
        replacing: StoredMessage | None = None,
    ) -> None:
        views, engine = self.views, self.ctx.engine
        if self.ctx.before_reply is not None:  # e.g. resume the conversation's saved KV cache
            # it waits for the engine (a reply in another conversation may hold it): the page says so, and a
            # Stop meanwhile is kept for when the reply is submitted (a resume is not cut midway)
            self.send_for(conversation_id)(*first, views.controls(generating=True, text=WAITING))
            first = []
            if note := await self.ctx.before_reply(conversation_id):
                self.send(views.alert(note, "note"))
        # a reply to continue is its last message; one being regenerated is not in it
        history = self._history(conversation_id, None if replacing is None else replacing.id)
        request = self._request(history, sampling, continuing is not None)
        submitted = time.monotonic()
        gen = engine.worker.submit(request, loop=asyncio.get_running_loop())
        self.cancel = gen.cancel
        if self.stop_asked:  # Stop was pressed while it waited
            gen.cancel()
        stream = self.reply_stream(
            conversation_id,
            received=self.received,
            started=submitted,
            continuing=continuing,
            replacing=replacing,
        )
        self.send_for(conversation_id)(  # the window may show another conversation by now (it waited)
            *first,
            *stream.opening(),
            views.controls(generating=True),
            views.conversation_list(conversation_id),
        )
        done: Done | None = None
        meter = asyncio.create_task(self._meter(stream))
        try:
            async for event in gen:
                if isinstance(event, TextDelta):
                    stream.add(event.text, event.count)
                elif isinstance(event, PrefillProgress):
                    stream.progress(event.processed, event.total)
                elif isinstance(event, Done):
                    done = event
        finally:
            meter.cancel()
            self.cancel = None
            if done is None:  # the task was cancelled (the server stopping): keep what streamed
                gen.cancel()
                stream.abandon()
        # the meter is of the reply being written: idle once it is done (its footer keeps the reply's numbers)
        if (idle := self.views.idle_meter(idle=True)) is not None:  # None: an engine with no meter
            self.send(self.views.engine_meter(idle))
        self._finish(stream, done, history, gen)

    def _history(self, conversation_id: str, without: int | None = None) -> list[Message]:
        """The model's context: a chat-mode system prompt (no tools; the conversation's own system prompt
        after it), then the messages since the latest /clear (but message `without`: a reply regenerated)."""
        db = self.ctx.db
        start = db.context_start(conversation_id)
        own = self.views.generation(conversation_id)["system"]
        system = "\n\n".join(s for s in (CHAT_MODE_SYSTEM, own) if s)
        return [{"role": "system", "content": system}] + [
            {"role": m.role, "content": m.content}
            for m in db.messages(conversation_id)
            if m.role in ("user", "assistant", "system")
            and m.content
            and m.id > start
            and m.id != without
            and (
                m.role != "user" or for_the_model(m.content)
            )  # not /model, /help, /stats: the transcript's only
        ]

    def _request(
        self, history: list[Message], sampling: dict[str, Any], continuing: bool = False
    ) -> GenerationRequest:
        """`continuing`: the history ends with the reply cut at the token limit, which goes on."""
        params = SamplingParams(**{k: v for k, v in sampling.items() if k in SAMPLING_FIELDS})
        if self.ctx.engine.is_base_model:  # completion mode: the model continues the user's text
            last = next((m["content"] for m in reversed(history) if m["role"] == "user"), "")
            so_far = history[-1]["content"] if continuing else ""
            return GenerationRequest(prompt=last + so_far, sampling=params, progress=True)
        return GenerationRequest(
            messages=tuple(history), sampling=params, progress=True, continue_final=continuing
        )

    async def _meter(self, stream: ReplyStream) -> None:
        """While a reply is written, send the engine's live numbers (flash: disk rate, MB per token, expert
        hits, memory) every METER_SECONDS — through prefill too, when no token arrives for a long time.
        `live_stats()` reads counters only (no MLX), so it is safe off the worker's thread."""
        live = getattr(self.ctx.engine.worker.backend, "live_stats", None)
        if live is None:
            return
        first = live()
        start = first.get("bytes_read", 0)
        self.send(self.views.engine_meter(meter_numbers(first)))  # at once: the row no longer says idle
        while True:
            await asyncio.sleep(METER_SECONDS)
            try:
                now = live()
            except Exception:  # noqa: BLE001 - a meter must never break a reply (e.g. the model was closed)
                return
            read = now.get("bytes_read", 0) - start
            per_token = read / stream.tokens / 1e6 if stream.tokens else None
            self.send(self.views.engine_meter(meter_numbers(now, per_token)))

    def _finish(self, stream: ReplyStream, done: Done, history: list[Message], gen: Generation) -> None:
        views = self.views
        # from the page's Ready on, another window may write here (the task itself ends just after)
        self.writing_in = None
        then = [views.controls(generating=False, can_regenerate=True)]
        used = done.stats.prompt_tokens + done.stats.completion_tokens
        if done.stats.prompt_tokens:
            then.append(views.gauge(used))
        ctx = self.ctx.engine.context_length
        if done.finish_reason == "length" and ctx and used >= ctx:  # the context, not the token limit
            done.stats.extra["context_full"] = ctx  # Continue cannot help: the footer says what can
        final = stream.finish(done.text, done.finish_reason, done.stats.to_dict(), done.error, then=then)
        if final is not None and final.status == "stopped":  # a stop answers before the engine's numbers
            asyncio.get_running_loop().create_task(self._complete_stopped(stream, final, history, gen))
        if done.error:
            self.error(done.error)

    async def _complete_stopped(
        self, stream: ReplyStream, reply: StoredMessage, history: list[Message], gen: Generation
    ) -> None:
        """A stopped reply gets the engine's own numbers once its generation has ended (a job queued after it
        has run): prompt and cache counts, memory, the engine's extras (flash: disk, hit rate, budget). The
        text, its token count and the rates measured here stay the stop's. The prompt is counted here if
        the engine stopped before it had."""
        worker, db = self.ctx.engine.worker, self.ctx.db
        try:
            await worker.acall(lambda b: None)  # runs once the stopped generation's job has ended
            own = gen.engine_done.stats.to_dict() if gen.engine_done is not None else {}
            stats = dict(reply.stats) | {k: own[k] for k in ENGINE_NUMBERS if own.get(k)}
            if not stats.get("prompt_tokens"):
                stats["prompt_tokens"] = await worker.acall(lambda b: len(b.apply_chat_template(history)))
        except Exception:  # noqa: BLE001 - the footer is a nicety; the reply is stored already
            return
        now = next((m for m in db.messages(reply.conversation_id) if m.id == reply.id), None)
        if stats == reply.stats or now is None or (now.status, now.content) != ("stopped", reply.content):
            # nothing new, the reply gone meanwhile (regenerated, deleted), or Continue reopened it (then its row
            # streams again: these numbers would end it as stopped, and its old text over the new)
            return
        db.finish_message(reply.id, reply.content, reply.status, stats)
        stream.run_hooks(stats, completed=True)  # Stats counts its prompt too
        frames = [self.views.replace_message(dataclasses.replace(reply, stats=stats))]
        if stats.get("prompt_tokens"):
            frames.append(self.views.gauge(stats["prompt_tokens"] + int(stats.get("completion_tokens") or 0)))
        self.send_for(reply.conversation_id)(*frames)  # not into another conversation the page shows now


class SocketTurn:
    """The `webapp.turns.Turn` a socket lends a `TurnHandler` for one message."""

    def __init__(
        self,
        session: Session,
        conversation_id: str,
        received: float,
        sampling: dict[str, Any] | None = None,
        attached: str = "",
    ) -> None:
        self.session, self._conversation_id, self.received = session, conversation_id, received
        self._sampling = dict(sampling or {})
        self._attached = attached
        self.context = 0  # the gauge's last mid-turn reading (tool-loop steps)

    @property
    def conversation_id(self) -> str:
        return self._conversation_id

    @property
    def sampling(self) -> dict[str, Any]:
        return self._sampling

    @property
    def attached(self) -> str:
        return self._attached

    def send(self, *fragments: str) -> None:
        # not into another conversation the page shows
        self.session.send_for(self.conversation_id)(*fragments)

    def error(self, text: str) -> None:
        self.session.error(text)

    async def ask(self, dialog_html: str, dialog_id: str) -> DialogAnswer:
        return await self.session.ask(dialog_html, dialog_id)

    def on_stop(self, stop: Callable[[], None] | None) -> None:
        self.session.cancel = stop

    @property
    def closing(self) -> bool:
        return self.session.closing

    def start_reply(self, route: str | None = None) -> ReplyStream:
        stream = self.session.reply_stream(self.conversation_id, route, received=self.received, turn="agent")
        self.send(self.session.views.append_message(stream.message))
        return stream

    def model_changed(self) -> None:
        self.send(self.session.views.model_picker())

    def context_used(self, tokens: int) -> None:
        self.context = tokens
        self.send(self.session.views.gauge(tokens))

    def status(self, text: str | None) -> None:
        self.send(self.session.views.controls(generating=True, text=text))

    def count(self, stats: Mapping[str, Any], route: str | None = None) -> None:
        model, backend = self.session.ctx.engine.model_and_backend()
        numbers = dict(stats) | {"model": model, "backend": backend, "turn": "agent"}
        for hook in self.session.ctx.hooks:
            try:
                hook(numbers, conversation_id=self.conversation_id, message_id=None, route=route)
            except Exception:  # noqa: BLE001 - a hook must not break the turn
                log.exception("reply hook %r failed", hook)
