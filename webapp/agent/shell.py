"""Shell command policy: split a proposed command into simple commands and decide, per part,
whether a per-project allow rule covers it. Nothing here runs anything (see `runner.py`).

What is covered
- Compound commands are split on `;`, `&`, `&&`, `||`, `|`, `|&`, newlines and `( ... )` subshells /
  `{ ...; }` groups; command substitutions `$(...)` and backticks and process substitutions
  `<(...)`, `>(...)` are parsed recursively (also inside double quotes). Every part must be allowed.
- Words are unquoted the way bash does for `'...'`, `"..."`, `\\x` and line continuations, so
  `'r'm`, `r\\m` and `"sh"` are seen as `rm` and `sh`.
- Redirections (`>`, `>>`, `<`, `2>`, `&>`, `>&`, `>|`, `<>`) belong to their part: a part that
  redirects anywhere but `/dev/null` or another descriptor can only be allowed by an exact rule.
- Interpreters and wrappers (sh, bash, python, node, env, xargs, sudo, eval, exec, timeout, npx,
  ..., by basename, so `/bin/sh` too) can never be prefix-allowed; nor can a part that starts with
  variable assignments (`PATH=... cmd`), one with an exec-like option (`find -exec`, `git -c`,
  `tar --to-command`, ...), or a runner subcommand (`uv run`, `docker exec`, `npm exec`, ...).
- Anything this parser does not understand fails closed (`ShellParseError`): here-documents,
  `$'...'`, `${...}`, `$((...))`, brace expansion `{a,b}`, control flow (`if`, `for`, `while`, `case`, functions), globs or
  `$` in the command name, control characters, unbalanced quotes or parentheses. Such a command
  can still be shown and run once by an explicit click, never allowed by a rule.

What is not covered
- What an allowed program does with its arguments: a prefix rule for `make` or `npm run` runs
  whatever the project's Makefile or package.json says; `git` aliases and hooks run code.
- Globs in arguments: they expand to the project's file names (a file named `-exec` would be an
  argument); command names may not be globs.
- Aliases and shell functions from rc files (commands run with a non-interactive `bash -c`, which
  reads none), and `$VAR` expansion in arguments (the value is the environment's).
- Resource limits and sandboxing: an approved command runs with the user's rights.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

RuleKind = Literal["exact", "prefix"]

# Programs that run other programs or code: never prefix-allowed (by basename).
WRAPPERS = frozenset(
    """sh bash zsh dash ksh mksh fish csh tcsh ash busybox python python2 python3 pypy pypy3 node nodejs
    deno bun perl ruby php lua luajit tclsh wish awk gawk mawk nawk sed osascript pwsh powershell
    env xargs sudo su doas eval exec source . command builtin nohup time timeout nice ionice
    strace ltrace gdb lldb watch setsid stdbuf unbuffer script ssh chroot flock chrt taskset nsenter
    unshare parallel runuser pkexec systemd-run at batch crontab expect npx pnpx bunx uvx pipx""".split()
)
_VERSIONED = re.compile(r"^(python|pypy|ruby|perl|php|lua|node)[0-9.]*$")

# Options that make an otherwise ordinary program execute code.
EXEC_OPTIONS: dict[str, tuple[str, ...]] = {
    "find": ("-exec", "-execdir", "-ok", "-okdir", "-fprint", "-fls", "-fprintf", "-delete"),
    "git": ("-c", "--exec-path", "--upload-pack", "--receive-pack", "--config-env", "--ext-diff"),
    "tar": ("--to-command", "--checkpoint-action", "--use-compress-program", "-I", "--info-script",
            "--new-volume-script", "-F"),
    "rsync": ("-e", "--rsh", "--rsync-path"),
    "zip": ("-TT", "--unzip-command"),
    "less": ("-",),  # LESSOPEN, !cmd: a pager is interactive anyway
    "vim": ("-c", "+"),
    "vi": ("-c", "+"),
    "man": ("-P", "--pager", "-H"),
}  # fmt: skip
# Subcommands that run an arbitrary program given as an argument (`uv run bash ...`).
RUNNER_SUBCOMMANDS = frozenset({("uv", "run"), ("uv", "tool"), ("poetry", "run"), ("pipenv", "run"), ("pdm", "run"),
                                ("hatch", "run"), ("conda", "run"), ("docker", "run"), ("docker", "exec"),
                                ("kubectl", "exec"), ("npm", "exec"), ("pnpm", "exec"), ("yarn", "exec"),
                                ("pnpm", "dlx"), ("yarn", "dlx"), ("bun", "x"), ("git", "submodule")})  # fmt: skip
# Programs whose first non-option argument is a subcommand (suggested prefix: `git status`).
SUBCOMMAND_TOOLS = frozenset(
    "git npm pnpm yarn cargo go make uv pip pip3 docker kubectl poetry hatch dotnet brew apt".split()
)
SAFE_REDIRECT_TARGETS = frozenset({"/dev/null"})
_KEYWORDS = frozenset(
    "if then else elif fi for while until do done case esac select function coproc [[ ]]".split()
)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=")
_FD_DUP = re.compile(r"^&?[0-9]*-?$")


class ShellParseError(ValueError):
    """The command uses shell syntax the policy does not understand; it cannot be rule-allowed."""


@dataclass(frozen=True)
class Part:
    """One simple command: its words (unquoted), its redirections and leading assignments."""

    argv: tuple[str, ...]
    redirects: tuple[tuple[str, str], ...] = ()
    assignments: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """Canonical form, used for exact per-part rules and shown in the dialog."""
        words = [*self.assignments, *(shlex.quote(a) for a in self.argv)]
        words += [f"{op}{shlex.quote(t)}" for op, t in self.redirects]
        return " ".join(words)

    @property
    def program(self) -> str:
        return os.path.basename(self.argv[0]) if self.argv else ""

    def unsafe_redirects(self) -> list[str]:
        out = []
        for op, target in self.redirects:
            if op.endswith("&") and _FD_DUP.match(target):  # 2>&1, >&2, <&0, >&-
                continue
            if target in SAFE_REDIRECT_TARGETS and ">" in op:
                continue
            out.append(f"{op}{target}")
        return out

    def prefix_blocker(self) -> str | None:
        """Why no prefix rule may ever cover this part, or None."""
        prog = self.program
        if not self.argv:
            return "it is only a redirection"
        if is_wrapper(prog):
            return f"`{prog}` runs other programs or code, so it can only be allowed exactly"
        if self.assignments:
            return (
                "it sets variables for the command ("
                + ", ".join(a.split("=")[0] for a in self.assignments)
                + ")"
            )
        if len(self.argv) > 1 and (prog, self.argv[1]) in RUNNER_SUBCOMMANDS:
            return f"`{prog} {self.argv[1]}` runs other programs, so it can only be allowed exactly"
        bad = exec_option(prog, self.argv[1:])
        if bad:
            return f"`{prog} {bad}` can run other programs"
        redir = self.unsafe_redirects()
        if redir:
            return "it redirects to a file (" + ", ".join(redir) + ")"
        return None


def is_wrapper(program: str) -> bool:
    name = os.path.basename(program)
    return name in WRAPPERS or bool(_VERSIONED.match(name))


def exec_option(program: str, args: Iterable[str]) -> str | None:
    opts = EXEC_OPTIONS.get(os.path.basename(program), ())
    for a in args:
        for o in opts:
            if a == o or (o.startswith("--") and a.startswith(o + "=")) or (o == "+" and a.startswith("+")):
                return a
            if len(o) == 2 and o.startswith("-") and not a.startswith("--") and a.startswith(o) and o != "-":
                return a  # -cfoo, -Ifoo
        if program.endswith("less") and a.startswith("!"):
            return a
    return None


# --------------------------------------------------------------------------- parsing
_OPERATORS = ("&&", "||", "|&", ";;", ";", "&", "|", "\n")
_REDIRECTS = ("&>>", "&>", ">>", ">&", ">|", "<>", "<&", ">", "<")


class _Parser:
    """A small recursive scanner over bash syntax; raises ShellParseError when unsure."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.parts: list[Part] = []

    def error(self, what: str) -> ShellParseError:
        return ShellParseError(
            f"{what} (at character {self.i + 1}); this command can only be run once by hand"
        )

    def parse(self, closer: str | None = None) -> list[Part]:
        words: list[str] = []
        redirects: list[tuple[str, str]] = []
        depth_here = 0
        while True:
            self.skip_blanks()
            if self.i >= len(self.s):
                if closer is not None:
                    raise self.error(f"missing `{closer}`")
                break
            c = self.s[self.i]
            if c == "#":  # at a word start: a comment to the end of the line
                while self.i < len(self.s) and self.s[self.i] != "\n":
                    self.i += 1
                continue
            if c == ")" and depth_here:
                depth_here -= 1
                self.i += 1
                self.flush(words, redirects)
                continue
            if closer is not None and c == closer:
                self.i += 1
                break
            if c == ")":
                raise self.error("unbalanced `)`")
            op = None if self.s.startswith("&>", self.i) else self.match(_OPERATORS)
            if op:
                if op == ";;":
                    raise self.error("`;;` outside case")
                self.i += len(op)
                self.flush(words, redirects)
                continue
            if c == "(":
                if words or redirects:
                    raise self.error("`(` after a word (function definitions are not supported)")
                if self.s.startswith("((", self.i):
                    raise self.error("arithmetic `((...))` is not supported")
                depth_here += 1
                self.i += 1
                continue
            redir = self.redirection(words)
            if redir:
                redirects.append(redir)
                continue
            if c in "<>" and self.s.startswith("(", self.i + 1):
                self.i += 2
                self.parts.extend(_Parser(self.s).sub(self, ")"))
                words.append("/dev/fd/63")  # what bash passes for a process substitution
                continue
            word = self.word()
            if not words and not redirects and word in ("{", "}", "!"):
                continue
            if not words and word == "}":
                continue
            words.append(word)
        if depth_here:
            raise self.error("unbalanced `(`")
        self.flush(words, redirects)
        return self.parts

    def sub(self, outer: _Parser, closer: str) -> list[Part]:
        """Parse a nested command starting at outer.i up to `closer`; advance outer past it."""
        self.i = outer.i
        parts = self.parse(closer)
        outer.i = self.i
        return parts

    def flush(self, words: list[str], redirects: list[tuple[str, str]]) -> None:
        if not words and not redirects:
            return
        assignments: list[str] = []
        while words and _ASSIGNMENT.match(words[0]):
            assignments.append(words.pop(0))
        if words:
            head = words[0]
            if head in _KEYWORDS:
                raise self.error(f"shell keyword `{head}` is not supported")
            if any(ch in head for ch in "$*?[`") or "\x00" in head:
                raise self.error(f"the command name `{head}` is computed or a glob")
            if head in ("{", "}", "!"):
                raise self.error(f"`{head}` in an unexpected place")
        self.parts.append(Part(tuple(words), tuple(redirects), tuple(assignments)))
        words.clear()
        redirects.clear()

    def skip_blanks(self) -> None:
        while self.i < len(self.s):
            if self.s[self.i] in " \t":
                self.i += 1
            elif self.s.startswith("\\\n", self.i):
                self.i += 2
            else:
                break

    def match(self, options: tuple[str, ...]) -> str | None:
        for o in options:
            if self.s.startswith(o, self.i):
                return o
        return None

    def redirection(self, words: list[str]) -> tuple[str, str] | None:
        j = self.i
        while j < len(self.s) and self.s[j].isdigit():
            j += 1
        if self.s.startswith("<<", j):
            raise self.error("here-documents and here-strings are not supported")
        op = None
        for o in _REDIRECTS:
            if self.s.startswith(o, j):
                op = o
                break
        if op is None or (j > self.i and op.startswith("&")):
            return None
        if self.s.startswith("(", j + len(op)) and op in ("<", ">"):
            return None  # process substitution
        fd = self.s[self.i : j]
        self.i = j + len(op)
        self.skip_blanks()
        if self.i >= len(self.s) or self.s[self.i] in ";&|\n()<>":
            raise self.error(f"redirection `{op}` without a target")
        target = self.word()
        return (fd + op, target)

    def word(self) -> str:
        out: list[str] = []
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\n;&|()<>":
                break
            if c == "'":
                end = s.find("'", self.i + 1)
                if end < 0:
                    raise self.error("unclosed single quote")
                out.append(s[self.i + 1 : end])
                self.i = end + 1
            elif c == '"':
                self.i += 1
                out.append(self.double_quoted())
            elif c == "\\":
                if self.i + 1 >= len(s):
                    raise self.error("trailing backslash")
                if s[self.i + 1] != "\n":
                    out.append(s[self.i + 1])
                self.i += 2
            elif c == "$":
                out.append(self.dollar())
            elif c == "`":
                self.backtick()
                out.append("$(...)")
            elif c == "{" and self.brace_expansion():
                raise self.error("brace expansion `{a,b}` is not supported")
            elif ord(c) < 32 or c == "\x7f":
                raise self.error("control character in the command")
            else:
                out.append(c)
                self.i += 1
        if not out:
            raise self.error(f"unexpected `{s[self.i] if self.i < len(s) else 'end'}`")
        return "".join(out)

    def brace_expansion(self) -> bool:
        """Whether the unquoted `{` at i opens a `{a,b}` or `{1..3}` expansion."""
        j = self.i + 1
        while j < len(self.s) and self.s[j] not in " \t\n;&|()<>}":
            j += 1
        if j >= len(self.s) or self.s[j] != "}":
            return False
        inner = self.s[self.i + 1 : j]
        return "," in inner or ".." in inner

    def double_quoted(self) -> str:
        out: list[str] = []
        s = self.s
        while True:
            if self.i >= len(s):
                raise self.error("unclosed double quote")
            c = s[self.i]
            if c == '"':
                self.i += 1
                return "".join(out)
            if c == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '$`"\\\n':
                if s[self.i + 1] != "\n":
                    out.append(s[self.i + 1])
                self.i += 2
            elif c == "$":
                out.append(self.dollar())
            elif c == "`":
                self.backtick()
                out.append("$(...)")
            else:
                out.append(c)
                self.i += 1

    def dollar(self) -> str:
        s = self.s
        nxt = s[self.i + 1] if self.i + 1 < len(s) else ""
        if nxt == "(":
            if s.startswith("((", self.i + 1):
                raise self.error("arithmetic `$((...))` is not supported")
            self.i += 2
            self.parts.extend(_Parser(s).sub(self, ")"))
            return "$(...)"
        if nxt in ("{", "'", '"', "["):
            raise self.error(f"`${nxt}` expansions are not supported")
        self.i += 1
        return "$"

    def backtick(self) -> None:
        end = self.s.find("`", self.i + 1)
        if end < 0:
            raise self.error("unclosed backtick")
        inner = self.s[self.i + 1 : end]
        if "\\" in inner:
            raise self.error("escapes inside backticks are not supported")
        self.parts.extend(_Parser(inner).parse())
        self.i = end + 1


