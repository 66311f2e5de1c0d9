"""Slash commands: a registry of `/name ARGS` with one-line help, and `parse_slash(text)`.

Later issues add theirs with `register(SlashCommand(...))` (/stats, /cost, /bench, /good, /bad);
`/help` lists whatever is registered. This module only parses; `agent.py` (or the web app, for
commands it owns) acts on the parsed `SlashCall`. A message that does not start with `/`, or starts
with `//`, is not a command (`//` sends a literal `/`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlashCommand:
    name: str
    help: str
    usage: str = ""
    needs_arg: bool = False


@dataclass(frozen=True)
class SlashCall:
    name: str
    arg: str
    command: SlashCommand


class SlashError(ValueError):
    pass


REGISTRY: dict[str, SlashCommand] = {}


def register(cmd: SlashCommand) -> SlashCommand:
    REGISTRY[cmd.name] = cmd
    return cmd


for _cmd in (
    SlashCommand("agent", "agent mode: each message is routed to chat, web search or a shell command"),
    SlashCommand("raw", "raw mode: messages go straight to the model, no routing and no tools"),
    SlashCommand("search", "search the web and answer with citations", "QUERY", needs_arg=True),
    SlashCommand(
        "shell", "propose a shell command in the project (still needs approval)", "COMMAND", needs_arg=True
    ),
    SlashCommand(
        "read", "show a project file and give it to the model as quoted data", "PATH", needs_arg=True
    ),
    SlashCommand(
        "write",
        "propose writing a file: PATH on the first line, the content below (needs approval)",
        "PATH",
        needs_arg=True,
    ),  # fmt: skip
    SlashCommand("model", "switch to another installed model", "NAME", needs_arg=True),
    SlashCommand("clear", "start over: forget this conversation's context"),
    SlashCommand("help", "list the slash commands"),
):
    register(_cmd)


def parse_slash(text: str) -> SlashCall | None:
    """The command in `text`, None if it is a plain message; SlashError for unknown or incomplete ones."""
    stripped = text.lstrip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    head, _, rest = (
        stripped[1:].partition("\n") if "\n" in stripped.split(" ", 1)[0] else stripped[1:].partition(" ")
    )
    name = head.strip().lower()
    if not name:
        raise SlashError("a slash command needs a name: type /help for the list")
    cmd = REGISTRY.get(name)
    if cmd is None:
        raise SlashError(f"unknown command /{name}: type /help for the list")
    arg = rest.strip() if name != "write" else rest.lstrip(" ")  # a file's content keeps its newlines
    if cmd.needs_arg and not arg.strip():
        raise SlashError(f"/{name} needs {cmd.usage or 'an argument'}: /{name} {cmd.usage}")
    return SlashCall(name, arg, cmd)


def help_text() -> str:
    lines = ["Slash commands:"]
    for cmd in sorted(REGISTRY.values(), key=lambda c: c.name):
        lines.append(f"/{cmd.name}{' ' + cmd.usage if cmd.usage else ''} — {cmd.help}")
    return "\n".join(lines)
