"""The agent's tools on their own: the runner (real subprocesses), project files (real symlinks),
search providers (ddgs with no network here), the SQLite store and slash parsing."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from webapp.agent.files import FileToolError, PathOutsideProjectError, ProjectFiles
from webapp.agent.runner import CommandExit, CommandRun, OutputChunk
from webapp.agent.search import DDGSProvider, LocalSearchProvider, SearchResult, SearchUnavailableError
from webapp.agent.slash import SlashError, parse_slash
from webapp.agent.store import AgentStore
from webapp.agent.tools import ReadTools, fetch_url
from webapp.db import MIGRATIONS, migrate


async def run_all(run: CommandRun) -> tuple[list[OutputChunk], CommandExit]:
    chunks, exit_ = [], None
    async for item in run.stream():
        if isinstance(item, OutputChunk):
            chunks.append(item)
        else:
            exit_ = item
    assert exit_ is not None
    return chunks, exit_


# --------------------------------------------------------------------------- runner
def test_runner_streams_both_streams_and_the_exit_code(tmp_path: Path) -> None:
    chunks, ex = asyncio.run(run_all(CommandRun("echo out; echo err >&2; pwd; exit 3", tmp_path)))
    assert {c.stream for c in chunks} == {"stdout", "stderr"}
    text = "".join(c.text for c in chunks if c.stream == "stdout")
    assert "out" in text and str(tmp_path) in text
    assert ex.exit_code == 3 and not ex.timed_out and not ex.killed


def test_runner_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    run = CommandRun("(sleep 30; touch child-survived) & echo $!; sleep 30", tmp_path, timeout_s=0.5)
    t0 = time.monotonic()
    chunks, ex = asyncio.run(run_all(run))
    assert ex.timed_out and time.monotonic() - t0 < 5 and "timed out" in ex.describe()
    child = int(chunks[0].text.split()[0])
    time.sleep(0.2)
    assert not alive(child), "the background child survived the timeout"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not reaped yet


def test_runner_caps_output_but_drains_the_pipe(tmp_path: Path) -> None:
    chunks, ex = asyncio.run(
        run_all(CommandRun("head -c 300000 /dev/zero | tr '\\0' x; echo done >&2", tmp_path, output_cap=1000))
    )
    assert sum(len(c.text) for c in chunks) == 1000 and ex.truncated and ex.exit_code == 0


def test_runner_reports_a_missing_directory(tmp_path: Path) -> None:
    _, ex = asyncio.run(run_all(CommandRun("ls", tmp_path / "gone")))
    assert ex.exit_code is None and ex.error


# --------------------------------------------------------------------------- files
@pytest.fixture
def proj(tmp_path: Path) -> Path:
    p = tmp_path / "proj"
    (p / "src").mkdir(parents=True)
    (p / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "secret.txt").write_text("secret\n")
    return p


def test_files_refuse_traversal_and_escaping_symlinks(proj: Path, tmp_path: Path) -> None:
    (proj / "link-out").symlink_to(tmp_path / "secret.txt")
    (proj / "dir-out").symlink_to(tmp_path, target_is_directory=True)
    (proj / "link-in").symlink_to(proj / "src" / "a.py")
    files = ProjectFiles(proj)
    for bad in [
        "../secret.txt",
        "src/../../secret.txt",
        str(tmp_path / "secret.txt"),
        "link-out",
        "dir-out/secret.txt",
        "/etc/passwd",
        "~/.bashrc",
    ]:
        with pytest.raises(PathOutsideProjectError):
            files.read(bad)
        with pytest.raises(PathOutsideProjectError):
            files.propose_write(bad, "pwned")
    assert files.read("link-in") == "x = 1\n"
    assert (tmp_path / "secret.txt").read_text() == "secret\n"


def test_files_refuse_a_symlink_swapped_in_before_apply(proj: Path, tmp_path: Path) -> None:
    files = ProjectFiles(proj)
    change = files.propose_write("new.txt", "data\n")
    (proj / "new.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(FileToolError):
        files.apply(change)
    assert (tmp_path / "secret.txt").read_text() == "secret\n"


def test_files_write_and_edit_produce_diffs(proj: Path) -> None:
    files = ProjectFiles(proj)
    change = files.propose_write("src/b.py", "y = 2\n")
    assert change.old is None and "--- /dev/null" in change.diff and "+y = 2" in change.diff
    assert not (proj / "src" / "b.py").exists()
    files.apply(change)
    assert (proj / "src" / "b.py").read_text() == "y = 2\n"
    edit = files.propose_edit("src/a.py", "x = 1", "x = 42")
    assert "-x = 1\n+x = 42\n" in edit.diff
    (proj / "src" / "a.py").write_text("x = 7\n")  # changed after the diff was shown
    with pytest.raises(FileToolError, match="changed since"):
        files.apply(edit)
    with pytest.raises(FileToolError, match="exactly once"):
        files.propose_edit("src/a.py", "nothing", "x")


def test_an_edit_whose_text_is_not_there_shows_the_lines_to_copy_it_from(proj: Path) -> None:
    """The 0.5B model invented `old_text` (`return add(a, b)` for `return a - b`) and made the call again and
    again: the error now carries the file's lines, numbered as read_file numbers them."""
    files = ProjectFiles(proj)
    (proj / "ops.py").write_text("def add(a, b):\n    return a - b\n")
    with pytest.raises(FileToolError) as err:
        files.propose_edit("ops.py", "return add(a, b)", "return a + b")
    assert str(err.value).endswith(
        "without the line numbers):\n    1  def add(a, b):\n    2      return a - b"
    )
    big = "".join(f"x{i} = {i}\n" for i in range(200)).replace("x150 = 150", "total = a - b")
    (proj / "big.py").write_text(big)
    with pytest.raises(FileToolError) as err:
        files.propose_edit("big.py", "total = a + b", "total = a + b + 1")
    shown = str(err.value)
    assert "Lines 131-170 of 200" in shown and "  151  total = a - b" in shown and "x10 =" not in shown
    with pytest.raises(
        FileToolError
    ) as err:  # twice there: no lines (the model knows its text is in the file)
        files.propose_edit("big.py", "= 1", "= 2")
    assert "occurs" in str(err.value) and "Lines" not in str(err.value)
    # where it occurs, and what to do (the 0.5B model made the same call three times: walkthrough)
    (proj / "ops2.py").write_text("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a + b\n")
    with pytest.raises(FileToolError) as err:
        files.propose_edit("ops2.py", "    return a + b", "    return a * b")
    assert str(err.value) == (
        "ops2.py: the text to replace occurs 2 times; it must occur exactly once (at lines 2, 6): put more of "
        "the lines around the one to change in old_text"
    )
    with pytest.raises(FileToolError, match=r"occurs 2 times; it must occur exactly once \(at lines 1, 5\)"):
        files.propose_edit("ops2.py", "(a, b):\n    return", "(a, b):\n    return")


