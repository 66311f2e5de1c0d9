"""Run one approved shell command in the project directory: sandboxed, streamed, capped, timed, killable.

What it knows: how to start `bash -c COMMAND` inside the OS sandbox (`sandbox.py`) in its own process
group (so a timeout or a kill takes its children too), with a clean environment, stream stdout/stderr
as they come, cap what is kept, and report the exit status. What it does not know: whether the command
should run — callers ask `shell.py` and the user first. It never runs a command that was not handed
to it explicitly, and runs one outside the sandbox only when the caller passes `sandbox=None`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .sandbox import (
    NetworkUnavailableError,
    ProjectMovedError,
    SandboxPolicy,
    SandboxUnavailableError,
    command_env,
    detect,
    launch,
    system_program,
)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_OUTPUT_CAP = 64_000  # characters kept across stdout and stderr
KILL_GRACE_S = 1.0


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr"]
    text: str
    type: str = "output"


@dataclass(frozen=True)
class CommandExit:
    exit_code: int | None  # None when it never started
    timed_out: bool = False
    killed: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    error: str | None = None  # could not start (no such directory, ...)
    stopped_why: str = "stopped by the user"  # a kill's reason (the page closed: `CommandRun.kill`)
    type: str = "exit"

    def describe(self) -> str:
        if self.error:
            return f"could not run: {self.error}"
        if self.timed_out:
            return f"timed out after {self.duration_s:.0f} s and was stopped"
        if self.killed:
            return self.stopped_why
        return f"exit code {self.exit_code}"


def shell_path(project_dir: Path | None = None) -> str:
    """bash as the command runs it: never a program found in the project (`system_program`)."""
    return system_program("bash", project_dir) or "/bin/sh"


class CommandRun:
    """One run. Iterate `stream()` once; `kill()` from anywhere on the same loop stops it."""

    def __init__(
        self,
        command: str,
        cwd: Path,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        sandbox: SandboxPolicy | None = None,
    ) -> None:
        self.command = command
        self.cwd = Path(cwd)
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.output_cap = output_cap
        self.output: list[OutputChunk] = []  # what was kept, for the model's summary
        self._kept = 0
        self._truncated = False
        self._killed = asyncio.Event()
        self._kill_reason = "stopped by the user"
        self._proc: asyncio.subprocess.Process | None = None

    def kill(self, reason: str = "stopped by the user") -> None:
        """Stop the command's whole process group; `reason`: why, as its result says (a reload while it ran was
        "stopped by the user": walkthrough)."""
        self._kill_reason = reason
        self._killed.set()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @contextlib.contextmanager
    def launch(self, tmp_dir: Path | None = None) -> Iterator[tuple[list[str], tuple[int, ...]]]:
        """What is executed, `bash -c COMMAND` inside the sandbox unless none was asked for, and the
        descriptors to pass to it; spawn inside the `with`."""
        argv = [shell_path(self.sandbox.project_dir if self.sandbox else self.cwd), "-c", self.command]
        if self.sandbox is None:
            yield argv, ()
            return
        with launch(argv, self.sandbox, tmp_dir) as launched:
            yield launched

    async def stream(self) -> AsyncIterator[OutputChunk | CommandExit]:
        with tempfile.TemporaryDirectory(prefix="flashcode-cmd-") as tmp:
            async for item in self._stream(Path(tmp)):
                yield item

    async def _stream(self, tmp_dir: Path) -> AsyncIterator[OutputChunk | CommandExit]:
        t0 = time.monotonic()
        env = command_env(project_dir=self.cwd)
        if self.sandbox is None or detect().kind == "sandbox-exec":
            env["TMPDIR"] = str(tmp_dir)  # bubblewrap mounts an empty /tmp of the command's own instead
        try:
            if self.sandbox is not None and not self.cwd.is_dir():
                raise FileNotFoundError(2, "No such file or directory")
            with contextlib.ExitStack() as stack:
                # the sandbox's arguments walk the project (its git directories): off the event loop
                argv, pass_fds = await asyncio.to_thread(stack.enter_context, self.launch(tmp_dir))
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=self.cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                    env=env,
                    pass_fds=pass_fds,
                )
        except (NetworkUnavailableError, ProjectMovedError) as exc:
            yield CommandExit(None, error=f"not run: {exc}")
            return
        except SandboxUnavailableError as exc:
            yield CommandExit(None, error=f"no sandbox: {exc}")
            return
        except OSError as exc:
            yield CommandExit(None, error=f"{exc.strerror or exc} ({self.cwd})")
            return
        self._proc = proc
        queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        readers = [
            asyncio.create_task(self._read(proc.stdout, "stdout", queue)),
            asyncio.create_task(self._read(proc.stderr, "stderr", queue)),
        ]
        waiter = asyncio.create_task(self._watch(proc))
        open_streams = 2
        try:
            while open_streams:
                chunk = await queue.get()
                if chunk is None:
                    open_streams -= 1
                else:
                    yield chunk
            reason = await waiter
        finally:
            if not waiter.done():  # the consumer went away: stop the process
                self._terminate_group(proc)
                waiter.cancel()
            for r in readers:
                r.cancel()
        code = proc.returncode
        yield CommandExit(
            code,
            timed_out=reason == "timeout",
            killed=reason == "killed",
            truncated=self._truncated,
            duration_s=time.monotonic() - t0,
            stopped_why=self._kill_reason,
        )

    async def _watch(self, proc: asyncio.subprocess.Process) -> str:
        """Wait for exit, a kill request or the timeout; stop the whole group in the latter cases."""
        exited = asyncio.create_task(proc.wait())
        killed = asyncio.create_task(self._killed.wait())
        done, _ = await asyncio.wait(
            {exited, killed}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        reason = "exit" if exited in done else ("killed" if killed in done else "timeout")
        killed.cancel()
        if reason != "exit":
            self._terminate_group(proc)
            try:
                await asyncio.wait_for(asyncio.shield(exited), KILL_GRACE_S)
            except TimeoutError:
                self._signal_group(proc, signal.SIGKILL)
                await exited
        else:
            self._signal_group(proc, signal.SIGKILL)  # leftovers it put in the background
        return reason

    def _terminate_group(self, proc: asyncio.subprocess.Process) -> None:
        self._signal_group(proc, signal.SIGTERM)

    @staticmethod
    def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    async def _read(
        self,
        pipe: asyncio.StreamReader | None,
        name: Literal["stdout", "stderr"],
        queue: asyncio.Queue[OutputChunk | None],
    ) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            while pipe is not None:
                data = await pipe.read(4096)
                text = decoder.decode(data, final=not data)
                if not data and not text:
                    break
                room = self.output_cap - self._kept
                if room <= 0:
                    self._truncated = True
                    continue  # keep draining so the process does not block on a full pipe
                if len(text) > room:
                    text, self._truncated = text[:room], True
                self._kept += len(text)
                chunk = OutputChunk(name, text)
                self.output.append(chunk)
                await queue.put(chunk)
        finally:
            await queue.put(None)

    def transcript(self) -> str:
        return "".join(c.text for c in self.output)
