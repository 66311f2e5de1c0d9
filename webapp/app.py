"""The composition root: `create_app(settings, worker=None)`, the one place that wires the web app.

It opens the database (running its migrations, once), puts the engine on its worker thread (a
test or `flashcode serve` may pass its own, already loaded), builds the template environment,
each feature with what it needs, and the middleware, then mounts their routes:

    chat      the page, the websocket, the one reply pipeline        webapp.chat
    agent     slash commands and agent turns in the chat; rules     webapp.agent.web
    contexts  saved project contexts (the Projects window)          webapp.contexts
    projects  the project registry, dialogs, Files window, auto-resume  webapp.projects
    stats     the Stats window, reply numbers, /stats /cost ...     webapp.stats
    api       OpenAI-compatible /v1                                 webapp.api

Features never import each other; they meet here, through the interfaces in `webapp.turns`: the
chat hands the messages the agent wants to it (a `TurnHandler`), every stored reply goes to the
stats' `ReplyHook`, and the stats' slash commands are registered with the agent's `SlashCommands`
and answered by its `SlashHandler`. Everything is wired explicitly, here, so `/help` and the hooks
do not depend on what was imported first. Security that applies to every request (token, Host,
Origin and CSRF, headers) is `webapp.security`'s middleware.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine import paths
from engine.worker import Worker

from . import security
from .agent.agent import quote_untrusted
from .agent.mcp import shared as mcp_servers
from .agent.mcp_store import McpStore
from .agent.mcp_web import McpWeb
from .agent.slash import BUILTIN, SlashCommand, SlashCommands
from .agent.web import AgentWeb
from .api.openai import OpenAIAPI
from .chat.pages import ChatPages
from .chat.socket import ChatContext
from .chat.views import ChatViews
from .contexts.http import SavedContexts
from .db import Database, StorageError, storage_problem
from .engine_host import EngineState, start_worker
from .projects.resume import AutoResume
from .projects.store import ProjectStore
from .projects.web import ProjectsWeb
from .render import find_dir, make_environment
from .settings import Settings
from .stats.views import SLASH_COMMANDS as STATS_COMMANDS
from .stats.views import Stats
from .turns import ReplyHook

log = logging.getLogger(__name__)


@dataclass
class AppParts:
    """What `create_app` built, kept on `app.state.flashcode` for tests and debugging (features are
    handed what they need; none reads this)."""

    settings: Settings
    db: Database
    engine: EngineState
    csrf_token: str
    on_reply: list[ReplyHook]  # called by the reply pipeline after every stored chat reply
    slash: SlashCommands
    stats: Stats
    agent: AgentWeb
    projects: ProjectStore | None = None
    resume: AutoResume | None = None


def slash_commands() -> SlashCommands:
    """Every slash command the chat knows: the agent's own, then those the stats answer."""
    return SlashCommands(BUILTIN, (SlashCommand(c.name, c.help, c.usage) for c in STATS_COMMANDS))


async def http_error(request: Request, exc: Exception) -> PlainTextResponse:
    assert isinstance(exc, HTTPException)
    return PlainTextResponse(f"{exc.status_code}: {exc.detail}", status_code=exc.status_code)


async def server_error(request: Request, exc: Exception) -> PlainTextResponse:
    """A 500: one plain sentence (the traceback goes to the log, as uvicorn writes it), and the security
    headers too, which the middleware inside Starlette's error handler never gets to add."""
    response = PlainTextResponse(
        "500: flashcode failed to answer this request; its log (flashcode serve's output, logs/serve.log) "
        "says why",
        status_code=500,
    )
    return security.with_security_headers(response)


async def storage_error(request: Request, exc: Exception) -> PlainTextResponse:
    """The database could not be written (busy, disk full, read-only): a 503 whose sentence says what to do
    (the page shows it in an alert); any other database error is a 500."""
    if isinstance(exc, StorageError):
        return PlainTextResponse(f"503: {exc}", status_code=503)
    problem = storage_problem(exc, request.app.state.flashcode.db.path)
    if problem is None:
        log.error("database error on %s", request.url.path, exc_info=exc)
        return await server_error(request, exc)
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return PlainTextResponse(f"503: {problem}", status_code=503)


def _quote_file(source: str, text: str) -> str:
    """An attached file, quoted for the model as untrusted data (the agent's quoting)."""
    return quote_untrusted(source, text, limit=len(text) + 1)


