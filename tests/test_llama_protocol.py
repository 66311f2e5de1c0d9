"""The llama-server backend's pure parts, no server: SSE parsing, chunk -> event mapping, flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.base import EngineError
from engine.llama_server import LlamaServerBackend, ServerError, ServerOptions, _Turn, iter_sse
from engine.stops import StopFilter


def test_llama_sse_skips_keepalives_and_ends_at_done() -> None:
    lines = [
        ": keep-alive",
        "",
        'data: {"a": 1}',
        ":",
        "event: ignored",
        'data: {"b": 2}',
        "data: [DONE]",
        'data: {"c": 3}',
    ]
    assert list(iter_sse(iter(lines))) == [{"a": 1}, {"b": 2}]


def test_llama_sse_raises_on_error_payloads() -> None:
    with pytest.raises(ServerError) as info:
        list(
            iter_sse(
                iter(['data: {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}'])
            )
        )
    assert (
        info.value.status == 400 and info.value.type == "invalid_request_error" and "bad" in str(info.value)
    )
    with pytest.raises(ServerError):
        list(iter_sse(iter(['error: {"message": "boom"}'])))


def test_llama_chat_chunks_become_text_and_reasoning_deltas() -> None:
    b, turn, stops = LlamaServerBackend(), _Turn(), StopFilter(())
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"delta": {"reasoning_content": "thinking"}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {"cache_n": 3, "predicted_n": 1}},
        {"choices": [], "usage": {"prompt_tokens": 9}},
    ]
    events = [e for c in chunks for e in b._deltas(c, turn, stops)]
    assert [(e.text, e.kind) for e in events] == [("thinking", "reasoning"), ("Hi", "text")]
    assert turn.finish == "stop" and turn.timings["cache_n"] == 3 and turn.usage["prompt_tokens"] == 9


def test_llama_completion_chunks_carry_token_ids() -> None:
    b, turn = LlamaServerBackend(), _Turn()
    events = list(b._deltas({"content": "ab", "tokens": [5, 6], "stop": False}, turn, StopFilter(())))
    events += list(
        b._deltas({"content": "", "tokens": [], "stop": True, "stop_type": "limit"}, turn, StopFilter(()))
    )
    assert [(e.text, e.token_ids) for e in events] == [("ab", (5, 6))] and turn.finish == "length"


def test_llama_options_map_to_flags() -> None:
    opts = ServerOptions(
        model_path=Path("/m.gguf"),
        ctx_size=4096,
        flash_attn="on",
        cache_type_k="q8_0",
        cache_type_v="q4_0",
        n_gpu_layers=99,
        n_cpu_moe=4,
        threads=2,
        slot_save_path=Path("/s"),
    )
    opts.validate()
    args = opts.to_args("127.0.0.1", 1234)
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["-m"] == "/m.gguf" and pairs["--port"] == "1234" and pairs["-c"] == "4096"
    assert [args[args.index(f) + 1] for f in ("-fa", "-ctk", "-ctv", "-ngl", "--n-cpu-moe", "-t", "-np")] == [
        "on",
        "q8_0",
        "q4_0",
        "99",
        "4",
        "2",
        "1",
    ]
    assert "--metrics" in args and args[args.index("--slot-save-path") + 1] == "/s"


def test_llama_threads_leave_a_core_free() -> None:
    """llama.cpp takes every physical core; one busy with anything else stalled every token (mlx.json: 2-3
    tok/s against 42-59 with one thread on this 2-core machine under load): a core fewer, at least one."""
    from engine.llama_server import default_threads

    assert default_threads(logical=2, physical=2) == 1
    assert default_threads(logical=16, physical=8) == 7  # hyperthreads do not count
    assert default_threads(logical=4, physical=8) == 3  # a cpuset of 4 cores
    assert default_threads(logical=1, physical=1) == 1
    auto = default_threads()
    assert auto is None if sys.platform == "darwin" else auto >= 1


def test_llama_options_refuse_a_quantized_v_cache_without_flash_attention() -> None:
    with pytest.raises(EngineError, match="flash attention"):
        ServerOptions(model_path=Path("/m"), cache_type_v="q4_0", flash_attn="off").validate()
    with pytest.raises(EngineError, match="KV cache type"):
        ServerOptions(model_path=Path("/m"), cache_type_k="q3").validate()


def test_llama_load_refuses_a_model_without_gguf(tmp_path: Path) -> None:
    from engine.base import ModelInfo, ModelLoadError

    with pytest.raises(ModelLoadError, match="no GGUF"):
        LlamaServerBackend().load(ModelInfo("m", tmp_path, "llama", 0, gguf_path=None))


def test_llama_logs_beyond_the_newest_twenty_go_once_a_week_old(tmp_path: Path) -> None:
    import os
    import time

    from engine.llama_server import prune_logs

    now = time.time()
    for i in range(30):
        p = tmp_path / f"llama-server-{1000 + i}.log"
        p.write_text("x")
        age = (i + 1) * 86400 if i < 25 else 3600  # 25 old ones (1..25 days), 5 recent
        os.utime(p, (now - age, now - age))
    (tmp_path / "serve.log").write_text("mine")
    assert prune_logs(tmp_path) == 10  # beyond the 20 newest: 10, all over a week old
    left = sorted(tmp_path.glob("llama-server-*.log"))
    assert len(left) == 20 and (tmp_path / "serve.log").exists()


def test_llama_completion_end_token_is_no_reply_token() -> None:
    """The native stream sends the end token as a chunk with no text before its stop chunk: its id is held, then
    dropped at a stop of type eos (as MLX leaves it out), and kept when text follows (a character's first bytes)."""
    b, turn, stops = LlamaServerBackend(), _Turn(), StopFilter(())
    chunks = [
        {"content": "Yes", "tokens": [10], "stop": False},
        {"content": "", "tokens": [11], "stop": False},  # the first bytes of a character
        {"content": "é", "tokens": [12], "stop": False},
        {"content": "", "tokens": [2], "stop": False},  # the end token
        {"content": "", "tokens": [], "stop": True, "stop_type": "eos"},
    ]
    events = [e for c in chunks for e in b._deltas(c, turn, stops)]
    assert [(e.text, e.token_ids) for e in events] == [("Yes", (10,)), ("é", (11, 12))]
    assert turn.finish == "stop" and turn.eos
