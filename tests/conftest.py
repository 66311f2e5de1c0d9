"""Shared fixtures. The real default model is imported once per run into $FLASHCODE_HOME
(`make test` / CI set it up); each test that writes user data gets its own data directory whose
`models/` points at that shared one, so no test touches another's conversations."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ARTIFACTS = Path(__file__).parent / "artifacts"


@pytest.fixture(scope="session")
def model_home() -> Path:
    """The data directory holding the imported default model (imported here if missing)."""
    from engine import paths
    from engine.models import ensure_default_model

    root = paths.home()
    ensure_default_model(root, quiet=True)
    return root


@pytest.fixture(scope="session")
def default_model(model_home: Path):
    from engine.models import find_model

    return find_model(None, model_home)


@pytest.fixture(scope="session")
def mlx_backend(default_model):
    """One loaded in-RAM MLX backend for the whole run (loading costs seconds on CPU)."""
    from engine.mlx_backend import MLXBackend

    b = MLXBackend()
    b.load(default_model)
    yield b
    b.close()


@pytest.fixture
def data_dir(tmp_path: Path, model_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh $FLASHCODE_HOME for one test, sharing the imported models read-only."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_home / "models", target_is_directory=True)
    (home / "gguf").symlink_to(model_home / "gguf", target_is_directory=True)
    monkeypatch.setenv("FLASHCODE_HOME", str(home))
    yield home


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# MLX can crash while the interpreter tears down after several engine threads (each with its own
# MLX streams) have come and gone: every test passes, then the process dies with SIGSEGV at exit
# (seen with the agent and stats real-model modules in one run; each alone exits cleanly). A user's
# process has one engine thread, so this only bites the test runner: once pytest has reported,
# leave without running interpreter teardown, keeping pytest's exit status.
_exit_status = {"code": 0}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status["code"] = int(exitstatus)
    # `make test` sets FLASHCODE_NO_SKIP=1: it installs llama-server and Chromium and runs as root,
    # so a skip there means a part went untested; fail instead of passing quietly.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("FLASHCODE_NO_SKIP") == "1" and skipped and _exit_status["code"] == 0:
        print(f"\nFLASHCODE_NO_SKIP=1: {skipped} test(s) skipped; each skip is a part left untested here")
        _exit_status["code"] = 1
        session.exitstatus = 1


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("FLASHCODE_TEST_HARD_EXIT", "1") == "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status["code"])
