"""llama.cpp's RPC backend for `--backend llama --hosts HOSTFILE`: one model's layers over several machines.

Not a cluster of our own: llama.cpp's `rpc-server` (`ggml-rpc-server` in recent builds) runs on each
worker and offers its CPU (or GPU) as a device; the main llama-server gets `--rpc HOST:PORT,...` and
offloads layers to those devices, keeping the first layers itself. flashcode's part: it finds the
rpc-server next to llama-server, starts the workers whose address is this machine (remote workers run
`flashcode rpc-worker` themselves), splits the layers evenly (`-ngl`, `--tensor-split`), restarts a
worker of ours that died before the next turn, and reports each host's layers and memory.

**RPC is not authenticated or encrypted, and an rpc-server runs what it is sent**: it must never face an
untrusted network (docs/distributed.md, docs/security.md). Workers of ours bind only to the address the
hostfile names for them.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import BackendUnavailableError, EngineError
from .hostfile import Host, is_local

log = logging.getLogger(__name__)

RPC_BINARIES = ("ggml-rpc-server", "rpc-server")  # the name changed in llama.cpp in 2025


def find_rpc_server(llama_server: Path | None = None) -> Path:
    """The rpc-server built with this llama-server (beside it), else one on PATH."""
    for name in RPC_BINARIES:
        if llama_server is not None and (beside := Path(llama_server).with_name(name)).is_file():
            return beside
    for name in RPC_BINARIES:
        if found := shutil.which(name):
            return Path(found)
    raise BackendUnavailableError(
        "llama.cpp's rpc-server is not installed: this llama-server was built without RPC. Run `make llama` "
        "(it builds with -DGGML_RPC=ON), or build llama.cpp with -DGGML_RPC=ON and put rpc-server on PATH"
    )


@dataclass(frozen=True)
class LayerPlan:
    n_gpu_layers: int  # -ngl: the last layers (and the output layer) go to the RPC devices
    tensor_split: list[int]  # --tensor-split: each device's share of those layers, in --rpc order
    spans: list[tuple[int, int]]  # each host's blocks [start, end), this machine first


def layer_plan(n_layers: int, n_hosts: int) -> LayerPlan:
    """Split `n_layers` blocks evenly over the hosts in hostfile order, this machine taking the first
    (llama.cpp offloads the last -ngl layers, the output layer counted, to the devices in order)."""
    if n_hosts > n_layers:
        raise EngineError(f"the model has {n_layers} layers: it cannot be split over {n_hosts} hosts")
    base, extra = divmod(n_layers, n_hosts)
    counts = [base + (1 if i < extra else 0) for i in range(n_hosts)]
    spans, start = [], 0
    for c in counts:
        spans.append((start, start + c))
        start += c
    return LayerPlan(n_gpu_layers=n_layers - counts[0] + 1, tensor_split=counts[1:], spans=spans)


def rpc_args(workers: list[Host], plan: LayerPlan, n_gpu_layers: int | None = None) -> list[str]:
    args = ["--rpc", ",".join(h.endpoint for h in workers), "-ngl", str(n_gpu_layers or plan.n_gpu_layers)]
    if len(workers) > 1:
        args += ["--tensor-split", ",".join(str(c) for c in plan.tensor_split)]
    return args


def gguf_layers(path: Path) -> int:
    """The GGUF's block count (its `{arch}.block_count`)."""
    from .gguf import read_gguf

    md = read_gguf(path).metadata
    arch = str(md.get("general.architecture", ""))
    try:
        return int(md[f"{arch}.block_count"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{path} does not say how many layers it has ({arch}.block_count)") from exc


class RpcWorker:
    """An rpc-server we started for a host of the hostfile that is this machine."""

    def __init__(self, binary: Path, host: Host, threads: int | None = None, log_dir: Path | None = None):
        self.binary, self.host, self.threads = binary, host, threads
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        from .llama_server import _set_pdeathsig, _Spawner

        if _listening(self.host):
            raise EngineError(
                f"{self.host.endpoint} is already taken: another rpc-server (or program) listens there; stop it "
                "or give this host another port in the hostfile (IP:PORT)"
            )
        argv = [str(self.binary), "-H", self.host.ip, "-p", str(self.host.port)]
        if self.threads:
            argv += ["-t", str(self.threads)]
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"rpc-server-{self.host.port}.log", "ab")  # noqa: SIM115 - closed below
        try:
            self.proc = _Spawner.popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_set_pdeathsig)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy: a restart must not leak one per start
        deadline = time.monotonic() + timeout
        while not _listening(self.host):
            if self.proc.poll() is not None:
                raise EngineError(
                    f"rpc-server for {self.host.endpoint} exited with code {self.proc.returncode}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"rpc-server for {self.host.endpoint} did not listen within {timeout:.0f} s"
                )
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def peak_rss_bytes(self) -> int:
        from .llama_server import process_peak_rss

        return process_peak_rss(self.proc.pid if self.proc else None)

    def stop(self) -> None:
        from .llama_server import stop_process

        proc, self.proc = self.proc, None
        stop_process(proc)


def _listening(host: Host) -> bool:
    try:
        with socket.create_connection((host.ip, host.port), timeout=0.5):
            return True
    except OSError:
        return False


class RpcCluster:
    """The hosts of a hostfile for llama-server: the workers we start here, the flags, the per-host stats."""

    def __init__(
        self, hosts: list[Host], llama_server: Path, threads: int | None = None, log_dir: Path | None = None
    ):
        self.hosts = hosts
        self.binary = find_rpc_server(llama_server)
        self.workers = [
            RpcWorker(self.binary, h, threads, log_dir) for h in hosts[1:] if is_local(h.ip)
        ]  # this machine's
        self.plan: LayerPlan | None = None
        if any(not ipaddress.ip_address(h.ip).is_loopback for h in hosts[1:]):
            log.warning(
                "llama.cpp RPC is not authenticated or encrypted and its servers run what they are sent: "
                "use --hosts only on a network you trust (docs/distributed.md)"
            )

    def start(self, gguf: Path, n_gpu_layers: int | None = None) -> list[str]:
        """Start our workers; the llama-server flags that use every worker."""
        self.plan = layer_plan(gguf_layers(gguf), len(self.hosts))
        try:
            for w in self.workers:
                w.start()
        except BaseException:
            self.stop()
            raise
        return rpc_args(self.hosts[1:], self.plan, n_gpu_layers)

    def alive(self) -> bool:
        return all(w.alive() for w in self.workers)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def stats(self, main_peak_rss: int) -> list[dict[str, Any]]:
        """Each host, its layers and (for processes on this machine) its peak memory."""
        ours = {w.host: w for w in self.workers}
        spans = self.plan.spans if self.plan else [(0, 0)] * len(self.hosts)
        out = []
        for rank, (h, span) in enumerate(zip(self.hosts, spans, strict=True)):
            rss = main_peak_rss if rank == 0 else (ours[h].peak_rss_bytes() if h in ours else 0)
            row: dict[str, Any] = {
                "rank": rank,
                "host": h.ip if rank == 0 else h.endpoint,
                "layers": list(span),
            }
            if rss:
                row["peak_rss_mb"] = rss >> 20
            out.append(row)
        return out
