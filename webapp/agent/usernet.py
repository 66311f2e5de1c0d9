"""Network for a sandboxed command, without this machine's own services: `python usernet.py BWRAP-ARGV`.

With the project's network switch on, a command still gets a network namespace of its own (bubblewrap's
`--unshare-net`), and slirp4netns connects it to the outside through this machine's sockets, with
`--disable-host-loopback` (and its own sandbox and seccomp filter: it parses the command's packets).
Sharing the host's network instead would let a command reach every service listening on loopback: flashcode itself first (on loopback it needs no token), where the command could
open a project anywhere, switch the network on and approve its own next command, outside the sandbox's
one writable folder. Here 127.0.0.1 is the sandbox's own loopback, the host's loopback (10.0.2.2) is
refused, and the rest of the network works (DNS through slirp4netns's resolver, 10.0.2.3, when the host's
resolver is on loopback).

How: bubblewrap starts with `--info-fd` (it tells the sandbox's pid) and `--block-fd` (the command waits
before it starts); once bubblewrap has set the sandbox's loopback up, slirp4netns joins the sandbox's
network namespace and adds `tap0`, and the command is let go. slirp4netns stops with the command, or with
this process (`--exit-fd`, also when it is killed). A file of the standard library only, run with
`python -I` (no package import on every command). The exit status is bubblewrap's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SLIRP_DNS = "10.0.2.3"  # slirp4netns's resolver inside the namespace
# from the system's folders only, as sandbox.SYSTEM_DIRS (this script runs isolated, -I, and imports nothing
# of flashcode): never one a command could have written into a project on the PATH
SLIRP4NETNS = (
    shutil.which("slirp4netns", path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin") or "slirp4netns"
)
LOOPBACK_WAIT_S = 10.0  # bubblewrap sets the sandbox's loopback up (a loaded machine may be slow)
READY_WAIT_S = 30.0
NOT_STARTED = 126  # the shell's "found but could not run"


def fail(message: str) -> int:
    print(f"flashcode: the command's network could not be set up: {message}", file=sys.stderr, flush=True)
    return NOT_STARTED


def child_pid(fd: int) -> int | None:
    """The sandbox's pid from bubblewrap's --info-fd (None: bubblewrap ended before it said)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except ValueError:
            continue
    return None


def loopback_ready(pid: int) -> bool:
    """Whether bubblewrap has given the sandbox's loopback its address (slirp4netns must not race it)."""
    try:
        with open(f"/proc/{pid}/net/fib_trie", "rb") as f:
            return b"127.0.0.1" in f.read()
    except OSError:
        return False


def resolv_conf() -> bytes | None:
    """/etc/resolv.conf with loopback name servers (systemd-resolved's 127.0.0.53, a local dnsmasq) pointed
    at slirp4netns's resolver; None when it names none."""
    try:
        with open("/etc/resolv.conf", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return f"nameserver {SLIRP_DNS}\n".encode()
    fixed = re.sub(r"(?m)^(\s*nameserver\s+)(127\.\S*|::1)\s*$", rf"\g<1>{SLIRP_DNS}", text)
    return None if fixed == text else fixed.encode()


def main(argv: list[str]) -> int:
    if argv[1:4] != ["--ro-bind", "/", "/"] or "--unshare-net" not in argv:
        return fail(
            "usage: usernet.py BWRAP --ro-bind / / ... --unshare-net ... -- COMMAND (sandbox.py's argv)"
        )
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    extra = ["--info-fd", str(info_w), "--block-fd", str(block_r)]
    fds = [info_w, block_r]
    conf = resolv_conf()
    if conf is not None:
        data = tempfile.TemporaryFile()
        data.write(conf)
        data.seek(0)
        extra += [
            "--ro-bind-data",
            str(data.fileno()),
            "/etc/resolv.conf",
        ]  # after `--ro-bind / /`, or it is covered
        fds.append(data.fileno())
    for fd in fds:
        os.set_inheritable(fd, True)
    try:  # no pass_fds: what this process inherited (the seccomp program) goes on to bubblewrap as well
        proc = subprocess.Popen([*argv[:4], *extra, *argv[4:]], close_fds=False)
    except OSError as exc:
        return fail(f"{argv[0]}: {exc.strerror or exc}")
    for fd in (info_w, block_r):
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    slirp = None
    try:
        pid = child_pid(info_r)
        if pid is None:
            return status(proc.wait())
        deadline = time.monotonic() + LOOPBACK_WAIT_S
        while not loopback_ready(pid):
            if proc.poll() is not None:
                return status(proc.returncode)
            if time.monotonic() > deadline:
                proc.kill()
                return fail("the sandbox's loopback did not come up")
            time.sleep(0.002)
        ready_r, ready_w = os.pipe()
        exit_r, _exit_w = os.pipe()  # slirp4netns stops once this end closes (this process gone)
        with tempfile.TemporaryFile() as log:
            try:
                slirp = subprocess.Popen(
                    [SLIRP4NETNS, "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox",
                     "--enable-seccomp", "--ready-fd", str(ready_w), "--exit-fd", str(exit_r), str(pid), "tap0"],
                    pass_fds=(ready_w, exit_r), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                )  # fmt: skip
            except OSError as exc:
                proc.kill()
                return fail(f"slirp4netns: {exc.strerror or exc}")
            finally:
                os.close(ready_w)
                os.close(exit_r)
            ready = wait_ready(ready_r)
            if not ready:
                proc.kill()
                log.seek(0)
                said = log.read().decode("utf-8", "replace").strip().splitlines()[-1:] or ["no answer"]
                return fail(f"slirp4netns: {said[0]}")
        os.write(block_w, b"1")
        return status(proc.wait())
    finally:
        os.close(block_w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if slirp is not None and slirp.poll() is None:
            slirp.terminate()
            try:
                slirp.wait(5)
            except subprocess.TimeoutExpired:
                slirp.kill()


def wait_ready(fd: int) -> bool:
    """slirp4netns writes "1" to --ready-fd once tap0 is configured."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        if not sel.select(READY_WAIT_S):
            return False
    return os.read(fd, 1) == b"1"


def status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
