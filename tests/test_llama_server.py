"""The llama-server backend against the real binary and the real default model: start, stream,
cancel, stop, attach, context errors, saved slots across a restart, a server killed mid-reply,
and `flashcode ask --backend llama --json`. One server for the module; a few tests start their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from engine.base import ContextLimitError, Done, GenerationRequest, SamplingParams, TextDelta

pytestmark = [pytest.mark.llama, pytest.mark.slow]

llama_server = pytest.importorskip("engine.llama_server")
try:
    BINARY = llama_server.find_llama_server()
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"no llama-server: {exc}", allow_module_level=True)

# one thread: the test machine is shared, and llama.cpp's spinning thread pool collapses when oversubscribed
THREADS = int(os.environ.get("FLASHCODE_TEST_LLAMA_THREADS", "1"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
CHAT = ({"role": "user", "content": "Name three primary colors."},)


def run(
    backend, request: GenerationRequest, cancel: threading.Event | None = None
) -> tuple[list[TextDelta], Done]:
    deltas, done = [], None
    for ev in backend.stream(request, cancel or threading.Event()):
        if isinstance(ev, Done):
            done = ev
        else:
            deltas.append(ev)
    assert done is not None
    return deltas, done


def our_llama_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "llama-server" in p.name():
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Iterator[Path]:
    h = tmp_path_factory.mktemp("llama-home")
    (h / "models").symlink_to(model_home / "models", target_is_directory=True)
    (h / "gguf").symlink_to(model_home / "gguf", target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHCODE_HOME", str(h))
    yield h
    mp.undo()


@pytest.fixture(scope="module")
def llama(home: Path, default_model) -> Iterator:
    b = llama_server.LlamaServerBackend(context_length=2048, threads=THREADS)
    b.load(default_model)
    yield b
    b.close()


def test_llama_starts_healthy_and_streams_a_reply(llama, home: Path) -> None:
    assert llama.client.health()
    props = llama.client.props()
    assert Path(props["model_path"]).name == llama.model.gguf_path.name
    assert llama.context_length == 2048
    deltas, done = run(llama, GenerationRequest(messages=CHAT, sampling=GREEDY))
    assert done.error is None and done.finish_reason in ("stop", "length")
    assert done.text == "".join(d.text for d in deltas) and done.text.strip()
    s = done.stats
    assert s.prompt_tokens > 10 and s.completion_tokens > 0 and s.decode_tps > 0 and s.ttft_s > 0
    assert s.peak_memory_bytes > 0
    assert llama.client.metrics()["llamacpp:tokens_predicted_total"] >= s.completion_tokens
    log_file = llama.process.log_path
    assert log_file.parent == home / "logs" and log_file.stat().st_size > 0


def test_llama_raw_prompt_streams_token_ids_and_honours_stop(llama) -> None:
    req = GenerationRequest(
        prompt="def fib(n):", sampling=SamplingParams(temperature=0, max_tokens=40, stop=("return",))
    )
    deltas, done = run(llama, req)
    assert all(d.token_ids for d in deltas[:-1])
    assert done.finish_reason == "stop" and "return" not in done.text


def test_llama_a_reply_ended_by_the_model_counts_no_end_token(llama) -> None:
    """The server counts the end token it sampled as generated; flashcode counts the reply's tokens, as on
    MLX ("Yes." is 2 tokens, not 3): the stats, the cost estimate and /v1's usage agree across engines."""
    short = SamplingParams(temperature=0.0, max_tokens=40)
    ask = ({"role": "user", "content": "Say only the word yes."},)
    _, chat = run(llama, GenerationRequest(messages=ask, sampling=short))
    assert chat.finish_reason == "stop" and chat.text.strip()
    assert chat.stats.completion_tokens == len(llama.tokenize(chat.text))
    prompt = llama.client.apply_template(ask)
    deltas, raw = run(llama, GenerationRequest(prompt=prompt, sampling=short))
    assert raw.finish_reason == "stop" and raw.text == chat.text
    assert (
        raw.stats.completion_tokens == sum(len(d.token_ids) for d in deltas) == chat.stats.completion_tokens
    )
    stop = SamplingParams(
        temperature=0.0, max_tokens=40, stop=(".",)
    )  # a stop string's tokens count (as on MLX)
    _, stopped = run(llama, GenerationRequest(messages=ask, sampling=stop))
    assert stopped.finish_reason == "stop" and stopped.text + "." == chat.text
    assert stopped.stats.completion_tokens == len(llama.tokenize(chat.text))
    cut = SamplingParams(temperature=0.0, max_tokens=3)  # cut at the limit: every token is the reply's
    _, limited = run(
        llama, GenerationRequest(messages=({"role": "user", "content": "Write a long poem."},), sampling=cut)
    )
    assert limited.finish_reason == "length" and limited.stats.completion_tokens == 3


