"""Starting servers for tests and benchmarks: a free port, the app in a thread, `flashcode serve`.

`serve_app(app)` runs a Starlette app under uvicorn on a thread of this process (a scripted engine,
a real browser in front); `serve_cli(home, ...)` runs the real `flashcode serve` in a subprocess
and returns once it printed its URL, which it does once the model is loaded and the socket listens.
Both stop their server on exit (the subprocess: terminate, then kill).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

ROOT = Path(__file__).resolve().parent.parent
FLASHCODE = [sys.executable, "-m", "webapp.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_app(app: Any, port: int, timeout: float = 30.0) -> Iterator[str]:
    """`app` on http://127.0.0.1:`port` (uvicorn on a daemon thread); yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class Served:
    url: str  # as printed: with ?token=... when the server needs one
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def serve_cli(
    home: Path,
    *args: str,
    backend: str = "mlx",
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> Iterator[Served]:
    """`flashcode serve --backend BACKEND --port 0 ARGS` with $FLASHCODE_HOME=`home`; output goes
    to `home`/serve.log. Raises, with the log's tail, if the server dies or prints no URL in time."""
    log = home / "serve.log"
    cmd = [*FLASHCODE, "serve", "--backend", backend, "--port", "0", "--log-level", "warning", *args]
    environ = (os.environ if env is None else env) | {"FLASHCODE_HOME": str(home)}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=environ)
    try:
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"flashcode on (http://\S+)", log.read_text())):
            if proc.poll() is not None:
                raise RuntimeError(f"flashcode serve exited {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"flashcode serve printed no URL in {timeout:.0f} s: {log.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        url = found.group(1)
        port = int(re.search(r":(\d+)", url.split("//", 1)[1]).group(1))  # type: ignore[union-attr]
        yield Served(url, port, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
