"""Stats storage, grading, bench runs, charts and the Stats window, in-process (no model)."""

from __future__ import annotations

import re
import sqlite3
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from engine.base import GenerationStats
from webapp.db import migrate
from webapp.render import make_environment
from webapp.stats import charts, costs
from webapp.stats import store as stats
from webapp.stats import views as stats_view


@pytest.fixture(params=[None, sqlite3.Row], ids=["tuples", "rows"])
def conn(request: pytest.FixtureRequest) -> sqlite3.Connection:
    c = sqlite3.connect(":memory:")
    c.row_factory = request.param
    migrate(c)
    assert migrate(c) == []  # once only
    return c


def reply(prompt: int, cached: int, out: int, tps: float, ttft: float, **extra: object) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        ttft_s=ttft,
        prompt_tps=500.0,
        decode_tps=tps,
        peak_memory_bytes=300 << 20,
        peak_rss_bytes=400 << 20,
        total_s=out / tps + ttft,
        extra=dict(extra),
    )


def test_stats_records_every_field_including_flash(conn: sqlite3.Connection) -> None:
    rid = stats.record_reply(
        conn,
        reply(100, 40, 20, 10.0, 0.5, bytes_read=123456, hit_rate=0.75),
        backend="flash",
        model="m",
        conversation_id="c1",
        message_id=7,
        finish_reason="stop",
    )
    r = conn.execute(
        "SELECT backend, model, prompt_tokens, cached_tokens, completion_tokens, ttft_s, decode_tps, "
        "peak_memory_bytes, total_s, flash_hit_rate, flash_bytes_read, source, message_id "
        "FROM stats_replies WHERE id=?",
        (rid,),
    ).fetchone()
    assert tuple(r) == (
        "flash",
        "m",
        100,
        40,
        20,
        0.5,
        10.0,
        300 << 20,
        pytest.approx(2.5),
        0.75,
        123456,
        "chat",
        7,
    )


def test_stats_skips_replies_that_generated_nothing(conn: sqlite3.Connection) -> None:
    assert stats.record_reply(conn, GenerationStats(), backend="mlx", model="m") is None
    assert stats.totals(conn).replies == 0


def test_stats_speed_is_all_tokens_over_all_decode_time_not_a_mean_of_replies(
    conn: sqlite3.Connection,
) -> None:
    """A 2-token reply at 20 tok/s and an 80-token one at 4 tok/s: 82 tokens in 20.1 s is 4.08 tok/s (the
    mean of the two rates, 12, said three times the real speed)."""
    stats.record_reply(conn, reply(10, 0, 2, 20.0, 0.1), backend="llama", model="a")
    stats.record_reply(conn, reply(10, 0, 80, 4.0, 0.1), backend="llama", model="a")
    assert stats.totals(conn).decode_tps == pytest.approx(82 / 20.1)
    assert stats.by_model(conn)[0].decode_tps == pytest.approx(82 / 20.1)


def test_stats_totals_and_tables(conn: sqlite3.Connection) -> None:
    stats.record_reply(conn, reply(100, 0, 10, 10.0, 0.2), backend="mlx", model="a")
    stats.record_reply(conn, reply(200, 100, 30, 30.0, 0.4), backend="llama", model="a")
    stats.record_reply(conn, reply(50, 0, 5, 20.0, 0.3), backend="llama", model="a", source="api")
    t = stats.totals(conn)
    assert (t.replies, t.prompt_tokens, t.cached_tokens, t.completion_tokens) == (3, 350, 100, 45)
    assert t.decode_tps == pytest.approx(20.0) and t.ttft_s == pytest.approx(0.3)
    rows = {(r.backend, r.model): r for r in stats.by_model(conn)}
    assert rows[("llama", "a")].replies == 2 and rows[("mlx", "a")].completion_tokens == 10
    assert [b.backend for b in stats.by_backend(conn)] == ["llama", "mlx"]
    s = stats.series(conn, "decode_tps")
    assert [v for _, v in s["llama"]] == [30.0, 20.0] and [v for _, v in s["mlx"]] == [10.0]
    with pytest.raises(ValueError):
        stats.series(conn, "prompt_tokens; DROP TABLE x")


