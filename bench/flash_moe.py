"""Flash streaming II benchmark: the MoE expert sniper under a cgroup cap, against its ceilings.

    .venv/bin/python bench/flash_moe.py --preset qwen3-30b-a3b --layers 8 --memory-cap 1GB --tokens 8 \
        --out bench/results/flash-moe.json

For each routing (uniform: skew 0; skewed: --skew, default 2) it makes the synthetic model under
--work (default $FLASHCODE_HOME/synth; never the repo), its split and its qwen3moe GGUF, then, with
the page cache dropped before each capped run:
- the direct-read bandwidth for expert-sized random reads, as many in flight as a layer routes to: the
  best of a probe per reader thread count (--probe-threads) and preadv size (--probe-chunks), all kept;
- flash under the cap (live policy --policy, default lru): decode tok/s, TTFT, decode hit rate,
  decode bytes/token; the decode routing trace replayed through lru / lfu / s3fifo at the same size;
- the same model in RAM, uncapped (compute ceiling; --skip ram where it does not fit);
- llama-server (mmap, -t 2) on the GGUF under the same cap (`vs_llama`).
I/O ceiling = bandwidth / ((1 - hit rate) x expert bytes a token routes to); ceiling = min(I/O,
compute); `ceiling_ratio` = flash decode tok/s / ceiling. `serial_bound_ratio`: the most `ceiling_ratio`
an exact engine that starts a layer's reads only once its router has chosen can reach — its reads and
the rest of the token then take turns, 1 / (1/I/O + 1/compute) tok/s at best; above it only reads
started on a guess can go. Runs as root (cgroups).

`--warmup N` runs flash N times first, kept apart (`warmup_runs`, their tokens checked too) and out of
the summary: on a fresh GPU machine the first run also compiles MLX's CUDA kernels. `--repeats N` runs
flash N times (a fresh process each; every run's numbers and token ids are kept; the summary takes the
median tok/s); `--profile` adds one profiled flash run per routing: per decode
token and per MoE layer, where the time goes (router + readback, cache, read wait, host-to-device copy,
bank update, expert compute, the rest of the token), each part evaluated on the spot (engine/flash/moe.py
`MoEProfile`); `--compare "NAME:FLAGS;..."` adds flash runs with other engine flags (e.g. the previous
device path: `legacy:--pipeline legacy`), after the repeats or, with `--interleave`, one of each after every
repeat (named NAME1, NAME2, ...); a flag NAME=VALUE sets that run's environment instead (MLX's own
switches, e.g. `nographs:MLX_USE_CUDA_GRAPHS=0`). The output starts with `provenance()` (command, commit, machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.flash.bench import (  # noqa: E402
    PROMPT,
    MemoryCgroup,
    _child_env,
    _ratio,
    _size,
    drop_page_cache,
    median_run,
    run_child,
    run_llama,
)
from engine.provenance import provenance  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- child (one engine run)
def child_main(args: argparse.Namespace) -> None:
    import threading

    import mlx.core  # noqa: F401
    import mlx_lm.utils  # noqa: F401
    import transformers  # noqa: F401

    from engine.base import GenerationRequest, ModelInfo, SamplingParams
    from engine.flash.backend import FlashBackend, current_rss_bytes
    from engine.flash.experts import POLICIES, simulate
    from engine.flash.moe import moe_counters

    path = Path(args.model)
    budget = args.memory_cap  # the budget is the process's: the engine measures its own runtime
    # leave part of what the cap leaves past the runtime to the OS page cache
    if budget and args.engine_share < 1:
        budget -= int((budget - current_rss_bytes()) * (1 - args.engine_share))
    backend = FlashBackend(
        memory_budget=budget,
        expert_policy=args.policy,
        top_k=args.top_k or None,
        expert_prefetch=args.prefetch_next,
        expert_predict=args.predict,
        routing_bias=args.bias,
        direct_io=not args.buffered,
        **({"io_threads": args.io_threads} if args.io_threads else {}),
    )
    t0 = time.perf_counter()
    backend.load(ModelInfo(path.name, path, "qwen3_moe", 0, split_path=path / "split"))
    load_s = time.perf_counter() - t0
    es = backend.expert_stream
    es.record = True
    es.profile = args.profile
    if args.pipeline:
        es.pipeline = args.pipeline
    if args.read_chunk >= 0:
        es.read_chunk = args.read_chunk or None  # 0: the reader's own chunk (one preadv per expert)
        es.split_by_misses = False  # every read in parts of that size, whatever the layer's misses
    es.pf_min_misses = args.prefetch_min_misses
    req = GenerationRequest(
        prompt=args.prompt, sampling=SamplingParams(temperature=0.0, max_tokens=args.tokens)
    )
    ids: list[int] = []
    first: dict[str, Any] | None = None
    done = None
    for ev in backend.stream(req, threading.Event()):
        if hasattr(ev, "token_ids"):
            ids += list(ev.token_ids)
            if first is None:  # decode starts: counters after the prefill
                first = {
                    **moe_counters(es),
                    "bytes": backend.reader.stats.bytes,
                    "trace": len(es.stats.trace),
                    "profile": es.prof.snapshot(),
                }
        else:
            done = ev
    assert done is not None and first is not None
    s = done.stats
    last = moe_counters(es)
    hits, misses = last["hits"] - first["hits"], last["misses"] - first["misses"]
    decode_tokens = max(1, s.completion_tokens - 1)
    trace = es.stats.trace
    sims = {}
    for p in POLICIES:  # the same accesses, each policy at the live cache's size; decode part scored
        warm = simulate(trace[: first["trace"]], es.cache.n_layers, es.cache.slots, p)
        full = simulate(trace, es.cache.n_layers, es.cache.slots, p)
        n = full["hits"] + full["misses"] - warm["hits"] - warm["misses"]
        sims[p] = round((full["hits"] - warm["hits"]) / max(1, n), 4)
    out = {
        "mode": "flash",
        "load_s": round(load_s, 2),
        "ttft_s": s.ttft_s,
        "decode_tps": s.decode_tps,
        "tokens": ids,
        "completion_tokens": s.completion_tokens,
        "peak_rss_bytes": s.peak_rss_bytes,
        "decode_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "decode_bytes_per_token": (backend.reader.stats.bytes - first["bytes"]) / decode_tokens,
        "decode_experts_read_per_token": (misses) / decode_tokens,
        "policy_decode_hit_rates": sims,
        "slots_per_layer": es.cache.slots,
        "read_wait_s_total": round(es.stats.read_wait_s, 3),  # the compute thread blocked on expert reads
        "prefetched": es.stats.prefetched,
        "prefetch_used": es.stats.prefetch_used,
        "prefetch_min_misses": es.pf_min_misses,
        "predict_units": args.predict,  # the predict pass (opt-in, exact): its staging units, 0 = off
        "predict_passes": es.predictor.passes if es.predictor else 0,
        "predicted": es.predictor.predicted if es.predictor else 0,  # experts read on a prediction
        "predicted_used": es.predictor.used if es.predictor else 0,  # ... that the exact pass used
        "miss_avg_per_layer": [round(float(m), 3) for m in es.miss_avg],
        "pipeline": es.pipeline if not es.host_writes else "host_writes",
        # bytes per preadv of an expert read; "by_misses": at least 512 KB, as far as a layer's misses leave
        # reader threads idle (the engine's default since this key)
        "read_chunk": "by_misses" if es.split_by_misses and es.read_chunk else es.read_chunk,
        "profiled": args.profile,
        "profile": decode_profile(first["profile"], es.prof.snapshot(), decode_tokens, s.decode_tps),
        "extra": s.extra,
        "error": done.error,
        "mlx_use_cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS"),  # the run's (None: MLX's default, on)
    }
    print(json.dumps(out, default=str))


def decode_profile(
    before: dict[str, Any], after: dict[str, Any], tokens: int, tps: float | None
) -> dict[str, Any]:
    """The decode part of a run's MoE profile: ms per token and us per MoE layer call for each part; `other`
    = the token's wall time (1 / decode tok/s) less the parts (attention graph, sampling, the rest)."""
    calls = after["calls"] - before["calls"]
    parts = {k: after[k] - before[k] for k in after if k != "calls"}
    out: dict[str, Any] = {"decode_tokens": tokens, "layer_calls": calls,
                           "ms_per_token": {k: round(1000 * v / tokens, 3) for k, v in parts.items()},
                           "us_per_layer": {k: round(1e6 * v / max(1, calls), 1) for k, v in parts.items()}}  # fmt: skip
    if tps:
        token_ms = 1000 / tps
        out["token_ms"] = round(token_ms, 3)
        main = sum(v for k, v in out["ms_per_token"].items() if not k.endswith("_async"))  # compute thread's
        out["ms_per_token"]["other"] = round(token_ms - main, 3)
    return out


