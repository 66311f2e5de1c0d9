"""engine/flash/devcopy.py on this machine's CPU: the address of an MLX array is its memory (a copy there
reaches the array), for every dtype a bank holds; no device copier is made where there is no CUDA GPU.
The CUDA copier itself runs on the GPU machine (bench/flash_moe.py, whose runs check the same tokens)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("dtype", ["uint32", "float16", "bfloat16", "float32", "uint8"])
def test_a_copy_to_an_arrays_address_lands_in_the_array(dtype: str) -> None:
    import mlx.core as mx

    from engine.flash.devcopy import HostCopier, address_of

    mdt = getattr(mx, dtype)
    bank = mx.zeros((3, 4, 16), dtype=mdt)
    slot_bytes = bank.nbytes // bank.shape[0]
    src = mx.arange(64).reshape(4, 16).astype(mdt)
    mx.eval(src)
    raw = np.array(src.view(mx.uint8), copy=False).copy()  # the expert's bytes, as a read leaves them
    HostCopier().copy(address_of(bank) + 1 * slot_bytes, raw.ctypes.data, raw.nbytes)
    got = bank.astype(mx.float32)
    assert mx.array_equal(got[1], src.astype(mx.float32)).item()
    assert mx.sum(mx.abs(got[0])).item() == 0 and mx.sum(mx.abs(got[2])).item() == 0


def test_a_device_copier_only_on_a_cuda_gpu() -> None:
    import mlx.core as mx

    from engine.flash.devcopy import open_device_copier

    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    copier = open_device_copier()  # None here (the CPU); the GPU machine gets the CUDA copier
    assert (copier is not None) == cuda
    if copier is not None:
        copier.close()


def test_an_array_whose_bytes_mlx_would_copy_has_no_address() -> None:
    """A strided slice: MLX's byte view of it is a copy, so a write there would never reach it."""
    import mlx.core as mx

    from engine.flash.devcopy import address_of

    with pytest.raises(RuntimeError, match="copied"):
        address_of(mx.zeros((4, 8), dtype=mx.float32)[:, ::2])
