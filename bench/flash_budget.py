"""Issue 22: `--memory-budget` is the whole process's. Each model runs in a memory cgroup whose limit is
the budget (page cache included) and its peak RSS is compared with the budget.

    .venv/bin/python bench/flash_budget.py --out bench/results/flash-budget.json
    .venv/bin/python bench/flash_budget.py --model default=300MB --model agent=750MB --model moe=800MB --moe-layers 8

Models: `default` (SmolLM2-135M, the default model), `agent` (Qwen2.5-Coder-0.5B Q4_K_M, `flashcode setup`
installs it) and `moe` (`flashcode synth qwen3-30b-a3b --layers N`, made under --work). Each is split
for flash if it is not yet. Per model, in child processes (engine.flash.bench), page cache dropped
before each capped run:
- `ram`: the model in RAM, uncapped: the reference tokens and tok/s (short prompt, greedy);
- `flash`: the flash engine under the cgroup, `--memory-budget` = the cgroup's limit: same prompt;
- `flash_fill` / `ram_fill`: a prompt that fills the context the budget planned (minus the reply), so the
  KV cache and attention scores are as large as the plan allows: the peak RSS that matters.
Recorded per run: status (an OOM kill is reported as such), tokens, decode tok/s, the runtime measured at
load (RSS after imports, MLX and the tokenizer) and the allowance, peak RSS since load, the cgroup's peak
and OOM kills, the plan. `unaccounted_bytes` = peak RSS - runtime RSS - what the plan says the engine
holds at that context: what TRANSIENT_ALLOWANCE (engine/flash/budget.py) has to cover.
Runs as root (cgroups).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import provenance  # noqa: E402
from engine.flash.bench import PROMPT, cgroup_unavailable, drop_page_cache, run_child  # noqa: E402

# moe: 8 layers (2.9 GB) under 0.8 GB, where a 4096-token context does not fit beside the smallest expert
# cache, so the plan takes 256 tokens (at 1 GB it plans 4096, and filling that took over 30 min on 2 cores)
DEFAULT_BUDGETS = {"default": "300MB", "agent": "750MB", "moe": "800MB"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_dir(kind: str, work: Path, moe_layers: int) -> Path:
    """The model's directory, split for flash (made here for `moe`)."""
    from engine import paths
    from engine.flash.split import split_model
    from engine.models import ensure_agent_model, ensure_default_model

    if kind == "default":
        path = ensure_default_model(paths.home(), quiet=True).path
    elif kind == "agent":
        path = ensure_agent_model(paths.home(), quiet=True).path
    else:
        from engine.flash.synth_moe import synth_moe

        path = work / f"qwen3-30b-a3b-l{moe_layers}"
        if not (path / "config.json").exists():
            log(f"synthesizing qwen3-30b-a3b with {moe_layers} layers in {path} ...")
            synth_moe("qwen3-30b-a3b", path, layers=moe_layers, seed=0, skew=2.0, progress=False)
    if not (path / "split" / "manifest.json").exists():
        log(f"splitting {path} ...")
        split_model(path, progress=False)
    return path


