"""A model split over several processes (issue 19, MLX in RAM): `--hosts HOSTFILE` launches the ranks with
`mlx.launch` (ring backend over loopback here), each holds its own layers, and the replies are the same
greedy tokens as one process. Stop, a rank killed mid-reply, the hostfile's errors, and the CLI.

Real parts: the default model, MLX's ring backend between two local processes, mlx.launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.base import Done, EngineError, GenerationRequest, SamplingParams, TextDelta
from engine.pipeline import load_hostfile

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the hostfile
def write(tmp_path: Path, data: Any) -> Path:
    p = tmp_path / "hosts.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_a_hostfile_in_mlx_form_or_as_a_list_of_addresses(tmp_path: Path) -> None:
    mlx_form = {
        "backend": "ring",
        "hosts": [{"ssh": "me", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}],
    }
    hosts = load_hostfile(write(tmp_path, mlx_form))
    assert [(h.ssh, h.ip) for h in hosts] == [("me", "127.0.0.1"), ("b", "10.0.0.2")]
    assert [h.ip for h in load_hostfile(write(tmp_path, ["127.0.0.1", "127.0.0.1"]))] == ["127.0.0.1"] * 2


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read the hostfile"),
        ("{not json", "is not JSON"),
        ({"nodes": []}, 'needs a "hosts" list'),
        (["127.0.0.1"], "a pipeline needs at least 2"),
        ([{"ssh": "a"}, "127.0.0.1"], "has no IP address"),
        (["127.0.0.1", "not-an-ip"], "is not an IP address"),
        (["192.0.2.7", "127.0.0.1"], "must be this machine"),
    ],
)
def test_a_bad_hostfile_is_one_clear_sentence(tmp_path: Path, content: Any, says: str) -> None:
    path = tmp_path / "missing.json" if content is None else write(tmp_path, content)
    with pytest.raises(EngineError, match=says):
        load_hostfile(path)


def test_a_sampled_request_gets_one_seed_for_every_rank() -> None:
    from engine.pipeline import same_draws

    warm = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0.7))
    assert same_draws(warm).sampling.seed is not None and same_draws(warm).sampling.temperature == 0.7
    greedy = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0))
    seeded = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0.7, seed=3))
    assert same_draws(greedy) is greedy and same_draws(seeded) is seeded


def test_hosts_runs_each_engine_its_own_way(tmp_path: Path) -> None:
    from engine.registry import backend_factory

    hosts = write(tmp_path, ["127.0.0.1", "127.0.0.1"])
    for name in ("mlx", "flash"):  # mlx.distributed: each rank runs this engine on its own layers
        b = backend_factory(name, hostfile=str(hosts), memory_budget=None)()
        assert type(b).__name__ == "PipelineBackend" and b.name == name
    b = backend_factory("llama", hostfile=str(hosts))()  # llama.cpp's RPC (tests/test_llama_rpc.py)
    assert type(b).__name__ == "LlamaServerBackend" and b.hostfile == hosts
    argv = ["ask", "--backend", "llama", "--llama-url", "http://127.0.0.1:9", "--hosts", str(hosts), "hi"]
    p = subprocess.run([sys.executable, "-m", "webapp.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)  # fmt: skip
    assert p.returncode != 0 and "cannot attach to one already running" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


# --------------------------------------------------------------------------- two processes over loopback
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def run(
    backend: Any, text: str, sampling: SamplingParams = GREEDY, cancel_after: int = 0
) -> tuple[list[int], Done]:
    cancel = threading.Event()
    ids: list[int] = []
    done = None
    req = GenerationRequest(messages=({"role": "user", "content": text},), sampling=sampling)
    for ev in backend.stream(req, cancel):
        if isinstance(ev, TextDelta):
            ids += ev.token_ids
            if cancel_after and len(ids) >= cancel_after:
                cancel.set()
        elif isinstance(ev, Done):
            done = ev
    assert done is not None
    return ids, done


@pytest.fixture(scope="module")
def pipeline(default_model, tmp_path_factory: pytest.TempPathFactory):
    from engine.pipeline import PipelineBackend

    hosts = tmp_path_factory.mktemp("hosts") / "hosts.json"
    hosts.write_text(json.dumps(["127.0.0.1", "127.0.0.1"]))
    b = PipelineBackend(hosts, load_timeout=300)
    b.load(default_model)
    yield b
    b.close()


@pytest.mark.slow
def test_two_processes_give_the_same_greedy_tokens_as_one(pipeline, default_model) -> None:
    from engine.mlx_backend import MLXBackend

    split, done = run(pipeline, "Write a haiku about the sea.")
    again, done2 = run(pipeline, "Write a haiku about the sea.")  # the ranks' prompt caches agree
    warm = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    sampled, _ = run(pipeline, "Name three colours.", warm)  # every rank draws the same tokens
    ram = MLXBackend()
    ram.load(default_model)
    try:
        single, _ = run(ram, "Write a haiku about the sea.")
        sampled_single, _ = run(ram, "Name three colours.", warm)
    finally:
        ram.close()
    assert split == single == again and len(split) == 24 and done.finish_reason == "length"
    assert sampled == sampled_single
    assert done2.stats.cached_tokens > 0
    hosts = done.stats.extra["hosts"]
    layers = int(json.loads((default_model.path / "config.json").read_text())["num_hidden_layers"])
    assert [h["rank"] for h in hosts] == [0, 1] and all(h["host"] == "127.0.0.1" for h in hosts)
    # each rank holds its own layers, together all of them, once
    assert sorted(tuple(h["layers"]) for h in hosts) == [(0, layers // 2), (layers // 2, layers)]
    assert all(h["peak_rss_mb"] > 50 for h in hosts)


@pytest.mark.slow
def test_three_processes_are_exact_too_and_every_rank_reports(default_model, tmp_path: Path) -> None:
    """Three ranks: the ranks' own collectives (Stop, stats) stay in order with the model's (they once ran
    on another stream, beside the next token's forward pass, and read each other's bytes)."""
    from engine.mlx_backend import MLXBackend
    from engine.pipeline import PipelineBackend

    b = PipelineBackend(write(tmp_path, ["127.0.0.1"] * 3), load_timeout=300)
    b.load(default_model)
    try:
        split, done = run(b, "Write a haiku about the sea.")
    finally:
        b.close()
    ram = MLXBackend()
    ram.load(default_model)
    try:
        single, _ = run(ram, "Write a haiku about the sea.")
    finally:
        ram.close()
    assert split == single
    hosts = done.stats.extra["hosts"]
    assert [h["rank"] for h in hosts] == [0, 1, 2] and all(50 < h["peak_rss_mb"] < 5000 for h in hosts), hosts


@pytest.mark.slow
def test_stop_reaches_every_rank_and_the_next_reply_is_exact(pipeline) -> None:
    ids, done = run(
        pipeline, "Write a long story about a robot.", SamplingParams(temperature=0, max_tokens=200), 4
    )
    assert done.finish_reason == "cancelled" and 4 <= len(ids) < 200
    again, done = run(pipeline, "Write a haiku about the sea.")
    assert done.finish_reason == "length" and len(again) == 24  # the ranks are still in step


@pytest.mark.slow
def test_a_rank_killed_mid_reply_is_a_clear_error_and_the_next_turn_launches_again(pipeline) -> None:
    import psutil

    def rank_pid(rank: int) -> int:
        for c in psutil.Process(pipeline._proc.pid).children(recursive=True):
            try:
                if "engine.pipeline_rank" in " ".join(c.cmdline()) and c.environ().get("MLX_RANK") == str(
                    rank
                ):
                    return c.pid
            except psutil.Error:
                continue
        raise AssertionError(f"no rank {rank}")

    req = GenerationRequest(
        messages=({"role": "user", "content": "Write a long story about a robot."},),
        sampling=SamplingParams(temperature=0, max_tokens=200),
    )
    kept, done, killed = "", None, False
    for ev in pipeline.stream(req, threading.Event()):
        if isinstance(ev, TextDelta):
            kept += ev.text
            if len(kept) > 10 and not killed:
                os.kill(rank_pid(1), signal.SIGKILL)
                killed = True
        elif isinstance(ev, Done):
            done = ev
    assert done is not None and done.finish_reason == "error", done
    assert "a host of the pipeline dropped" in (done.error or "") and "next turn" in (done.error or "")
    assert done.text == kept and len(kept) > 10  # nothing streamed is lost
    ids, done = run(pipeline, "Write a haiku about the sea.")
    assert done.finish_reason == "length" and len(ids) == 24, done.error


@pytest.mark.slow
def test_ask_with_hosts_on_the_command_line(tmp_path: Path) -> None:
    hosts = write(tmp_path, ["127.0.0.1", "127.0.0.1"])
    p = subprocess.run(
        [sys.executable, "-m", "webapp.cli", "ask", "--hosts", str(hosts), "--json", "--max-tokens", "8",
         "--temperature", "0", "Say hello."],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["completion_tokens"] == 8 and len(out["hosts"]) == 2, out
    assert "split over the hosts of" in p.stderr


def test_the_reply_footer_lists_each_host_with_its_layers_and_memory() -> None:
    from types import SimpleNamespace

    from webapp.render import make_environment

    footer = make_environment().get_template("macros.html").module.stats_footer
    hosts = [
        {"rank": 0, "host": "192.168.1.10", "layers": [15, 30], "peak_rss_mb": 276},
        {"rank": 1, "host": "192.168.1.11", "layers": [0, 15], "load_rss_mb": 211},
    ]
    m = SimpleNamespace(id=7, status="complete", stats={"completion_tokens": 3, "extra": {"hosts": hosts}})
    html = str(footer(m))
    assert 'data-stat="hosts"' in html and "192.168.1.10 L15–29 276 MB · 192.168.1.11 L0–14 211 MB" in html
    flash = [h | {"bytes_per_token": 12_500_000, "read_Bps": 900_000_000} for h in hosts]
    m.stats["extra"]["hosts"] = flash
    html = str(footer(m))
    assert "192.168.1.10 L15–29 276 MB 12.5 MB/tok @ 900 MB/s · 192.168.1.11 L0–14 211 MB 12.5 MB/tok" in html
    assert "what it read from its disk per token" in html


# --------------------------------------------------------------------------- flash per host
@pytest.mark.slow
@pytest.mark.parametrize(("preset", "budget"), [("moe-tiny", 800_000_000), ("tiny", None)])
def test_flash_per_host_streams_only_its_own_layers_with_the_same_tokens(
    preset: str, budget: int | None, tmp_path_factory: pytest.TempPathFactory, model_home: Path
) -> None:
    """Each rank runs the flash engine on its own layers: it reads only their experts (MoE, under its own
    budget) or FFNs (dense, all streamed) from its disk, and the reply is token for token one process's,
    in RAM and under flash."""
    from engine.flash.backend import FlashBackend
    from engine.flash.split import split_model
    from engine.flash.synth import synth_model
    from engine.flash.synth_moe import synth_moe
    from engine.mlx_backend import MLXBackend
    from engine.models import model_info
    from engine.pipeline import PipelineBackend

    out = tmp_path_factory.mktemp("pflash") / preset
    if preset == "moe-tiny":
        synth_moe(preset, out, skew=2.0, progress=False)
    else:
        synth_model(preset, out, progress=False)
    split_model(out, progress=False)
    info = model_info(out)
    layers = int(json.loads((out / "config.json").read_text())["num_hidden_layers"])
    ask = SamplingParams(temperature=0, max_tokens=12)
    runs = {}
    # the one flash process is this test process (pytest holds ~2 GB in a full run): its budget covers the
    # engine only; each rank's is its whole (small) process's
    single = FlashBackend(memory_budget=budget, runtime_bytes=0 if budget else None)
    for name, b in (("ram", MLXBackend()), ("flash", single)):
        b.load(info)
        try:
            runs[name] = run(b, "Once upon a time", ask)
        finally:
            b.close()
    hosts = tmp_path_factory.mktemp("hosts") / "hosts.json"
    hosts.write_text(json.dumps(["127.0.0.1", "127.0.0.1"]))
    b = PipelineBackend(hosts, engine="flash", memory_budget=budget, load_timeout=300)
    b.load(info)
    try:
        split, done = run(b, "Once upon a time", ask)
        live = b.live_stats()  # the flash meter: every host's counters, sent with the per-token all-sum
    finally:
        b.close()
    assert split == runs["flash"][0] == runs["ram"][0] and len(split) == 12, done.error
    assert [h["layers"] for h in live["hosts"]] == [[layers // 2, layers], [0, layers // 2]], live
    assert all(h["rss_bytes"] > 50 << 20 for h in live["hosts"]) and live["bytes_read"] > 0, live
    per_host = done.stats.extra["hosts"]
    assert sorted(tuple(h["layers"]) for h in per_host) == [(0, layers // 2), (layers // 2, layers)]
    assert all(h["bytes_read"] > 0 and h["bytes_per_token"] > 0 for h in per_host), per_host
    assert done.stats.extra["bytes_read"] == sum(h["bytes_read"] for h in per_host)
    if budget is not None:  # each host planned its own budget; the expert reads split, none twice
        assert all(h["memory_budget_mb"] == budget >> 20 for h in per_host), per_host
        single = runs["flash"][1].stats.extra["bytes_read"]
        assert abs(done.stats.extra["bytes_read"] - single) <= 1024 * len(per_host), (single, per_host)


def test_the_hostfile_picks_mx_distributed_backend_and_mlx_launch_gets_its_own_file(tmp_path: Path) -> None:
    """Ring unless the hostfile names JACCL (Thunderbolt RDMA between Macs) or NCCL (CUDA); a hostfile in
    MLX's form reaches mlx.launch whole (its "rdma" devices kept)."""
    from engine.hostfile import hostfile_backend, mlx_hostfile

    assert hostfile_backend(write(tmp_path, ["127.0.0.1", "127.0.0.1"])) == "ring"
    rdma = {"backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["127.0.0.1"], "rdma": [None, "rdma_en3"]},
                                          {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]}]}  # fmt: skip
    path = write(tmp_path, rdma)
    assert hostfile_backend(path) == "jaccl"
    made = mlx_hostfile(load_hostfile(path), path, "jaccl")
    assert made["hosts"][1]["rdma"] == ["rdma_en3", None] and made["backend"] == "jaccl"
    with pytest.raises(EngineError, match="names backend 'mpi'"):
        load_hostfile(write(tmp_path, {**rdma, "backend": "mpi"}))


def test_the_flash_meter_shows_each_hosts_disk_rate_and_memory() -> None:
    from webapp.render import make_environment

    meter = make_environment().get_template("macros.html").module.engine_meter
    hosts = [{"host": "192.168.1.10", "layers": [6, 12], "bytes_per_s": 850e6, "rss_bytes": 5.5e9},
             {"host": "192.168.1.11", "layers": [0, 6], "bytes_per_s": 0.0, "rss_bytes": 5.25e9}]  # fmt: skip
    m = {"bytes_per_s": 850e6, "rss_bytes": 5.5e9, "memory_budget": 6e9, "hit_rate": None, "peak_rss_bytes": None,
         "mb_per_token": 12.0, "memory_budget_auto": None, "hosts": hosts}  # fmt: skip
    html = str(meter(m))
    assert 'data-meter="hosts"' in html
    assert "192.168.1.10 L6–11 850 MB/s 5.50 GB · 192.168.1.11 L0–5 0 MB/s 5.25 GB" in html
