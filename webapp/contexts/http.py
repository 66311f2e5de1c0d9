"""HTTP handlers for saved project contexts: list, save, resume, rename, delete, export, import.

What it knows: URLs under `/projects/{project_id}/contexts`, the CSRF rule (`routes.check_csrf`),
which engine errors become which HTTP status, that `save`/`resume` run on the worker thread, and
the Projects window's pane (small HTML fragments for htmx: a request with `HX-Request` gets the
pane back, any other gets JSON). What it does not know: the file layout or the model check
(`engine.sessions`).

Until projects exist every conversation belongs to the project `default`.
"""

from __future__ import annotations

import asyncio
import html
import json
import tempfile
from pathlib import Path
from typing import Any

from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
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

from .state import AppState

MAX_IMPORT_BYTES = 16 << 30
_STATUS = [
    (ContextNameError, 400), (ContextNotFoundError, 404), (QuotaExceededError, 413),
    (ContextImportError, 400), (CacheMismatchError, 409), (EngineError, 409),
]  # fmt: skip


def _state(request: Request) -> AppState:
    return request.app.state.flashcode  # type: ignore[no-any-return]


async def check_csrf(request: Request) -> None:
    from .routes import check_csrf as check  # routes mounts these handlers: import it late

    await check(request)


def _store(request: Request) -> ContextStore:
    return ContextStore(_state(request).settings.data_dir)


def _htmx(request: Request) -> bool:
    return bool(request.headers.get("hx-request"))


def _error(exc: EngineError, request: Request | None = None) -> Response:
    if request is not None and _htmx(request):  # htmx swaps only 2xx answers: say it in the pane
        return _pane(request, error=str(exc))
    status = next(code for kind, code in _STATUS if isinstance(exc, kind))
    return JSONResponse({"error": str(exc)}, status_code=status)


# --------------------------------------------------------------------------- the Projects window pane
PRECISIONS = [("8", "8-bit KV (recommended)"), ("16", "16-bit KV"), ("native", "full precision"),
              ("4", "4-bit KV (lossy on small models)")]  # fmt: skip


def window_pane_html(project_id: str = "default") -> str:
    """What the Projects window should hold: it loads the pane each time the window is shown."""
    return (f'<div class="contexts-loader" hx-get="/projects/{html.escape(project_id)}/window" '
            'hx-trigger="intersect" hx-swap="innerHTML"><p>Loading saved contexts…</p></div>')  # fmt: skip


def _pane(request: Request, note: str = "", error: str = "", link: str = "") -> HTMLResponse:
    store, pid = _store(request), request.path_params["project_id"]
    try:
        items, usage = store.list(pid), store.usage(pid)
    except EngineError as exc:
        items, usage, error = [], 0, str(exc)
    return HTMLResponse(pane_html(pid, items, usage, store.quota_bytes, note, error, link))


def pane_html(pid: str, items: list[Any], usage: int, quota: int, note: str = "", error: str = "",
              link: str = "") -> str:  # fmt: skip
    from engine.models import human_size

    e, base = html.escape, f"/projects/{html.escape(pid)}/contexts"
    swap = 'hx-target="#contexts-pane" hx-swap="outerHTML"'
    out = ['<div class="contexts-pane" id="contexts-pane">']
    if note:
        opener = f' <a href="{e(link)}">Open the conversation</a>' if link else ""
        out.append(f'<p class="contexts-note">{e(note)}{opener}</p>')
    if error:
        out.append(f'<p class="contexts-error" role="alert">{e(error)}</p>')
    options = "".join(f'<option value="{v}">{e(label)}</option>' for v, label in PRECISIONS)
    out.append(f'<form class="contexts-save" hx-post="{base}" hx-include="#conversation-id" {swap}>'
               '<label>Save this conversation\'s context as <input name="name" required maxlength="100" '
               f'placeholder="name"></label> <select name="kv_bits" aria-label="KV precision">{options}</select> '
               '<button type="submit" class="btn">Save Context</button></form>')  # fmt: skip
    if items:
        out.append('<table class="contexts"><thead><tr><th>Name</th><th>Model</th><th>Tokens</th><th>KV</th>'
                   "<th>Size</th><th>Saved</th><th></th></tr></thead><tbody>")  # fmt: skip
        for c in items:
            url = f"{base}/{e(c.id)}"
            problem = f' <span class="contexts-problem">({e(c.problem)})</span>' if c.problem else ""
            out.append(
                f'<tr><td><form hx-post="{url}/rename" {swap}><input name="name" value="{e(c.name)}" maxlength="100" '
                f'aria-label="name"> <button class="btn">Rename</button></form>{problem}</td>'
                f"<td>{e(c.model)} ({e(c.backend)})</td><td>{c.token_count:,}</td><td>{c.kv_bits}-bit</td>"
                f"<td>{human_size(c.size_bytes)}</td><td>{e(c.created.replace('T', ' ')[:16])}</td>"
                f'<td><button class="btn" hx-post="{url}/resume" {swap}>Resume</button> '
                f'<a class="btn" href="{url}/export" download>Export</a> '
                f'<button class="btn" hx-post="{url}/delete" hx-confirm="Delete the saved context {e(c.name)}?" '
                f"{swap}>Delete</button></td></tr>"
            )  # fmt: skip
        out.append("</tbody></table>")
    else:
        out.append("<p>No saved contexts yet.</p>")
    out.append(f'<p class="contexts-usage">{human_size(usage)} of {human_size(quota)} used.</p>'
               f'<form hx-post="{base}/import" hx-encoding="multipart/form-data" {swap}>'
               '<input type="file" name="file" accept=".flashctx" required aria-label="context file"> '
               '<button type="submit" class="btn">Import…</button></form></div>')  # fmt: skip
    return "".join(out)