def test_grading_grades_the_last_reply_and_counts_routes(conn: sqlite3.Connection) -> None:
    with pytest.raises(stats.GradeError, match="no reply"):
        stats.grade_last(conn, "good")
    for message_id, route in ((1, "search"), (2, "shell")):
        stats.record_reply(
            conn, reply(10, 0, 5, 9.0, 0.1), backend="mlx", model="m", conversation_id="c", route=route,
            message_id=message_id,
        )  # fmt: skip
    stats.record_reply(
        conn, reply(10, 0, 5, 9.0, 0.1), backend="mlx", model="m", conversation_id="d", message_id=3
    )
    # an agent step that only called tools: a generation, no reply to grade
    stats.record_reply(
        conn, reply(10, 0, 5, 9.0, 0.1), backend="mlx", model="m", conversation_id="d", route="tools"
    )
    g = stats.grade_last(conn, "bad", "  wrong   flag ", conversation_id="c", excerpt="rm -rf /tmp/x")
    assert (g.grade, g.route, g.note, g.excerpt) == ("bad", "shell", "wrong flag", "rm -rf /tmp/x")
    stats.grade_last(conn, "good", conversation_id="c")  # re-grading replaces
    # d's last turn wrote no reply: said, not the turn before it graded in its place
    with pytest.raises(stats.GradeError, match="the last turn wrote no reply to grade"):
        stats.grade_last(conn, "bad", conversation_id="d")
    stats.record_reply(
        conn, reply(10, 0, 5, 9.0, 0.1), backend="mlx", model="m", conversation_id="d", message_id=4
    )
    stats.grade_last(conn, "bad", conversation_id="d")
    counts, graded = stats.improve(conn)
    by_route = {c.route: (c.replies, c.good, c.bad, c.ungraded) for c in counts}
    assert by_route == {"chat": (2, 0, 1, 1), "search": (1, 0, 0, 1), "shell": (1, 1, 0, 0)}  # no step graded
    assert [g.grade for g in graded] == ["bad", "good"]
    with pytest.raises(ValueError):
        stats.grade_last(conn, "meh")


def test_bench_runs_are_stored_with_medians(conn: sqlite3.Connection) -> None:
    results = [
        {
            "decode_tps": v,
            "ttft_s": t,
            "prompt_tps": 100.0,
            "peak_memory_bytes": m,
            "total_s": 1.0,
            "prompt_tokens": 30,
            "completion_tokens": 8,
        }
        for v, t, m in ((10, 0.1, 5), (30, 0.3, 9), (20, 0.2, 7))
    ]
    run = stats.record_bench_run(conn, backend="mlx", model="m", max_tokens=8, results=results)
    assert (run.decode_tps, run.ttft_s, run.peak_memory_bytes, run.total_s) == (20.0, 0.2, 9, 3.0)
    [again] = stats.bench_runs(conn)
    assert again.id == run.id and len(again.results) == 3
    assert stats.totals(conn).replies == 0 and stats.totals(conn, source="bench").replies == 3


def test_charts_are_well_formed_svg_with_escaped_labels() -> None:
    line = charts.line_chart(
        {"mlx": [(1.0, 5.0), (2.0, 9.0)], "<llama>": [(1.5, 50.0)]}, "tok/s & more", "tok/s"
    )
    root = ET.fromstring(line)
    assert root.tag.endswith("svg") and "&lt;llama&gt;" in line and "tok/s &amp; more" in line
    assert len(root.findall(".//{http://www.w3.org/2000/svg}polyline")) == 2
    bars = charts.bar_chart([("mlx", 9.0), ("llama", 97.0)], "per backend", "tok/s")
    assert len(ET.fromstring(bars).findall(".//{http://www.w3.org/2000/svg}g[@class='bar']")) == 2
    assert "No replies yet" in charts.line_chart({}, "empty")
    assert charts.nice_ceiling(97) == 100 and charts.nice_ceiling(0.31) == 0.5 and charts.nice_ceiling(0) == 1


def test_stats_window_renders_totals_costs_and_charts(conn: sqlite3.Connection, tmp_path: Path) -> None:
    stats.record_reply(conn, reply(1_000_000, 200_000, 100_000, 12.0, 0.25), backend="mlx", model="small")
    html = stats_view.render_window(make_environment(), conn, tmp_path, csrf_token="tok")
    assert "$3.96" in html  # Claude Sonnet 4.5 at the shipped prices
    assert html.count("<svg") == 4 and 'name="csrf_token" value="tok"' in html
    costs.save_prices(costs.prices_path(tmp_path), [costs.Price("Mine", 1, 0, 0, "2026-01-01")])
    assert "$0.80" in stats_view.render_window(make_environment(), conn, tmp_path)


