"""One expert into its bank slot: the MoE engine's device paths, timed one copy at a time.

    python bench/flash_copy.py --out bench/results/flash-copy-gpu.json        # on the GPU machine

An expert of `--expert-bytes` (default 2.65 MB, a Qwen3-30B-A3B expert at 4 bits) sits in host staging
(page-aligned, as a direct read leaves it); each path puts it into slot `i % slots` of a bank of
`--slots` experts in the device's memory, `--repeats` times after `--warmup`, and the bank is checked
against the bytes after each path:
- `mx_array_update` (the `threaded`/`overlap` paths): `mx.array` of the bytes, a slice update of the bank
  slot, evaluated;
- `direct_pinned` (the `direct` path, CUDA): the staging page-locked, `cuMemcpyHtoDAsync` into the bank
  slot's address on the copier's stream, then its sync;
- `direct_pageable`: the same from staging the driver has not pinned.
Where no CUDA GPU is (the CPU, Metal) the direct paths use the memmove copier (host memory). The JSON
starts with `provenance()` and keeps every copy's time; the summary is each path's median.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx
    import numpy as np

    from bench.flash_moe import device_name
    from engine.flash.devcopy import HostCopier, address_of, open_device_copier
    from engine.flash.reader import buffer_address
    from engine.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--expert-bytes", type=int, default=2654208)
    ap.add_argument("--slots", type=int, default=11)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    n, slots = args.expert_bytes, args.slots
    bank = mx.zeros((slots, n), dtype=mx.uint8)
    mx.eval(bank)
    staging = mmap.mmap(-1, n)
    data = np.frombuffer(staging, dtype=np.uint8)
    data[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    src = buffer_address(memoryview(staging))
    copier = open_device_copier() or HostCopier()

    def timed(one: Any) -> list[float]:
        times = []
        for i in range(args.warmup + args.repeats):
            t0 = time.perf_counter()
            one(i % slots)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt * 1e3)
        return times

    def holds_the_expert(b: Any) -> bool:
        return all(bool(mx.array_equal(b[s], mx.array(data)).item()) for s in range(slots))

    runs: dict[str, Any] = {}

    def mx_array_update(s: int) -> None:
        nonlocal bank
        bank[s : s + 1] = mx.array(data).reshape(1, n)
        mx.eval(bank)

    runs["mx_array_update"] = {"ms": timed(mx_array_update), "bank_holds_expert": holds_the_expert(bank)}

    bank = mx.zeros((slots, n), dtype=mx.uint8)
    base, stride = address_of(bank), n

    def direct(s: int) -> None:
        copier.copy(base + s * stride, src, n)
        copier.wait()

    runs["direct_pageable"] = {"ms": timed(direct), "bank_holds_expert": holds_the_expert(bank)}
    copier.register(src, n)
    pinned = src in getattr(copier, "pinned", {src})  # the CUDA copier logs and goes on where pinning fails
    bank = mx.zeros((slots, n), dtype=mx.uint8)
    base = address_of(bank)
    runs["direct_pinned"] = {"ms": timed(direct), "bank_holds_expert": holds_the_expert(bank)}
    copier.close()

    result: dict[str, Any] = {
        **provenance(),
        "device": device_name(),
        "copier": copier.name,
        "pinned": pinned,
        "expert_bytes": n,
        "slots": slots,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "runs": runs,
    }
    for name, r in runs.items():
        result[f"{name}_median_ms"] = statistics.median(r["ms"])
    result["speedup_direct_pinned"] = round(
        result["mx_array_update_median_ms"] / result["direct_pinned_median_ms"], 2
    )
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0 if all(r["bank_holds_expert"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
