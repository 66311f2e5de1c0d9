"""End-to-end probes of the OS sandbox (`webapp/agent/sandbox.py` through `runner.CommandRun`): each
probe really runs, in a scratch project, and the test checks outside the project that nothing else
happened.

Every write probe runs three ways: (1) a *control* run under a permissive bubblewrap (the scratch tree
writable) must create the marker — so the probe is a real bypass, not a typo; (2) the agent's path:
if `check_command` auto-allows it under the attacker's rules, it runs sandboxed; (3) "Run once", as if
the user clicked it: sandboxed. After (2) and (3) nothing may exist beside the project, and a write
inside the project must still work. Probes of `.git` then run the user's own `git commit` outside the
sandbox, as the user would later, to see whether a planted hook runs.

What is covered: writes outside the project (absolute, `..`, symlinks, hard links, /proc, /tmp,
/dev/shm, /var/tmp), the policy bypasses of issue 13 run for real, `.git` hooks and config, secrets in
$HOME and in the environment, network (TCP, abstract and path unix sockets), process isolation and
cleanup, capabilities, inherited descriptors. What is not covered: macOS (sandbox-exec).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from webapp.agent import sandbox
from webapp.agent.files import FileToolError, PathOutsideProjectError, ProjectFiles
from webapp.agent.sandbox import SandboxPolicy, detect
from webapp.agent.shell import Rule, check_command
from webapp.agent.tools import ReadTools

from .conftest import HOOK, SECRET, Scratch, git, run_command, run_control


def rules(*specs: str) -> tuple[Rule, ...]:
    return tuple(Rule("exact", s[1:]) if s.startswith("=") else Rule("prefix", s) for s in specs)


@dataclass(frozen=True)
class Probe:
    id: str
    command: str  # placeholders: {out} {tmpout} {py} {shm} {vartmp} {tmpfile} (see Scratch.subst)
    rules: tuple[Rule, ...] = ()
    control: bool = True  # the permissive control run must create the marker
    git_commit: bool = False  # the user's `git commit` afterwards must not run a planted hook
    wait_s: float = 0.0  # for background payloads
    no_hooks_dir: bool = False  # the project's .git/hooks does not exist (git init --template=)


COMMON = rules("ls", "cat", "echo", "grep", "find", "git status", "git log", "git diff", "sort", "head", "wc")
PROBES = [
    Probe("absolute", "touch {out}/pwned"),
    Probe("dotdot", "touch ../outside/pwned"),
    Probe("redirect", "echo x > {out}/pwned"),
    Probe("under-tmp", "mkdir -p {tmpout} && touch {tmpout}/pwned"),
    Probe("symlink-dir", "ln -s {out} esc && touch esc/pwned"),
    Probe("symlink-file", "ln -s {out}/pwned lnk && echo x > lnk"),
    Probe("hardlink", "ln {out}/victim.txt hl && echo pwned >> hl"),
    Probe("cp", "cp README.md {out}/pwned"),
    Probe("mv", "mv README.md {out}/pwned"),
    Probe("proc-self-root", "touch /proc/self/root{out}/pwned"),
    Probe("proc-self-cwd", "touch /proc/self/cwd/../outside/pwned"),
    Probe("python", "{py} -c 'open(\"{out}/pwned\", \"w\")'"),
    Probe("dd", "dd if=/dev/zero of={out}/pwned count=1"),
    Probe("tee", "echo x | tee {out}/pwned", rules("echo")),
    Probe("clobber", "echo x >| {out}/pwned", rules("echo")),
    Probe("and-append", "echo x &>> {out}/pwned", rules("echo")),
    Probe("named-fd", "echo x {fd}>{out}/pwned", rules("echo")),
    Probe("read-write", "echo x 1<>{out}/pwned", rules("echo")),
    Probe("procsub-comment", "ls <(ls)#; touch {out}/pwned", rules("ls")),
    Probe("brace-find-exec", 'find . -maxdepth 0 {-exec,touch,{out}/pwned,";"}', rules("find")),
    Probe("brace-find-escaped", "find . -maxdepth 0 {'-exec',touch,{out}/pwned,\\;}", rules("find")),
    Probe("find-fprint", "find . -maxdepth 0 -fprint {out}/pwned", rules("find")),
    Probe("find-dashdash-exec", "find -- . -maxdepth 0 -exec touch {out}/pwned ';'", rules("find")),
    Probe("exec-string", "find . -maxdepth 0 ${BASH_EXECUTION_STRING##*#} #-exec touch {out}/pwned ;", rules("find")),
    Probe("bash-var", "$BASH -c 'touch {out}/pwned'", COMMON),
    Probe("ansi-c-name", "$'\\x74ouch' {out}/pwned", COMMON),
    Probe("heredoc", "cat <<EOF\n$(touch {out}/pwned)\nEOF", rules("cat")),
    Probe("printf-v", "printf -v 'a[$(touch {out}/pwned)]' x", rules("printf")),
    Probe("test-v", "test -v 'a[$(touch {out}/pwned)]'", rules("test")),
    Probe("let", "let 'a[$(touch {out}/pwned)]=1'", rules("let")),
    Probe("read", "read 'a[$(touch {out}/pwned)]' <<< x", rules("read")),
    Probe("tar-checkpoint-a", "tar -cf /dev/null --checkpoint=1 --checkpoint-a='exec=touch {out}/pwned' README.md",
          rules("tar")),
    Probe("tar-bundled-I", "tar -cI'touch {out}/pwned;cat' -f x.tar README.md", rules("tar")),
    Probe("git-shortlog-output", "git shortlog --output={out}/pwned HEAD", rules("git shortlog")),
    Probe("git-diff-output", "git diff --output={out}/pwned HEAD", rules("git diff")),
    Probe("git-alias", "git -c alias.x='!touch {out}/pwned' x", rules("git status")),
    Probe("sort-o", "sort -o {out}/pwned README.md", rules("sort")),
    Probe("sort-uo-bundled", "sort -uo{out}/pwned README.md", rules("sort")),
    Probe("uniq-outfile", "uniq README.md {out}/pwned", rules("uniq")),
    Probe("make-eval", "make --eval='$(shell touch {out}/pwned)' -f /dev/null", rules("make")),
    Probe("vim-cmd", "vim -es --cmd '!touch {out}/pwned' --cmd q", rules("vim")),
    Probe("xargs", "echo {out}/pwned | xargs touch", rules("echo", "xargs")),
    Probe("background", "(sleep 1; touch {out}/pwned) >/dev/null 2>&1 &", COMMON, control=False, wait_s=2.5),
    Probe("nohup-setsid", "nohup setsid sh -c 'sleep 1; touch {out}/pwned' >/dev/null 2>&1 &", COMMON,
          control=False, wait_s=2.5),
    Probe("dev-shm", "touch {shm}", control=False),
    Probe("var-tmp", "touch {vartmp}", control=False),
    Probe("tmp-is-private", "touch {tmpfile}", control=False),
    Probe("git-hook", HOOK, git_commit=True),
    Probe("git-config-hookspath",
          "mkdir -p h && " + HOOK.replace("{hooks}", "h") + " && git config core.hooksPath h", git_commit=True),
    Probe("git-config-append", "printf '[core]\\n\\thooksPath = h\\n' >> .git/config && mkdir -p h && "
          + HOOK.replace("{hooks}", "h"), git_commit=True),
    Probe("git-rename-dot-git", "mv .git .git.old && cp -a .git.old .git && " + HOOK, git_commit=True),
    Probe("git-commondir", "mkdir -p evil/hooks && cp -r .git/objects .git/refs .git/config evil/ && "
          + HOOK.replace("{hooks}", "evil/hooks") + " && echo ../evil > .git/commondir", git_commit=True),
    Probe("git-missing-hooks-dir", "mkdir -p .git/hooks && " + HOOK, git_commit=True, no_hooks_dir=True),
]  # fmt: skip


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_write_probe_is_contained(scratch: Scratch, probe: Probe) -> None:
    command = scratch.subst(probe.command)
    if probe.no_hooks_dir:
        for project in (scratch.project, scratch.control):
            subprocess.run(["rm", "-rf", str(project / ".git" / "hooks")], check=True)
    if probe.control:
        ran = run_control(command, scratch)
        if probe.git_commit:
            git(scratch.control, "commit", "-q", "--allow-empty", "-m", "later")
        assert scratch.breaches(), f"the probe is broken: unsandboxed it left no marker\n{ran.output}"
        scratch.clean()

    verdict = check_command(command, probe.rules)
    if verdict.allowed:  # the agent's path: a rule allows it, it runs with no dialog (sandboxed)
        run_command(command, scratch.project)
    ran = run_command(command, scratch.project)  # "Run once"
    assert ran.error is None, ran.error
    if probe.git_commit:
        git(scratch.project, "commit", "-q", "--allow-empty", "-m", "later")
    time.sleep(probe.wait_s)
    assert scratch.breaches() == [], f"auto-allowed={verdict.allowed}\n{ran.output}"

    alive = run_command(
        "echo ok > inside.txt", scratch.project
    )  # the sandbox still lets the project be written
    assert alive.exit_code == 0 and (scratch.project / "inside.txt").read_text() == "ok\n", alive.output


def test_sandbox_is_available_here() -> None:
    status = detect()
    assert status.available and status.kind == "bubblewrap", status.reason


def test_writes_inside_the_project_work(scratch: Scratch) -> None:
    ran = run_command("echo ok > inside.txt && mkdir -p sub/dir && touch sub/dir/f && git status --short",
                      scratch.project)  # fmt: skip
    assert ran.exit_code == 0, ran.output
    assert (scratch.project / "inside.txt").read_text() == "ok\n"
    assert (scratch.project / "sub" / "dir" / "f").exists()
    assert "inside.txt" in ran.output


def test_git_hooks_and_config_are_read_only(scratch: Scratch) -> None:
    config = (scratch.project / ".git" / "config").read_text()
    for command in ["echo x >> .git/config", "touch .git/hooks/pre-commit", "git config core.pager cat",
                    "rm -rf .git/hooks", "mv .git/hooks .git/hooks.old", "rm .git/config"]:  # fmt: skip
        ran = run_command(command, scratch.project)
        assert ran.exit_code != 0, (command, ran.output)
    assert (scratch.project / ".git" / "config").read_text() == config
    assert not (scratch.project / ".git" / "hooks" / "pre-commit").exists()


SECRETS = [".ssh/id_ed25519", ".aws/credentials", ".config/gh/hosts.yml", ".netrc", ".git-credentials",
           ".docker/config.json", ".kube/config", ".gnupg/private-keys-v1.d/key.key", ".cargo/credentials.toml",
           ".config/git/credentials", ".cache/huggingface/token", ".claude/.credentials.json", ".pgpass",
           # red-team: readable before (a snap or Flatpak Firefox's cookies, yarn's and pip's tokens, a key
           # exported in .bashrc)
           "snap/firefox/common/.mozilla/firefox/p.default/cookies.sqlite",
           ".var/app/org.mozilla.firefox/.mozilla/firefox/p.default/cookies.sqlite",
           ".config/BraveSoftware/Brave-Browser/Default/Cookies", ".yarnrc.yml", ".config/pip/pip.conf",
           ".bashrc", ".zshrc", ".profile"]  # fmt: skip


@pytest.mark.parametrize("relative", SECRETS)
def test_secrets_in_home_are_hidden(scratch: Scratch, relative: str) -> None:
    secret = scratch.home / relative
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text(SECRET + "\n")
    command = f'cat ~/{relative}; cat "$HOME/{relative}"; cat {secret}; ln -s {secret} leak; cat leak'
    assert SECRET in run_command(command, scratch.project, sandboxed=False).output  # the probe reads it
    (scratch.project / "leak").unlink()
    ran = run_command(command, scratch.project)
    assert SECRET not in ran.output


def test_secrets_are_not_found_by_searching_home(scratch: Scratch) -> None:
    for relative in SECRETS:
        (scratch.home / relative).parent.mkdir(parents=True, exist_ok=True)
        (scratch.home / relative).write_text(SECRET + "\n")
    ran = run_command(f"grep -r {SECRET} ~ 2>/dev/null; find ~ -name 'id_*'", scratch.project)
    assert SECRET not in ran.output and "id_ed25519" not in ran.output, ran.output


def test_server_environment_secrets_do_not_reach_commands(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN"):
        monkeypatch.setenv(name, SECRET)
    server = subprocess.Popen(["sleep", "60"], env=os.environ.copy())  # a host process holding the keys
    try:
        # Popen returns (vfork) before the kernel has laid out the new program's environment, and
        # /proc/PID/environ reads empty until it has: wait for it, or the control below races.
        environ = Path(f"/proc/{server.pid}/environ")
        deadline = time.monotonic() + 10
        while SECRET.encode() not in environ.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        command = f"env; cat /proc/self/environ; cat /proc/1/environ; cat /proc/{server.pid}/environ"
        assert (
            SECRET in run_command(f"cat /proc/{server.pid}/environ", scratch.project, sandboxed=False).output
        )
        ran = run_command(command, scratch.project)
    finally:
        server.kill()
        server.wait()
    assert SECRET not in ran.output
    assert "PATH=" in ran.output  # the command did run


def test_tmp_is_private_and_empty(scratch: Scratch) -> None:
    host_file = Path(f"/tmp/{scratch.tag}-secret")
    host_file.write_text(SECRET)
    try:
        listing = run_command("ls -A /tmp", scratch.project)
        read = run_command(f"cat {host_file}", scratch.project)
        write = run_command(f"echo x > /tmp/{scratch.tag}-w && cat /tmp/{scratch.tag}-w", scratch.project)
    finally:
        host_file.unlink()
    assert listing.exit_code == 0 and listing.output.strip() == "", listing.output
    assert SECRET not in read.output
    assert write.output == "x\n" and not Path(f"/tmp/{scratch.tag}-w").exists()


class Listener:
    """A server on the host that records what a command sends (and drops a marker, like a real
    service such as `systemd-run` or a docker socket would run something)."""

    def __init__(self, family: int, address: object, marker: Path) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.marker = marker
        self.received = b""
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received += conn.recv(100)
                except OSError:
                    pass
                self.marker.touch()

    def close(self) -> bytes:
        time.sleep(0.5)
        self._stop = True
        self._thread.join(2)
        self.sock.close()
        return self.received


SEND = "{py} -c 'import socket,sys; s=socket.socket({family}); s.settimeout(3); s.connect({addr}); s.send(b\"pwned\")'"


def host_address() -> str:
    """This machine's address on its network (not loopback): where a service bound beyond loopback listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # a route lookup only: UDP connect sends nothing
        return s.getsockname()[0]


