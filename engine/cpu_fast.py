"""Fast CPU math for MLX on Linux: an optimized BLAS under MLX's float matmuls, and a
dequantize-then-matmul path for quantized linears fed many rows at once (prefill).

What it knows:
- The `mlx[cpu]` Linux wheel links the reference (netlib) BLAS: its `cblas_sgemm` runs at 1-2 GFLOP/s
  where OpenBLAS runs at ~100 on one core. numpy's Linux wheels bundle OpenBLAS, but ILP64 and
  renamed (`scipy_cblas_sgemm64_`), so it cannot stand in for `cblas_sgemm` as it is. A 20-line C shim,
  compiled once with the system C compiler into `$FLASHCODE_HOME/cache/`, exports `cblas_sgemm` and
  forwards it there; loaded with RTLD_GLOBAL before `libmlx.so` is, it wins the symbol (the global
  scope is searched before libmlx's own dependencies). Only `cblas_sgemm` moves: LAPACK, float64 and
  complex stay on the wheel's libraries. It must run before `mlx.core` is imported, hence
  `engine/__init__.py` calls `load_fast_blas()` first thing.
- MLX's CPU `quantized_matmul` costs about the same per row whatever the row count (~0.8 ms per row
  for a 576x1536 matrix), so prefill is as slow as decode. For inputs of `min_rows` rows or more,
  `patch_model` makes each `QuantizedLinear` dequantize its weight (exact: the same float32 values
  `quantized_matmul` uses) and call the BLAS matmul. Decode (one row) keeps `quantized_matmul`.
- MLX runs a stream's ops on one thread. A matrix of `SPLIT_MIN_PARAMS` or more has its output features
  cut into one part per core, each part's `quantized_matmul` (or dequantize and matmul) on its own CPU
  stream (`cpu_streams`), the parts concatenated: ~1.5-2x faster on 2 cores for 2048x4096 (0.9 M-parameter
  matrices gain nothing and stay whole); the same bits as whole (each output element is computed alone;
  tests compare). The flash MoE path spreads its expert pairs over the same streams.

What it does not know: models, threads (the worker owns MLX), Metal or CUDA (GPUs keep MLX's kernels:
`patch_model` does nothing off the CPU device).

Off switch: `FLASHCODE_CPU_FAST=0` turns every lever off (read at import and at `patch_model`);
`FLASHCODE_BLAS_THREADS` sets OpenBLAS's threads (default 1: see docs/cpu.md);
`FLASHCODE_DEQUANT_ROWS` sets `min_rows`.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_SWITCH = "FLASHCODE_CPU_FAST"
ENV_THREADS = "FLASHCODE_BLAS_THREADS"
ENV_ROWS = "FLASHCODE_DEQUANT_ROWS"
ENV_LIBRARY = "FLASHCODE_BLAS"  # an explicit BLAS library to forward to (LP64 or ILP64 OpenBLAS)
DEFAULT_THREADS = 1
DEFAULT_MIN_ROWS = 4
CPU_PARTS = 4  # at most this many CPU streams share one matmul (fewer with fewer cores)
SPLIT_MIN_PARAMS = 2 << 20  # matrices this large and up split their output features over the streams
# the many-rows path dequantizes a weight this much at a time: its float copy is a transient no memory budget
# counts whole (an 8B model's 128k-vocabulary head: 2 GB in float32); one block per stream in flight (each
# block's dequantize waits for the matmul of that stream's block before it: `mx.depends`)
DEQUANT_BLOCK_BYTES = 2 << 20

SHIM_SOURCE = r"""
#include <stdint.h>
typedef void (*sgemm32_t)(int, int, int, int32_t, int32_t, int32_t, float, const float *, int32_t,
                          const float *, int32_t, float, float *, int32_t);
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                          const float *, int64_t, float, float *, int64_t);
static void *target;
static int ilp64;
static long long calls;
void flashcode_blas_set_target(void *fn, int is_ilp64) { target = fn; ilp64 = is_ilp64; }
long long flashcode_blas_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  if (ilp64)
    ((sgemm64_t)target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    ((sgemm32_t)target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""

# (sgemm symbol, is ILP64, set-threads symbol), in the order numpy/scipy wheels have named them
SYMBOLS = (
    ("scipy_cblas_sgemm64_", True, "scipy_openblas_set_num_threads64_"),
    ("cblas_sgemm64_", True, "openblas_set_num_threads64_"),
    ("scipy_cblas_sgemm", False, "scipy_openblas_set_num_threads"),
    ("cblas_sgemm", False, "openblas_set_num_threads"),
)


@dataclass
class BlasStatus:
    """What `load_fast_blas` did: `active` when MLX's `cblas_sgemm` now goes to `library`."""

    active: bool = False
    library: str = ""
    symbol: str = ""
    threads: int = 0
    reason: str = "not tried"


_status = BlasStatus()
_shim: ctypes.CDLL | None = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def blas_status() -> BlasStatus:
    return _status


def blas_calls() -> int:
    """How many `cblas_sgemm` calls went through the shim (-1 when it is not loaded)."""
    return int(_shim.flashcode_blas_calls()) if _shim is not None else -1


# --------------------------------------------------------------------------- the BLAS
def numpy_openblas() -> Path | None:
    """The OpenBLAS numpy's wheel bundles (`numpy.libs/` beside the package), found without importing numpy."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.origin:
        return None
    libs = Path(spec.origin).parent.parent / "numpy.libs"
    found = sorted(libs.glob("lib*openblas*.so*")) if libs.is_dir() else []
    return found[0] if found else None


def _forward_target(lib: ctypes.CDLL) -> tuple[str, bool, Any] | None:
    for name, ilp64, threads in SYMBOLS:
        if hasattr(lib, name):
            return name, ilp64, getattr(lib, threads, None)
    return None


def build_shim(cache_dir: Path) -> Path:
    """Compile the forwarding shim once per source and compiler; the path of the shared object."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise OSError("no C compiler (cc, gcc or clang) on PATH to build the BLAS shim")
    key = hashlib.sha256((SHIM_SOURCE + cc).encode()).hexdigest()[:16]
    out = cache_dir / f"flashcode-blas-shim-{key}.so"
    if out.is_file():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src, obj = Path(tmp) / "shim.c", Path(tmp) / "shim.so"
        src.write_text(SHIM_SOURCE)
        proc = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(obj), str(src)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise OSError(f"{cc} could not build the BLAS shim: {proc.stderr.strip()[:400]}")
        os.replace(obj, out)  # atomic: a concurrent builder writes the same bytes
    return out


def _threads() -> int:
    try:
        return max(1, int(os.environ.get(ENV_THREADS, DEFAULT_THREADS)))
    except ValueError:
        return DEFAULT_THREADS


def load_fast_blas(cache_dir: Path | None = None) -> BlasStatus:
    """Route MLX's `cblas_sgemm` to OpenBLAS (Linux only; idempotent; never raises).

    Must run before `mlx.core` is imported: the dynamic linker binds MLX's BLAS symbols when libmlx
    loads. Returns what happened; `reason` says why not where it is not active."""
    global _status
    if _status.reason == "not tried":
        _status = _load(cache_dir)
    return _status


def _load(cache_dir: Path | None) -> BlasStatus:
    global _shim
    reason = _unavailable()
    if reason:
        return BlasStatus(reason=reason)
    path = Path(os.environ[ENV_LIBRARY]) if os.environ.get(ENV_LIBRARY) else numpy_openblas()
    if path is None:
        return BlasStatus(
            reason=f"no OpenBLAS found (numpy's wheel bundles one; or set {ENV_LIBRARY}=/path/libopenblas.so)"
        )
    try:
        lib = ctypes.CDLL(str(path))
        target = _forward_target(lib)
        if target is None:
            return BlasStatus(reason=f"{path.name} exports no cblas_sgemm variant this module knows")
        if cache_dir is None:
            from .paths import home

            cache_dir = home() / "cache"
        shim = ctypes.CDLL(str(build_shim(cache_dir)), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        log.info("fast BLAS unavailable, MLX keeps the reference BLAS: %s", exc)
        return BlasStatus(reason=str(exc))
    name, ilp64, set_threads = target
    shim.flashcode_blas_set_target.argtypes = [ctypes.c_void_p, ctypes.c_int]
    shim.flashcode_blas_calls.restype = ctypes.c_longlong
    shim.flashcode_blas_set_target(ctypes.cast(getattr(lib, name), ctypes.c_void_p), int(ilp64))
    threads = _threads()
    if set_threads is not None:
        set_threads(ctypes.c_int64(threads) if ilp64 else ctypes.c_int(threads))
    _shim = shim
    return BlasStatus(True, str(path), name, threads, "active")


def _unavailable() -> str:
    """Why the BLAS cannot be swapped in this process ('' when it can)."""
    if sys.platform != "linux":
        return "not Linux: MLX uses the system's BLAS (Accelerate on macOS)"
    if not enabled():
        return f"{ENV_SWITCH}=0"
    if "mlx.core" in sys.modules:
        return "mlx.core was imported before engine: MLX keeps the wheel's reference BLAS"
    return ""


# --------------------------------------------------------------------------- the layer swap
def min_rows() -> int:
    try:
        return max(1, int(os.environ.get(ENV_ROWS, DEFAULT_MIN_ROWS)))
    except ValueError:
        return DEFAULT_MIN_ROWS


class _Switch:
    on = True  # flipped by `plain_path()` (tests, benchmarks) without unpatching models


_LOCAL = threading.local()  # MLX streams belong to the thread that made them: one set per thread


def cpu_streams() -> list[Any]:
    """The CPU streams work may be spread over: `None` (the caller's stream) and up to `CPU_PARTS - 1` side
    streams, one per further core. MLX runs each stream's ops on one thread of its own, so a matmul cut into
    parts, one per stream, uses that many cores. Exact: each output element is computed as it would be whole
    (tests compare bits). Made on first use by each thread that computes (MLX refuses a stream another thread
    made); `[None]` with one core, off the CPU device, or with FLASHCODE_CPU_FAST=0."""
    import mlx.core as mx

    if not enabled() or mx.default_device() != mx.cpu:
        return [None]
    streams = getattr(_LOCAL, "streams", None)
    if streams is None:
        side = [mx.new_stream(mx.cpu) for _ in range(min(CPU_PARTS, os.cpu_count() or 1) - 1)]
        streams = _LOCAL.streams = [None, *side]
        if side and threading.current_thread() is threading.main_thread():
            atexit.register(synchronize)  # a worker thread's streams are synchronized as its replies end
    return streams


def cuts(n: int, parts: int) -> list[int]:
    """`parts + 1` boundaries that cut `n` items into `parts` runs as even as integers allow."""
    return [n * j // parts for j in range(parts + 1)]


def synchronize() -> None:
    """Wait until this thread's side streams are idle. Call it when a reply ends: mlx-lm evaluates the next
    step before it yields a token, so work is still in flight there after the last one, and a process that
    exits with work in flight on a side stream corrupts its heap ("malloc_consolidate(): unaligned fastbin
    chunk detected", about 1 exit in 20 in a test). Only the calling thread's streams (MLX refuses another
    thread's); a no-op where this thread made none. Its default stream too: it joins the side streams' parts
    (with the side streams alone waited for, one exit of ~400 here still failed so, on a loaded box)."""
    streams = getattr(_LOCAL, "streams", None)
    if streams and len(streams) > 1:
        import mlx.core as mx

        for st in streams[1:]:
            mx.synchronize(st)
        mx.synchronize()


def end_thread() -> None:
    """Call as the last thing a thread that used MLX does (the engine worker's thread): waits for its side
    streams, then frees the MLX state this thread made (its streams, its random key) with `mx.clear_streams()`
    while Python still runs. Left to MLX, that state is freed by C++ thread-exit destructors that take the
    GIL; a thread that ends just before the interpreter finalizes is then stopped by Python inside that
    destructor and the process aborts ("terminate called without an active exception", exit 134) after its
    work is done. MLX asks every thread but the main one to call `clear_streams` itself (ml-explore/mlx#4373).
    The thread cannot use MLX afterwards (its default stream is gone). A no-op where MLX was never imported."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return
    try:
        synchronize()
    finally:
        _LOCAL.__dict__.pop("streams", None)
        clear = getattr(mx, "clear_streams", None)  # mlx >= 0.31.2 (per-thread streams)
        if clear is not None:
            clear()


@contextmanager
def plain_path() -> Iterator[None]:
    """Within this block patched layers call `quantized_matmul` for every input, as if unpatched."""
    before, _Switch.on = _Switch.on, False
    try:
        yield
    finally:
        _Switch.on = before


def quantized_matmul(
    x: Any,
    w: Any,
    scales: Any,
    biases: Any | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    rows: int | None = None,
) -> Any:
    """`mx.quantized_matmul(x, w, ..., transpose=True)`, through a dequantized float matmul when `x` has
    at least `rows` (default `min_rows()`) rows. Same values up to float32 summation order."""
    import mlx.core as mx

    n = 1
    for d in x.shape[:-1]:
        n *= d
    # (scales of another dtype are cast to x's, exactly, only into float32: the CPU's compute dtype)
    many = (
        _Switch.on
        and mode == "affine"
        and n >= (rows or min_rows())
        and (scales.dtype == x.dtype or x.dtype == mx.float32)
    )
    big = _Switch.on and w.shape[0] * w.shape[1] * 32 // bits >= SPLIT_MIN_PARAMS
    streams = cpu_streams() if big else [None]
    count = len(streams)
    if many:  # the dequantized weight is a float copy: made a block of output features at a time, not whole
        whole = w.shape[0] * w.shape[1] * 32 // bits * x.dtype.size
        count = max(count, -(-whole // DEQUANT_BLOCK_BYTES))
    bounds = cuts(w.shape[0], count)
    parts = []
    for j, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):  # output features split
        st = streams[j % len(streams)]  # a large matrix: its blocks spread over the cores
        wp, sp, bp = (
            (w[a:b], scales[a:b], biases[a:b] if biases is not None else None)
            if count > 1
            else (w, scales, biases)
        )
        if many:
            if j >= len(streams):  # one block of this stream's at a time: the last one's matmul first
                wp = mx.depends(wp, parts[j - len(streams)])
            if sp.dtype != x.dtype:
                # float16 scales (the flash engine keeps its pinned ones so, at half the memory): MLX dequantizes
                # with them ~3x slower, so they are cast first, exactly (flash prefilled 4.5x slower without it)
                sp, bp = sp.astype(x.dtype), bp.astype(x.dtype) if bp is not None else None
            dense = mx.dequantize(
                wp, sp, bp, group_size=group_size, bits=bits, mode=mode, dtype=x.dtype, stream=st
            )
            parts.append(mx.matmul(x, dense.T, stream=st))
        else:
            parts.append(
                mx.quantized_matmul(
                    x,
                    wp,
                    scales=sp,
                    biases=bp,
                    transpose=True,
                    group_size=group_size,
                    bits=bits,
                    mode=mode,
                    stream=st,
                )
            )
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _rows_call(self: Any, x: Any) -> Any:
    y = quantized_matmul(
        x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode
    )
    if "bias" in self:
        y = y + self["bias"]
    return y


def rows_path(force: bool = False) -> bool:
    """Whether the many-rows path pays here: on the CPU device with the fast BLAS loaded (with the reference
    BLAS both paths cost the same); `force` skips the BLAS check (tests). Off with FLASHCODE_CPU_FAST=0."""
    import mlx.core as mx

    return enabled() and mx.default_device() == mx.cpu and (force or _status.active)


def dequant_in_flight_bytes() -> int:
    """What a memory budget allows for the many-rows path's dequantized weight blocks: one block per CPU stream
    in flight, twice (a block's dequantize is several ops, each with an output of its own, and MLX allocates an
    op's output when it is dispatched); 0 where the path is off."""
    if not rows_path():
        return 0
    return 2 * min(CPU_PARTS, os.cpu_count() or 1) * DEQUANT_BLOCK_BYTES


def patch_model(model: Any, force: bool = False) -> int:
    """Give every `QuantizedLinear` of `model` the many-rows path, where `rows_path` says it pays. Returns how
    many layers were switched; idempotent."""
    import mlx.nn as nn

    if not rows_path(force):
        return 0
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:  # subclasses may compute something else: leave them be
            m.__class__ = _rows_class()
            n += 1
    return n


_ROWS_CLASS: list[type] = []


def _rows_class() -> type:
    """`QuantizedLinear` with the many-rows `__call__` (made on first use: mlx.nn is imported late)."""
    import mlx.nn as nn

    if not _ROWS_CLASS:
        _ROWS_CLASS.append(
            type(
                "RowsQuantizedLinear", (nn.QuantizedLinear,), {"__call__": _rows_call, "__module__": __name__}
            )
        )
    return _ROWS_CLASS[0]
