"""The agent's tools: what the model is offered (OpenAI-format schemas) and the read-only ones' code.

What it knows: each tool's name, description, JSON schema and kind of effect (`none`: reads the
project; `write`: changes a file, always approved; `shell`: runs a command under the shell policy,
approval and sandbox; `network`: reads the web, only when the project allows the network); how to
check a call's arguments against its schema; how to list files (honouring .gitignore), read a file
by line range, search text (`rg` when present, Python otherwise) and fetch a page as readable text
(trafilatura). What it does not know: approval, the model, events - `loop.py` runs the tools.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpcore
import httpx

from .files import FileToolError, ProjectFiles
from .sandbox import inner_data_dirs, system_program

Effect = Literal["none", "write", "shell", "network"]
MAX_LIST = 400  # entries list_files returns
MAX_READ_LINES = 400  # lines read_file returns at once
MAX_RESULT_CHARS = 12_000  # what one tool result hands the model
MAX_MATCHES = 100
FETCH_TIMEOUT_S = 15.0
SKIP_DIRS = {".git", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache"}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]
    effect: Effect = "none"

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _params(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


_STR, _INT = {"type": "string"}, {"type": "integer"}
# the order the model sees them in (small models favour the first ones)
SPECS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "read_file",
        "Read a text file of the project, with line numbers; optionally only lines start_line..end_line.",
        _params(["path"], path=_STR, start_line=_INT, end_line=_INT),
    ),
    ToolSpec(
        "write_file",
        "Create a file, or overwrite it, with the given content.",
        _params(["path", "content"], path=_STR, content=_STR),
        "write",
    ),
    ToolSpec(
        "edit_file",
        "Replace one exact piece of text in a file. old_text must occur exactly once in the file.",
        _params(["path", "old_text", "new_text"], path=_STR, old_text=_STR, new_text=_STR),
        "write",
    ),
    ToolSpec(
        "run_command",
        "Run a bash command in the project directory and get its output and exit code.",
        _params(["command"], command=_STR),
        "shell",
    ),
    ToolSpec(
        "list_files",
        "List the files of the project (or of one folder in it), skipping what .gitignore ignores.",
        _params(
            [],
            path={
                **_STR,
                "description": "folder relative to the project root; default .",
            },
        ),
    ),
    ToolSpec(
        "search_text",
        "Search the project's files for a regular expression; returns path:line: text for each match.",
        _params(["pattern"], pattern=_STR, path={**_STR, "description": "folder or file; default ."}),
    ),
    ToolSpec(
        "web_search", "Search the web; returns numbered results.", _params(["query"], query=_STR), "network"
    ),
    ToolSpec("fetch_url", "Fetch a web page as readable text.", _params(["url"], url=_STR), "network"),
)
BY_NAME = {s.name: s for s in SPECS}


def openai_tools(names: tuple[str, ...] | None = None) -> tuple[dict[str, Any], ...]:
    return tuple(s.openai() for s in SPECS if names is None or s.name in names)


_TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "integer": int, "object": dict, "boolean": bool}


def check_arguments(spec: ToolSpec, args: dict[str, Any]) -> str | None:
    """Why `args` do not fit the tool's schema (required, known names, types), or None."""
    props = spec.parameters["properties"]
    missing = [k for k in spec.parameters.get("required", []) if k not in args]
    if missing:
        return f"{spec.name} needs {', '.join(missing)}"
    unknown = [k for k in args if k not in props]
    if unknown:
        return f"{spec.name} takes no argument {', '.join(unknown)} (it takes {', '.join(props) or 'none'})"
    for k, v in args.items():
        want = _TYPES.get(props[k].get("type", ""), object)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            return f"{spec.name}: {k} must be a {props[k]['type']}"
    return None


def undecided(reason: str) -> bool:
    """Whether a call was not approved because nobody said no (the page closed, no answer came)."""
    return reason.startswith(("not decided", "no answer within", "no one is there"))


def denied(reason: str) -> str:
    """What the model is told of a call not approved (an edit, a command, an MCP tool)."""
    if undecided(reason):  # nobody said no
        # (the 0.5B model took "Denied by the user: no answer within 300 s" for the program's output)
        return f"Not run: {reason}; nothing it would have done happened or was seen."
    return f"Denied by the user: {reason}" if reason else "Denied by the user."


