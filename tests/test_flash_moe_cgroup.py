"""A synthetic MoE over twice the size of a cgroup memory cap runs under it, to the same tokens as in RAM."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.flash.bench import cgroup_unavailable, run_child

CAP = 360_000_000


@pytest.mark.slow
@pytest.mark.skipif(cgroup_unavailable() is not None, reason=f"{cgroup_unavailable()}")
def test_flash_moe_runs_a_model_twice_the_cap_under_it(
    tmp_path_factory: pytest.TempPathFactory, model_home: Path
) -> None:
    from engine.flash.split import split_model
    from engine.flash.synth_moe import synth_moe

    model = synth_moe("moe-heavy", tmp_path_factory.mktemp("bigmoe") / "m", skew=2.0, progress=False)
    try:
        split_model(model, progress=False)
        size = (model / "model.safetensors").stat().st_size
        assert size >= 2 * CAP, f"the synthetic MoE ({size} bytes) must be at least twice the cap"
        capped = run_child("flash", model, 4, CAP, timeout=600, prompt="Once upon")
        assert capped["status"] == "ok", capped
        ram = run_child("ram", model, 4, None, timeout=600, prompt="Once upon")
        assert ram["status"] == "ok", ram
        assert capped["tokens"] == ram["tokens"] and len(ram["tokens"]) == 4
        assert capped["cgroup_peak_bytes"] <= CAP
        extra = capped["extra"]
        assert extra["budget"]["total"] < CAP and extra["bytes_read"] > 0
        cache = extra["expert_cache"]
        assert cache["used_bytes"] <= cache["capacity_bytes"] < CAP
        assert 0.0 <= extra["hit_rate"] <= 1.0
    finally:
        shutil.rmtree(model, ignore_errors=True)
