"""The chat's HTTP handlers: the page, conversation fragments, rename/delete, exports, health.

What it knows: URLs and how to answer htmx (a fragment for `HX-Request`, the full page otherwise).
What it does not know: SQL (`webapp.db`), HTML layout (`views.ChatViews`), CSRF (every POST here
passed `webapp.security.CsrfMiddleware` before it arrives).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ..db import (
    MAX_IMPORT_BYTES,
    Conversation,
    ConversationImportError,
    Database,
    EventConverter,
    StorageError,
    export_json,
    export_markdown,
    import_json,
    parse_import,
)
from ..engine_host import EngineState
from ..render import pygments_css
from ..units import parse_budget
from .transcript import DEFAULTS_KEY, parse_generation
from .views import ChatViews

MAX_TITLE_CHARS = 120
MAX_DRAFT_CHARS = 64 * 1024  # what Move to Trash keeps of a conversation's typed text (a message's most)
log = logging.getLogger(__name__)


def _filename(conv: Conversation, ext: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", conv.title).strip("-")[:60] or "conversation"
    return f"{stem}-{conv.id}.{ext}"


def _attachment(conv: Conversation, ext: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{_filename(conv, ext)}"'}


class ChatPages:
    def __init__(self, db: Database, engine: EngineState, views: ChatViews) -> None:
        self.db, self.engine, self.views = db, engine, views
        self.import_event: EventConverter | None = (
            None  # set by create_app: an imported event, as logged here
        )
        # set by create_app: after a delete for good, what belonged to the deleted conversations (saved caches)
        self.on_deleted: Callable[[], Awaitable[object]] | None = None
        self.on_trashed: Callable[[str], None] | None = None  # a conversation went to the Trash

    @property
    def routes(self) -> list[Route]:
        return [
            Route("/", self.index),
            Route("/health", self.health),
            Route("/conversations", self.conversation_list),
            Route("/c/{conversation_id:str}", self.conversation_page),
            Route("/c/{conversation_id:str}/sync", self.sync),
            Route("/c/{conversation_id:str}/rename", self.rename, methods=["POST"]),
            Route("/c/{conversation_id:str}/delete", self.delete, methods=["POST"]),
            Route("/c/{conversation_id:str}/restore", self.restore, methods=["POST"]),
            Route("/c/{conversation_id:str}/delete-now", self.delete_now, methods=["POST"]),
            Route("/trash", self.trash),
            Route("/trash/empty", self.empty_trash, methods=["POST"]),
            Route("/conversations/import", self.import_conversation, methods=["POST"]),
            Route("/m/{message_id:int}/edit", self.edit_message, methods=["POST"]),
            Route("/c/{conversation_id:str}/export.md", self.export_md),
            Route("/c/{conversation_id:str}/export.json", self.export_json),
            Route("/static/pygments.css", self.pygments_stylesheet),
            Route("/generation", self.generation_window),
            Route("/engine-state", self.engine_state),
            Route("/c/{conversation_id:str}/generation", self.save_generation, methods=["POST"]),
            Route("/settings/generation", self.save_generation_defaults, methods=["POST"]),
            Route("/engine/budget", self.budget_form),
            Route("/engine/budget", self.set_budget, methods=["POST"]),
        ]

    def _conversation(self, request: Request) -> Conversation:
        conv = self.db.get_conversation(request.path_params["conversation_id"])
        if conv is None:
            if self.db.get_conversation(request.path_params["conversation_id"], trashed=True):
                raise HTTPException(404, "this conversation is in the Trash: View › Trash puts it back")
            raise HTTPException(404, "no such conversation (it may have been deleted)")
        return conv

    def _trashed(self, request: Request) -> Conversation:
        conv = self.db.get_conversation(request.path_params["conversation_id"], trashed=True)
        if conv is None or conv.trashed_at is None:
            raise HTTPException(404, "no such conversation in the Trash (it may have been deleted for good)")
        return conv

    # ------------------------------------------------------------------ pages
    async def _page(self, request: Request, conversation_id: str | None) -> HTMLResponse:
        """The page, or the chat window alone (htmx): drawn off the event loop — a long conversation's
        markdown takes a while, and every other request (Stop, an approval, the other windows) goes on."""
        if request.headers.get("hx-request") and request.headers.get("hx-target") == "chat-window":
            shown = request.query_params.get("project")  # New Conversation: the project that window shows
            return HTMLResponse(await run_in_threadpool(self.views.chat_window, conversation_id, shown))
        return HTMLResponse(await run_in_threadpool(self.views.page, conversation_id))

    async def index(self, request: Request) -> HTMLResponse:
        trashed = self.db.get_conversation(request.query_params.get("trashed") or "", trashed=True)
        if trashed is not None and trashed.trashed_at is not None and not request.headers.get("hx-request"):
            return HTMLResponse(self.views.page(None, undo=trashed))  # after Move to Trash: Undo offered
        return await self._page(request, None)

    async def conversation_page(self, request: Request) -> Response:
        cid = str(request.path_params["conversation_id"])
        trashed = self.db.get_conversation(cid, trashed=True)
        if trashed is not None and trashed.trashed_at is not None and not request.headers.get("hx-request"):
            # a link to a conversation in the Trash: the page says so and offers it back (a bare 404 did not)
            return RedirectResponse(f"/?trashed={cid}", status_code=303)
        return await self._page(request, self._conversation(request).id)

    async def sync(self, request: Request) -> HTMLResponse:
        """GET /c/ID/sync: what another window changed in the conversation, as out-of-band fragments (a
        window showing it asks when told over its socket; `static/trust.js`)."""
        cid = str(request.path_params["conversation_id"])
        return HTMLResponse(await run_in_threadpool(self.views.sync, cid))

    async def conversation_list(self, request: Request) -> HTMLResponse:
        """GET /conversations?current=ID&q=TEXT: the list (`q`: only the conversations holding TEXT)."""
        params = request.query_params
        current = params.get("current") or params.get("conversation_id") or None
        # off the event loop: a search reads every message of the project (replies stream on meanwhile)
        listed = await run_in_threadpool(
            self.views.conversation_list, current, False, None, params.get("q", "")
        )
        return HTMLResponse(listed)

    # ------------------------------------------------------------------ changes
    async def rename(self, request: Request) -> HTMLResponse:
        conv = self._conversation(request)
        form = await request.form()
        given = str(form.get("title") or request.headers.get("hx-prompt") or "")
        title = " ".join(given.split())[:MAX_TITLE_CHARS]
        if not title:
            raise HTTPException(400, "a title cannot be empty")
        self.db.rename_conversation(conv.id, title)
        return HTMLResponse(self.views.conversation_list(conv.id, oob=False) + self.views.chat_title(title))

    async def delete(self, request: Request) -> Response:
        """POST /c/ID/delete: Move to Trash (Undo in the list, Put Back in the Trash window)."""
        conv = self._conversation(request)
        draft = str((await request.form()).get("draft") or "")
        if draft.strip():  # what was typed in its box: there again after Undo or Put Back
            self.views.kept[conv.id] = draft[:MAX_DRAFT_CHARS]
        self.db.trash_conversation(conv.id)
        if (
            self.on_trashed is not None
        ):  # a reply left writing there by a closed window: nothing could stop it
            self.on_trashed(conv.id)
        current_url = request.headers.get("hx-current-url", "")
        if re.search(rf"/c/{re.escape(conv.id)}(?:[?#]|$)", current_url):
            return Response(status_code=200, headers={"HX-Redirect": f"/?trashed={conv.id}"})
        return HTMLResponse(self.views.conversation_list(None, oob=False, undo=conv))

    async def restore(self, request: Request) -> HTMLResponse:
        """POST /c/ID/restore: Put Back (or Undo) — the conversation is listed again in its project."""
        conv = self._trashed(request)
        projects = self.views.projects
        home = None  # its project was removed from the list meanwhile: back into the open one
        if projects is not None and projects.get(conv.project_id) is None:
            home = projects.current().id
        self.db.restore_conversation(conv.id, home)
        return HTMLResponse(self.views.conversation_list(self._current(request), oob=False))

    async def delete_now(self, request: Request) -> HTMLResponse:
        """POST /c/ID/delete-now: delete one conversation in the Trash for good (the page asked first)."""
        conv = self._trashed(request)
        self.db.delete_conversation(conv.id)
        await self._deleted()
        return HTMLResponse(self.views.trash(note=f"Deleted “{conv.title}” for good."))

    async def trash(self, request: Request) -> HTMLResponse:
        return HTMLResponse(self.views.trash())

    async def empty_trash(self, request: Request) -> HTMLResponse:
        """POST /trash/empty (`ids`: the conversations the page showed in its Trash, comma-separated): those
        deleted for good, the page having asked first — not one another window trashed meanwhile."""
        ids = [
            i
            for i in str((await request.form()).get("ids") or "").split(",")
            if re.fullmatch(r"[0-9a-f]{1,64}", i)
        ]
        if not ids:
            raise HTTPException(400, "name the conversations to delete for good (ids: those the Trash shows)")
        n = self.db.purge_trash(ids=ids[:10_000])
        await self._deleted()
        return HTMLResponse(
            self.views.trash(note=f"Deleted {n} conversation{'' if n == 1 else 's'} for good.")
        )

    async def _deleted(self) -> None:
        """Conversations were deleted for good: their kept drafts go, and their saved caches (`on_deleted`)."""
        for kept in (self.views.drafts, self.views.kept):
            for cid in [c for c in kept if self.db.get_conversation(c, trashed=True) is None]:
                del kept[cid]
        if self.on_deleted is None:
            return
        try:
            await self.on_deleted()
        except Exception:  # noqa: BLE001 - the conversation is deleted; a leftover cache is swept at the next start
            log.warning("removing a deleted conversation's saved cache failed", exc_info=True)

    def _current(self, request: Request) -> str | None:
        """The conversation the page that asked shows (its list keeps it selected)."""
        found = re.search(r"/c/([0-9a-f]{12})(?:[?#/]|$)", request.headers.get("hx-current-url", ""))
        return found.group(1) if found and self.db.get_conversation(found.group(1)) else None

    async def import_conversation(self, request: Request) -> Response:
        """POST /conversations/import (multipart: `file`, a conversation's JSON export; `project_id`): a NEW
        conversation in that project (the open one without it). The page goes to it; a bad file is said in
        an alert and nothing is stored."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_IMPORT_BYTES + (1 << 20):  # refused before it is read
            raise HTTPException(
                413, f"that file is over {MAX_IMPORT_BYTES >> 20} MB: a conversation export is smaller"
            )
        form = await request.form(max_part_size=MAX_IMPORT_BYTES)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise HTTPException(400, "send the conversation's JSON file as the form field 'file'")
        name = upload.filename or "the file"
        project = self._import_project(str(form.get("project_id") or ""))
        body = await upload.read(MAX_IMPORT_BYTES + 1)
        await form.close()
        try:  # a file of up to 64 MB is parsed off the event loop (other windows keep streaming)
            done = import_json(
                self.db, await asyncio.to_thread(parse_import, body), project, self.import_event
            )
        except (ConversationImportError, StorageError) as exc:
            text = f"Could not import {name}: {exc}."
            if not request.headers.get("hx-request"):
                raise HTTPException(503 if isinstance(exc, StorageError) else 400, text) from None
            listed = self.views.conversation_list(self._current(request), oob=False)  # the form's target
            return HTMLResponse(listed + self.views.alert(text))
        log.info(
            "imported %s as conversation %s (%s)", name, done.conversation.id, done.skipped or "all kept"
        )
        if not request.headers.get("hx-request"):
            return JSONResponse(
                {"id": done.conversation.id, "messages": done.messages, "events": done.events,
                 "skipped": done.skipped},
                status_code=201,
            )  # fmt: skip
        return Response(status_code=200, headers={"HX-Redirect": f"/c/{done.conversation.id}"})

    async def edit_message(self, request: Request) -> Response:
        """POST /m/ID/edit (Edit… on one of the user's messages): a NEW conversation with what came before the
        message, its text in the box to change and send. Nothing stored is changed or lost: the conversation it
        comes from stays as it is (a reply is never thrown away to make room for another)."""
        message = self.db.get_message(int(request.path_params["message_id"]))
        conv = self.db.get_conversation(message.conversation_id) if message is not None else None
        if message is None or conv is None:
            raise HTTPException(404, "that message is gone (its conversation was deleted or is in the Trash)")
        if message.role != "user":
            raise HTTPException(400, "only your own messages can be edited; a reply can be regenerated")
        # a reply being written meanwhile is no obstacle: it comes after the message, and the copy ends before it
        sent = message.stats.get("attachments") or []
        typed_from = message.stats.get("typed_from") if sent else None
        text = message.content[typed_from:] if isinstance(typed_from, int) else message.content
        if not any(m.id < message.id for m in self.db.messages(conv.id)):
            # the first message: nothing to copy, so a new conversation of its project and mode gets the text (an
            # empty copy left unsent would stay in the list for good)
            self.views.new_drafts[conv.project_id] = (text, conv.mode)  # its mode for that one, not for good
            if not request.headers.get("hx-request"):
                return JSONResponse({"id": None, "title": None, "draft": text}, status_code=200)
            where = {"path": f"/?project={conv.project_id}", "target": "#chat-window", "swap": "outerHTML"}
            return Response(status_code=200, headers={"HX-Location": json.dumps(where)})
        notice = (
            f"A copy of “{conv.title}” up to the message you edited, whose text was put in the box to change and "
            "send when this copy opened. The original conversation is unchanged and keeps it."
        )
        if sent:
            names = ", ".join(str(f.get("name")) for f in sent[:5]) + (" …" if len(sent) > 5 else "")
            notice += (
                f" The files attached to it ({names}) are not attached again: attach them if the model should "
                "read them."
            )
        try:
            new = self.db.branch_conversation(message, notice)
        except StorageError as exc:
            raise HTTPException(503, f"the copy could not be stored: {exc}") from None
        self.views.drafts[new.id] = text
        log.info("conversation %s: message %s edited in a new conversation %s", conv.id, message.id, new.id)
        if not request.headers.get("hx-request"):
            return JSONResponse({"id": new.id, "title": new.title, "draft": text}, status_code=201)
        # the chat window alone, in the same page: a reload would close the page's socket, which stops a reply it
        # is writing (in this conversation or another)
        where = {"path": f"/c/{new.id}", "target": "#chat-window", "swap": "outerHTML"}
        return Response(status_code=200, headers={"HX-Location": json.dumps(where)})

    def _import_project(self, project_id: str) -> str:
        projects = self.views.projects
        if projects is None:
            return project_id or "default"
        if not project_id:
            return projects.current().id
        if projects.get(project_id) is None:
            raise HTTPException(404, f"there is no project {project_id!r} (it may have been removed)")
        return project_id

    async def engine_state(self, request: Request) -> HTMLResponse:
        """GET /engine-state: every place that names the engine, out-of-band (a page that reconnected)."""
        return HTMLResponse(self.views.engine_state())

    # ------------------------------------------------------------------ generation settings
    async def generation_window(self, request: Request) -> HTMLResponse:
        """GET /generation?conversation_id=ID: the conversation's own settings form (or why there is none)."""
        conv = self.db.get_conversation(request.query_params.get("conversation_id") or "")
        if conv is None:
            return HTMLResponse(str(self.views.tx.generation_none()))
        return HTMLResponse(self.views.generation_form(conv.id))

    async def save_generation(self, request: Request) -> HTMLResponse:
        conv = self._conversation(request)
        form = await request.form()
        try:
            values = parse_generation(form)
        except ValueError as exc:
            return HTMLResponse(self.views.generation_form(conv.id, note=f"Not saved: {exc}."))
        self.db.set_generation(conv.id, self.views.changed(conv.id, values, str(form.get("inherited") or "")))
        return HTMLResponse(self.views.generation_form(conv.id, note="Saved."))

    async def save_generation_defaults(self, request: Request) -> HTMLResponse:
        form = await request.form()
        try:
            values = parse_generation(form)
        except ValueError as exc:
            return HTMLResponse(self.views.generation_form(None, note=f"Not saved: {exc}."))
        self.db.set_setting(DEFAULTS_KEY, self.views.changed(None, values, str(form.get("inherited") or "")))
        return HTMLResponse(self.views.generation_form(None, note="Saved."))

    # ------------------------------------------------------------------ flash's memory budget
    async def budget_form(self, request: Request) -> HTMLResponse:
        """GET /engine/budget: the Settings window's memory budget form."""
        return HTMLResponse(self.views.budget_form())

    async def set_budget(self, request: Request) -> HTMLResponse:
        """POST /engine/budget (memory_budget = auto or a size): applies to the next flash load, and at once
        to a model on flash (loaded again under it: no restart)."""
        text = str((await request.form()).get("memory_budget") or "auto")
        try:
            budget = parse_budget(text)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            return HTMLResponse(self.views.budget_form(f"Not set: {exc}."))
        try:
            reloaded = await self.engine.set_budget(budget)
        except Exception as exc:  # noqa: BLE001 - said in the form; the engine restored what it had
            return HTMLResponse(self.views.budget_form(f"Could not load {self.engine.model} under it: {exc}"))
        note = "Set; flash loaded again under it." if reloaded else "Set: applies when a model runs from SSD."
        return HTMLResponse(self.views.budget_form(note))

    # ------------------------------------------------------------------ exports and assets
    async def export_md(self, request: Request) -> PlainTextResponse:
        conv = self._conversation(request)
        text = export_markdown(conv, self.db.messages(conv.id), self.db.events(conv.id))
        return PlainTextResponse(
            text, media_type="text/markdown; charset=utf-8", headers=_attachment(conv, "md")
        )

    async def export_json(self, request: Request) -> Response:
        conv = self._conversation(request)
        exported = export_json(conv, self.db.messages(conv.id), self.db.events(conv.id))
        data = await asyncio.to_thread(json.dumps, exported, indent=2, ensure_ascii=False)  # off the loop
        return Response(data, media_type="application/json", headers=_attachment(conv, "json"))

    async def pygments_stylesheet(self, request: Request) -> Response:
        return Response(pygments_css(), media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    async def health(self, request: Request) -> JSONResponse:
        e = self.engine
        return JSONResponse(
            {"ok": True, "backend": e.backend, "model": e.model, "context_length": e.context_length}
        )
