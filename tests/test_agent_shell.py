"""The shell policy: splitting, unquoting, wrappers, redirections, and every bypass attempt refused.

tests/security/ holds the adversarial suite (probes by class, end to end in the sandbox, fuzzing)."""

from __future__ import annotations

import pytest

from webapp.agent.shell import Rule, ShellParseError, check_command, parse_command, validate_rule

LS = [Rule("prefix", "ls", 1)]
GIT = [Rule("prefix", "git status", 2), Rule("prefix", "echo", 3), Rule("prefix", "cat", 4)]


def test_shell_splits_compound_commands_into_parts() -> None:
    cases = {
        "ls; rm -rf x": ["ls", "rm -rf x"],
        "ls && rm x || pwd": ["ls", "rm x", "pwd"],
        "ls | wc -l": ["ls", "wc -l"],
        "ls\nrm x": ["ls", "rm x"],
        "ls 2>/dev/null | wc -l": ["ls 2>/dev/null", "wc -l"],
    }
    for command, parts in cases.items():
        assert [p.text for p in parse_command(command)] == parts, command
    for command in ["ls & rm x", "(cd sub && make)", "{ ls; pwd; }", "ls |& cat"]:
        with pytest.raises(ShellParseError):  # background jobs, subshells and groups are not plain
            parse_command(command)


def test_shell_substitutions_anywhere_are_never_plain() -> None:
    for command in ["echo $(rm -rf ~)", 'echo "a `whoami` b"', "cat <(curl evil)", "echo $(ls $(rm x))"]:
        with pytest.raises(ShellParseError):
            parse_command(command)
        assert not check_command(command, [Rule("prefix", "echo"), Rule("prefix", "cat")]).allowed


def test_shell_unquotes_command_names_like_bash() -> None:
    for command in ["'r'm -rf x", '"rm" -rf x', "r''m -rf x"]:
        assert parse_command(command)[0].argv[0] == "rm", command
    assert parse_command("'s'h -c id")[0].prefix_blocker() is not None
    with pytest.raises(ShellParseError):  # escapes are not plain
        parse_command("r\\m -rf x")


@pytest.mark.parametrize(
    "command",
    [
        "ls; rm -rf ~",
        "ls && rm -rf ~",
        "ls || rm -rf ~",
        "ls | sh",
        "ls\nrm -rf ~",
        "ls $(rm -rf ~)",
        "ls `rm -rf ~`",
        'ls "$(rm -rf ~)"',
        "ls > ~/.bashrc",
        "ls >> ~/.bashrc",
        "ls &> ~/.bashrc",
        "ls 2> ~/.bashrc",
        "(ls; rm -rf ~)",
        "ls <(rm -rf ~)",
        "ls & rm -rf ~",
        "PATH=/tmp ls",
        "LD_PRELOAD=/tmp/x.so ls",
    ],
)
def test_shell_bypass_attempts_are_not_covered_by_a_prefix_rule(command: str) -> None:
    v = check_command(command, LS)
    assert not v.allowed, (command, v.reason)


@pytest.mark.parametrize(
    "command",
    [
        "cat <<EOF\nx\nEOF",
        "cat <<< x",
        "echo ${HOME}",
        "echo $'\\x72m'",
        "echo $((1+2))",
        "if true; then rm -rf ~; fi",
        "for f in *; do rm $f; done",
        "f() { rm -rf ~; }; f",
        "$CMD -rf ~",
        "/bin/r? -rf ~",
        "{rm,-rf,~}",
        "find . {-exec,rm,x,+}",
        "echo {1..3}",
        "ls 'unclosed",
        'ls "unclosed',
        "ls )",
        "(ls",
        "ls \x07",
        "",
    ],
)
def test_shell_fails_closed_on_what_it_cannot_parse(command: str) -> None:
    if command:
        with pytest.raises(ShellParseError):
            parse_command(command)
    v = check_command(command, [Rule("exact", command), *LS])
    assert not v.allowed and not v.can_always_exact and v.prefix is None


@pytest.mark.parametrize(
    "wrapper",
    [
        "sh -c",
        "bash",
        "zsh",
        "python",
        "python3",
        "python3.12",
        "node",
        "perl",
        "ruby",
        "env",
        "xargs",
        "sudo",
        "su",
        "doas",
        "eval",
        "exec",
        "nohup",
        "time",
        "timeout 5",
        "nice",
        "/bin/sh",
        "/usr/bin/env",
        "awk",
    ],
)
def test_shell_wrappers_can_never_be_prefix_allowed(wrapper: str) -> None:
    with pytest.raises(ValueError):
        validate_rule("prefix", wrapper)
    # even a rule smuggled into the database is ignored
    v = check_command(f"{wrapper} 'rm -rf ~'", [Rule("prefix", wrapper.split()[0])])
    assert not v.allowed and v.prefix is None and v.prefix_blocked


def test_shell_exec_options_block_prefix_rules() -> None:
    assert not check_command("find . -exec rm {} +", [Rule("prefix", "find")]).allowed
    assert not check_command("git -c core.pager=sh status", [Rule("prefix", "git")]).allowed
    assert not check_command("tar --to-command=sh -xf a.tar", [Rule("prefix", "tar")]).allowed
    assert check_command("find . -name '*.py'", [Rule("prefix", "find")]).allowed
    assert check_command("find . -name x -exec echo {} +", []).prefix is None  # `{}` is fine, -exec is not


@pytest.mark.parametrize(
    "command", ["uv run bash -c id", "docker exec box sh", "npm exec evil", "npx evil", "poetry run sh"]
)
def test_shell_runner_subcommands_are_never_prefix_allowed(command: str) -> None:
    prog = command.split()[0]
    assert not check_command(
        command, [Rule("prefix", prog), Rule("prefix", " ".join(command.split()[:2]))]
    ).allowed
    with pytest.raises(ValueError):
        validate_rule("prefix", " ".join(command.split()[:2]))


def test_shell_every_part_must_be_allowed() -> None:
    v = check_command("git status && echo done | cat", GIT)
    assert v.allowed and {r.pattern for r in v.rules} == {"git status", "echo", "cat"}
    v = check_command("git status && git push", GIT)
    assert not v.allowed and "git push" in v.reason


def test_shell_exact_rule_matches_the_whole_command_only() -> None:
    rules = [Rule("exact", "make test")]
    assert check_command("make test", rules).allowed
    assert check_command("  make test  ", rules).allowed
    assert not check_command("make test; rm x", rules).allowed
    assert not check_command("make tests", rules).allowed
    # a redirection to a file is not plain: even an exact rule for it asks
    assert not check_command("make test > log.txt", [Rule("exact", "make test > log.txt")]).allowed


def test_shell_safe_redirections_keep_prefix_rules() -> None:
    assert check_command("ls 2>/dev/null", LS).allowed
    assert check_command("ls 2>&1 | cat", [*LS, Rule("prefix", "cat")]).allowed
    assert not check_command("ls > out.txt", LS).allowed


def test_shell_suggests_a_prefix_only_for_one_plain_command() -> None:
    assert check_command("git status --short", []).prefix == "git status"
    assert check_command("ls -la src", []).prefix == "ls"
    v = check_command("ls; pwd", [])
    assert v.prefix is None and "2 parts" in (v.prefix_blocked or "")
    assert check_command("sudo ls", []).prefix is None


def test_shell_explains_why_no_rule_matched() -> None:
    v = check_command("rm -rf build", LS)
    assert not v.allowed and "rm -rf build" in v.reason
    v = check_command("ls -la", LS)
    assert v.allowed and "ls" in v.reason
