"""A synthetic dense model over twice the size of a cgroup memory cap runs under it, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.flash.bench import cgroup_unavailable, run_child

CAP = 360_000_000


@pytest.mark.slow
@pytest.mark.skipif(cgroup_unavailable() is not None, reason=f"{cgroup_unavailable()}")
def test_flash_runs_a_model_twice_the_cap_under_it(
    tmp_path_factory: pytest.TempPathFactory, model_home: Path
) -> None:
    from engine.flash.split import split_model
    from engine.flash.synth import synth_model

    model = synth_model("ffn-heavy", tmp_path_factory.mktemp("big") / "m", layers=88, progress=False)
    try:
        split_model(model, progress=False)
        size = (model / "model.safetensors").stat().st_size
        assert size >= 2 * CAP, f"the synthetic model ({size} bytes) must be at least twice the cap"
        capped = run_child("flash", model, 4, CAP, timeout=600, prompt="Once")
        assert capped["status"] == "ok", capped
        ram = run_child("ram", model, 4, None, timeout=600, prompt="Once")
        assert ram["status"] == "ok", ram
        assert capped["tokens"] == ram["tokens"] and len(ram["tokens"]) == 4
        assert capped["cgroup_peak_bytes"] <= CAP
        assert capped["extra"]["bytes_read"] > 0 and capped["extra"]["budget"]["total"] < CAP
    finally:
        import shutil

        shutil.rmtree(model, ignore_errors=True)
