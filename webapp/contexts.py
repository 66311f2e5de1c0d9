"""HTTP handlers for saved project contexts: list, save, resume, rename, delete, export, import.

What it knows: URLs under `/projects/{project_id}/contexts`, the CSRF rule (`routes.check_csrf`),
which engine errors become which HTTP status, and that `save`/`resume` run on the worker thread.
What it does not know: the file layout or the model check (`engine.sessions`), HTML layout (it
answers JSON; the Projects window draws it).

Mount with `*context_routes` next to `routes` in `create_app`. Until projects exist every
conversation belongs to the project `default`.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from engine.base import CacheMismatchError, EngineError, Message
from engine.sessions import (
    ContextImportError,
    ContextNameError,
    ContextNotFoundError,
    ContextStore,
    QuotaExceededError,
    try_resume,
)

from .routes import _state, check_csrf

MAX_IMPORT_BYTES = 16 << 30
_STATUS = [
    (ContextNameError, 400), (ContextNotFoundError, 404), (QuotaExceededError, 413),
    (ContextImportError, 400), (CacheMismatchError, 409), (EngineError, 409),
]  # fmt: skip


def _store(request: Request) -> ContextStore:
    return ContextStore(_state(request).settings.data_dir)


def _error(exc: EngineError) -> JSONResponse:
    status = next(code for kind, code in _STATUS if isinstance(exc, kind))
    return JSONResponse({"error": str(exc)}, status_code=status)


async def _fields(request: Request) -> dict[str, Any]:
    if request.headers.get("content-type", "").startswith("application/json"):
        body = await request.json()
        return body if isinstance(body, dict) else {}
    return dict(await request.form())


def _history(request: Request, conversation_id: str) -> list[Message]:
    db = _state(request).db
    if db.get_conversation(conversation_id) is None:
        raise HTTPException(404, "no such conversation (it may have been deleted)")
    return [{"role": m.role, "content": m.content} for m in db.messages(conversation_id)
            if m.role in ("user", "assistant", "system") and m.content]  # fmt: skip


async def list_contexts(request: Request) -> Response:
    store, pid = _store(request), request.path_params["project_id"]
    try:
        items = await asyncio.to_thread(store.list, pid)
        usage = await asyncio.to_thread(store.usage, pid)
    except EngineError as exc:
        return _error(exc)
    return JSONResponse({"contexts": [c.to_dict() for c in items], "usage_bytes": usage,
                         "quota_bytes": store.quota_bytes})  # fmt: skip


async def save_context(request: Request) -> Response:
    await check_csrf(request)
    f = await _fields(request)
    store, pid = _store(request), request.path_params["project_id"]
    conv = str(f.get("conversation_id") or "")
    bits = int(f["kv_bits"]) if f.get("kv_bits") not in (None, "", "native") else None
    history = _history(request, conv) if conv else None
    try:
        ctx = await _state(request).engine.worker.acall(
            lambda b: store.save(
                b, pid, str(f.get("name") or ""), kv_bits=bits, conversation_id=conv or None, messages=history
            )  # fmt: skip
        )
    except EngineError as exc:
        return _error(exc)
    return JSONResponse(ctx.to_dict(), status_code=201)


async def resume_context(request: Request) -> Response:
    await check_csrf(request)
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    res = await _state(request).engine.worker.acall(lambda b: try_resume(store, b, pid, cid))
    ctx = res.context
    return JSONResponse({"resumed": res.resumed, "message": res.message, "tokens": res.tokens,
                         "seconds": round(res.seconds, 3),
                         "conversation_id": ctx.conversation_id if ctx else None})  # fmt: skip


async def rename_context(request: Request) -> Response:
    await check_csrf(request)
    f = await _fields(request)
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    try:
        return JSONResponse(store.rename(pid, cid, str(f.get("name") or "")).to_dict())
    except EngineError as exc:
        return _error(exc)


async def delete_context(request: Request) -> Response:
    await check_csrf(request)
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    try:
        await asyncio.to_thread(store.delete, pid, cid)
    except EngineError as exc:
        return _error(exc)
    return Response(status_code=204)


async def export_context(request: Request) -> Response:
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    tmp = Path(tempfile.mkdtemp(prefix="flashcode-export-"))
    try:
        path = await asyncio.to_thread(store.export, pid, cid, tmp)
    except EngineError as exc:
        return _error(exc)
    return FileResponse(path, filename=path.name, media_type="application/zip",
                        background=BackgroundTask(_remove, tmp))  # fmt: skip


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


async def import_context(request: Request) -> Response:
    await check_csrf(request)
    store, pid = _store(request), request.path_params["project_id"]
    form = await request.form(max_part_size=MAX_IMPORT_BYTES)
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise HTTPException(400, "send the .flashctx file as the form field 'file'")
    tmp = Path(tempfile.mkdtemp(prefix="flashcode-import-"))
    try:
        dest = tmp / "upload.flashctx"
        with dest.open("wb") as out:
            while chunk := await upload.read(8 << 20):
                out.write(chunk)
        name = str(form.get("name") or "") or None
        ctx = await asyncio.to_thread(store.import_file, pid, dest, name)
    except EngineError as exc:
        return _error(exc)
    finally:
        _remove(tmp)
    return JSONResponse(ctx.to_dict(), status_code=201)


context_routes = [
    Route("/projects/{project_id:str}/contexts", list_contexts),
    Route("/projects/{project_id:str}/contexts", save_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/import", import_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/resume", resume_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/rename", rename_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/delete", delete_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/export", export_context),
]
