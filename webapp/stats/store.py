"""Per-reply numbers in SQLite: what each reply cost in time and tokens, grades, and bench runs.

What it knows: the queries on `stats_replies`, `stats_grades` and `stats_bench_runs` (their schema
is in `webapp.db`'s migration list): how to record a reply from the engine's `GenerationStats`, and
what the Stats window, `/stats`, `/cost`, `/improve` and `/bench` need (totals, per-model and
per-backend tables, series for charts). Stats rows do not reference `messages`: deleting a
conversation keeps its numbers (they hold no text), so totals and savings do not shrink.

What it does not know: prices (`costs.py`), HTML (`views.py`), engines. Calls are short and
synchronous; the web app makes them on the event loop.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.base import GenerationStats

ROUTES = ("chat", "search", "shell")
EXCERPT_CHARS = 160
# keys an engine may put in GenerationStats.extra for the flash columns
HIT_RATE_KEYS = ("hit_rate", "cache_hit_rate", "expert_hit_rate")
BYTES_READ_KEYS = ("bytes_read",)


# --------------------------------------------------------------------------- recording
def _first(extra: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((extra[k] for k in keys if extra.get(k) is not None), None)


def record_reply(
    conn: sqlite3.Connection,
    stats: GenerationStats | Mapping[str, Any],
    *,
    backend: str | None,
    model: str | None,
    source: str = "chat",
    route: str | None = None,
    conversation_id: str | None = None,
    message_id: int | None = None,
    finish_reason: str | None = None,
    bench_run_id: int | None = None,
    project_id: str | None = None,
) -> int | None:
    """Store one reply's numbers; returns the row id, or None when nothing was generated at all."""
    s = stats.to_dict() if isinstance(stats, GenerationStats) else dict(stats)
    if not s.get("prompt_tokens") and not s.get("completion_tokens"):
        return None
    extra = s.get("extra") or {}
    row = {
        "created_at": time.time(),
        "source": source,
        "route": route,
        "conversation_id": conversation_id,
        "message_id": message_id,
        "backend": backend,
        "model": model,
        "prompt_tokens": int(s.get("prompt_tokens") or 0),
        "cached_tokens": int(s.get("cached_tokens") or 0),
        "completion_tokens": int(s.get("completion_tokens") or 0),
        "ttft_s": s.get("ttft_s"),
        "prompt_tps": s.get("prompt_tps"),
        "decode_tps": s.get("decode_tps"),
        "peak_memory_bytes": s.get("peak_memory_bytes"),
        "peak_rss_bytes": s.get("peak_rss_bytes"),
        "total_s": s.get("total_s"),
        "flash_hit_rate": _first(extra, HIT_RATE_KEYS),
        "flash_bytes_read": _first(extra, BYTES_READ_KEYS),
        "finish_reason": finish_reason or s.get("finish_reason"),
        "bench_run_id": bench_run_id,
        "project_id": project_id,
    }
    cols = ", ".join(row)
    cur = conn.execute(
        f"INSERT INTO stats_replies ({cols}) VALUES ({', '.join('?' * len(row))})", tuple(row.values())
    )
    conn.commit()
    return int(cur.lastrowid or 0)


def complete_reply(
    conn: sqlite3.Connection, message_id: int, stats: GenerationStats | Mapping[str, Any]
) -> int | None:
    """A recorded chat reply's numbers, completed after a stop (the prompt is counted once the engine has
    ended): its row is updated, not doubled; returns the row id, or None when there is none."""
    s = stats.to_dict() if isinstance(stats, GenerationStats) else dict(stats)
    extra = s.get("extra") or {}
    known = {"prompt_tokens": s.get("prompt_tokens"), "cached_tokens": s.get("cached_tokens"),
             "peak_memory_bytes": s.get("peak_memory_bytes"), "peak_rss_bytes": s.get("peak_rss_bytes"),
             "flash_hit_rate": _first(extra, HIT_RATE_KEYS), "flash_bytes_read": _first(extra, BYTES_READ_KEYS)}  # fmt: skip
    found = conn.execute(
        "SELECT id FROM stats_replies WHERE source = 'chat' AND message_id = ? ORDER BY id DESC LIMIT 1",
        (message_id,),
    ).fetchone()
    if found is None:
        return None
    sets = {k: v for k, v in known.items() if v is not None}
    if sets:
        conn.execute(
            f"UPDATE stats_replies SET {', '.join(f'{k} = ?' for k in sets)} WHERE id = ?",
            (*sets.values(), found[0]),
        )
        conn.commit()
    return int(found[0])


