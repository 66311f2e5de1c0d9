"""Which MCP servers a project has: its `.mcp.json` and the servers added in Settings, checked.

`.mcp.json` at the project root has the shape Claude Code and Cursor read:

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "some-mcp-server"], "env": {"KEY": "value"}},
        "docs":  {"type": "http", "url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "..."}}
    }}

A server is stdio (`command`, optional `args`, `env`; `"type": "stdio"` or no type) or streamable
HTTP (`url`, optional `headers`; `"type": "http"` or `"streamable-http"`, or no type). SSE servers
(`"type": "sse"`) are refused with a message. `${VAR}` and `${VAR:-default}` in `command`, `args`,
`env` values, `url` and `headers` values are expanded from flashcode's own environment, as Claude
Code does (`$VAR` is not; a default ends at the first `}`; a variable set to "" is set): a variable
that is not set and has no default makes that server unusable, with a message naming it. The
config keeps the expanded values (what runs, what the approval fingerprint covers) and the text as
written (`describe()`: what the user is shown, so secrets from the environment never reach the
transcript). Settings rows (the table
`mcp_servers`, `mcp_store.py`) add servers of the same shape, and a row with no config holds the
user's state for the `.mcp.json` server of that name: disabled, or approved (the config's
fingerprint: a `.mcp.json` server runs only once the user approved exactly that config, since a
cloned repository can name any command). A Settings server of the same name as a `.mcp.json` one
replaces it.

What it knows: parsing, validation, names (`server__tool`) and fingerprints. What it does not
know: processes, the SDK, SQL, HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ..render import visible_line

CONFIG_FILE = ".mcp.json"
MAX_CONFIG_BYTES = 256_000
NAME_RE = re.compile(
    r"[A-Za-z0-9_-]{1,40}"
)  # a whole name (fullmatch: with "$", a name ending in a newline passed)
TOOL_NAME_MAX = 64  # OpenAI-style function names: [A-Za-z0-9_-]{1,64}
SEP = "__"
Transport = Literal["stdio", "http"]
Source = Literal["file", "settings"]
VAR_RE = re.compile(r"\$\{([^}]+)\}")  # ${VAR} or ${VAR:-default}, as Claude Code reads them


class McpConfigError(ValueError):
    """A server entry that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class ServerConfig:
    """One MCP server of a project, as configured (and the user's switches for it)."""

    name: str
    transport: Transport
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    source: Source = "file"
    enabled: bool = True
    approved: bool = True  # .mcp.json servers: the user approved this exact config
    error: str | None = None  # why it cannot be used (a bad entry is listed, never started)
    written: str = ""  # describe() as written in the config, ${VAR} unexpanded ("" when no ${...})
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def fingerprint(self) -> str:
        """A digest of what would run (command, args, env, url, headers): approval is for this. The whole
        SHA-256: cut to 64 bits, two configs sharing one could be made (a birthday search, ~2^33 hashes), the
        harmless one approved and the other swapped in by a `git pull` without a question. An approval stored
        under an older, cut fingerprint no longer matches: that server asks once more."""
        body = json.dumps(
            [self.transport, self.command, list(self.args), list(self.env), self.url, list(self.headers)]
        )
        return hashlib.sha256(body.encode()).hexdigest()

    @property
    def usable(self) -> bool:
        return self.error is None and self.enabled and self.approved

    def describe(self) -> str:
        """What runs, on one line: `command arg ...` or the URL (header values never shown), as
        written: `${VAR}` stays as it is (the expanded values may be secrets)."""
        if self.written:
            return self.written
        if self.transport == "http":
            return self.url
        return " ".join([self.command, *(_shell_word(a) for a in self.args)])

    def details(self) -> list[str]:
        """What an approval shows besides `describe()`, as written (`${VAR}` unexpanded): the environment a
        stdio server gets, the headers sent to an HTTP one, and which of flashcode's own environment
        variables the config reads (a `.mcp.json` could send an API key of yours to its own URL)."""
        raw = self.raw or {}
        env = raw["env"] if isinstance(raw.get("env"), dict) else dict(self.env)
        headers = raw["headers"] if isinstance(raw.get("headers"), dict) else dict(self.headers)
        # a server added in Settings is the user's: its values (tokens typed there) are not shown again
        value = (lambda v: "…") if self.source == "settings" else visible_line
        lines = [f"env {visible_line(k)}={value(v)}" for k, v in env.items()]
        lines += [f"header {visible_line(k)}: {value(v)}" for k, v in headers.items()]
        names = sorted({m.split(":-", 1)[0] for m in VAR_RE.findall(json.dumps(raw, default=str))})
        if names:
            lines.append(
                "reads from flashcode's environment: " + ", ".join(f"${visible_line(n)}" for n in names)
            )
        return lines

    def status(self) -> str:
        if self.error:
            return f"not usable: {self.error}"
        if not self.enabled:
            return "disabled"
        if not self.approved:
            return "not approved yet (from .mcp.json: approve it in Settings › MCP servers)"
        return "enabled"

    def as_written(self) -> dict[str, Any]:
        """`to_json()` with `${VAR}` as written, not expanded (what Settings stores, so values
        from the environment are never saved)."""
        out = self.to_json()
        if self.written:
            for key in out:
                if key != "type" and key in self.raw:
                    out[key] = self.raw[key].strip() if key == "command" else self.raw[key]
        return out

    def to_json(self) -> dict[str, Any]:
        """The `mcpServers` entry for this server, expanded."""
        if self.transport == "http":
            out: dict[str, Any] = {"type": "http", "url": self.url}
            if self.headers:
                out["headers"] = dict(self.headers)
            return out
        out = {"command": self.command}
        if self.args:
            out["args"] = list(self.args)
        if self.env:
            out["env"] = dict(self.env)
        return out


