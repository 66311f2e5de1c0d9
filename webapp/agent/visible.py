"""What the approval dialog must point out: characters that do not show, and writes into `.git/`.

What it knows: which characters are invisible or reorder the text around them (controls, bidi
overrides and isolates, zero-width characters, odd spaces, invisible letters), how to name one
(`<U+202E>`), how to cut text into visible runs and markers for a template, and which warning
lines a proposal gets. What it does not know: HTML (the template draws the markers, autoescaped),
approval, the shell policy.
"""

from __future__ import annotations

import re
import unicodedata

# Letters and symbols that draw nothing (Hangul fillers, Khmer vowels, Mongolian separator, braille
# blank, combining grapheme joiner); variation selectors draw nothing either.
_BLANK = {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, 0x2800, 0x3164, 0xFFA0}
_CANDIDATE = re.compile(r"[^\t\n\x20-\x7e]")  # ASCII that prints, tab and newline are always fine
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


def is_invisible(ch: str) -> bool:
    """True for a character a reader cannot see as itself: Cc but tab and newline, every Cf (bidi
    controls U+202A-202E and U+2066-2069, U+200B-200F, U+FEFF, ...), unassigned and private-use
    code points, every space but U+0020, line and paragraph separators, and blank letters."""
    if ch in "\t\n":
        return False
    cat, code = unicodedata.category(ch), ord(ch)
    return (
        cat[0] == "C"
        or (cat[0] == "Z" and ch != " ")
        or code in _BLANK
        or 0xFE00 <= code <= 0xFE0F
        or 0x180B <= code <= 0x180F
        or 0xE0100 <= code <= 0xE01EF
    )


def marker(ch: str) -> str:
    return f"<U+{ord(ch):04X}>"


def invisible_parts(text: str | None) -> list[tuple[bool, str]]:
    """`text` cut for a template: (False, visible run) and (True, "<U+202E>") for each hidden
    character, in order. The Jinja filter `invisible_parts`."""
    text = "" if text is None else str(text)
    out: list[tuple[bool, str]] = []
    start = 0
    for m in _CANDIDATE.finditer(text):
        if not is_invisible(m.group()):
            continue
        if m.start() > start:
            out.append((False, text[start : m.start()]))
        out.append((True, marker(m.group())))
        start = m.end()
    if start < len(text) or not out:
        out.append((False, text[start:]))
    return out


def _name(ch: str) -> str:
    kind = {"Cc": "CONTROL CHARACTER", "Co": "PRIVATE USE CHARACTER", "Cn": "UNASSIGNED CHARACTER"}
    return _CONTROLS.get(ord(ch)) or unicodedata.name(ch, kind.get(unicodedata.category(ch), "CHARACTER"))


def invisible_names(text: str, most: int = 3) -> list[str]:
    """The distinct hidden characters of `text`, named: ["U+202E RIGHT-TO-LEFT OVERRIDE", ...]."""
    seen = dict.fromkeys(m.group() for m in _CANDIDATE.finditer(text) if is_invisible(m.group()))
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
    if tool == "write" and touches_git(command):
        out.append(f"this writes inside .git/: {GIT_WARNING}")
    elif tool == "shell" and _GIT_WORD.search(command):
        out.append(f"the command names .git/: {GIT_WARNING}")
    return tuple(out)