# --------------------------------------------------------------------------- totals and tables
@dataclass(frozen=True)
class Totals:
    replies: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    total_s: float = 0.0
    # tokens over decode time, every reply that decoded (a 2-token reply weighs 2 tokens, not one reply)
    decode_tps: float = 0.0
    ttft_s: float = 0.0  # mean
    peak_memory_bytes: int = 0  # max
    flash_bytes_read: int = 0
    tool_steps: int = 0  # of `replies`: agent steps that only called tools (a generation with no message)


@dataclass(frozen=True)
class GroupRow(Totals):
    backend: str | None = None
    model: str | None = None


_AGG = """COUNT(*) AS replies, COALESCE(SUM(prompt_tokens),0) AS prompt_tokens,
          COALESCE(SUM(cached_tokens),0) AS cached_tokens, COALESCE(SUM(completion_tokens),0) AS completion_tokens,
          COALESCE(SUM(total_s),0) AS total_s,
          COALESCE(SUM(CASE WHEN decode_tps > 0 AND completion_tokens > 0 THEN completion_tokens END)
                   / SUM(CASE WHEN decode_tps > 0 AND completion_tokens > 0
                              THEN completion_tokens / decode_tps END), 0) AS decode_tps,
          COALESCE(AVG(CASE WHEN ttft_s > 0 THEN ttft_s END),0) AS ttft_s,
          COALESCE(MAX(peak_memory_bytes),0) AS peak_memory_bytes,
          COALESCE(SUM(flash_bytes_read),0) AS flash_bytes_read,
          COALESCE(SUM(CASE WHEN source = 'chat' AND message_id IS NULL THEN 1 ELSE 0 END),0) AS tool_steps"""


def _where(source: str | None, project: str | None = None) -> tuple[str, tuple[Any, ...]]:
    """`project`: one project's replies (its id), or every project's (None)."""
    where, args = ("WHERE source = ?", (source,)) if source else ("WHERE source != 'bench'", ())
    if project is not None:
        where, args = f"{where} AND project_id = ?", (*args, project)
    return where, args


def totals(conn: sqlite3.Connection, source: str | None = None, project: str | None = None) -> Totals:
    """Everything recorded (bench replies excluded unless `source='bench'`)."""
    where, args = _where(source, project)
    row = conn.execute(f"SELECT {_AGG} FROM stats_replies {where}", args).fetchone()
    return Totals(*row)


def by_model(
    conn: sqlite3.Connection, source: str | None = None, project: str | None = None
) -> list[GroupRow]:
    """One row per (backend, model), most used first."""
    where, args = _where(source, project)
    rows = conn.execute(
        f"SELECT {_AGG}, backend, model FROM stats_replies {where} GROUP BY backend, model "
        "ORDER BY replies DESC, model, backend",
        args,
    ).fetchall()
    return [GroupRow(*r) for r in rows]


def by_backend(
    conn: sqlite3.Connection, source: str | None = None, project: str | None = None
) -> list[GroupRow]:
    where, args = _where(source, project)
    rows = conn.execute(
        f"SELECT {_AGG}, backend, NULL FROM stats_replies {where} GROUP BY backend ORDER BY backend", args
    ).fetchall()
    return [GroupRow(*r) for r in rows]