def test_network_is_off_by_default_and_on_when_allowed(scratch: Scratch) -> None:
    """Off: nothing leaves. On: the network works (a service on this machine's own address answers), but
    this machine's loopback — where flashcode listens with no token — is out of reach, under its own
    address and slirp4netns's alias for it (10.0.2.2)."""
    address = host_address()
    assert not address.startswith("127."), address
    for network in (False, True):
        listeners = {
            where: Listener(socket.AF_INET, (where, 0), scratch.outside / f"pwned-{where}")
            for where in ("127.0.0.1", address)
        }
        targets = [(where, listener.sock.getsockname()[1]) for where, listener in listeners.items()]
        targets.append(("10.0.2.2", targets[0][1]))  # the host's loopback seen from slirp4netns's side
        command = "; ".join(
            f"echo pwned > /dev/tcp/{host}/{port}; "
            + scratch.subst(
                SEND.replace("{family}", "socket.AF_INET").replace("{addr}", f'("{host}", {port})')
            )
            for host, port in targets
        )
        ran = run_command(command, scratch.project, network=network, timeout_s=60)
        got = {where: listener.close() for where, listener in listeners.items()}
        assert got["127.0.0.1"] == b"" and not (scratch.outside / "pwned-127.0.0.1").exists(), ran.output
        if network:
            assert b"pwned" in got[address], ran.output
        else:
            assert got[address] == b"", ran.output
        scratch.clean()


