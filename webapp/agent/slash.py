"""Slash commands: `SlashCommands`, a set of `/name ARGS` with one-line help, and its `parse(text)`.

The agent's own commands are `BUILTIN`. Commands other features answer (/stats, /cost, /bench,
/good, /bad, /improve) are added where the app is wired (`webapp.app.create_app`), so `/help`
lists exactly what that app knows, whatever was imported first. This module only parses;
`agent.py` acts on the parsed `SlashCall` (a command it does not implement comes back as
`SlashUnhandled` for the web layer). A message that does not start with `/`, or starts with `//`,
is not a command (`//` sends a literal `/`).
"""

from __future__ import annotations

from collections.abc import Iterable
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


BUILTIN: tuple[SlashCommand, ...] = (
    SlashCommand("agent", "agent mode: the model uses tools on the project; side effects ask first"),
    SlashCommand("chat", "chat mode: messages go straight to the model, no routing and no tools"),
    SlashCommand("raw", "the same as /chat"),
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
        True,
    ),
    SlashCommand("model", "switch to another installed model", "NAME", needs_arg=True),
    SlashCommand("continue", "give the agent's task more steps after it reached the step limit"),
    SlashCommand("clear", "start over: forget this conversation's context"),
    SlashCommand("help", "list the slash commands"),
)


class SlashCommands:
    """An immutable set of commands, by name."""

    def __init__(self, *groups: Iterable[SlashCommand]) -> None:
        self.commands: dict[str, SlashCommand] = {c.name: c for group in groups for c in group}

    def __contains__(self, name: str) -> bool:
        return name in self.commands

    def parse(self, text: str) -> SlashCall | None:
        """The command in `text`, None if it is a plain message; SlashError for unknown or incomplete ones."""
        stripped = text.lstrip()
        if not stripped.startswith("/") or stripped.startswith("//"):
            return None
        first_word = stripped.split(" ", 1)[0]
        head, _, rest = stripped[1:].partition("\n" if "\n" in first_word else " ")
        name = head.strip().lower()
        if not name:
            raise SlashError("a slash command needs a name: type /help for the list")
        cmd = self.commands.get(name)
        if cmd is None:
            raise SlashError(f"unknown command /{name}: type /help for the list")
        arg = rest.strip() if name != "write" else rest.lstrip(" ")  # a file's content keeps its newlines
        if cmd.needs_arg and not arg.strip():
            raise SlashError(f"/{name} needs {cmd.usage or 'an argument'}: /{name} {cmd.usage}")
        return SlashCall(name, arg, cmd)

    def help_text(self) -> str:
        lines = ["Slash commands:"]
        for cmd in sorted(self.commands.values(), key=lambda c: c.name):
            lines.append(f"/{cmd.name}{' ' + cmd.usage if cmd.usage else ''} — {cmd.help}")
        return "\n".join(lines)


DEFAULT = SlashCommands(BUILTIN)


def parse_slash(text: str, commands: SlashCommands = DEFAULT) -> SlashCall | None:
    return commands.parse(text)


def help_text(commands: SlashCommands = DEFAULT) -> str:
    return commands.help_text()
