"""Shell command policy: decide whether a per-project allow rule covers a proposed command, or
whether the user must be asked. Nothing here runs anything (`runner.py` does, inside `sandbox.py`).

A rule auto-allows only a *provably plain* command. The command is parsed twice, by the real bash
grammar (tree-sitter-bash) and by a strict lexer of the plain subset written here, and both must
agree on every word. Plain means: simple commands, pipelines (`|`) and `&&` / `||` / `;` / newline
lists of them; words of `[A-Za-z0-9_./:@%+,=-]`, single-quoted strings, and double-quoted strings
without `$`, backticks or backslashes; redirections only to `/dev/null` or between descriptors
(`2>&1`). Everything else asks: any expansion or substitution (`$`, backticks, `<(...)`, globs, braces,
`~`), escapes, comments, here-documents, assignments, subshells, control flow, functions, `&`,
other redirections, invisible or control characters, anything the grammar marks as an error, and
input over `MAX_COMMAND_CHARS`.

Prefix rules (`ls` allows `ls -la src`) exist only for programs in `PREFIX_TABLE`: programs whose
arguments cannot run code or write files once the options listed there are refused. Bundled short
options (`-cI'…'`) and GNU long-option abbreviations (`--checkpoint-a=`) are normalised before the
check. Every other program (interpreters, build tools, `env`, `xargs`, `tar`, `make`, ...) can be
allowed only as one exact command. Exact rules match the whole command, or one part of it.

What is covered: deciding *when to ask*, for commands the agent proposes and commands the user types.
What is not covered (the sandbox is what makes these harmless): what a program does with files or
configuration of the project (`git status` reads `.git/config`, which can name programs to run), and
bugs in the grammar or the lexer — both must agree, and a command that slips through still runs only
inside the OS sandbox.
"""

from __future__ import annotations

import functools
import shlex
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

RuleKind = Literal["exact", "prefix"]
MAX_COMMAND_CHARS = 4096

_SAFE_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./:@%+,=-")
_BAD_IN_DOUBLE_QUOTES = frozenset("$`\\!")
_RESERVED = frozenset(
    "! [[ ]] { } case coproc do done elif else esac fi for function if in select then time until while".split()
)
_DEV_NULL = "/dev/null"
# Builtins that change how later parts of the same command run: a command with one of them can be
# allowed only by an exact rule for the whole command, never part by part.
STATEFUL_BUILTINS = frozenset(
    ". alias bind builtin command compgen complete declare enable eval exec export fc getopts hash history "
    "let local mapfile printf read readarray readonly set shift shopt source test trap typeset ulimit umask "
    "unalias unset [ cd pushd popd".split()  # cd & co.: a rule for `make` is not a rule for `make` elsewhere
)


class ShellParseError(ValueError):
    """The command is not provably plain: no rule may allow it (the user can still run it once)."""


# --------------------------------------------------------------------------- the prefix table
@dataclass(frozen=True)
class ProgramSpec:
    """A program that may be prefix-allowed, and the options that disqualify a command."""

    deny_short: str = ""  # short option letters, alone or bundled (`-uo` has `o`)
    deny_long: tuple[str, ...] = ()  # GNU long options; any abbreviation of one counts
    deny_args: tuple[str, ...] = ()  # argument prefixes refused anywhere, even after `--` (find's `-exec`)
    subcommands: Mapping[str, ProgramSpec] | None = None  # only these subcommands, no options before
    operands: str | None = None  # if set, every operand must start with it (`date +%F`, never `date 0101…`)
    takes_value: str = ""  # short options whose value is the next argument, not an operand

    def blocker(self, program: str, args: tuple[str, ...]) -> str | None:
        """Why `program args` cannot be covered by a prefix rule, or None."""
        if self.subcommands is not None:
            if not args or args[0].startswith("-"):
                return f"options before a `{program}` subcommand (like `-c`, `-C`) can run programs"
            sub = self.subcommands.get(args[0])
            if sub is None:
                names = ", ".join(sorted(self.subcommands))
                return f"`{program} {args[0]}` is not one of the subcommands that may be prefix-allowed ({names})"
            return sub.blocker(f"{program} {args[0]}", args[1:])
        denied = next((a for a in args if any(a.startswith(p) for p in self.deny_args)), None)
        if denied is not None:
            return f"`{program} {denied}` can run programs or write files"
        # Every word that looks like an option is checked, wherever it stands: after `--` too, and as the value
        # of an option not declared in `takes_value`. Which options take the next word as their value differs by
        # program and version (`rg -e -- --pre=sh` reads `--` as the pattern, so `--pre` is still an option), so
        # `--` ending the options cannot be trusted; a pattern or file that only looks like a denied option asks.
        options_end = False
        value_next = False
        for arg in args:
            operand = options_end or arg == "-" or not arg.startswith("-")
            if value_next:  # the value of an option declared to take one (`date -d -3days`): only that value
                value_next = False
                continue
            if operand and self.operands is not None and not arg.startswith(self.operands):
                return (
                    f"`{program} {arg}`: only operands starting with `{self.operands}` may be prefix-allowed"
                )
            if arg == "--":
                options_end = True
            elif arg.startswith("--"):
                name = arg[2:].split("=", 1)[0]
                # an abbreviation of a denied option, or a longer one that extends it with a dash (`file
                # --uncompress-noreport` is -Z, as `--uncompress` is -z); `rg --pretty` is not `--pre`
                hit = next(
                    (o for o in self.deny_long if name and (o.startswith(name) or name.startswith(o + "-"))),
                    None,
                )
                if hit:
                    return f"`{program} {arg}` (--{hit}) can run programs or write files"
            elif arg.startswith("-") and len(arg) > 1:
                hit = next((c for c in arg[1:] if c in self.deny_short), None)
                if hit:
                    return f"`{program} {arg}` (-{hit}) can run programs or write files"
                value_next = not operand and len(arg) == 2 and arg[1] in self.takes_value
        return None