def parse_command(command: str) -> list[Part]:
    """Every simple command in `command`, substitutions included; raises ShellParseError."""
    if not command.strip():
        raise ShellParseError("the command is empty")
    parts = _Parser(command).parse()
    if not any(p.argv for p in parts):
        raise ShellParseError("the command runs no program")
    return parts


# --------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    kind: RuleKind
    pattern: str
    id: int | None = None

    def describe(self) -> str:
        return f"{'exact' if self.kind == 'exact' else 'prefix'} rule `{self.pattern}`"


def prefix_matches(rule: Rule, part: Part) -> bool:
    try:
        words = tuple(shlex.split(rule.pattern))
    except ValueError:
        return False
    if not words or is_wrapper(words[0]) or part.prefix_blocker() is not None:
        return False
    return part.argv[: len(words)] == words


def normalize(command: str) -> str:
    return command.strip()


@dataclass
class Verdict:
    """What the approval dialog shows: whether rules allow it, which ones, or why not."""

    command: str
    parts: list[Part] = field(default_factory=list)
    allowed: bool = False
    rules: list[Rule] = field(default_factory=list)  # the rules that matched
    reason: str = ""  # why it is (not) allowed, one line
    parse_error: str | None = None
    prefix: str | None = None  # the prefix "Always allow this prefix" would save, if any
    prefix_blocked: str | None = None  # why no prefix can be offered

    @property
    def can_always_exact(self) -> bool:
        return self.parse_error is None

    @property
    def can_always_prefix(self) -> bool:
        return self.prefix is not None


