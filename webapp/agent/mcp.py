"""Tools from a project's MCP servers: started lazily, kept across turns, every call approved.

`McpServers` (one per process: `shared()`; a test may give a session its own as `session.mcp`)
holds the running servers, one `ServerHandle` per (project, server name). A handle lives on one
asyncio task for its whole life — the official SDK's `Client` and its transport (anyio cancel
scopes and task groups) are entered and exited there — and takes calls through a queue; each call
runs in a child task of that task, with its timeout. A server starts the first time a turn needs
its tools, is reused by later turns of any conversation of the project while its config (and the
project's network switch) stay the same, and stops when it is removed or disabled in Settings,
when it hangs (a call past its timeout), after `IDLE_S` unused, when its project is no longer
registered (swept at the next turn) and at shutdown (`close_all`).

Stdio servers run in the sandbox of shell commands (`sandbox.launch`: writes only in the project,
secrets hidden, network per the project's switch, the commands' clean environment plus the
server's `env`). The SDK's `stdio_client` spawns the process itself and passes no descriptors, so
the bubblewrap argv is wrapped in `bash -c 'exec "$@" 3<FILE'` with the seccomp program in a
private file that bwrap reads as fd 3 (the file is deleted once the server answered). HTTP servers
are reached by flashcode itself; with the project's network off only loopback URLs are.

`McpTools(session)` is one turn's view, for the tool loop: `load()` starts the project's usable
servers and lists their tools as `server__tool` (schemas the constrained decoder cannot take are
left out, with a notice), `execute(call)` checks the arguments, asks for approval (unless the
project has a 'tool' allow rule for exactly that tool and the server is sandboxed or remote) and
calls. Failures — a server that does not start, exits, hangs or answers with an error — are the
model's result and a notice in the transcript; the turn goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from engine import paths
from engine.base import ToolCall

from . import sandbox
from .events import AgentEvent, Decided, Notice, Proposal
from .mcp_config import ServerConfig, tool_name
from .mcp_store import McpStore
from .tools import ToolResult, denied

if TYPE_CHECKING:
    from .agent import AgentSession

log = logging.getLogger(__name__)


def _one_line(record: logging.LogRecord) -> bool:
    """The SDK logs a server's every non-JSON stdout line with a 30-line traceback; one line says as much
    (the notice "NAME is not available this turn" follows, and the server's stderr log keeps the rest)."""
    record.exc_info, record.exc_text = None, None
    return True


logging.getLogger("mcp.client.stdio").addFilter(_one_line)
START_TIMEOUT_S = 30.0  # FLASHCODE_MCP_START_TIMEOUT_S
CALL_TIMEOUT_S = 60.0  # FLASHCODE_MCP_CALL_TIMEOUT_S
IDLE_S = 15 * 60.0
RETRY_AFTER_S = (
    5 * 60.0
)  # a server that hung at start is not started again before this (each try held a turn)
STDERR_TAIL = 800  # characters of a failed server's stderr shown with its error
RESULT_CHARS = 12_000


class ServerDown(RuntimeError):
    """A server that could not start, exited, hung or broke the protocol; the message says which."""


@dataclass(frozen=True)
class Launch:
    """What one server runs as in one project: its config and the sandbox it gets."""

    project: str
    project_dir: Path
    config: ServerConfig
    network: bool = False
    hidden: tuple[Path, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.project, self.config.name)

    @property
    def fingerprint(self) -> str:
        return f"{self.config.fingerprint}:{int(self.network)}:{self.project_dir}:{','.join(map(str, self.hidden))}"

    @property
    def remote(self) -> bool:
        return self.config.transport == "http"

    def policy(self) -> sandbox.SandboxPolicy:
        return sandbox.SandboxPolicy(self.project_dir, network=self.network, hidden=self.hidden)

    def describe_sandbox(self) -> tuple[str, bool]:
        """(how the server runs, whether it is sandboxed) for the dialog and `flashcode tools`."""
        if self.remote:
            return (
                f"remote MCP server at {self.config.url}: runs outside flashcode, not sandboxed by it",
                False,
            )
        box = sandbox.detect()
        return box.describe(self.policy()), box.available


@dataclass(frozen=True)
class McpTool:
    name: str  # server__tool, what the model calls
    server: str
    remote_name: str  # the server's own name for the tool
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _message(exc: BaseException) -> str:
    """One line for the first real error inside (task groups wrap the SDK's errors)."""
    leaves = [e for e in _leaves(exc) if not isinstance(e, asyncio.CancelledError | GeneratorExit)]
    e = leaves[0] if leaves else exc
    if isinstance(e, ServerDown):
        return str(e)
    if isinstance(e, FileNotFoundError | PermissionError):
        return f"could not start: {e.strerror}: {e.filename}"
    text = str(e).strip() or type(e).__name__
    if "Connection closed" in text or type(e).__name__ in ("EndOfStream", "BrokenResourceError"):
        return "exited (the connection closed)"
    return f"{type(e).__name__}: {text}"[:500]


# --------------------------------------------------------------------------- one server
class ServerHandle:
    """One running server; all SDK objects live on `self.task`."""

    def __init__(
        self,
        launch: Launch,
        start_timeout_s: float,
        call_timeout_s: float,
        on_start_timeout: Callable[[ServerHandle], None] | None = None,
    ) -> None:
        self.launch = launch
        self.on_start_timeout = on_start_timeout
        self.fingerprint = launch.fingerprint
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[list[Any]] = self.loop.create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "never retrieved"
        self.calls: asyncio.Queue[tuple[str, dict[str, Any], float, asyncio.Future[Any]] | None] = (
            asyncio.Queue()
        )
        self.task: asyncio.Task[None] | None = None
        self.error: str | None = None
        self.dead = False
        self._stopping: asyncio.Future[None] | None = None  # the one stop (`stop`)
        self.last_used = time.monotonic()
        self.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        # the sandbox's descriptors (the seccomp program, the env, the folders): open until the server answered
        self._launch = contextlib.ExitStack()
        self._pending: set[asyncio.Future[Any]] = set()

    @property
    def name(self) -> str:
        return self.launch.config.name

    # ------------------------------------------------------------------ from any task
    async def tools(self) -> list[Any]:
        """The server's tools (starting it on first use); ServerDown when it cannot start."""
        self.last_used = time.monotonic()
        if self.dead:
            raise ServerDown(self.error or "stopped")
        if self.task is None:
            self.task = asyncio.create_task(self._main(), name=f"mcp-{self.name}")
        try:
            return await asyncio.wait_for(asyncio.shield(self.ready), self.start_timeout_s)
        except TimeoutError:
            self.error = f"did not answer within {self.start_timeout_s:g} s of starting (it was stopped)"
            if self.on_start_timeout is not None:
                self.on_start_timeout(self)
            await self.stop()
            raise ServerDown(self.error) from None

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float | None = None) -> Any:
        await self.tools()
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self.last_used = time.monotonic()
        self.calls.put_nowait((name, arguments, timeout_s or self.call_timeout_s, fut))
        return await fut

    async def stop(self) -> None:
        """Stop the server (the SDK closes stdin, then terminates the process group) and wait. Stopped once: a
        second caller (a sweep, `handle`) waits for the same stop, as a second cancel could cut the SDK's
        shutdown of the process short. A caller cancelled meanwhile is cancelled; the stop goes on."""
        self.dead = True
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        task = self.task
        if task is None or task.done():
            self._fail_all(self.error or "stopped")
            return
        if not self.ready.done():  # it never answered (a hung start): nothing reads `calls`, so no goodbye is
            task.cancel()  # waited for 10 s; the SDK closes its stdin and ends the process as it unwinds
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 10)
            return
        self.calls.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 10)
        except Exception:  # noqa: BLE001 - already recorded by _main
            pass

    # ------------------------------------------------------------------ the owner task
    def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        cfg = self.launch.config
        if cfg.transport == "http":
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            if not self.launch.network and not _loopback(cfg.url):
                raise ServerDown(
                    f"network access is off for this project, so {cfg.url} is not contacted "
                    "(the user can allow the network in Settings; loopback URLs always work)"
                )
            client = httpx2.AsyncClient(headers=dict(cfg.headers), timeout=httpx2.Timeout(30.0, read=300.0))
            stack.push_async_callback(client.aclose)
            return streamable_http_client(cfg.url, http_client=client)
        from mcp import StdioServerParameters, stdio_client

        project = self.launch.project_dir
        env = {**sandbox.command_env(project_dir=project), **dict(cfg.env)}
        argv = [cfg.command, *cfg.args]
        if sandbox.detect().available:
            # the config's env goes into the sandbox only: the wrapper, bubblewrap and usernet.py run with the
            # clean environment (a PATH or BASH_ENV of the config would run a project file outside the sandbox)
            env = sandbox.command_env(project_dir=project)
            # held open until the server answered: the wrapper reopens them (`_release_launch` closes them)
            wrapped, fds = self._launch.enter_context(
                sandbox.launch(argv, self.launch.policy(), env=dict(cfg.env))
            )
            argv = list(wrapped)
            if fds:
                # the seccomp program, the env (the config's keys: never written to a file), the folders: bwrap
                # reads fds 3, 4, ... that a wrapper opens from this process's /proc (each opened anew: a memfd
                # from its start, a folder as the descriptor holds it)
                named = {fd: sandbox.argv_fds(argv, fd) for fd in fds}  # before any is renumbered
                for n, fd in enumerate(fds, start=3):
                    for i in named[fd]:
                        argv[i] = str(n)
                sources = [f"/proc/{os.getpid()}/fd/{fd}" for fd in fds]
                opens = " ".join(
                    f'{n}<"${{{i}}}"' for i, n in enumerate(range(3, 3 + len(sources)), start=1)
                )  # ${10}: $10 is $1, then 0
                script = f'exec {opens}; shift {len(sources)}; exec "$@"'
                argv = [
                    sandbox.system_program("bash", project) or "/bin/bash",
                    "-c",
                    script,
                    "flashcode-mcp",
                    *sources,
                    *argv,
                ]
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=str(project))
        return stdio_client(params, errlog=self.errlog)

    def _release_launch(self) -> None:
        """The server answered (or is gone): the wrapper has opened the sandbox's descriptors, which close
        here (one a folder in the project: a workspace of many repositories holds many)."""
        self._launch.close()

    async def _main(self) -> None:
        import anyio
        from mcp import Client

        try:
            async with contextlib.AsyncExitStack() as stack:
                client = Client(self._transport(stack), cache=None)
                await stack.enter_async_context(client)
                tools: list[Any] = []
                cursor: str | None = None
                for _ in range(50):  # pages
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self._release_launch()
                if not self.ready.done():
                    self.ready.set_result(tools)
                async with anyio.create_task_group() as tg:
                    while (item := await self.calls.get()) is not None:
                        tg.start_soon(self._one_call, client, item)
                    tg.cancel_scope.cancel()
        except BaseException as exc:
            self.error = self.error or self._with_stderr(_message(exc))
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
        finally:
            self.dead = True
            self._release_launch()
            reason = self.error or "stopped"
            if not self.ready.done():
                self.ready.set_exception(ServerDown(reason))
            self._fail_all(reason)

    async def _one_call(
        self, client: Any, item: tuple[str, dict[str, Any], float, asyncio.Future[Any]]
    ) -> None:
        import anyio

        name, arguments, timeout_s, fut = item
        if fut.done():
            return
        with anyio.CancelScope() as scope:
            fut.add_done_callback(lambda f: scope.cancel() if f.cancelled() else None)  # Stop
            try:
                with anyio.fail_after(timeout_s):
                    result = await client.call_tool(name, arguments)
            except TimeoutError:
                self.error = f"did not answer {name} within {timeout_s:g} s (it was stopped; it restarts on the next call)"
                if not fut.done():
                    fut.set_exception(ServerDown(self.error))
                self.dead = True
                self.calls.put_nowait(None)
                return
            except Exception as exc:  # noqa: BLE001 - the call's result
                message = self._with_stderr(_message(exc))
                if not fut.done():
                    fut.set_exception(ServerDown(message))
                if "exited" in message:
                    self.error, self.dead = message, True
                    self.calls.put_nowait(None)
                return
            if not fut.done():
                fut.set_result(result)

    def _with_stderr(self, message: str) -> str:
        try:
            self.errlog.flush()
            self.errlog.seek(0)
            tail = self.errlog.read()[-STDERR_TAIL:].strip()
        except (OSError, ValueError):
            tail = ""
        return f"{message}; its stderr ends with:\n{tail}" if tail else message

    def _fail_all(self, reason: str) -> None:
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(ServerDown(reason))