def test_slash_answers(conn: sqlite3.Connection, tmp_path: Path) -> None:
    import asyncio

    run = lambda name, arg="": asyncio.run(stats_view.run_slash(name, arg, conn=conn, data_dir=tmp_path))  # noqa: E731
    assert "No replies" in run("stats")
    stats.record_reply(
        conn,
        reply(1_000, 0, 500, 12.0, 0.25),
        backend="mlx",
        model="small",
        conversation_id="c",
        message_id=1,
    )
    assert "| small | mlx | 1 |" in run("stats") and "**1 generation** ·" in run("stats")
    assert "| GPT-4o | $0.0075 |" in run("cost")
    assert "Graded the last reply **bad** — too long" in run("bad", "too long")
    assert "| chat | 1 | 0 | 1 | 0 |" in run("improve")
    assert "no worker" in run("bench")


def test_slash_answers_and_grades_count_the_project_they_were_typed_in(
    conn: sqlite3.Connection, tmp_path: Path
) -> None:
    """/stats and /cost in a project said every project's totals (and the API's); the Stats window's Grades
    table counted every project's replies under one project's Totals."""
    import asyncio

    def run(name: str, project: str | None, arg: str = "") -> str:
        return asyncio.run(stats_view.run_slash(name, arg, conn=conn, data_dir=tmp_path, project=project))

    stats.record_reply(
        conn, reply(1_000, 0, 500, 12.0, 0.25), backend="mlx", model="a", project_id="p1", message_id=5
    )
    stats.record_reply(
        conn, reply(2_000, 0, 100, 12.0, 0.25), backend="mlx", model="b", project_id="p2", message_id=6
    )
    stats.record_reply(conn, reply(3_000, 0, 100, 12.0, 0.25), backend="mlx", model="c", conversation_id="c2",
                       project_id="p2", message_id=7)  # fmt: skip
    assert "**1 generation in this project**" in run("stats", "p1") and "| b |" not in run("stats", "p1")
    assert "**3 generations**" in run("stats", None)
    assert "The 1,000 prompt tokens" in run("cost", "p1") and "made in this project" in run("cost", "p1")
    assert "Graded the last reply **bad**" in run("bad", None, "slow")  # the latest reply: p2's
    assert "| chat | 1 | 0 | 0 | 1 |" in run("improve", "p1") and "| chat | 2 | 0 | 1 | 1 |" in run(
        "improve", "p2"
    )
    counts, graded = stats.improve(conn, project="p1")
    assert graded == [] and counts[0].replies == 1
    window = stats_view.window_context(conn, tmp_path, project="p1")
    assert window["graded"] == [] and window["route_counts"][0].replies == 1


def test_stats_routes_render_and_save_prices_with_csrf(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from engine.worker import Worker
    from webapp.app import create_app
    from webapp.settings import Settings

    worker = Worker()
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url="http://127.0.0.1:8000") as c:
            state = app.state.flashcode
            stats.record_reply(state.db.conn, reply(1_000, 0, 500, 12.0, 0.25), backend="mlx", model="small")
            page = c.get("/stats/window")
            assert page.status_code == 200 and "$0.0075" in page.text  # GPT-4o: 1000 x 2.50 + 500 x 10
            # a walkthrough counted 31 "replies" for about 15: each agent step is a generation, and says so
            assert (
                ">Generations</dt>" in page.text
                and "(1 of them agent step that only called tools)" in page.text
            )
            form = {
                "name": ["Mine", ""],
                "input": ["1", ""],
                "cached_input": ["0.1", ""],
                "output": ["2", ""],
                "as_of": ["2026-11-01", ""],
            }
            assert c.post("/stats/prices", data=form).status_code == 403  # no CSRF token
            r = c.post("/stats/prices", data=form, headers={"x-csrf-token": state.csrf_token})
            assert r.status_code == 200 and "Mine" in r.text and "$0.0020" in r.text  # 1000 x 1 + 500 x 2
            assert [p.name for p in costs.load_prices(costs.prices_path(tmp_path))] == ["Mine"]
            bad = form | {"name": ["Mine too", ""], "input": ["abc", ""]}
            r = c.post("/stats/prices", data=bad, headers={"x-csrf-token": state.csrf_token})
            assert r.status_code == 400 and "Not saved: Mine too: Input needs a price" in r.text
            # beside the form, open, with what was typed (it closed, the message scrolled out of sight, and
            # the rows went back to the saved ones: walkthrough)
            assert re.search(
                r'<details open>\s*<summary id="stats-prices-h">Edit prices…</summary>\s*<p class="stats-error"',
                r.text,
            )
            assert 'value="Mine too"' in r.text and 'value="abc"' in r.text
            assert [p.name for p in costs.load_prices(costs.prices_path(tmp_path))] == ["Mine"]
            r = c.post("/stats/prices/reset", headers={"x-csrf-token": state.csrf_token})
            assert r.status_code == 200 and not costs.prices_path(tmp_path).exists()
            # a hand edit's typo: the window shows the defaults, and Save replaced the user's rows for good
            own = '{"models": [{"name": "my-gpt", "input": 1, "cached_input": 0, "output": 2, "as_of": "2026-01-01"},]}'
            costs.prices_path(tmp_path).write_text(own)
            r = c.post("/stats/prices", data=form, headers={"x-csrf-token": state.csrf_token})
            kept = list(tmp_path.glob("prices.unreadable-*.json"))
            assert r.status_code == 200 and len(kept) == 1 and kept[0].read_text() == own
            assert "could not be read, so it was kept as" in r.text and kept[0].name in r.text
            costs.prices_path(tmp_path).write_text("{")
            r = c.post("/stats/prices/reset", headers={"x-csrf-token": state.csrf_token})
            assert "kept as" in r.text and not costs.prices_path(tmp_path).exists()
            assert sorted(p.read_text() for p in tmp_path.glob("prices.unreadable-*.json")) == sorted(
                [own, "{"]
            )
    finally:
        worker.close()