# --------------------------------------------------------------------------- search
def test_search_ddgs_without_network_says_so_plainly() -> None:
    provider = DDGSProvider(timeout_s=3, min_interval_s=0)
    t0 = time.monotonic()
    with pytest.raises(SearchUnavailableError) as info:
        asyncio.run(provider.search("flashcode local llm"))
    assert str(info.value).startswith("web search is unavailable: ") and time.monotonic() - t0 < 10


def test_search_ddgs_goes_through_the_proxy_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ddgs client, HTTPS_PROXY set: its requests go to that proxy (here one that hears them and hangs
    up), as fetch_url's do. (ddgs passes no proxy of its own to primp, whose client reads the environment.)"""
    import socketserver
    import threading

    heard: list[str] = []

    class Proxy(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            heard.append(self.rfile.readline().decode("latin-1").strip())

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "DDGS_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        with pytest.raises(SearchUnavailableError):
            asyncio.run(DDGSProvider(timeout_s=3, min_interval_s=0).search("flashcode local llm"))
    finally:
        server.shutdown()
        server.server_close()
    assert heard and all(line.startswith("CONNECT ") for line in heard), heard


def test_search_ddgs_caches_and_throttles(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    provider = DDGSProvider(timeout_s=3, min_interval_s=0.3)

    def fake_fetch(query: str, kind: str, n: int) -> list[dict]:
        calls.append(time.monotonic())
        return [{"title": f"T {query}", "href": "https://www.example.org/x", "body": "snippet"}]

    monkeypatch.setattr(provider, "_fetch", fake_fetch)

    async def go() -> list[list[SearchResult]]:
        return [await provider.search("a"), await provider.search("A "), await provider.search("b")]

    a, a2, b = asyncio.run(go())
    assert a == a2 and len(calls) == 2 and calls[1] - calls[0] >= 0.29
    assert a[0].site == "example.org" and b[0].title == "T b"


def test_search_local_provider_serves_fixed_results() -> None:
    r = SearchResult("Title", "https://example.com/p", "snip")
    provider = LocalSearchProvider({"q": [r]})
    assert asyncio.run(provider.search("Q")) == [r] and asyncio.run(provider.search("other")) == []
    assert provider.history == [("Q", "text"), ("other", "text")]


# --------------------------------------------------------------------------- store
def test_store_schema_rules_and_audit_trail(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "db.sqlite")
    migrate(conn)
    assert migrate(conn) == []  # once only
    agent_steps = [
        sql for _, name, steps in MIGRATIONS if "agent" in name or "sandbox" in name for sql in steps
    ]
    assert agent_steps and all("IF NOT EXISTS" in sql for sql in agent_steps)  # older databases may hold them
    store = AgentStore(conn)
    rule = store.add_rule("/p", "prefix", "git status")
    assert store.add_rule("/p", "prefix", "git status").id == rule.id
    store.add_rule("/p", "exact", "rm -rf build")
    assert [r.pattern for r in store.list_rules("/p")] == ["git status", "rm -rf build"]
    assert store.list_rules("/other") == []
    with pytest.raises(ValueError):
        store.add_rule("/p", "prefix", "bash")
    assert store.remove_rule("/p", rule.id or 0) and [r.kind for r in store.list_rules("/p")] == ["exact"]
    aid = store.record_proposal("/p", "shell", "ls", "conv1")
    store.record_decision(aid, "once")
    store.record_result(aid, 0, "exit code 0")
    (row,) = store.actions("/p")
    assert (row.command, row.decision, row.exit_code, row.outcome) == ("ls", "once", 0, "exit code 0")


# --------------------------------------------------------------------------- slash
def test_slash_parsing() -> None:
    assert parse_slash("hello") is None and parse_slash("//not a command") is None
    call = parse_slash("/shell  ls -la ")
    assert call is not None and (call.name, call.arg) == ("shell", "ls -la")
    call = parse_slash("/search rust async")
    assert call is not None and call.arg == "rust async"
    call = parse_slash("/write a.txt\nline 1\n")
    assert call is not None and call.arg == "a.txt\nline 1\n"
    assert parse_slash("/RAW") is not None
    with pytest.raises(SlashError, match="unknown"):
        parse_slash("/frobnicate")
    with pytest.raises(SlashError, match="needs"):
        parse_slash("/model")


def test_search_text_does_not_follow_symlinks_out_of_the_project(
    proj: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository that ships `docs/notes.txt -> ../../secret.txt` or `-> /proc/self/environ`: read_file
    refuses them, and so must search (its Python walk, used where ripgrep is not installed)."""
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)  # the Python walk, as without rg
    monkeypatch.setenv("FAKE_API_KEY", "sk-live-123456")
    (proj / "docs").mkdir()
    (proj / "docs" / "notes.txt").symlink_to(tmp_path / "secret.txt")
    (proj / "docs" / "env.txt").symlink_to("/proc/self/environ")
    (proj / "docs" / "inside.txt").symlink_to(proj / "src" / "a.py")
    (proj / "docs" / "blob.bin").write_bytes(b"x = 1\0\xff")
    tools = ReadTools(ProjectFiles(proj))
    assert tools.search_text("secret") == "(no matches)"
    assert tools.search_text("FAKE_API_KEY") == "(no matches)"
    assert tools.search_text("secret", "docs") == "(no matches)"
    assert tools.search_text(r"x = 1").splitlines() == ["docs/inside.txt:1:x = 1", "src/a.py:1:x = 1"]
    with pytest.raises(PathOutsideProjectError):
        tools.search_text("secret", "docs/notes.txt")


def _send_text(handler: Any, body: bytes) -> None:
    """An http.server handler's 200 answer: `body` as text/plain."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _this_machines_address() -> str:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # a route lookup only: this machine's network address
        return str(s.getsockname()[0])


def test_fetch_url_refuses_this_machines_own_services_also_after_a_redirect() -> None:
    """fetch_url runs in the server, beside flashcode's own port (no token on loopback): a page could point
    the model there, directly or through a redirect. A page on this machine's network address still loads."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(f"{self.server.server_address[0]}{self.path}")
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{inner.server_address[1]}/secret")
                self.end_headers()
                return
            _send_text(self, b"plain page")

        def log_message(self, *args: object) -> None:
            pass

    address = _this_machines_address()
    inner, outer = ThreadingHTTPServer(("127.0.0.1", 0), Handler), ThreadingHTTPServer((address, 0), Handler)
    for server in (inner, outer):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    port = inner.server_address[1]
    try:
        for url in (f"http://127.0.0.1:{port}/secret", f"http://localhost:{port}/secret",
                    f"http://[::ffff:127.0.0.1]:{port}/secret", f"http://{address}:{outer.server_address[1]}/redirect"):  # fmt: skip
            with pytest.raises(FileToolError, match="out of bounds"):
                asyncio.run(fetch_url(url))
        assert asyncio.run(fetch_url(f"http://{address}:{outer.server_address[1]}/page")) == "plain page"
    finally:
        for server in (inner, outer):
            server.shutdown()
            server.server_close()
    assert not [h for h in hits if h.startswith("127.")]  # the loopback server never saw a request
    assert f"{address}/redirect" in hits and f"{address}/page" in hits


def test_fetch_url_connects_only_to_the_address_it_checked() -> None:
    """DNS rebinding: a name answers a public address to a check and 127.0.0.1 to the connection. There is
    no separate check to fool: the connection resolves once and refuses loopback itself."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "6")
            self.end_headers()
            self.wfile.write(b"secret")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for host in ("localhost", "127.0.0.1"):
            with pytest.raises(FileToolError, match="out of bounds"):
                asyncio.run(fetch_url(f"http://{host}:{server.server_address[1]}/secret"))
    finally:
        server.shutdown()
        server.server_close()
    assert hits == []


def test_fetch_url_goes_through_the_proxy_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY/HTTPS_PROXY are honoured (a network whose only way out is a proxy), NO_PROXY too; through a
    proxy the target is still checked here first: a loopback address, literal or by name, never reaches it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from webapp.agent import tools as agent_tools

    proxied: list[str] = []
    direct: list[str] = []

    class Proxy(BaseHTTPRequestHandler):  # a forward proxy that answers itself: the request line is the URL
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            proxied.append(self.path)
            _send_text(self, f"via proxy: {self.path}".encode())

        def log_message(self, *args: object) -> None:
            pass

    class Page(Proxy):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            direct.append(self.path)
            _send_text(self, b"direct page")

    address = _this_machines_address()
    proxy, page = ThreadingHTTPServer(("127.0.0.1", 0), Proxy), ThreadingHTTPServer((address, 0), Page)
    for server in (proxy, page):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    real_resolve = agent_tools._resolve

    names = {"example.test": "93.184.215.14", "fass.de": "93.184.215.14", "xn--fa-hia.de": "127.0.0.1"}
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:  # no DNS here: a few names, the rest as is
        asked.append(host)
        return [names[host]] if host in names else await real_resolve(host, port)

    monkeypatch.setattr(agent_tools, "_resolve", resolve)
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY"):  # a proxy on loopback is fine
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.server_address[1]}")
    monkeypatch.setenv("NO_PROXY", address)
    try:
        assert (
            asyncio.run(fetch_url("http://example.test/page?q=1"))
            == "via proxy: http://example.test/page?q=1"
        )
        for url in (f"http://127.0.0.1:{page.server_address[1]}/secret", "http://localhost/secret",
                    "http://169.254.169.254/latest/meta-data/", "http://localhost./", "http://127.0.0.1./",
                    "http://169.254.169.254./latest/", "http://foo.localhost/", "https://localhost./",
                    "http://[::ffff:127.0.0.1]/", "http://2130706433/",
                    # the proxy is sent the IDNA name: checked as that, not as Python's `fass.de`
                    "http://faß.de/secret"):  # fmt: skip
            with pytest.raises(FileToolError, match="out of bounds"):
                asyncio.run(fetch_url(url))
        assert "fass.de" not in asked
        with pytest.raises(
            FileToolError, match="could not resolve"
        ):  # unchecked: could answer 127.0.0.1 there
            asyncio.run(fetch_url("http://nowhere.invalid/"))
        # NO_PROXY: straight to the page, through the direct path's own checks
        assert asyncio.run(fetch_url(f"http://{address}:{page.server_address[1]}/here")) == "direct page"
    finally:
        for server in (proxy, page):
            server.shutdown()
            server.server_close()
    assert proxied == ["http://example.test/page?q=1"]
    assert direct == ["/here"]


def test_list_files_takes_a_glob_as_the_folder_before_it_filtered(tmp_path: Path) -> None:
    """A small model asks for `./*` (seen: four times in a row, each refused as "not a folder"): a path with a
    glob lists the folder before its first glob part, filtered by the whole pattern, still inside the project."""
    (tmp_path / "src" / "sub").mkdir(parents=True)
    for name in ("a.py", "README.md", "src/b.py", "src/sub/c.txt"):
        (tmp_path / name).write_text("x\n")
    tools = ReadTools(ProjectFiles(tmp_path))
    every = ["README.md", "a.py", "src/b.py", "src/sub/c.txt"]
    assert tools.list_files("./*").splitlines() == every == tools.list_files("*").splitlines()
    assert tools.list_files("src/*.py").splitlines() == ["src/b.py"]
    assert tools.list_files("./src/*").splitlines() == ["src/b.py", "src/sub/c.txt"]
    assert tools.list_files("*.md").splitlines() == ["README.md"]
    assert tools.list_files("*.rs") == "(no files)"
    assert tools.list_files("**/*.py").splitlines() == ["a.py", "src/b.py"]  # `**/` matches no folder too
    assert tools.list_files(f"{tmp_path}/src/*.py").splitlines() == ["src/b.py"]  # an absolute glob
    (tmp_path / "app" / "[id]").mkdir(parents=True)  # a folder named like a glob (Next.js) is that folder
    (tmp_path / "app" / "[id]" / "page.tsx").write_text("x\n")
    assert tools.list_files("app/[id]").splitlines() == ["app/[id]/page.tsx"]
    with pytest.raises(PathOutsideProjectError):
        tools.list_files("../*")


def test_a_call_nobody_answered_is_not_called_denied_by_the_user() -> None:
    """The 0.5B model answered "The output of main.py is `Denied by the user: no answer within 300 s`": a
    dialog left unanswered (or no one there to ask) is not the user's no, and nothing ran."""
    from webapp.agent.tools import denied

    for reason in (
        "no answer within 300 s",
        "no one is there to approve it",
        "not decided: the page was closed",
    ):
        said = denied(reason)
        assert (
            said.startswith(f"Not run: {reason}") and "by the user" not in said and "nothing it would" in said
        )
    assert denied("use mental arithmetic") == "Denied by the user: use mental arithmetic"
    assert denied("") == "Denied by the user."


def test_read_file_says_when_it_showed_all_of_a_file(tmp_path: Path) -> None:
    """What write_file may replace (`ToolLoop._unread`): only a file a read showed whole."""
    (tmp_path / "short.py").write_text("a = 1\nb = 2\n")
    (tmp_path / "long.py").write_text("".join(f"x{n} = {n}\n" for n in range(450)))
    (tmp_path / "empty.py").write_text("")
    tools = ReadTools(ProjectFiles(tmp_path))
    assert tools.read_file_shown("short.py")[1] == "a = 1\nb = 2\n"
    assert tools.read_file_shown("short.py", 1, 2)[1] == "a = 1\nb = 2\n"
    assert (
        tools.read_file_shown("short.py", 2)[1] is None and tools.read_file_shown("short.py", 1, 1)[1] is None
    )
    out, whole = tools.read_file_shown("long.py")  # 400 lines at most
    assert whole is None and "[... lines 401-450 not shown]" in out
    assert tools.read_file_shown("short.py", 9)[1] is None and tools.read_file_shown("empty.py")[1] == ""