def test_llama_repeated_turn_reuses_the_prompt_cache(llama) -> None:
    req = GenerationRequest(messages=CHAT, sampling=SamplingParams(temperature=0, max_tokens=4))
    run(llama, req)
    _, done = run(llama, req)
    assert done.stats.cached_tokens > 0


# Stop's latency is a few ms here (bench numbers, not a timed test): a bound of 2 s still fails an
# engine that ignores the cancel (these replies run ~30 s, these prefills ~8 s) but not a loaded box.
STOP_BOUND_S = 2.0


def test_llama_cancel_ends_the_stream_at_once(llama) -> None:
    cancel = threading.Event()
    req = GenerationRequest(
        prompt="Once upon a time", sampling=SamplingParams(temperature=0.8, max_tokens=2000)
    )
    stamps: dict[str, float] = {}

    def cancel_soon() -> None:
        time.sleep(0.3)
        stamps["set"] = time.perf_counter()
        cancel.set()

    threading.Thread(target=cancel_soon).start()
    deltas, done = run(llama, req, cancel)
    latency = time.perf_counter() - stamps["set"]
    assert done.finish_reason == "cancelled" and done.error is None
    assert latency < STOP_BOUND_S, f"cancel took {latency * 1000:.0f} ms"
    assert done.stats.completion_tokens < 1000  # 2,000 were asked for
    _, after = run(
        llama, GenerationRequest(messages=CHAT, sampling=SamplingParams(temperature=0, max_tokens=4))
    )
    assert after.error is None and after.text


def test_llama_chat_reply_stopped_or_cut_keeps_its_token_counts(llama) -> None:
    """The chat endpoint streams no token ids: each delta carries the server's running count
    (`timings_per_token`), so a reply stopped mid-way, or cut by the server dying, still has its
    generated and prompt tokens (it had 0 and 0: the stats left it out). Greedy, so the count can be
    checked against the whole reply's."""
    long = ({"role": "user", "content": "Write a detailed essay about the history of the Roman empire."},)
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    whole_deltas, whole = run(llama, GenerationRequest(messages=long, sampling=greedy))
    assert whole.stats.completion_tokens >= 40 and whole.stats.prompt_tokens > 20
    counts = [d.count for d in whole_deltas]
    assert all(n >= 1 for n in counts) and sum(counts) == whole.stats.completion_tokens
    cancel = threading.Event()
    events = llama.stream(GenerationRequest(messages=long, sampling=greedy), cancel)
    got = []
    for ev in events:
        got.append(ev)
        if len(got) == 10:
            cancel.set()
        if isinstance(ev, Done):
            break
    done = got[-1]
    assert isinstance(done, Done) and done.finish_reason == "cancelled"
    streamed = sum(e.count for e in got if isinstance(e, TextDelta))
    assert streamed == sum(counts[:10]) and done.stats.completion_tokens >= streamed
    assert done.stats.prompt_tokens == whole.stats.prompt_tokens  # cached or read, the prompt is counted


def test_llama_cancel_during_a_long_prefill_ends_the_stream_at_once(llama) -> None:
    long = ({"role": "user", "content": " ".join(f"item{i}" for i in range(450))},)  # ~1,700 tokens
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    t0 = time.perf_counter()
    deltas, done = run(llama, GenerationRequest(messages=long, sampling=GREEDY), cancel)
    assert done.finish_reason == "cancelled" and not deltas
    assert time.perf_counter() - t0 < 0.1 + STOP_BOUND_S
    # the server sent no count: the prompt is counted all the same (the context gauge read 0 of it)
    assert done.stats.prompt_tokens == len(llama.apply_chat_template(long)) > 1500
    # a turn after a first (its prefix cached): the server counted the cached part only (89 of ~1,600: walkthrough)
    _, first = run(llama, GenerationRequest(messages=CHAT, sampling=GREEDY))
    later = (*CHAT, {"role": "assistant", "content": first.text}, *long)
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    _, again = run(llama, GenerationRequest(messages=later, sampling=GREEDY, progress=True), cancel)
    assert again.finish_reason == "cancelled" and again.stats.prompt_tokens == len(
        llama.apply_chat_template(later)
    )
    _, after = run(
        llama, GenerationRequest(messages=CHAT, sampling=SamplingParams(temperature=0, max_tokens=4))
    )
    assert after.error is None and after.text