class FakeBenchEngine:
    """Answers every prompt with `max_tokens` tokens at made-up speeds (for the bench runner)."""

    name = "fake"

    def __init__(self) -> None:
        from engine.base import ModelInfo

        self.model = ModelInfo(
            name="fake-model", path=Path("/nonexistent"), architecture="fake", size_bytes=0
        )
        self.context_length = 4096
        self.requests: list = []

    def stream(self, request, cancel):  # noqa: ANN001, ANN201
        from engine.base import Done, TextDelta

        self.requests.append(request)
        n = request.sampling.max_tokens
        for i in range(n):
            yield TextDelta("x", (i,))
        i = len(self.requests)
        yield Done(
            GenerationStats(
                prompt_tokens=20 + i,
                completion_tokens=n,
                ttft_s=0.1 * i,
                decode_tps=10.0 * i,
                peak_memory_bytes=i << 20,
                total_s=1.0,
            ),
            "length",
            "x" * n,
        )

    def close(self) -> None:
        pass


def test_bench_runs_the_fixed_prompts_greedily_and_compares_runs(conn: sqlite3.Connection) -> None:
    import asyncio

    from engine.worker import Worker
    from webapp.stats import bench as benchset

    engine = FakeBenchEngine()
    worker = Worker(lambda: engine)  # type: ignore[arg-type, return-value]
    try:
        results = benchset.run_sync(worker, max_tokens=3)
        assert len(results) == len(benchset.PROMPTS) == len(engine.requests)
        assert all(r.sampling.temperature == 0 and r.sampling.seed == benchset.SEED for r in engine.requests)
        assert [r.messages[-1]["content"] for r in engine.requests] == list(benchset.PROMPTS)
        first = stats.record_bench_run(
            conn, backend="fake", model="fake-model", max_tokens=3, results=results
        )
        assert (
            first.decode_tps == 30.0 and first.peak_memory_bytes == 5 << 20
        )  # median of 10..50, max of 1..5 MiB
        text = asyncio.run(
            stats_view.run_slash("bench", "", conn=conn, data_dir=Path("/nonexistent"), worker=worker)
        )
        assert "bench #2: fake-model on fake, 5 prompts x 64 tokens" in text and "decode x2.67" in text
        text = asyncio.run(
            stats_view.run_slash("bench", "2", conn=conn, data_dir=Path("/nonexistent"), worker=worker)
        )
        assert "bench #3: fake-model on fake, 5 prompts x 2 tokens" in text
        assert "not 'lots'" in asyncio.run(
            stats_view.run_slash("bench", "lots", conn=conn, data_dir=Path("."), worker=worker)
        )
    finally:
        worker.close()


def test_stats_tables_come_from_the_web_apps_migrations() -> None:
    """The stats tables are steps of db.py's one migration list (the integration path)."""
    c = sqlite3.connect(":memory:", isolation_level=None)
    migrate(c)
    assert stats.record_reply(c, reply(5, 0, 1, 1.0, 0.1), backend="mlx", model="m") == 1


def test_stats_slash_commands_are_registered_with_the_agent() -> None:
    from webapp.app import slash_commands

    commands = slash_commands()  # what create_app gives the agent
    call = commands.parse("/bad it ignored the file I named")
    assert call is not None and (call.name, call.arg) == ("bad", "it ignored the file I named")
    assert all(commands.parse(f"/{n}") is not None for n in stats_view.SLASH_NAMES)
    assert "/improve" in commands.help_text() and "/cost" in commands.help_text()


