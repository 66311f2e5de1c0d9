"""The agent inside the web app: the chat messages it answers, and the Settings window's rules.

`AgentWeb` is built once per app by `create_app`. Its `turns()` makes one `AgentTurns` per websocket
(a `webapp.turns.TurnHandler`): it wants slash commands and every message of a conversation in
agent mode, runs them as `AgentSession` turns, draws their events (`AgentViews`), asks approvals
through the chat's dialogs, and writes answers through the chat's one reply pipeline (the `Turn`'s
`start_reply`). Slash commands other features own come back from the agent as `SlashUnhandled`
and go to their `SlashHandler`. What it does not know: the socket, MLX, HTML layout.

One `AgentSession` per conversation and socket, created on first use with the conversation's
stored messages as history. It works in the conversation's project (`webapp.turns.ProjectLookup`):
its directory, its allow rules and network switch (keyed by the project's id). Without a project
lookup (a bare test app) the project is `settings.project_dir`, else the working directory.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine.base import SamplingParams
from engine.models import find_model
from engine.registry import BACKENDS

from ..db import Database
from ..engine_host import EngineState
from ..settings import Settings
from ..turns import (
    NEW_MODE_KEY,
    PROJECT_REMOVED,
    ProjectLookup,
    ProjectRef,
    ReplyWriter,
    SlashHandler,
    Turn,
    for_the_model,
)
from . import events as ev
from .agent import AgentSession, tools_note
from .files import FileToolError, ProjectFiles
from .sandbox import ProjectMovedError, detect, pinned_project
from .search import DDGSProvider
from .shell import as_typed, validate_rule
from .slash import SlashCommands
from .store import AgentStore, FileChangeRecord
from .undo import record_undo, undo_refusal, undo_write
from .views import SLASH_OUTPUT, AgentViews

log = logging.getLogger(__name__)
DIALOG_TIMEOUT_S = 300.0
# A conversation's mode is stored with it (`conversations.mode`: chat | agent) and shown in the chat
# window's toolbar; conversations start in chat; `/agent` or the toolbar turns routing on.
DEFAULT_MODE = "chat"
# an open dialog when its page goes away (closed, reloaded): the call is not run, and nobody denied it
CLOSED_REASON = "not decided: the page was closed or reloaded while it asked"
CLOSED_RUNNING = (
    "stopped: the page was closed or reloaded while it ran"  # a command's (it said "by the user")
)


def project_key(settings: Settings) -> str:
    """Without projects: the key of the directory the agent works in (as `AgentSession.project` names it)."""
    return str(Path(settings.project_dir or Path.cwd()).resolve())


def hidden_paths(data_dir: Path) -> tuple[Path, ...]:
    """What a command never sees: flashcode's data directory, all of it. For a project inside it (the
    scratch project) the sandbox empties the directory and mounts the project back into it, so what
    flashcode adds there later (another project's saved contexts) is hidden too."""
    return (Path(data_dir).resolve(),)


class AgentWeb:
    def __init__(
        self,
        *,
        db: Database,
        engine: EngineState,
        settings: Settings,
        env: Environment,
        commands: SlashCommands,
        slash_handlers: Mapping[str, SlashHandler],
        projects: ProjectLookup | None = None,
    ) -> None:
        self.db, self.engine, self.settings, self.projects = db, engine, settings, projects
        self.views = AgentViews(env)
        self.store = AgentStore(db.conn)
        self.commands = commands
        self.slash_handlers = dict(slash_handlers)

    def turns(self) -> AgentTurns:
        return AgentTurns(self)

    @property
    def project_dir(self) -> Path:
        return Path(self.settings.project_dir or Path.cwd())

    def project_for(self, conversation_id: str | None) -> ProjectRef:
        """The project a conversation's agent works in (the open one for a new conversation)."""
        if self.projects is not None:
            return self.projects.of_conversation(conversation_id)
        return ProjectRef(project_key(self.settings), "", self.project_dir)

    def _current_key(self) -> str:
        return self.project_for(None).id

    # ------------------------------------------------------------------ Settings: allow rules
    @property
    def routes(self) -> list[Route]:
        return [
            Route("/agent/rules", self.rules_fragment),
            Route("/agent/network", self.set_network, methods=["POST"]),
            Route("/agent/approve-edits", self.set_approve_edits, methods=["POST"]),
            Route("/agent/rules", self.add_rule, methods=["POST"]),
            Route("/agent/rules/{rule_id:int}/delete", self.delete_rule, methods=["POST"]),
            Route("/agent/changes/{action_id:int}/undo", self.undo_change, methods=["POST"]),
            Route("/agent/changes/{action_id:int}/before", self.change_before),
        ]

    def _rules_html(self, error: str = "", typed: tuple[str, str] = ("exact", "")) -> HTMLResponse:
        current = self.project_for(None)
        project = current.id
        rules = self.store.list_rules(project)
        shown = f"{current.name} ({current.path})" if current.name else str(current.path)
        html = self.views.ui.allow_rules(
            rules,
            shown,
            project,
            detect(),
            self.store.network_allowed(project),
            self.store.edits_approved(project),
            error=error,
            typed=typed,
        )
        return HTMLResponse(str(html), status_code=400 if error else 200)

    def _stale(self, form: Any) -> bool:
        """Whether a Settings form was drawn for another project than the one open now (another window opened
        one since): its change would land on a project the user was not looking at."""
        return str(form.get("project") or "") != self._current_key()

    STALE = (
        "another project was opened since this window showed its settings; they are shown now, check them and"
    )

    async def add_rule(self, request: Request) -> HTMLResponse:
        """POST /agent/rules (`kind` exact or prefix, `pattern`): a rule typed in Settings, checked as one made
        from an approval dialog is (a prefix only from the table of safe ones); a refusal says why, keeping what
        was typed."""
        form = await request.form()
        kind, pattern = str(form.get("kind") or "exact"), str(form.get("pattern") or "")
        if self._stale(form):
            return self._rules_html(f"Not added: {self.STALE} add it again", (kind, pattern))
        project = self._current_key()
        try:
            rule = validate_rule(kind, pattern)  # type: ignore[arg-type]
            if any((r.kind, r.pattern) == (rule.kind, rule.pattern) for r in self.store.list_rules(project)):
                raise ValueError(f"the {rule.kind} rule {as_typed(rule.pattern)} is on the list already")
            self.store.add_rule(project, rule.kind, rule.pattern)
        except ValueError as exc:  # a rule on the list already said nothing (walkthrough)
            return self._rules_html(f"Not added: {exc}", (kind, pattern))
        return self._rules_html()

    async def rules_fragment(self, request: Request) -> HTMLResponse:
        """GET /agent/rules: the current project's allow rules, for the Settings window."""
        return self._rules_html()

    async def delete_rule(self, request: Request) -> HTMLResponse:
        """POST /agent/rules/{rule_id}/delete: remove one rule, answer with the new list."""
        if self._stale(await request.form()):
            return self._rules_html(f"Not removed: {self.STALE} remove it again")
        self.store.remove_rule(self._current_key(), int(request.path_params["rule_id"]))
        return self._rules_html()

    async def set_network(self, request: Request) -> HTMLResponse:
        """POST /agent/network: the project's network switch (form field `network=on`)."""
        form = await request.form()
        if self._stale(form):
            return self._rules_html(f"Not changed: {self.STALE} change it again")
        self.store.set_network_allowed(self._current_key(), form.get("network") == "on")
        return self._rules_html()

    async def set_approve_edits(self, request: Request) -> HTMLResponse:
        """POST /agent/approve-edits: "auto-approve file edits in this project" (`approve_edits=on`)."""
        form = await request.form()
        if self._stale(form):
            return self._rules_html(f"Not changed: {self.STALE} change it again")
        self.store.set_edits_approved(self._current_key(), form.get("approve_edits") == "on")
        return self._rules_html()

    # ------------------------------------------------------------------ undoing a file change
    def render_stored(self, type: str, data: Mapping[str, Any]) -> str:
        """A logged event, drawn as live (`webapp.turns.EventRenderer`); a file write's Undo as it stands now."""
        if type == ev.FileWritten.type and data.get("undo"):
            change = self.store.file_change(int(data.get("action_id") or 0))
            state = "" if change is None else "done" if change.undone_at else "offer"
            data = {**data, "undo": state, "undo_refused": "", "undo_before": False}  # never a file's own
            if (
                change is not None and state == "offer"
            ):  # after a reload, an Undo that would only be refused is not offered
                project = self._project_of(change)
                refusal = undo_refusal(
                    change, project.path if project else None, hidden_paths(self.settings.data_dir)
                )
                if refusal is not None:
                    data |= {
                        "undo": "refused",
                        "undo_refused": f"Cannot be undone now: {refusal}.",
                        "undo_before": change.before is not None,
                    }
        return self.views.stored(type, data)

    def _project_of(self, change: FileChangeRecord) -> ProjectRef | None:
        if self.projects is not None:
            return self.projects.get(change.project)
        here = self.project_for(None)
        return here if here.id == change.project else None

    def _undo_html(self, change: FileChangeRecord, state: str, error: str = "") -> HTMLResponse:
        """The card's Undo control for `change`, as it stands (the caller has the record: not read again)."""
        ui = self.views.ui
        return HTMLResponse(
            str(ui.undo_control(change.action_id, state, error, change.before is not None, change.path))
        )

    async def undo_change(self, request: Request) -> HTMLResponse:
        """POST /agent/changes/{action_id}/undo: put back what one write of the agent's file tools replaced
        (remove the file it made), while the file still holds what it wrote; the transcript says so. A refusal
        says why, in the card, and offers the earlier text to download."""
        action_id = int(request.path_params["action_id"])
        change = self.store.file_change(action_id)
        if change is None:
            refused = self.views.ui.undo_control(
                action_id, "", "flashcode kept no earlier text for this write"
            )
            return HTMLResponse(str(refused))
        if change.undone_at:
            return self._undo_html(change, "done")
        project = self._project_of(change)
        if project is None:
            return self._undo_html(
                change,
                "offer",
                "its project was removed from flashcode: add its folder again (File › New Project…), then Undo",
            )
        hidden = hidden_paths(self.settings.data_dir)
        try:
            text = await asyncio.to_thread(undo_write, change, project.path, hidden)
        except FileToolError as exc:
            return self._undo_html(change, "offer", f"Not undone: {exc}.")
        said = record_undo(self.store, self.db, change, text)
        return HTMLResponse(str(self.views.ui.undo_control(action_id, "done")) + self.views.event(said))

    async def change_before(self, request: Request) -> Response:
        """GET /agent/changes/{action_id}/before: the text a write replaced, as a file to download."""
        change = self.store.file_change(int(request.path_params["action_id"]))
        if change is None or change.before is None:
            what = "that write made the file: it had no earlier text" if change else "no such file change"
            return PlainTextResponse(f"Not found: {what}.", status_code=404)
        name = Path(change.path).name + ".before"
        return PlainTextResponse(
            change.before,
            headers={"Content-Disposition": f"attachment; filename*=UTF-8''{quote(name, safe='')}"},
        )


def undo_note(path: str) -> list[dict[str, str]]:
    """What the model is told of a write undone from its card (as `/read` tells it of a file: said, then
    heard). Not "your write": a `/write` the user typed is undone the same way."""
    return [
        {
            "role": "user",
            "content": f"The write of {path} was undone: it holds what it held before that write.",
        },
        {"role": "assistant", "content": f"Understood: I will read {path} again before I change it."},
    ]


class AgentTurns:
    """The agent's side of one websocket (a `webapp.turns.TurnHandler`)."""

    def __init__(self, web: AgentWeb) -> None:
        self.web = web
        self.search = DDGSProvider()  # one per socket: its cache lives as long as the tab
        self.agents: dict[str, AgentSession] = {}
        self._synced: dict[str, int] = {}  # stored message count after the last agent turn
        self._undone_seen: dict[str, int] = {}  # writes undone from their cards, in the agent's history
        self._turn: Turn | None = None  # the turn being run (one at a time per socket)
        self._step_id: str | None = None  # its tool-loop step running now (its card's id)
        self._said_next = False  # the no-tools note was shown for the next new conversation (not said again)

    def _stored_history(self, conversation_id: str) -> list[dict[str, str]]:
        """The conversation as stored, minus the message of the turn being run; a write undone from its card
        is said where it happened (the model would take the file for what it wrote)."""
        rows = self.web.db.messages(conversation_id)
        start = self.web.db.context_start(conversation_id)  # nothing from before a /clear
        items: list[tuple[int, int, list[dict[str, str]]]] = [
            (m.id, 0, [{"role": m.role, "content": m.content}])
            for m in rows[:-1]
            if m.role in ("user", "assistant")
            and m.content
            and m.id > start
            and (
                m.role != "user" or for_the_model(m.content)
            )  # not /model, /help, /stats: the transcript's only
        ]
        last = rows[-1].id if rows else 0
        items += [
            (after, 1, undo_note(path))
            for after, path in self._undone(conversation_id)
            if start < after < last  # not one undone while this turn's message was sent
        ]
        return [said for *_, pair in sorted(items, key=lambda i: i[:2]) for said in pair]

    def _undone(self, conversation_id: str) -> list[tuple[int, str]]:
        """The conversation's logged undos, as (the message they came after, the path), of writes this database
        undid: an imported conversation's name writes of another one (renumbered, they name none here), and
        their paths would be the file's words."""
        found = []
        for e in self.web.db.events(conversation_id, ev.FileUndone.type):
            change = self.web.store.file_change(int(e.data.get("action_id") or 0))
            if change is not None and change.undone_at:
                found.append((e.after_message, change.path))
        return found

    async def mode_note(self, conversation_id: str | None) -> tuple[str, str]:
        """The Mode menu chose Agent for this conversation (None: the next one): what its agent would say about
        the loaded model (it takes no tools: turns are routed, and which model would work, offered by name),
        empty when it takes them."""
        if conversation_id is None:
            note, offer = await tools_note(self.web.engine.worker)
            self._said_next = bool(note)
            return note, offer
        return await self.agent_for(conversation_id).tools_note()

    def agent_for(self, conversation_id: str, files: ProjectFiles | None = None) -> AgentSession:
        """The conversation's agent, made at its first turn (`files`: its project's, made off the event loop)."""
        web = self.web
        agent = self.agents.get(conversation_id)
        undone = self._undone(conversation_id)
        if agent is not None:
            if self._synced.get(conversation_id) != len(web.db.messages(conversation_id)) - 1:
                agent.history = self._stored_history(conversation_id)  # plain-chat turns happened in between
            else:  # writes undone since its last turn: said after it (what only the session holds is kept)
                for _, path in undone[self._undone_seen.get(conversation_id, 0) :]:
                    agent.history += undo_note(path)
        self._undone_seen[conversation_id] = len(undone)
        if agent is None:
            project = web.project_for(conversation_id)
            agent = AgentSession(
                web.engine.worker,
                project.path,
                project=project.id,
                request_approval=self.approve,
                store=web.store,
                search=self.search,
                conversation_id=conversation_id,
                history=self._stored_history(conversation_id),
                approval_timeout_s=DIALOG_TIMEOUT_S,
                on_model=self._switch_model,
                check_model=self._check_model,
                hidden=hidden_paths(web.settings.data_dir),
                commands=web.commands,
                files=files,
            )
            self.agents[conversation_id] = agent
            if self._said_next:  # shown when Agent was chosen for this (then new) conversation
                agent._said_no_tools, self._said_next = True, False
        agent.mode = "agent" if self._mode(conversation_id) == "agent" else "raw"  # the stored mode
        return agent

    def _mode(self, conversation_id: str) -> str:
        conv = self.web.db.get_conversation(conversation_id)
        return conv.mode if conv is not None else DEFAULT_MODE

    def wants(self, conversation_id: str, text: str) -> bool:
        """Whether this message is the agent's: a slash command, or any message in agent mode."""
        return text.lstrip().startswith("/") or self._mode(conversation_id) == "agent"

    async def approve(self, proposal: ev.Proposal) -> ev.Decision:
        assert self._turn is not None
        turn, views = self._turn, self.web.views
        dialog_id = f"a{proposal.action_id}-{uuid.uuid4().hex[:8]}"
        step = self._step_id  # the tool-loop step whose call this is (None: a slash command's)
        turn.status("Waiting for your approval…")
        if step:
            turn.send(views.step_waiting(step, True))
        try:
            answer = await turn.ask(views.approval_dialog(proposal, dialog_id), dialog_id)
        finally:
            turn.send(views.dialog_closed(dialog_id))
            turn.status(None)
            if step:
                turn.send(views.step_waiting(step, False))
        network = answer.network if proposal.tool == "shell" else None
        return ev.Decision.from_answer(answer.choice, answer.note, network)

    @staticmethod
    def _backend_model(name: str, loaded_backend: str | None) -> tuple[str, str]:
        """/model's NAME as (backend, model): `BACKEND:NAME`, as the API takes it, picks both."""
        backend, sep, model = name.partition(":")
        if not (sep and backend in BACKENDS and model.strip()):
            backend, model = loaded_backend or "mlx", name
        return backend, model.strip()

    async def _check_model(self, name: str) -> str | None:
        """Why /model NAME cannot load (no installed model of that name), said instead of "Switching to …"."""
        _, model = self._backend_model(name, self.web.engine.backend)
        try:
            await asyncio.to_thread(find_model, model)
        except Exception as exc:  # noqa: BLE001 - shown; nothing was unloaded
            return f"Could not load {name}: {exc}"
        return None

    async def _switch_model(self, name: str) -> tuple[str | None, str]:
        """/model NAME: (None, the model loaded: NAME may be the start of its name); else (why not, which the
        transcript keeps under "Switching to …", the model still loaded)."""
        engine, turn = self.web.engine, self._turn
        assert turn is not None
        failed = None
        backend, model = self._backend_model(name, engine.backend)
        try:
            await engine.switch(backend, model)
        except Exception as exc:  # noqa: BLE001 - shown; the engine keeps or restores a model
            failed = f"Could not load {name}: {exc}"
        else:
            self.web.db.remember_model(engine.backend, engine.model)
        turn.model_changed()
        return failed, engine.model or ""

    async def run(self, turn: Turn, text: str) -> None:
        """One agent turn for a user message already stored and shown."""
        conversation_id, db = turn.conversation_id, self.web.db
        conv, projects = db.get_conversation(conversation_id), self.web.projects
        if conv is not None and projects is not None and projects.get(conv.project_id) is None:
            removed = ev.Notice(PROJECT_REMOVED, "warning")  # never the open project's folder instead
            db.add_event(conversation_id, removed.type, removed.to_dict())
            turn.send(self.web.views.event(removed))
            return
        project = self.web.project_for(conversation_id)
        if not project.path.is_dir():  # moved or deleted since: nothing can run there, and nothing is lost
            gone = ev.Notice(
                f"The folder of project {project.name}, {project.path}, is gone (moved or deleted), so the agent "
                "cannot work in it and nothing was run. Put the folder back, or point the project at its new "
                f"place: flashcode projects move {shlex.quote(project.name)} NEW-FOLDER (its conversations stay).",
                "warning",
            )
            db.add_event(conversation_id, gone.type, gone.to_dict())
            turn.send(self.web.views.event(gone))
            return
        try:  # swapped for a symbolic link since it was added (it led to the home folder): nothing runs there
            pinned_project(project.path)
        except ProjectMovedError as exc:
            moved = ev.Notice(f"{str(exc)[:1].upper()}{str(exc)[1:]}.", "warning")
            db.add_event(conversation_id, moved.type, moved.to_dict())
            turn.send(self.web.views.event(moved))
            return
        files = None
        if conversation_id not in self.agents:  # its file tools walk the project (data directories): not here
            try:
                files = await asyncio.to_thread(
                    ProjectFiles, project.path, hidden_paths(self.web.settings.data_dir)
                )
            except FileToolError:
                files = None  # made (and its error raised) where it always was
        agent = self.agent_for(conversation_id, files)
        # under the turn's values (the chat gives them all): the agent's defaults
        settings = self.web.settings
        agent.sampling = SamplingParams(**(settings.sampling | settings.agent_sampling | dict(turn.sampling)))
        agent.approve_edits = self.web.store.edits_approved(agent.project)  # Settings' switch, read each turn
        self._turn = turn
        reply: ReplyWriter | None = None
        route: str | None = None
        answered = completed = limited = tool_turn = False  # a reply; ran to its end; step limit; tool loop
        steps = 0
        reading = False  # the status bar says the prompt is being read
        asking = ""  # the tool of the proposal last made (a command's runs once approved)
        # the user's Stop, or the page going away (then no one decided what the dialog asked)
        turn.on_stop(
            lambda: (
                agent.stop(CLOSED_REASON, CLOSED_RUNNING)
                if turn.closing
                else agent.stop("stopped by the user")
            )
        )
        try:
            async for e in agent.run_turn(text, turn.attached):
                if isinstance(e, ev.Reading):
                    reading = True
                    turn.status(
                        f"Reading the prompt… {e.processed:,} / {e.total:,} tokens"
                        if e.processed
                        < e.total  # then the prompt is read: a tool call shows nothing until whole
                        else f"Writing… (the {e.total:,}-token prompt is read)"
                    )
                    continue
                if reading:  # the model writes (words, or a tool call that follows)
                    reading = False
                    turn.status(None)
                # the status bar says what the turn waits for: it said "Writing…" while a command ran (walkthrough)
                if isinstance(e, ev.Proposal):
                    asking = e.tool
                    if not e.allowed_by_rule:
                        turn.status("Waiting for your approval…")
                elif isinstance(e, ev.Decided):
                    runs = asking == "shell" and e.decision not in ("deny", "timeout")
                    turn.status("Running the command… Stop stops it." if runs else None)
                elif isinstance(e, ev.ActionExit):
                    turn.status(None)
                limited = limited or isinstance(e, ev.StepLimitReached)
                tool_turn = tool_turn or (isinstance(e, ev.TurnDone) and e.route == "tools")
                if isinstance(e, ev.Generated | ev.ToolStep) and route is None:
                    route = "tools"  # the tool loop's steps and answer (Stats' grades tell them from chat)
                if isinstance(e, ev.RouteChosen):
                    route = e.route
                if isinstance(e, ev.ModeChanged):
                    db.set_mode(conversation_id, "agent" if e.mode == "agent" else "chat")
                    db.set_setting(
                        NEW_MODE_KEY, "agent" if e.mode == "agent" else "chat"
                    )  # as the picker does
                if isinstance(e, ev.SlashUnhandled) and e.name in self.web.slash_handlers:
                    html = await self.web.slash_handlers[e.name](e.name, e.arg, conversation_id)
                    db.add_event(conversation_id, SLASH_OUTPUT, {"type": SLASH_OUTPUT, "html": html})
                    turn.send(html)
                elif isinstance(e, ev.AnswerDelta):
                    if reply is None:
                        reply = turn.start_reply(route)
                    reply.add(e.text)
                elif isinstance(e, ev.AnswerDone) and reply is not None:
                    # no numbers: words the agent wrote itself (a denial, a summary), not the model's
                    reply.finish(e.text, e.finish_reason, e.stats or {"not_generated": True}, e.error)
                    reply = None  # the tool loop writes one reply per step that has words
                    answered = True
                elif isinstance(e, ev.Generated):
                    turn.count(e.stats, route)  # a step of calls only: Stats counts it all the same
                elif fragment := self.web.views.event(e):
                    if isinstance(e, ev.ToolStep):
                        steps, self._step_id = e.step, e.call_id
                        turn.send(self.web.views.step_counter(e.step, e.max_steps))
                        if e.context_tokens:
                            turn.context_used(e.context_tokens)  # steps with no words write no reply to count
                    db.add_event(conversation_id, e.type, e.to_dict())  # the transcript keeps it
                    turn.send(fragment)
            completed = True
        except Exception as exc:  # noqa: BLE001 - shown to the user; the socket lives on
            log.exception("agent turn failed")
            turn.error(f"the agent failed: {type(exc).__name__}: {exc}")
        finally:
            if reply is not None:
                answered = True  # its text is kept, marked stopped (below)
            if not answered and not limited:
                # Stop, a closed window, a failure, or a model that ended with no words after its steps: the
                # transcript says so, or the turn would leave only the user's message behind (the step limit
                # says so itself, with Continue)
                said = None  # a slash command answers in its own way (or needs no answer): nothing to say
                if agent.halted:
                    said = "Stopped before the agent answered."
                elif not completed:
                    said = "The agent's turn ended before it answered."
                elif tool_turn:
                    said = (
                        f"The model ended its turn after {steps} step{'' if steps == 1 else 's'} without an "
                        "answer. Ask again or more plainly; a larger model follows the tools better."
                        if steps
                        else "The model ended its turn without an answer (an empty reply). Ask again or more "
                        "plainly."
                    )
                if said:
                    cut = ev.Notice(said, "warning")
                    db.add_event(conversation_id, cut.type, cut.to_dict())
                    turn.send(self.web.views.event(cut))
            turn.on_stop(None)
            turn.send(self.web.views.step_counter())
            self._turn = None
            self._step_id = None
            self._synced[conversation_id] = len(db.messages(conversation_id))
            if reply is not None:
                reply.abandon()  # cut off: keep the text (a no-op once finished)