# a compare flag that sets the child's environment (MLX reads some switches only from there)
ENV_FLAG = re.compile(r"^[A-Z][A-Z0-9_]*=")


def split_env(flags: tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
    """(the child's environment: ours with the NAME=VALUE flags set, the other flags)."""
    env = _child_env()
    for f in flags:
        if ENV_FLAG.match(f):
            name, _, value = f.partition("=")
            env[name] = value
    return env, tuple(f for f in flags if not ENV_FLAG.match(f))


def run_flash(
    model: Path,
    tokens: int,
    cap: int,
    timeout: float,
    policy: str,
    top_k: int,
    prefetch_next: bool = False,
    bias: float = 0.0,
    child_flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    env, child_flags = split_env(child_flags)
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--tokens", str(tokens), "--memory-cap", str(cap),
           "--policy", policy, "--top-k", str(top_k), "--prompt", PROMPT, "--bias", str(bias),
           *child_flags,
           *(["--prefetch-next", str(int(prefetch_next))] if prefetch_next else [])]  # fmt: skip
    cg = MemoryCgroup("flashcode-moe", cap)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=cg.enter)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        out: dict[str, Any] = json.loads(lines[-1]) if p.returncode == 0 and lines else {}
        out["status"] = "ok" if out else f"failed (exit {p.returncode})"
        if not lines:
            out["stderr_tail"] = p.stderr[-1500:]
    except subprocess.TimeoutExpired:
        out = {"status": f"timed out after {timeout:.0f} s"}
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    out["cgroup_peak_bytes"] = cg.peak()
    cg.remove()
    return out


