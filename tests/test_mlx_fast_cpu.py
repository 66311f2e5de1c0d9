"""engine.cpu_fast: MLX's float matmuls on OpenBLAS and the dequantize-then-matmul path for quantized
linears over many rows: the numerics of the layer swap, the BLAS routing, and the same greedy tokens
as the reference path (reference BLAS, `quantized_matmul` everywhere) with the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import cpu_fast

ROOT = Path(__file__).resolve().parent.parent


def _quantized_linear(din: int, dout: int, bits: int, group_size: int, bias: bool = True):
    import mlx.core as mx
    import mlx.nn as nn

    mx.random.seed(3)
    lin = nn.Linear(din, dout, bias=bias)
    q = nn.QuantizedLinear.from_linear(lin, group_size=group_size, bits=bits)
    q.set_dtype(mx.float32)
    return q


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 32)])
def test_layer_swap_matches_quantized_matmul(bits: int, group_size: int) -> None:
    """Many rows: within float32 summation noise of quantized_matmul, and exactly x @ dequantize(W).T;
    fewer rows than min_rows: quantized_matmul itself, bit for bit."""
    import mlx.core as mx

    layer = _quantized_linear(256, 96, bits, group_size)
    wrapper = type("M", (), {"named_modules": lambda self: [("q", layer)]})()
    assert cpu_fast.patch_model(wrapper, force=True) == 1 and type(layer).__name__ == "RowsQuantizedLinear"
    assert cpu_fast.patch_model(wrapper, force=True) == 0  # idempotent
    dense = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group_size, bits=bits)
    for shape in [(1, 1, 256), (1, 3, 256), (1, 4, 256), (2, 37, 256), (300, 256)]:
        x = mx.random.normal(shape)
        with cpu_fast.plain_path():
            plain = layer(x)
        fast = layer(x)
        rows = x.size // 256
        if rows < cpu_fast.min_rows():
            assert mx.array_equal(fast, plain), shape
        else:
            assert mx.array_equal(fast, x @ dense.T + layer.bias), shape
            scale = float(mx.abs(plain).max())
            assert float(mx.abs(fast - plain).max()) <= 1e-5 * max(scale, 1.0) * 8, shape
        assert fast.dtype == mx.float32 and fast.shape == plain.shape


def test_large_layer_few_rows_split_over_cpu_streams_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2048x1280 layer fed fewer rows than min_rows: its output features cut over the CPU streams (one
    per core), the very bits of quantized_matmul on the whole matrix."""
    import mlx.core as mx

    layer = _quantized_linear(2048, 1280, 4, 64, bias=True)
    wrapper = type("M", (), {"named_modules": lambda self: [("q", layer)]})()
    cpu_fast.patch_model(wrapper, force=True)
    assert len(cpu_fast.cpu_streams()) == min(cpu_fast.CPU_PARTS, os.cpu_count() or 1)
    calls: list[object] = []
    qmm = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(k.get("stream")) or qmm(*a, **k))
    for shape in [(1, 1, 2048), (1, 3, 2048), (2, 1, 2048)]:
        x = mx.random.normal(shape)
        with cpu_fast.plain_path():
            plain = layer(x)
        calls.clear()
        fast = layer(x)
        assert len(calls) == len(cpu_fast.cpu_streams()), shape  # one part per stream
        assert mx.array_equal(fast, plain).item(), shape
    # MLX streams belong to the thread that made them: another thread (a new engine worker) gets its own
    x, out = mx.random.normal((1, 1, 2048)), []
    mx.eval(x)
    t = threading.Thread(target=lambda: out.append(mx.array_equal(layer(x), qmm(x, layer.weight, layer.scales,
        layer.biases, transpose=True, group_size=64, bits=4) + layer.bias).item()))  # fmt: skip
    t.start()
    t.join()
    assert out == [True]