@dataclass
class ToolResult:
    """What one tool call came to: the text for the model, and what the step card shows."""

    ok: bool
    content: str
    decision: str = (
        "none"  # none (no approval needed) | rule | once | always_* | deny | timeout | network_off
    )
    exit_code: int | None = None
    action_id: int | None = None
    output: str = ""  # what the card shows collapsed (a file, a listing, command output)
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- .gitignore
class IgnoreRules:
    """The project's root .gitignore (and .git/info/exclude), enough for listing and searching:
    `name`, `dir/`, `/anchored`, `a/b`, `*.ext`, `**`, `!negation`."""

    def __init__(self, root: Path) -> None:
        self.rules: list[tuple[bool, bool, bool, str]] = []  # (negate, dir_only, anchored, pattern)
        for f in (root / ".gitignore", root / ".git" / "info" / "exclude"):
            try:
                lines = f.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.rstrip()
                if not line or line.startswith("#"):
                    continue
                negate = line.startswith("!")
                line = line.removeprefix("!")
                dir_only = line.endswith("/")
                line = line.strip("/") if dir_only else line
                anchored = line.startswith("/") or "/" in line
                self.rules.append((negate, dir_only, anchored, line.lstrip("/")))

    def ignored(self, rel: str, is_dir: bool) -> bool:
        out = False
        name = rel.rsplit("/", 1)[-1]
        for negate, dir_only, anchored, pat in self.rules:
            if dir_only and not is_dir:
                continue
            hit = fnmatch.fnmatchcase(rel, pat) or (
                "**" in pat and fnmatch.fnmatchcase(rel, pat.replace("**/", ""))
            )
            if not anchored:
                hit = hit or fnmatch.fnmatchcase(name, pat)
            if hit:
                out = not negate
        return out


def walk(root: Path, start: Path, hidden: tuple[Path, ...] = ()) -> list[str]:
    """Files under `start`, relative to `root`, sorted, .gitignore'd ones, SKIP_DIRS and `hidden` left out."""
    rules = IgnoreRules(root)
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(start):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIP_DIRS
            and not rules.ignored(rel_dir + d, True)
            and Path(dirpath, d).resolve() not in hidden
        )
        out += [
            rel_dir + f
            for f in sorted(filenames)
            if not rules.ignored(rel_dir + f, False) and not (hidden and Path(dirpath, f) in hidden)
        ]
    return sorted(out)


def _rg_text(field: dict[str, str]) -> str:
    """ripgrep's JSON text: `text`, or `bytes` (base64) for what is not UTF-8, decoded as Python names a file."""
    if "text" in field:
        return field["text"]
    import base64

    return base64.b64decode(field.get("bytes", "")).decode("utf-8", "surrogateescape")


def _one_line(name: str) -> str:
    """A file name on one line of the hits: a line break in it is shown as \\n, never begun as a new hit."""
    return name.replace("\n", "\\n").replace("\r", "\\r")


