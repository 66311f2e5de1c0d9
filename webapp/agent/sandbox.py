"""The OS sandbox around every shell command: bubblewrap on Linux, `sandbox-exec` on macOS.

The policy (`shell.py`) decides when to ask; this module decides what a command can do if the
policy, the user or the model was wrong. `wrap(argv, policy)` returns the argv that runs `argv`
inside the sandbox; `detect()` says whether one is available here, and why not.

What is covered (Linux, bubblewrap)
- Writes only in the project directory and a private, empty `/tmp` that vanishes with the command;
  the rest of the filesystem is mounted read-only. `.git/hooks` and `.git/config` of the project stay
  read-only too (a hook planted there would run later, outside the sandbox, on the user's `git commit`).
- Secrets are hidden: `~/.ssh`, `~/.aws`, `~/.gnupg`, `~/.config/gh`, `~/.docker`, `~/.kube`,
  `~/.netrc`, keyrings, … and flashcode's own data directory (its database holds the allow rules).
- No network (a fresh network namespace with only a loopback of its own) unless the project allows it.
- New PID, IPC, UTS and cgroup namespaces, no capabilities (root included), a new session (no
  terminal injection), killed with its parent, and a clean environment (PATH, HOME, LANG, locale and
  TERM only: API keys in the server's environment do not reach commands).

What is covered (macOS, sandbox-exec): the same write, secret and network rules as a Seatbelt
profile; no namespaces. Written from Apple's profile language; not exercised by this machine's tests.

What is not covered
- Reads of anything else the user can read (source trees, `/etc`): the sandbox keeps secrets and
  writes in, it is not a read jail.
- CPU, memory and disk use (the runner's timeout stops runaway commands; nothing caps disk writes
  inside the project).
- With the project's network switch on, whatever the command sends.
- Kernel bugs, and programs outside the sandbox that later act on files the command wrote in the
  project (a Makefile it edited runs unsandboxed when the user types `make` in a terminal).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SandboxKind = Literal["bubblewrap", "sandbox-exec", "none"]

# Paths under $HOME that commands never see (hidden whole, whether file or directory).
SECRET_PATHS = (
    ".ssh", ".aws", ".azure", ".gnupg", ".docker", ".kube", ".netrc", ".git-credentials", ".npmrc",
    ".pypirc", ".password-store", ".config/gh", ".config/gcloud", ".config/hub", ".config/op",
    ".local/share/keyrings", ".mozilla", ".config/google-chrome", ".config/chromium", "Library/Keychains",
    ".bash_history", ".zsh_history", ".python_history",
)  # fmt: skip
# Environment variables a command keeps; everything else (API keys, tokens) is dropped.
KEEP_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ")
COMMAND_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb", "TMPDIR": "/tmp"}


@dataclass(frozen=True)
class SandboxPolicy:
    """What one command may touch: its project directory (read-write) and, if allowed, the network."""

    project_dir: Path
    network: bool = False
    hidden: tuple[Path, ...] = ()  # more paths to hide (flashcode's data directory)

    def describe(self) -> str:
        net = "network on" if self.network else "network off"
        return f"sandboxed: writes only in {self.project_dir}, {net}"


@dataclass(frozen=True)
class SandboxStatus:
    available: bool
    kind: SandboxKind
    reason: str  # how commands are contained, or why they cannot be

    def describe(self, policy: SandboxPolicy) -> str:
        return policy.describe() if self.available else f"NOT sandboxed: {self.reason}"


def command_env(env: dict[str, str] | None = None, project_dir: Path | None = None) -> dict[str, str]:
    """The environment a command gets: the few variables in KEEP_ENV (and LC_*), plus COMMAND_ENV.

    PATH keeps only absolute directories outside the project, so a program the command (or the
    agent) wrote into the project never shadows the one a rule names."""
    env = dict(os.environ if env is None else env)
    kept = {k: v for k, v in env.items() if k in KEEP_ENV or k.startswith("LC_")}
    project = Path(project_dir).resolve() if project_dir is not None else None
    path = [
        d
        for d in kept.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
        if os.path.isabs(d) and (project is None or not Path(d).resolve().is_relative_to(project))
    ]
    kept["PATH"] = os.pathsep.join(path) or "/usr/bin:/bin"
    return {**kept, **COMMAND_ENV}


@functools.cache
def detect() -> SandboxStatus:
    """Which sandbox this machine has, checked by running `true` inside it once per process."""
    if os.environ.get("FLASHCODE_NO_SANDBOX") == "1":  # for tests of the no-sandbox path
        return SandboxStatus(False, "none", "disabled by FLASHCODE_NO_SANDBOX=1")
    system = platform.system()
    if system == "Darwin":
        exe = shutil.which("sandbox-exec")
        if not exe:
            return SandboxStatus(False, "none", "sandbox-exec was not found (it ships with macOS)")
        return _probe("sandbox-exec", _seatbelt_argv(["/usr/bin/true"], SandboxPolicy(Path("/tmp"))))
    if system != "Linux":
        return SandboxStatus(False, "none", f"no sandbox is implemented for {system}")
    if not shutil.which("bwrap"):
        return SandboxStatus(
            False, "none", "bubblewrap is not installed (Debian/Ubuntu: `sudo apt-get install bubblewrap`)"
        )
    return _probe("bubblewrap", _bwrap_argv(["true"], SandboxPolicy(Path("/tmp"))))


def _probe(kind: SandboxKind, argv: list[str]) -> SandboxStatus:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=command_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SandboxStatus(False, "none", f"{kind} could not start: {exc}")
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return SandboxStatus(False, "none", f"{kind} does not work here: {detail[0]}")
    return SandboxStatus(
        True, kind, f"{kind}: writes only in the project, secrets hidden, network per project"
    )


def wrap(argv: list[str], policy: SandboxPolicy, tmp_dir: Path | None = None) -> list[str]:
    """`argv` run inside the sandbox this machine has. Raises `SandboxUnavailableError` if none.

    `tmp_dir` is the command's private temp directory on macOS (Linux mounts an empty one itself)."""
    status = detect()
    if not status.available:
        raise SandboxUnavailableError(status.reason)
    if status.kind == "sandbox-exec":
        return _seatbelt_argv(argv, policy, tmp_dir or Path("/private/tmp"))
    return _bwrap_argv(argv, policy)


