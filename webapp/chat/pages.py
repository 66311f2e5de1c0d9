"""Thin HTTP handlers: the page, conversation fragments, rename/delete (CSRF-checked), exports.

What it knows: URLs, the CSRF rule and how to answer htmx (a fragment for `HX-Request`, the full
page otherwise). What it does not know: SQL (`webapp.db`) or HTML layout (`webapp.views`).

CSRF: a state-changing request must carry the per-process token (header `X-CSRF-Token`, which the
page puts in `hx-headers`, or a `csrf_token` form field) and, when it has an Origin header, an allowed
Origin. Another site cannot read the token: there is no CORS header anywhere.
"""

from __future__ import annotations

import json
import re
import secrets

from jinja2_fragments import render_block
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .agent.web import ROUTES as agent_routes
from .contexts import context_routes
from .db import Conversation, export_json, export_markdown
from .render import pygments_css
from .state import AppState

MAX_TITLE_CHARS = 120


def _state(request: Request) -> AppState:
    return request.app.state.flashcode


async def check_csrf(request: Request) -> None:
    state = _state(request)
    origin = request.headers.get("origin")
    if origin is not None and origin not in state.settings.allowed_origins:
        raise HTTPException(403, f"cross-origin request from {origin} refused")
    token = request.headers.get("x-csrf-token")
    if token is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form", "multipart/")
    ):
        token = str((await request.form()).get("csrf_token") or "")
    if not token or not secrets.compare_digest(token, state.csrf_token):
        raise HTTPException(403, "missing or stale CSRF token: reload the page and try again")


def _conversation(request: Request) -> Conversation:
    conv = _state(request).db.get_conversation(request.path_params["conversation_id"])
    if conv is None:
        raise HTTPException(404, "no such conversation (it may have been deleted)")
    return conv


# ------------------------------------------------------------------ pages
def _page(request: Request, conversation_id: str | None) -> HTMLResponse:
    views = _state(request).views
    ctx = views.page_context(conversation_id)
    if request.headers.get("hx-request") and request.headers.get("hx-target") == "chat-window":
        return HTMLResponse(render_block(views.env, "page.html", "chat_window", **ctx))
    return HTMLResponse(views.env.get_template("page.html").render(**ctx))


async def index(request: Request) -> HTMLResponse:
    return _page(request, None)


async def conversation_page(request: Request) -> HTMLResponse:
    return _page(request, _conversation(request).id)


async def conversation_list(request: Request) -> HTMLResponse:
    current = request.query_params.get("current")
    return HTMLResponse(_state(request).views.conversation_list_plain(current))


# ------------------------------------------------------------------ changes
async def rename(request: Request) -> HTMLResponse:
    await check_csrf(request)
    conv = _conversation(request)
    form = await request.form()
    title = " ".join(str(form.get("title") or request.headers.get("hx-prompt") or "").split())[
        :MAX_TITLE_CHARS
    ]
    if not title:
        raise HTTPException(400, "a title cannot be empty")
    state = _state(request)
    state.db.rename_conversation(conv.id, title)
    body = state.views.conversation_list_plain(conv.id) + state.views.chat_title(title)
    return HTMLResponse(body)


async def delete(request: Request) -> Response:
    await check_csrf(request)
    conv = _conversation(request)
    state = _state(request)
    state.db.delete_conversation(conv.id)
    current_url = request.headers.get("hx-current-url", "")
    if re.search(rf"/c/{re.escape(conv.id)}(?:[?#]|$)", current_url):
        return Response(status_code=200, headers={"HX-Redirect": "/"})
    return HTMLResponse(state.views.conversation_list_plain(None))


# ------------------------------------------------------------------ exports and assets
def _filename(conv: Conversation, ext: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", conv.title).strip("-")[:60] or "conversation"
    return f"{stem}-{conv.id}.{ext}"


async def export_md(request: Request) -> PlainTextResponse:
    conv = _conversation(request)
    text = export_markdown(conv, _state(request).db.messages(conv.id))
    return PlainTextResponse(text, media_type="text/markdown; charset=utf-8",
                             headers={"Content-Disposition": f'attachment; filename="{_filename(conv, "md")}"'})  # fmt: skip


async def export_json_route(request: Request) -> Response:
    conv = _conversation(request)
    data = export_json(conv, _state(request).db.messages(conv.id))
    return Response(json.dumps(data, indent=2, ensure_ascii=False), media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{_filename(conv, "json")}"'})  # fmt: skip


async def pygments_stylesheet(request: Request) -> Response:
    return Response(pygments_css(), media_type="text/css", headers={"Cache-Control": "max-age=3600"})


async def health(request: Request) -> JSONResponse:
    e = _state(request).engine
    return JSONResponse(
        {"ok": True, "backend": e.backend, "model": e.model, "context_length": e.context_length}
    )


routes = [
    Route("/", index),
    Route("/health", health),
    Route("/conversations", conversation_list),
    Route("/c/{conversation_id:str}", conversation_page),
    Route("/c/{conversation_id:str}/rename", rename, methods=["POST"]),
    Route("/c/{conversation_id:str}/delete", delete, methods=["POST"]),
    Route("/c/{conversation_id:str}/export.md", export_md),
    Route("/c/{conversation_id:str}/export.json", export_json_route),
    Route("/static/pygments.css", pygments_stylesheet),
    *agent_routes,  # issue 4: GET /agent/rules, POST /agent/rules/{id}/delete (Settings)
    *context_routes,  # issue 6: /projects/{id}/window and /projects/{id}/contexts... (Projects)
]