def series(
    conn: sqlite3.Connection,
    metric: str,
    limit: int = 200,
    source: str | None = None,
    project: str | None = None,
) -> dict[str, list[tuple[float, float]]]:
    """The latest `limit` values of `metric` as (time, value) points, one list per backend, oldest first."""
    if metric not in ("decode_tps", "ttft_s", "prompt_tps", "peak_memory_bytes", "total_s"):
        raise ValueError(f"no series for {metric!r}")
    where, args = _where(source, project)
    rows = conn.execute(
        f"SELECT created_at, {metric}, COALESCE(backend, '?') FROM stats_replies {where} AND {metric} > 0 "
        "ORDER BY id DESC LIMIT ?",
        (*args, limit),
    ).fetchall()
    out: dict[str, list[tuple[float, float]]] = {}
    for t, value, backend in reversed(rows):
        out.setdefault(backend, []).append((float(t), float(value)))
    return out


# --------------------------------------------------------------------------- grading
class GradeError(LookupError):
    pass


@dataclass(frozen=True)
class Grade:
    id: int
    created_at: float
    grade: str
    route: str | None
    model: str | None
    note: str | None
    excerpt: str | None
    conversation_id: str | None
    message_id: int | None


def last_reply(conn: sqlite3.Connection, conversation_id: str | None = None) -> sqlite3.Row | None:
    """The latest chat generation (in `conversation_id` when given): a reply, or an agent step that only called
    tools (no message id; its turn wrote no reply)."""
    sql = "SELECT id, conversation_id, message_id, route, model FROM stats_replies WHERE source = 'chat'"
    args: tuple[Any, ...] = ()
    if conversation_id:
        sql, args = sql + " AND conversation_id = ?", (conversation_id,)
    return conn.execute(sql + " ORDER BY id DESC LIMIT 1", args).fetchone()


def grade_last(
    conn: sqlite3.Connection,
    grade: str,
    note: str = "",
    conversation_id: str | None = None,
    excerpt: str = "",
) -> Grade:
    """`/good` or `/bad`: grade the latest reply; grading it again replaces the earlier grade."""
    if grade not in ("good", "bad"):
        raise ValueError(f"a grade is 'good' or 'bad', got {grade!r}")
    reply = last_reply(conn, conversation_id)
    if reply is None:
        raise GradeError("there is no reply to grade yet: ask something first")
    reply_id, conv, message_id, route, model = tuple(reply)
    if message_id is None:
        # the last generation was an agent step that only called tools: its turn wrote no reply (the turn
        # before it is not what the user means to grade)
        raise GradeError("the last turn wrote no reply to grade (its agent steps only called tools)")
    conn.execute("DELETE FROM stats_grades WHERE reply_id = ?", (reply_id,))
    now = time.time()
    note_text = " ".join(note.split())[:500] or None
    short = " ".join(excerpt.split())[:EXCERPT_CHARS] or None
    cur = conn.execute(
        "INSERT INTO stats_grades (created_at, reply_id, conversation_id, message_id, route, model, grade, note, excerpt) "
        "VALUES (?,?,?,?,?,?,?,?,?)",
        (now, reply_id, conv, message_id, route or "chat", model, grade, note_text, short),
    )
    conn.commit()
    return Grade(
        int(cur.lastrowid or 0), now, grade, route or "chat", model, note_text, short, conv, message_id
    )


@dataclass(frozen=True)
class RouteCounts:
    route: str
    replies: int
    good: int
    bad: int

    @property
    def ungraded(self) -> int:
        return max(0, self.replies - self.good - self.bad)


def improve(
    conn: sqlite3.Connection, limit: int = 20, project: str | None = None
) -> tuple[list[RouteCounts], list[Grade]]:
    """`/improve`: per route, replies and grades; and the latest graded replies (bad ones first). `project`: one
    project's (a grade belongs to its reply's project), or every project's (None)."""
    mine, args = ("AND project_id = ?", (project,)) if project is not None else ("", ())
    replies = dict(
        conn.execute(
            # the replies a grade can be given to: a step that only called tools wrote none
            "SELECT COALESCE(route, 'chat'), COUNT(*) FROM stats_replies WHERE source = 'chat' "
            f"AND message_id IS NOT NULL {mine} GROUP BY 1",
            args,
        ).fetchall()
    )
    # grades of replies a message shows (one given to a tool step before they were told apart is not counted)
    of_grades = "WHERE reply_id IN (SELECT id FROM stats_replies WHERE message_id IS NOT NULL{})".format(
        " AND project_id = ?" if project is not None else ""
    )
    graded: dict[str, dict[str, int]] = {}
    for route, grade, n in conn.execute(
        f"SELECT COALESCE(route, 'chat'), grade, COUNT(*) FROM stats_grades {of_grades} GROUP BY 1, 2", args
    ):
        graded.setdefault(route, {})[grade] = n
    routes = list(ROUTES) + sorted((set(replies) | set(graded)) - set(ROUTES))
    counts = [
        RouteCounts(r, replies.get(r, 0), graded.get(r, {}).get("good", 0), graded.get(r, {}).get("bad", 0))
        for r in routes
    ]
    rows = conn.execute(
        "SELECT id, created_at, grade, route, model, note, excerpt, conversation_id, message_id FROM stats_grades "
        f"{of_grades} ORDER BY grade = 'good', id DESC LIMIT ?",
        (*args, limit),
    ).fetchall()
    return counts, [Grade(*r) for r in rows]


