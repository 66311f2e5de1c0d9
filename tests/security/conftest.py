"""Fixtures of the adversarial suite: a scratch project with marker directories beside it, a fake
$HOME holding secrets, and runners that go through the agent's own path (`CommandRun` inside
`SandboxPolicy`).

The scratch tree lives under the real home (`~/.cache/flashcode-sectest-*`), not under /tmp: the
sandbox mounts a private /tmp, so markers there would vanish for the wrong reason. A "control" run
uses a permissive bubblewrap (the scratch tree writable, nothing else) to prove that a probe really
creates its marker when nothing contains it, without touching the host.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from webapp.agent.runner import CommandExit, CommandRun
from webapp.agent.sandbox import SandboxPolicy, command_env

REAL_HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)
SECRET = f"FLASHCODE-SECRET-{uuid.uuid4().hex}"
HOOK = "printf '#!/bin/sh\\ntouch {out}/pwned\\n' > {hooks}/post-commit && chmod +x {hooks}/post-commit"


def _python() -> str:
    """A Python for probes: this one, unless it lives under /tmp (a checkout there): sandboxed commands
    get a private /tmp and could not run it, so the control runs would prove nothing."""
    import shutil
    import sys

    if not sys.executable.startswith("/tmp/"):
        return sys.executable
    return shutil.which("python3", path="/usr/local/bin:/usr/bin") or sys.executable


@dataclass
class Ran:
    exit_code: int | None
    output: str
    timed_out: bool = False
    error: str | None = None


@dataclass
class Scratch:
    base: Path
    project: Path  # the sandboxed project
    control: Path  # a copy the permissive control run works in
    outside: Path  # beside the project: must stay untouched
    home: Path  # the fake $HOME, with secrets
    tmp_outside: Path  # under /tmp (pytest's tmp_path)
    tag: str  # unique name part for markers in shared places (/dev/shm, /var/tmp, /tmp)
    extra: list[Path] = field(default_factory=list)  # marker paths in shared places

    @property
    def victim(self) -> Path:
        return self.outside / "victim.txt"

    def subst(self, command: str) -> str:

        for key, value in {
            "{out}": str(self.outside),
            "{tmpout}": str(self.tmp_outside),
            "{py}": _python(),
            "{shm}": f"/dev/shm/{self.tag}-pwned",
            "{vartmp}": f"/var/tmp/{self.tag}-pwned",
            "{tmpfile}": f"/tmp/{self.tag}-pwned",
            "{hooks}": ".git/hooks",
        }.items():
            command = command.replace(key, value)
        return command

    def breaches(self) -> list[str]:
        """What a probe changed outside the project: new files beside it, the victim, shared places."""
        found = [
            str(p) for d in (self.outside, self.tmp_outside) for p in d.rglob("*") if p.name != "victim.txt"
        ]
        if self.victim.read_text() != "victim\n":
            found.append(f"{self.victim} was modified")
        found += [str(p) for p in self.extra if os.path.lexists(p)]
        return found

    def clean(self) -> None:
        for d in (self.outside, self.tmp_outside):
            shutil.rmtree(d)
            d.mkdir()
        self.victim.write_text("victim\n")
        for p in self.extra:
            if os.path.lexists(p):
                os.unlink(p)


def make_project(path: Path) -> None:
    (path / "src").mkdir(parents=True)
    (path / "README.md").write_text("hello\n")
    (path / "src" / "app.py").write_text("def main():\n    return 'hello'\n")
    git(path, "init", "-q", ".")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The user's own git, later, outside the sandbox (hooks a command planted would run here)."""
    argv = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scratch]:
    tag = f"flashcode-sectest-{uuid.uuid4().hex[:12]}"
    (REAL_HOME / ".cache").mkdir(exist_ok=True)
    base = REAL_HOME / ".cache" / tag
    s = Scratch(
        base=base,
        project=base / "project",
        control=base / "control",
        outside=base / "outside",
        home=base / "home",
        tmp_outside=tmp_path / "outside",
        tag=tag,
        extra=[Path(f"/dev/shm/{tag}-pwned"), Path(f"/var/tmp/{tag}-pwned"), Path(f"/tmp/{tag}-pwned")],
    )
    try:
        for d in (s.outside, s.home, s.tmp_outside):
            d.mkdir(parents=True)
        s.victim.write_text("victim\n")
        make_project(s.project)
        shutil.copytree(s.project, s.control, symlinks=True)
        monkeypatch.setenv("HOME", str(s.home))  # sandbox.py reads $HOME when it builds the argv
        yield s
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for p in s.extra:
            if os.path.lexists(p):
                os.unlink(p)


def run_command(
    command: str,
    project: Path,
    *,
    network: bool = False,
    timeout_s: float = 20.0,
    policy: SandboxPolicy | None = None,
    sandboxed: bool = True,
) -> Ran:
    """Run `command` the way the agent does: `CommandRun` inside the sandbox (or none if not `sandboxed`)."""
    if sandboxed and policy is None:
        policy = SandboxPolicy(project, network=network)

    async def go() -> Ran:
        run = CommandRun(command, project, timeout_s=timeout_s, sandbox=policy if sandboxed else None)
        done: CommandExit | None = None
        async for item in run.stream():
            if item.type == "exit":
                done = item  # type: ignore[assignment]
        assert done is not None
        return Ran(done.exit_code, run.transcript(), done.timed_out, done.error)

    return asyncio.run(go())


def run_control(command: str, s: Scratch, cwd: Path | None = None) -> Ran:
    """`command` under a permissive bubblewrap: the scratch tree writable, the host untouched."""
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    argv += ["--bind", str(s.base), str(s.base), "--bind", str(s.tmp_outside), str(s.tmp_outside)]
    argv += [
        "--unshare-pid",
        "--die-with-parent",
        "--chdir",
        str(cwd or s.control),
        "--",
        "bash",
        "-c",
        command,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=command_env())
    return Ran(done.returncode, done.stdout + done.stderr)