def test_many_rows_dequantize_a_block_at_a_time_with_float16_scales() -> None:
    """A head-sized weight (49152x576, 113 MB in float32) fed 128 rows: dequantized a block at a time, one block
    per stream in flight, so the transient stays far below the whole float copy (it was 284 MB over the inputs
    whole); float16 scales (the flash engine's pinned ones) give exactly the float32 ones' result, and the
    result is x @ dequantize(W).T within float32 summation noise."""
    import mlx.core as mx

    mx.random.seed(5)
    out_f, in_f = 49152, 576
    wq, s, b = mx.quantize(mx.random.normal((out_f, in_f)), group_size=32, bits=4)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    s, b = s16.astype(mx.float32), b16.astype(mx.float32)  # the same values, as float32
    x = mx.random.normal((128, in_f))
    mx.eval(wq, s, b, s16, b16, x)
    whole = out_f * in_f * 4
    assert whole > 8 * cpu_fast.DEQUANT_BLOCK_BYTES
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    y16 = cpu_fast.quantized_matmul(x, wq, s16, b16, 32, 4)
    mx.eval(y16)
    outputs = 2 * 128 * out_f * 4  # the blocks' products and their concatenation
    assert mx.get_peak_memory() - base < outputs + whole // 2, (mx.get_peak_memory() - base) / 1e6
    y32 = cpu_fast.quantized_matmul(x, wq, s, b, 32, 4)
    assert mx.array_equal(y16, y32).item()
    dense = mx.dequantize(wq, s, b, group_size=32, bits=4)
    assert float(mx.abs(y32 - x @ dense.T).max()) <= 1e-4


