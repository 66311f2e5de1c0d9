"""Flash streaming (dense) on an MLX GPU device (mlx-cuda on NVIDIA, Metal on a Mac).

Same measurements as `flashcode bench flash` (engine.flash.bench), for machines where a memory
cgroup cannot be made (e.g. a gVisor sandbox): the flash engine runs under its own byte budget
(`--memory-budget`) and reports peak RSS; the compute ceiling is the same model held in GPU memory.
The JSON starts with `provenance()` (command, commit — `FLASHCODE_GIT_COMMIT` on a machine without
.git —, machine) and keeps both runs' raw numbers and token ids.

    python bench/flash_gpu.py --work /root/flash --preset llama-8b --budget 1.75GB --tokens 16 --out OUT.json

`--prefetch 2,3 --repeats 3` runs the flash child at each read-ahead depth (units in flight), interleaved,
page cache dropped before each run; `flash_runs` keeps every run, the headline (`flash` and the summary
keys) is the median run (by decode tok/s) of the first depth, `by_depth` every depth's ratios. The disk
limit is the best of the disk probes: direct reads of the largest unit over up to 4 GB of the split, with
4, 8 and 16 reader threads (`--probe-threads`) at each run depth and at 4 units in flight.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from engine.flash.bench import (
        PROMPT,
        cgroup_unavailable,
        drop_page_cache,
        median_run,
        run_child,
        summarize,
    )
    from engine.flash.reader import measure_bandwidth
    from engine.flash.split import load_manifest, split_model
    from engine.flash.synth import synth_model
    from engine.provenance import provenance
    from webapp.units import parse_size

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/root/flash")
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--budget", type=parse_size, default=parse_size("1.75GB"))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=1, help="flash runs per depth (fresh processes)")
    ap.add_argument("--prefetch", default="2",
                    help="read-ahead depths to run, interleaved (e.g. 2,3); the first is the headline")  # fmt: skip
    ap.add_argument("--probe-threads", default="4,8,16",
                    help="reader threads of the disk probes (each at the run depths and 4 units in flight)")  # fmt: skip
    ap.add_argument("--copy-also", action="store_true",
                    help="also measure flash on a copied split (units.bin) of the same weights, beside the default in-place one")  # fmt: skip
    args = ap.parse_args()

    import mlx.core as mx

    model = Path(args.work) / args.preset
    t0 = time.perf_counter()
    if not (model / "config.json").exists():
        synth_model(args.preset, model, layers=args.layers, progress=False)
    if not (model / "split" / "manifest.json").exists():
        split_model(model, progress=False)
    man = load_manifest(model / "split")
    print(f"model ready in {time.perf_counter() - t0:.0f} s on {mx.default_device()}", flush=True)
    bytes_per_token = sum(u.padded for u in man.dense_units())
    res: dict = {
        **provenance(),
        "model": args.preset,
        "model_bytes": sum(f.stat().st_size for f in model.glob("model*.safetensors")),
        "device": str(mx.default_device()),
        "memory_budget": args.budget,
        "tokens": args.tokens,
        "prompt": PROMPT,
        "cgroup": cgroup_unavailable() or "available",
    }
    depths = [int(d) for d in args.prefetch.split(",")]
    res["page_cache_dropped"] = drop_page_cache()
    res["bandwidth_probes"] = []
    for threads in (int(t) for t in args.probe_threads.split(",")):  # the disk limit: the best probe
        for d in sorted({*depths, 4}):
            drop_page_cache()
            probe = measure_bandwidth(man.units_path, man.max_unit_bytes, threads=threads, depth=d,
                                      total=min(4 << 30, man.units_path.stat().st_size))  # fmt: skip
            res["bandwidth_probes"].append({"threads": threads, **probe})
            print("bandwidth", threads, d, round(probe["bandwidth_Bps"] / 1e9, 3), "GB/s", flush=True)
    res["bandwidth"] = max(res["bandwidth_probes"], key=lambda b: b["bandwidth_Bps"])
    res["ram"] = run_child("ram", model, args.tokens, None, 1200)
    print("ram", {k: v for k, v in res["ram"].items() if k != "tokens"}, flush=True)
    res["repeats"], res["depths"] = args.repeats, depths
    res["flash_runs"] = {str(d): [] for d in depths}
    for r in range(args.repeats):
        for d in depths:
            drop_page_cache()
            run = run_child("flash", model, args.tokens, None, 1200,
                            ["--memory-cap", str(args.budget), "--prefetch", str(d)])  # fmt: skip
            res["flash_runs"][str(d)].append(run)
            print(
                "flash",
                d,
                r,
                {k: v for k, v in run.items() if k in ("status", "decode_tps", "ttft_s")},
                flush=True,
            )
    res["flash"] = median_run(res["flash_runs"][str(depths[0])])
    out = summarize(res, bytes_per_token)
    out["split_layout"] = man.layout
    out["by_depth"] = {d: depth_summary(runs, out["ceiling_tps"], res["ram"].get("tokens"))
                       for d, runs in res["flash_runs"].items()}  # fmt: skip
    if args.copy_also:  # the same weights, split as a copy: what the in-place reader costs (or not)
        copy_dir = Path(args.work) / f"{args.preset}-copy"
        if not (copy_dir / "config.json").exists():
            synth_model(args.preset, copy_dir, layers=args.layers, progress=False)
        if not (copy_dir / "split" / "manifest.json").exists():
            split_model(copy_dir, progress=False, copy=True)
        cman = load_manifest(copy_dir / "split")
        alt: dict = {"model": str(copy_dir), "page_cache_dropped": drop_page_cache()}
        alt["bandwidth"] = measure_bandwidth(
            cman.units_path, cman.max_unit_bytes, total=min(2 << 30, cman.units_path.stat().st_size)
        )
        drop_page_cache()
        alt["flash"] = run_child("flash", copy_dir, args.tokens, None, 1200,
                                 ["--memory-cap", str(args.budget), "--prefetch", str(depths[0])])  # fmt: skip
        alt["ram"] = res["ram"]  # the same weights: the in-RAM run above is the compute ceiling
        alt = summarize(alt, bytes_per_token)
        alt["split_layout"] = cman.layout
        out["copy_split"] = {k: v for k, v in alt.items() if k != "ram"}
        print(
            "copy split",
            {k: alt.get(k) for k in ("decode_tps", "ceiling_ratio", "engine_read_bandwidth_Bps")},
        )
    Path(args.out).write_text(json.dumps(out, indent=2))
    keys = (
        "decode_tps",
        "ttft_s",
        "io_ceiling_tps",
        "compute_ceiling_tps",
        "ceiling_ratio",
        "peak_rss_bytes",
        "same_tokens_as_ram",
        "measured_bandwidth_Bps",
        "engine_read_bandwidth_Bps",
        "by_depth",
    )
    print(json.dumps({k: out.get(k) for k in keys}, indent=1))
    return 0


def depth_summary(runs: list[dict], ceiling_tps: float, ram_tokens: list[int] | None) -> dict:
    """One depth's runs against the invocation's ceiling: every run's ratio and the median's."""
    from engine.flash.bench import median_run

    ratios = [round((r.get("decode_tps") or 0.0) / ceiling_tps, 3) for r in runs]
    return {
        "decode_tps": [r.get("decode_tps") for r in runs],
        "ceiling_ratio": ratios,
        "median_ceiling_ratio": round((median_run(runs).get("decode_tps") or 0.0) / ceiling_tps, 3),
        "same_tokens_as_ram": bool(ram_tokens) and all(r.get("tokens") == ram_tokens for r in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
