"""Differential fuzz of the policy against what really runs: hypothesis composes shell strings from the
programs of the rule table, their options (dangerous ones included), quoted and unquoted words and
bash metacharacters; every string a fixed rule set auto-allows is run inside the sandbox under
`strace -f -e trace=execve`, and the test fails if any program other than bash and the programs of
the command's own parts (resolved on PATH) was executed.

What is covered: disagreements between the policy's reading of a command and bash's (a hidden
command, an option that runs a program). What is not covered: file writes (the e2e suite checks
those); programs the allowed ones exec on their own behalf would show up here as failures.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from webapp.agent.runner import CommandRun, shell_path
from webapp.agent.sandbox import SandboxPolicy, command_env
from webapp.agent.shell import Rule, check_command

from .conftest import make_project

RULES = [
    Rule("prefix", p)
    for p in ("ls", "cat", "echo", "grep", "find", "git status", "git log", "git diff", "git grep", "git show",
              "git shortlog", "sort", "head", "tail", "wc", "printf", "cut", "tr", "nl", "rev", "stat", "du",
              "date", "file", "rg", "uniq", "true")
]  # fmt: skip
PROGRAMS = ["ls", "cat", "echo", "grep", "find", "git status", "git log", "git diff", "git grep", "git show",
            "git shortlog", "sort", "head", "tail", "wc", "printf", "cut", "tr", "nl", "rev", "stat", "du", "date",
            "file", "rg", "uniq", "true"]  # fmt: skip
TEMPTING = ["sh", "touch", "rm", "python3", "xargs", "env", "tee", "awk", "sed", "bash", "/bin/ls", "./ls"]
SAFE_OPTIONS = ["-l", "-a", "-n", "1", "-r", "-c", "-u", "-s", "--short", "--oneline", "-name", "-type", "f",
                "-maxdepth", "1", "--stat", "-i", "-e", "hello", "-H", "-R", "-1", "-k1", "-w", "-d,", "-f1",
                "--porcelain", "HEAD", "--", "-la", "-print", "--count"]  # fmt: skip
DANGEROUS = ["-exec", "-execdir", "-ok", "-delete", "-fprint", "-fprint0", "-fls", "-o", "--output=o.txt",
             "--outp=o.txt", "-uo", "-oo.txt", "-T", "--compress-program=touch", "-O", "-Otouch",
             "--open-files-in-pager=touch", "--open=touch", "--ext-diff", "--textconv", "-v", "--set=2020-01-01",
             "-C", "-z", "--pre=touch", "--pre", "-I", "--checkpoint-action=exec=touch", "-c", "touch", "sh",
             "{}", "';'", "+", "0101000020", "-S", "--files0-from=-"]  # fmt: skip
WORDS = ["README.md", "src", "src/app.py", ".", "x", "hello", "o.txt", "'a b'", '"a b"', "'$(touch pwned)'",
         '"x"', "'*.py'", "'%s'", "'a;b'", '"a|b"', "'#'", "a=b", "%s", "@", ":", "+x", ",", "'-exec'",
         "'\\n'"]  # fmt: skip
META = list(";|&<>(){}$\\`'\"#*?~=") + [
    " ", "\t", "\n", "&&", "||", "2>&1", ">/dev/null", "2>/dev/null", "<(", ">(", "$(", "${", "$'", "<<<",
    "<<", ">|", "&>", "{fd}>", "$BASH_COMMAND", "$_", "{a,b}", "~/", "*.py", "\\;", "#x",
]  # fmt: skip
JOINERS = ["; ", " && ", " || ", " | ", "\n", "; ", " && ", " | ", " & ", ";", "|", " ;\n", " |& "]

token = st.one_of(
    *[st.sampled_from(SAFE_OPTIONS)] * 4,
    *[st.sampled_from(WORDS)] * 3,
    *[st.sampled_from(DANGEROUS)] * 2,
    st.sampled_from(META),
)
program = st.one_of(*([st.sampled_from(PROGRAMS)] * 5), st.sampled_from(TEMPTING))


@st.composite
def segments(draw: st.DrawFn) -> str:
    words = [draw(program)] + draw(st.lists(token, max_size=5))
    glue = draw(st.sampled_from([" ", " ", " ", ""]))
    return glue.join(words) if glue else " ".join(words[:1]) + "".join(words[1:])


@st.composite
def commands(draw: st.DrawFn) -> str:
    parts = draw(st.lists(segments(), min_size=1, max_size=3))
    out = parts[0]
    for part in parts[1:]:
        out += draw(st.sampled_from(JOINERS)) + part
    return out


EXECVE = re.compile(r'^(\d+)\s+execve\("((?:[^"\\]|\\.)*)"')
DONE = re.compile(r"= 0$")


def executed(trace: str) -> list[str]:
    """The programs a trace shows successfully exec'd, in order (unfinished calls resolved by pid)."""
    pending: dict[str, str] = {}
    out: list[str] = []
    for line in trace.splitlines():
        m = EXECVE.match(line)
        if m:
            pid, path = m.groups()
            if "<unfinished ...>" in line:
                pending[pid] = path
            elif DONE.search(line):
                out.append(path)
        elif "<... execve resumed>" in line:
            pid = line.split()[0]
            if pid in pending and DONE.search(line):
                out.append(pending.pop(pid))
    return out


def resolve(program: str, path: str) -> str | None:
    found = shutil.which(program, path=path)
    return os.path.realpath(found) if found else None


@pytest.mark.slow
def test_fuzz_allowed_commands_exec_only_their_own_programs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert shutil.which("strace"), "strace is needed (Debian package `strace`)"
    project = tmp_path / "project"
    make_project(project)
    policy = SandboxPolicy(project)
    env = command_env()
    bash = os.path.realpath(shell_path())
    stats = {"generated": 0, "allowed": 0}
    seen: set[str] = set()
    violations: list[str] = []

    @settings(
        max_examples=300,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(commands())
    @example("find -- . -maxdepth 0 -exec true ';'")
    @example("ls -la | wc -l && git status --short")
    def run_one(command: str) -> None:
        stats["generated"] += 1
        verdict = check_command(command, RULES)
        if not verdict.allowed:
            return
        stats["allowed"] += 1
        allowed = {bash} | {r for p in verdict.parts if (r := resolve(p.program, env["PATH"]))}
        trace_file = tmp_path / "trace.txt"
        strace = ["strace", "-f", "-qq", "-e", "trace=execve", "-e", "signal=none", "-o", str(trace_file)]
        with CommandRun(command, project, timeout_s=10, sandbox=policy).launch() as (argv, pass_fds):
            try:
                subprocess.run([*strace, *argv], cwd=project, env=env, stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=20, pass_fds=pass_fds)  # fmt: skip
            except subprocess.TimeoutExpired:
                pass  # what ran until then is in the trace
        programs = executed(trace_file.read_text())
        assert programs and os.path.basename(programs[0]) == "bwrap", programs[:1]
        for path in programs[1:]:
            real = os.path.realpath(path)
            seen.add(os.path.basename(real))
            if real not in allowed:
                violations.append(f"{command!r} executed {path} (allowed: {sorted(allowed)})")

    run_one()
    with capsys.disabled():
        print(
            f"\nfuzz: {stats['generated']} generated, {stats['allowed']} auto-allowed and run under strace, "
            f"programs seen: {', '.join(sorted(seen))}"
        )
    assert stats["allowed"] >= 30, stats  # the strategy must reach the allowed space to prove anything
    assert violations == [], "\n".join(violations)