def test_with_the_network_on_a_command_cannot_reach_flashcode(scratch: Scratch) -> None:
    """The attack the loopback rule stops: a command that finds flashcode's port (no token on loopback)
    could open a project anywhere and approve its own next command. Here a stand-in HTTP server on loopback
    must not answer, while the command's own loopback still works."""
    listener = Listener(socket.AF_INET, ("127.0.0.1", 0), scratch.outside / "pwned")
    port = listener.sock.getsockname()[1]
    command = scratch.subst(
        f"curl -s --max-time 3 http://127.0.0.1:{port}/ ; echo curl=$?; "
        '{py} -c \'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); '
        'c = socket.create_connection(s.getsockname()); print("own loopback", s.accept()[1][0])\''
    )
    ran = run_command(command, scratch.project, network=True, timeout_s=60)
    assert listener.close() == b"" and scratch.breaches() == [], ran.output
    assert "curl=7" in ran.output and "own loopback 127.0.0.1" in ran.output, ran.output


def test_unix_socket_outside_the_project_is_unreachable(scratch: Scratch) -> None:
    """A socket outside the project (/run/user/UID/bus, /var/run/docker.sock) lets a command ask a host
    service to run anything, unsandboxed; a read-only mount does not stop connect()."""
    path = scratch.base / "run" / "bus.sock"
    path.parent.mkdir()
    listener = Listener(socket.AF_UNIX, str(path), scratch.outside / "pwned")
    command = scratch.subst(SEND.replace("{family}", "socket.AF_UNIX").replace("{addr}", f'"{path}"'))
    command += f"; curl -s --max-time 3 --unix-socket {path} http://localhost/"
    ran = run_command(command, scratch.project)
    got = listener.close()
    assert got == b"" and scratch.breaches() == [], ran.output