async def window(request: Request) -> Response:
    return await asyncio.to_thread(_pane, request)


async def _fields(request: Request) -> dict[str, Any]:
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise HTTPException(400, f"the request body is not readable JSON ({type(exc).__name__}): "
                                     'send an object like {"name": "my context"}') from exc  # fmt: skip
        return body if isinstance(body, dict) else {}
    return dict(await request.form())


def _kv_bits(value: Any) -> int | None:
    """The form's KV precision: "native" (or nothing) keeps the cache's own; else 16, 8 or 4 bits."""
    if value in (None, "", "native"):
        return None
    if str(value) not in ("16", "8", "4"):
        raise HTTPException(400, f"kv_bits {str(value)[:40]!r} is not a KV precision: use 16, 8, 4 or native")
    return int(str(value))


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
    bits = _kv_bits(f.get("kv_bits"))
    history = _history(request, conv) if conv else None
    try:
        ctx = await _state(request).engine.worker.acall(
            lambda b: store.save(
                b, pid, str(f.get("name") or ""), kv_bits=bits, conversation_id=conv or None, messages=history
            )  # fmt: skip
        )
    except EngineError as exc:
        return _error(exc, request)
    if _htmx(request):
        return _pane(request, note=f"Saved {ctx.name!r}: {ctx.token_count:,} tokens.")
    return JSONResponse(ctx.to_dict(), status_code=201)


async def resume_context(request: Request) -> Response:
    await check_csrf(request)
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    res = await _state(request).engine.worker.acall(lambda b: try_resume(store, b, pid, cid))
    ctx = res.context
    if _htmx(request):
        conv = ctx.conversation_id if ctx else None
        if res.resumed:
            return _pane(request, note=res.message + ".", link=f"/c/{conv}" if conv else "")
        return _pane(request, error=res.message)
    return JSONResponse({"resumed": res.resumed, "message": res.message, "tokens": res.tokens,
                         "seconds": round(res.seconds, 3),
                         "conversation_id": ctx.conversation_id if ctx else None})  # fmt: skip


async def rename_context(request: Request) -> Response:
    await check_csrf(request)
    f = await _fields(request)
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    try:
        ctx = store.rename(pid, cid, str(f.get("name") or ""))
    except EngineError as exc:
        return _error(exc, request)
    return _pane(request) if _htmx(request) else JSONResponse(ctx.to_dict())


async def delete_context(request: Request) -> Response:
    await check_csrf(request)
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    try:
        await asyncio.to_thread(store.delete, pid, cid)
    except EngineError as exc:
        return _error(exc, request)
    return _pane(request, note="Deleted.") if _htmx(request) else Response(status_code=204)


async def export_context(request: Request) -> Response:
    store, pid, cid = _store(request), request.path_params["project_id"], request.path_params["context_id"]
    try:
        await asyncio.to_thread(store.get, pid, cid)  # the id first: nothing is made for an unknown one
    except EngineError as exc:
        return _error(exc)
    tmp = Path(tempfile.mkdtemp(prefix="flashcode-export-"))
    try:
        path = await asyncio.to_thread(store.export, pid, cid, tmp)
    except BaseException as exc:
        _remove(tmp)  # nothing to send, nothing left behind
        if isinstance(exc, EngineError):
            return _error(exc)
        raise
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
        name = form.get("name")
        name = name if isinstance(name, str) and name else None
        ctx = await asyncio.to_thread(store.import_file, pid, dest, name)
    except EngineError as exc:
        return _error(exc, request)
    finally:
        _remove(tmp)
    if _htmx(request):
        return _pane(request, note=f"Imported {ctx.name!r}.")
    return JSONResponse(ctx.to_dict(), status_code=201)


context_routes = [
    Route("/projects/{project_id:str}/window", window),
    Route("/projects/{project_id:str}/contexts", list_contexts),
    Route("/projects/{project_id:str}/contexts", save_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/import", import_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/resume", resume_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/rename", rename_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/delete", delete_context, methods=["POST"]),
    Route("/projects/{project_id:str}/contexts/{context_id:str}/export", export_context),
]
