"""Where a model runs: a GGUF path imported once (reused after), then in RAM if it fits, flash otherwise.

What it knows: which installed model came from a GGUF file (`flashcode.json` records the file's path,
size, mtime and sha256: the same path, size and mtime is the same file without reading it; otherwise
the sha256, computed once, finds an import of the same bytes under another path), how many bytes a
model takes in memory on an in-RAM engine (MLX: its safetensors, float16/bfloat16 tensors cast to
float32 on the CPU; llama-server: the GGUF it maps), and what the process may still take
(`engine.flash.memory`: the memory cgroup's limit, or available memory minus the margin, or the
budget the user gave, less what the process holds now).

The rule: in RAM when the model needs at most `free / RAM_HEADROOM - RAM_SLACK` — room for its KV cache,
activations and the runtime growing as it loads — and from SSD (flash) otherwise.

What it does not know: how the engines load (the backends) or how the import converts (engine.gguf).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from .base import ModelInfo
from .models import model_info

RAM_HEADROOM = 1.25  # the model in RAM may use at most 1/1.25 = 80% of what is free ...
RAM_SLACK = 256_000_000  # ... less this: KV cache, activations, the runtime's own growth while loading
FLOAT_DTYPES = ("F16", "BF16")


def is_gguf_path(name: str | None) -> bool:
    return bool(name) and str(name).lower().endswith(".gguf")


def _meta(model_dir: Path) -> dict[str, object]:
    try:
        return json.loads((model_dir / "flashcode.json").read_text())
    except (OSError, ValueError):
        return {}


def find_import(gguf: Path, models_root: Path, sha256: str | None = None) -> ModelInfo | None:
    """The installed model imported from this GGUF: same path, size and mtime; or, given `sha256`, the
    same bytes (the file moved or was copied)."""
    gguf = gguf.expanduser().resolve()
    st = gguf.stat()
    installed = _installed(models_root)
    for m in installed:
        meta = _meta(m.path)
        if (
            meta.get("source_gguf") == str(gguf)
            and meta.get("source_size") == st.st_size
            and meta.get("source_mtime_ns") == st.st_mtime_ns
        ):
            return m
    if sha256 is not None:
        for m in installed:
            if _meta(m.path).get("source_sha256") == sha256:
                return m
    return None


def _installed(models_root: Path) -> list[ModelInfo]:
    out = []
    for d in sorted(models_root.iterdir()) if models_root.is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / "config.json").exists():
            try:
                out.append(model_info(d))
            except (OSError, ValueError):
                continue
    return out


def _free_name(models_root: Path, name: str) -> str:
    if not (models_root / name).exists():
        return name
    n = 2
    while (models_root / f"{name}-{n}").exists():
        n += 1
    return f"{name}-{n}"


def import_or_reuse(
    gguf: str | Path, models_root: Path, show_progress: bool = True
) -> tuple[ModelInfo, bool]:
    """(the model, whether it was imported now). Reuses an import of the same file; hashes the GGUF only
    when no import has its path, size and mtime (the import hashes it anyway)."""
    from .gguf import GGUFImportError, default_name, import_gguf, sha256_file

    path = Path(gguf).expanduser().resolve()
    if not path.is_file():
        raise GGUFImportError(f"no GGUF file at {path}")
    found = find_import(path, models_root)
    if found is not None:
        return found, False
    digest = sha256_file(path)
    found = find_import(path, models_root, sha256=digest)
    if found is not None:
        return found, False
    name = _free_name(models_root, default_name(path))
    target = import_gguf(path, models_root, name=name, show_progress=show_progress, sha256=digest)
    return model_info(target), True


def default_float_bytes() -> int:
    """Bytes of a float16/bfloat16 parameter once MLX loaded it: float32 on the CPU backend, as is on Metal."""
    return 2 if sys.platform == "darwin" and platform.machine() == "arm64" else 4


def in_ram_bytes(info: ModelInfo, backend: str = "mlx", float_bytes: int | None = None) -> int:
    """What the model's weights take in memory on an in-RAM engine."""
    if backend == "llama" and has_gguf(info):
        return info.gguf_path.stat().st_size  # llama-server maps the GGUF
    from .flash.safetensors_io import read_model_tensors

    fb = float_bytes or default_float_bytes()
    try:
        refs = read_model_tensors(info.path)
    except (OSError, ValueError):
        return info.size_bytes
    return sum(r.nbytes // 2 * fb if r.dtype in FLOAT_DTYPES else r.nbytes for r in refs.values())


@dataclass(frozen=True)
class Placement:
    backend: str  # the engine picked: the in-RAM one, or "flash"
    need: int  # the model's bytes in memory on the in-RAM engine
    free: int  # what the process may still take: the budget less what it holds
    budget: int
    source: str  # "cgroup" | "available" | "given"
    detail: str  # how the budget was found
    own_rss: int
    setting: str = "auto"  # the flash budget the user gave, or auto

    @property
    def fits(self) -> bool:
        return fits_in(self.need, self.free)

    def as_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend, "need_bytes": self.need, "free_bytes": self.free, "fits": self.fits,
            "budget": self.budget, "budget_source": self.source, "budget_detail": self.detail,
        }  # fmt: skip

    def line(self, model: str) -> str:
        """One line for the user: which engine and why."""
        # the budget's own terms, then what the process holds less: the sums add up as printed
        why = (f"{model} needs {size(self.need)} in RAM; this process may take {size(self.free)} more (a budget of "
               f"{size(self.budget)}: {self.detail}; less the {size(self.own_rss)} it holds)")  # fmt: skip
        if self.fits:
            return f"{why}: it fits with room to spare, so it runs in RAM on {self.backend}"
        return f"{why}: not enough room to spare, so it is streamed from SSD (flash, --memory-budget {self.setting})"