def test_abstract_unix_socket_is_unreachable(scratch: Scratch) -> None:
    name = f"\0{scratch.tag}"
    listener = Listener(socket.AF_UNIX, name, scratch.outside / "pwned")
    addr = f'"\\0{scratch.tag}"'
    command = scratch.subst(SEND.replace("{family}", "socket.AF_UNIX").replace("{addr}", addr))
    assert run_command(command, scratch.project, sandboxed=False).exit_code == 0  # the probe connects
    time.sleep(0.5)
    scratch.clean()
    listener.received = b""
    ran = run_command(command, scratch.project)
    got = listener.close()
    assert got == b"" and scratch.breaches() == [], ran.output


def _host_processes_with(token: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if token in cmdline:
                found.append(f"{pid}: {cmdline}")
    return found


def test_host_processes_are_invisible_and_unkillable(scratch: Scratch) -> None:
    token = f"61.{uuid.uuid4().int % 10**6:06d}"
    victim = subprocess.Popen(["sleep", token])
    try:
        ran = run_command(f"ps -eo pid,args; kill -9 {victim.pid}; kill -9 -1", scratch.project)
        time.sleep(0.2)
        assert victim.poll() is None, "a sandboxed command killed a host process"
        assert token not in ran.output and "pytest" not in ran.output, ran.output
    finally:
        victim.kill()
        victim.wait()


def test_background_children_die_with_the_command(scratch: Scratch) -> None:
    token = f"97.{uuid.uuid4().int % 10**6:06d}"
    command = (
        f"nohup setsid sleep {token} >/dev/null 2>&1 & disown; "
        f"(trap '' HUP TERM; exec -a daemon-{token} sleep {token}) >/dev/null 2>&1 & echo started"
    )
    ran = run_command(command, scratch.project)
    assert "started" in ran.output, ran.output
    deadline = time.monotonic() + 3
    while _host_processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _host_processes_with(token) == []


@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_timeout_kills_the_sandboxed_command(scratch: Scratch, network: bool) -> None:
    """With the network on, slirp4netns (and usernet.py around bubblewrap) go with the command."""
    token = f"98.{uuid.uuid4().int % 10**6:06d}"
    ran = run_command(f"sleep {token}", scratch.project, timeout_s=1, network=network)
    assert ran.timed_out, ran
    time.sleep(0.5)
    assert _host_processes_with(token) == []
    assert [p for p in _host_processes_with("slirp4netns") if "--exit-fd" in p] == []


CAPABILITY_PROBES = [
    "mkdir -p mnt && mount -t tmpfs none mnt",
    "mkdir -p mnt && mount --bind {out} mnt",
    "mount -o remount,rw /",
    "unshare -m true",
    "unshare -U -r true",
    "unshare -n true",
    "chroot / true",
    "date -s @$(date +%s)",  # sets the clock to what it is: harmless if it ever succeeds
    "v=$(cat /proc/sys/kernel/core_pattern) && printf '%s\\n' \"$v\" > /proc/sys/kernel/core_pattern",
    "test -w /proc/sysrq-trigger",
    "test -w /proc/sys/kernel/core_pattern",
    "test -w /proc/sys/kernel/modprobe",
    "{py} -c 'import os; os.setgroups([0])'",
    "chown 1:1 README.md",
]


@pytest.mark.parametrize("command", CAPABILITY_PROBES)
def test_no_capabilities_even_as_root(scratch: Scratch, command: str) -> None:
    ran = run_command(scratch.subst(command), scratch.project)
    assert ran.exit_code not in (0, None), ran.output


def test_capability_sets_are_empty(scratch: Scratch) -> None:
    ran = run_command("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb):' /proc/self/status", scratch.project)
    lines = [line.split() for line in ran.output.splitlines() if line.startswith("Cap")]
    assert len(lines) == 5 and all(int(value, 16) == 0 for _, value in lines), ran.output


def test_inherited_descriptors_do_not_leak(scratch: Scratch) -> None:
    fd = os.open(scratch.victim, os.O_WRONLY | os.O_APPEND)
    os.set_inheritable(fd, True)
    try:
        command = 'for f in /proc/self/fd/*; do echo pwned >> "$f"; done 2>/dev/null; ls -l /proc/self/fd'
        ran = run_command(command, scratch.project)
    finally:
        os.close(fd)
    assert scratch.victim.read_text() == "victim\n", ran.output


def test_hidden_paths_of_the_policy_are_hidden(scratch: Scratch) -> None:
    data = scratch.base / "flashcode-data"
    data.mkdir()
    (data / "flashcode.db").write_text(SECRET)
    policy = SandboxPolicy(scratch.project, hidden=(data,))
    ran = run_command(
        f"ls -A {data}; cat {data}/flashcode.db; echo x > {data}/rules", scratch.project, policy=policy
    )
    assert SECRET not in ran.output and not (data / "rules").exists()


@pytest.mark.parametrize("entry", [".", "bin", "{project}/bin"])
def test_an_allowed_program_never_resolves_into_the_project(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    """A user whose PATH has `.`, a relative or a project directory: the model writes `./ls` (or
    `bin/ls`) and the auto-allowed `ls` would run it."""
    entry = entry.replace("{project}", str(scratch.project))
    monkeypatch.setenv("PATH", f"{entry}{os.pathsep}{os.environ['PATH']}")
    for folder in (scratch.project, scratch.project / "bin"):
        folder.mkdir(exist_ok=True)
        (folder / "ls").write_text("#!/bin/sh\necho planted > planted-ran.txt\n")
        (folder / "ls").chmod(0o755)
    verdict = check_command("ls -la", rules("ls"))
    assert verdict.allowed
    ran = run_command("ls -la", scratch.project)
    assert not (scratch.project / "planted-ran.txt").exists(), ran.output


def test_a_project_that_holds_the_secrets_does_not_uncover_them(scratch: Scratch) -> None:
    """A project opened at the home folder (or above the data directory): its read-write mount must not
    cover the mounts that hide the secrets and the data directory (mounts stack in order)."""
    (scratch.home / ".ssh").mkdir()
    (scratch.home / ".ssh" / "id_ed25519").write_text(SECRET + "\n")
    (scratch.home / ".netrc").write_text(SECRET + "\n")
    data = scratch.home / ".local" / "share" / "flashcode"
    data.mkdir(parents=True)
    (data / "flashcode.db").write_text(SECRET + "\n")
    command = (
        f"cat .ssh/id_ed25519 .netrc {data}/flashcode.db; echo x >> {data}/flashcode.db; echo ok > inside.txt"
    )
    assert SECRET in run_command(command, scratch.home, sandboxed=False).output  # the probe reads them
    (data / "flashcode.db").write_text(SECRET + "\n")
    for project in (scratch.home, scratch.home / ".local"):
        ran = run_command(command, project, policy=SandboxPolicy(project, hidden=(data,)))
        assert SECRET not in ran.output, ran.output
        assert (data / "flashcode.db").read_text() == SECRET + "\n"
        assert (project / "inside.txt").read_text() == "ok\n", ran.output  # the project is still writable


def test_another_data_directory_inside_the_project_is_hidden(scratch: Scratch) -> None:
    """Only the server's own data directory was hidden: a second one inside the project (another
    FLASHCODE_HOME, another --data-dir) was writable, so a command approved once planted an allow rule for
    itself there (red-team). Any folder holding flashcode.db or serve.lock is hidden, from commands and from
    the file tools, made before or after the files were looked at."""
    other = scratch.project / "tools" / "fchome"
    other.mkdir(parents=True)
    for i in range(
        30
    ):  # a bigger tree beside it: walked breadth-first, the shallow data directory comes first
        (scratch.project / "node_modules" / f"p{i}" / "a" / "b").mkdir(parents=True)
    (other / "flashcode.db").write_text(SECRET + "\n")
    command = "cat tools/fchome/flashcode.db; echo planted >> tools/fchome/flashcode.db; ls -a tools/fchome"
    assert SECRET in run_command(command, scratch.project, sandboxed=False).output  # the probe reads it
    (other / "flashcode.db").write_text(SECRET + "\n")
    ran = run_command(command, scratch.project)
    assert SECRET not in ran.output and (other / "flashcode.db").read_text() == SECRET + "\n", ran.output
    files = ProjectFiles(scratch.project)
    for path in ("tools/fchome/flashcode.db", "tools/fchome/rules.txt"):
        with pytest.raises(PathOutsideProjectError, match="flashcode data directory"):
            files.resolve(path)
    later = scratch.project / "late"
    later.mkdir()
    (later / "serve.lock").write_text("")  # made after the file tools looked: still refused
    with pytest.raises(PathOutsideProjectError, match="flashcode data directory"):
        files.resolve("late/flashcode.db")
    (later / "notes.txt").write_text("needle in a data directory\n")  # searched: not shown (review)
    (scratch.project / "found.txt").write_text("needle in the project\n")
    assert ReadTools(files).search_text("needle") == "found.txt:1:needle in the project"
    assert files.resolve("tools/other.txt") == scratch.project.resolve() / "tools" / "other.txt"


def test_a_data_directory_that_git_also_takes_for_a_repository_stays_hidden(scratch: Scratch) -> None:
    """The data and the git directories were found by two walks, and a folder in both lists was hidden, then
    mounted again read-only from its real self for git's sake: its database readable (review). One walk now
    finds both; a data directory is hidden whatever else it looks like."""
    both = scratch.project / "both"
    for name in ("objects", "refs"):
        (both / name).mkdir(parents=True)
    (both / "HEAD").write_text("ref: refs/heads/main\n")
    (both / "flashcode.db").write_text(SECRET + "\n")
    ran = run_command("cat both/flashcode.db; ls -a both", scratch.project)
    assert SECRET not in ran.output and "HEAD" not in ran.output, ran.output
    scan = sandbox.scan_project(scratch.project, sandbox.named_git_dirs(scratch.project))  # not its .git
    assert scan.data_dirs == [both.resolve()] and scan.git_dirs == [] and scan.complete


def test_a_data_directory_inside_a_git_directory_stays_hidden(scratch: Scratch) -> None:
    """(review) The walk does not enter a git directory it found, so a data directory inside one went unseen: the
    file tools listed its database, and the git directory's read-only mount, made after the hiding one, showed it
    to commands. Git directories are looked into for data directories, and hiding comes after read-only."""
    git_dir = scratch.project / "vendor" / "lib.git"
    for name in ("objects", "refs"):
        (git_dir / name).mkdir(parents=True)
    (git_dir / "HEAD").write_text("ref: refs/heads/main\n")
    inner = git_dir / "fc"
    inner.mkdir()
    (inner / "flashcode.db").write_text(SECRET + "\n")
    ran = run_command("cat vendor/lib.git/fc/flashcode.db; ls vendor/lib.git", scratch.project)
    assert SECRET not in ran.output and "HEAD" in ran.output, ran.output  # the git directory read-only, shown
    listed = ReadTools(ProjectFiles(scratch.project)).list_files("vendor/lib.git")
    assert "fc" not in listed.split() and "flashcode.db" not in listed, listed


def test_a_project_folder_swapped_for_a_link_runs_and_writes_nothing(scratch: Scratch) -> None:
    """The home-folder rule was checked when a project was added only: a project's folder swapped for a
    symbolic link to the home folder while the server ran, the next command was mounted there read-write and
    wrote `.gitconfig` and `.cargo/env` (run by the next login, outside the sandbox) (red-team). A path that
    now leads elsewhere runs nothing and the file tools write nothing."""
    project = scratch.project
    (project / "a.txt").write_text("here\n")
    files = ProjectFiles(project)
    assert files.resolve("a.txt") == project / "a.txt"
    project.rename(scratch.base / "project-moved")
    project.symlink_to(scratch.home, target_is_directory=True)
    ran = run_command("touch planted-in-home.txt", project)
    assert ran.exit_code is None and "now leads to" in (ran.error or ""), ran
    assert not (scratch.home / "planted-in-home.txt").exists()
    with pytest.raises(FileToolError, match="now leads to"):
        ProjectFiles(project)
    inner = scratch.base / "parent-link"  # a folder above the project swapped: the same
    inner.symlink_to(scratch.base, target_is_directory=True)
    ran = run_command("touch x.txt", inner / "project-moved")
    assert (
        ran.exit_code is None
        and "now leads to" in (ran.error or "")
        and not (scratch.base / "project-moved" / "x.txt").exists()
    )


def test_a_project_folder_swapped_after_its_check_is_never_mounted_where_the_link_leads(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder was checked (`pinned_project`), then bound by its name: swapped for a link to the home folder
    between the two, the command was mounted there read-write (review). The writable folders are bound from
    descriptors opened as they were checked, so the swap makes the command fail to start, or it writes in the
    folder that was checked (moved), never where the link leads. The same for a folder inside the project
    that is bound writable (a pin above a hidden secret)."""
    project = scratch.project
    for name in ("objects", "refs"):  # a git directory with no .git in its name: read-only, `deep` its pin
        (project / "deep" / "inner" / name).mkdir(parents=True)
    (project / "deep" / "inner" / "HEAD").write_text("ref: refs/heads/main\n")
    real_scan = sandbox.scan_project
    swapped: list[str] = []

    def swap_then_walk(
        folder: Path, skip: list[Path]
    ) -> sandbox.ProjectScan:  # builds the arguments, after the check
        found = real_scan(folder, skip)
        if not swapped:
            swapped.append("project")
            project.rename(scratch.base / "project-moved")  # a relative link: bubblewrap's mount follows it
            project.symlink_to(os.path.relpath(scratch.home, project.parent), target_is_directory=True)
        return found

    monkeypatch.setattr(sandbox, "scan_project", swap_then_walk)
    ran = run_command("touch planted-in-home.txt", project)
    assert swapped and not (scratch.home / "planted-in-home.txt").exists(), ran
    assert ran.exit_code != 0 or (scratch.base / "project-moved" / "planted-in-home.txt").exists(), ran

    project.unlink()
    (scratch.base / "project-moved").rename(project)
    (scratch.home / "deep" / "inner").mkdir(parents=True)  # what the old code's binds by name then found
    swapped.clear()

    def swap_inner_then_walk(folder: Path, skip: list[Path]) -> sandbox.ProjectScan:
        found = real_scan(folder, skip)
        if not swapped:
            swapped.append("deep")
            (project / "deep").rename(project / "deep-moved")
            (project / "deep").symlink_to(
                os.path.relpath(scratch.home / "deep", project), target_is_directory=True
            )
        return found

    monkeypatch.setattr(sandbox, "scan_project", swap_inner_then_walk)
    ran = run_command("touch deep/planted.txt", project)
    assert swapped and not (scratch.home / "deep" / "planted.txt").exists(), ran
    assert ran.exit_code is None and "changed while the command was being set up" in (ran.error or ""), ran


def test_a_project_inside_a_hidden_folder_works_and_the_rest_of_it_stays_hidden(scratch: Scratch) -> None:
    """The scratch project lives in the data directory, which commands must not see otherwise."""
    data = scratch.base / "flashcode-data"
    project = data / "projects" / "scratch"
    project.mkdir(parents=True)
    (data / "flashcode.db").write_text(SECRET)
    ran = run_command(
        f"echo ok > inside.txt && cat inside.txt; echo listing $(ls -A {data}); cat {data}/flashcode.db",
        project,
        policy=SandboxPolicy(project, hidden=(data,)),
    )
    assert "ok" in ran.output and (project / "inside.txt").read_text() == "ok\n", ran.output
    assert SECRET not in ran.output and "listing projects\n" in ran.output, ran.output


IO_URING = (
    "{py} -c 'import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); p = ctypes.create_string_buffer(120); "
    'fd = libc.syscall(425, 4, p); print("io_uring", fd, os.strerror(ctypes.get_errno()) if fd < 0 else "ok")\''
)


def test_io_uring_is_refused(scratch: Scratch) -> None:
    """io_uring's IORING_OP_SOCKET makes sockets inside the kernel, where the filter on socket(2) never
    sees them (a unix socket to docker.sock or the session bus): the whole interface is refused."""
    ran = run_command(scratch.subst(IO_URING), scratch.project)
    assert "io_uring -1 Operation not permitted" in ran.output, ran.output


def test_with_the_network_on_and_no_slirp4netns_nothing_runs(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharing this machine's network instead would put flashcode's port in reach: the command is not run,
    and the error says what to install or switch off."""
    import shutil

    which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **k: None if name == "slirp4netns" else which(name, *a, **k)
    )
    ran = run_command("touch ran.txt", scratch.project, network=True)
    assert ran.exit_code is None and not (scratch.project / "ran.txt").exists()
    assert (
        ran.error is not None and "slirp4netns is not installed" in ran.error and "network off" in ran.error
    )
    assert run_command("touch ran.txt", scratch.project).exit_code == 0  # with the network off it runs


def test_a_folder_that_leads_to_a_hidden_path_cannot_be_renamed_away(scratch: Scratch) -> None:
    """Project ~/.local holds the data directory (~/.local/share/flashcode), project ~/.config holds git
    credentials: renaming a folder on the way would carry the hiding mount off with it, and the next command
    would find the secret under the new name with nothing over it."""
    data = scratch.home / ".local" / "share" / "flashcode"
    data.mkdir(parents=True)
    (data / "flashcode.db").write_text(SECRET + "\n")
    creds = scratch.home / ".config" / "git" / "credentials"
    creds.parent.mkdir(parents=True)
    creds.write_text(SECRET + "\n")
    for project, folder, read in [
        (scratch.home / ".local", "share", "share2/flashcode/flashcode.db"),
        (scratch.home / ".config", "git", "g2/credentials"),
    ]:
        policy = SandboxPolicy(project, hidden=(data,))
        moved = run_command(
            f"mv {folder} {folder.replace('share', 'share2').replace('git', 'g2')}", project, policy=policy
        )
        assert moved.exit_code != 0 and "busy" in moved.output.lower(), moved.output
        ran = run_command(f"cat {read}; ls -A {folder}; echo ok > inside.txt", project, policy=policy)
        assert SECRET not in ran.output and (project / "inside.txt").read_text() == "ok\n", ran.output
    assert (data / "flashcode.db").read_text() == creds.read_text() == SECRET + "\n"


def test_a_git_directory_named_by_a_git_file_is_read_only(scratch: Scratch) -> None:
    """`git init --separate-git-dir` (and worktrees) leave a `.git` file naming the real git directory: a
    hook planted there would run on the user's next `git commit`, outside the sandbox."""
    project = scratch.base / "sep"
    (project / "meta").mkdir(parents=True)
    git(scratch.base, "init", "-q", f"--separate-git-dir={project / 'meta' / '.repo'}", str(project))
    assert (project / ".git").is_file()
    hook = project / "meta" / ".repo" / "hooks" / "post-commit"
    attempts = [
        f"printf '#!/bin/sh\\ntouch {scratch.outside}/pwned\\n' > {hook} && chmod +x {hook}",
        "mv meta meta2 && mkdir -p meta2/.repo/hooks",
        "mv meta/.repo meta/r2",
        "echo 'gitdir: elsewhere' > .git",
    ]
    for command in attempts:
        ran = run_command(command, project)
        assert ran.exit_code != 0, (command, ran.output)
    assert not hook.exists() and (project / ".git").read_text().startswith("gitdir:")
    git(project, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "--allow-empty", "-m", "later")
    assert scratch.breaches() == []


def test_where_git_config_points_git_is_read_only(scratch: Scratch) -> None:
    """A review: with `core.hooksPath = .husky` (husky's setup) a command wrote `.husky/pre-commit`, and the
    user's next `git commit` ran it outside the sandbox; a file `include.path` names is config as well (its
    `core.fsmonitor` runs at `git status`). Both are read-only to commands, as `.git` is; the rest is not."""
    project = scratch.base / "husky"
    project.mkdir()
    git(project, "init", "-q")
    git(project, "config", "core.hooksPath", ".husky")
    git(project, "config", "include.path", "../team.gitconfig")
    (project / ".husky").mkdir()
    (project / ".husky" / "pre-commit").write_text("true\n")
    (project / "team.gitconfig").write_text("[user]\n\tname = team\n")
    attempts = [
        f"printf 'touch {scratch.outside}/pwned\\n' > .husky/pre-commit",
        f"printf '#!/bin/sh\\ntouch {scratch.outside}/pwned\\n' > .husky/post-commit && chmod +x .husky/post-commit",
        "mv .husky husky2",
        f"printf '[core]\\n\\tfsmonitor = touch {scratch.outside}/pwned\\n' >> team.gitconfig",
        "mv team.gitconfig t2",
    ]
    for command in attempts:
        ran = run_command(command, project)
        assert ran.exit_code != 0, (command, ran.output)
    assert (project / ".husky" / "pre-commit").read_text() == "true\n"
    assert not (project / ".husky" / "post-commit").exists()
    assert "fsmonitor" not in (project / "team.gitconfig").read_text()
    ran = run_command("echo ok > notes.txt", project)
    assert ran.exit_code == 0 and (project / "notes.txt").read_text() == "ok\n"
    git(project, "-c", "user.email=u@x", "commit", "-q", "--allow-empty", "-m", "later")
    git(project, "status", "--short")
    assert scratch.breaches() == []


def test_hooks_of_a_worktree_a_submodule_and_husky_9_are_read_only(scratch: Scratch) -> None:
    """A review: the hooks of a linked worktree opened as the project (its config lies in the main repository,
    outside it), of a submodule inside it, and husky 9's scripts (`.husky/_` stubs run `.husky/<hook>`) were
    all writable, and each ran at the next `git commit`."""
    main = scratch.base / "main"
    main.mkdir()
    git(main, "init", "-q")
    git(main, "-c", "user.email=u@x", "commit", "-q", "--allow-empty", "-m", "0")
    git(main, "config", "core.hooksPath", ".husky")
    wt = scratch.base / "wt"
    git(main, "worktree", "add", "-q", str(wt))
    (wt / ".husky").mkdir()
    ran = run_command(f"printf '#!/bin/sh\\ntouch {scratch.outside}/pwned\\n' > .husky/pre-commit", wt)
    assert ran.exit_code != 0 and "Read-only" in ran.output, ran.output

    project = scratch.base / "super"
    project.mkdir()
    git(project, "init", "-q")
    (project / ".git" / "modules").mkdir()
    git(
        project,
        "init",
        "-q",
        f"--separate-git-dir={project / '.git' / 'modules' / 'sub'}",
        str(project / "sub"),
    )
    git(project / "sub", "config", "core.hooksPath", ".githooks")
    (project / "sub" / ".githooks").mkdir()
    ran = run_command("echo 'touch /tmp/x' > sub/.githooks/pre-commit", project)
    assert ran.exit_code != 0 and "Read-only" in ran.output, ran.output

    husky = scratch.base / "h9"
    (husky / ".husky" / "_").mkdir(parents=True)
    git(husky, "init", "-q")
    git(husky, "config", "core.hooksPath", ".husky/_")
    (husky / ".husky" / "_" / "h").write_text("#!/usr/bin/env sh\n")
    (husky / ".husky" / "pre-commit").write_text("npm test\n")
    ran = run_command("echo 'touch /tmp/x' > .husky/pre-commit", husky)
    assert ran.exit_code != 0 and (husky / ".husky" / "pre-commit").read_text() == "npm test\n", ran.output
    ran = run_command("echo ok > notes.txt", husky)
    assert ran.exit_code == 0, ran.output
    assert scratch.breaches() == []


def test_a_commands_own_env_is_set_inside_and_never_on_a_command_line(scratch: Scratch) -> None:
    """An MCP server's env (an API key) reaches the server inside the sandbox, and no value shows in a
    command line (bubblewrap's, which any process can read, and which the sandbox's pid 1 is)."""
    from webapp.agent.sandbox import command_env, launch

    for network in (False, True):
        policy = SandboxPolicy(scratch.project, network=network)
        command = ["bash", "-c", 'echo "key=$MCP_T_KEY"; tr "\\0" " " < /proc/1/cmdline']
        with launch(command, policy, env={"MCP_T_KEY": SECRET, "MCP_T_ODD": "a b\n--seccomp 9"}) as (
            argv,
            fds,
        ):
            assert SECRET not in " ".join(argv)
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=60, env=command_env(), pass_fds=fds
            )
        assert done.stdout.startswith(f"key={SECRET}\n") and "--args" in done.stdout, (
            done.stdout + done.stderr
        )
        assert done.stdout.count(SECRET) == 1, done.stdout


@pytest.mark.parametrize("network", [False, True])
def test_the_folders_descriptors_mount_the_project_and_never_reach_the_command(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch, network: bool
) -> None:
    """The writable folders are bound from descriptors (`--bind-fd`). One left open in the command would be a
    way out: `openat(fd, "../..")` walks the host's tree, where nothing is read-only or hidden. bubblewrap
    closes each after its mount; the command holds only its own. Without `--bind-fd` (bubblewrap before 0.7)
    the folders are bound by name, and commands still write in the project."""
    from webapp.agent.sandbox import argv_fds, command_env, launch

    (scratch.project / "deep" / "inner" / "objects").mkdir(parents=True)  # a pin: `deep`
    (scratch.project / "deep" / "inner" / "HEAD").write_text("ref: refs/heads/main\n")
    policy = SandboxPolicy(scratch.project, network=network)
    command = ["bash", "-c", "touch made deep/made && for f in /proc/self/fd/*; do readlink $f; done; true"]
    for binds_fds in (True, False):
        monkeypatch.setattr(sandbox, "_binds_from_fds", lambda _bwrap, on=binds_fds: on)
        with launch(command, policy) as (argv, fds):
            head = argv[: argv.index("--")]
            assert ("--bind-fd" in head) is binds_fds and ("--bind" in head) is not binds_fds, head
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=60, env=command_env(), pass_fds=fds
            )
        assert done.returncode == 0, done.stderr
        assert (scratch.project / "made").exists() and (scratch.project / "deep" / "made").exists()
        held = done.stdout.splitlines()  # /dev/null and pipes: no folder
        assert held and not any(line.startswith(str(scratch.base)) or line == "/" for line in held), held
        (scratch.project / "made").unlink()
        (scratch.project / "deep" / "made").unlink()
    assert argv_fds(["bwrap", "--bind-fd", "7", "/p", "--", "tool", "--bind-fd", "7"], 7) == [2]