_PLAIN = ProgramSpec()
_GIT_READ = ProgramSpec(deny_short="O", deny_long=("output", "ext-diff", "open-files-in-pager", "textconv"))
PREFIX_TABLE: Mapping[str, ProgramSpec] = {
    **dict.fromkeys(
        "ls cat head tail wc pwd echo true false cut tr nl tac rev fold paste comm join column expand "
        "unexpand diff cmp basename dirname realpath readlink stat du df id whoami uname nproc printenv "
        "sha1sum sha256sum sha512sum md5sum b2sum cksum od hexdump grep sleep".split(),
        _PLAIN,
    ),
    "printf": ProgramSpec(deny_short="v"),  # printf -v 'a[$(cmd)]' evaluates the subscript
    "rg": ProgramSpec(deny_short="z", deny_long=("pre", "pre-glob", "search-zip", "hostname-bin")),
    "find": ProgramSpec(deny_args=("-exec", "-ok", "-delete", "-fprint", "-fls")),
    "sort": ProgramSpec(deny_short="oT", deny_long=("output", "compress-program", "temporary-directory")),
    "tree": ProgramSpec(deny_short="oR"),  # -R writes 00Tree.html files (with -H)
    "file": ProgramSpec(deny_short="CzZ", deny_long=("compile", "uncompress")),  # -z may run gzip
    "date": ProgramSpec(
        deny_short="s", deny_long=("set",), operands="+", takes_value="dfr"
    ),  # MMDDhhmm sets the clock
    "git": ProgramSpec(
        subcommands={
            **dict.fromkeys(("status", "ls-files", "rev-parse", "describe"), ProgramSpec()),
            **dict.fromkeys(("diff", "log", "show", "grep", "blame", "shortlog"), _GIT_READ),
        }
    ),
}


def not_in_table(program: str) -> str:
    return (
        f"`{program}` is not in flashcode's table of programs whose arguments cannot run code or write files"
    )


def prefix_table_reason(program: str) -> str:
    return f"{not_in_table(program)}, so no prefix rule can allow it: allow an exact command instead"


# --------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Part:
    """One simple command: its words (unquoted) and its (harmless) redirections."""

    argv: tuple[str, ...]
    redirects: tuple[str, ...] = ()  # as written: `2>/dev/null`, `2>&1`
    piped: bool = False  # its input comes from the part before it (`a | b`: b), which the model chose

    @property
    def text(self) -> str:
        """Canonical form, used for exact per-part rules."""
        return " ".join([shlex.join(self.argv), *self.redirects]).strip()

    @property
    def program(self) -> str:
        return self.argv[0] if self.argv else ""

    def prefix_blocker(self) -> str | None:
        """Why no prefix rule may cover this part, or None."""
        spec = PREFIX_TABLE.get(self.program)
        if spec is None:
            return prefix_table_reason(self.program)
        return spec.blocker(self.program, self.argv[1:])


@functools.cache
def _parser() -> Parser:
    return Parser(Language(tree_sitter_bash.language()))


def _check_characters(command: str) -> None:
    if not command.strip():
        raise ShellParseError("the command is empty")
    if len(command) > MAX_COMMAND_CHARS:
        raise ShellParseError(
            f"the command is {len(command):,} characters; rules cover at most {MAX_COMMAND_CHARS:,}"
        )
    for ch in command:
        if ch in "\n\t":
            continue
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            raise ShellParseError(f"the command contains an invisible or control character (U+{ord(ch):04X})")


