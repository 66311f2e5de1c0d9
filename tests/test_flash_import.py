"""Models bigger than memory, end to end (issue 17): GGUF import in bounded memory.

Fast: a synthetic GGUF (the `tiny` preset, the same values as its safetensors twin) imports into
sharded safetensors with an index, tensor for tensor equal to the twin; an interrupted import leaves
nothing; a killed import's temporary directory is swept by the next one.
Slow, root (a memory cgroup, page cache included; see engine/flash/bench.py): a dense and a MoE
synthetic GGUF import under a cap 2.5x smaller than the file, then answer with flash under the same cap
with the tokens the model gives in RAM uncapped.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.base import Done, GenerationRequest, ModelInfo, SamplingParams, TextDelta
from engine.flash.split import ALIGN
from engine.gguf import import_gguf
from engine.shards import INDEX_NAME


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Path:
    from engine.flash.synth import export_gguf, synth_model

    model = synth_model("tiny", tmp_path_factory.mktemp("imp") / "tiny", progress=False)
    export_gguf(model, model / "model.gguf", progress=False)
    return model


def _all_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    out = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        for k, v in mx.load(str(f)).items():
            out[k] = np.array(v.astype(mx.float32)) if v.dtype != mx.uint32 else np.array(v)
    return out


def test_import_writes_shards_with_an_index_equal_to_the_source(tiny_gguf: Path, tmp_path: Path) -> None:
    out = import_gguf(tiny_gguf / "model.gguf", tmp_path / "models", name="t", show_progress=False,
                      shard_bytes=2 << 20)  # fmt: skip
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(s.stat().st_size for s in shards) - sum(
        8 + int.from_bytes(s.open("rb").read(8), "little") for s in shards
    )
    got, want = _all_tensors(out), _all_tensors(tiny_gguf)
    assert set(got) == set(want)
    for name, arr in want.items():
        assert np.array_equal(got[name], arr), name
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]


def test_import_keeps_each_ffn_contiguous_gate_up_down_as_a_split_unit(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    from engine.flash.safetensors_io import read_model_tensors

    out = import_gguf(tiny_gguf / "model.gguf", tmp_path / "models", name="t", show_progress=False)
    refs = read_model_tensors(out)
    for layer in range(4):
        parts = [refs[f"model.layers.{layer}.mlp.{p}_proj.{s}"] for p in ("gate", "up", "down")
                 for s in ("biases", "scales", "weight")]  # fmt: skip
        for a, b in zip(parts, parts[1:], strict=False):
            assert a.offset + a.nbytes == b.offset, (a.name, b.name)


def test_interrupted_import_leaves_nothing(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    import engine.gguf as g

    real = g.SourceTensor.convert
    calls = [0]

    def interrupted(self, raw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > 20:
            raise KeyboardInterrupt
        return real(self, raw)

    monkeypatch.setattr(g.SourceTensor, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(tiny_gguf / "model.gguf", tmp_path / "models", name="t", show_progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_killed_import_is_swept_by_the_next(tiny_gguf: Path, tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / ".t.importing-4194303-x").mkdir(parents=True)  # a pid that cannot be alive (above pid_max)
    (root / ".t.importing-4194303-x" / "model.safetensors").write_bytes(b"half")
    mine = root / f".u.importing-{os.getpid()}-y"  # a running import's directory is left alone
    mine.mkdir()
    import_gguf(tiny_gguf / "model.gguf", root, name="t", show_progress=False)
    assert sorted(p.name for p in root.iterdir()) == sorted([mine.name, "t"])


# --------------------------------------------------------------------------- one copy on disk
def greedy_tokens(
    backend: Any, model: ModelInfo, n: int = 12, prompt: str = "def fibonacci(n):"
) -> list[int]:
    backend.load(model)
    try:
        req = GenerationRequest(prompt=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=n))
        out: list[int] = []
        for ev in backend.stream(req, threading.Event()):
            if isinstance(ev, TextDelta):
                out.extend(ev.token_ids)
            elif isinstance(ev, Done):
                assert ev.error is None, ev.error
                stats = ev.stats
        backend.last_extra = stats.extra
        return out
    finally:
        backend.close()


@pytest.fixture(scope="module")
def imported(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(tiny_gguf / "model.gguf", tmp_path_factory.mktemp("models"), name="t", show_progress=False,
                       shard_bytes=3 << 20)  # fmt: skip


def test_in_place_split_copies_no_weights_and_reads_what_a_copy_holds(imported: Path, tmp_path: Path) -> None:
    from engine.flash.inplace import InPlaceReader, open_reader
    from engine.flash.reader import AlignedBuffer
    from engine.flash.split import load_manifest, split_model

    inplace = load_manifest(split_model(imported, tmp_path / "inplace", progress=False))
    copied = load_manifest(split_model(imported, tmp_path / "copy", progress=False, copy=True))
    weights = sum(f.stat().st_size for f in imported.glob("*.safetensors"))
    assert inplace.in_place and not (tmp_path / "inplace" / "units.bin").exists()
    names = {f.name for f in (tmp_path / "inplace").iterdir()}
    assert not {n for n in names if n.endswith((".safetensors", ".bin"))}, (
        names
    )  # manifest, config, tokenizer
    assert (tmp_path / "inplace" / "manifest.json").stat().st_size < weights / 20
    assert len(inplace.files) > 1  # the units span several shards
    dense_extents = [e for e in inplace.extents if e[0] < inplace.dense_units()[-1].offset + ALIGN]
    assert len(dense_extents) == len(inplace.dense_units())  # each FFN: one contiguous range of a shard
    a, b = open_reader(inplace, threads=3), open_reader(copied)
    assert isinstance(a, InPlaceReader)
    buf_a, buf_b = AlignedBuffer(copied.max_unit_bytes), AlignedBuffer(copied.max_unit_bytes)
    try:
        for ua, ub in zip(inplace.units, copied.units, strict=True):
            assert (ua.key, ua.offset, ua.length, ua.crc32) == (ub.key, ub.offset, ub.length, ub.crc32)
            a.read(buf_a, ua.offset + 4096, ua.length - 4096, chunk=ALIGN).result()  # unaligned, many pieces
            b.read(buf_b, ub.offset, ub.length).result()
            assert bytes(buf_a.view[: ua.length - 4096]) == bytes(buf_b.view[4096 : ub.length])
    finally:
        a.close(), b.close(), buf_a.close(), buf_b.close()


def test_in_place_flash_gives_the_in_ram_tokens(imported: Path) -> None:
    from engine.flash.backend import FlashBackend
    from engine.mlx_backend import MLXBackend
    from engine.models import model_info

    info = model_info(imported)
    ram = greedy_tokens(MLXBackend(), info)
    flash = FlashBackend(runtime_bytes=0)
    streamed = greedy_tokens(flash, model_info(imported))  # splits in place on first use
    assert streamed == ram and len(ram) == 12
    assert (imported / "split" / "manifest.json").exists() and not (imported / "split" / "units.bin").exists()
    assert flash.last_extra["bytes_per_token"] > 0


def test_in_place_split_detects_changed_weights(imported: Path, tmp_path: Path) -> None:
    import shutil

    from engine.flash.backend import FlashBackend
    from engine.flash.safetensors_io import read_model_tensors
    from engine.flash.split import SplitError, split_model

    model = tmp_path / "m"
    shutil.copytree(imported, model, ignore=shutil.ignore_patterns("split"))
    split_model(model, progress=False)
    ref = read_model_tensors(model)["model.layers.2.mlp.up_proj.weight"]
    with open(ref.path, "r+b") as f:
        f.seek(ref.offset + 100)
        byte = f.read(1)
        f.seek(ref.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    info = ModelInfo("m", model, "llama", 0, split_path=model / "split")
    with pytest.raises(SplitError, match=r"unit layers.2.mlp .*import the model again"):
        FlashBackend(runtime_bytes=0).load(info)
    # splitting again would take the damage's checksums: refused, and the last split still refuses to load
    with pytest.raises(SplitError, match=r"no longer match .*layers.2.mlp.*Import the model again.*--force"):
        split_model(model, progress=False)
    with pytest.raises(SplitError, match="unit layers.2.mlp"):
        FlashBackend(runtime_bytes=0).load(info)
    split_model(model, progress=False, force=True)  # changed on purpose: the user says so
    FlashBackend(runtime_bytes=0).load(info)


def test_a_failed_re_split_keeps_the_last_split_and_its_checksums(imported: Path, tmp_path: Path) -> None:
    """A re-split that fails (weights cut short) leaves the last split's manifest as it was: it used to be
    deleted first, so the next flash load split again silently and took a damaged file's checksums."""
    import shutil

    from engine.flash.split import SplitError, split_model

    model = tmp_path / "m"
    shutil.copytree(imported, model, ignore=shutil.ignore_patterns("split"))
    split_model(model, progress=False)
    manifest = (model / "split" / "manifest.json").read_text()
    weights = max(model.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) - 4096])
    with pytest.raises(SplitError):
        split_model(model, progress=False)
    assert (model / "split" / "manifest.json").read_text() == manifest