def _plant(folder: Path, name: str, marker: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f'#!/bin/sh\necho planted > {marker}\nexec /usr/bin/{name} "$@"\n')
    (folder / name).chmod(0o755)


@pytest.mark.parametrize("network", [False, True])
def test_the_sandbox_shell_and_rg_are_never_programs_found_in_the_project(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch, network: bool
) -> None:
    """A server started from a virtual environment inside the project has its bin on PATH: a command
    (allowed by a rule) writes `bwrap`, `bash` or `rg` there, and flashcode would run it, unsandboxed, at
    the next command or search. The programs flashcode runs outside the sandbox come from elsewhere."""
    from webapp.agent.files import ProjectFiles
    from webapp.agent.sandbox import system_program
    from webapp.agent.tools import ReadTools

    venv_bin = scratch.project / ".venv" / "bin"
    marker = scratch.outside / "ESCAPED"
    for name in ("bwrap", "bash", "rg", "slirp4netns", "python3"):
        _plant(venv_bin, name, marker)
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    for name in ("bwrap", "bash", "rg"):
        found = system_program(name, scratch.project)
        assert found is None or not Path(found).resolve().is_relative_to(scratch.project.resolve()), found
    ran = run_command("echo inside", scratch.project, network=network)
    assert "inside" in ran.output and not marker.exists(), ran.output
    ReadTools(ProjectFiles(scratch.project)).search_text("victim")
    assert not marker.exists()