def _node_text(node: Node) -> str:
    return (node.text or b"").decode("utf-8", "surrogatepass")


def _word_value(node: Node) -> str:
    """The value of one argument node of the plain subset (quotes removed), or ShellParseError."""
    kind, text = node.type, _node_text(node)
    if kind in ("word", "number"):
        bad = next((c for c in text if c not in _SAFE_WORD), None)
        if bad is not None or not text:
            raise ShellParseError(f"`{text}` has {bad!r}, which bash may expand or treat specially")
        return text
    if kind == "raw_string":
        return text[1:-1]
    if kind == "string":
        out = []
        for child in node.children:
            if child.type == '"':
                continue
            if child.type != "string_content":
                raise ShellParseError(f"{text} contains {child.type.replace('_', ' ')}")
            value = _node_text(child)
            if any(c in _BAD_IN_DOUBLE_QUOTES for c in value):
                raise ShellParseError(
                    f"{text} contains `$`, a backtick, `!` or a backslash inside double quotes"
                )
            out.append(value)
        return "".join(out)
    if kind == "concatenation":
        return "".join(_word_value(c) for c in node.children)
    raise ShellParseError(f"`{text}` is a {kind.replace('_', ' ')}")


def _redirect(node: Node) -> str:
    text = _node_text(node)
    if node.type != "file_redirect":
        raise ShellParseError(f"`{text}` is a {node.type.replace('_', ' ')}")
    ops = [c.type for c in node.children if not c.is_named]
    target = node.child_by_field_name("destination")
    value = _word_value(target) if target is not None else ""
    if ops in ([">"], [">>"], ["&>"], ["&>>"]) and value == _DEV_NULL:
        return text
    if ops == [">&"] and value.isdigit():
        return text
    raise ShellParseError(f"`{text}` redirects to a file (only /dev/null and `2>&1` are plain)")


def _command(node: Node, redirects: tuple[str, ...] = ()) -> Part:
    argv: list[str] = []
    for child in node.children:
        if child.type == "command_name":
            if child.named_child_count != 1:
                raise ShellParseError(f"`{_node_text(child)}` is not a plain command name")
            argv.append(_word_value(child.named_children[0]))
        elif child.type in ("word", "number", "raw_string", "string", "concatenation"):
            argv.append(_word_value(child))
        elif child.type == "file_redirect":
            redirects = (*redirects, _redirect(child))
        else:
            raise ShellParseError(f"`{_node_text(child)}` is a {child.type.replace('_', ' ')}")
    if not argv:
        raise ShellParseError("a part of the command runs no program")
    if argv[0] in _RESERVED:
        raise ShellParseError(f"`{argv[0]}` is a bash keyword")
    return Part(tuple(argv), redirects)


def _grammar_parts(command: str) -> list[Part]:
    """Parts of the command by the bash grammar, or ShellParseError for anything not plain."""
    tree = _parser().parse(command.encode("utf-8", "surrogatepass"))
    root = tree.root_node
    if root.has_error:
        raise ShellParseError("bash would not parse it as written (a syntax error)")
    parts: list[Part] = []
    stack: list[Node] = [root]
    while stack:  # iterative: deep nesting cannot exhaust Python's stack
        node = stack.pop()
        kind = node.type
        if kind in ("program", "list", "pipeline"):
            for child in reversed(node.children):
                if child.is_named:
                    stack.append(child)
                elif child.type not in (";", "&&", "||", "|"):
                    raise ShellParseError(f"`{child.type}` is not a plain list operator")
        elif kind == "command":
            parts.append(_command(node))
        elif kind == "redirected_statement":
            body = node.child_by_field_name("body")
            redirects = tuple(_redirect(c) for c in node.children_by_field_name("redirect"))
            if len(redirects) != node.named_child_count - 1:
                raise ShellParseError(f"`{_node_text(node)[:60]}` has parts the policy does not know")
            if body is None or body.type != "command":
                raise ShellParseError("a redirection applies to a compound statement")
            parts.append(_command(body, redirects))
        else:
            raise ShellParseError(f"`{_node_text(node)[:60]}` is a {kind.replace('_', ' ')}")
    return parts


