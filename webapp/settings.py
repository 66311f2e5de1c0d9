"""Run-time settings of one flashcode process (from the CLI, or built by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import paths
from engine.models import DEFAULT_MODEL

from .security import WILDCARD_HOSTS, is_loopback_host, local_host_names

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(default_factory=paths.home)
    backend: str = "auto"  # auto: picked per platform (see webapp.cli.default_backend)
    model: str = DEFAULT_MODEL
    backend_options: dict[str, Any] = field(default_factory=dict)
    load_model: bool = True  # tests may build an app without loading a model
    extra_origins: tuple[str, ...] = ()  # --allow-origin: e.g. http://my-mac.local:8000 with --host 0.0.0.0
    token: str | None = None  # access token (webapp.security); bound beyond loopback, one is always set

    @property
    def is_loopback(self) -> bool:
        """Whether the server is bound to loopback: the only thing that makes a request 'local'."""
        return self.host in LOOPBACK_HOSTS or is_loopback_host(self.host)

    @property
    def allowed_origins(self) -> set[str]:
        hosts = {self.host} | (LOOPBACK_HOSTS if self.is_loopback else set())
        if self.host in WILDCARD_HOSTS:  # bound to every interface: its loopback and its own names
            hosts |= LOOPBACK_HOSTS | local_host_names()
        out = set()
        for h in hosts:
            hh = f"[{h}]" if ":" in h else h
            out.add(f"http://{hh}:{self.port}")
        return out | {o.rstrip("/") for o in self.extra_origins}
