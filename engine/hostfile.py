"""The hostfile of `--hosts`: the machines a model is split over (engine/pipeline.py for MLX, and
engine/llama_rpc.py for llama.cpp's RPC). MLX's own format (`mlx.distributed_config`'s JSON:
{"hosts": [{"ssh", "ips"}]}) or a JSON list of addresses; the first host is this machine. No MLX here.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import EngineError

RPC_PORT = 50052  # llama.cpp's rpc-server default


@dataclass(frozen=True)
class Host:
    ssh: str  # how mlx.launch reaches it (a local address runs locally, no ssh)
    ip: str  # the address the ring backend's links use
    port: int = RPC_PORT  # llama.cpp RPC: where its rpc-server listens ("IP:PORT", or "rpc_port")

    @property
    def endpoint(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


def load_hostfile(path: str | Path) -> list[Host]:
    """The hosts of an MLX hostfile (`mlx.distributed_config`'s JSON: {"hosts": [{"ssh", "ips"}]}), or a
    JSON list of addresses. The first host is rank 0 and must be this machine. Clear errors otherwise."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise EngineError(f"cannot read the hostfile {p}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise EngineError(f"the hostfile {p} is not JSON ({exc}): see docs/distributed.md") from exc
    entries = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise EngineError(f'the hostfile {p} needs a "hosts" list: see docs/distributed.md')
    hosts = []
    for i, e in enumerate(entries):
        port: Any = RPC_PORT
        if isinstance(e, str):
            ip, sep, port_text = e.rpartition(":") if e.count(":") == 1 else ("", "", "")
            ip, port = (ip, port_text) if sep else (e, RPC_PORT)
            e = {"ssh": ip, "ips": [ip], "rpc_port": port}
        ips = e.get("ips") if isinstance(e, dict) else None
        if not ips or not isinstance(ips, list):
            raise EngineError(f"host {i + 1} of {p} has no IP address (the ring backend needs one)")
        try:
            ipaddress.ip_address(ips[0])
        except ValueError as exc:
            raise EngineError(f"host {i + 1} of {p}: {ips[0]!r} is not an IP address") from exc
        port = e.get("rpc_port", RPC_PORT)
        if not str(port).isdigit() or not 0 < int(port) < 65536:
            raise EngineError(f"host {i + 1} of {p}: {port!r} is not a port number")
        hosts.append(Host(ssh=str(e.get("ssh") or ips[0]), ip=str(ips[0]), port=int(port)))
    if len(hosts) < 2:
        raise EngineError(f"the hostfile {p} names {len(hosts)} host(s): a pipeline needs at least 2")
    hostfile_backend(p)  # a backend mx.distributed has, or a clear error now
    if not is_local(hosts[0].ip):
        raise EngineError(
            f"the first host of {p} ({hosts[0].ip}) must be this machine: rank 0 streams to this server"
        )
    return hosts


def is_local(ip: str) -> bool:
    """Whether `ip` is an address of this machine."""
    addr = ipaddress.ip_address(ip)
    if addr.is_loopback:
        return True
    try:
        import psutil

        return any(a.address == ip for addrs in psutil.net_if_addrs().values() for a in addrs)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return False


# mx.distributed's backends that mlx.launch starts: ring (TCP, everywhere), JACCL (RDMA over Thunderbolt 5
# between Macs; the hostfile lists each host's "rdma" devices), NCCL (CUDA GPUs)
DIST_BACKENDS = ("ring", "jaccl", "jaccl-ring", "nccl")


def hostfile_backend(path: str | Path) -> str:
    """The hostfile's `"backend"` (MLX's key), ring when it names none."""
    p = Path(path).expanduser()
    data = json.loads(p.read_text())
    backend = str(data.get("backend") or "ring") if isinstance(data, dict) else "ring"
    if backend not in DIST_BACKENDS:
        raise EngineError(
            f"the hostfile {p} names backend {backend!r}: use one of {', '.join(DIST_BACKENDS)}"
        )
    return backend


def mlx_hostfile(hosts: list[Host], path: str | Path | None = None, backend: str = "ring") -> dict[str, Any]:
    """The hostfile mlx.launch reads: the user's own when it is in MLX's form (its "rdma" devices and
    "envs" kept), else one made from the addresses."""
    data = json.loads(Path(path).expanduser().read_text()) if path is not None else None
    if isinstance(data, dict):
        return {**data, "backend": backend, "envs": list(data.get("envs") or [])}
    return {"backend": backend, "envs": [], "hosts": [{"ssh": h.ssh, "ips": [h.ip]} for h in hosts]}