# --------------------------------------------------------------------------- all servers
class McpServers:
    """The running servers of this process, by (project, name)."""

    def __init__(
        self,
        start_timeout_s: float | None = None,
        call_timeout_s: float | None = None,
        idle_s: float = IDLE_S,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        if start_timeout_s is None:
            start_timeout_s = paths.env_number("FLASHCODE_MCP_START_TIMEOUT_S", START_TIMEOUT_S)
        if call_timeout_s is None:
            call_timeout_s = paths.env_number("FLASHCODE_MCP_CALL_TIMEOUT_S", CALL_TIMEOUT_S)
        self.start_timeout_s, self.call_timeout_s, self.idle_s = start_timeout_s, call_timeout_s, idle_s
        self.retry_after_s = retry_after_s
        self.handles: dict[tuple[str, str], ServerHandle] = {}
        # servers that hung at start: (fingerprint, when to try again, the message), so that one stuck
        # server does not hold up every turn by its start timeout; Settings (off and on, a new config) clears
        self.stalled: dict[tuple[str, str], tuple[str, float, str]] = {}

    def _stalled(self, h: ServerHandle) -> None:
        retry_at = time.monotonic() + self.retry_after_s
        clock = time.strftime("%H:%M", time.localtime(time.time() + self.retry_after_s))
        self.stalled[h.launch.key] = (
            h.fingerprint,
            retry_at,
            f"{h.error}; it is not started again before {clock}, so that it does not hold up every turn "
            "(to try now: switch it off and on in Settings › MCP servers)",
        )

    async def handle(self, launch: Launch) -> ServerHandle:
        """The live handle for this launch: the running one if its config is the same, else new."""
        loop = asyncio.get_running_loop()
        h = self.handles.get(launch.key)
        if h is not None and (h.dead or h.fingerprint != launch.fingerprint or h.loop is not loop):
            self.handles.pop(launch.key, None)
            if h.loop is loop:
                await h.stop()
            h = None
        if h is None and (stalled := self.stalled.get(launch.key)) is not None:
            fingerprint, retry_at, message = stalled
            if fingerprint == launch.fingerprint and time.monotonic() < retry_at:
                h = ServerHandle(launch, self.start_timeout_s, self.call_timeout_s)
                h.dead, h.error = True, message  # not kept: tools() and call() raise ServerDown(message)
                h.errlog.close()
                return h
            del self.stalled[launch.key]
        if h is None:
            h = self.handles[launch.key] = ServerHandle(
                launch, self.start_timeout_s, self.call_timeout_s, self._stalled
            )
        return h

    async def stop(self, project: str, name: str | None = None) -> int:
        """Stop one server of a project, or all of them; returns how many were running."""
        for k in [k for k in self.stalled if k[0] == project and (name is None or k[1] == name)]:
            del self.stalled[k]  # the user changed something in Settings: try it again at the next turn
        keys = [k for k in self.handles if k[0] == project and (name is None or k[1] == name)]
        return await self._stop_keys(keys)

    async def _stop_keys(self, keys: list[tuple[str, str]]) -> int:
        loop = asyncio.get_running_loop()
        handles = [self.handles.pop(k) for k in keys if k in self.handles]
        await asyncio.gather(*(h.stop() for h in handles if h.loop is loop))
        return len(handles)

    async def sweep(self, live_projects: set[str] | None = None) -> int:
        """Stop servers unused for `idle_s` and those of projects no longer registered."""
        now = time.monotonic()
        keys = [
            k
            for k, h in self.handles.items()
            if h.dead
            or now - h.last_used > self.idle_s
            or (live_projects is not None and k[0] not in live_projects)
        ]
        return await self._stop_keys(keys)

    async def close_all(self) -> None:
        await self._stop_keys(list(self.handles))

    def running(self, project: str) -> set[str]:
        return {k[1] for k, h in self.handles.items() if k[0] == project and not h.dead and h.ready.done()}


_SHARED: McpServers | None = None


def shared() -> McpServers:
    """The process's servers (the web app's and the command line's)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = McpServers()
    return _SHARED


# --------------------------------------------------------------------------- schemas and results
def clean_schema(schema: Any) -> dict[str, Any]:
    """An MCP input schema as a tool's parameters: an object schema, `$schema` dropped."""
    out = dict(schema) if isinstance(schema, dict) else {}
    out.pop("$schema", None)
    out["type"] = "object"
    out.setdefault("properties", {})
    return out


def schema_problem(tool: dict[str, Any]) -> str | None:
    """Why the constrained decoder cannot take this tool's schema (None: it can)."""
    from llguidance import LLMatcher

    from engine.tool_calls import call_grammar

    try:
        return LLMatcher.validate_grammar(call_grammar([tool])) or None
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot be constrained
        return str(exc)[:300]


def check_mcp_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"invalid arguments{f' at {where}' if where else ''}: {exc.message}"[:600]
    except jsonschema.SchemaError:
        return None  # the server's schema is broken; the server checks its own arguments
    return None


def result_text(result: Any) -> str:
    """A CallToolResult as text for the model: its text blocks, other blocks described."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(
                f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes: not shown to the model]"
            )
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(
                f"[resource {res.uri}]\n{text}" if text is not None else f"[binary resource {res.uri}]"
            )
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(parts) or "(no output)"


class _CallStopper:
    """What `AgentSession.stop` kills while an MCP call runs (it kills `session._run`)."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task

    def kill(self) -> None:
        self.task.cancel()


# --------------------------------------------------------------------------- one turn
class McpTools:
    """The MCP tools of one session's turn (the tool loop's view)."""

    def __init__(self, session: AgentSession, servers: McpServers | None = None) -> None:
        self.s = session
        self.servers = servers or getattr(session, "mcp", None) or shared()
        self.store = McpStore(session.store.conn)
        self.tools: dict[str, McpTool] = {}
        self.launches: dict[str, Launch] = {}

    def launch_for(self, cfg: ServerConfig) -> Launch:
        s = self.s
        return Launch(s.project, s.project_dir, cfg, s.store.network_allowed(s.project), s.hidden)

    def openai(self) -> tuple[dict[str, Any], ...]:
        return tuple(t.openai() for t in self.tools.values())

    async def load(self, live_projects: set[str] | None = None) -> AsyncIterator[AgentEvent]:
        """Start the project's usable servers and list their tools; notices for the others."""
        s = self.s
        await self.servers.sweep(live_projects)
        found = self.store.servers(s.project, s.project_dir)
        if found.file_error:
            yield Notice(f"MCP: {found.file_error}", "warning")
        usable: list[ServerConfig] = []
        run_only = getattr(s, "mcp_run_approved", None) or set()  # `flashcode agent --approve all`
        for cfg in found.servers:
            if not cfg.approved and (cfg.name, cfg.fingerprint) in run_only:
                cfg = replace(cfg, approved=True)
            if cfg.error:
                yield Notice(f"MCP server {cfg.name} is not used: {cfg.error}", "warning")
            elif cfg.enabled and not cfg.approved:
                yield Notice(
                    f"MCP server {cfg.name} from .mcp.json is not approved yet, so it was not started: it "
                    f"would run `{cfg.describe()}`. Approve it in Settings › MCP servers to use its tools.",
                    "info",
                )
            elif cfg.usable:
                usable.append(cfg)
        if not usable:
            return
        launches = [self.launch_for(cfg) for cfg in usable]
        handles = [await self.servers.handle(launch) for launch in launches]
        listed = await asyncio.gather(*(h.tools() for h in handles), return_exceptions=True)
        for launch, tools in zip(launches, listed, strict=True):
            name = launch.config.name
            if isinstance(tools, BaseException):
                text = str(tools) if isinstance(tools, ServerDown) else _message(tools)
                yield Notice(f"MCP server {name} is not available this turn: {text}", "warning")
                continue
            if not launch.remote and not sandbox.detect().available:
                yield Notice(f"MCP server {name} runs NOT sandboxed: {sandbox.detect().reason}", "warning")
            skipped: list[str] = []
            for t in tools:
                full = tool_name(name, t.name)
                if full in self.tools:
                    skipped.append(f"{t.name} (its name clashes with {self.tools[full].remote_name})")
                    continue
                mt = McpTool(full, name, t.name, (t.description or "")[:1000], clean_schema(t.input_schema))
                if why := schema_problem(mt.openai()):
                    skipped.append(f"{t.name} (its input schema cannot be constrained: {why})")
                    continue
                self.tools[full] = mt
                self.launches[full] = launch
            if skipped:
                yield Notice(f"MCP server {name}: tools left out: {'; '.join(skipped)}", "warning")

    # ------------------------------------------------------------------ a call
    async def _git_notices(self, server: str, before: Any) -> list[Notice]:
        """The warnings for git directories the server made in the project during the call (`before`:
        `sandbox.git_state`'s, None for a remote server)."""
        if before is None:
            return []
        said = await asyncio.to_thread(sandbox.git_warnings, self.s.project_dir, before)
        return [Notice(w.replace("The command", f"The MCP server {server}"), "warning") for w in said]

    async def execute(self, call: ToolCall) -> AsyncIterator[AgentEvent | ToolResult]:
        s, tool, launch = self.s, self.tools[call.name], self.launches[call.name]
        if why := check_mcp_arguments(tool.parameters, call.arguments):
            yield ToolResult(False, f"Error: {call.name}: {why}")
            return
        args_text = json.dumps(call.arguments, ensure_ascii=False)
        command = f"{call.name} {args_text}"
        where, sandboxed = launch.describe_sandbox()
        rule = self.store.tool_rule(s.project, call.name)
        trusted = launch.remote or sandboxed
        allowed = rule is not None and trusted
        if allowed:
            rule_text = f"allowed by the rule for the tool {call.name} in this project"
        elif rule is not None:
            rule_text = "the server is NOT sandboxed, so allow rules are ignored: every call asks"
        else:
            rule_text = "no allow rule for this tool: every call asks"
        action_id = s.store.record_proposal(s.project, "mcp", command, s.conversation_id)
        proposal = Proposal(
            action_id,
            "mcp",  # type: ignore[arg-type]
            command,
            str(s.project_dir),
            self.servers.call_timeout_s,
            allowed_by_rule=allowed,
            rule_text=rule_text,
            choices=("deny", "once", "always_exact") if trusted else ("deny", "once"),
            sandbox=where,
            sandboxed=sandboxed,
            network=launch.network,
        )
        yield proposal
        if allowed:
            s.store.record_decision(action_id, "rule", f"tool {call.name}", rule_text)
            decision, saved = "rule", f"tool {call.name}"
            yield Decided(action_id, "rule", saved, rule_text)
        else:
            answer = await s._ask(proposal)
            decision, reason, saved = answer.kind, answer.reason, None
            if decision not in proposal.choices:
                decision, reason = "deny", f"{decision} was not offered for this call"
            if decision == "always_exact":
                saved = f"tool {self.store.allow_tool(s.project, call.name).tool}"
            s.store.record_decision(action_id, decision, saved, reason)
            yield Decided(action_id, decision, saved, reason)
            if decision == "deny":
                yield ToolResult(False, denied(reason), decision, action_id=action_id)
                return
        # a stdio server writes in the project as a command does: a git directory it makes is said (its hooks
        # and config would run at the user's next git, outside the sandbox)
        git_before = None if launch.remote else await asyncio.to_thread(sandbox.git_state, s.project_dir)
        try:
            handle = await self.servers.handle(launch)
            task = asyncio.ensure_future(handle.call(tool.remote_name, dict(call.arguments)))
            s._run = _CallStopper(task)  # type: ignore[assignment]
            try:
                result = await task
            finally:
                s._run = None
        except asyncio.CancelledError:
            if not s.halted:
                raise
            s.store.record_result(action_id, None, "stopped")
            for notice in await self._git_notices(tool.server, git_before):
                yield notice
            yield ToolResult(False, "Error: stopped by the user", decision, action_id=action_id)
            return
        except ServerDown as exc:
            message = f"MCP server {tool.server} {exc}"
            s.store.record_result(action_id, None, message[:500])
            yield Notice(message, "warning")
            for notice in await self._git_notices(tool.server, git_before):  # made before it went down
                yield notice
            yield ToolResult(False, f"Error: {message}", decision, action_id=action_id, output=message)
            return
        text = result_text(result)[:RESULT_CHARS]
        ok = not getattr(result, "is_error", False)
        s.store.record_result(action_id, None, "ok" if ok else "tool error")
        for notice in await self._git_notices(tool.server, git_before):
            yield notice
        content = text if ok else f"Error from {call.name}: {text}"
        yield ToolResult(ok, content, decision, action_id=action_id, output=text)


def summary(cfg: ServerConfig) -> dict[str, Any]:
    """A server as `flashcode tools --json` and Settings list it."""
    return {
        "name": cfg.name,
        "source": ".mcp.json" if cfg.source == "file" else "settings",
        "transport": None if cfg.error else cfg.transport,  # an entry that could not be read has none
        "runs": cfg.describe(),
        "details": cfg.details(),  # env, headers, and the environment variables it reads (as written)
        "status": cfg.status(),
        "enabled": cfg.enabled,
        "approved": cfg.approved,
        "fingerprint": cfg.fingerprint,
    }
