"""Read bandwidth of the same units from an in-place split and from a copied one (engine/flash/inplace.py).

One synthetic model, split twice: in place (the default: units read from the model's own safetensors shard
through `InPlaceReader`) and as a copy (`flashcode split --copy`: units.bin through `UnitReader`). Each run
drops the page cache, opens a fresh reader and reads every dense unit the way the dense stream does
(dense.py: one projection per read, `depth` reads in flight, `threads` I/O threads), once alone and once
beside a thread that keeps the GIL busy (as the engine's compute thread does: `*_gil_busy`); in-place and
copy runs alternate (their order swaps every repeat) so that a noisy, shared disk weighs on both alike. Before the timed
runs every unit is read once both ways and checked against its CRC-32 (the in-place reads give the copy's
bytes). The JSON starts with `provenance()` and keeps every run (bytes, seconds); the summary keys are the
medians of the runs' bandwidths and their ratio, per condition.

    .venv/bin/python bench/flash_reader.py --work /tmp/flash-reader --out bench/results/flash-reader.json

Runs as root (dropping the page cache); deletes the model afterwards unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
import zlib
from itertools import product
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def reads_of(man: Any) -> list[tuple[int, int]]:
    """(offset, length) of every read the dense stream makes for one token, in its order."""
    from engine.flash.dense import unit_pieces

    return [(u.offset + p.read_start, p.read_length) for u in man.dense_units() for p in unit_pieces(u)]


def _busy(stop: threading.Event) -> None:
    """Python work that holds the GIL between switch intervals, as the engine's compute thread does."""
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x ^= i


def one_pass(man: Any, threads: int, depth: int, gil_busy: bool = False) -> dict[str, Any]:
    """Every dense read once, `depth` in flight, through a fresh reader; the bytes and the wall time.
    `gil_busy`: a thread keeps the GIL busy meanwhile (a reader that needs it often waits for it)."""
    from engine.flash.inplace import open_reader
    from engine.flash.reader import AlignedBuffer

    reads = reads_of(man)
    reader = open_reader(man, threads=threads)
    bufs = [AlignedBuffer(max(n for _, n in reads)) for _ in range(depth)]
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if gil_busy:
        busy.start()
    try:
        pending: list[Any] = []
        t0 = time.perf_counter()
        for k, (offset, length) in enumerate(reads):
            if len(pending) == depth:
                pending.pop(0).result()
            pending.append(reader.read(bufs[k % depth], offset, length))
        for fut in pending:
            fut.result()
        dt = time.perf_counter() - t0
        return {"bytes": sum(n for _, n in reads), "seconds": round(dt, 4), "reads": len(reads),
                "direct": reader.direct, "disk_bytes": reader.stats.bytes}  # fmt: skip
    finally:
        stop.set()
        if gil_busy:
            busy.join()
        reader.close()
        for b in bufs:
            b.close()


def check(man: Any, threads: int) -> int:
    """Every unit read whole and checked against its CRC-32; the number of units."""
    from engine.flash.inplace import open_reader
    from engine.flash.reader import AlignedBuffer

    reader = open_reader(man, threads=threads)
    buf = AlignedBuffer(man.max_unit_bytes)
    try:
        for u in man.units:
            reader.read(buf, u.offset, u.length).result()
            if zlib.crc32(buf.view[: u.length]) != u.crc32:
                raise SystemExit(f"{man.layout}: unit {u.key} read back wrong")
    finally:
        reader.close()
        buf.close()
    return len(man.units)


def main() -> int:
    from engine.flash.bench import drop_page_cache
    from engine.flash.split import load_manifest, split_model
    from engine.flash.synth import synth_model
    from engine.provenance import provenance

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/flash-reader")
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--layers", type=int, default=4, help="llama-8b, 4 layers: 440 MB of units, 37 MB reads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4, help="I/O threads (FlashBackend's io_threads)")
    ap.add_argument("--depth", type=int, default=2, help="reads in flight (the dense stream's read-ahead)")
    ap.add_argument("--keep", action="store_true", help="keep the model in --work")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    work = Path(args.work)
    model = work / args.preset
    t0 = time.perf_counter()
    if not (model / "config.json").exists():
        work.mkdir(parents=True, exist_ok=True)  # no tokenizer: none is needed to read units
        synth_model(args.preset, model, layers=args.layers, progress=False, tokenizer_dir=work)
    inplace = load_manifest(split_model(model, work / "split-inplace", progress=False))
    copied = load_manifest(split_model(model, work / "split-copy", progress=False, copy=True))
    print(f"model and splits ready in {time.perf_counter() - t0:.0f} s", flush=True)
    res: dict[str, Any] = {
        **provenance(),
        "model": args.preset,
        "layers": args.layers,
        "model_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
        "units_bytes": sum(u.padded for u in copied.dense_units()),
        "read_bytes": max(n for _, n in reads_of(copied)),
        "threads": args.threads,
        "depth": args.depth,
        "repeats": args.repeats,
        "checked_units": {"in_place": check(inplace, args.threads), "copy": check(copied, args.threads)},
    }
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeats):
            order = [("in_place", inplace), ("copy", copied)]
            for (layout, man), gil_busy in product(order if rep % 2 == 0 else order[::-1], (False, True)):
                dropped = drop_page_cache()
                run = {"layout": layout, "repeat": rep, "gil_busy": gil_busy, "page_cache_dropped": dropped,
                       **one_pass(man, args.threads, args.depth, gil_busy)}  # fmt: skip
                run["bandwidth_Bps"] = round(run["bytes"] / run["seconds"])
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["runs"] = runs
    for busy, sfx in ((False, ""), (True, "_gil_busy")):
        bw = {
            k: statistics.median(
                r["bandwidth_Bps"] for r in runs if r["layout"] == k and r["gil_busy"] == busy
            )
            for k in ("in_place", "copy")
        }
        res[f"inplace_bandwidth_Bps{sfx}"] = bw["in_place"]
        res[f"copy_bandwidth_Bps{sfx}"] = bw["copy"]
        res[f"inplace_vs_copy{sfx}"] = round(bw["in_place"] / bw["copy"], 3)
    print({k: v for k, v in res.items() if k.startswith(("inplace_", "copy_"))}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