def test_ws_hooks_record_a_chat_reply_and_answer_commands(tmp_path: Path) -> None:
    import asyncio

    from starlette.testclient import TestClient

    from engine.worker import Worker
    from webapp.app import create_app
    from webapp.settings import Settings

    worker = Worker()
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url="http://127.0.0.1:8000"):
            state = app.state.flashcode
            conv = state.db.create_conversation("t")
            state.db.add_message(conv.id, "user", "hi")
            msg = state.db.add_message(conv.id, "assistant", "Hello there, friend.")
            s = reply(30, 10, 5, 8.0, 0.2).to_dict() | {
                "model": "m",
                "backend": "mlx",
                "finish_reason": "stop",
            }
            assert state.stats.record_chat_reply(s, conversation_id=conv.id, message_id=msg.id, route="shell")
            text = asyncio.run(state.stats.answer("good", "nice", conv.id))
            assert "**good** — nice" in text
            [g] = stats.improve(state.db.conn)[1]
            assert (g.route, g.excerpt, g.message_id) == ("shell", "Hello there, friend.", msg.id)
    finally:
        worker.close()


def test_stats_install_records_every_websocket_reply(tmp_path: Path) -> None:
    """The integrated path: `create_app` hooks the stats into the chat, then a reply over the websocket."""
    import threading

    from starlette.testclient import TestClient

    from engine.base import Done, ModelInfo, TextDelta
    from engine.worker import Worker
    from webapp.app import create_app
    from webapp.settings import Settings

    class Engine(FakeBenchEngine):
        def __init__(self) -> None:
            super().__init__()
            self.model = ModelInfo(name="tiny", path=Path("/nonexistent"), architecture="fake", size_bytes=0)

        def stream(self, request, cancel: threading.Event):  # noqa: ANN001, ANN201
            yield TextDelta("Hi", (1,))
            yield Done(
                GenerationStats(prompt_tokens=12, completion_tokens=1, ttft_s=0.01, decode_tps=5.0),
                "stop",
                "Hi",
            )

        def apply_chat_template(self, messages) -> list[int]:  # noqa: ANN001
            return [0] * 12

    worker = Worker(lambda: Engine())  # type: ignore[arg-type, return-value]
    app = create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url="http://127.0.0.1:8000") as c:
            state = app.state.flashcode
            assert state.on_reply.count(state.stats.record_chat_reply) == 1
            with c.websocket_connect(
                "ws://127.0.0.1:8000/ws", headers={"origin": "http://127.0.0.1:8000"}
            ) as ws:
                ws.send_json({"type": "send", "text": "hello"})
                for _ in range(50):
                    if "msg-stats" in ws.receive_text():
                        break
            [row] = state.db.conn.execute(
                "SELECT source, route, backend, model, prompt_tokens, completion_tokens, finish_reason, message_id "
                "FROM stats_replies"
            ).fetchall()
            assert tuple(row)[:7] == ("chat", "chat", "fake", "tiny", 12, 1, "stop") and row[7]
    finally:
        worker.close()


def test_stats_note_fragment_renders_markdown_escaped(conn: sqlite3.Connection) -> None:
    stats.record_reply(conn, reply(1_000, 0, 500, 12.0, 0.25), backend="mlx", model="<b>x</b>")
    html = stats_view.note_html(make_environment(), "stats", stats_view.stats_markdown(conn))
    assert 'hx-swap-oob="beforeend"' in html and "<table>" in html and "<b>x</b>" not in html


def test_the_reply_footer_says_how_much_of_the_prompt_came_from_a_cache() -> None:
    """A resumed context (or the engine's prefix cache) reads only the new part of the prompt: the footer
    says so beside the token counts, or a 3-second reply to a 4,600-token prompt looks like a miracle."""
    from types import SimpleNamespace

    from webapp.render import make_environment

    footer = make_environment().get_template("macros.html").module.stats_footer
    stats = {"completion_tokens": 62, "prompt_tokens": 4583, "cached_tokens": 4521, "ttft_s": 2.7}
    html = str(footer(SimpleNamespace(id=7, status="complete", stats=stats)))
    assert "4583 + 62 tokens (4521 cached)" in html and "came from a cache or a saved context" in html
    stats["cached_tokens"] = 0
    assert "cached" not in str(footer(SimpleNamespace(id=7, status="complete", stats=stats)))