COUNTING = "Count from 1 to 1000: 1, 2, 3,"  # greedy, it counts on to the token limit (~30 s)


def test_llama_cancel_while_another_reply_holds_the_slot_ends_at_once(llama) -> None:
    """llama-server sends a stream's headers only once a slot takes its task. With its one slot busy
    (another client's reply, or a cancelled prefill's last batch), a Stop had to wait for them: the
    reply ended when the other did. The socket is now shut from its connect on."""
    hold, held = threading.Event(), []
    counting = GenerationRequest(prompt=COUNTING, sampling=SamplingParams(temperature=0, max_tokens=2000))
    holder = threading.Thread(target=lambda: held.append(run(llama, counting, hold)[1]))
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while not llama.client.metrics().get("llamacpp:requests_processing") and time.monotonic() < deadline:
            time.sleep(0.02)
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        t0 = time.perf_counter()
        deltas, done = run(llama, GenerationRequest(messages=CHAT, sampling=GREEDY), cancel)
        elapsed = time.perf_counter() - t0
        assert holder.is_alive()  # the other reply still holds the slot: this one never started
        assert done.finish_reason == "cancelled" and done.error is None and not deltas
        assert elapsed < 0.3 + STOP_BOUND_S, f"cancel took {elapsed * 1000:.0f} ms"
    finally:
        hold.set()
        holder.join(30)
    assert held[0].finish_reason == "cancelled" and held[0].error is None
    _, after = run(llama, GenerationRequest(messages=CHAT, sampling=GREEDY))
    assert after.error is None and after.text


def test_llama_too_long_prompt_raises_context_limit(llama) -> None:
    long = ({"role": "user", "content": "word " * 3000},)
    with pytest.raises(ContextLimitError) as info:
        run(llama, GenerationRequest(messages=long, sampling=GREEDY))
    assert info.value.context_length == 2048 and info.value.prompt_tokens > 2048


def test_llama_stop_leaves_no_process(home: Path, default_model) -> None:
    b = llama_server.LlamaServerBackend(context_length=512, threads=THREADS)
    b.load(default_model)
    pid = b.process.pid
    assert psutil.pid_exists(pid)
    b.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert pid not in [p.pid for p in our_llama_children()]