# --------------------------------------------------------------------------- bandwidth
def expert_bandwidth(
    split: Path, in_flight: int, total: int = 1 << 30, threads: int | None = None, chunk: int | None = None
) -> dict[str, Any]:
    """Direct reads of random whole experts, `in_flight` at a time (what one layer's misses look like), on
    `threads` reader threads (default: one per read in flight), each read cut in preadv calls of at most
    `chunk` bytes (default: one per expert)."""
    from engine.flash.inplace import open_reader
    from engine.flash.moe import expert_units
    from engine.flash.reader import AlignedBuffer
    from engine.flash.split import load_manifest

    man = load_manifest(split)
    units = [u for us in expert_units(man).values() for u in us]
    size = max(u.padded for u in units)
    threads = threads or in_flight
    reader = open_reader(man, threads=threads)
    bufs = [AlignedBuffer(size) for _ in range(in_flight)]
    rng = random.Random(0)
    n = max(in_flight, total // size // in_flight * in_flight)
    t0 = time.perf_counter()
    for _ in range(n // in_flight):
        futs = [
            reader.read(b, u.offset, u.length, chunk)
            for b, u in zip(bufs, rng.sample(units, in_flight), strict=True)
        ]
        for f in futs:
            f.result()
    dt = time.perf_counter() - t0
    reader.close()
    for b in bufs:
        b.close()
    return {
        "bandwidth_Bps": n * size / dt,
        "unit_bytes": size,
        "reads": n,
        "in_flight": in_flight,
        "threads": threads,
        "chunk": chunk,
        "direct": reader.direct,
    }


def best_bandwidth(
    split: Path, in_flight: int, threads: tuple[int, ...], chunks: tuple[int, ...]
) -> list[dict[str, Any]]:
    """The disk limit: a probe for each (threads, chunk) — the reads as the engine may issue them, and whole
    experts — page cache dropped before each; the best is the ceiling's bandwidth."""
    probes = []
    for t in threads:
        for c in chunks:
            drop_page_cache()
            probes.append(expert_bandwidth(split, in_flight, threads=t, chunk=c or None))
    return probes


# --------------------------------------------------------------------------- one routing config
def prepare(
    work: Path, preset: str, layers: int | None, skew: float, gguf: bool, drop_source: bool = False
) -> Path:
    from engine.flash.split import split_model
    from engine.flash.synth_moe import export_gguf_moe, synth_moe

    model = work / f"{preset}-l{layers or 'all'}-skew{skew:g}"
    if not (model / "model.safetensors").exists() and not (model / "split/manifest.json").exists():
        log(f"synth {model.name} ...")
        synth_moe(preset, model, layers=layers, skew=skew, progress=False)
    if not (model / "split/manifest.json").exists():
        log("split ...")
        split_model(model, progress=False)
    if gguf and not (model / "model.gguf").exists():
        log("GGUF export ...")
        export_gguf_moe(model, model / "model.gguf", progress=False)
    if (
        drop_source and (model / "model.safetensors").exists()
    ):  # disk: the split and the GGUF are all the runs need
        (model / "model.safetensors").unlink()
    return model


def bench_one(
    model: Path,
    cap: int,
    tokens: int,
    policy: str,
    top_k: int,
    skip: set[str],
    timeout: float,
    compute_tps: float | None = None,
    prefetch_next: int = 0,
    biases: tuple[float, ...] = (),
    child_flags: tuple[str, ...] = (),
    repeats: int = 1,
    profile: bool = False,
    compare: tuple[tuple[str, tuple[str, ...]], ...] = (),
    warmup: int = 0,
    probe_threads: tuple[int, ...] = (8,),
    probe_chunks: tuple[int, ...] = (0,),
    interleave: bool = False,
    probe_in_flight: tuple[int, ...] = (0,),
) -> dict[str, Any]:
    from engine.flash.split import load_manifest

    cfg = json.loads((model / "config.json").read_text())
    man = load_manifest(model / "split")
    k = top_k or cfg["num_experts_per_tok"]
    unit = max(u.padded for u in man.units if u.kind == "expert")
    res: dict[str, Any] = {"model": str(model), "model_bytes": man.source["bytes"],
                           "memory_cap": cap, "tokens": tokens, "layers": cfg["num_hidden_layers"], "top_k": k,
                           "router_skew": cfg.get("flashcode_router_skew"), "expert_bytes": unit}  # fmt: skip
    res["page_cache_dropped"] = drop_page_cache()
    res[
        "bandwidth_probes"
    ] = [  # the disk limit: the best of them all (0 reads in flight: top-k, a prefill's)
        p
        for n in probe_in_flight
        for p in best_bandwidth(model / "split", n or k, probe_threads, probe_chunks)
    ]
    res["bandwidth"] = max(res["bandwidth_probes"], key=lambda b: b["bandwidth_Bps"])
    log(f"  bandwidth {res['bandwidth']['bandwidth_Bps'] / 1e9:.2f} GB/s, the best of "
        + ", ".join(f"{b['bandwidth_Bps'] / 1e9:.2f} ({b['threads']} threads, chunk {b['chunk'] or 'whole'})"
                    for b in res["bandwidth_probes"])
        + f"; {k} expert reads in flight")  # fmt: skip
    for r in range(warmup):  # not in the summary: a fresh GPU machine compiles MLX's kernels in its first run
        drop_page_cache()
        f = run_flash(model, tokens, cap, timeout, policy, top_k, prefetch_next, child_flags=child_flags)
        res.setdefault("warmup_runs", []).append(f)
        log(
            f"  warm-up {r + 1}/{warmup}: {f['status']} {f.get('decode_tps') or 0:.3f} tok/s, TTFT {f.get('ttft_s')}"
        )

    def compared(names: tuple[tuple[str, tuple[str, ...]], ...], suffix: str = "") -> None:
        for (
            name,
            flags,
        ) in names:  # the same cap and model, other engine flags (e.g. the previous device path)
            drop_page_cache()
            f = run_flash(
                model, tokens, cap, timeout, policy, top_k, prefetch_next, child_flags=(*child_flags, *flags)
            )
            res.setdefault("compare", {})[name + suffix] = {
                "flags": list(flags),
                **f,
            }  # NAME=VALUE: environment
            log(f"  {name + suffix} ({' '.join(flags)}): {f['status']} {f.get('decode_tps') or 0:.3f} tok/s, "
                f"hit {f.get('decode_hit_rate')}, read wait {f.get('read_wait_s_total')} s")  # fmt: skip

    res["flash_runs"] = []
    for r in range(repeats):
        drop_page_cache()
        f = run_flash(model, tokens, cap, timeout, policy, top_k, prefetch_next, child_flags=child_flags)
        res["flash_runs"].append(f)
        log(f"  flash {r + 1}/{repeats}: {f['status']} {f.get('decode_tps') or 0:.3f} tok/s, hit {f.get('decode_hit_rate')}, "
            f"read wait {f.get('read_wait_s_total')} s")  # fmt: skip
        if (
            interleave
        ):  # each compare run right after a repeat: a disk that drifts over the lease hits both alike
            compared(compare, str(r + 1))
    res["flash"] = median_run(res["flash_runs"])
    if profile:  # one more run, each part evaluated on the spot: slower, but it says where the time goes
        drop_page_cache()
        f = run_flash(model, tokens, cap, timeout, policy, top_k, prefetch_next,
                      child_flags=(*child_flags, "--profile"))  # fmt: skip
        res["profile"] = f
        parts = (f.get("profile") or {}).get("ms_per_token")
        log(f"  profiled: {f['status']} {f.get('decode_tps') or 0:.3f} tok/s; ms/token {parts}")
    if not interleave:
        compared(compare)
    if (
        compute_tps
    ):  # the model does not fit in RAM here: a compute ceiling measured elsewhere, labelled as such
        res["ram"] = {"status": "not run (given --compute-ceiling)", "decode_tps": compute_tps}
    elif "ram" not in skip:
        res["ram"] = run_child("ram", model, tokens, None, timeout, prompt=PROMPT)
        log(f"  ram: {res['ram']['status']} {res['ram'].get('decode_tps', 0):.3f} tok/s")
    exact = res["flash"].get("tokens") or []
    for b in biases:  # opt-in, lossy: cache-aware routing at the same cap; its quality = agreement with exact
        drop_page_cache()
        r = run_flash(
            model, tokens, cap, timeout, policy, top_k, prefetch_next, bias=b, child_flags=child_flags
        )
        toks = r.get("tokens") or []
        agree = next(
            (i for i, (a, c) in enumerate(zip(toks, exact, strict=False)) if a != c),
            min(len(toks), len(exact)),
        )
        res.setdefault("routing_bias", {})[str(b)] = {
            "status": r["status"], "decode_tps": r.get("decode_tps"), "decode_hit_rate": r.get("decode_hit_rate"),
            "decode_bytes_per_token": r.get("decode_bytes_per_token"), "ttft_s": r.get("ttft_s"),
            "same_tokens_as_exact": toks == exact, "tokens_before_divergence": agree, "tokens": toks,
        }  # fmt: skip
        log(f"  routing bias {b}: {r['status']} {r.get('decode_tps') or 0:.3f} tok/s, hit {r.get('decode_hit_rate')}, "
            f"{agree}/{len(exact)} tokens as exact")  # fmt: skip
    if "llama" not in skip and (model / "model.gguf").exists():
        drop_page_cache()
        res["llama"] = run_llama(model / "model.gguf", tokens, cap, timeout, threads=2)
        log(f"  llama: {res['llama']['status']} {res['llama'].get('decode_tps', 0):.3f} tok/s")
    return summarize(res, unit * k * cfg["num_hidden_layers"])


def ceiling_of(run: dict[str, Any], bandwidth: float, routed_bytes: int, compute: float | None) -> float:
    """min(I/O ceiling at this run's decode hit rate, compute ceiling)."""
    io = bandwidth / max(1.0, (1 - (run.get("decode_hit_rate") or 0.0)) * routed_bytes)
    return min(io, compute) if compute else io


def summarize(res: dict[str, Any], routed_bytes: int) -> dict[str, Any]:
    """Summary keys from the raw runs: the median flash run's tok/s and hit rate against this run's
    bandwidth and in-RAM tok/s; every repeat's ratio beside it."""
    flash, ram = res["flash"], res.get("ram", {})
    tps = flash.get("decode_tps") or 0.0
    hit = flash.get("decode_hit_rate") or 0.0
    bw = res["bandwidth"]["bandwidth_Bps"]
    need = max(1.0, (1 - hit) * routed_bytes)
    io = bw / need
    compute = ram.get("decode_tps") or None
    ceiling = min(io, compute) if compute else io
    serial = io * compute / (io + compute) if compute and io else None  # reads, then the rest: no overlap
    runs = res.get("flash_runs") or [flash]
    every = [flash, *runs, *res.get("warmup_runs", []), *([res["profile"]] if "profile" in res else []),
             *res.get("compare", {}).values()]  # fmt: skip
    same = all(f.get("tokens") == ram.get("tokens") for f in every) if ram.get("tokens") else None
    res.update({
        "decode_tps_runs": [f.get("decode_tps") for f in runs],
        "ceiling_ratio_runs": [_ratio(f.get("decode_tps"), ceiling_of(f, bw, routed_bytes, compute)) for f in runs],
        "decode_tps": tps, "ttft_s": flash.get("ttft_s"), "hit_rate": hit,
        "policy_hit_rates": flash.get("policy_decode_hit_rates"),
        "routed_bytes_per_token": routed_bytes, "bytes_per_token": flash.get("decode_bytes_per_token"),
        "measured_bandwidth_Bps": bw, "engine_read_bandwidth_Bps": (flash.get("extra") or {}).get("read_bandwidth_Bps"),
        "io_ceiling_tps": io, "compute_ceiling_tps": compute, "ceiling_tps": ceiling,
        "ceiling_bound": "compute" if compute and compute < io else "io",
        "serial_bound_tps": serial, "serial_bound_ratio": _ratio(serial, ceiling),
        "ceiling_ratio": _ratio(tps, ceiling), "vs_llama": _ratio(tps, res.get("llama", {}).get("decode_tps")),
        "ttft_ratio_vs_llama": _ratio(flash.get("ttft_s"), res.get("llama", {}).get("ttft_s")),  # ours / llama's
        "same_tokens_as_ram": same,
        "cgroup_peak_bytes": flash.get("cgroup_peak_bytes"), "peak_rss_bytes": flash.get("peak_rss_bytes"),
    })  # fmt: skip
    return res


def device_name() -> str:
    """MLX's default device and, on CUDA, the card (nvidia-smi), for the result's `device`."""
    try:
        out = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.default_device())"],
                             capture_output=True, text=True, timeout=120).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        out = "unknown"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)  # fmt: skip
        out += f" ({q.stdout.strip()})"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument(
        "--skew", type=float, default=2.0, help="router skew of the skewed run (the uniform run uses 0)"
    )
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--memory-cap", type=_size, default=None)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--prefetch-next", type=int, nargs="?", const=1, default=0,
                    help="opt-in, exact: read the guessed experts of the next N layers ahead (default 1 when given)")  # fmt: skip
    ap.add_argument("--prefetch-min-misses", type=float, default=0.0,
                    help="with --prefetch-next: guess only the layers whose decode calls miss this many experts on "
                         "average (0: every layer)")  # fmt: skip
    ap.add_argument("--predict", type=int, default=0,
                    help="opt-in, exact: the predict pass, its reads through this many staging units (0: off)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, help="flash runs per routing (fresh processes)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="flash runs before the repeats, kept under warmup_runs, not summarized (a fresh GPU "
                         "machine compiles MLX's CUDA kernels in its first run)")  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true", help="add a profiled flash run per routing (time per part)"
    )
    ap.add_argument(
        "--compare", default="", help='extra flash runs with other flags: "NAME:FLAGS;NAME:FLAGS"'
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="run each --compare once after every repeat (NAME1, NAME2, ...), not all after the repeats",
    )
    ap.add_argument(
        "--pipeline",
        default="",
        choices=["", "direct", "threaded", "overlap", "legacy"],
        help="device path (engine default)",
    )
    ap.add_argument("--io-threads", type=int, default=0, help="reader threads (0: the engine's default)")
    ap.add_argument("--probe-threads", default="4,8,16",
                    help="the disk limit is the best direct-read probe over these reader thread counts ...")  # fmt: skip
    ap.add_argument("--probe-chunks", default="0,524288",
                    help="... and these preadv sizes (0: one per expert; 524288: the engine's)")  # fmt: skip
    ap.add_argument("--probe-in-flight", default="0",
                    help="... and these reads in flight (0: top-k); e.g. 2,3,0 adds what a decode layer's few "
                         "misses get: in_flight is in each probe")  # fmt: skip
    ap.add_argument("--read-chunk", type=int, default=-1,
                    help="bytes per preadv of every expert read (0: one per expert; -1: the engine's default, "
                         "parts of at least 512 KB only as far as a layer's misses leave reader threads idle)")  # fmt: skip
    ap.add_argument(
        "--top-k", type=int, default=0, help="opt-in, lossy: fewer active experts (0 = the model's)"
    )
    ap.add_argument(
        "--routing-bias",
        default="",
        help="opt-in, lossy: extra flash runs at these cache-aware "
        "routing biases, e.g. 1,4 (compared with the exact run)",
    )
    ap.add_argument("--bias", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--engine-share",
        type=float,
        default=1.0,
        help="give the engine this share of the budget the cap leaves (the rest: OS page cache)",
    )
    ap.add_argument(
        "--buffered", action="store_true", help="read experts through the page cache (no O_DIRECT)"
    )
    ap.add_argument("--skip", action="append", default=[], choices=["ram", "llama"])
    ap.add_argument("--work", default=None, help="where models are made (default $FLASHCODE_HOME/synth)")
    ap.add_argument("--keep", action="store_true", help="keep the models (default: delete them after)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument(
        "--compute-ceiling", type=float, default=None, help="tok/s in RAM measured or extrapolated elsewhere"
    )
    ap.add_argument(
        "--drop-source", action="store_true", help="delete model.safetensors once split and exported"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=PROMPT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    if not args.memory_cap:
        ap.error("--memory-cap is required")
    child_flags = ("--engine-share", str(args.engine_share), *(["--buffered"] if args.buffered else []),
                   *(["--pipeline", args.pipeline] if args.pipeline else []),
                   *(["--io-threads", str(args.io_threads)] if args.io_threads else []),
                   *(["--predict", str(args.predict)] if args.predict else []),
                   *(["--read-chunk", str(args.read_chunk)] if args.read_chunk >= 0 else []),
                   *(["--prefetch-min-misses", str(args.prefetch_min_misses)] if args.prefetch_min_misses else []))  # fmt: skip
    compare = tuple((name.strip(), tuple(flags.split())) for name, _, flags in
                    (c.partition(":") for c in args.compare.split(";") if c.strip()))  # fmt: skip
    work = Path(args.work or Path(os.environ.get("FLASHCODE_HOME", "/tmp/fhome")) / "synth")
    results: dict[str, Any] = {**provenance(), "preset": args.preset, "layers": args.layers, "policy": args.policy,
                               "engine_share": args.engine_share, "buffered": args.buffered,
                               "prefetch_next": args.prefetch_next, "predict": args.predict,
                               "memory_cap": args.memory_cap,
                               "tokens": args.tokens, "repeats": args.repeats, "device": device_name(),
                               "top_k": args.top_k or None, "runs": {}}  # fmt: skip
    for routing in args.routing.split(","):
        skew = 0.0 if routing == "uniform" else args.skew
        model = prepare(
            work, args.preset, args.layers, skew, gguf="llama" not in args.skip, drop_source=args.drop_source
        )
        log(f"{routing} routing ({model.name}) under {args.memory_cap / 1e9:.2f} GB ...")
        results["runs"][routing] = bench_one(model, args.memory_cap, args.tokens, args.policy, args.top_k,
                                             set(args.skip), args.timeout, args.compute_ceiling, args.prefetch_next,
                                             tuple(float(b) for b in args.routing_bias.split(",") if b), child_flags,
                                             args.repeats, args.profile, compare, args.warmup,
                                             tuple(int(t) for t in args.probe_threads.split(",")),
                                             tuple(int(c) for c in args.probe_chunks.split(",")),
                                             args.interleave,
                                             tuple(int(n) for n in args.probe_in_flight.split(",")))  # fmt: skip
        if not args.keep:
            shutil.rmtree(model, ignore_errors=True)
    head = results["runs"].get("skewed") or next(iter(results["runs"].values()))
    for key in ("decode_tps", "ttft_s", "hit_rate", "bytes_per_token", "measured_bandwidth_Bps", "io_ceiling_tps",
                "compute_ceiling_tps", "ceiling_tps", "ceiling_ratio", "vs_llama", "ttft_ratio_vs_llama"):  # fmt: skip
        results[key] = head.get(key)
    for routing, run in results["runs"].items():  # the keys the checks read
        results[f"ceiling_ratio_{routing}"] = run.get("ceiling_ratio")
        results[f"decode_tps_{routing}"] = run.get("decode_tps")
        results[f"serial_bound_ratio_{routing}"] = run.get("serial_bound_ratio")
    results["same_tokens_as_ram"] = (
        all(r.get("same_tokens_as_ram") for r in results["runs"].values())
        if all(r.get("same_tokens_as_ram") is not None for r in results["runs"].values())
        else None
    )
    text = json.dumps(results, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
