"""llama.cpp's RPC backend for `--backend llama --hosts` (issue 19): a real rpc-server on 127.0.0.1 holds
half of the default model's layers, the real llama-server the other half, and the greedy reply is the
one llama-server gives alone. A worker killed mid-reply is a clear error that keeps the text, and the
next turn starts both again. The layer plan and the hostfile's ports need no binary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.base import Done, EngineError, GenerationRequest, SamplingParams, TextDelta
from engine.hostfile import RPC_PORT, load_hostfile
from engine.llama_rpc import layer_plan, rpc_args

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def test_layers_split_evenly_this_machine_first() -> None:
    plan = layer_plan(30, 2)
    assert plan.spans == [(0, 15), (15, 30)] and plan.n_gpu_layers == 16  # 15 blocks + the output layer
    plan = layer_plan(31, 3)
    assert plan.spans == [(0, 11), (11, 21), (21, 31)] and plan.tensor_split == [10, 10]
    with pytest.raises(EngineError, match="cannot be split over 5 hosts"):
        layer_plan(4, 5)


def test_the_hostfile_names_each_workers_port(tmp_path: Path) -> None:
    p = tmp_path / "hosts.json"
    p.write_text(json.dumps(["127.0.0.1", "127.0.0.1:50070", {"ips": ["10.0.0.3"], "rpc_port": 50071}]))
    hosts = load_hostfile(p)
    assert [h.port for h in hosts] == [RPC_PORT, 50070, 50071]
    args = rpc_args(hosts[1:], layer_plan(30, 3))
    assert args == ["--rpc", "127.0.0.1:50070,10.0.0.3:50071", "-ngl", "21", "--tensor-split", "10,10"]
    p.write_text(json.dumps(["127.0.0.1", "127.0.0.1:99999"]))
    with pytest.raises(EngineError, match="not a port number"):
        load_hostfile(p)


# --------------------------------------------------------------------------- the real binaries
def reply(backend, text: str, n: int = 24, on_text=None) -> tuple[str, Done]:
    req = GenerationRequest(messages=({"role": "user", "content": text},), sampling=replace_max(n))
    got, done = "", None
    for ev in backend.stream(req, threading.Event()):
        if isinstance(ev, TextDelta):
            got += ev.text
            if on_text is not None:
                on_text(got)
        elif isinstance(ev, Done):
            done = ev
    assert done is not None
    return got, done


def replace_max(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


@pytest.fixture(scope="module")
def rpc_backend(default_model, tmp_path_factory: pytest.TempPathFactory):
    from engine.llama_server import LlamaServerBackend, free_port

    hosts = tmp_path_factory.mktemp("rpc") / "hosts.json"
    hosts.write_text(json.dumps(["127.0.0.1", f"127.0.0.1:{free_port()}"]))
    b = LlamaServerBackend(hostfile=hosts, threads=1)
    b.load(default_model)
    yield b
    b.close()


@pytest.mark.llama
@pytest.mark.slow
def test_two_hosts_over_rpc_give_one_servers_greedy_reply(rpc_backend, default_model) -> None:
    from engine.llama_server import LlamaServerBackend

    one = LlamaServerBackend(threads=1)
    one.load(default_model)
    try:
        alone, _ = reply(one, "Write a haiku about the sea.")
    finally:
        one.close()
    split, done = reply(rpc_backend, "Write a haiku about the sea.")
    assert split == alone and done.finish_reason in ("length", "stop") and done.stats.completion_tokens > 5
    hosts = done.stats.extra["hosts"]
    layers = int(json.loads((default_model.path / "config.json").read_text())["num_hidden_layers"])
    assert [tuple(h["layers"]) for h in hosts] == [(0, layers // 2), (layers // 2, layers)]
    assert hosts[1]["host"].startswith("127.0.0.1:") and all(h["peak_rss_mb"] > 20 for h in hosts), hosts
    # the worker holds its layers' weights: the main server was started with them offloaded
    argv = " ".join(rpc_backend.process.proc.args)
    assert f"--rpc {hosts[1]['host']}" in argv and f"-ngl {layers - layers // 2 + 1}" in argv


@pytest.mark.llama
@pytest.mark.slow
def test_a_worker_killed_mid_reply_is_a_clear_error_and_the_next_turn_starts_again(rpc_backend) -> None:
    worker = rpc_backend.cluster.workers[0]
    killed = []

    def kill(text: str) -> None:
        if len(text) > 10 and not killed:
            os.kill(worker.proc.pid, signal.SIGKILL)
            killed.append(True)

    text, done = reply(rpc_backend, "Write a long story about a robot.", 300, kill)
    assert killed and done.finish_reason == "error", done
    assert "an RPC worker" in (done.error or "") and "next message starts them again" in (done.error or "")
    assert done.text == text and len(text) > 10  # nothing streamed is lost
    again, done = reply(rpc_backend, "Write a haiku about the sea.")
    assert done.finish_reason in ("length", "stop") and again, done.error
    assert rpc_backend.cluster.alive()


@pytest.mark.llama
@pytest.mark.slow
def test_ask_with_hosts_and_the_llama_backend(tmp_path: Path) -> None:
    from engine.llama_server import free_port

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(["127.0.0.1", f"127.0.0.1:{free_port()}"]))
    p = subprocess.run(
        [sys.executable, "-m", "webapp.cli", "ask", "--backend", "llama", "--llama-threads", "1", "--hosts",
         str(hosts), "--json", "--max-tokens", "8", "--temperature", "0", "Say hello."],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert len(out["hosts"]) == 2 and out["completion_tokens"] > 0, out
    assert "llama.cpp's RPC" in p.stderr and "trusted network" in p.stderr


@pytest.mark.llama
def test_rpc_worker_serves_this_machine_and_refuses_an_address_of_another(tmp_path: Path) -> None:
    import time

    from engine.hostfile import Host
    from engine.llama_rpc import _listening
    from engine.llama_server import free_port

    cli = [sys.executable, "-m", "webapp.cli", "rpc-worker"]
    p = subprocess.run([*cli, "--host", "192.0.2.7"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode != 0 and "not an address of this machine" in p.stderr
    port = free_port()
    proc = subprocess.Popen([*cli, "--host", "127.0.0.1", "--port", str(port), "--threads", "1"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _listening(Host("127.0.0.1", "127.0.0.1", port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _listening(Host("127.0.0.1", "127.0.0.1", port))
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "NOT authenticated" in err