def _lexer_parts(command: str, piped: list[bool] | None = None) -> list[tuple[str, ...]]:
    """The argv of each part by a strict lexer of the plain subset: the grammar's cross-check. `piped`
    gets, for each part, whether a `|` comes before it (its input is the part before's output)."""
    parts: list[tuple[str, ...]] = []
    words: list[str] = []
    i, n = 0, len(command)
    flags = piped if piped is not None else []
    after_pipe = False

    def end_part() -> None:
        if not words:
            raise ShellParseError("an operator has no command before it")
        parts.append(tuple(words))
        flags.append(after_pipe)
        words.clear()

    while i < n:
        ch = command[i]
        if ch in " \t":
            i += 1
        elif ch == "\n" or ch == ";":
            if words:  # a part ends here: the next one reads no pipe (a line break right after `|` keeps it)
                end_part()
                after_pipe = False
            i += 1
        elif command.startswith(("&&", "||"), i):
            end_part()
            after_pipe = False
            i += 2
        elif ch == "|":
            end_part()
            after_pipe = True
            i += 1
        elif ch in "<>&" or (ch.isdigit() and _redirect_at(command, i)):
            i = _skip_redirect(command, i)
        else:
            word, i = _lex_word(command, i)
            words.append(word)
    if words:
        parts.append(tuple(words))
        flags.append(after_pipe)
    return parts


def _redirect_at(command: str, i: int) -> bool:
    j = i
    while j < len(command) and command[j].isdigit():
        j += 1
    return j < len(command) and command[j] == ">"


def _skip_redirect(command: str, i: int) -> int:
    """Skip a harmless redirection at i (`2>/dev/null`, `>>/dev/null`, `&>/dev/null`, `2>&1`)."""
    j = i
    while j < len(command) and command[j].isdigit():
        j += 1
    for op in ("&>>", "&>", ">>", ">&", ">"):
        if command.startswith(op, j):
            j += len(op)
            break
    else:
        raise ShellParseError(f"`{command[i : i + 10]}` is not a plain redirection")
    while j < len(command) and command[j] in " \t":
        j += 1
    target, j = _lex_word(command, j)
    if not (target == _DEV_NULL and op != ">&") and not (op == ">&" and target.isdigit()):
        raise ShellParseError(f"a redirection to `{target}` is not plain")
    return j


def _lex_word(command: str, i: int) -> tuple[str, int]:
    out: list[str] = []
    n = len(command)
    while i < n and command[i] not in " \t\n;|&<>":
        ch = command[i]
        if ch in "'\"":
            close = command.find(ch, i + 1)
            if close < 0:
                raise ShellParseError("a quote is not closed")
            value = command[i + 1 : close]
            if ch == '"' and any(c in _BAD_IN_DOUBLE_QUOTES for c in value):
                raise ShellParseError("`$`, a backtick, `!` or a backslash inside double quotes")
            out.append(value)
            i = close + 1
        elif ch in _SAFE_WORD:
            out.append(ch)
            i += 1
        else:
            raise ShellParseError(f"{ch!r} may be expanded or treated specially by bash")
    if not out:
        raise ShellParseError("an empty word")
    return "".join(out), i


def parse_command(command: str) -> list[Part]:
    """The parts of a provably plain command; ShellParseError (with the reason) for anything else."""
    _check_characters(command)
    parts = _grammar_parts(command)
    piped: list[bool] = []
    if [p.argv for p in parts] != _lexer_parts(command, piped):
        raise ShellParseError("the bash grammar and the strict lexer read it differently")
    return [replace(p, piped=f) for p, f in zip(parts, piped, strict=True)]


# --------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    kind: RuleKind
    pattern: str
    id: int | None = None

    def describe(self) -> str:
        return f"{'exact' if self.kind == 'exact' else 'prefix'} rule `{self.pattern}`"


def _rule_parts(rule: Rule) -> list[Part] | None:
    try:
        return parse_command(rule.pattern)
    except ShellParseError:
        return None


def prefix_matches(rule: Rule, part: Part) -> bool:
    """A prefix rule covers a part: same leading words, a program in the table, no refused option."""
    parts = _rule_parts(rule)
    if not parts or len(parts) != 1 or parts[0].redirects:
        return False
    words = parts[0].argv
    return part.argv[: len(words)] == words and _valid_prefix(words) is None and part.prefix_blocker() is None


def _valid_prefix(words: tuple[str, ...]) -> str | None:
    spec = PREFIX_TABLE.get(words[0])
    if spec is None:
        return prefix_table_reason(words[0])
    if spec.subcommands is not None and len(words) < 2:
        return f"a `{words[0]}` prefix rule must name the subcommand (e.g. `{words[0]} status`)"
    return spec.blocker(words[0], words[1:])