def size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def fits_in(need: int, free: int) -> bool:
    return need * RAM_HEADROOM + RAM_SLACK <= free


def spare_memory(
    memory_budget: int | str | None = None, own_rss: int | None = None
) -> tuple[int, int, str, str]:
    """(budget, own RSS, source, detail): the budget the user gave, else what `auto` means here and now."""
    from .flash.memory import auto_budget

    if own_rss is None:
        own_rss = _rss()
    if isinstance(memory_budget, int) and memory_budget > 0:
        return memory_budget, own_rss, "given", f"--memory-budget {memory_budget / 1e6:.0f} MB"
    auto = auto_budget(own_rss)
    return auto.budget, own_rss, auto.source, auto.detail


def has_gguf(info: ModelInfo) -> bool:
    """Whether llama-server can load the model: the GGUF it was imported from is still there."""
    return info.gguf_path is not None and Path(info.gguf_path).exists()


def in_ram_engine(info: ModelInfo, in_ram: str) -> str:
    """`in_ram`, except llama for a model with no GGUF (made by `flashcode synth` or copied in as safetensors):
    MLX, the in-RAM engine that loads it."""
    return "mlx" if in_ram == "llama" and not has_gguf(info) else in_ram


def choose_engine(
    info: ModelInfo,
    in_ram: str,
    memory_budget: int | str | None = None,
    own_rss: int | None = None,
    float_bytes: int | None = None,
) -> Placement:
    """`in_ram` (mlx or llama; mlx for a model llama-server cannot load) when the model fits with room to
    spare, else flash."""
    in_ram = in_ram_engine(info, in_ram)
    budget, rss, source, detail = spare_memory(memory_budget, own_rss)
    need = in_ram_bytes(info, in_ram, float_bytes)
    free = max(0, budget - rss)
    backend = in_ram if fits_in(need, free) else "flash"
    setting = size(memory_budget) if isinstance(memory_budget, int) else "auto"
    return Placement(backend, need, free, budget, source, detail, rss, setting)


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(Path("/proc/self/statm").read_text().split()[1])


def menu_placements(
    models: list[ModelInfo],
    in_ram: str,
    memory_budget: int | str | None = None,
    loaded: tuple[str, ModelInfo] | None = None,
) -> dict[str, Placement]:
    """The rule for each installed model as if it replaced the `loaded` one (backend, model): its bytes
    are counted free again when it sits in this process (mlx) or, outside a cgroup, in llama-server's."""
    budget, rss, source, detail = spare_memory(memory_budget)
    held = 0
    if loaded is not None and (loaded[0] == "mlx" or (loaded[0] == "llama" and source == "available")):
        held = in_ram_bytes(loaded[1], loaded[0])
    free = max(0, budget - rss + held)
    out = {}
    for info in models:
        mine = in_ram_engine(info, in_ram)
        need = in_ram_bytes(info, mine)
        backend = mine if fits_in(need, free) else "flash"
        setting = size(memory_budget) if isinstance(memory_budget, int) else "auto"
        out[info.name] = Placement(backend, need, free, budget, source, detail, rss, setting)
    return out
