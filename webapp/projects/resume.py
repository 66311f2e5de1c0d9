"""Conversations resume by themselves: each conversation's KV cache is saved to disk, and reopening
the conversation continues from it instead of re-reading (prefilling) the whole conversation.

The engine holds one live cache: the last conversation it answered. That cache is saved as the engine
holds it (MLX: float32 on a CPU, float16 on a GPU, so a resumed reply is the live one's; llama-server's
slot as its cache type keeps it) under the conversation's project

    $FLASHCODE_HOME/projects/<project_id>/autosave/<context_id>/   (engine.sessions' layout)
        conversation.json   the conversation id, how many messages the cache holds and their digest

- when it has been idle `idle_s` seconds (3 minutes by default),
- when another conversation is about to replace it (the user switched conversation), when another
  generation takes the engine (an agent step, an API request: `generating`), and when the user opens
  another project,
- at shutdown.

On a switch the reply waits only for a copy of the cache (MLX: `snapshot_prompt_cache`, ~1 ms; up to
`DEFER_MAX_BYTES`): the file is written by a job queued on the worker behind the new reply, so its
first token does not wait for the disk (the write took ~20-30 ms of every switch's TTFT). Resuming that
conversation, opening another project and shutting down wait for such a write first (`flush`).
llama-server's slot is saved before the reply, as its next request overwrites it.

Before a conversation's reply, if the engine's live cache is another conversation's, the saved
cache of this one is resumed (`engine.sessions.try_resume`): the reply then prefills only the new
message. A saved cache is never trusted blindly: another model or engine, a damaged file (checked by
`engine.sessions`), or a conversation changed since the save (a reply regenerated or deleted: the
digest of its first messages differs) is ignored with a note, and the reply re-reads the
conversation. Each project's automatic saves stay within a disk quota (`quota_bytes`, 2 GiB by
default, `FLASHCODE_AUTOSAVE_QUOTA_MB`): the least recently used are deleted to make room. Named
saves (the Projects window) are a separate list with their own quota.

What it knows: when to save and resume, and the conversation check. What it does not know: HTTP,
the page; the file format (`engine.sessions`). Saves and resumes run on the engine's worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import paths
from engine.base import EngineError, PromptCacheBackend
from engine.sessions import (
    ContextNameError,
    ContextNotFoundError,
    ContextStore,
    QuotaExceededError,
    SavedContext,
    check_id,
    try_resume,
)
from engine.worker import Worker

from ..db import Database

log = logging.getLogger(__name__)
IDLE_S = 180.0
# a cache copied out on a switch is held in memory until its file is written behind the reply: above this,
# the reply waits for the save instead (no second copy of a long conversation's cache in memory)
DEFER_MAX_BYTES = 256 << 20
SUBMIT_WAIT_S = 5.0  # a save written behind a reply waits this long at most for that reply to be queued
# the cache as the engine holds it (float32 on a CPU, float16 on a GPU): a resumed conversation goes on exactly as
# the live one would. 8-bit KV is near-lossless on short contexts only: in bench/results/resume.json a
# 4,096-token conversation's reply resumed from 8 bits left the live one's at its 10th token
KV_BITS: int | None = None
SIDECAR = "conversation.json"


def autosave_quota() -> int:
    mb = paths.env_number("FLASHCODE_AUTOSAVE_QUOTA_MB", -1)
    return int(mb * 2**20) if mb >= 0 else 2 << 30


class AutoSaveStore(ContextStore):
    """`ContextStore` with the automatic saves in `projects/<id>/autosave/` instead of `contexts/`."""

    def contexts_dir(self, project_id: str, create: bool = False) -> Path:
        d = self.root / check_id(project_id) / "autosave"
        if create:
            d.mkdir(parents=True, exist_ok=True)
        if d.exists() and d.resolve() != self.root.resolve() / project_id / "autosave":
            raise ContextNameError(f"{d} leads outside project {project_id}'s folder: refused")
        return d


def digest(messages: Sequence[Mapping[str, Any]]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(json.dumps([m.get("role"), m.get("content")], ensure_ascii=False).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Saved:
    context: SavedContext
    messages: int  # how many of the conversation's messages the cache held
    digest: str
    used: float  # last save or resume (least recently used goes first)


class AutoResume:
    """One app's automatic saves. `note_reply` is a `webapp.turns.ReplyHook`; `before_reply` runs
    before each chat reply; `save_now` on a switch and at shutdown."""

    def __init__(
        self,
        data_dir: Path,
        worker: Worker,
        db: Database,
        idle_s: float = IDLE_S,
        quota_bytes: int | None = None,
        kv_bits: int | None = KV_BITS,
    ) -> None:
        self.store = AutoSaveStore(data_dir, quota_bytes if quota_bytes is not None else autosave_quota())
        self.worker, self.db, self.idle_s, self.kv_bits = worker, db, idle_s, kv_bits
        self.live: str | None = None  # the conversation the engine's cache holds
        self.dirty = False  # the live cache changed since it was last saved
        self.lock = asyncio.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self.on_event: Callable[[str, str], None] | None = None  # (kind, conversation_id): tests, logs
        self._writing: dict[str, asyncio.Task[None]] = {}  # conversation -> its save written behind a reply
        self._queued: asyncio.Event | None = None  # a generation was submitted since the last copy was taken
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it belongs to
        self._submitted = 0  # generations submitted (`generating`)
        # conversation -> `_submitted` when its chat reply was submitted
        self._reply_from: dict[str, int] = {}

    # ------------------------------------------------------------------ what the chat calls
    def note_reply(
        self,
        stats: Mapping[str, Any],
        *,
        conversation_id: str,
        message_id: int | None,
        route: str | None = None,
        completed: bool = False,
    ) -> None:
        """After every stored reply: a chat reply leaves its conversation in the live cache; an agent
        turn leaves its own prompts there (not the conversation's), so nothing to save then. A stopped
        reply's numbers completed later (`completed`), and a generation that wrote no reply, say nothing
        new about the cache."""
        if completed or message_id is None:  # no reply stored (an agent step that only called tools)
            return
        start = self._reply_from.pop(conversation_id, None)
        if route is None and (start is None or self._submitted <= start + 1):
            self.live, self.dirty = conversation_id, True
        # else another generation (an API request, another window's reply or agent step) was submitted after
        # this reply's: the cache ends as its prompt, not this conversation (`generating` cleared `live`)
        # an agent turn: a generation it ran already took the cache from its conversation (`generating`); one
        # that ran none (a denied /shell) left the cache as it was, still the conversation's before
        self._arm_idle()

    async def before_reply(self, conversation_id: str) -> str | None:
        """Make the conversation's saved cache the live one, if it is not already; a note when a
        saved cache was found but could not be used."""
        try:
            return await self._before_reply(conversation_id)
        finally:  # the reply is submitted next, with no await between: generations counted after it are others'
            self._reply_from[conversation_id] = self._submitted

    async def make_live(self, conversation_id: str) -> str | None:
        """Make the conversation's automatic save the live cache (Save in Saved Contexts, for a conversation
        just opened), as `before_reply` does, with no reply to follow."""
        return await self._before_reply(conversation_id)

    async def _before_reply(self, conversation_id: str) -> str | None:
        async with self.lock:
            if self.live == conversation_id:
                return None
            notes = []
            try:
                await self._save_live_behind()
            except Exception as exc:  # noqa: BLE001 - a failed save (a full disk) costs that save, never this reply
                log.warning("automatic save before a reply failed", exc_info=True)
                notes.append(f"The cache of the conversation before could not be saved ({_why(exc)}).")
            self.live, self.dirty = None, False
            try:
                note = await self._resume(conversation_id)
            except Exception as exc:  # noqa: BLE001 - a resume that failed costs a re-read, never the reply
                log.warning("automatic resume before a reply failed", exc_info=True)
                self.live, self.dirty = None, False
                note = f"The saved cache of this conversation could not be used ({_why(exc)}): this reply re-reads it."
            return " ".join([*notes, note] if note else notes) or None

    def generating(self, _request: Any = None) -> None:
        """A generation is being queued (a chat reply, an agent step, an API request, a benchmark): until its
        reply is noted (`note_reply`), the engine's cache is no conversation's to save or resume. A save
        waiting to be written behind that reply is queued now (`_write_behind`). A live conversation not saved
        yet (a chat reply's, before an agent step or an API request takes the engine) is saved first: a job
        queued ahead of the generation copies its cache (or, where no copy can be taken, saves it)."""
        cid, dirty = self.live, self.dirty
        self.live, self.dirty = None, False
        self._submitted += 1
        if self._writing and self._loop is not None and self._queued is not None:  # the submitter: any thread
            with contextlib.suppress(RuntimeError):  # that loop is closed (its saves went with it)
                self._loop.call_soon_threadsafe(self._queued.set)
        if cid is not None and dirty:
            self._save_before_taken(cid)

    def _save_before_taken(self, cid: str) -> None:
        """`generating`'s save of the live conversation `cid`: its job is queued before the generation's."""
        try:
            loop = asyncio.get_running_loop()  # the app's: its database connection and tasks live there
        except RuntimeError:
            log.info(
                "conversation %s's cache taken by a generation submitted off the event loop: not saved", cid
            )
            return
        conv = self.db.get_conversation(cid)
        if conv is None:
            return
        project, history = conv.project_id, self._history(cid)

        def copy_or_save(backend: Any) -> Any:
            snapshot = self._snapshot(backend)
            if snapshot is None:
                self._save(backend, project, cid, history)  # no copy: saved now, before the generation
            return snapshot

        self._track(
            cid, loop.create_task(self._finish_taken(self.worker.queue(copy_or_save), project, cid, history))
        )

    def _track(self, cid: str, task: asyncio.Task[None]) -> None:
        """`task` writes conversation `cid`'s save: `flush` and a resume of `cid` wait for it."""
        self._writing[cid] = task
        task.add_done_callback(
            lambda t: self._writing.pop(cid, None) if self._writing.get(cid) is t else None
        )

    async def _finish_taken(self, job: Any, project: str, cid: str, history: list[dict[str, str]]) -> None:
        """The copy of `cid`'s cache taken ahead of the generation is written behind it (the generation was
        queued before this task runs); a cache that could not be copied was saved by the job itself."""
        ok, snapshot = await self._logged(cid, asyncio.wrap_future(job))
        if not ok:
            return
        if snapshot is None:
            self._event("saved", cid)
            return
        await self._write_behind(project, cid, history, snapshot, queued=True)

    def took_over(self, conversation_id: str | None) -> None:
        """A saved context (the Projects window's Resume) replaced the engine's cache: it now holds this
        conversation (None: a context saved without one), unchanged since its save."""
        self.live, self.dirty = conversation_id, False

    async def save_now(self) -> None:
        """Save the live conversation's cache if it changed (a switch of project, shutdown); saves still
        being written behind a reply are waited for first."""
        await self.flush()
        async with self.lock:
            await self._save_live()

    async def flush(self) -> None:
        """Wait for every save being written behind a reply (`_save_live_behind`)."""
        while self._writing:
            self._release()
            # wait, not gather: a cancelled waiter (a closed page's reply) must not cancel the saves
            await asyncio.wait(set(self._writing.values()))

    def _release(self) -> None:
        """The saves waiting for a reply to be queued (`_write_behind`) go now: nothing will queue one first."""
        if self._queued is not None:
            self._queued.set()

    # ------------------------------------------------------------------ saving
    def _arm_idle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(self.idle_s, lambda: loop.create_task(self.save_now()))

    def _history(self, conversation_id: str) -> list[dict[str, str]]:
        return [
            {"role": m.role, "content": m.content}
            for m in self.db.messages(conversation_id)
            if m.role in ("user", "assistant", "system") and m.content
        ]

    async def _save_live(self) -> None:
        cid = self.live
        if cid is None or not self.dirty:
            return
        conv = self.db.get_conversation(cid)
        if conv is None:
            self.dirty = False
            return
        history = self._history(cid)
        project = conv.project_id
        ok, _ = await self._logged(cid, self.worker.acall(lambda b: self._save(b, project, cid, history)))
        if ok:
            self.dirty = False
            self._event("saved", cid)

    async def _logged(self, cid: str, work: Awaitable[Any]) -> tuple[bool, Any]:
        """Await a save of conversation `cid` (or its copy): (done, its result). A failure is logged, never
        raised: a failed save must never cost a conversation or a reply."""
        try:
            return True, await work
        except EngineError as exc:  # nothing to save, no room even after eviction, the engine switched
            log.info("automatic save of conversation %s skipped: %s", cid, exc)
        except Exception:  # noqa: BLE001 - the next reply re-reads the conversation, that is all
            log.exception("automatic save of conversation %s failed", cid)
        return False, None

    async def _save_live_behind(self) -> None:
        """Before another conversation's reply: copy the live cache out and write it behind that reply (the
        job is queued once the reply is submitted: `generating`); where
        no copy can be taken (llama-server, a cache above `DEFER_MAX_BYTES`), save it now."""
        cid = self.live
        if cid is None or not self.dirty:
            return
        conv = self.db.get_conversation(cid)
        snapshot = None
        if conv is not None:
            try:
                snapshot = await self.worker.acall(self._snapshot)
            except Exception:  # noqa: BLE001 - no copy (no engine, out of memory): the save now says why
                log.info("copying the cache of conversation %s failed: saving it now", cid, exc_info=True)
        if conv is None or snapshot is None:
            await self._save_live()
            return
        history, project = self._history(cid), conv.project_id
        self.dirty = False
        loop = asyncio.get_running_loop()
        if self._queued is None or self._loop is not loop:
            self._loop, self._queued = loop, asyncio.Event()
        self._queued.clear()
        self._track(cid, asyncio.create_task(self._write_behind(project, cid, history, snapshot)))

    def _snapshot(self, backend: Any) -> Any:
        """On the worker thread: a copy of the live cache (MLX), or None to save it at once instead."""
        take = getattr(backend, "snapshot_prompt_cache", None)
        if take is None or not isinstance(backend, PromptCacheBackend) or backend.model is None:
            return None
        try:
            snapshot = take(self.kv_bits)
        except EngineError:
            return None  # nothing to save: the save now says why in the log
        return snapshot if snapshot.detached and snapshot.nbytes <= DEFER_MAX_BYTES else None

    async def _write_behind(
        self, project: str, cid: str, history: list[dict[str, str]], snapshot: Any, queued: bool = False
    ) -> None:
        # the job goes in behind the reply this switch is for (a resume of that conversation's own save is a
        # worker job queued before the reply: it must not wait for this write either); `queued`: it is already
        if self._queued is not None and not queued:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queued.wait(), SUBMIT_WAIT_S)
        # deleted for good, or its project removed, meanwhile (one in the Trash keeps its save: Put Back resumes
        # it); a removal waits for this task (`flush`), so the job queued next cannot land after it
        conv = self.db.get_conversation(cid, trashed=True)
        if conv is None or conv.project_id != project:
            log.info(
                "conversation %s went from project %s before its save was written: not saved", cid, project
            )
            return
        ok, _ = await self._logged(
            cid, self.worker.acall(lambda b: self._save(b, project, cid, history, snapshot))
        )
        if ok:
            self._event("saved", cid)

    def _save(
        self, backend: Any, project: str, cid: str, history: list[dict[str, str]], snapshot: Any = None
    ) -> None:
        """On the worker thread: save the live cache (or `snapshot`, a copy of it taken before), replacing the
        conversation's previous save, evicting the project's least recently used saves while the quota is
        short."""
        if not isinstance(backend, PromptCacheBackend) or backend.model is None:
            return
        kv_bits = self.kv_bits if getattr(backend, "name", "") != "llama" else None
        if snapshot is not None and (
            getattr(backend, "snapshot_prompt_cache", None) is None or backend.model.name != snapshot.model
        ):  # the engine or its model changed since the copy: checked before the previous save goes
            raise EngineError(f"the engine changed since the cache of {snapshot.model} was copied: not saved")
        previous = [s for s in self.saved(project) if s.context.conversation_id == cid]
        for s in previous:  # make room first: the new save replaces it
            self._drop(project, s.context.id)
        while True:
            try:
                ctx = self.store.save(
                    backend, project, f"auto {cid}", kv_bits=kv_bits, conversation_id=cid, snapshot=snapshot
                )
                break
            except QuotaExceededError as exc:
                victims = self.saved(project)
                if not victims or exc.adding > exc.quota:  # larger than the whole quota: no room to make
                    raise
                if self._drop(project, victims[-1].context.id):
                    self._event("evicted", victims[-1].context.conversation_id or "")
        folder = self.store.context_dir(project, ctx.id)
        (folder / SIDECAR).write_text(
            json.dumps({"conversation_id": cid, "messages": len(history), "digest": digest(history)})
        )

    def _drop(self, project: str, context_id: str) -> bool:
        """Delete a save; one already gone (the event loop drops a stale save while this thread saves) is
        fine: False."""
        try:
            self.store.delete(project, context_id)
        except ContextNotFoundError:
            return False
        return True

    def saved(self, project: str) -> list[Saved]:
        """The project's automatic saves, most recently used first."""
        out = []
        for ctx in self.store.list(project):
            side = self.store.contexts_dir(project) / ctx.id / SIDECAR
            try:
                data = json.loads(side.read_text())
                out.append(Saved(ctx, int(data["messages"]), str(data["digest"]), side.stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError):
                out.append(Saved(ctx, -1, "", 0.0))  # unreadable: first to go
        return sorted(out, key=lambda s: s.used, reverse=True)

    # ------------------------------------------------------------------ resuming
    async def _resume(self, cid: str) -> str | None:
        if (writing := self._writing.get(cid)) is not None:  # its save is still being written: wait for it
            self._release()  # the reply it was waiting for is queued, or will not be
            await asyncio.wait({writing})
        conv = self.db.get_conversation(cid)
        if conv is None:
            return None
        project = conv.project_id
        found = next((s for s in self.saved(project) if s.context.conversation_id == cid), None)
        if found is None:
            return None
        history = self._history(cid)
        if found.messages < 0 or digest(history[: found.messages]) != found.digest:
            self._drop(project, found.context.id)
            self._event("mismatch", cid)
            return (
                "The saved cache of this conversation no longer matches it (it changed since it was "
                "saved): it was ignored, and this reply re-reads the conversation."
            )
        res = await self.worker.acall(lambda b: try_resume(self.store, b, project, found.context.id))
        if not res.resumed:
            self._event("mismatch", cid)
            return f"The saved cache of this conversation was ignored: {res.message}"
        # evicted meanwhile by a save on the worker: it was loaded all the same
        with contextlib.suppress(OSError):
            os.utime(self.store.contexts_dir(project) / found.context.id / SIDECAR)
        self.live, self.dirty = cid, False
        self._event("resumed", cid)
        return None

    async def forget_deleted(self) -> int:
        """Delete the automatic saves of conversations deleted for good (Delete Now, Empty Trash, the 30-day
        rule): a saved cache holds the conversation's tokens, and nothing could resume it any more. A
        conversation in the Trash keeps its save (Put Back resumes it). How many were deleted."""
        async with self.lock:  # no save is started while it is held (before_reply holds it)
            await self.flush()  # a save still being written would land after the sweep
            gone = 0
            root = self.store.root
            for folder in sorted(root.iterdir()) if root.is_dir() else ():
                if not (folder / "autosave").is_dir():
                    continue
                try:
                    saves = self.saved(folder.name)
                except (OSError, ValueError, EngineError):  # a folder that is no project's (a.bak: check_id)
                    continue
                for s in saves:
                    cid = s.context.conversation_id
                    if not cid or self.db.get_conversation(cid, trashed=True) is not None:
                        continue
                    try:
                        self.store.delete(folder.name, s.context.id)
                    except (
                        OSError,
                        EngineError,
                    ):  # gone meanwhile, or not removable: the next sweep tries again
                        log.warning(
                            "removing the saved cache of deleted conversation %s failed", cid, exc_info=True
                        )
                        continue
                    self._event("forgotten", cid)
                    gone += 1
                    if self.live == cid:
                        self.live, self.dirty = None, False
            return gone

    def _event(self, kind: str, cid: str) -> None:
        log.debug("autosave %s %s at %.0f", kind, cid, time.time())
        if self.on_event is not None:
            self.on_event(kind, cid)


def _why(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
