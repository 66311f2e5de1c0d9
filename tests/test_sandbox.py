"""The sandbox layer: detection, the no-sandbox fallback (every command asks), the clean environment,
and the macOS profile's text. tests/security/ runs the adversarial probes inside bubblewrap."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_agent_loop import Approver, collect, make_session, of
from webapp.agent import events as ev
from webapp.agent import sandbox
from webapp.agent.runner import CommandRun
from webapp.agent.shell import Rule, check_command

pytest_plugins = ["tests.test_agent_loop"]


@pytest.fixture
def no_sandbox(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("FLASHCODE_NO_SANDBOX", "1")
    sandbox.detect.cache_clear()
    yield
    sandbox.detect.cache_clear()


def test_sandbox_is_detected_on_this_machine() -> None:
    status = sandbox.detect()
    assert status.available and status.kind == "bubblewrap", status.reason


def test_without_a_sandbox_rules_never_auto_allow(no_sandbox: None) -> None:
    assert not sandbox.detect().available
    v = check_command("ls -la", [Rule("prefix", "ls"), Rule("exact", "ls -la")], sandboxed=False)
    assert not v.allowed and "no OS sandbox" in v.reason and v.prefix == "ls"


def test_without_a_sandbox_the_agent_asks_and_says_so(no_sandbox: None, worker, fake, project, store) -> None:
    store.add_rule(str(project.resolve()), "prefix", "ls")
    approver = Approver(ev.Decision.once())
    events = asyncio.run(collect(make_session(worker, project, store, approver), "/shell ls"))
    (proposal,) = of(events, ev.Proposal)
    assert not proposal.allowed_by_rule and not proposal.sandboxed and len(approver.asked) == 1
    assert proposal.sandbox.startswith("NOT sandboxed: disabled by FLASHCODE_NO_SANDBOX")
    assert of(events, ev.ActionExit)[0].exit_code == 0  # approved once, it runs (unsandboxed)


def test_a_rule_allowed_command_runs_in_the_sandbox(worker, fake, project, store, tmp_path: Path) -> None:
    store.add_rule(str(project.resolve()), "prefix", "cat")
    events = asyncio.run(collect(make_session(worker, project, store, None), "/shell cat /proc/1/comm"))
    (proposal,) = of(events, ev.Proposal)
    assert proposal.allowed_by_rule and proposal.sandboxed and "network off" in proposal.sandbox
    out = "".join(e.text for e in of(events, ev.ActionOutput))
    assert (
        of(events, ev.ActionExit)[0].exit_code == 0 and out.strip() == "bwrap"
    )  # PID 1 of its own namespace


def test_command_env_drops_secrets_and_relative_path_entries(tmp_path: Path) -> None:
    env = {
        "PATH": f".:bin::/usr/bin:{tmp_path}/bin:/bin",
        "OPENAI_API_KEY": "sk-1",
        "HOME": "/h",
        "LC_ALL": "C",
    }
    out = sandbox.command_env(env, project_dir=tmp_path)
    assert out["PATH"] == "/usr/bin:/bin" and "OPENAI_API_KEY" not in out
    assert out["HOME"] == "/h" and out["LC_ALL"] == "C" and out["PAGER"] == "cat"


def test_sandboxed_run_sees_no_secret_env_and_writes_only_in_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    project = tmp_path / "p"
    project.mkdir()
    run = CommandRun(
        "env; touch ok; touch /usr/x 2>&1; echo done", project, sandbox=sandbox.SandboxPolicy(project)
    )

    async def go() -> list:
        return [item async for item in run.stream()]

    items = asyncio.run(go())
    text = run.transcript()
    assert "sk-secret" not in text and "done" in text and "Read-only file system" in text
    assert (project / "ok").exists() and items[-1].exit_code == 0


def test_seatbelt_profile_limits_writes_secrets_and_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    project = tmp_path / 'we"ird'
    project.mkdir()
    text = sandbox.seatbelt_profile(sandbox.SandboxPolicy(project), "/private/tmp/x")
    assert "(deny file-write*)" in text and '(subpath "/private/tmp/x")' in text
    assert f'(subpath "{tmp_path}/we\\"ird")' in text  # quoted, not broken out of
    assert f'(subpath "{tmp_path}/.ssh")' in text and '(deny network* (remote ip "*:*"))' in text
    assert f'(deny file-write* (subpath "{tmp_path}/we\\"ird/.git"))' in text
    assert "(deny network-outbound (remote unix-socket))" in text
    on = sandbox.seatbelt_profile(sandbox.SandboxPolicy(project, network=True))
    assert '(remote ip "*:*")' not in on  # the network is on...
    assert '(deny network-outbound (remote ip "localhost:*"))' in on  # ...but not this machine's loopback


def test_a_git_created_by_a_command_is_flagged_and_an_existing_one_is_read_only(
    worker, fake, project, store
) -> None:
    approver = Approver(ev.Decision.once(), ev.Decision.once())
    session = make_session(worker, project, store, approver)
    events = asyncio.run(collect(session, "/shell git init -q"))
    assert any("created .git" in n.text for n in of(events, ev.Notice))
    events = asyncio.run(collect(session, "/shell touch .git/hooks/post-commit"))
    assert of(events, ev.ActionExit)[0].exit_code != 0 and not (project / ".git/hooks/post-commit").exists()
    assert not any("created .git" in n.text for n in of(events, ev.Notice))


def test_a_git_dir_planted_without_the_name_is_flagged_and_an_existing_one_is_read_only(
    worker, fake, project, store
) -> None:
    """A command can make any folder a repository to git (HEAD beside objects/ and refs/): the transcript
    warns, as for a new .git; once there, the sandbox keeps it read-only, as it does .git."""
    import subprocess

    approver = Approver(ev.Decision.once(), ev.Decision.once(), ev.Decision.once())
    session = make_session(worker, project, store, approver)
    plant = "mkdir -p src/objects src/refs && echo 'ref: refs/heads/main' > src/HEAD && touch src/config"
    events = asyncio.run(collect(session, f"/shell {plant}"))
    assert of(events, ev.ActionExit)[0].exit_code == 0
    warned = [n.text for n in of(events, ev.Notice) if "into a git directory" in n.text]
    assert len(warned) == 1 and "made src into a git directory" in warned[0]
    assert not any("created .git" in n.text for n in of(events, ev.Notice))
    config = '[core]\n\trepositoryformatversion = 0\n\tworktree = ..\n\tfsmonitor = "touch pwned; false"\n'
    events = asyncio.run(collect(session, f"/shell printf '{config}' > src/config"))
    assert of(events, ev.ActionExit)[0].exit_code != 0 and (project / "src" / "config").read_text() == ""
    git = subprocess.run(["git", "status"], cwd=project / "src", capture_output=True, text=True)
    assert "work tree" in git.stderr and not (project / "pwned").exists()  # a repository to git, a bare one
    events = asyncio.run(collect(session, "/shell echo fine > notes.txt"))  # the rest stays writable
    assert of(events, ev.ActionExit)[0].exit_code == 0
    assert not [n for n in of(events, ev.Notice) if "git" in n.text]


def test_the_walk_for_git_dirs_follows_no_link_and_stops_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for d in ("a/objects", "a/refs", "b/c/refs"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "a" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "b" / "c" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    found, whole = sandbox.planted_git_dirs(tmp_path)
    assert found == [tmp_path / "a", tmp_path / "b" / "c"] and whole
    assert sandbox.makes_git_dir(tmp_path, tmp_path / "d" / "objects" / "x") is None
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "HEAD").write_text("")
    assert sandbox.makes_git_dir(tmp_path, tmp_path / "d" / "objects" / "x") == tmp_path / "d"
    monkeypatch.setattr(sandbox, "SCAN_FOLDERS", 2)
    assert sandbox.planted_git_dirs(tmp_path)[1] is False


def test_the_walks_for_git_dirs_run_off_the_event_loop(
    worker, fake, project, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command walks the project for git directories three times (before, for the sandbox's mounts, after):
    in a big project that took seconds on the event loop, and every other window waited. Slowed here, the loop
    still ticks while they run."""
    import time

    slow = sandbox.scan_project

    def scan(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.4)
        return slow(*args, **kwargs)

    monkeypatch.setattr(sandbox, "scan_project", scan)
    session = make_session(worker, project, store, Approver(ev.Decision.once()))

    async def go() -> tuple[list, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        events = await collect(session, "/shell echo hi")
        ticker.cancel()
        return events, ticks

    events, ticks = asyncio.run(go())
    assert of(events, ev.ActionExit)[0].exit_code == 0
    assert ticks >= 30, ticks  # 1.2 s of walks; on the loop they allowed a tick or two


def test_the_probe_walks_an_empty_folder_of_its_own_not_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    """(review) The probe ran `true` with /tmp as the project: every git directory in /tmp became a mount, and a
    /tmp holding a thousand clones failed the probe ("Exceeded maximum number of arguments"): no sandbox."""
    walked: list[Path] = []
    real = sandbox.scan_project

    def scan(project, skip=()):  # type: ignore[no-untyped-def]
        walked.append(Path(project))
        return real(project, skip)

    monkeypatch.setattr(sandbox, "scan_project", scan)
    sandbox.detect.cache_clear()
    try:
        assert sandbox.detect().available
    finally:
        sandbox.detect.cache_clear()
    assert walked and all(p.name.startswith("flashcode-probe-") and not p.exists() for p in walked), walked


def test_asking_bubblewrap_for_bind_fd_is_asked_again_after_a_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(review) One slow `bwrap --help` on a busy machine turned the descriptors off for the process's life."""
    import subprocess

    calls: list[list[str]] = []
    real = subprocess.run

    def slow_once(argv, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(argv)
        if len(calls) == 1:
            raise subprocess.TimeoutExpired(argv, 1)
        return real(argv, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "run", slow_once)
    monkeypatch.setattr(sandbox, "_BINDS_FROM_FDS", {})
    bwrap = sandbox.system_program("bwrap") or "/usr/bin/bwrap"
    assert sandbox._binds_from_fds(bwrap) is False  # no answer: by name this once
    assert sandbox._binds_from_fds(bwrap) is True and sandbox._binds_from_fds(bwrap) is True
    assert len(calls) == 2  # asked again once, then kept


def test_a_folder_named_outside_the_checked_project_is_refused_as_moved(tmp_path: Path) -> None:
    """(review) A project swapped for a link after its check was named again by its path: `relative_to` raised a
    ValueError the runner did not catch (it failed closed, with a traceback for the model)."""
    import os

    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    folders = sandbox._FolderFds(tmp_path, root)
    try:
        with pytest.raises(sandbox.ProjectMovedError, match="changed while the command was being set up"):
            folders.open(tmp_path.parent / "elsewhere")
    finally:
        folders.close()


def test_a_workspace_of_many_repositories_runs_and_a_low_file_limit_is_said(tmp_path: Path) -> None:
    """(review) Each folder mounted writable (one above each nested repository) is held open until bubblewrap
    mounted it: past the soft limit on open files every command failed, said as "changed while the command was
    being set up". The soft limit is raised to the hard one; when the hard one is too low, it is said."""
    import subprocess
    import sys

    for i in range(40):
        for d in ("objects", "refs"):
            (tmp_path / f"r{i}" / ".git" / d).mkdir(parents=True)
        (tmp_path / f"r{i}" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    script = """
import resource, subprocess, sys
from pathlib import Path
soft, hard = (int(x) for x in sys.argv[2:4])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from webapp.agent import sandbox
try:
    with sandbox.launch(["sh", "-c", "touch r7/made"], sandbox.SandboxPolicy(Path(sys.argv[1]))) as (argv, fds):
        done = subprocess.run(argv, env=sandbox.command_env(), pass_fds=fds)
    print("rc", done.returncode, "soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except sandbox.SandboxUnavailableError as exc:
    print("refused", exc)
"""
    root = Path(__file__).resolve().parent.parent

    def run(soft: int, hard: int) -> str:
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path), str(soft), str(hard)],
            capture_output=True, text=True, timeout=120, cwd=root,
        )  # fmt: skip
        return done.stdout.strip() + done.stderr[-400:]

    assert run(30, 4096) == "rc 0 soft 4096" and (tmp_path / "r7" / "made").exists()
    said = run(30, 30)
    assert said.startswith("refused") and "may open no more files" in said and "ulimit -n" in said, said


