"""The Stats window and the chat's `/stats`, `/cost`, `/bench`, `/good`, `/bad`, `/improve`.

What it knows: how to turn `store.py` rows and the `costs.py` price table into the Stats window
(`templates/stats/window.html`, with `charts.py` SVG) and into short Markdown answers for the slash
commands, shown in the chat as a note (`templates/stats/note.html`). `Stats` is the feature as one
app uses it: its HTTP routes (`GET /stats/window`, `POST /stats/prices`, `POST /stats/prices/reset`),
the `ReplyHook` that records every chat reply, and the `SlashHandler` that answers its commands.

What it does not know: sockets, the agent (its slash commands reach it through `create_app`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from engine.worker import Worker

from ..db import Database
from ..turns import ProjectLookup, SlashSpec
from . import bench, charts, costs, store

SLASH_COMMANDS: tuple[SlashSpec, ...] = (
    SlashSpec("stats", "", "tokens, speed and memory so far, per model"),
    SlashSpec("cost", "", "what the same tokens would have cost on cloud APIs"),
    SlashSpec(
        "bench",
        "[TOKENS]",
        "run the fixed benchmark prompts on the current model (TOKENS per reply, default 64)",
    ),
    SlashSpec("good", "[NOTE]", "grade the last reply as good (optional note)"),
    SlashSpec("bad", "[NOTE]", "grade the last reply as bad (optional note: what was wrong)"),
    SlashSpec("improve", "", "graded replies and counts per route (chat / search / shell)"),
)
SLASH_NAMES = frozenset(c.name for c in SLASH_COMMANDS)


def _kept_note(kept: Path | None) -> str | None:
    if kept is None:
        return None
    return f"The price table could not be read, so it was kept as {kept} before it was replaced."


# --------------------------------------------------------------------------- the window
@dataclass(frozen=True)
class CostRow:
    price: costs.Price
    dollars: float


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "—"


def window_context(
    conn: sqlite3.Connection,
    data_dir: Path,
    csrf_token: str = "",
    error: str | None = None,
    project: str | None = None,
    project_choices: Sequence[tuple[str, str]] = (),
    price_error: str | None = None,
    typed: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """`project`: one project's numbers (its id), or every project's (None); `project_choices`:
    (id, name) pairs for the window's project menu; `price_error`, `typed`: why the price form was refused,
    and its rows as typed (drawn again, the form open, the message beside it)."""
    total = store.totals(conn, project=project)
    try:
        prices = costs.load_prices(costs.prices_path(data_dir))
    except costs.PriceTableError as exc:
        prices, error = costs.DEFAULT_PRICES, str(exc)
    models = store.by_model(conn, project=project)
    backends = store.by_backend(conn, project=project)
    counts, graded = store.improve(conn, limit=8, project=project)
    tps = store.series(conn, "decode_tps", project=project)
    ttft = {
        b: [(t, v * 1000) for t, v in pts] for b, pts in store.series(conn, "ttft_s", project=project).items()
    }
    return {
        "totals": total,
        "models": models,
        "model_costs": {
            (m.backend, m.model): costs.costs_for(
                prices, m.prompt_tokens, m.cached_tokens, m.completion_tokens
            )
            for m in models
        },
        "savings": [
            CostRow(p, d)
            for p, d in costs.costs_for(
                prices, total.prompt_tokens, total.cached_tokens, total.completion_tokens
            )
        ],
        "prices": prices,
        "price_rows": typed
        if typed is not None
        else [
            {
                "name": p.name,
                "input": f"{p.input:g}",
                "cached_input": f"{p.cached_input:g}",
                "output": f"{p.output:g}",
                "as_of": p.as_of,
            }
            for p in prices
        ],  # fmt: skip
        "price_error": price_error,
        "prices_are_defaults": not costs.prices_path(data_dir).exists(),
        "price_sources": costs.PRICE_SOURCES,
        "charts": {
            "tps_time": charts.line_geometry(tps, "Decode speed over time", "tok/s"),
            "ttft_time": charts.line_geometry(ttft, "Time to first token over time", "ms"),
            "tps_backend": charts.bar_geometry(
                [(b.backend or "?", b.decode_tps) for b in backends if b.decode_tps],
                "Mean decode speed per backend",
                "tok/s",
            ),
            "ttft_backend": charts.bar_geometry(
                [(b.backend or "?", b.ttft_s * 1000) for b in backends if b.ttft_s],
                "Mean time to first token per backend",
                "ms",
            ),
        },
        "bench_runs": store.bench_runs(conn, limit=8),
        "route_counts": counts,
        "graded": graded,
        "usd": costs.format_usd,
        "mib": _mib,
        "csrf_token": csrf_token,
        "error": error,
        "project": project or "all",
        "project_choices": list(project_choices),
    }


def render_window(
    env: Environment,
    conn: sqlite3.Connection,
    data_dir: Path,
    csrf_token: str = "",
    error: str | None = None,
    project: str | None = None,
    project_choices: Sequence[tuple[str, str]] = (),
    price_error: str | None = None,
    typed: list[dict[str, str]] | None = None,
) -> str:
    context = window_context(conn, data_dir, csrf_token, error, project, project_choices, price_error, typed)
    return env.get_template("stats/window.html").render(**context)


def _getlist(form: FormData, key: str) -> list[str]:
    return [str(v) for v in form.getlist(key)]


# --------------------------------------------------------------------------- slash commands (Markdown)
def _scope(project: str | None) -> str:
    return " in this project" if project is not None else ""


def _generations(t: store.Totals) -> str:
    """ "12 generations (5 of them agent steps that only called tools)": each is one model call, as a cloud API
    would bill it; a reply is the one a message shows."""
    n = f"{t.replies} generation{'s' if t.replies != 1 else ''}"
    if t.tool_steps:
        n += f" ({t.tool_steps} of them agent step{'s' if t.tool_steps != 1 else ''} that only called tools)"
    return n


def stats_markdown(conn: sqlite3.Connection, project: str | None = None) -> str:
    """`project`: the project of the conversation it was typed in (None: every project's, the API's too)."""
    t = store.totals(conn, project=project)
    if not t.replies:
        return f"No replies recorded yet{_scope(project)}: ask something, then try `/stats` again."
    lines = [
        f"**{_generations(t)}{_scope(project)}** · {t.prompt_tokens:,} prompt tokens ({t.cached_tokens:,} from cache) · "
        f"{t.completion_tokens:,} generated · {t.decode_tps:.1f} tok/s overall · mean TTFT {t.ttft_s * 1000:.0f} ms",
        "",
        "| model | backend | generations | tokens in / out | tok/s | TTFT | peak memory |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in store.by_model(conn, project=project):
        lines.append(
            f"| {m.model} | {m.backend} | {m.replies} | {m.prompt_tokens:,} / {m.completion_tokens:,} | "
            f"{m.decode_tps:.1f} | {m.ttft_s * 1000:.0f} ms | {_mib(m.peak_memory_bytes)} |"
        )
    return "\n".join(lines)


def cost_markdown(conn: sqlite3.Connection, data_dir: Path, project: str | None = None) -> str:
    t = store.totals(conn, project=project)
    prices = costs.load_prices(costs.prices_path(data_dir))
    lines = [
        f"The {t.prompt_tokens:,} prompt tokens ({t.cached_tokens:,} cached) and {t.completion_tokens:,} "
        f"generated tokens made {'in this project' if project is not None else 'here'} would have cost:",
        "",
        "| cloud model | cost | input / cached / output per 1M | prices of |",
        "|---|---:|---:|---|",
    ]
    for p, dollars in costs.costs_for(prices, t.prompt_tokens, t.cached_tokens, t.completion_tokens):
        lines.append(
            f"| {p.name} | {costs.format_usd(dollars)} | ${p.input:g} / ${p.cached_input:g} / ${p.output:g} "
            f"| {p.as_of} |"
        )
    lines += ["", "Edit the prices in the Stats window (View › Stats)."]
    return "\n".join(lines)


def improve_markdown(conn: sqlite3.Connection, project: str | None = None) -> str:
    counts, graded = store.improve(conn, project=project)
    lines = ["| route | replies | good | bad | ungraded |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {c.route} | {c.replies} | {c.good} | {c.bad} | {c.ungraded} |" for c in counts]
    if not graded:
        lines += ["", "Nothing graded yet: after a reply, type `/good` or `/bad what was wrong`."]
    else:
        lines += ["", "Graded replies (bad first):", ""]
        for g in graded:
            note = f" — {g.note}" if g.note else ""
            excerpt = f" “{g.excerpt}”" if g.excerpt else ""
            lines.append(f"- **{g.grade}** · {g.route} · {g.model or '?'}{note}{excerpt}")
    return "\n".join(lines)


def grade_markdown(
    conn: sqlite3.Connection, grade: str, note: str, conversation_id: str | None, excerpt: str = ""
) -> str:
    try:
        g = store.grade_last(conn, grade, note, conversation_id, excerpt)
    except store.GradeError as exc:
        return str(exc)
    return (
        f"Graded the last reply **{g.grade}**{' — ' + g.note if g.note else ''}. `/improve` shows all grades."
    )


async def bench_markdown(
    conn: sqlite3.Connection, worker: Worker, max_tokens: int = bench.DEFAULT_MAX_TOKENS
) -> str:
    backend, model = bench.engine_names(worker)
    if model is None:
        return "No model is loaded: pick one in the model menu, then `/bench`."
    earlier = store.bench_runs(conn, limit=1)
    results = await bench.run_async(worker, max_tokens)
    run = store.record_bench_run(conn, backend=backend, model=model, max_tokens=max_tokens, results=results)
    return "```\n" + bench.format_run(run, earlier[0] if earlier else None) + "\n```"


async def run_slash(
    name: str,
    arg: str,
    *,
    conn: sqlite3.Connection,
    data_dir: Path,
    worker: Worker | None = None,
    conversation_id: str | None = None,
    last_reply_text: str = "",
    project: str | None = None,
) -> str:
    """Answer one of `SLASH_COMMANDS` as Markdown (the chat shows it as a system note); /stats, /cost and
    /improve count the project it was typed in (`project`; None: every project's)."""
    if name == "stats":
        return stats_markdown(conn, project)
    if name == "cost":
        try:
            return cost_markdown(conn, data_dir, project)
        except costs.PriceTableError as exc:
            return str(exc)
    if name == "improve":
        return improve_markdown(conn, project)
    if name in ("good", "bad"):
        return grade_markdown(conn, name, arg, conversation_id, last_reply_text)
    if name == "bench":
        if worker is None:
            return "/bench needs the engine: no worker is running."
        if arg and not (arg.isdigit() and 1 <= int(arg) <= 4096):
            return f"/bench takes a reply length in tokens (1 to 4096), not {arg!r}: /bench 32"
        return await bench_markdown(conn, worker, int(arg) if arg else bench.DEFAULT_MAX_TOKENS)
    raise ValueError(f"/{name} is not a stats command")


# --------------------------------------------------------------------------- the feature in one app
class Stats:
    """The Stats window's routes, the reply hook and the slash commands, for one app's database."""

    def __init__(
        self,
        db: Database,
        data_dir: Path,
        env: Environment,
        worker: Worker,
        csrf_token: str,
        projects: ProjectLookup | None = None,
    ) -> None:
        self.projects = projects  # the window's project filter (None: no filter)
        self.db, self.data_dir, self.env, self.worker, self.csrf_token = (
            db,
            Path(data_dir),
            env,
            worker,
            csrf_token,
        )

    @property
    def routes(self) -> list[Route]:
        return [
            Route("/stats/window", self.window_route),
            Route("/stats/prices", self.save_prices_route, methods=["POST"]),
            Route("/stats/prices/reset", self.reset_prices_route, methods=["POST"]),
        ]

    def _window(
        self,
        error: str | None = None,
        status_code: int = 200,
        project: str | None = None,
        price_error: str | None = None,
        typed: list[dict[str, str]] | None = None,
    ) -> HTMLResponse:
        choices = [(p.id, p.name) for p in self.projects.all()] if self.projects else []
        if project is not None and project not in {pid for pid, _ in choices}:
            project = None  # an unknown id shows every project's numbers
        html = render_window(
            self.env,
            self.db.conn,
            self.data_dir,
            self.csrf_token,
            error,
            project,
            choices,
            price_error,
            typed,
        )
        return HTMLResponse(html, status_code=status_code)

    async def window_route(self, request: Request) -> HTMLResponse:
        """GET /stats/window[?project=ID|all]: every project's numbers unless one is picked."""
        return self._window(project=_picked(request.query_params.get("project")))

    async def save_prices_route(self, request: Request) -> HTMLResponse:
        """The price table saved; the window is drawn again for the project it showed (the form sends it)."""
        form = await request.form()
        project = _picked(form.get("project"))
        columns = [_getlist(form, k) for k in ("name", "input", "cached_input", "output", "as_of")]
        try:
            prices = costs.prices_from_form(*columns)
        except costs.PriceTableError as exc:  # beside the form, open, with what was typed (walkthrough)
            try:
                typed: list[dict[str, str]] | None = [
                    r for r in costs.form_rows(*columns) if r["name"].strip()
                ]
            except costs.PriceTableError:  # a forged form's uneven rows: the table as saved
                typed = None
            return self._window(status_code=400, project=project, price_error=str(exc), typed=typed)
        path = costs.prices_path(self.data_dir)
        kept = costs.keep_unreadable(path)
        costs.save_prices(path, prices)
        return self._window(error=_kept_note(kept), project=project)

    async def reset_prices_route(self, request: Request) -> HTMLResponse:
        form = await request.form()
        path = costs.prices_path(self.data_dir)
        kept = costs.keep_unreadable(path)
        path.unlink(missing_ok=True)
        return self._window(error=_kept_note(kept), project=_picked(form.get("project")))

    # ------------------------------------------------------------------ recording (a ReplyHook)
    def record_chat_reply(
        self,
        stats: Mapping[str, Any],
        *,
        conversation_id: str,
        message_id: int | None,
        route: str | None = None,
        completed: bool = False,
    ) -> int | None:
        """Called by the chat once a reply is stored: its numbers, with the model and backend that made it;
        `completed`: the numbers of a reply recorded at its stop, completed since (its row is updated)."""
        if completed and message_id is not None:
            return store.complete_reply(self.db.conn, message_id, stats)
        return store.record_reply(
            self.db.conn,
            stats,
            backend=stats.get("backend"),
            model=stats.get("model"),
            route=route or "chat",
            conversation_id=conversation_id,
            message_id=message_id,
            finish_reason=stats.get("finish_reason"),
            # a reply that ended after its conversation went to the Trash still counts for its project
            project_id=conv.project_id
            if (conv := self.db.get_conversation(conversation_id, trashed=True))
            else None,
        )

    def record_api_reply(self, stats: Mapping[str, Any]) -> int | None:
        """A reply made through `/v1` (source "api": no conversation, no route)."""
        return store.record_reply(
            self.db.conn,
            stats,
            backend=stats.get("backend"),
            model=stats.get("model"),
            source="api",
            finish_reason=stats.get("finish_reason"),
        )

    # ------------------------------------------------------------------ slash commands (a SlashHandler)
    async def answer(self, name: str, arg: str, conversation_id: str | None) -> str:
        """A stats slash command typed in `conversation_id`, answered as Markdown."""
        last, project = "", None
        if conversation_id:
            replies = [m for m in self.db.messages(conversation_id) if m.role == "assistant"]
            last = replies[-1].content if replies else ""
            conv = self.db.get_conversation(conversation_id)
            project = conv.project_id if conv is not None else None
        return await run_slash(
            name,
            arg,
            conn=self.db.conn,
            data_dir=self.data_dir,
            worker=self.worker,
            conversation_id=conversation_id,
            last_reply_text=last,
            project=project,
        )

    async def answer_fragment(self, name: str, arg: str, conversation_id: str | None) -> str:
        """`answer` drawn as a note appended to the transcript."""
        return note_html(self.env, name, await self.answer(name, arg, conversation_id))


def note_html(env: Environment, command: str, markdown: str) -> str:
    """A slash command's answer as an out-of-band fragment appended to the transcript."""
    return env.get_template("stats/note.html").render(command=command, markdown=markdown)


def _picked(value: Any) -> str | None:
    """The window's project menu value: a project's id, or None for "all" (and when it sent none)."""
    return None if value in (None, "", "all") or not isinstance(value, str) else value
