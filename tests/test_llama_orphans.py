"""A llama-server never outlives flashcode: the kernel kills it when the process that spawned it dies
(PR_SET_PDEATHSIG from one long-lived spawning thread), with SIGKILL, which a server cannot ignore or hang
in. A CI run had left two llama-servers that survived SIGTERM holding their models 18 minutes later."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SPAWN = """
import sys, time
from engine.llama_server import _Spawner, _set_pdeathsig
child = _Spawner.popen(["bash", "-c", "trap '' TERM; exec sleep 600"], preexec_fn=_set_pdeathsig,
                       start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie is dead, waiting for its new parent to reap it


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_that_ignores_sigterm_dies_with_the_flashcode_that_spawned_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", SPAWN], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    try:
        deadline = (
            time.monotonic() + 30
        )  # bash has run its `trap` once it is `sleep` (a loaded machine is slow)
        while _cmdline(pid) != "sleep 600" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _cmdline(pid) == "sleep 600"
        os.kill(pid, 15)  # SIGTERM is ignored: the stand-in for a server that does not stop on it
        time.sleep(0.3)
        assert _alive(pid)
        parent.kill()  # flashcode dies without running any cleanup of its own
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, 9)