def test_private_tmp_note_names_the_tmp_paths_a_command_gives() -> None:
    """Read off the command's text: a path in /tmp as an argument, an option's value or a redirection's target;
    not /tmpx nor x/tmp/y; and only under bubblewrap (whose /tmp is the command's own)."""
    from webapp.agent.sandbox import SandboxStatus, private_tmp_note

    bwrap = SandboxStatus(True, "bubblewrap", "")
    named = {
        "touch /tmp/a": "/tmp/a",
        "echo hi >/tmp/b.txt && ls": "/tmp/b.txt",
        "gcc --out=/tmp/c.o x.c": "/tmp/c.o",
        "cp x /tmp/": "/tmp",
        "python3 -c \"open('/tmp/d', 'w')\"": "/tmp/d",
        "touch /tmp/1 /tmp/2 /tmp/3 /tmp/4": "/tmp/1, /tmp/2, /tmp/3 and 1 more",
    }
    for command, shown in named.items():
        note = private_tmp_note(bwrap, command)
        assert note is not None and note.startswith(f"The command named {shown}: in the sandbox"), (
            command,
            note,
        )
    for command in ("ls /tmpx", "cat x/tmp/y", "echo hi 2>/dev/null", "touch made.txt"):
        assert private_tmp_note(bwrap, command) is None, command
    assert private_tmp_note(SandboxStatus(True, "sandbox-exec", ""), "touch /tmp/a") is None
    assert private_tmp_note(SandboxStatus(False, "none", "no bwrap"), "touch /tmp/a") is None


