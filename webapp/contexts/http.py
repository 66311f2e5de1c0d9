"""HTTP handlers for saved project contexts: list, save, resume, rename, delete, export, import.

What it knows: URLs under `/projects/{project_id}/contexts`, which engine errors become which HTTP
status, that `save`/`resume` run on the worker thread, and the Projects window's pane
(`templates/contexts/pane.html`: a request with `HX-Request` gets the pane back, any other gets
JSON). What it does not know: the file layout or the model check (`engine.sessions`), CSRF (every
POST passed `webapp.security.CsrfMiddleware`).

Until projects exist every conversation belongs to the project `default`.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from jinja2 import Environment
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from engine.base import CacheMismatchError, EngineError
from engine.sessions import (
    ContextImportError,
    ContextNameError,
    ContextNotFoundError,
    ContextStore,
    QuotaExceededError,
    try_resume,
)
from engine.worker import Worker

from ..db import Database

MAX_IMPORT_BYTES = 16 << 30
STATUS_OF_ERROR: list[tuple[type[EngineError], int]] = [
    (ContextNameError, 400),
    (ContextNotFoundError, 404),
    (QuotaExceededError, 413),
    (ContextImportError, 400),
    (CacheMismatchError, 409),
    (EngineError, 409),
]
PRECISIONS = [  # MLX and flash requantize the cache when they save it; the first is the default: exact
    ("native", "KV as the engine holds it (exact; float32 on a CPU: the largest)"),
    ("16", "16-bit KV (half of float32; the same replies in our benchmark)"),
    ("8", "8-bit KV (lossy: changed a long conversation's reply)"),
    ("4", "4-bit KV (smallest; changes replies at once)"),
]
LLAMA_PRECISIONS = [  # llama-server saves its slot as it is (--cache-type-k/v decides)
    ("native", "KV as llama-server holds it (its --cache-type, f16 unless set)"),
]


def precisions(backend: str | None) -> list[tuple[str, str]]:
    """The KV precisions the loaded engine can save, the default first (one that works there)."""
    return LLAMA_PRECISIONS if backend == "llama" else PRECISIONS


def _htmx(request: Request) -> bool:
    return bool(request.headers.get("hx-request"))


async def _fields(request: Request) -> dict[str, Any]:
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise HTTPException(
                400,
                f"the request body is not readable JSON ({type(exc).__name__}): "
                'send an object like {"name": "my context"}',
            ) from exc
        return body if isinstance(body, dict) else {}
    return dict(await request.form())


def _kv_bits(value: Any) -> int | None:
    """The form's KV precision: "native" (or nothing) keeps the cache's own; else 16, 8 or 4 bits."""
    if value in (None, "", "native"):
        return None
    if str(value) not in ("16", "8", "4"):
        raise HTTPException(400, f"kv_bits {str(value)[:40]!r} is not a KV precision: use 16, 8, 4 or native")
    return int(str(value))


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


NONE_OPEN = (
    "No conversation is open: a saved context is one conversation's. Open the conversation whose context to save "
    "(click it in the Conversations window), then save."
)


class SavedContexts:
    """The saved-context routes of one app: files under `data_dir`, the engine on `worker`."""

    def __init__(
        self,
        data_dir: Path,
        worker: Worker,
        db: Database,
        env: Environment,
        live: Callable[[], str | None] | None = None,
        before_resume: Callable[[], Awaitable[None]] | None = None,
        after_resume: Callable[[str | None], None] | None = None,
        known_project: Callable[[str], bool] | None = None,
        make_live: Callable[[str], Awaitable[str | None]] | None = None,
    ) -> None:
        """`live`: the conversation whose reply the engine's cache holds now (None: none, or another kind of
        prompt, as an agent step's); `before_resume` saves that one's changes before a saved context
        replaces it, `after_resume` says which conversation the cache then holds; `make_live` loads a
        conversation's automatic save into the engine (as its next reply would) before it is saved by name."""
        self.data_dir, self.worker, self.db = Path(data_dir), worker, db
        self.ui: Any = env.get_template("contexts/pane.html").module
        self.live, self.before_resume, self.after_resume = live, before_resume, after_resume
        self.make_live = make_live
        self.known_project = known_project  # saving or importing into a project that does not exist: 404

    @property
    def routes(self) -> list[Route]:
        base, one = "/projects/{project_id:str}", "/projects/{project_id:str}/contexts/{context_id:str}"
        return [
            Route(f"{base}/window", self.window),
            Route(f"{base}/contexts", self.list_contexts),
            Route(f"{base}/contexts", self.save_context, methods=["POST"]),
            Route(f"{base}/contexts/import", self.import_context, methods=["POST"]),
            Route(f"{one}/resume", self.resume_context, methods=["POST"]),
            Route(f"{one}/rename", self.rename_context, methods=["POST"]),
            Route(f"{one}/delete", self.delete_context, methods=["POST"]),
            Route(f"{one}/export", self.export_context),
        ]

    def _store(self) -> ContextStore:
        return ContextStore(self.data_dir)

    def _error(self, exc: EngineError, request: Request | None = None) -> Response:
        if request is not None and _htmx(request):  # htmx swaps only 2xx answers: say it in the pane
            return self._pane(request, error=str(exc))
        status = next(code for kind, code in STATUS_OF_ERROR if isinstance(exc, kind))
        return JSONResponse({"error": str(exc)}, status_code=status)

    # ------------------------------------------------------------------ the Projects window pane
    def _pane(
        self, request: Request, note: str = "", error: str = "", link: str = "", typed: str = ""
    ) -> HTMLResponse:
        """The pane; `typed`: the name a refused Save had in its box (kept: it was cleared)."""
        store, pid = self._store(), request.path_params["project_id"]
        try:
            items, usage = store.list(pid), store.usage(pid)
        except EngineError as exc:
            items, usage, error = [], 0, str(exc)
        backend = getattr(getattr(self.worker, "backend", None), "name", None)
        items = [self._relinked(store, pid, c) for c in items]
        titles = {}  # each context's conversation, by title (the list did not say which it was)
        for cid in {c.conversation_id for c in items if c.conversation_id}:
            if (conv := self.db.get_conversation(cid, trashed=True)) is not None:
                titles[cid] = conv.title
        pane = self.ui.pane(
            pid, items, usage, store.quota_bytes, note, error, link, precisions(backend), titles, typed
        )
        return HTMLResponse(str(pane))

    async def window(self, request: Request) -> Response:
        return await asyncio.to_thread(self._pane, request)

    def _check_live(self, conversation_id: str) -> None:
        """The context saved for a conversation must be that conversation's: the one whose reply the
        engine's cache holds now."""
        if self.live is not None and self.live() != conversation_id:
            conv = self.db.get_conversation(conversation_id)
            if conv is not None and conv.mode == "agent":
                raise EngineError(
                    "an agent conversation's context is not kept: each agent step's prompt (the task, the tool "
                    "calls and their results) takes the engine's cache, not the conversation as it reads. To save "
                    "it, switch the conversation to Chat mode, send a message, then save"
                )
            raise EngineError(
                "the engine's live context is not this conversation's, and it has no automatic save to load (another "
                "conversation or an agent step ran since its last reply): send a message in this conversation, "
                "then save"
            )

    # ------------------------------------------------------------------ handlers
    async def list_contexts(self, request: Request) -> Response:
        store, pid = self._store(), request.path_params["project_id"]
        try:
            items = await asyncio.to_thread(store.list, pid)
            usage = await asyncio.to_thread(store.usage, pid)
        except EngineError as exc:
            return self._error(exc)
        body = {
            "contexts": [c.to_dict() for c in items],
            "usage_bytes": usage,
            "quota_bytes": store.quota_bytes,
        }
        return JSONResponse(body)

    def _check_project(self, project_id: str) -> None:
        if self.known_project is not None and not self.known_project(project_id):
            raise HTTPException(404, f"there is no project {project_id!r} (it may have been removed)")

    async def save_context(self, request: Request) -> Response:
        f = await _fields(request)
        store, pid = self._store(), request.path_params["project_id"]
        self._check_project(pid)
        conv = str(f.get("conversation_id") or "")
        bits = _kv_bits(f.get("kv_bits"))
        name = str(f.get("name") or "")
        if conv and self.db.get_conversation(conv) is None:
            raise HTTPException(404, "no such conversation (it may have been deleted)")
        # the window's Save with none open: the engine's cache is another conversation's, and saved it named none
        if not conv and _htmx(request):
            return self._pane(request, error=NONE_OPEN)
        if conv and self.make_live is not None and self.live is not None and self.live() != conv:
            # a conversation just opened (after a restart, or another one's reply): its automatic save, if it
            # has one, is made live first, as its next reply would (Save had said "send a message first")
            await self.make_live(conv)

        def save(backend: Any) -> Any:  # on the worker: after every generation queued before this save
            if conv:
                self._check_live(conv)
            return store.save(backend, pid, name, kv_bits=bits, conversation_id=conv or None)

        try:
            ctx = await self.worker.acall(save)
        except EngineError as exc:
            if _htmx(request):  # the name typed stays in the box, to save again once mended
                return self._pane(request, error=str(exc), typed=name)
            return self._error(exc, request)
        if _htmx(request):
            return self._pane(request, note=f"Saved {ctx.name!r}: {ctx.token_count:,} tokens.")
        return JSONResponse(ctx.to_dict(), status_code=201)

    async def resume_context(self, request: Request) -> Response:
        store, pid, cid = self._store(), request.path_params["project_id"], request.path_params["context_id"]
        gone = await asyncio.to_thread(self._conversation_gone, store, pid, cid)
        if gone:  # resumed, it would be the live cache of nothing (the redirect went to a plain 404)
            return self._pane(request, error=gone) if _htmx(request) else JSONResponse({"error": gone}, 409)
        if self.before_resume is not None:
            await self.before_resume()
        res = await self.worker.acall(lambda b: try_resume(store, b, pid, cid))
        ctx = res.context
        if res.resumed and self.after_resume is not None:
            self.after_resume(ctx.conversation_id if ctx else None)
        if _htmx(request):
            conv = ctx.conversation_id if ctx else None
            if res.resumed:
                said = (
                    res.message[:1].upper() + res.message[1:]
                )  # a sentence in the pane ("Resumed 'teal poem' …")
                pane = self._pane(request, note=said + ".", link=f"/c/{conv}" if conv else "")
                if conv and urlsplit(request.headers.get("hx-current-url", "")).path != f"/c/{conv}":
                    # the page goes to the conversation whose context is now live (a newcomer typed into the
                    # one open, which started afresh, and missed the link)
                    pane.headers["HX-Redirect"] = f"/c/{conv}"
                    # and the page it goes to says what was resumed (static/app.js: its status bar), as the
                    # pane did: the conversation alone looked as if nothing had happened
                    pane.headers["X-Flashcode-Said"] = quote(
                        f"{said}. Your next message goes on from it, without reading the conversation again."
                    )
                return pane
            return self._pane(request, error=res.message)
        return JSONResponse(
            {
                "resumed": res.resumed,
                "message": res.message,
                "tokens": res.tokens,
                "seconds": round(res.seconds, 3),
                "conversation_id": ctx.conversation_id if ctx else None,
            }
        )

    def _relinked(self, store: Any, project_id: str, ctx: Any) -> Any:
        """`ctx`, pointed at its conversation as imported here when the id it was saved with is not in this
        flashcode but a conversation imported from an export of it is (a backup restored: the context and its
        conversation exported, then both imported; a review found it said "deleted"). Else as it was."""
        conv = ctx.conversation_id
        if not conv or self.db.get_conversation(conv, trashed=True) is not None:
            return ctx
        twin = self.db.imported_as(project_id, conv)
        if twin is None:
            return ctx
        try:
            return store.relink(project_id, ctx.id, twin.id)
        except (EngineError, OSError):  # a full disk: said "not here" until a later look can relink it
            return ctx

    def _conversation_gone(self, store: Any, project_id: str, context_id: str) -> str | None:
        """Why a saved context cannot be resumed because its conversation is gone; None when it is there (or the
        context has none, or is not found: the resume says that)."""
        try:
            conv = self._relinked(store, project_id, store.get(project_id, context_id)).conversation_id
        except EngineError:
            return None
        if not conv or self.db.get_conversation(conv) is not None:
            return None
        if self.db.get_conversation(conv, trashed=True) is not None:
            return "its conversation is in the Trash: put it back (View › Trash), then resume it"
        return (
            "its conversation is not in this flashcode (deleted, or saved on another machine): import the "
            "conversation's export (File › Import Conversation…) and resume this again, or delete this context "
            "if it is no use"
        )

    async def rename_context(self, request: Request) -> Response:
        f = await _fields(request)
        store, pid, cid = self._store(), request.path_params["project_id"], request.path_params["context_id"]
        try:
            ctx = store.rename(pid, cid, str(f.get("name") or ""))
        except EngineError as exc:
            return self._error(exc, request)
        return self._pane(request) if _htmx(request) else JSONResponse(ctx.to_dict())

    async def delete_context(self, request: Request) -> Response:
        store, pid, cid = self._store(), request.path_params["project_id"], request.path_params["context_id"]
        try:
            await asyncio.to_thread(store.delete, pid, cid)
        except EngineError as exc:
            return self._error(exc, request)
        return self._pane(request, note="Deleted.") if _htmx(request) else Response(status_code=204)

    async def export_context(self, request: Request) -> Response:
        store, pid, cid = self._store(), request.path_params["project_id"], request.path_params["context_id"]
        try:
            await asyncio.to_thread(store.get, pid, cid)  # the id first: nothing is made for an unknown one
        except EngineError as exc:
            return self._error(exc)
        tmp = Path(tempfile.mkdtemp(prefix="flashcode-export-"))
        try:
            path = await asyncio.to_thread(store.export, pid, cid, tmp)
        except BaseException as exc:
            _remove(tmp)  # nothing to send, nothing left behind
            if isinstance(exc, EngineError):
                return self._error(exc)
            raise
        return FileResponse(
            path, filename=path.name, media_type="application/zip", background=BackgroundTask(_remove, tmp)
        )

    async def import_context(self, request: Request) -> Response:
        store, pid = self._store(), request.path_params["project_id"]
        self._check_project(pid)
        form = await request.form(max_part_size=MAX_IMPORT_BYTES)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise HTTPException(400, "send the .flashctx file as the form field 'file'")
        tmp = Path(tempfile.mkdtemp(prefix="flashcode-import-"))
        try:
            given = re.sub(r"[^\w.\- ]+", "_", Path(upload.filename or "").name)[:120].strip(". ")
            dest = tmp / (given or "upload.flashctx")  # errors name the user's file
            try:
                with dest.open("wb") as out:
                    while chunk := await upload.read(8 << 20):
                        out.write(chunk)
            except OSError as exc:  # the temporary folder's disk is full
                raise HTTPException(
                    507,
                    f"the upload could not be held in {tmp.parent} ({exc.strerror or exc}): free some space",
                ) from None
            name = form.get("name")
            name = name if isinstance(name, str) and name else None
            ctx = await asyncio.to_thread(store.import_file, pid, dest, name)
        except EngineError as exc:
            return self._error(exc, request)
        finally:
            _remove(tmp)
        if _htmx(request):
            return self._pane(request, note=f"Imported {ctx.name!r}.")
        return JSONResponse(ctx.to_dict(), status_code=201)
