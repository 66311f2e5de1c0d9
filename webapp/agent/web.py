"""The agent inside the web app: runs agent turns for one websocket `Session` (webapp/ws.py).

What it knows: the Session's small surface — `send(fragment)`, `ask(dialog_html, dialog_id)`,
`cancel` (what Stop calls), `state.db` / `state.views` / `state.engine` / `state.settings` — and how
to turn agent events into fragments (`AgentViews`) and the answer into a stored, streamed reply
(the Session's own `TokenBatcher`). What it does not know: the socket itself, MLX, HTML layout.

One `AgentSession` per conversation, created on first use with the conversation's stored messages
as history. The project directory is `settings.project_dir` when the web app has one, else the
directory `flashcode serve` was started in.
"""

from __future__ import annotations

import html
import logging
import uuid
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from engine.base import SamplingParams

from .. import stats_view
from . import events as ev
from .agent import AgentSession
from .sandbox import detect
from .search import DDGSProvider
from .store import AgentStore, ensure_schema
from .views import AgentViews

log = logging.getLogger(__name__)
DIALOG_TIMEOUT_S = 300.0
# Conversations start in plain chat ("raw"); `/agent` turns routing on. Flip to "agent" once the UI
# has a visible mode switch (the browser test types a story prompt and expects a plain reply).
DEFAULT_MODE = "raw"


class AgentBridge:
    def __init__(self, session: Any) -> None:
        self.session = session
        state = session.state
        self.views = AgentViews(state.views.env)
        ensure_schema(state.db.conn)  # idempotent; db.py also lists store.MIGRATIONS
        self.store = AgentStore(state.db.conn)
        self.search = DDGSProvider()  # one per socket: its cache lives as long as the tab
        self.agents: dict[str, AgentSession] = {}
        self._synced: dict[str, int] = {}  # stored message count after the last agent turn

    @property
    def project_dir(self) -> Path:
        return Path(getattr(self.session.state.settings, "project_dir", None) or Path.cwd())

    def _stored_history(self, conversation_id: str) -> list[dict[str, str]]:
        """The conversation as stored, minus the message of the turn being run."""
        rows = self.session.state.db.messages(conversation_id)
        return [
            {"role": m.role, "content": m.content}
            for m in rows[:-1]
            if m.role in ("user", "assistant") and m.content
        ]

    def agent_for(self, conversation_id: str) -> AgentSession:
        agent = self.agents.get(conversation_id)
        if (
            agent is not None
            and self._synced.get(conversation_id) != len(self.session.state.db.messages(conversation_id)) - 1
        ):
            agent.history = self._stored_history(conversation_id)  # plain-chat turns happened in between
        if agent is None:
            history = self._stored_history(conversation_id)
            sampling = SamplingParams(**self.session.state.sampling)
            agent = AgentSession(self.session.state.engine.worker, self.project_dir, request_approval=self.approve,
                                 store=self.store, search=self.search, conversation_id=conversation_id,
                                 sampling=sampling, history=history, approval_timeout_s=DIALOG_TIMEOUT_S,
                                 on_model=self._switch_model, hidden=(self.session.state.settings.data_dir,))  # fmt: skip
            agent.mode = DEFAULT_MODE  # type: ignore[assignment]
            self.agents[conversation_id] = agent
        return agent

    def wants(self, conversation_id: str, text: str) -> bool:
        """Whether this message is the agent's: a slash command, or any message in agent mode."""
        agent = self.agents.get(conversation_id)
        mode = agent.mode if agent is not None else DEFAULT_MODE
        return text.lstrip().startswith("/") or mode == "agent"

    async def approve(self, proposal: ev.Proposal) -> ev.Decision:
        dialog_id = f"a{proposal.action_id}-{uuid.uuid4().hex[:8]}"
        try:
            answer = await self.session.ask(self.views.approval_dialog(proposal, dialog_id), dialog_id)
        finally:
            self.session.dialogs.pop(dialog_id, None)
            self.session.send(self.views.dialog_closed(dialog_id))
        network = answer.network if proposal.tool == "shell" else None
        return ev.Decision.from_answer(answer.choice, answer.note, network)

    async def _switch_model(self, name: str) -> None:
        engine = self.session.state.engine
        try:
            await engine.switch(engine.backend or "mlx", name)
        except Exception as exc:  # noqa: BLE001 - shown; the engine keeps or restores a model
            self.session.error(f"could not load {name}: {exc}")
        self.session.send(self.session.state.views.model_picker())

    async def run_turn(self, conversation_id: str, text: str) -> None:
        """One agent turn for a user message already stored and shown (run as the Session's task)."""
        s, db, views = self.session, self.session.state.db, self.session.state.views
        agent = self.agent_for(conversation_id)
        reply: Any = None
        route: str | None = None
        parts: list[str] = []
        s.cancel = agent.stop
        s.send(views.controls(generating=True))
        try:
            async for e in agent.run_turn(text):
                if isinstance(e, ev.RouteChosen):
                    route = e.route
                if isinstance(e, ev.SlashUnhandled) and e.name in stats_view.SLASH_NAMES:
                    s.send(await stats_view.answer_fragment(s.state, e.name, e.arg, conversation_id))
                elif isinstance(e, ev.AnswerDelta):
                    if reply is None:
                        reply = db.add_message(conversation_id, "assistant", "", status="streaming")
                        s.send(views.append_message(reply))
                    parts.append(e.text)
                    s.send(
                        f'<div id="msg-{reply.id}-body" hx-swap-oob="beforeend">{html.escape(e.text, quote=False)}</div>'
                    )
                elif isinstance(e, ev.AnswerDone) and reply is not None:
                    status = {"stop": "complete", "length": "complete", "cancelled": "stopped"}.get(
                        e.finish_reason, "error"
                    )
                    stats = e.stats | {"finish_reason": e.finish_reason}
                    db.finish_message(reply.id, e.text, status, stats)
                    for hook in s.state.on_reply:
                        hook(s.state, stats, conversation_id=conversation_id, message_id=reply.id, route=route)
                    s.send(views.replace_message(db.messages(conversation_id)[-1]))
                elif fragment := self.views.event(e):
                    s.send(fragment)
        except Exception as exc:  # noqa: BLE001 - shown to the user; the socket lives on
            log.exception("agent turn failed")
            s.error(f"the agent failed: {type(exc).__name__}: {exc}")
        finally:
            s.cancel = None
            self._synced[conversation_id] = len(db.messages(conversation_id))
            last = db.messages(conversation_id)[-1]
            if (
                reply is not None and last.id == reply.id and last.status == "streaming"
            ):  # cut off: keep the text
                db.finish_message(reply.id, "".join(parts), "stopped")
            s.send(views.controls(generating=False, can_regenerate=False))