def exact_matches(rule: Rule, command: str, part: Part | None = None) -> bool:
    if rule.kind != "exact":
        return False
    if part is None:
        return rule.pattern.strip() == command.strip()
    parts = _rule_parts(rule)
    return parts is not None and len(parts) == 1 and parts[0].text == part.text


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
    parse_error: str | None = None  # why it is not a plain command (then no rule can allow it)
    prefix: str | None = None  # the prefix "Always allow this prefix" would save, if any
    prefix_blocked: str | None = None  # why no prefix can be offered

    @property
    def can_always_exact(self) -> bool:
        return self.parse_error is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "allowed": self.allowed,
            "reason": self.reason,
            "parse_error": self.parse_error,
            "prefix": self.prefix,
            "prefix_blocked": self.prefix_blocked,
            "parts": [list(p.argv) for p in self.parts],
        }


def suggest_prefix(part: Part) -> str:
    spec = PREFIX_TABLE.get(part.program)
    n = 2 if spec is not None and spec.subcommands is not None else 1
    return shlex.join(part.argv[:n])


def check_command(command: str, rules: Iterable[Rule], *, sandboxed: bool = True) -> Verdict:
    """Decide whether the per-project `rules` allow `command`, and explain it.

    `sandboxed=False` (no OS sandbox on this machine): rules never allow anything; every command asks.
    """
    command = normalize(command)
    rules = list(rules)
    v = Verdict(command)
    try:
        v.parts = parse_command(command)
    except ShellParseError as exc:
        v.parse_error = str(exc)
        v.reason = f"not a plain command ({exc}), so no rule can allow it"
        v.prefix_blocked = "only plain commands can be allowed by a rule"
        return v
    _offer_prefix(v)
    if not sandboxed:
        v.reason = "there is no OS sandbox on this machine, so every command asks"
        return v
    whole = next((r for r in rules if exact_matches(r, command)), None)
    if whole is not None:
        v.allowed, v.rules, v.reason = True, [whole], f"allowed by the {whole.describe()}"
        return v
    missing: list[Part] = []
    per_part = not any(p.program in STATEFUL_BUILTINS for p in v.parts) or len(v.parts) == 1
    for part in v.parts:
        # an exact rule covers a part as it was approved alone: with its input from /dev/null, not from a
        # pipe whose contents the model chose (`echo 'import os…' | python3 manage.py shell`)
        hit = next(
            (r for r in rules if per_part and not part.piped and exact_matches(r, command, part)), None
        )
        hit = hit or next((r for r in rules if r.kind == "prefix" and prefix_matches(r, part)), None)
        if hit is None:
            missing.append(part)
        elif hit not in v.rules:
            v.rules.append(hit)
    if missing:
        v.reason = "no allow rule matches " + ", ".join(f"`{m.text}`" for m in missing)
        blocked = [b for p in missing if (b := p.prefix_blocker()) and p.program in PREFIX_TABLE]
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
    part = v.parts[0]
    blocker = part.prefix_blocker()
    if blocker is None and part.redirects:
        blocker = "it has redirections; a prefix rule covers a command without them"
    if blocker:
        v.prefix_blocked = blocker
        return
    v.prefix = suggest_prefix(part)


def as_typed(pattern: str) -> str:
    """A rule as its refusal quotes it: as typed, in backticks (Python's quoting, escapes and all, where it
    holds characters that do not print)."""
    return f"`{pattern}`" if pattern.isprintable() else repr(pattern)


def validate_rule(kind: RuleKind, pattern: str) -> Rule:
    """Refuse rules that could never be safe: prefix rules outside the table, anything not plain."""
    pattern = normalize(pattern)
    if kind not in ("exact", "prefix"):
        raise ValueError(f"rule kind must be 'exact' or 'prefix', got {kind!r}")
    if not pattern:
        raise ValueError("an allow rule needs a command")
    try:
        parts = parse_command(pattern)
    except ShellParseError as exc:
        raise ValueError(
            f"{as_typed(pattern)} is not a plain command ({exc}); no rule can allow it"
        ) from None
    if kind == "prefix":
        if len(parts) != 1 or parts[0].redirects:
            raise ValueError(
                f"a prefix rule must be one plain command without redirections, got {as_typed(pattern)}"
            )
        program = parts[0].argv[0]
        if program not in PREFIX_TABLE:  # said once, not "… so no prefix rule can allow it: …" after it
            raise ValueError(
                f"{as_typed(pattern)} can never be prefix-allowed, as {not_in_table(program)}. "
                "Allow the exact command instead"
            )
        blocker = _valid_prefix(parts[0].argv)
        if blocker:
            raise ValueError(f"{as_typed(pattern)} can never be prefix-allowed: {blocker}")
    return Rule(kind, pattern)
