"""Where a benchmark result came from: see engine/provenance.py (the engine's benchmarks use it too)."""

from engine.provenance import git_commit, machine, provenance

__all__ = ["git_commit", "machine", "provenance"]