def create_app(settings: Settings | None = None, worker: Worker | None = None) -> Starlette:
    settings = settings or Settings()
    own_worker = worker is None
    db = Database(paths.database_path(settings.data_dir))
    if db.recovered:
        log.warning("%d reply(s) cut by a previous crash were kept and marked incomplete", db.recovered)
    engine = EngineState(worker or start_worker(settings), options=dict(settings.backend_options))
    env = make_environment()
    csrf_token = security.new_token()
    on_reply: list[ReplyHook] = []

    projects = ProjectStore(db.conn, settings.data_dir)
    if settings.project_dir is not None:  # serve --project DIR: added if needed, and opened
        projects.open(projects.add(settings.project_dir).id)
    resume = AutoResume(settings.data_dir, engine.worker, db)
    engine.worker.on_submit.append(resume.generating)
    projects_web = ProjectsWeb(
        projects, env, _quote_file, on_switch=resume.save_now, on_remove=lambda: resume.flush()
    )  # a removal waits only for the saves being written (a new save of the live one would go in its folder)

    stats = Stats(db, settings.data_dir, env, engine.worker, csrf_token, projects=projects)
    on_reply.append(stats.record_chat_reply)
    on_reply.append(resume.note_reply)
    commands = slash_commands()
    agent = AgentWeb(
        db=db,
        engine=engine,
        settings=settings,
        env=env,
        commands=commands,
        slash_handlers={c.name: stats.answer_fragment for c in STATS_COMMANDS},
        projects=projects,
    )
    mcp = McpWeb(McpStore(db.conn), env, lambda: agent.project_for(None), projects)  # Settings › MCP servers
    contexts = SavedContexts(
        settings.data_dir,
        engine.worker,
        db,
        env,
        live=lambda: resume.live,
        before_resume=resume.save_now,
        after_resume=resume.took_over,
        known_project=lambda project_id: projects.get(project_id) is not None,
        make_live=resume.make_live,
    )
    api = OpenAIAPI(engine, stats.record_api_reply)
    views = ChatViews(env, db, engine, settings, csrf_token, projects=projects)
    pages = ChatPages(db, engine, views)
    views.render_event = agent.render_stored  # the transcript replays the agent's logged events
    pages.import_event = agent.views.importable  # an imported conversation's events, checked
    pages.on_deleted = resume.forget_deleted  # a conversation deleted for good takes its saved cache along
    views.slash_commands = tuple(
        {"name": c.name, "usage": c.usage, "help": c.help}
        for c in sorted(commands.commands.values(), key=lambda c: c.name)
    )
    chat = ChatContext(
        db=db, engine=engine, views=views, sampling=settings.sampling, hooks=on_reply, turns=agent.turns
    )
    chat.projects, chat.before_reply = projects, resume.before_reply
    pages.on_trashed = chat.stop_left  # a reply a closed window left writing there stops with it
    # an agent turn takes the engine (its router scores first): the live conversation is saved before it
    chat.before_turn = resume.generating
    chat.take_attachments = projects_web.take_attachments

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.refresh()
        try:  # the saved caches of conversations deleted for good meanwhile (30 days in the Trash, a crash)
            await resume.forget_deleted()
        except Exception:  # noqa: BLE001 - a leftover cache must not stop the server
            log.warning("removing deleted conversations' saved caches failed", exc_info=True)
        try:
            yield
        finally:
            await chat.close_left()  # replies closed windows left writing: stopped and saved before the rest
            await resume.save_now()  # the live conversation's KV cache, for the next start
            await mcp_servers().close_all()  # every MCP server the agent started
            await resume.flush()  # a save a reply that ended meanwhile left behind it
            if own_worker:
                engine.worker.close()
            db.close()

    app = Starlette(
        routes=[
            *pages.routes,
            *agent.routes,
            *mcp.routes,
            *projects_web.routes,
            *contexts.routes,
            *stats.routes,
            *api.routes,
            WebSocketRoute("/ws", chat.endpoint),
            Mount("/static", StaticFiles(directory=find_dir("static")), name="static"),
        ],
        middleware=security.middleware(settings, csrf_token),
        exception_handlers={
            HTTPException: http_error,
            sqlite3.OperationalError: storage_error,
            StorageError: storage_error,
            500: server_error,
        },
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.flashcode = AppParts(settings, db, engine, csrf_token, on_reply, commands, stats, agent)
    app.state.flashcode.projects, app.state.flashcode.resume = projects, resume
    return app