# --------------------------------------------------------------------------- bench runs
@dataclass(frozen=True)
class BenchRun:
    id: int
    created_at: float
    backend: str | None
    model: str | None
    prompts: int
    max_tokens: int
    decode_tps: float
    ttft_s: float
    prompt_tps: float
    peak_memory_bytes: int
    peak_rss_bytes: int
    total_s: float
    results: list[dict[str, Any]]


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of decode tok/s, TTFT and prefill tok/s; max of the memory peaks; summed time."""

    def med(key: str) -> float:
        values = [float(r[key]) for r in results if r.get(key)]
        return statistics.median(values) if values else 0.0

    return {
        "decode_tps": med("decode_tps"),
        "ttft_s": med("ttft_s"),
        "prompt_tps": med("prompt_tps"),
        "peak_memory_bytes": max((int(r.get("peak_memory_bytes") or 0) for r in results), default=0),
        "peak_rss_bytes": max((int(r.get("peak_rss_bytes") or 0) for r in results), default=0),
        "total_s": sum(float(r.get("total_s") or 0) for r in results),
    }


def record_bench_run(
    conn: sqlite3.Connection,
    *,
    backend: str | None,
    model: str | None,
    max_tokens: int,
    results: list[dict[str, Any]],
) -> BenchRun:
    """Store a bench run (its summary plus each prompt's numbers) and each reply in `stats_replies`."""
    s = summarize(results)
    now = time.time()
    cur = conn.execute(
        "INSERT INTO stats_bench_runs (created_at, backend, model, prompts, max_tokens, decode_tps, ttft_s, "
        "prompt_tps, peak_memory_bytes, peak_rss_bytes, total_s, results) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            now,
            backend,
            model,
            len(results),
            max_tokens,
            s["decode_tps"],
            s["ttft_s"],
            s["prompt_tps"],
            s["peak_memory_bytes"],
            s["peak_rss_bytes"],
            s["total_s"],
            json.dumps(results),
        ),
    )
    run_id = int(cur.lastrowid or 0)
    for r in results:
        record_reply(conn, r, backend=backend, model=model, source="bench", bench_run_id=run_id)
    conn.commit()
    return BenchRun(
        run_id,
        now,
        backend,
        model,
        len(results),
        max_tokens,
        s["decode_tps"],
        s["ttft_s"],
        s["prompt_tps"],
        int(s["peak_memory_bytes"]),
        int(s["peak_rss_bytes"]),
        s["total_s"],
        results,
    )


def bench_runs(conn: sqlite3.Connection, limit: int = 20) -> list[BenchRun]:
    """The latest runs, newest first."""
    rows = conn.execute(
        "SELECT id, created_at, backend, model, prompts, max_tokens, COALESCE(decode_tps,0), COALESCE(ttft_s,0), "
        "COALESCE(prompt_tps,0), COALESCE(peak_memory_bytes,0), COALESCE(peak_rss_bytes,0), COALESCE(total_s,0), "
        "results FROM stats_bench_runs ORDER BY id DESC LIMIT ?",
        (limit,),
    ).fetchall()
    return [BenchRun(*r[:-1], json.loads(r[-1] or "[]")) for r in rows]