def test_flashcode_own_environment_in_the_project_is_read_only_for_commands_and_file_tools(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flashcode's own virtual environment inside the project: a `.pth` file written there would run at its
    next start (or its next network-on command, through usernet.py), outside the sandbox."""
    from webapp.agent import files as files_mod
    from webapp.agent import sandbox as sandbox_mod
    from webapp.agent.files import FileToolError, ProjectFiles

    site = scratch.project / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    own = [(scratch.project / ".venv").resolve()]
    monkeypatch.setattr(sandbox_mod, "own_paths", lambda: own)
    monkeypatch.setattr(files_mod, "own_paths", lambda: own)
    ran = run_command(
        "echo 'import os' > .venv/lib/site-packages/zz.pth; echo ok > inside.txt", scratch.project
    )
    assert not (site / "zz.pth").exists(), ran.output
    assert (scratch.project / "inside.txt").read_text() == "ok\n", ran.output  # the rest stays writable
    tools = ProjectFiles(scratch.project)
    with pytest.raises(FileToolError, match="own Python environment"):
        tools.propose_write(".venv/lib/site-packages/zz.pth", "import os\n")


def test_hugging_face_stored_tokens_and_codex_credentials_are_hidden(scratch: Scratch) -> None:
    for relative in (".cache/huggingface/stored_tokens", ".codex/auth.json"):
        path = scratch.home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SECRET + "\n")
    ran = run_command("cat ~/.cache/huggingface/stored_tokens ~/.codex/auth.json", scratch.project)
    assert SECRET not in ran.output, ran.output