EXIT_MID_SPLIT = """
import engine
from engine import cpu_fast
import mlx.core as mx
mx.random.seed(0)
wq, s, b = mx.quantize(mx.random.normal((4096, 1024)), group_size=32, bits=4)
x = mx.random.normal((1, 7, 1024))
mx.eval(wq, s, b, x)
for _ in range(20):  # queued, never waited for: the process exits with work in flight on the side streams
    x = cpu_fast.quantized_matmul(x, wq, s, b, 32, 4)[..., :1024] * 0.01
    mx.async_eval(x)
print("exiting", len(cpu_fast.cpu_streams()))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="side streams need a second core")
def test_a_process_that_exits_with_split_work_in_flight_exits_cleanly() -> None:
    """mlx-lm leaves the next step in flight after the last token; an exit while a side stream still ran
    corrupted the heap ("malloc_consolidate(): unaligned fastbin chunk detected": 3 exits in 60 before
    `cpu_fast.synchronize` ran at exit). 40 exits, every one clean."""
    parts = str(min(cpu_fast.CPU_PARTS, os.cpu_count() or 1))
    for i in range(40):
        proc = subprocess.run([sys.executable, "-c", EXIT_MID_SPLIT], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.split() == ["exiting", parts], (i, proc.stderr[-600:])


def test_patch_model_leaves_other_layers_and_obeys_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.nn as nn

    q = _quantized_linear(64, 32, 4, 32, bias=False)
    lin = nn.Linear(64, 32)
    model = type("M", (), {"named_modules": lambda self: [("q", q), ("lin", lin)]})()
    monkeypatch.setenv(cpu_fast.ENV_SWITCH, "0")
    assert cpu_fast.patch_model(model, force=True) == 0 and type(q) is nn.QuantizedLinear
    monkeypatch.delenv(cpu_fast.ENV_SWITCH)
    assert cpu_fast.patch_model(model, force=True) == 1 and type(lin) is nn.Linear


def _child(code: str, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


BLAS_PROBE = """
import json, time
import engine
from engine.cpu_fast import blas_calls, blas_status
import mlx.core as mx
import numpy as np
a, b = mx.random.normal((512, 576)), mx.random.normal((576, 1536))
mx.eval(a, b)
mx.eval(a @ b)
t = time.perf_counter(); mx.eval(a @ b); ms = (time.perf_counter() - t) * 1000
ref = np.array(a).astype(np.float64) @ np.array(b).astype(np.float64)
s = blas_status()
print(json.dumps({"active": s.active, "reason": s.reason, "calls": blas_calls(), "ms": ms,
                  "err": float(np.abs(np.array(a @ b) - ref).max())}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS swap is for the Linux mlx[cpu] wheel")
def test_fast_blas_routes_mlx_matmul_and_the_switch_turns_it_off() -> None:
    fast = _child(BLAS_PROBE)
    assert fast["active"] and fast["reason"] == "active", fast
    assert fast["calls"] >= 2 and fast["err"] < 1e-2, fast  # MLX's sgemm went through the shim
    off = _child(BLAS_PROBE, FLASHCODE_CPU_FAST="0")
    assert not off["active"] and off["calls"] == -1 and off["err"] < 1e-2, off
    print(f"512x576x1536 float32 matmul: {fast['ms']:.1f} ms with OpenBLAS, {off['ms']:.1f} ms reference")


def test_fast_blas_is_refused_once_mlx_is_loaded() -> None:
    late = _child(
        "import json, mlx.core; import engine.cpu_fast as c; s = c.load_fast_blas(); "
        "print(json.dumps({'active': s.active, 'reason': s.reason}))"
    )
    assert not late["active"] and "imported before" in late["reason"]


# --------------------------------------------------------------------------- the real default model
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What does the `with` statement do in Python? Give a short example.",
    "Explain the difference between a list and a tuple, with examples of when to use each.",
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out\n\nWhat is missing in this merge function? Fix it.",
]
TOKENS = 32

GENERATE = """
import json, sys, threading
from engine.base import GenerationRequest, SamplingParams, TextDelta
from engine.cpu_fast import blas_status
from engine.mlx_backend import MLXBackend
from engine.models import find_model
b = MLXBackend()
b.load(find_model(None))
out = []
for p in json.loads(sys.argv[1]):
    req = GenerationRequest(messages=({"role": "user", "content": p},),
                            sampling=SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2])))
    out.append([i for ev in b.stream(req, threading.Event()) if isinstance(ev, TextDelta) for i in ev.token_ids])
print(json.dumps({"tokens": out, "blas": blas_status().reason}))
"""


def greedy(backend, prompt: str, tokens: int = TOKENS) -> list[int]:
    from engine.base import GenerationRequest, SamplingParams, TextDelta

    backend.prompt_cache.reset()
    req = GenerationRequest(
        messages=({"role": "user", "content": prompt},),
        sampling=SamplingParams(temperature=0.0, max_tokens=tokens),
    )
    return [
        i for ev in backend.stream(req, threading.Event()) if isinstance(ev, TextDelta) for i in ev.token_ids
    ]


@pytest.mark.slow
def test_fast_path_gives_the_reference_greedy_tokens(mlx_backend) -> None:
    """4 prompts x 32 greedy tokens: the fast path (OpenBLAS + dequantize-then-matmul) against a process on the
    reference path (FLASHCODE_CPU_FAST=0: neither); one whole-prompt forward's logits against the same backend
    with the layer swap off. (Greedy runs with only the swap off are not repeated here: the fast path giving the
    reference process's tokens covers both of its changes at once.)"""
    import mlx.core as mx

    n_patched = sum(
        type(m).__name__ == "RowsQuantizedLinear" for _, m in mlx_backend.model_obj.named_modules()
    )
    if cpu_fast.blas_status().active:
        assert n_patched > 0
    fast = [greedy(mlx_backend, p) for p in PROMPTS]
    assert all(len(t) == TOKENS for t in fast)
    # logits of one whole-prompt forward: within float32 summation noise
    ids = mx.array(mlx_backend.apply_chat_template(({"role": "user", "content": PROMPTS[3]},)))[None]
    a = mlx_backend.model_obj(ids)[0]
    with cpu_fast.plain_path():
        b = mlx_backend.model_obj(ids)[0]
    assert float(mx.abs(a - b).max()) < 1e-2 and mx.array_equal(a.argmax(-1), b.argmax(-1))
    ref = _child_run(PROMPTS, FLASHCODE_CPU_FAST="0")
    assert ref["blas"].startswith("FLASHCODE_CPU_FAST=0")
    assert ref["tokens"] == fast


def _child_run(prompts: list[str], **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE, json.dumps(prompts), str(TOKENS)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_results_carry_provenance_and_recompute_from_raw_runs() -> None:
    """bench/results/mlx.json is written by engine/bench_mlx.py: its summary keys come from its runs."""
    from engine.bench_mlx import summarize

    result = json.loads((ROOT / "bench" / "results" / "mlx.json").read_text())
    assert result["command"] and result["git_commit"] and result["machine"]
    sides = [result["mlx_lm"], result["backend"], result["reference"], *result["llama"].values()]
    assert all(r["token_ids"] and r["load1"] is not None for side in sides for r in side["runs"])
    assert len(result["backend"]["runs"]) == result["repeats"]
    for key, value in summarize(result).items():
        assert result[key] == pytest.approx(value), key
    assert {"prefill_ratio_vs_llama", "decode_ratio"} <= result.keys()