class SandboxUnavailableError(RuntimeError):
    pass


def _secret_paths(policy: SandboxPolicy) -> list[Path]:
    home = Path(os.environ.get("HOME") or Path.home())
    paths = [home / p for p in SECRET_PATHS] + [Path(p) for p in policy.hidden]
    return [p for p in paths if os.path.lexists(p)]


def _bwrap_argv(argv: list[str], policy: SandboxPolicy) -> list[str]:
    project = Path(policy.project_dir).resolve()
    args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for secret in _secret_paths(policy):
        real = secret.resolve()
        if project == real or real in project.parents:
            continue  # the project itself lives inside it (the scratch project in the data directory)
        if real.is_dir():
            args += ["--tmpfs", str(real)]
        else:
            args += ["--ro-bind", "/dev/null", str(real)]
    args += ["--bind", str(project), str(project)]
    for keep in (project / ".git" / "hooks", project / ".git" / "config"):
        if keep.exists() and not keep.is_symlink():
            args += ["--ro-bind", str(keep), str(keep)]
    args += ["--unshare-user-try", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    if not policy.network:
        args.append("--unshare-net")
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--chdir", str(project)]
    return [*args, "--", *argv]


def _seatbelt_quote(path: Path | str) -> str:
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


def seatbelt_profile(policy: SandboxPolicy, tmp_dir: Path | str = "/private/tmp") -> str:
    """The macOS Seatbelt profile: writes in the project and the temp dir, secrets and network denied."""
    project = Path(policy.project_dir).resolve()
    lines = [
        "(version 1)",
        "(allow default)",
        "(deny file-write*)",
        f"(allow file-write* (subpath {_seatbelt_quote(project)}) (subpath {_seatbelt_quote(tmp_dir)})",
        '  (literal "/dev/null") (literal "/dev/zero") (literal "/dev/dtracehelper") (regex #"^/dev/fd/"))',
        f"(deny file-write* (subpath {_seatbelt_quote(project / '.git' / 'hooks')})"
        f" (literal {_seatbelt_quote(project / '.git' / 'config')}))",
    ]
    secrets = [s for s in _secret_paths(policy) if s.resolve() not in (project, *project.parents)]
    if secrets:
        lines.append(
            "(deny file-read* file-write* "
            + " ".join(f"(subpath {_seatbelt_quote(s)})" for s in secrets)
            + ")"
        )
    if not policy.network:
        lines.append('(deny network* (remote ip "*:*"))')
        lines.append('(allow network* (remote unix-socket (path-literal "/private/var/run/mDNSResponder")))')
    return "\n".join(lines)


def _seatbelt_argv(argv: list[str], policy: SandboxPolicy, tmp_dir: Path = Path("/private/tmp")) -> list[str]:
    return ["sandbox-exec", "-p", seatbelt_profile(policy, tmp_dir), *argv]