def suggest_prefix(part: Part) -> str:
    argv = part.argv
    words = [argv[0]]
    if part.program in SUBCOMMAND_TOOLS and len(argv) > 1 and not argv[1].startswith("-"):
        words.append(argv[1])
    return shlex.join(words)


def check_command(command: str, rules: Iterable[Rule]) -> Verdict:
    """Decide whether the per-project `rules` allow `command`, and explain it."""
    command = normalize(command)
    rules = list(rules)
    v = Verdict(command)
    try:
        v.parts = parse_command(command)
    except ShellParseError as exc:
        v.parse_error = str(exc)
        v.reason = f"not understood by the policy: {exc}"
        v.prefix_blocked = "the command could not be parsed"
        return v
    _offer_prefix(v)
    for r in rules:
        if r.kind == "exact" and r.pattern == command:
            v.allowed, v.rules, v.reason = True, [r], f"allowed by the {r.describe()}"
            return v
    missing: list[str] = []
    for part in v.parts:
        hit = next((r for r in rules if r.kind == "exact" and r.pattern == part.text), None)
        hit = hit or next((r for r in rules if r.kind == "prefix" and prefix_matches(r, part)), None)
        if hit is None:
            missing.append(part.text)
        elif hit not in v.rules:
            v.rules.append(hit)
    if missing:
        v.reason = "no allow rule matches " + ", ".join(f"`{m}`" for m in missing)
        blocked = [b for p in v.parts if (b := p.prefix_blocker())]
        if blocked:
            v.reason += f" ({blocked[0]})"
        return v
    v.allowed = True
    v.reason = "allowed by the " + "; ".join(r.describe() for r in v.rules)
    return v


def _offer_prefix(v: Verdict) -> None:
    if len(v.parts) != 1:
        v.prefix_blocked = f"it has {len(v.parts)} parts; a prefix rule covers one simple command"
        return
    blocker = v.parts[0].prefix_blocker()
    if blocker:
        v.prefix_blocked = blocker
        return
    v.prefix = suggest_prefix(v.parts[0])


def validate_rule(kind: RuleKind, pattern: str) -> Rule:
    """Refuse rules that could never be safe: prefix rules for wrappers or compound text."""
    pattern = normalize(pattern)
    if kind not in ("exact", "prefix"):
        raise ValueError(f"rule kind must be 'exact' or 'prefix', got {kind!r}")
    if not pattern:
        raise ValueError("an allow rule needs a command")
    if kind == "prefix":
        parts = parse_command(pattern)
        if len(parts) != 1 or parts[0].redirects or parts[0].assignments:
            raise ValueError(f"a prefix rule must be one plain command, got {pattern!r}")
        blocker = parts[0].prefix_blocker()
        if blocker:
            raise ValueError(f"{pattern!r} can never be prefix-allowed: {blocker}")
    else:
        parse_command(pattern)  # an exact rule must at least be understood
    return Rule(kind, pattern)
