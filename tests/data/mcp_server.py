"""A small MCP server written with the official SDK (`mcp.server.mcpserver.MCPServer`, FastMCP in
mcp 1.x), for the MCP tests: `python tests/data/mcp_server.py [--crash-at-start | --hang-at-start]
[--only=add,echo]` (other arguments are ignored).

Tools: add, echo, getenv (a variable of the server's environment), write_note (writes any path it
is given: the sandbox must stop writes outside the project), connect (opens a TCP connection: the
sandbox must stop it with the network off), crash (the process exits mid-call), hang (never
answers).
"""

from __future__ import annotations

import os
import socket
import sys
import time

if "--crash-at-start" in sys.argv:
    print("mcp_server: configuration error, giving up", file=sys.stderr, flush=True)
    sys.exit(2)
if "--hang-at-start" in sys.argv:
    time.sleep(3600)  # never reads stdin, never answers initialize

from mcp.server.mcpserver import MCPServer  # noqa: E402
from mcp.server.mcpserver.exceptions import ToolError  # noqa: E402 - its text reaches the client

mcp = MCPServer("flashcode-test")
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)


def tool(fn):  # noqa: ANN001, ANN201 - registers fn unless --only=a,b leaves it out
    if ONLY is None or fn.__name__ in ONLY:
        mcp.tool()(fn)
    return fn


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def getenv(variable: str) -> str:
    """Return the value of an environment variable of this server process."""
    return os.environ.get(variable, "(not set)")


@tool
def write_note(path: str, text: str) -> str:
    """Write text to a file at path."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise ToolError(str(exc)) from exc
    return f"wrote {len(text)} characters to {path}"


@tool
def connect(host: str, port: int) -> str:
    """Open a TCP connection to host:port and read what it sends."""
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            return s.recv(100).decode(errors="replace")
    except OSError as exc:
        raise ToolError(str(exc)) from exc


@tool
def crash() -> str:
    """Exit the server process in the middle of the call."""
    print("mcp_server: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@tool
def hang() -> str:
    """Never answer."""
    time.sleep(3600)
    return "unreachable"


if __name__ == "__main__":
    mcp.run()