# --------------------------------------------------------------------------- under a cgroup 2.5x smaller than the GGUF
NO_CGROUP = None
try:
    from engine.flash.bench import cgroup_unavailable

    NO_CGROUP = cgroup_unavailable()
except ImportError as exc:  # pragma: no cover
    NO_CGROUP = str(exc)

_IMPORT = (
    "import sys; from pathlib import Path; from engine.gguf import import_gguf; "
    "from engine.mlx_backend import peak_rss_bytes; "
    "import_gguf(sys.argv[1], Path(sys.argv[2]), name='m', show_progress=False); print(peak_rss_bytes())"
)


def import_capped(gguf: Path, models: Path, cap: int) -> tuple[int, int]:
    """(process peak RSS, cgroup peak) of `import_gguf` run in a child under a memory cgroup of `cap` bytes."""
    import subprocess
    import sys

    from engine.flash.bench import MemoryCgroup

    cg = MemoryCgroup("flashcode-import", cap)
    try:
        p = subprocess.run([sys.executable, "-c", _IMPORT, str(gguf), str(models)], capture_output=True, text=True,
                           timeout=1800, preexec_fn=cg.enter)  # fmt: skip
        assert p.returncode == 0 and cg.oom_kills() == 0, (p.returncode, p.stderr[-2000:])
        return int(p.stdout.split()[-1]), cg.peak()
    finally:
        cg.remove()


