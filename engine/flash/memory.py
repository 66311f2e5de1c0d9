"""`--memory-budget auto`: what this machine (or this process's memory cgroup) can spare.

What it knows: the cgroup limit that applies to this process (v2 `memory.max`, v1
`memory.limit_in_bytes`, found through /proc/self/cgroup, "max" or a huge v1 number meaning none),
the memory available on the machine (MemAvailable), and the stated margin.

The rule: under a cgroup limit smaller than the machine, the budget is the limit (the budget is the
whole process's and the cgroup charges it the same way; page cache is reclaimed first). Otherwise it
is what this process holds now plus what is available, minus `AUTO_MARGIN` (the larger of 1 GB and
10% of RAM: room for the desktop, the browser and the page cache the model's reads go through).

What it does not know: how the budget is spent (budget.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def auto_margin(total: int) -> int:
    return max(1_000_000_000, total // 10)


@dataclass(frozen=True)
class AutoBudget:
    budget: int
    source: str  # "cgroup" | "available"
    detail: str  # for the UI and logs: how it was found

    def as_dict(self) -> dict[str, object]:
        return {"budget": self.budget, "source": self.source, "detail": self.detail}


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    value = int(text)
    return None if value >= 1 << 60 else value  # v1 writes 9223372036854771712 for "no limit"


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """The tightest memory limit on this process's cgroup and its ancestors (v2 or v1), or None."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2: one unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            limit = _read_limit(d / name)
            if limit is not None:
                limits.append(limit)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(limits) if limits else None


def auto_budget(own_rss: int | None = None) -> AutoBudget:
    """The budget `--memory-budget auto` means here and now."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit()
    if limit is not None and limit < total:
        return AutoBudget(limit, "cgroup", f"the memory cgroup's limit, {limit / 1e9:.2f} GB")
    if own_rss is None:
        from .backend import current_rss_bytes

        own_rss = current_rss_bytes()
    available = info.get("MemAvailable", total // 2)
    margin = auto_margin(total)
    budget = max(0, own_rss + available - margin)
    return AutoBudget(
        budget,
        "available",
        f"{available / 1e9:.2f} GB available + {own_rss / 1e9:.2f} GB this process holds "
        f"- a {margin / 1e9:.2f} GB margin",
    )