# --------------------------------------------------------------------------- Settings: allow rules
def project_key(settings: Any) -> str:
    """The project the web app's agent works in (as `AgentSession.project` names it)."""
    return str(Path(getattr(settings, "project_dir", None) or Path.cwd()).resolve())


def _rules_html(request: Request) -> HTMLResponse:
    state = request.app.state.flashcode
    ensure_schema(state.db.conn)
    project = project_key(state.settings)
    store = AgentStore(state.db.conn)
    ui = AgentViews(state.views.env).ui
    return HTMLResponse(str(ui.allow_rules(store.list_rules(project), project, detect(), store.network_allowed(project))))


async def rules_fragment(request: Request) -> HTMLResponse:
    """GET /agent/rules: the current project's allow rules, for the Settings window."""
    return _rules_html(request)


async def delete_rule(request: Request) -> HTMLResponse:
    """POST /agent/rules/{rule_id}/delete (CSRF-checked): remove one rule, answer with the new list."""
    from webapp.routes import check_csrf

    await check_csrf(request)
    state = request.app.state.flashcode
    ensure_schema(state.db.conn)
    AgentStore(state.db.conn).remove_rule(project_key(state.settings), int(request.path_params["rule_id"]))
    return _rules_html(request)


async def set_network(request: Request) -> HTMLResponse:
    """POST /agent/network (CSRF-checked): the project's network switch (form field `network=on`)."""
    from webapp.routes import check_csrf

    await check_csrf(request)
    state = request.app.state.flashcode
    ensure_schema(state.db.conn)
    form = await request.form()
    AgentStore(state.db.conn).set_network_allowed(project_key(state.settings), form.get("network") == "on")
    return _rules_html(request)


ROUTES = [
    Route("/agent/rules", rules_fragment),
    Route("/agent/network", set_network, methods=["POST"]),
    Route("/agent/rules/{rule_id:int}/delete", delete_rule, methods=["POST"]),
]
