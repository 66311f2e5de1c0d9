"""Every file under bench/results/ is written by its script: it carries where it came from (`command`,
`git_commit`, `machine`) and the raw runs its summary keys are computed from, and those keys recompute
from the runs. A results file edited by hand, or one no script can write, fails here.

Each file is listed with the key that holds its raw runs; a new results file must be added to `RAW`
(and, where its summary is simple, to the recomputations below).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"

# file -> the key that holds its raw, per-run numbers
RAW = {
    "flash-budget.json": "models",
    "flash-copy-gpu.json": "runs",
    "flash-dense.json": "flash",
    "flash-dense-gpu.json": "flash",
    "flash-dense-gpu-depth.json": "flash_runs",
    "flash-dense-gpu-h100.json": "flash",
    "flash-moe.json": "runs",
    "flash-prefill.json": "runs",
    "flash-moe-gpu.json": "runs",
    "flash-moe-gpu-h100.json": "runs",
    "flash-moe-gpu-h200.json": "runs",
    "flash-moe-gpu-064af62.json": "runs",
    "flash-moe-gpu-direct-first.json": "runs",
    "flash-moe-gpu-deferred.json": "runs",
    "flash-moe-gpu-build.json": "runs",
    "flash-moe-gpu-graphs.json": "runs",
    "flash-moe-gpu-graphs-h200.json": "runs",
    "flash-moe-gpu-speculation-skewed.json": "runs",
    "flash-moe-gpu-speculation-uniform.json": "runs",
    "flash-moe-gpu-interleave-skewed.json": "runs",
    "flash-moe-gpu-interleave-uniform.json": "runs",
    "flash-moe-gpu-queue-skewed.json": "runs",
    "flash-moe-gpu-queue-uniform.json": "runs",
    "flash-moe-gpu-adaptive-skewed.json": "runs",
    "flash-moe-gpu-adaptive-uniform.json": "runs",
    "flash-moe-cpu-chunks.json": "runs",
    "flash-moe-predict-cpu.json": "runs",
    "flash-moe-gpu-chunks-uniform.json": "runs",
    "flash-moe-gpu-chunks-skewed.json": "runs",
    "flash-moe-gpu-chunks48.json": "runs",
    "flash-reader.json": "runs",
    "flash-reader-gpu.json": "runs",
    "flash-residency.json": "residency",
    "flash-residency-gpu.json": "residency",
    "llama.json": "runs",
    "mlx.json": "backend",
    "resume.json": "sizes",
    "routing.json": "predictions",
    "sandbox.json": "raw_runs",
    "sandbox-folders.json": "raw_runs",
    "websocket.json": "backends",
    "projects.json": "backends",
    "agent.json": "raw_runs",
    "agent-constraint.json": "raw_runs",
    "agent-files.json": "raw_runs",
    "agent-files-at.json": "raw_runs",
    "agent-edit-hint.json": "raw_runs",
    "distributed.json": "configs",
    "distributed-flash.json": "configs",
}


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


FILES = sorted(p.name for p in RESULTS.glob("*.json"))


def test_every_results_file_is_known() -> None:
    unknown = [f for f in FILES if f not in RAW]
    assert not unknown, f"add these to RAW with the key of their raw runs: {unknown}"


@pytest.mark.parametrize("name", FILES)
def test_results_file_says_where_it_came_from_and_keeps_its_raw_runs(name: str) -> None:
    result = load(name)
    assert isinstance(result.get("command"), str) and result["command"], "no command"
    assert isinstance(result.get("git_commit"), str) and len(result["git_commit"]) >= 7, "no git_commit"
    machine = result.get("machine")
    assert isinstance(machine, dict) and machine.get("machine") and machine.get("cpus"), "no machine"
    assert result.get(RAW[name]), f"no raw runs under {RAW[name]!r}"


@pytest.mark.parametrize("name", FILES)
def test_results_file_names_a_clean_commit_of_this_repository(name: str) -> None:
    """The code that wrote it can be checked out: a commit of this repository, not `-dirty` (a tree with
    uncommitted changes ran) and not a hash that names nothing. Rerun the script from a clean tree."""
    import subprocess

    commit = load(name)["git_commit"]
    assert not commit.endswith("-dirty"), f"{commit}: written from a tree with uncommitted changes"
    root = RESULTS.parent.parent
    if not (root / ".git").exists():
        pytest.skip("no .git here (a copy of the work tree): the commit cannot be looked up")
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True)
    assert found.returncode == 0, f"{commit} is not a commit of this repository"


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


@pytest.mark.parametrize("name", ["sandbox.json", "sandbox-folders.json"])
def test_sandbox_summary_recomputes(name: str) -> None:
    result = load(name)
    for command, rows in result["raw_runs"].items():
        assert len(rows) == result["runs_per_command"]
        s = result["summary"][command]
        assert s["sandboxed_ms"] == pytest.approx(_median(rows, "sandboxed_ms"), abs=0.01)
        assert s["plain_ms"] == pytest.approx(_median(rows, "plain_ms"), abs=0.01)
    added = statistics.median(s["added_ms"] for s in result["summary"].values())
    assert result["added_ms_per_command"] == pytest.approx(added, abs=0.01)


def test_llama_decode_ratio_recomputes() -> None:
    result = load("llama.json")
    adapter, raw = result["runs"]["adapter"], result["runs"]["raw"]
    assert len(adapter) == len(raw) == result["reps"]
    ratio = round(_median(adapter, "client_tps"), 2) / round(_median(raw, "client_tps"), 2)
    assert result["decode_ratio"] == pytest.approx(ratio, abs=1e-4)


def test_routing_accuracy_recomputes() -> None:
    result = load("routing.json")
    preds = result["predictions"]
    assert len(preds) == result["n"]
    correct = sum(p["route"] == p["expected"] for p in preds)
    assert correct == result["correct"] and result["accuracy"] == pytest.approx(
        correct / len(preds), abs=1e-3
    )


def test_resume_speedups_recompute() -> None:
    result = load("resume.json")
    for key, row in result["sizes"].items():
        if row.get("reprefill_s") is None:  # shape-only rows: sizes and resume times, nothing to recompute
            continue
        assert row["speedup"] == pytest.approx(row["reprefill_s"] / row["resume_s"], rel=0.01)
        assert any(p["resume_s"] == row["resume_s"] for p in row["precisions"].values())
        label = {"1024": "1k", "4096": "4k"}.get(key, "8k" if int(key) >= 7000 else key)
        assert result[f"resume_speedup_{label}"] == row["speedup"]


def test_flash_prefill_summary_recomputes() -> None:
    """The flash engine's CPU prefill against MLX in RAM: every summary key from the raw runs, by the script's
    own `summarize` (its medians and ratios), and each mode's tokens are the in-RAM run's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flash_prefill", RESULTS.parent / "flash_prefill.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = load("flash-prefill.json")
    summary = script.summarize(result["runs"])
    assert {k: result[k] for k in summary} == summary
    assert all(result["same_tokens_as_ram"].values())
    assert all(len(rows) == result["repeats"] for rows in result["runs"].values())


