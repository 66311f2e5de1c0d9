"""Run-time settings of one flashcode process (from the CLI, or built by tests), and the host names
that decide which origins are this server's own.

What it knows: where the server listens, where its data lives, which engine and model it starts
with, the default sampling of a chat reply, and what counts as loopback. What it does not know:
HTTP, the database, engines (it only names them).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from engine import paths
from engine.models import DEFAULT_MODEL

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=1)
def local_host_names() -> frozenset[str]:
    """This machine's names and addresses: what a browser elsewhere may call a wildcard-bound server."""
    names = {socket.gethostname()}
    if "." not in socket.gethostname():
        names.add(f"{socket.gethostname()}.local")  # mDNS (macOS, avahi)
    try:
        for addrs in psutil.net_if_addrs().values():
            names.update(a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    except Exception as exc:  # noqa: BLE001 - no interface list: the names above still work
        log.debug("could not list network addresses: %s", exc)
    return frozenset(n for n in names if n and "%" not in n)  # no scoped (link-local) IPv6


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def default_sampling() -> dict[str, Any]:
    return {"temperature": 0.7, "max_tokens": 1024}


def default_agent_sampling() -> dict[str, Any]:
    """An agent turn's, unless the user set them (as `flashcode agent`'s: a small model calling tools does
    best greedy; sampled at 0.7 the 0.5B agent model wandered from the task)."""
    return {"temperature": 0.0, "max_tokens": 512}


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(default_factory=paths.home)
    backend: str = "auto"  # auto: picked per platform (webapp.engine_host.default_backend)
    model: str = DEFAULT_MODEL
    backend_options: dict[str, Any] = field(default_factory=dict)
    load_model: bool = True  # tests may build an app without loading a model
    extra_origins: tuple[str, ...] = ()  # --allow-origin: e.g. http://my-mac.local:8000 with --host 0.0.0.0
    token: str | None = None  # access token (webapp.security); bound beyond loopback, one is always set
    sampling: dict[str, Any] = field(default_factory=default_sampling)  # a chat reply's, unless overridden
    # over `sampling`, in agent mode
    agent_sampling: dict[str, Any] = field(default_factory=default_agent_sampling)
    project_dir: Path | None = None  # where the agent works; None: the directory serve was started in

    @property
    def is_loopback(self) -> bool:
        """Whether the server is bound to loopback: the only thing that makes a request 'local'."""
        return self.host in LOOPBACK_HOSTS or is_loopback_host(self.host)

    @property
    def foreign_origins(self) -> tuple[str, ...]:
        """--allow-origin entries on another machine's name: pages there use this server, typically
        through a reverse proxy in front of a loopback bind (where every request comes from 127.0.0.1)."""
        return tuple(o for o in self.extra_origins if not is_loopback_host(urlsplit(o).hostname or ""))

    @property
    def local_only(self) -> bool:
        """Bound to loopback and used only by pages on this machine: the one case with no token."""
        return self.is_loopback and not self.foreign_origins

    @property
    def allowed_origins(self) -> set[str]:
        hosts = {self.host} | (LOOPBACK_HOSTS if self.is_loopback else set())
        if self.host in WILDCARD_HOSTS:  # bound to every interface: its loopback and its own names
            hosts |= LOOPBACK_HOSTS | local_host_names()
        out = set()
        for h in hosts:
            out.add(f"http://{url_host(h)}:{self.port}")
        return out | {o.rstrip("/") for o in self.extra_origins}
