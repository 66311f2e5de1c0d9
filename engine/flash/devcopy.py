"""Expert bytes copied straight into a bank's memory: pinned host staging, one copy stream, no MLX op.

What it knows: an evaluated MLX array's memory and its address (`address_of`: a numpy view of a byte
view of it, which MLX makes without a copy for a row-contiguous array), and two ways to move bytes there:
- `CudaCopier` (NVIDIA, mlx-cuda): MLX's CUDA backend allocates every array in CUDA managed memory, whose
  address is valid on the device. The CUDA driver API (libcuda, present wherever the GPU runs) page-locks
  the staging buffers the reads land in (`cuMemHostRegister`) and copies each tensor of an expert into its
  bank slot on a stream of its own (`cuMemcpyHtoDAsync`); `wait` returns once the copies are done.
  Measured (bench/flash_copy.py, an H200): a 2.65 MB expert in 0.064 ms this way, against 1.61 ms for
  `mx.array` of the bytes plus a slice update (the new array's managed pages are written on the host,
  then migrated to the device page by page when the update first touches them: ~1.7 GB/s).
- `HostCopier` (memmove): the same bookkeeping where the bank is host memory (the tests run the device
  path with it on the CPU).

What it does not know: when a write is safe. The caller (moe.py) writes a bank slot only after the router
readback of its layer, which has evaluated every earlier use of the bank (MLX runs a device's work in
order), and waits for the copies before the layer's compute is queued.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)


class BankCopier(Protocol):
    name: str

    def register(self, address: int, size: int) -> None: ...
    def unregister(self, address: int) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...


def address_of(arr: Any) -> int:
    """The address of an MLX array's first byte (evaluated here). Row-contiguous arrays only: MLX's byte
    view of one shares its buffer, so a write through this address is a write into `arr` (checked against
    the array's own numpy view; numpy has no bfloat16, so a same-size view stands in for one)."""
    import mlx.core as mx

    raw = arr.view(mx.uint8)
    own = arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr
    mx.eval(arr, raw, own)
    address = int(np.array(raw, copy=False).ctypes.data)
    if address != int(np.array(own, copy=False).ctypes.data):  # a copy: writes there would never reach `arr`
        raise RuntimeError("MLX copied the array's bytes instead of sharing its memory")
    return address


class HostCopier:
    """Copies with memmove: for a bank in host memory (the CPU; tests of the device path). `queued`: like a
    device stream nobody has waited for, a copy lands only at the next `wait` (a caller that reads a slot
    before waiting reads the old bytes)."""

    name = "host"

    def __init__(self, queued: bool = False) -> None:
        self.queued = queued
        self._todo: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def register(self, address: int, size: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if not self.queued:
            ctypes.memmove(dst, src, nbytes)
            return
        with self._lock:
            self._todo.append((dst, src, nbytes))

    def wait(self) -> None:
        with self._lock:  # held while copying: like a stream sync, no caller returns before every queued copy
            todo, self._todo = self._todo, []
            for dst, src, nbytes in todo:
                ctypes.memmove(dst, src, nbytes)

    def close(self) -> None:
        self.wait()


class CudaError(RuntimeError):
    pass


class CudaCopier:
    """Host-to-device copies through the CUDA driver API on the context MLX uses (the device's primary
    context), on a non-blocking stream of its own. Made by `open_device_copier`."""

    name = "cuda"

    def __init__(self, lib: Any, device: int = 0) -> None:
        self.lib = lib
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        self._check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.dev = dev
        self.ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self._local = threading.local()
        self._bind()
        self.stream = ctypes.c_void_p()
        self._check(lib.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")  # 1: non-blocking
        self.pinned: set[int] = set()

    def _check(self, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise CudaError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def _bind(self) -> None:
        """Make MLX's context current on this thread (the driver API keeps one per thread)."""
        if getattr(self._local, "bound", False):
            return
        self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self._local.bound = True

    def register(self, address: int, size: int) -> None:
        """Page-lock [address, address + size) so copies from it are DMA at full speed. Optional: a buffer
        the driver refuses to pin (a memlock limit) is copied from all the same, through its own staging."""
        self._bind()
        rc = self.lib.cuMemHostRegister_v2(address, size, 0)
        if rc:
            log.warning("could not pin %d bytes of staging (CUDA error %d): copies will be slower", size, rc)
            return
        self.pinned.add(address)

    def unregister(self, address: int) -> None:
        if address in self.pinned:
            self._bind()
            self.pinned.discard(address)
            self._check(self.lib.cuMemHostUnregister(address), "cuMemHostUnregister")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._bind()
        self._check(self.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def wait(self) -> None:
        self._bind()
        self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def close(self) -> None:
        if self.stream:
            self.wait()
            for address in list(self.pinned):
                self.unregister(address)
            self.lib.cuStreamDestroy_v2(self.stream)
            self.stream = ctypes.c_void_p()
            self.lib.cuDevicePrimaryCtxRelease_v2(self.dev)


def open_device_copier() -> BankCopier | None:
    """The copier for the default device's banks, or None where MLX's own copies are the way: a CUDA GPU
    gets a `CudaCopier` (None, with a log line, where libcuda will not load or set up); the CPU writes
    through numpy views of its banks (moe.py) and Metal keeps MLX's path (not measured there)."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu or not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    if not sys.platform.startswith("linux"):
        return None
    try:
        return CudaCopier(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError, CudaError) as exc:
        log.warning("direct expert copies are off (%s): using MLX's host-to-device path", exc)
        return None