@pytest.mark.parametrize("name", ["flash-reader.json", "flash-reader-gpu.json"])
def test_flash_reader_summary_recomputes(name: str) -> None:
    result = load(name)
    for busy, sfx in ((False, ""), (True, "_gil_busy")):
        bw = {}
        for layout in ("in_place", "copy"):
            rows = [r for r in result["runs"] if r["layout"] == layout and r["gil_busy"] == busy]
            assert len(rows) == result["repeats"]
            assert all(r["bandwidth_Bps"] == pytest.approx(r["bytes"] / r["seconds"], rel=1e-6) for r in rows)
            bw[layout] = _median(rows, "bandwidth_Bps")
        assert result[f"inplace_bandwidth_Bps{sfx}"] == bw["in_place"]
        assert result[f"copy_bandwidth_Bps{sfx}"] == bw["copy"]
        assert result[f"inplace_vs_copy{sfx}"] == pytest.approx(bw["in_place"] / bw["copy"], abs=1e-3)


@pytest.mark.parametrize("name", ["distributed.json", "distributed-flash.json"])
def test_distributed_summary_recomputes(name: str) -> None:
    r = load(name)
    ref = r["configs"]["single"]["runs"][0]["token_ids"]
    runs = [run for c in r["configs"].values() for run in c["runs"]]
    assert r["same_tokens_as_single"] == all(run["token_ids"] == ref for run in runs)
    for name, c in r["configs"].items():
        s = r["summary"][name]
        assert s["decode_tps_median"] == statistics.median(run["decode_tps"] for run in c["runs"])
        assert s["ttft_s_median"] == statistics.median(run["ttft_s"] for run in c["runs"])
        if name != "single":
            assert r["hosts"][name] == len(c["runs"][-1]["hosts"]) == len(s["layers_per_rank"])
        if r.get("engine") == "flash":  # the pipeline's bytes per token are its hosts' together
            assert s["bytes_per_token_median"] == statistics.median(
                run["bytes_per_token"] for run in c["runs"]
            )
            for run in c["runs"]:
                assert name == "single" or run["bytes_per_token"] == sum(
                    h["bytes_per_token"] for h in run["hosts"]
                )