def test_git_run_paths_reads_hooks_path_and_includes_as_git_does(tmp_path: Path) -> None:
    """`core.hooksPath` from the work tree's top, `include.path` and `includeIf.*.path` from the config's folder,
    nested includes followed, keys in any case, quoted values and comments read as git reads them; only paths
    that exist inside the project count."""
    project = tmp_path / "p"
    (project / ".git").mkdir(parents=True)
    for d in (".husky/_", "conf", "tools/hooks"):
        (project / d).mkdir(parents=True)
    (project / "conf" / "team.cfg").write_text(
        '[includeIf "onbranch:main"]\n\tpath = ../conf/more.cfg ; why\n'
    )
    (project / "conf" / "more.cfg").write_text("[core]\nHooksPath = tools/hooks\n")
    (project / ".git" / "config").write_text(
        "[core]\n\trepositoryformatversion = 0\n"
        '\thooksPath = ".husky/_" # husky 9\n'
        "[include]\n\tpath = ../conf/team.cfg\n"
        "\tpath = ../missing.cfg\n"
        "[INCLUDE] path = /etc/gitconfig\n"  # outside the project: not the project's to protect
        '[remote "origin"]\n\tpath = conf\n'  # another section's key of that name: not an include
    )
    found = sandbox.git_run_paths(project)
    real = project.resolve()
    assert sorted(found) == sorted(
        [real / ".husky/_", real / "conf/team.cfg", real / "conf/more.cfg", real / "tools/hooks"]
    )
    # what is not there yet counts where a write is asked about (existing=False), not for mounts
    assert real / "missing.cfg" in sandbox.git_run_paths(project, existing=False)
    # a cycle of includes ends
    (project / "conf" / "more.cfg").write_text("[include]\n\tpath = team.cfg\n")
    assert real / "conf/team.cfg" in sandbox.git_run_paths(project)
    assert sandbox.git_run_paths(tmp_path / "no-repo") == []
    # a value continued on the next line is one value, as git reads it (a review)
    (project / ".git" / "config").write_text("[core]\n\thooksPath = .hu\\\nsky/_\n")
    assert sandbox.git_run_paths(project) == [real / ".husky/_"]


