"""Flash streaming (dense) on an MLX GPU device (mlx-cuda on NVIDIA, Metal on a Mac).

Same measurements as `flashcode bench flash` (engine.flash.bench), for machines where a memory
cgroup cannot be made (e.g. a gVisor sandbox): the flash engine runs under its own byte budget
(`--memory-budget`) and reports peak RSS; the compute ceiling is the same model held in GPU memory.
The JSON starts with `provenance()` (command, commit — `FLASHCODE_GIT_COMMIT` on a machine without
.git —, machine) and keeps both runs' raw numbers and token ids.

    python bench/flash_gpu.py --work /root/flash --preset llama-8b --budget 1.75GB --tokens 16 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from engine.flash.bench import PROMPT, cgroup_unavailable, drop_page_cache, run_child, summarize
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
    res["page_cache_dropped"] = drop_page_cache()
    res["bandwidth"] = measure_bandwidth(
        man.units_path, man.max_unit_bytes, total=min(2 << 30, man.units_path.stat().st_size)
    )
    print("bandwidth", res["bandwidth"], flush=True)
    drop_page_cache()
    res["flash"] = run_child("flash", model, args.tokens, None, 1200, ["--memory-cap", str(args.budget)])
    print("flash", {k: v for k, v in res["flash"].items() if k != "tokens"}, flush=True)
    res["ram"] = run_child("ram", model, args.tokens, None, 1200)
    print("ram", {k: v for k, v in res["ram"].items() if k != "tokens"}, flush=True)
    out = summarize(res, bytes_per_token)
    out["split_layout"] = man.layout
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
        alt["flash"] = run_child(
            "flash", copy_dir, args.tokens, None, 1200, ["--memory-cap", str(args.budget)]
        )
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
    )
    print(json.dumps({k: out.get(k) for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