def engine_bytes(plan: dict[str, Any], tokens: int) -> int:
    """What the plan says the engine holds with `tokens` in the context (KV in mlx-lm's 256-token steps)."""
    kv_tokens = -(-tokens // 256) * 256
    return (
        plan["fixed"] - plan["runtime"] + plan["kv_per_token"] * kv_tokens + plan["scores_per_token"] * tokens
    )


def summarize_run(run: dict[str, Any], budget: int) -> dict[str, Any]:
    extra = run.get("extra") or {}
    plan = extra.get("budget") or {}
    out = {
        "status": run.get("status"),
        "prompt_tokens": run.get("prompt_tokens"),
        "decode_tps": run.get("decode_tps"),
        "runtime_rss_bytes": extra.get("runtime_rss_bytes"),
        "runtime_allowance_bytes": extra.get("runtime_allowance_bytes"),
        "peak_rss_bytes": run.get("process_peak_rss_bytes") or run.get("peak_rss_bytes"),
        "cgroup_peak_bytes": run.get("cgroup_peak_bytes"),
        "cgroup_oom_kills": run.get("cgroup_oom_kills"),
        "context": plan.get("context"),
    }
    if out["peak_rss_bytes"]:
        out["peak_rss_within_budget"] = out["peak_rss_bytes"] <= budget
        out["headroom_bytes"] = budget - out["peak_rss_bytes"]
    if plan and out["peak_rss_bytes"] and extra.get("runtime_rss_bytes"):
        used = engine_bytes(plan, (run.get("prompt_tokens") or 0) + (run.get("completion_tokens") or 0))
        out["unaccounted_bytes"] = out["peak_rss_bytes"] - extra["runtime_rss_bytes"] - used
        # beyond MLX's own peak (every engine array on the CPU) and the reader's buffers: allocator slack,
        # code pages, Python: what the allowance is for
        out["mlx_peak_bytes"] = run.get("mlx_peak_bytes")
        if run.get("mlx_peak_bytes"):
            outside = (
                out["peak_rss_bytes"] - extra["runtime_rss_bytes"] - run["mlx_peak_bytes"] - plan["buffers"]
            )
            out["outside_mlx_bytes"] = outside
    return out


def bench_model(kind: str, path: Path, budget: int, tokens: int, timeout: float) -> dict[str, Any]:
    res: dict[str, Any] = {"model": kind, "path": str(path), "memory_budget": budget, "tokens": tokens,
                           "model_bytes": sum(f.stat().st_size for f in path.glob("model*.safetensors"))}  # fmt: skip
    log(f"{kind}: in RAM, uncapped ...")
    res["ram"] = run_child("ram", path, tokens, None, timeout)
    log(f"  {res['ram']['status']}: {res['ram'].get('decode_tps', 0):.2f} tok/s")
    drop_page_cache()
    log(f"{kind}: flash in a {budget / 1e6:.0f} MB cgroup, --memory-budget {budget / 1e6:.0f} MB ...")
    res["flash"] = run_child("flash", path, tokens, budget, timeout)
    log(f"  {res['flash']['status']}: {res['flash'].get('decode_tps', 0):.2f} tok/s, "
        f"peak RSS {res['flash'].get('process_peak_rss_bytes', 0) / 1e6:.1f} MB")  # fmt: skip
    if res["flash"]["status"] == "ok":
        drop_page_cache()
        log(f"{kind}: flash, a prompt filling the context its plan allows ...")
        res["flash_fill"] = run_child("flash", path, tokens, budget, timeout, ["--fill", "-1"])
        log(f"  {res['flash_fill']['status']}: {res['flash_fill'].get('prompt_tokens')} prompt tokens, "
            f"peak RSS {res['flash_fill'].get('process_peak_rss_bytes', 0) / 1e6:.1f} MB")  # fmt: skip
        if res["flash_fill"].get("fill"):  # the same prompt in RAM
            res["ram_fill"] = run_child(
                "ram", path, tokens, None, timeout, ["--fill", str(res["flash_fill"]["fill"])]
            )
            log(f"  ram: {res['ram_fill']['status']}")
    same = res["flash"].get("tokens") == res["ram"].get("tokens") if res["ram"].get("tokens") else None
    res["summary"] = {
        "flash": summarize_run(res["flash"], budget),
        "same_tokens_as_ram": same,
        "ram_decode_tps": res["ram"].get("decode_tps"),
    }
    if "flash_fill" in res:
        res["summary"]["flash_fill"] = summarize_run(res["flash_fill"], budget)
        ram_fill = res.get("ram_fill", {}).get("tokens")
        res["summary"]["fill_same_tokens_as_ram"] = (
            res["flash_fill"].get("tokens") == ram_fill if ram_fill else None
        )
    return res


def main(argv: list[str] | None = None) -> int:
    from webapp.cli import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], metavar="KIND=BUDGET",
                    help=f"default, agent or moe, each with its budget (default: {DEFAULT_BUDGETS})")  # fmt: skip
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--work", default=None, help="where the synthetic MoE is made (default $FLASHCODE_HOME/synth)"
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="write the JSON here (bench/results/flash-budget.json)")
    args = ap.parse_args(argv)
    reason = cgroup_unavailable()
    if reason:
        raise SystemExit(f"flash_budget: {reason}")
    from engine import paths

    work = Path(args.work) if args.work else paths.home() / "synth"
    pairs = [m.split("=", 1) for m in args.model] or [[k, v] for k, v in DEFAULT_BUDGETS.items()]
    res: dict[str, Any] = {**provenance(), "prompt": PROMPT, "tokens": args.tokens, "models": {}}
    for kind, budget in pairs:
        if kind not in DEFAULT_BUDGETS:
            raise SystemExit(f"flash_budget: unknown model {kind!r}: default, agent or moe")
        path = model_dir(kind, work, args.moe_layers)
        res["models"][kind] = bench_model(kind, path, parse_size(budget), args.tokens, args.timeout)
        if args.out:  # after each model, so a later failure keeps what was measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(json.dumps({k: v["summary"] for k, v in res["models"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