@pytest.mark.parametrize("name", ["flash-residency.json", "flash-residency-gpu.json"])
def test_residency_efficiency_recomputes_from_the_runs(name: str) -> None:
    """Each budget's numbers are its fastest run's; the efficiency recomputes from them; every run's
    tokens equal the in-RAM run's."""
    d = load(name)
    budgets = d["residency"]["budgets"]
    ram = d["residency"]["ram"]["tokens"]
    for b in budgets.values():
        best = max(b["runs"], key=lambda r: r["decode_tps"])
        assert b["decode_tps"] == best["decode_tps"] and b["bytes_per_token"] == best["bytes_per_token"]
        assert b["same_tokens_as_ram"] == all(r["tokens"] == ram for r in b["runs"])
    lo = budgets["min"]
    for name_, eff in d["residency_efficiency"].items():
        hi = budgets[name_]
        gain = (hi["decode_tps"] - lo["decode_tps"]) / lo["decode_tps"]
        cut = (lo["bytes_per_token"] - hi["bytes_per_token"]) / lo["bytes_per_token"]
        assert eff == round(gain / cut, 3)


@pytest.mark.parametrize(
    "name", ["flash-dense-gpu.json", "flash-dense-gpu-depth.json", "flash-dense-gpu-h100.json"]
)
def test_dense_gpu_summary_recomputes(name: str) -> None:
    """The dense GPU headline: the ceiling is the best disk probe (or the in-memory run), the
    headline run is the median of the first depth's runs, and each depth's ratios recompute."""
    d = load(name)
    io = d["measured_bandwidth_Bps"] / d["bytes_per_token"]
    ceiling = min(io, d["compute_ceiling_tps"]) if d["compute_ceiling_tps"] else io
    assert d["ceiling_tps"] == pytest.approx(ceiling, rel=1e-9)
    assert d["ceiling_ratio"] == round(d["flash"]["decode_tps"] / ceiling, 3)
    assert d["same_tokens_as_ram"] == (d["flash"]["tokens"] == d["ram"]["tokens"])
    if "flash_runs" not in d:  # a single run (written before --repeats)
        return
    assert d["measured_bandwidth_Bps"] == max(b["bandwidth_Bps"] for b in d["bandwidth_probes"])
    runs = d["flash_runs"][str(d["depths"][0])]
    assert len(runs) == d["repeats"]
    ranked = sorted(runs, key=lambda r: r["decode_tps"])
    assert d["flash"] == ranked[(len(ranked) - 1) // 2]
    for depth, s in d["by_depth"].items():
        rows = d["flash_runs"][depth]
        assert s["decode_tps"] == [r["decode_tps"] for r in rows]
        assert s["ceiling_ratio"] == [round(r["decode_tps"] / ceiling, 3) for r in rows]
        mid = sorted(rows, key=lambda r: r["decode_tps"])[(len(rows) - 1) // 2]
        assert s["median_ceiling_ratio"] == round(mid["decode_tps"] / ceiling, 3)
        assert s["same_tokens_as_ram"] == all(r["tokens"] == d["ram"]["tokens"] for r in rows)


def test_expert_copy_summary_recomputes() -> None:
    """One expert into its bank slot (bench/flash_copy.py): each path's median is its copies' median, the
    speed-up recomputes from them, and every path left the expert's bytes in every slot."""
    d = load("flash-copy-gpu.json")
    for name, run in d["runs"].items():
        assert len(run["ms"]) == d["repeats"] and run["bank_holds_expert"] is True
        assert d[f"{name}_median_ms"] == statistics.median(run["ms"])
    assert d["speedup_direct_pinned"] == round(
        d["mx_array_update_median_ms"] / d["direct_pinned_median_ms"], 2
    )


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("agent") and f != "agent-constraint.json"])
def test_agent_success_rates_recompute(name: str) -> None:
    """bench/agent.py: each backend and mode's success rate is its raw runs' share of passed tasks."""
    result = load(name)
    groups: dict[tuple[str, str], list[bool]] = {}
    for r in result["raw_runs"]:
        groups.setdefault((r["backend"], r["mode"]), []).append(r["success"])
    assert {b: set(m) for b, m in result["success_rate"].items()} == {
        b: {m for bb, m in groups if bb == b} for b, _ in groups
    }
    for (backend, mode), ok in groups.items():
        assert result["success_rate"][backend][mode] == pytest.approx(round(sum(ok) / len(ok), 3), abs=1e-9)