def test_llama_prompt_cache_in_ram_is_sized_to_the_memory_left(
    home: Path, default_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server keeps earlier prompts' KV in RAM (8 GiB by default) beyond the model the placement
    counted: with 400 MiB left after the model (as under a cgroup cap), it gets a quarter of that."""
    from engine import placement
    from engine.flash import memory

    size = Path(default_model.gguf_path).stat().st_size
    monkeypatch.setattr(placement, "_rss", lambda: 50 << 20)  # this process holds 50 MiB of the cap
    left = memory.AutoBudget(size + (450 << 20), "cgroup", "a test's cap")
    monkeypatch.setattr(memory, "auto_budget", lambda own_rss=None: left)
    b = llama_server.LlamaServerBackend(context_length=512, threads=THREADS)
    b.load(default_model)
    try:
        argv = psutil.Process(b.process.pid).cmdline()
        assert argv[argv.index("--cache-ram") + 1] == "100"
        assert b.client.health()
    finally:
        b.close()
    monkeypatch.setattr(memory, "auto_budget", lambda own_rss=None: memory.AutoBudget(size, "cgroup", "full"))
    assert llama_server.prompt_cache_mib(size) == 0  # nothing left: off
    monkeypatch.setattr(
        memory, "auto_budget", lambda own_rss=None: memory.AutoBudget(1 << 40, "cgroup", "big")
    )
    assert llama_server.prompt_cache_mib(size) == 8192  # llama-server's own default at most
    monkeypatch.setattr(memory, "auto_budget", lambda own_rss=None: left)
    assert llama_server.prompt_cache_mib(size, offloaded=True) == (size + (400 << 20)) // 4 >> 20  # in GPU


def test_llama_attaches_to_a_server_it_did_not_start(home: Path, default_model) -> None:
    port = llama_server.free_port()
    proc = subprocess.Popen(
        [
            str(BINARY),
            "-m",
            str(default_model.gguf_path),
            "--port",
            str(port),
            "-c",
            "512",
            "-np",
            "1",
            "-t",
            str(THREADS),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        b = llama_server.LlamaServerBackend(url=f"http://127.0.0.1:{port}", startup_timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                b.load(default_model)
                break
            except llama_server.BackendUnavailableError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert b.process is None and b.context_length == 512
        _, done = run(b, GenerationRequest(messages=CHAT, sampling=GREEDY))
        assert done.error is None and done.text
        b.close()
        assert proc.poll() is None, (
            "closing an attached backend must not stop a server flashcode did not start"
        )
    finally:
        proc.terminate()
        proc.wait(10)


def test_llama_slot_save_restart_restore_reuses_cache(llama, tmp_path: Path) -> None:
    system = {"role": "system", "content": "You are a terse assistant. " + "Keep answers short. " * 40}
    turn1 = (system, {"role": "user", "content": "What is 2+2?"})
    _, first = run(llama, GenerationRequest(messages=turn1, sampling=GREEDY))
    saved = llama.save_prompt_cache(tmp_path / "ctx.bin", {"project": "p1"})
    assert saved["n_saved"] > 150 and (tmp_path / "ctx.bin").stat().st_size > 0

    old_pid = llama.process.pid
    llama.close_process()
    llama.ensure_running()  # a fresh server: an empty slot
    assert llama.process.pid != old_pid
    restored = llama.load_prompt_cache(tmp_path / "ctx.bin")
    assert restored["n_restored"] == saved["n_saved"] and restored["metadata"]["project"] == "p1"

    turn2 = (*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3+3?"})
    _, second = run(llama, GenerationRequest(messages=turn2, sampling=GREEDY))
    assert second.error is None
    assert second.stats.cached_tokens > 150, second.stats
    assert second.stats.extra["restore_reused"] is True
    assert llama.last_restore_check["reused"]


def test_llama_restore_of_a_damaged_file_fails_cleanly(llama, tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a slot file" * 100)
    with pytest.raises(llama_server.CacheMismatchError):
        llama.load_prompt_cache(bad)
    _, done = run(
        llama, GenerationRequest(messages=CHAT, sampling=SamplingParams(temperature=0, max_tokens=4))
    )
    assert done.error is None and done.text


def test_llama_server_killed_mid_stream_reports_and_recovers(llama) -> None:
    req = GenerationRequest(
        prompt="Once upon a time", sampling=SamplingParams(temperature=0.8, max_tokens=1000)
    )
    pid = llama.process.pid
    events = llama.stream(req, threading.Event())
    got = [next(events) for _ in range(3)]
    assert all(isinstance(e, TextDelta) for e in got)
    os.kill(pid, signal.SIGKILL)
    done = [e for e in events if isinstance(e, Done)][0]
    assert done.finish_reason == "error"
    assert done.stats.completion_tokens >= 3 and done.stats.prompt_tokens > 0  # the numbers so far are kept
    assert "llama-server stopped during the reply" in done.error and "next message restarts it" in done.error
    _, after = run(llama, GenerationRequest(messages=CHAT, sampling=GREEDY))
    assert after.error is None and after.text
    assert llama.process.pid != pid


def servers_for_logs(logs: set[Path]) -> list[psutil.Process]:
    """Live llama-servers whose --port matches one of these flashcode log files (llama-server-PORT.log)."""
    ports = {f.stem.rsplit("-", 1)[-1] for f in logs}
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "llama-server" in (p.info["name"] or "") and any(
            cmd[i + 1] in ports for i, a in enumerate(cmd[:-1]) if a == "--port"
        ):
            out.append(p)
    return out


def test_llama_cli_ask_json(home: Path) -> None:
    logs_before = set((home / "logs").glob("llama-server-*.log"))
    env = {**os.environ, "FLASHCODE_HOME": str(home), "FLASHCODE_LLAMA_THREADS": str(THREADS)}
    cmd = [
        sys.executable,
        "-m",
        "webapp.cli",
        "ask",
        "--backend",
        "llama",
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--ctx-size",
        "512",
        "Say hello",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parent.parent
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["backend"] == "llama" and data["text"] and data["completion_tokens"] > 0
    assert {
        "prompt_tokens",
        "ttft_s",
        "prompt_tps",
        "decode_tps",
        "peak_rss_bytes",
        "finish_reason",
    } <= data.keys()
    new_logs = set((home / "logs").glob("llama-server-*.log")) - logs_before
    assert new_logs and not servers_for_logs(new_logs), "the CLI left its llama-server running"