def _shell_word(text: str) -> str:
    return text if re.fullmatch(r"[A-Za-z0-9_./:=@%+,-]+", text) else json.dumps(text)


def expand_vars(text: str, environ: Mapping[str, str], missing: list[str]) -> str:
    """`${VAR}` and `${VAR:-default}` in `text` from `environ`, the way Claude Code expands
    `.mcp.json`: the value when VAR is set (even to ""), else the default, else the text stays and
    VAR is added to `missing`. `$VAR` without braces is left alone; nothing is expanded twice."""

    def one(m: re.Match[str]) -> str:
        var, sep, default = m.group(1).partition(":-")
        if var in environ:
            return environ[var]
        if sep:
            return default
        missing.append(var)
        return m.group(0)

    return VAR_RE.sub(one, text)


def _expand_entry(entry: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The entry with `${...}` expanded in command, args, env and headers values, and url; a
    McpConfigError naming the variables that are not set and have no default."""
    missing: list[str] = []
    out = dict(entry)
    for key in ("command", "url"):
        if isinstance(entry.get(key), str):
            out[key] = expand_vars(entry[key], environ, missing)
    if isinstance(entry.get("args"), list):
        out["args"] = [expand_vars(a, environ, missing) if isinstance(a, str) else a for a in entry["args"]]
    for key in ("env", "headers"):
        if isinstance(entry.get(key), dict):
            out[key] = {
                k: expand_vars(v, environ, missing) if isinstance(v, str) else v
                for k, v in entry[key].items()
            }
    if missing:
        names = [f"${{{v}}}" for v in dict.fromkeys(missing)]
        these = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        raise McpConfigError(
            f"{these} {'is' if len(names) == 1 else 'are'} not set in flashcode's environment and "
            f"{'has' if len(names) == 1 else 'have'} no default (set it before starting flashcode, "
            "or write ${NAME:-default})"
        )
    return out


def parse_entry(
    name: str,
    entry: Any,
    source: Source = "file",
    environ: Mapping[str, str] | None = None,
    expand: bool = True,
) -> ServerConfig:
    """One `mcpServers` entry; a bad one comes back with `error` set (and is listed, not started).
    With `expand`, `${VAR}` / `${VAR:-default}` are expanded from `environ` (default: this
    process's environment); without, the values stay as written (what Settings stores)."""
    try:
        if not expand or not isinstance(entry, dict) or not VAR_RE.search(json.dumps(entry, default=str)):
            return _parse(name, entry, source)
        cfg = _parse(name, _expand_entry(entry, os.environ if environ is None else environ), source)
        if cfg.transport == "http":
            written = entry["url"]
        else:
            written = " ".join([entry["command"].strip(), *(_shell_word(a) for a in entry.get("args") or ())])
        return replace(cfg, written=written, raw=entry)
    except McpConfigError as exc:
        return ServerConfig(name, "stdio", source=source, error=str(exc), enabled=False, raw=_dict(entry))


def _dict(entry: Any) -> dict[str, Any]:
    return entry if isinstance(entry, dict) else {}


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise McpConfigError(f"{what} must be a list of strings")
    return tuple(value)


def _mapping(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise McpConfigError(f"{what} must be an object of strings")
    return tuple(sorted(value.items()))


def _parse(name: str, entry: Any, source: Source) -> ServerConfig:
    if not NAME_RE.fullmatch(name):
        raise McpConfigError("a server name is 1-40 letters, digits, '_' or '-'")
    # `a__b` + `c` and `a` + `b__c` would both be the tool `a__b__c` and share its allow rule; so would `a_` + `x`
    # and `a` + `_x`: with no `__` inside and no `_` at its end, a name's first `__` ends the server's name
    if SEP in name or name.endswith("_"):
        better = name.replace(SEP, "_").rstrip("_") or "server"
        raise McpConfigError(
            f"a server name cannot contain {SEP!r} nor end in '_': {SEP!r} separates the server from the tool in "
            f"`server{SEP}tool` (rename it, say to {better!r})"
        )
    if not isinstance(entry, dict):
        raise McpConfigError("the entry must be a JSON object")
    kind = entry.get("type")
    if kind == "sse":
        raise McpConfigError("SSE servers are not supported: use the server's streamable HTTP URL")
    if kind not in (None, "stdio", "http", "streamable-http", "streamableHttp"):
        raise McpConfigError(f"unknown type {str(kind)[:40]!r} (stdio or http)")
    if "url" in entry and kind != "stdio":
        url = entry["url"]
        if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
            raise McpConfigError("url must be an http:// or https:// address")
        return ServerConfig(
            name, "http", url=url, headers=_mapping(entry.get("headers"), "headers"), source=source, raw=entry
        )
    command = entry.get("command")
    if not isinstance(command, str) or not command.strip() or "\x00" in command:
        raise McpConfigError("a stdio server needs a command (or an http server a url)")
    args = _strings(entry.get("args"), "args")
    if any("\x00" in a for a in args):
        raise McpConfigError("args cannot contain NUL bytes")
    return ServerConfig(
        name,
        "stdio",
        command=command.strip(),
        args=args,
        env=_mapping(entry.get("env"), "env"),
        source=source,
        raw=entry,
    )


def read_file_config(
    project_dir: Path, environ: Mapping[str, str] | None = None
) -> tuple[list[ServerConfig], str | None]:
    """The servers of `<project>/.mcp.json` (`${VAR}` expanded from `environ`, default this
    process's environment) and, when the file is unreadable, why (else None)."""
    path = Path(project_dir) / CONFIG_FILE
    try:
        if not path.is_file():
            return [], None
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return [], f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES // 1000} KB"
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, json.JSONDecodeError) as exc:
        return [], f"{CONFIG_FILE} cannot be read: {exc}"
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        return [], f'{CONFIG_FILE} has no "mcpServers" object'
    return [parse_entry(str(name), entry, "file", environ) for name, entry in servers.items()], None


def tool_name(server: str, tool: str) -> str:
    """`server__tool`, with characters outside [A-Za-z0-9_-] as `_`, at most 64 characters."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", tool)
    return f"{server}{SEP}{clean}"[:TOOL_NAME_MAX]
