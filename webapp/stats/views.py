"""The Stats window and the chat's `/stats`, `/cost`, `/bench`, `/good`, `/bad`, `/improve`.

What it knows: how to turn `webapp.stats` rows and the `webapp.costs` price table into the Stats
window (`templates/stats/window.html`, with `webapp.charts` SVG) and into short Markdown answers for
the slash commands; the Stats window's HTTP routes (`GET /stats/window`, `POST /stats/prices`,
`POST /stats/prices/reset`, CSRF-checked like every other change).

What it reads from the app: `app.state.flashcode` (`db.conn`, `settings.data_dir`, `csrf_token`,
`views.env`) and `app.state.worker` for `/bench`. What it does not know: sockets, the agent.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Environment
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from engine.worker import Worker

from . import benchset, charts, costs, stats

if TYPE_CHECKING:
    from .state import AppState

# (name, usage, help) for the slash-command registry
SLASH_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("stats", "", "tokens, speed and memory so far, per model"),
    ("cost", "", "what the same tokens would have cost on cloud APIs"),
    (
        "bench",
        "[TOKENS]",
        "run the fixed benchmark prompts on the current model (TOKENS per reply, default 64)",
    ),
    ("good", "[NOTE]", "grade the last reply as good (optional note)"),
    ("bad", "[NOTE]", "grade the last reply as bad (optional note: what was wrong)"),
    ("improve", "", "graded replies and counts per route (chat / search / shell)"),
)


SLASH_NAMES = frozenset(name for name, _, _ in SLASH_COMMANDS)


def register_slash_commands() -> bool:
    """Add the commands above to the agent's registry (`webapp.agent.slash`); done on import.
    The agent answers them with `SlashUnhandled(name, arg)`, which the web app passes to `run_slash`."""
    try:
        from .agent.slash import SlashCommand, register
    except ImportError:  # no agent in this build: the commands have nowhere to be typed
        return False
    for name, usage, help_text in SLASH_COMMANDS:
        register(SlashCommand(name, help_text, usage, needs_arg=False))
    return True


# --------------------------------------------------------------------------- the window
@dataclass(frozen=True)
class CostRow:
    price: costs.Price
    dollars: float


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "—"


def window_context(conn: sqlite3.Connection, data_dir: Path, csrf_token: str = "",
                   error: str | None = None) -> dict[str, Any]:  # fmt: skip
    total = stats.totals(conn)
    try:
        prices = costs.load_prices(costs.prices_path(data_dir))
    except costs.PriceTableError as exc:
        prices, error = costs.DEFAULT_PRICES, str(exc)
    models = stats.by_model(conn)
    backends = stats.by_backend(conn)
    counts, graded = stats.improve(conn, limit=8)
    tps = stats.series(conn, "decode_tps")
    ttft = {b: [(t, v * 1000) for t, v in pts] for b, pts in stats.series(conn, "ttft_s").items()}
    return {
        "totals": total,
        "models": models,
        "model_costs": {
            (m.backend, m.model): costs.costs_for(
                prices, m.prompt_tokens, m.cached_tokens, m.completion_tokens
            )
            for m in models
        },  # fmt: skip
        "savings": [
            CostRow(p, d)
            for p, d in costs.costs_for(
                prices, total.prompt_tokens, total.cached_tokens, total.completion_tokens
            )
        ],  # fmt: skip
        "prices": prices,
        "prices_are_defaults": not costs.prices_path(data_dir).exists(),
        "charts": {
            "tps_time": charts.line_chart(tps, "Decode speed over time", "tok/s"),
            "ttft_time": charts.line_chart(ttft, "Time to first token over time", "ms"),
            "tps_backend": charts.bar_chart(
                [(b.backend or "?", b.decode_tps) for b in backends if b.decode_tps],
                "Mean decode speed per backend",
                "tok/s",
            ),  # fmt: skip
            "ttft_backend": charts.bar_chart(
                [(b.backend or "?", b.ttft_s * 1000) for b in backends if b.ttft_s],
                "Mean time to first token per backend",
                "ms",
            ),  # fmt: skip
        },
        "bench_runs": stats.bench_runs(conn, limit=8),
        "route_counts": counts,
        "graded": graded,
        "usd": costs.format_usd,
        "mib": _mib,
        "csrf_token": csrf_token,
        "error": error,
    }


def render_window(env: Environment, conn: sqlite3.Connection, data_dir: Path, csrf_token: str = "",
                  error: str | None = None) -> str:  # fmt: skip
    return env.get_template("stats/window.html").render(**window_context(conn, data_dir, csrf_token, error))


def _app_parts(request: Request) -> tuple[Environment, sqlite3.Connection, Path, str]:
    state = request.app.state.flashcode
    return state.views.env, state.db.conn, Path(state.settings.data_dir), state.csrf_token


async def window_route(request: Request) -> HTMLResponse:
    env, conn, data_dir, token = _app_parts(request)
    return HTMLResponse(render_window(env, conn, data_dir, token))


def _getlist(form: FormData, key: str) -> list[str]:
    return [str(v) for v in form.getlist(key)]


async def save_prices_route(request: Request) -> HTMLResponse:
    from .routes import check_csrf

    await check_csrf(request)
    env, conn, data_dir, token = _app_parts(request)
    form = await request.form()
    try:
        prices = costs.prices_from_form(
            *(_getlist(form, k) for k in ("name", "input", "cached_input", "output", "as_of"))
        )
    except costs.PriceTableError as exc:
        return HTMLResponse(render_window(env, conn, data_dir, token, error=str(exc)), status_code=400)
    costs.save_prices(costs.prices_path(data_dir), prices)
    return HTMLResponse(render_window(env, conn, data_dir, token))


async def reset_prices_route(request: Request) -> HTMLResponse:
    from .routes import check_csrf

    await check_csrf(request)
    env, conn, data_dir, token = _app_parts(request)
    costs.prices_path(data_dir).unlink(missing_ok=True)
    return HTMLResponse(render_window(env, conn, data_dir, token))


routes = [
    Route("/stats/window", window_route),
    Route("/stats/prices", save_prices_route, methods=["POST"]),
    Route("/stats/prices/reset", reset_prices_route, methods=["POST"]),
]


def window_pane_html() -> str:
    """What the web app's Stats window pane should hold: it loads the window's content when opened."""
    # intersect: fetched each time the (hidden) window is opened; the Refresh button does the rest
    return ('<div class="stats-loader" hx-get="/stats/window" hx-trigger="intersect" '
            'hx-swap="innerHTML"><p>Loading stats…</p></div>')  # fmt: skip


# --------------------------------------------------------------------------- slash commands (Markdown)
def stats_markdown(conn: sqlite3.Connection) -> str:
    t = stats.totals(conn)
    if not t.replies:
        return "No replies recorded yet: ask something, then try `/stats` again."
    lines = [f"**{t.replies} replies** · {t.prompt_tokens:,} prompt tokens ({t.cached_tokens:,} from cache) · "
             f"{t.completion_tokens:,} generated · mean {t.decode_tps:.1f} tok/s · mean TTFT {t.ttft_s * 1000:.0f} ms",
             "", "| model | backend | replies | tokens in / out | tok/s | TTFT | peak memory |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m in stats.by_model(conn):
        lines.append(f"| {m.model} | {m.backend} | {m.replies} | {m.prompt_tokens:,} / {m.completion_tokens:,} | "
                     f"{m.decode_tps:.1f} | {m.ttft_s * 1000:.0f} ms | {_mib(m.peak_memory_bytes)} |")  # fmt: skip
    return "\n".join(lines)


def cost_markdown(conn: sqlite3.Connection, data_dir: Path) -> str:
    t = stats.totals(conn)
    prices = costs.load_prices(costs.prices_path(data_dir))
    lines = [f"The {t.prompt_tokens:,} prompt tokens ({t.cached_tokens:,} cached) and {t.completion_tokens:,} "
             "generated tokens made here would have cost:", "",
             "| cloud model | cost | input / cached / output per 1M | prices of |", "|---|---:|---:|---|"]  # fmt: skip
    for p, dollars in costs.costs_for(prices, t.prompt_tokens, t.cached_tokens, t.completion_tokens):
        lines.append(f"| {p.name} | {costs.format_usd(dollars)} | ${p.input:g} / ${p.cached_input:g} / ${p.output:g} "
                     f"| {p.as_of} |")  # fmt: skip
    lines += ["", "Edit the prices in the Stats window (View > Stats)."]
    return "\n".join(lines)


def improve_markdown(conn: sqlite3.Connection) -> str:
    counts, graded = stats.improve(conn)
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


def grade_markdown(conn: sqlite3.Connection, grade: str, note: str, conversation_id: str | None,
                   excerpt: str = "") -> str:  # fmt: skip
    try:
        g = stats.grade_last(conn, grade, note, conversation_id, excerpt)
    except stats.GradeError as exc:
        return str(exc)
    return (
        f"Graded the last reply **{g.grade}**{' — ' + g.note if g.note else ''}. `/improve` shows all grades."
    )


async def bench_markdown(
    conn: sqlite3.Connection, worker: Worker, max_tokens: int = benchset.DEFAULT_MAX_TOKENS
) -> str:
    backend, model = benchset.engine_names(worker)
    if model is None:
        return "No model is loaded: pick one in the model menu, then `/bench`."
    earlier = stats.bench_runs(conn, limit=1)
    results = await benchset.run_async(worker, max_tokens)
    run = stats.record_bench_run(conn, backend=backend, model=model, max_tokens=max_tokens, results=results)
    return "```\n" + benchset.format_run(run, earlier[0] if earlier else None) + "\n```"


async def run_slash(name: str, arg: str, *, conn: sqlite3.Connection, data_dir: Path, worker: Worker | None = None,
                    conversation_id: str | None = None, last_reply_text: str = "") -> str:  # fmt: skip
    """Answer one of `SLASH_COMMANDS` as Markdown (the chat shows it as a system note)."""
    if name == "stats":
        return stats_markdown(conn)
    if name == "cost":
        try:
            return cost_markdown(conn, data_dir)
        except costs.PriceTableError as exc:
            return str(exc)
    if name == "improve":
        return improve_markdown(conn)
    if name in ("good", "bad"):
        return grade_markdown(conn, name, arg, conversation_id, last_reply_text)
    if name == "bench":
        if worker is None:
            return "/bench needs the engine: no worker is running."
        if arg and not (arg.isdigit() and 1 <= int(arg) <= 4096):
            return f"/bench takes a reply length in tokens (1 to 4096), not {arg!r}: /bench 32"
        return await bench_markdown(conn, worker, int(arg) if arg else benchset.DEFAULT_MAX_TOKENS)
    raise ValueError(f"/{name} is not a stats command")


# --------------------------------------------------------------------------- one-line hooks for webapp.ws
def record_chat_reply(state: AppState, reply_stats: dict[str, Any], *, conversation_id: str, message_id: int,
                      route: str | None = None, finish_reason: str | None = None) -> int | None:  # fmt: skip
    """Call after `db.finish_message`: records the reply with the loaded backend and model."""
    model, backend = state.engine.model_and_backend()
    return stats.record_reply(state.db.conn, reply_stats, backend=reply_stats.get("backend") or backend,
                              model=reply_stats.get("model") or model, route=route or "chat",
                              conversation_id=conversation_id, message_id=message_id,
                              finish_reason=finish_reason or reply_stats.get("finish_reason"))  # fmt: skip


def note_html(env: Environment, command: str, markdown: str) -> str:
    """A slash command's answer as an out-of-band fragment appended to the transcript."""
    from .render import render_markdown

    return env.get_template("stats/note.html").render(command=command, body=render_markdown(markdown))


async def answer_fragment(state: AppState, name: str, arg: str, conversation_id: str | None) -> str:
    """`answer` rendered for the chat: what the agent bridge sends for `SlashUnhandled(name, arg)`."""
    return note_html(state.views.env, name, await answer(state, name, arg, conversation_id))


def install(state: AppState) -> None:
    """What the web app's lifespan calls once the database is open: the stats tables, and a record of
    every finished chat reply (through `AppState.on_reply`)."""
    stats.ensure_schema(state.db.conn)
    if record_chat_reply not in state.on_reply:
        state.on_reply.append(record_chat_reply)


async def answer(state: AppState, name: str, arg: str, conversation_id: str | None) -> str:
    """A stats slash command typed in `conversation_id`, answered as Markdown."""
    last = ""
    if conversation_id:
        replies = [m for m in state.db.messages(conversation_id) if m.role == "assistant"]
        last = replies[-1].content if replies else ""
    return await run_slash(name, arg, conn=state.db.conn, data_dir=Path(state.settings.data_dir),
                           worker=state.engine.worker, conversation_id=conversation_id, last_reply_text=last)  # fmt: skip


register_slash_commands()