# --------------------------------------------------------------------------- the read-only tools
class ReadTools:
    """list_files, read_file and search_text over one project (`ProjectFiles` confines the paths)."""

    def __init__(self, files: ProjectFiles) -> None:
        self.files = files

    def list_files(self, path: str = ".") -> str:
        path = (path or ".").strip()
        pattern = self._glob(path)
        start = self.files.resolve(path if pattern is None else pattern[0])
        if not start.is_dir():
            raise FileToolError(f"{path} is not a folder of the project")
        names = walk(self.files.root, start, self.files.hidden)
        if pattern is not None:  # relative to the root, as names are; `**/` also matches no folder at all
            full = str(start.relative_to(self.files.root) / pattern[1]).removeprefix("./")
            shapes = (full, f"{full}/*", full.replace("**/", ""))
            names = [n for n in names if any(fnmatch.fnmatch(n, shape) for shape in shapes)]
        if not names:
            return "(no files)"
        more = f"\n[... {len(names) - MAX_LIST} more]" if len(names) > MAX_LIST else ""
        return "\n".join(names[:MAX_LIST]) + more

    def _glob(self, path: str) -> tuple[str, str] | None:
        """A small model's `./*` or `src/*.py`: (the folder before the first glob part, the rest); None for a plain
        path, or one that is a folder as written (`app/[id]` in a Next.js project)."""
        if not any(c in path for c in "*?["):
            return None
        try:
            if self.files.resolve(path).is_dir():
                return None
        except FileToolError:
            pass
        parts = Path(path).parts
        cut = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
        return (str(Path(*parts[:cut])) if cut else "."), str(Path(*parts[cut:]))

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        return self.read_file_shown(path, start_line, end_line)[0]

    def read_file_shown(
        self, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> tuple[str, str | None]:
        """`read_file`'s result, and the file's text when the result showed all of it (else None)."""
        text = self.files.read(path)
        lines = text.splitlines()
        first = max(1, start_line or 1)
        last = min(len(lines), end_line or first + MAX_READ_LINES - 1, first + MAX_READ_LINES - 1)
        if not lines:
            return "(empty file)", text
        if first > len(lines):
            return f"(the file has {len(lines)} lines)", None
        body = "\n".join(f"{n:>5}  {lines[n - 1]}" for n in range(first, last + 1))
        rest = f"\n[... lines {last + 1}-{len(lines)} not shown]" if last < len(lines) else ""
        return body + rest, text if first == 1 and not rest else None

    def search_text(self, pattern: str, path: str = ".") -> str:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise FileToolError(f"not a regular expression: {exc}") from exc
        start = self.files.resolve(path or ".")
        rg = system_program("rg", self.files.root)  # runs here, unsandboxed: never one found in the project
        # what the files keep out of, and a data directory made in the project since they looked (review)
        hidden = (*self.files.hidden, *inner_data_dirs(self.files.root))
        hits = self._rg(rg, pattern, start, hidden) if rg else self._python(regex, start, hidden)
        if not hits:
            return "(no matches)"
        more = "\n[... more matches not shown]" if len(hits) > MAX_MATCHES else ""
        return "\n".join(hits[:MAX_MATCHES]) + more

    def _rg(self, rg: str, pattern: str, start: Path, hidden: tuple[Path, ...]) -> list[str]:
        # --json: each hit's file name whole, whatever it holds (":", a line break: a review split names with
        # "\n" into a forged line), so a hidden file (a credentials file itself, not only a folder of them) is
        # left out by its path
        argv = [rg, "--no-require-git", "--color", "never", "--json", "-m", "20"]
        proc = subprocess.run(
            [*argv, "-e", pattern, "--", str(start)],
            cwd=self.files.root,
            capture_output=True,
            timeout=20,
        )
        hits: list[str] = []
        for line in proc.stdout.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("type") != "match":
                continue
            data = event["data"]
            name, text = _rg_text(data["path"]), _rg_text(data["lines"]).rstrip("\r\n")
            full = Path(name) if os.path.isabs(name) else self.files.root / name
            if not full.is_relative_to(self.files.root) or any(
                full == h or full.is_relative_to(h) for h in hidden
            ):
                continue
            hits.append(f"{_one_line(self.files.relative(full))}:{data['line_number']}:{text}"[:300])
            if len(hits) > MAX_MATCHES:
                break
        return hits

    def _python(self, regex: re.Pattern[str], start: Path, hidden_dirs: tuple[Path, ...]) -> list[str]:
        names = [self.files.relative(start)] if start.is_file() else walk(self.files.root, start, hidden_dirs)
        hits: list[str] = []
        for rel in names:
            try:  # through ProjectFiles: a symlink out of the project (to a secret, /proc/self/environ) is refused
                text = self.files.searchable(rel)
            except (FileToolError, OSError):
                continue  # outside the project, or unreadable
            if text is None:
                continue  # binary, or not UTF-8
            for n, line in enumerate(text.splitlines(), 1):
                if regex.search(line):
                    hits.append(f"{_one_line(rel)}:{n}:{line[:300]}")
                    if len(hits) > MAX_MATCHES:
                        return hits
        return hits


# --------------------------------------------------------------------------- the web
# clouds' instance-metadata services outside the link-local range (169.254.169.254 and fe80::/10 are in it):
# AWS's IPv6 one, Alibaba's, and Oracle's alias
METADATA_ADDRESSES = frozenset({"fd00:ec2::254", "100.100.100.200", "192.0.0.192"})


def _out_of_bounds(host: str, address: str) -> str | None:
    import ipaddress

    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1
    if (
        ip.is_loopback
        or ip.is_link_local
        or ip.is_unspecified
        or ip.is_multicast
        or str(ip) in METADATA_ADDRESSES
    ):
        return (
            f"fetch_url does not fetch from {host} ({ip}): this machine's own, link-local and cloud-metadata addresses are "
            "out of bounds for the agent"
        )
    return None


async def _resolve(host: str, port: int) -> list[str]:
    import socket

    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _PublicAddresses(httpcore.AsyncNetworkBackend):
    """fetch_url runs in the server: a page the model read could point it at this machine's own services —
    flashcode itself (no token on loopback: other conversations, saved contexts), a model server — or at a
    cloud's metadata address. So every connection (each redirect's too) resolves the host once, refuses
    loopback, link-local, unspecified and multicast addresses, and connects to an address it checked: a
    name that answers differently the second time (DNS rebinding) gains nothing. TLS still checks the
    certificate against the host name (httpcore sends it as SNI)."""

    class Refused(httpcore.ConnectError):
        """httpx raises its own ConnectError from this one."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await _resolve(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"{host}: {exc}") from exc
        for address in addresses:
            if (refused := _out_of_bounds(host, address)) is not None:
                raise self.Refused(refused)
        last: Exception = httpcore.ConnectError(f"{host} has no address")
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address.split("%")[0], port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        raise last

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise self.Refused("fetch_url does not open local sockets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _public_transport() -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport()
    # httpx takes no network backend, its pool does (the DNS rebinding test fails if this stops working)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(), network_backend=_PublicAddresses()
    )
    return transport


def _proxy_for(url: httpx.URL) -> str | None:
    """The proxy the user named for `url` (`HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY`, in either case, less the
    hosts `NO_PROXY` names; on macOS the system's settings too), or None to connect directly."""
    import urllib.request

    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(url.host):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


class _Routed(httpx.AsyncBaseTransport):
    """Each request (each redirect's too) goes directly, through `_PublicAddresses`, or through the proxy the
    user named for its URL. Through a proxy the proxy connects, so the target is checked here first, by the
    name the proxy is sent (IDNA-encoded: `faß.de` is `xn--fa-hia.de`, not the `fass.de` Python's resolver
    would make of it; a trailing dot dropped): `localhost` and `*.localhost` are refused by name, and a
    literal address and every address the name resolves to on this machine must be in bounds. A name this
    machine cannot resolve is refused too: unchecked, it could be one that answers 127.0.0.1 at the proxy."""

    def __init__(self) -> None:
        self.direct = _public_transport()
        self.proxied: dict[str, httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        proxy = _proxy_for(request.url)
        if proxy is None:
            return await self.direct.handle_async_request(request)
        host = request.url.raw_host.decode("ascii").strip("[]")
        name = host[:-1] if host.endswith(".") else host
        if name.lower() == "localhost" or name.lower().endswith(".localhost"):
            refused = f"fetch_url does not fetch from {host}: this machine's own addresses are out of bounds"
            raise httpx.ConnectError(refused, request=request) from _PublicAddresses.Refused(refused)
        try:
            addresses = await _resolve(
                name, request.url.port or (443 if request.url.scheme == "https" else 80)
            )
        except (OSError, UnicodeError) as exc:
            refused = (
                f"fetch_url could not resolve {host} on this machine ({exc}), so it cannot check where the proxy "
                "would connect: not fetched"
            )
            raise httpx.ConnectError(refused, request=request) from _PublicAddresses.Refused(refused)
        for address in addresses:
            if (refused := _out_of_bounds(host, address)) is not None:
                raise httpx.ConnectError(refused, request=request) from _PublicAddresses.Refused(refused)
        if proxy not in self.proxied:
            self.proxied[proxy] = httpx.AsyncHTTPTransport(proxy=proxy)
        return await self.proxied[proxy].handle_async_request(request)

    async def aclose(self) -> None:
        for transport in (self.direct, *self.proxied.values()):
            await transport.aclose()


async def fetch_url(url: str, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """The page at `url` as readable text (trafilatura's main-content extraction; plain text as is)."""
    if not re.match(r"^https?://", url):
        raise FileToolError("fetch_url takes an http:// or https:// address")
    async with httpx.AsyncClient(follow_redirects=True, timeout=timeout_s, transport=_Routed()) as client:
        try:
            resp = await client.get(url, headers={"User-Agent": "flashcode"})
        except httpx.ConnectError as exc:
            if isinstance(exc.__cause__, _PublicAddresses.Refused):  # httpx's error is raised from httpcore's
                raise FileToolError(str(exc.__cause__)) from exc
            raise
    if resp.status_code >= 400:
        raise FileToolError(f"{url} answered HTTP {resp.status_code}")
    kind = resp.headers.get("content-type", "")
    if "html" not in kind:
        return resp.text[:MAX_RESULT_CHARS]
    html = resp.text

    def extract() -> str:
        import trafilatura

        return trafilatura.extract(html, url=url, include_links=False) or ""

    text = await asyncio.to_thread(extract)
    return text or "(the page has no readable text)"