def _git(*args: str | Path) -> str:
    import subprocess

    done = subprocess.run(["git", *map(str, args)], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def _hooks_of(tree: Path) -> Path:
    """Where git itself runs `tree`'s hooks from: the oracle the reader is checked against."""
    return Path(_git("-C", tree, "rev-parse", "--path-format=absolute", "--git-path", "hooks")).resolve()


def test_git_run_paths_reads_a_worktree_a_submodule_and_husky_9_as_git_does(tmp_path: Path) -> None:
    """A review: a linked worktree (its config in the main repository's .git, outside the project) and a
    submodule (its git directory in .git/modules, its hooksPath from its own folder) were not read, and
    husky 9's `.husky/_` stubs run `.husky/<hook>`. Each is found where git runs hooks from."""
    main = tmp_path / "main"
    _git("init", "-q", main)
    _git("-C", main, "-c", "user.email=u@x", "-c", "user.name=u", "commit", "-q", "--allow-empty", "-m", "0")
    _git("-C", main, "config", "core.hooksPath", ".husky")
    wt = tmp_path / "wt"
    _git("-C", main, "worktree", "add", "-q", wt)
    (wt / ".husky").mkdir()
    assert sandbox.git_run_paths(wt) == [_hooks_of(wt)] == [wt.resolve() / ".husky"]

    project = tmp_path / "p"
    _git("init", "-q", project)
    sub = project / "sub"
    # a submodule's layout: its git directory in .git/modules, a `.git` file in its folder naming it
    (project / ".git" / "modules").mkdir()
    _git("init", "-q", f"--separate-git-dir={project / '.git' / 'modules' / 'sub'}", sub)
    _git("-C", sub, "config", "core.hooksPath", ".githooks")
    (sub / ".githooks").mkdir()
    scan = sandbox.scan_project(project)
    assert scan.work_trees == [sub.resolve()]
    assert sandbox.git_run_paths(project, [project, *scan.work_trees]) == [_hooks_of(sub)]
    assert sandbox.work_trees_at(project, sub / ".githooks" / "pre-commit") == [
        project.resolve(),
        sub.resolve(),
    ]

    husky = tmp_path / "h9"
    _git("init", "-q", husky)
    _git("-C", husky, "config", "core.hooksPath", ".husky/_")
    (husky / ".husky" / "_").mkdir(parents=True)
    (husky / ".husky" / "_" / "h").write_text("#!/usr/bin/env sh\n")  # husky 9's runner
    real = husky.resolve()
    assert (
        sandbox.git_run_paths(husky)
        == [_hooks_of(husky), real / ".husky"]
        == [real / ".husky/_", real / ".husky"]
    )


def test_git_warnings_name_a_hooks_folder_made_or_a_link_swapped(tmp_path: Path) -> None:
    """A hooks folder the config names but that is not there yet cannot be mounted read-only, nor can a link on
    the way to one be kept from being replaced: a command that makes one, or swaps the link for a folder of its
    own, is followed by a warning (as a new .git is)."""
    project = tmp_path / "p"
    _git("init", "-q", project)
    _git("-C", project, "config", "core.hooksPath", ".githooks")
    before = sandbox.git_state(project)
    assert sandbox.git_warnings(project, before) == []
    (project / ".githooks").mkdir()
    (warning,) = sandbox.git_warnings(project, before)
    assert warning.startswith(
        "The command made or changed .githooks, where this repository's config points git"
    )

    (project / "real").mkdir()
    (project / ".githooks").rmdir()
    (project / ".githooks").symlink_to("real")
    before = sandbox.git_state(project)
    (project / ".githooks").unlink()
    (project / ".githooks").mkdir()  # the same name, a folder of the command's own
    (warning,) = sandbox.git_warnings(project, before)
    assert "made or changed .githooks" in warning