def import_then_flash_under_a_cap(preset: list[str], tmp_path: Path, cap: int) -> dict[str, Any]:
    import shutil
    import subprocess
    import sys

    from engine.flash.bench import run_child

    src = tmp_path / "synth"
    made = subprocess.run([sys.executable, "-m", "webapp.cli", "synth", *preset, "--gguf", "--out", str(src)],
                          capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    gguf = src / "model.gguf"
    for f in src.glob("*.safetensors"):  # only the GGUF is needed from here on
        f.unlink()
    assert gguf.stat().st_size >= 2.5 * cap, (gguf.stat().st_size, cap)
    try:
        rss, peak = import_capped(gguf, tmp_path / "models", cap)
        model = tmp_path / "models" / "m"
        flash = run_child("flash", model, 8, cap, timeout=1200)  # splits in place under the cap, then answers
        assert flash["status"] == "ok", flash
        assert (model / "split" / "manifest.json").exists() and not (model / "split" / "units.bin").exists()
        ram = run_child("ram", model, 8, None, timeout=1200)
        assert ram["status"] == "ok", ram
        assert flash["tokens"] == ram["tokens"] and len(ram["tokens"]) == 8
        assert flash["cgroup_oom_kills"] == 0 and flash["cgroup_peak_bytes"] <= cap
        return {"gguf_bytes": gguf.stat().st_size, "import_peak_rss": rss, "import_cgroup_peak": peak}
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(NO_CGROUP is not None, reason=f"{NO_CGROUP}")
def test_dense_gguf_imports_and_answers_under_a_cap_smaller_than_the_file(tmp_path: Path) -> None:
    cap = 400_000_000
    got = import_then_flash_under_a_cap(["ffn-heavy", "--layers", "130"], tmp_path, cap)
    assert got["import_peak_rss"] < cap and got["import_cgroup_peak"] <= cap, got


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(NO_CGROUP is not None, reason=f"{NO_CGROUP}")
def test_moe_gguf_imports_and_answers_under_a_cap_smaller_than_the_file(tmp_path: Path) -> None:
    cap = 400_000_000
    got = import_then_flash_under_a_cap(["moe-heavy"], tmp_path, cap)
    assert got["import_peak_rss"] < cap and got["import_cgroup_peak"] <= cap, got


# --------------------------------------------------------------------------- --memory-budget auto
def test_cgroup_limit_reads_v2_and_v1_and_takes_the_tightest(tmp_path: Path) -> None:
    from engine.flash.memory import cgroup_limit

    proc = tmp_path / "cgroup"
    (tmp_path / "fs" / "a" / "b").mkdir(parents=True)
    (tmp_path / "fs" / "a" / "memory.max").write_text("3000000000\n")
    (tmp_path / "fs" / "a" / "b" / "memory.max").write_text("max\n")
    proc.write_text("0::/a/b\n")
    assert cgroup_limit(proc, tmp_path / "fs") == 3_000_000_000
    (tmp_path / "fs" / "memory" / "x").mkdir(parents=True)
    (tmp_path / "fs" / "memory" / "x" / "memory.limit_in_bytes").write_text("500000000\n")
    (tmp_path / "fs" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc.write_text("7:cpu,cpuacct:/x\n5:memory:/x\n")
    assert cgroup_limit(proc, tmp_path / "fs") == 500_000_000
    proc.write_text("5:memory:/\n")
    assert cgroup_limit(proc, tmp_path / "fs") is None


def test_auto_budget_is_available_memory_minus_the_margin() -> None:
    from engine.flash.memory import _meminfo, auto_budget, auto_margin, cgroup_limit

    info = _meminfo()
    got = auto_budget(own_rss=100_000_000)
    if cgroup_limit() is not None and cgroup_limit() < info["MemTotal"]:  # type: ignore[operator]
        pytest.skip("this test process runs inside a memory cgroup")
    assert got.source == "available" and "margin" in got.detail
    want = 100_000_000 + info["MemAvailable"] - auto_margin(info["MemTotal"])
    assert abs(got.budget - want) < 200_000_000  # MemAvailable moves between the two reads


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(NO_CGROUP is not None, reason=f"{NO_CGROUP}")
def test_auto_budget_inside_a_cgroup_is_its_limit(imported: Path) -> None:
    import subprocess
    import sys

    from engine.flash.bench import MemoryCgroup

    code = (
        "import json, sys; from engine.models import model_info; from engine.flash.backend import FlashBackend; "
        "b = FlashBackend(memory_budget='auto'); b.load(model_info(__import__('pathlib').Path(sys.argv[1]))); "
        "print(json.dumps(b.memory_report()))"
    )
    cg = MemoryCgroup("flashcode-auto", 700_000_000)
    try:
        p = subprocess.run([sys.executable, "-c", code, str(imported)], capture_output=True, text=True, timeout=600,
                           preexec_fn=cg.enter)  # fmt: skip
    finally:
        cg.remove()
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout.splitlines()[-1])
    assert 700_000_000 - 4096 < report["memory_budget"] <= 700_000_000  # the kernel keeps whole pages
    assert "cgroup" in report["memory_budget_auto"]


# --------------------------------------------------------------------------- partial residency
def test_partial_residency_reads_less_as_the_budget_grows_and_nothing_when_all_fits(imported: Path) -> None:
    from engine.flash.backend import FlashBackend
    from engine.flash.budget import RESIDENT_CONTEXT, plan_budget, resident_unit_bytes
    from engine.flash.inplace import scratch_bytes
    from engine.flash.split import load_manifest, split_model
    from engine.mlx_backend import MLXBackend
    from engine.models import model_info

    info = model_info(imported)
    man = load_manifest(info.split_path or split_model(imported, progress=False))
    ctx = int(man.config.get("max_position_embeddings", 4096))
    base = plan_budget(man, None, 2, ctx, 128, 4, scratch=scratch_bytes(4))  # as FlashBackend plans it
    stream_only = base.fixed + min(ctx, RESIDENT_CONTEXT) * base.per_token + 1000
    units = man.dense_units()
    held = [resident_unit_bytes(u, 4) for u in units]  # float32 scales and biases on the CPU
    assert all(h > u.length for h, u in zip(held, units, strict=True))
    budgets = [stream_only, stream_only + sum(held[:2]), stream_only + sum(held)]
    want = greedy_tokens(MLXBackend(), info)
    per_token, resident = [], []
    for b in budgets:
        flash = FlashBackend(memory_budget=b, runtime_bytes=0)
        assert greedy_tokens(flash, model_info(imported)) == want
        per_token.append(flash.last_extra["bytes_per_token"])
        resident.append(flash.last_extra["budget"]["resident_layers"])
    assert resident == [[], [0, 1], [0, 1, 2, 3]]
    assert per_token[0] > per_token[1] > per_token[2] == 0, per_token
    assert (
        abs(per_token[1] - per_token[0] / 2) < per_token[0] * 0.05
    )  # half the FFNs streamed: half the bytes
