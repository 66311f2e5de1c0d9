"""The OS sandbox around every shell command: bubblewrap on Linux, `sandbox-exec` on macOS.

The policy (`shell.py`) decides when to ask; this module decides what a command can do if the
policy, the user or the model was wrong. `launch(argv, policy)` gives the argv (and the descriptors
to pass) that run `argv` inside the sandbox; `detect()` says whether one is available here, and why not.

What is covered (Linux, bubblewrap)
- Writes only in the project directory and a private, empty `/tmp` that vanishes with the command;
  the rest of the filesystem is mounted read-only. The writable folders are mounted from descriptors
  opened as they were checked (`--bind-fd`, bubblewrap 0.7 on), not looked up by name again. The
  project's `.git` is read-only as a whole (a hook or `commondir` planted there would run later, outside
  the sandbox, on the user's `git commit`; a read-only mount also cannot be renamed away), so git
  commands that write refuse inside the sandbox.
- Kernel knobs stay read-only even for root: `/proc/sys`, `/proc/sysrq-trigger`, `/proc/irq`, ...
- A seccomp filter refuses unix-domain sockets (a socket file outside the project — the session bus,
  docker.sock, a database — could act for the command outside the sandbox), io_uring (which makes
  sockets the filter would not see) and the kernel keyrings.
- Secrets are hidden: `~/.ssh`, `~/.aws`, `~/.gnupg`, `~/.config/gh`, `~/.docker`, `~/.kube`,
  `~/.netrc`, cargo, git, Hugging Face and Claude credentials, keyrings, … and flashcode's own data
  directory (its database holds the allow rules).
- No network (a fresh network namespace with only a loopback of its own) unless the project allows it;
  then still a namespace of its own, connected to the outside by slirp4netns without this machine's
  loopback (`usernet.py`): flashcode's own port, which needs no token on loopback, stays out of reach.
- New PID, IPC, UTS and cgroup namespaces, no capabilities (root included), a new session (no
  terminal injection), killed with its parent, and a clean environment (PATH, HOME, LANG, locale and
  TERM only: API keys in the server's environment do not reach commands).

What is covered (macOS, sandbox-exec): the same write, secret and network rules as a Seatbelt
profile; no namespaces. Written from Apple's profile language; not exercised by this machine's tests.

What is not covered
- Reads of anything else the user can read (source trees, `/etc`): the sandbox keeps secrets and
  writes in, it is not a read jail.
- A hard link that already exists in the project and points outside it (commands cannot make new ones
  across the mount), and a git directory a command creates (read-only from the next command on; the agent
  warns). Folders git would take for a repository with no `.git` in their names (`planted_git_dirs`) and
  nested `sub/.git` are read-only like `.git`, when a walk of at most `SCAN_FOLDERS` folders finds them.
- The seccomp filter on CPUs other than x86-64 and arm64 (there bubblewrap runs without it).
- CPU, memory and disk use (the runner's timeout stops runaway commands; nothing caps disk writes
  inside the project).
- With the project's network switch on, whatever the command sends.
- Kernel bugs, and programs outside the sandbox that later act on files the command wrote in the
  project (a Makefile it edited runs unsandboxed when the user types `make` in a terminal).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SandboxKind = Literal["bubblewrap", "sandbox-exec", "none"]

# Paths under $HOME that commands never see (hidden whole, whether file or directory).
SECRET_PATHS = (
    ".ssh",
    ".aws",
    ".azure",
    ".gnupg",
    ".docker",
    ".kube",
    ".netrc",
    ".git-credentials",
    ".npmrc",
    ".yarnrc.yml",  # npmAuthToken
    ".pypirc",
    ".config/pip",  # an index URL with its password
    ".s3cfg",
    ".config/configstore",  # the tokens of npm-installed CLIs (firebase, …)
    ".databrickscfg",
    ".oci",
    ".fly",
    ".config/doctl",
    ".config/hcloud",
    ".config/stripe",
    # shell start-up files: where API keys are exported (commands run with none of the user's environment)
    ".bashrc",
    ".bash_profile",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".config/fish",
    ".password-store",
    ".config/gh",
    ".config/gcloud",
    ".config/hub",
    ".config/op",
    ".local/share/keyrings",
    # browsers' profiles (cookies, saved passwords): deb, snap and Flatpak installs
    ".mozilla",
    ".config/google-chrome",
    ".config/chromium",
    ".config/BraveSoftware",
    ".config/microsoft-edge",
    ".config/vivaldi",
    ".config/opera",
    "snap/firefox",
    "snap/chromium",
    ".var/app",
    "Library/Application Support/Google/Chrome",
    "Library/Application Support/Firefox",
    "Library/Cookies",
    "Library/Keychains",
    ".bash_history",
    ".zsh_history",
    ".python_history",
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".m2/settings.xml",
    ".gem/credentials",
    ".config/git/credentials",
    ".config/containers/auth.json",
    ".config/rclone",
    ".cache/huggingface/token",
    ".cache/huggingface/stored_tokens",  # huggingface_hub >= 0.25 keeps every saved token here
    ".huggingface/token",
    ".terraform.d/credentials.tfrc.json",
    ".vault-token",
    ".pgpass",
    ".my.cnf",
    ".claude",
    ".claude.json",
    ".codex",
    ".config/anthropic",
    ".config/openai",
    # more a review named: tokens of CLIs and model tools, fish's history
    ".local/share/fish/fish_history",
    ".kaggle",
    ".config/github-copilot",
    ".config/glab-cli",
    ".pulumi",
    ".minikube",
    ".local/share/io.datasette.llm",
    ".gemini",
    ".ollama/id_ed25519",
)
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
        return f"sandboxed: writes only in {self.project_dir} and a private /tmp emptied after, {net}"


@dataclass(frozen=True)
class SandboxStatus:
    available: bool
    kind: SandboxKind
    reason: str  # how commands are contained, or why they cannot be
    settled: bool = True  # False: the probe ran out of time; ask again rather than keep this answer

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


# Where flashcode looks for the programs it runs itself, outside the sandbox: the system's folders, never
# the server's PATH, which may hold a project's folder (a server started from a virtual environment in a
# project has its bin first) — a program a sandboxed command wrote there would run unsandboxed next time.
SYSTEM_DIRS = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/opt/homebrew/bin",
)


def system_program(name: str, project_dir: Path | str | None = None) -> str | None:
    """`name` as flashcode itself runs it outside the sandbox (bubblewrap, the shell, slirp4netns,
    ripgrep): from SYSTEM_DIRS only, and never a file that resolves into the project."""
    project = Path(project_dir).resolve() if project_dir is not None else None
    dirs = [d for d in SYSTEM_DIRS if project is None or not Path(d).resolve().is_relative_to(project)]
    found = shutil.which(name, path=os.pathsep.join(dirs))
    if found and project is not None and Path(found).resolve().is_relative_to(project):
        return None
    return found


def own_paths() -> list[Path]:
    """What flashcode runs outside the sandbox from its own install: the Python environment (its
    interpreter and site-packages, `.pth` files included), flashcode's source, templates and scripts. Inside a project they
    are kept read-only for commands (`_bwrap_argv`), and the file tools do not write there."""
    here = Path(__file__).resolve().parents[2]  # the checkout or the installed package's root
    roots = {
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
        Path(sys.executable).resolve().parent,
    }
    if (here / "webapp").is_dir() and (here / "engine").is_dir():
        roots.add(here / "webapp")
        roots.add(here / "engine")
        # the templates (Jinja2 code, reloaded when they change) and the page's scripts, where a checkout
        # keeps them (render.find_dir): a change there runs in the server or as the page's own script
        roots.update(d for name in ("templates", "static") if (d := here / name).is_dir())
    return sorted(roots)


PROBE_TIMEOUT_S = 60.0  # a loaded machine can take seconds to start bubblewrap: slow is not absent


def detect() -> SandboxStatus:
    """Which sandbox this machine has, checked by running `true` inside it once per process. A probe
    that did not finish in time is no verdict (a busy machine): that command is not sandboxed and
    asks, and the next one probes again, instead of every command of the process asking for good."""
    status = _detect()
    if not status.settled:
        _detect.cache_clear()
    return status


@functools.cache
def _detect() -> SandboxStatus:
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
    if not system_program("bwrap"):
        return SandboxStatus(
            False, "none", "bubblewrap is not installed (Debian/Ubuntu: `sudo apt-get install bubblewrap`)"
        )
    # an empty folder of its own as the project: /tmp itself would be walked, every git directory in it mounted
    # (a /tmp holding a thousand clones made the probe fail: "Exceeded maximum number of arguments")
    with _seccomp_fd() as fd, tempfile.TemporaryDirectory(prefix="flashcode-probe-") as empty:
        argv = _bwrap_argv(["true"], SandboxPolicy(Path(empty)), fd)
        return _probe("bubblewrap", argv, () if fd is None else (fd,))


detect.cache_clear = _detect.cache_clear  # type: ignore[attr-defined]  # tests start over with it


def _probe(kind: SandboxKind, argv: list[str], pass_fds: tuple[int, ...] = ()) -> SandboxStatus:
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=command_env(),
            pass_fds=pass_fds,
        )
    except subprocess.TimeoutExpired:
        return SandboxStatus(
            False,
            "none",
            f"{kind} did not start within {PROBE_TIMEOUT_S:.0f} s (a busy machine?)",
            settled=False,
        )
    except OSError as exc:
        return SandboxStatus(False, "none", f"{kind} could not start: {exc}")
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return SandboxStatus(False, "none", f"{kind} does not work here: {detail[0]}")
    return SandboxStatus(
        True, kind, f"{kind}: writes only in the project, secrets hidden, network per project"
    )


@contextlib.contextmanager
def launch(
    argv: list[str], policy: SandboxPolicy, tmp_dir: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """`(argv, pass_fds)` that run `argv` inside the sandbox this machine has; spawn it inside the
    `with` (the descriptors, e.g. the seccomp program, close after it), with `command_env()`. Raises
    `SandboxUnavailableError` if there is none. `tmp_dir` is the command's private temp directory on
    macOS (Linux mounts an empty one itself). `env`: variables set inside the sandbox only, for the
    command (an MCP server's config): the sandbox's own programs never see them (a `PATH` or `BASH_ENV`
    there would run a program of the project's outside the sandbox), and neither does a command line.
    Where the descriptors cannot be passed as they are, `argv_fds` says where they are named (the folders'
    descriptors, `_FolderFds`, are `O_PATH`: reopen them through /proc, their contents cannot be copied)."""
    status = detect()
    if not status.available:
        raise SandboxUnavailableError(status.reason)
    pinned_project(policy.project_dir)
    if policy.network and status.kind == "bubblewrap" and not system_program("slirp4netns"):
        raise NetworkUnavailableError(NO_SLIRP)
    if status.kind == "sandbox-exec":
        if env:  # set by env(1) inside the profile; then a shell execs the command (a name with = is no assignment)
            pairs = [f"{k}={v}" for k, v in env.items()]
            argv = ["/usr/bin/env", *pairs, "/bin/sh", "-c", 'exec "$@"', "sh", *argv]
        yield _seatbelt_argv(argv, policy, tmp_dir or Path("/private/tmp")), ()
        return
    with _seccomp_fd() as fd, _env_args_fd(env) as env_fd, _folder_fds(policy.project_dir) as folders:
        args = _bwrap_argv(argv, policy, fd, env_fd, folders)
        fds = tuple(f for f in (fd, env_fd) if f is not None) + (folders.fds if folders else ())
        yield args, fds


_BINDS_FROM_FDS: dict[str, bool] = {}


def _binds_from_fds(bwrap: str) -> bool:
    """Whether this bubblewrap mounts a folder from an open descriptor (`--bind-fd`, bubblewrap 0.7 on), asked
    once per program. A run that did not finish in time is no answer (a busy machine): that command binds by
    name, and the next one asks again, rather than the whole process going without the descriptors."""
    if bwrap in _BINDS_FROM_FDS:
        return _BINDS_FROM_FDS[bwrap]
    try:
        done = subprocess.run(
            [bwrap, "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=command_env()
        )
    except subprocess.TimeoutExpired:
        return False
    except OSError:
        done = None
    _BINDS_FROM_FDS[bwrap] = done is not None and "--bind-fd" in done.stdout + done.stderr
    return _BINDS_FROM_FDS[bwrap]


@functools.cache
def raise_open_file_limit() -> tuple[int, int]:
    """The soft limit on open files raised to the hard one (once): each folder a command's sandbox mounts
    writable is held open until bubblewrap has mounted it, and a workspace of a thousand repositories needs a
    thousand (1,024 is a common soft limit; the hard one is usually far higher). Returns the limits now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class _FolderFds:
    """The writable folders of a command's sandbox, opened (`O_PATH`) from the project's folder as it was
    checked, one name at a time without following a symbolic link: bubblewrap mounts what these descriptors
    hold (`--bind-fd`, and it checks that what it mounted is that folder), not what the names lead to when it
    runs. A folder swapped for a link between the check and the mount makes the command fail to start,
    never a mount of where the link leads."""

    def __init__(self, project: Path, root: int) -> None:
        self.project, self.root, self._opened = project, root, {project: root}

    @property
    def fds(self) -> tuple[int, ...]:
        return tuple(self._opened.values())

    def open(self, folder: Path) -> int:
        if folder in self._opened:
            return self._opened[folder]
        if not folder.is_relative_to(self.project):  # named from a path that now leads elsewhere
            raise ProjectMovedError(
                f"the project's folder {self.project} changed while the command was being set up: run it again"
            )
        fd = self.root
        try:
            for part in folder.relative_to(self.project).parts:
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if fd != self.root:
                    os.close(fd)
                fd = nxt
        except OSError as exc:
            if fd != self.root:
                os.close(fd)
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise SandboxUnavailableError(
                    f"the sandbox mounts {len(self._opened) + 1}+ folders of this project (one above each git "
                    f"directory in it) and flashcode may open no more files ({exc.strerror}): raise the limit "
                    "(`ulimit -n` in the shell that starts flashcode) or open a smaller folder as the project"
                ) from None
            raise SandboxUnavailableError(
                f"{folder} changed while the command was being set up ({exc.strerror or exc}): run it again"
            ) from None
        self._opened[folder] = fd
        return fd

    def close(self) -> None:
        for fd in self._opened.values():
            os.close(fd)
        self._opened.clear()


@contextlib.contextmanager
def _folder_fds(project_dir: Path) -> Iterator[_FolderFds | None]:
    """`_FolderFds` for the project, or None where this bubblewrap binds by name only (before 0.7: then the
    folder is checked just before, `pinned_project`, and a swap in between is a race that is not covered)."""
    bwrap = system_program("bwrap", project_dir) or "/usr/bin/bwrap"
    if not _binds_from_fds(bwrap):
        yield None
        return
    raise_open_file_limit()
    project = pinned_project(project_dir)
    try:
        root = os.open(project, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxUnavailableError(
            f"the project's folder {project} cannot be opened: {exc.strerror or exc}"
        ) from None
    folders = _FolderFds(project, root)
    try:
        if os.readlink(f"/proc/self/fd/{root}") != str(project):  # swapped between the check and the open
            pinned_project(project_dir)
            raise ProjectMovedError(
                f"the project's folder {project} changed while the command was being set up: run it again"
            )
        yield folders
    finally:
        folders.close()


# seccomp: refuse socket(AF_UNIX, ...), the keyring calls and io_uring; everything else is allowed. A classic
# BPF program over `struct seccomp_data` (nr at 0, arch at 4, args[0] at 16), as bubblewrap takes it.
# io_uring (setup, enter, register: the same numbers on both) is refused whole: its IORING_OP_SOCKET makes a
# socket inside the kernel, where the filter on socket(2) never sees it (Docker's default profile refuses it too)
_IO_URING = (425, 426, 427)
_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, socket, (add_key, request_key, keyctl, io_uring_*))
    "x86_64": (0xC000003E, 41, (248, 249, 250, *_IO_URING)),
    "aarch64": (0xC00000B7, 198, (217, 218, 219, *_IO_URING)),
    "arm64": (0xC00000B7, 198, (217, 218, 219, *_IO_URING)),
}
_AF_UNIX = 1
_RET_ERRNO_EPERM = 0x00050001
_RET_ALLOW = 0x7FFF0000


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The filter for this CPU, or None where none is defined (bubblewrap then runs without one)."""
    spec = _SECCOMP_ARCH.get(machine or platform.machine())
    if spec is None:
        return None
    arch, sys_socket, refused = spec
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    n_refused = len(refused)
    # layout: 0 ld arch; 1 arch?; 2 ld nr; 3 x32?; 4..4+n-1 refused?; socket?; ld arg0; AF_UNIX?; deny; allow
    deny = 4 + n_refused + 3
    allow = deny + 1
    prog = [(ld, 0, 0, 4), (jeq, 0, deny - 2, arch), (ld, 0, 0, 0), (jge, deny - 4, 0, 0x40000000)]
    for i, nr in enumerate(refused):
        pc = 4 + i
        prog.append((jeq, deny - pc - 1, 0, nr))
    pc = 4 + n_refused
    prog.append((jeq, 0, allow - pc - 1, sys_socket))
    prog.append((ld, 0, 0, 16))
    pc = 4 + n_refused + 2
    prog.append((jeq, deny - pc - 1, allow - pc - 1, _AF_UNIX))
    prog += [(ret, 0, 0, _RET_ERRNO_EPERM), (ret, 0, 0, _RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


@contextlib.contextmanager
def _seccomp_fd() -> Iterator[int | None]:
    program = seccomp_program()
    if program is None:
        yield None
        return
    fd = os.memfd_create("flashcode-seccomp")
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def argv_fds(argv: list[str], fd: int) -> list[int]:
    """Where `argv` (from `launch`) names descriptor `fd`: the values of its `--seccomp`, `--args` and
    `--bind-fd`, before the `--` that starts the command (whose own words are left alone)."""
    end = argv.index("--") if "--" in argv else len(argv)
    flags = ("--seccomp", "--args", "--bind-fd")
    return [i + 1 for i, a in enumerate(argv[: end - 1]) if a in flags and argv[i + 1] == str(fd)]


@contextlib.contextmanager
def _env_args_fd(env: dict[str, str] | None) -> Iterator[int | None]:
    """`--setenv NAME VALUE` for each variable, NUL-separated in a memfd that bubblewrap reads (`--args FD`):
    values (an MCP server's API key) never appear on a command line, which every process can read."""
    if not env:
        yield None
        return
    for name in env:
        if not name or "=" in name or "\0" in name or "\0" in env[name]:
            raise SandboxUnavailableError(
                f"the environment variable {name!r} cannot be set (a name with = or NUL)"
            )
    fd = os.memfd_create("flashcode-env")
    try:
        os.write(fd, b"".join(b"--setenv\0%s\0%s\0" % (k.encode(), v.encode()) for k, v in env.items()))
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


class SandboxUnavailableError(RuntimeError):
    pass


class ProjectMovedError(SandboxUnavailableError):
    """The project's folder (or one above it) is now a symbolic link: it leads somewhere else than the folder
    that was checked when the project was added (home, a folder above it, ~/.config: never projects)."""


def pinned_project(project_dir: Path | str) -> Path:
    """The project's folder, as it was checked when the project was added: ProjectMovedError when the path now
    leads elsewhere (the folder, or one above it, swapped for a symbolic link while the server ran: commands
    then wrote in the home folder the link led to)."""
    given = Path(os.path.abspath(project_dir))
    real = given.resolve()
    if real != given:
        raise ProjectMovedError(
            f"the project's folder {given} now leads to {real} (a symbolic link): nothing runs or is written there. "
            "Open the project where it is now (File › Open Project…), which checks that folder first"
        )
    return real


class NetworkUnavailableError(SandboxUnavailableError):
    """The project's network switch is on, but nothing here can give a command a network of its own."""


USERNET = Path(__file__).with_name("usernet.py")
NO_SLIRP = (
    "the project's network switch is on, but slirp4netns is not installed (Debian/Ubuntu: `sudo apt-get "
    "install slirp4netns`; `make run` installs it). Without it a command would share this machine's "
    "network, flashcode's own port included, so it is not run: install it, or turn the network off"
)


def secret_paths(existing: bool = True) -> list[Path]:
    """The user's secrets (SECRET_PATHS under $HOME): hidden from commands and from the file tools."""
    home = Path(os.environ.get("HOME") or Path.home())
    return [home / p for p in SECRET_PATHS if not existing or os.path.lexists(home / p)]


DATA_MARKS = ("flashcode.db", "serve.lock")  # what makes a folder a flashcode data directory


def looks_like_data_dir(folder: Path) -> bool:
    """Whether `folder` is a flashcode data directory (its database, or a server's lock): another one than the
    server's own (`policy.hidden`), which the sandbox hides as well — its allow rules would let a command
    allow itself in the server that uses it."""
    return any(os.path.lexists(Path(folder) / mark) for mark in DATA_MARKS)


def inner_data_dirs(project: Path) -> list[Path]:
    """The flashcode data directories inside the project (not the project itself): `scan_project`'s."""
    return scan_project(project).data_dirs


def _secret_paths(policy: SandboxPolicy, data_dirs: list[Path]) -> list[Path]:
    paths = secret_paths() + [Path(p) for p in policy.hidden] + data_dirs
    return [p for p in paths if os.path.lexists(p)]


# /proc files that stay writable for uid 0 without capabilities (what Docker makes read-only)
_PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")


GIT_CREATED = (
    "The command created .git in the project. The sandbox keeps an existing .git read-only, but not one "
    "made during the command: look at .git/hooks and .git/config before you use git outside flashcode."
)
# what makes git take a folder with no `.git` in its name for a repository (a bare one): a HEAD beside
# objects/ and refs/ (or a commondir naming them). Its config (`core.fsmonitor`, `core.worktree`) and hooks
# run programs at the next git run in or under it, outside the sandbox.
GIT_MARKS = ("objects", "refs", "commondir")
SCAN_FOLDERS = 20_000  # folders a scan for git directories looks at, at most (a project's node_modules)


def git_created(folders: list[str]) -> str:
    """The warning for git directories a command made that have no `.git` in their names."""
    return (
        f"The command made {', '.join(folders[:5])}{' …' if len(folders) > 5 else ''} into a git directory "
        "(HEAD beside objects/ or refs/: git takes it for a repository, and its config and hooks run "
        "programs at your next git in that folder, outside the sandbox). Look at it before you use git there."
    )


GitState = tuple[bool, frozenset[Path], frozenset[tuple[str, str | None]]]


def git_state(project: Path) -> GitState:
    """Before a command: whether the project has `.git`, the other git directories in it, and where its
    repositories' config points git (`run_paths_state`)."""
    project = Path(project).resolve()
    scan = scan_project(project)
    return (
        (project / ".git").exists(),
        frozenset(scan.git_dirs),
        run_paths_state(project, [project, *scan.work_trees]),
    )


_TMP_PATH = re.compile(r"""(?:^|[\s=:<>&|;('"])(/tmp(?:/[^\s;|&)'"]*)?)(?=$|[\s;|&)'"])""")


def private_tmp_note(status: SandboxStatus, command: str) -> str | None:
    """After a command whose text names a path in /tmp: what became of it. Under bubblewrap /tmp is the
    command's own, emptied when it ends: `touch /tmp/x` said exit code 0 and the model "executed successfully",
    of a file that was gone. None: no such path, or another sandbox. (A hint read off the text: a path built at
    run time is not seen.)"""
    if not status.available or status.kind != "bubblewrap":
        return None
    named = sorted({m.group(1).rstrip("/") or "/tmp" for m in _TMP_PATH.finditer(command)})
    if not named:
        return None
    shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return (
        f"The command named {shown}: in the sandbox, /tmp is the command's own and was emptied when it ended, so "
        "nothing it wrote there is kept. To keep a file, write it in the project."
    )


READ_ONLY_NOTE = (
    "A write failed as read-only: in the sandbox only the project and a private /tmp can be written, and inside "
    "the project .git, the folders git runs hooks from (core.hooksPath) and the config files it includes are "
    "read-only, because git would run what a command wrote there outside the sandbox. The user can change "
    "those in a terminal of their own."
)


def read_only_note(status: SandboxStatus, output: str) -> str | None:
    """After a command under bubblewrap whose output says a write met a read-only mount: why (a model retried
    writing a husky hook; a user saw "Read-only file system" with no reason). None otherwise."""
    if not status.available or status.kind != "bubblewrap" or "Read-only file system" not in output:
        return None
    return READ_ONLY_NOTE


def git_warnings(project: Path, before: GitState) -> list[str]:
    """After a command: the warnings for the git directories it made (`before`: `git_state`'s), whose hooks and
    config would run programs outside the sandbox at the user's next git, and for a place the config points
    git that it made or led elsewhere (a hooks folder that was missing; a link swapped for a folder)."""
    project = Path(project).resolve()
    has_git, planted, run_state = git_state(project)
    out = [GIT_CREATED] if has_git and not before[0] else []
    made = sorted(d.relative_to(project).as_posix() for d in planted - before[1] if d != project / ".git")
    if made:
        out.append(git_created(made))
    changed = sorted({_shown_in(project, Path(p)) for p, _ in run_state - before[2]})
    if changed:
        out.append(
            f"The command made or changed {', '.join(changed[:5])}{' …' if len(changed) > 5 else ''}, where this "
            "repository's config points git (core.hooksPath, an included config file): what is there runs at "
            "your next git, outside the sandbox. Look at it before you use git there."
        )
    return out


def _shown_in(project: Path, path: Path) -> str:
    return path.relative_to(project).as_posix() if path.is_relative_to(project) else str(path)


def looks_like_git_dir(folder: Path, adding: Path | None = None) -> bool:
    """Whether git would take `folder` for a repository: a HEAD beside objects/, refs/ or a commondir
    (more than git asks: any of the three). `adding`: a path about to be written, counted as there."""

    def there(name: str) -> bool:  # a name written in another case counts (macOS: the same file)
        return os.path.lexists(folder / name) or any(
            p.parent == folder and p.name.casefold() == name.casefold()
            for p in ((adding, *adding.parents) if adding is not None else ())
        )

    return there("HEAD") and any(there(m) for m in GIT_MARKS)


def makes_git_dir(project: Path, path: Path) -> Path | None:
    """The folder (the project or one inside it) that writing `path` would make, or leaves, a git
    directory by the marks of `looks_like_git_dir`; None when none."""
    project = Path(project).resolve()
    for folder in reversed((path.parent, *path.parent.parents)):
        if folder.is_relative_to(project) and looks_like_git_dir(folder, path):
            return folder
    return None


@dataclass(frozen=True)
class ProjectScan:
    """What one walk of the project found: other flashcode data directories (`looks_like_data_dir`), folders
    git would take for a repository although no `.git` names them (`looks_like_git_dir`), and whether the
    walk saw every folder (at most `SCAN_FOLDERS`)."""

    data_dirs: list[Path]
    git_dirs: list[Path]
    complete: bool
    work_trees: list[Path] = dataclasses.field(default_factory=list)  # folders inside it that hold a `.git`


_GIT_MARKS_FOLDED = frozenset(m.casefold() for m in GIT_MARKS)


def scan_project(project: Path, skip: list[Path] | tuple[Path, ...] = ()) -> ProjectScan:
    """One breadth-first walk of the project (shallow folders first: a data or git directory is rarely deep,
    a node_modules is) that follows no symbolic link, enters neither `skip` nor a found data directory, and
    looks at `SCAN_FOLDERS` folders at most; then the git directories found, for data directories only (their
    read-only mounts would not hide one), as many again at most. A folder that is both is a data directory
    (hidden, not only read-only).
    One walk serves both lists: a command's mounts needed two, each 0.3-0.5 s on a 24,000-folder project."""
    project = Path(project).resolve()
    skipped = {str(p) for p in skip}
    data: list[Path] = []
    gits: list[Path] = []
    trees: list[Path] = []
    complete = _walk(str(project), skipped, data, gits, trees)
    # then inside the git directories found, for data directories only (their read-only mounts would not hide
    # one), with a budget of its own: a workspace of many clones must not leave the last clones unwalked
    _walk_inside(gits, skipped, data)
    return ProjectScan(sorted(data), sorted(gits), complete, sorted(trees))


def _walk(top: str, skipped: set[str], data: list[Path], gits: list[Path], trees: list[Path]) -> bool:
    todo, seen = collections.deque([top]), 0  # strings: a Path per folder costs
    while todo:
        folder = todo.popleft()
        seen += 1
        if seen > SCAN_FOLDERS:
            return False
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:  # not listed (no read permission): git may still take it for a repository
            if folder != top and looks_like_git_dir(Path(folder)):
                gits.append(Path(folder))
            continue
        if folder != top and entries:
            names = {e.name for e in entries}
            if any(mark in names for mark in DATA_MARKS):
                data.append(Path(folder))
                continue
            folded = {n.casefold() for n in names}  # a cheap sieve; `looks_like_git_dir` decides as git would
            if "head" in folded and folded & _GIT_MARKS_FOLDED and looks_like_git_dir(Path(folder)):
                gits.append(Path(folder))
                continue
            if ".git" in names:  # a nested repository's or a submodule's work tree: its config points git too
                trees.append(Path(folder))
        todo.extend(e.path for e in entries if e.is_dir(follow_symlinks=False) and e.path not in skipped)
    return True


def _walk_inside(gits: list[Path], skipped: set[str], data: list[Path]) -> None:
    todo, seen = collections.deque(str(g) for g in gits), 0
    while todo and seen < SCAN_FOLDERS:
        folder = todo.popleft()
        seen += 1
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        if any(e.name in DATA_MARKS for e in entries) and Path(folder) not in gits:
            data.append(Path(folder))
            continue
        todo.extend(  # not git's object store (256 folders of hashed files in every repository)
            e.path
            for e in entries
            if e.is_dir(follow_symlinks=False) and e.name != "objects" and e.path not in skipped
        )


def planted_git_dirs(project: Path, skip: list[Path] | tuple[Path, ...] = ()) -> tuple[list[Path], bool]:
    """Folders in the project that git would take for a repository although no `.git` names them, and whether
    the walk saw every folder: `scan_project`'s."""
    scan = scan_project(project, skip)
    return scan.git_dirs, scan.complete


def named_git_dirs(project: Path) -> list[Path]:
    """`.git`, or the folder a `.git` file names (`gitdir:`, as `git init --separate-git-dir` and worktrees
    write), and the `commondir` that one names: found without a walk (a file write asks about them; the
    others it finds by its path's folders, `makes_git_dir`)."""
    project = Path(project).resolve()
    git = project / ".git"
    found: list[Path] = []
    if git.is_file() and not git.is_symlink():
        if (named := _gitdir_named(git)) is not None:
            found.append((project / named).resolve())
    elif os.path.lexists(git):
        found.append(git.resolve())
    found += [common.resolve() for d in found if (common := _common_dir(d)) is not None]
    return [d for d in found if d.exists() and d.is_relative_to(project) and d != project]


def _gitdir_named(git_file: Path) -> str | None:
    """The folder a `.git` file names on its `gitdir:` line, as written; None when it names none."""
    try:
        line = git_file.read_text(errors="replace").splitlines()[:1]
    except OSError:
        return None
    return line[0].removeprefix("gitdir:").strip() if line and line[0].startswith("gitdir:") else None


def _common_dir(git_dir: Path) -> Path | None:
    """The main repository's git directory that a linked worktree's `commondir` names (None: none)."""
    try:
        common = (git_dir / "commondir").read_text(errors="replace").strip()
    except OSError:
        return None
    return git_dir / common if common else None


_CONFIG_SECTION = re.compile(r'^\s*\[\s*([A-Za-z0-9.-]+)(?:\s+"(?:[^"\\]|\\.)*")?\s*\]')
_CONFIG_KEY = re.compile(r"^\s*([A-Za-z][A-Za-z0-9-]*)\s*(?:=\s*(.*))?$")
_CONTINUED = re.compile(r"(?<!\\)((?:\\\\)*)\\\n")  # an odd backslash at a line's end continues it
CONFIG_INCLUDE_DEPTH = 10  # git's own limit on nested includes


def _config_value(raw: str) -> str:
    """A git config value as git reads it: quotes removed, a comment (# or ; outside quotes) cut, escapes
    undone (lines continued with a backslash are joined before, by `_CONTINUED`)."""
    out, quoted, i = [], False, 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and i + 1 < len(raw):
            out.append({"n": "\n", "t": "\t", "b": "\b"}.get(raw[i + 1], raw[i + 1]))
            i += 2
            continue
        if ch == '"':
            quoted = not quoted
        elif ch in "#;" and not quoted:
            break
        else:
            out.append(ch)
        i += 1
    return "".join(out).strip()


def _git_dir_of(work_tree: Path) -> Path | None:
    """The git directory of `work_tree`: its `.git` folder, or the one a `.git` file names (`gitdir:`: a linked
    worktree's, a submodule's, `--separate-git-dir`'s), wherever it lies. None without one."""
    git = work_tree / ".git"
    if git.is_dir():
        return git
    named = _gitdir_named(git) if git.is_file() else None
    return None if named is None else work_tree / named


def _config_files(git_dir: Path) -> list[Path]:
    """The config files git reads for a repository, before includes: its git directory's, the worktree's own
    (`config.worktree`), and the main repository's that a linked worktree's `commondir` names."""
    files = [git_dir / "config", git_dir / "config.worktree"]
    if (common := _common_dir(git_dir)) is not None:
        files.append(common / "config")
    return files


def _configured(work_tree: Path) -> list[Path]:
    """Where `work_tree`'s repository config points git, as written (not resolved): `core.hooksPath` from the
    work tree's top, and the files `include.path` / `includeIf.*.path` name, from the including file's folder,
    followed as git follows them (any condition taken as true)."""
    git_dir = _git_dir_of(work_tree)
    if git_dir is None:
        return []
    found: list[Path] = []
    todo = [(config, 0) for config in _config_files(git_dir)]
    read: set[str] = set()
    while todo:
        config, depth = todo.pop(0)
        key_of = os.path.normpath(config)
        if key_of in read or depth > CONFIG_INCLUDE_DEPTH:
            continue
        read.add(key_of)
        try:
            text = config.read_text(errors="replace")
        except OSError:
            continue
        section = ""
        # a value continued with a backslash at the line's end is one line
        for line in _CONTINUED.sub(r"\1", text).splitlines():
            if m := _CONFIG_SECTION.match(line):
                section = m.group(1).casefold()
                line = line[m.end() :]
            m = _CONFIG_KEY.match(line)
            if m is None or m.group(2) is None:
                continue
            key, value = m.group(1).casefold(), _config_value(m.group(2))
            if not value:
                continue
            where = Path(os.path.expanduser(value))
            if section == "core" and key == "hookspath":
                hooks = where if where.is_absolute() else work_tree / where
                found.append(hooks)
                if hooks.name == "_" and (hooks / "h").is_file():
                    # husky 9: its stubs in `.husky/_` run the scripts in `.husky/` itself
                    found.append(hooks.parent)
            elif section.split(".")[0] in ("include", "includeif") and key == "path":
                target = where if where.is_absolute() else config.parent / where
                found.append(target)
                todo.append((target, depth + 1))
    return found


def work_trees_at(project: Path, path: Path) -> list[Path]:
    """The project and the folders between it and `path` that hold a `.git` (a nested repository's, a
    submodule's work tree): whose config may point git at `path`. No walk: a file write asks about its own
    path only."""
    project = Path(project).resolve()
    trees = [project]
    for folder in reversed(path.parents):
        if folder != project and folder.is_relative_to(project) and os.path.lexists(folder / ".git"):
            trees.append(folder)
    return trees


def git_run_paths(project: Path, work_trees: list[Path] | None = None, existing: bool = True) -> list[Path]:
    """What the config of the project's repositories points git at inside the project, which runs as the user
    at their next git, outside the sandbox: `core.hooksPath` (husky's `.husky`; husky 9's `.husky/_`, and
    `.husky` whose scripts its stubs run) and the files `include.path` and `includeIf.*.path` read as more
    config (a `core.fsmonitor` there runs at `git status`). `work_trees`: the project and the nested work trees
    (`ProjectScan.work_trees`, `work_trees_at`); a linked worktree's or a submodule's config is read where it
    lies, in or out of the project. Resolved; `existing`: only the paths there now (what can be mounted
    read-only). A review planted husky's hook unasked; commands get these read-only and the file tools ask
    before writing there, as for `.git`."""
    project = Path(project).resolve()
    out: list[Path] = []
    for tree in [project] if work_trees is None else work_trees:
        for path in _configured(Path(tree)):
            real = path.resolve()
            if real == project or not real.is_relative_to(project) or real in out:
                continue
            if existing and not os.path.lexists(real):
                continue
            out.append(real)
    return out


def run_paths_state(project: Path, work_trees: list[Path]) -> frozenset[tuple[str, str | None]]:
    """Each place the config points git, as written, with where it leads now (None: nothing there): a command
    that makes one that was missing, or swaps a link on the way for a folder of its own, changes this."""
    project = Path(project).resolve()
    state = set()
    for tree in work_trees:
        for path in _configured(Path(tree)):
            lexical = Path(os.path.normpath(path))
            if not (lexical.is_relative_to(project) or path.resolve().is_relative_to(project)):
                continue
            there = path.resolve() if os.path.lexists(path) else None
            state.add((str(lexical), None if there is None else f"{there}|{_kind(path)}"))
    return frozenset(state)


def _kind(path: Path) -> str:
    """What `path` is, link or not, for `run_paths_state`: a link swapped for a folder of its own changes it."""
    return "".join("l" if p.is_symlink() else "-" for p in (path, *path.parents))


def _pins(project: Path, paths: list[Path]) -> list[Path]:
    """The folders between the project and each of `paths` (mounts inside it), shallow first. Each becomes
    a mount point of itself: a mount point cannot be renamed, and a renamed folder would carry a hidden
    path's mount away, leaving the next command a name at which nothing is hidden any more."""
    out: set[Path] = set()
    for path in paths:
        if path != project and path.is_relative_to(project):
            out.update(d for d in path.parents if d != project and d.is_relative_to(project))
    return sorted(out, key=lambda d: len(d.parts))


def _bwrap_argv(
    argv: list[str],
    policy: SandboxPolicy,
    seccomp_fd: int | None = None,
    env_fd: int | None = None,
    folders: _FolderFds | None = None,
) -> list[str]:
    """bubblewrap's arguments. `folders`: the descriptors the writable folders are bound from, and the project's
    path as it was checked (not looked up again); without it, folders are bound by name."""

    def writable(folder: Path) -> list[str]:
        if folders is None:
            return ["--bind", str(folder), str(folder)]
        return ["--bind-fd", str(folders.open(folder)), str(folder)]

    project = folders.project if folders is not None else Path(policy.project_dir).resolve()
    bwrap = system_program("bwrap", project) or "/usr/bin/bwrap"  # never one found in the project
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for path in _PROC_READ_ONLY:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    args += ["--tmpfs", "/tmp"]
    # Mounts stack in order, and a later one covers what lies below its path. So: first hide the secrets
    # that hold the project (the scratch project in the data directory), then bind the project into the
    # emptied tree, then pin the folders that lead to what is hidden or read-only inside it, then make the
    # git directories read-only, then hide every other secret, the ones inside the project too (a project
    # opened at ~/.config must not uncover its git credentials; a data directory inside a git directory
    # stays hidden under its read-only mount).
    named = named_git_dirs(project)
    scan = scan_project(project, named)  # one walk for the data and the git directories inside the project
    # where the repositories' config points git (hooks, included config): read-only like a git directory
    named += [
        p
        for p in git_run_paths(project, [project, *scan.work_trees])
        if not any(p.is_relative_to(d) for d in named)
    ]
    secrets = [s.resolve() for s in _secret_paths(policy, scan.data_dirs)]
    holders = [s for s in secrets if s != project and s in project.parents]
    for real in holders:
        args += ["--tmpfs", str(real)]
    args += writable(project)
    hidden = [real for real in secrets if real != project and real not in holders]  # the project itself stays
    gits = [*named, *(d for d in scan.git_dirs if d not in hidden)]
    own = [p for p in own_paths() if p.is_relative_to(project) and p != project and p.exists()]
    for folder in _pins(project, hidden + gits + own):
        args += writable(folder)
    for real in gits + own:  # flashcode's own environment too, when it lies in the project
        args += ["--ro-bind", str(real), str(real)]
    git = project / ".git"
    if os.path.lexists(git) and (git.is_symlink() or git.is_file()):
        args += [
            "--ro-bind",
            str(git),
            str(git),
        ]  # the link or `gitdir:` file itself cannot be replaced either
    for real in hidden:
        if real.is_dir():
            args += ["--tmpfs", str(real)]
        else:
            args += ["--ro-bind", "/dev/null", str(real)]
    # a network namespace of its own in every case: with the network on, usernet.py connects it to the
    # outside without this machine's loopback (where flashcode itself listens)
    args += ["--unshare-user-try", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    args += [
        "--unshare-net",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--chdir",
        str(project),
    ]
    if (
        env_fd is not None
    ):  # the command's own variables (`_env_args_fd`): bubblewrap itself runs with the clean ones
        args += ["--args", str(env_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args = [*args, "--", *argv]
    return [sys.executable, "-I", str(USERNET), *args] if policy.network else args


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
        f"(deny file-write* (subpath {_seatbelt_quote(project / '.git')}))",
        # unix sockets outside the sandbox (docker.sock, the session's services) act for the command
        "(deny network-outbound (remote unix-socket))",
        '(allow network-outbound (remote unix-socket (path-literal "/private/var/run/mDNSResponder")))',
    ]
    named = named_git_dirs(project)
    scan = scan_project(project, named)
    named += [
        p
        for p in git_run_paths(project, [project, *scan.work_trees])
        if not any(p.is_relative_to(d) for d in named)
    ]
    secrets = [s for s in _secret_paths(policy, scan.data_dirs) if s.resolve() != project]
    if secrets:
        lines.append(
            "(deny file-read* file-write* "
            + " ".join(f"(subpath {_seatbelt_quote(s)})" for s in secrets)
            + ")"
        )
    # later rules win: the scratch project inside the (hidden) data directory is allowed again, then what
    # lies inside the project is denied again, and the folders that lead there cannot be renamed away
    if any(s.resolve() in project.parents for s in secrets):
        lines.append(f"(allow file-read* file-write* (subpath {_seatbelt_quote(project)}))")
        inside = [s for s in secrets if s.resolve().is_relative_to(project)]
        if inside:
            lines.append(
                "(deny file-read* file-write* "
                + " ".join(f"(subpath {_seatbelt_quote(s)})" for s in inside)
                + ")"
            )
    gits = named + scan.git_dirs
    for real in [project / ".git", *gits]:
        lines.append(f"(deny file-write* (subpath {_seatbelt_quote(real)}))")
    inner = [s.resolve() for s in secrets if s.resolve().is_relative_to(project)]
    for folder in _pins(project, inner + gits):
        lines.append(f"(deny file-write* (literal {_seatbelt_quote(folder)}))")
    if not policy.network:
        lines.append('(deny network* (remote ip "*:*"))')
    else:  # this machine's own services, flashcode itself first (no token on loopback), stay out of reach
        lines.append('(deny network-outbound (remote ip "localhost:*"))')
    return "\n".join(lines)


def _seatbelt_argv(argv: list[str], policy: SandboxPolicy, tmp_dir: Path = Path("/private/tmp")) -> list[str]:
    return ["sandbox-exec", "-p", seatbelt_profile(policy, tmp_dir), *argv]
