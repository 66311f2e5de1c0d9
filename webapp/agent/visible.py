"""What the approval dialog must point out: characters that do not show, and writes into `.git/`.

What it knows: how to name a character that does not show (which ones those are, and how a template
cuts text into visible runs and `<U+202E>` markers, is `webapp.render`'s: conversation titles and file
names use them too), and which warning lines a proposal gets. What it does not know: HTML (the template draws the markers, autoescaped),
approval, the shell policy.
"""

from __future__ import annotations

import re
import unicodedata

from ..render import hidden_chars, invisible_parts, is_invisible, marker  # noqa: F401 - what the agent uses

_GIT_WORD = re.compile(r"(?<![\w.-])\.git(?![\w.-])", re.IGNORECASE)
_CONTROLS = {
    0x00: "NULL",
    0x07: "BELL",
    0x08: "BACKSPACE",
    0x0D: "CARRIAGE RETURN",
    0x1B: "ESCAPE",
    0x7F: "DELETE",
}
GIT_WARNING = "hooks and config there run code the next time git runs"


def _name(ch: str) -> str:
    kind = {"Cc": "CONTROL CHARACTER", "Co": "PRIVATE USE CHARACTER", "Cn": "UNASSIGNED CHARACTER"}
    return _CONTROLS.get(ord(ch)) or unicodedata.name(ch, kind.get(unicodedata.category(ch), "CHARACTER"))


def invisible_names(text: str, most: int = 3) -> list[str]:
    """The distinct hidden characters of `text`, named: ["U+202E RIGHT-TO-LEFT OVERRIDE", ...]."""
    seen = dict.fromkeys(hidden_chars(text))
    names = [f"U+{ord(ch):04X} {_name(ch)}" for ch in list(seen)[:most]]
    return names + ([f"{len(seen) - most} more"] if len(seen) > most else [])


def touches_git(path: str) -> bool:
    """True when `path` (relative to the project) is `.git` or inside it. Case and characters that
    macOS ignores in names (`.g\\u200cit`) do not hide it."""
    for part in re.split(r"[/\\]", path):
        folded = "".join(ch for ch in unicodedata.normalize("NFKC", part) if not is_invisible(ch))
        if folded.casefold() == ".git":
            return True
    return False


COMMAND_LINES = 8  # the dialog's command box shows about this many lines before it scrolls
DIFF_LINES = 14  # and its change box about this many
BLANK_RUN = re.compile(
    r"[ \t]{40,}\S"
)  # a run of blanks within a line (not its indentation): text pushed aside


ROW_CHARS = 80  # about this many characters fit a row of the dialog's boxes (a longer line wraps)


def _rows(lines: list[str]) -> int:
    """The rows `lines` take in a box that wraps them."""
    return sum(max(1, -(-len(line) // ROW_CHARS)) for line in lines)


def diff_rows(diff: str | None) -> int:
    """How many rows a change takes when its box scrolls (more than DIFF_LINES, long lines wrapped; the dialog
    says so), else 0. Not a warning: most writes are longer than that."""
    rows = _rows(diff.rstrip("\n").split("\n")) if diff else 0
    return rows if rows > DIFF_LINES else 0


def _out_of_sight(what: str, text: str, lines: int | None, marked: bool = False) -> list[str]:
    """Warnings for `text` that the dialog's box does not show at once: more lines than it holds (`lines`),
    and a line whose end a long run of blanks pushes far to the side (a model may hide the part that matters
    there). `marked`: a diff's rows, each after its one-character mark (`+`, `-`, ` `)."""
    out = []
    rows = text.split("\n")
    # a line's own indentation hides nothing in a change; in a command, blanks at a line's start push it too
    body = [r[1:].lstrip() for r in rows] if marked else [rows[0].lstrip(), *rows[1:]]
    if lines is not None and _rows(rows) > lines:
        out.append(
            f"the {what} takes {_rows(rows)} rows (long lines wrap): scroll its box to read all of it before you "
            "decide"
        )
    if (
        m := max((BLANK_RUN.search(row) for row in body), key=lambda m: m.end() - m.start() if m else 0)
    ) is not None:
        out.append(
            f"the {what} has a line with {m.end() - 1 - m.start()} blanks in a row before more text: the box "
            "wraps it, and what follows the blanks starts a new row"
        )
    return out


def proposal_warnings(tool: str, command: str, diff: str | None = None) -> tuple[str, ...]:
    """The warning lines the approval dialog shows above everything else for one proposal."""
    out = []
    what = {"shell": "command", "mcp": "tool call"}.get(tool, "file path")
    if names := invisible_names(command):
        out.append(
            f"the {what} contains invisible characters ({', '.join(names)}); they are shown as <U+…> markers"
        )
    body = diff.split("\n", 2)[-1] if diff and diff.startswith("--- ") else diff  # past the path headers
    if body and (names := invisible_names(body)):
        out.append(
            f"the change contains invisible characters ({', '.join(names)}); they are shown as <U+…> markers"
        )
    if tool != "write":  # a write's "command" is its path
        out += _out_of_sight(what, command, COMMAND_LINES)
    if body:
        out += _out_of_sight("change", body, None, marked=bool(diff and diff.startswith("--- ")))
    if tool == "write" and touches_git(command):
        out.append(f"this writes inside .git/: {GIT_WARNING}")
    elif tool == "shell" and _GIT_WORD.search(command):
        out.append(f"the command names .git/: {GIT_WARNING}")
    return tuple(out)
