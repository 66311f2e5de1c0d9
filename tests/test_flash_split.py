"""Split layout, reader and budget: round-trip, damage detection, refusals. Fast (tiny models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.base import BudgetError
from engine.flash.budget import plan_budget
from engine.flash.reader import AlignedBuffer, UnitReader
from engine.flash.safetensors_io import read_model_tensors
from engine.flash.split import ALIGN, SplitError, load_manifest, split_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_home: Path) -> Path:
    from engine.flash.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", progress=False)


@pytest.fixture
def tiny_split(tiny: Path, tmp_path: Path) -> Path:
    return split_model(
        tiny, tmp_path / "split", progress=False, copy=True
    )  # the copied layout; in place: test_flash_import.py


def test_split_round_trips_unit_bytes(tiny: Path, tiny_split: Path) -> None:
    man = load_manifest(tiny_split)
    refs = read_model_tensors(tiny)
    assert len(man.dense_units()) == 4
    reader = UnitReader(man.units_path)
    buf = AlignedBuffer(man.max_unit_bytes)
    try:
        for u in man.units:
            assert u.offset % ALIGN == 0
            reader.read(buf, u.offset, u.length).result()
            for t in u.tensors:
                ref = refs[f"model.layers.{u.layer}.mlp.{t.name}"]
                with open(ref.path, "rb") as f:
                    f.seek(ref.offset)
                    assert bytes(buf.view[t.offset : t.offset + t.nbytes]) == f.read(ref.nbytes)
    finally:
        reader.close()
        buf.close()
    pinned = read_model_tensors(tiny_split)
    assert not any(".mlp." in n for n in pinned)
    assert set(pinned) | {
        f"model.layers.{u.layer}.mlp.{t.name}" for u in man.units for t in u.tensors
    } == set(refs)


def test_split_of_the_default_model_matches_its_tensors(default_model, tmp_path: Path) -> None:
    out = split_model(default_model.path, tmp_path / "split", progress=False)
    man = load_manifest(out)
    assert len(man.dense_units()) == 30
    assert man.pinned_bytes + man.streamed_bytes == sum(
        r.nbytes for r in read_model_tensors(default_model.path).values()
    )


def test_flash_load_detects_a_damaged_unit(tiny: Path, tiny_split: Path) -> None:
    from engine.base import ModelInfo
    from engine.flash.backend import FlashBackend

    man = load_manifest(tiny_split)
    u = man.units[2]
    with open(man.units_path, "r+b") as f:
        f.seek(u.offset + 100)
        b = f.read(1)
        f.seek(u.offset + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    backend = FlashBackend()
    with pytest.raises(SplitError, match=r"damaged: unit layers\.2\.mlp .*checksum"):
        backend.load(ModelInfo("tiny", tiny, "llama", 0, split_path=tiny_split))


def test_dense_units_stream_one_projection_at_a_time(tiny_split: Path) -> None:
    from engine.flash.dense import max_piece_bytes, unit_pieces

    man = load_manifest(tiny_split)
    for u in man.dense_units():
        pieces = unit_pieces(u)
        assert [p.projections for p in pieces] == [["gate_proj"], ["up_proj"], ["down_proj"]]
        assert pieces[0].start == 0 and pieces[-1].end == u.length  # the pieces tile the unit
        assert all(a.end == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        assert all(p.read_start % ALIGN == 0 and p.read_start + p.read_length <= u.padded for p in pieces)
    assert max_piece_bytes(man) < man.max_unit_bytes
    plan = plan_budget(man, None, 1, 8192, 128)
    assert plan.buffers == plan.in_flight == max_piece_bytes(man)


def test_a_unit_in_another_order_streams_whole(tiny_split: Path) -> None:
    from engine.flash.dense import unit_pieces
    from engine.flash.split import UnitTensor

    u = load_manifest(tiny_split).dense_units()[0]
    down_first = sorted(u.tensors, key=lambda t: (not t.name.startswith("down"), t.offset))
    pos, moved = 0, []
    for t in down_first:
        moved.append(UnitTensor(t.name, t.dtype, t.shape, pos, t.nbytes))
        pos += t.nbytes
    u.tensors = moved
    (piece,) = unit_pieces(u)
    assert piece.projections == ["gate_proj", "up_proj", "down_proj"] and piece.end == u.length


def test_streaming_detects_a_damaged_unit_on_its_first_read(tiny: Path, tiny_split: Path) -> None:
    """Past `verify_limit` units are checked as they stream: a running CRC over a unit's pieces."""
    import threading

    from engine.base import GenerationRequest, ModelInfo, SamplingParams
    from engine.flash.backend import FlashBackend
    from engine.flash.dense import unit_pieces

    man = load_manifest(tiny_split)
    u = man.dense_units()[1]
    down = unit_pieces(u)[-1]
    with open(man.units_path, "r+b") as f:  # a flipped byte in the last piece: caught only after all three
        f.seek(u.offset + down.start + 5)
        b = f.read(1)
        f.seek(u.offset + down.start + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    backend = FlashBackend(verify_limit=0)
    backend.load(ModelInfo("tiny", tiny, "llama", 0, split_path=tiny_split))
    try:
        req = GenerationRequest(prompt="hello", sampling=SamplingParams(temperature=0.0, max_tokens=2))
        with pytest.raises(SplitError, match=r"damaged: unit layers\.1\.mlp .*checksum"):
            list(backend.stream(req, threading.Event()))
    finally:
        backend.close()


def test_flash_load_detects_a_damaged_pinned_file(tiny: Path, tiny_split: Path) -> None:
    from engine.base import ModelInfo
    from engine.flash.backend import FlashBackend

    p = tiny_split / "model-pinned.safetensors"
    data = bytearray(p.read_bytes())
    data[-10] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(SplitError, match="model-pinned.safetensors fails its checksum"):
        FlashBackend().load(ModelInfo("tiny", tiny, "llama", 0, split_path=tiny_split))


def test_truncated_units_file_is_refused(tiny_split: Path) -> None:
    with open(tiny_split / "units.bin", "r+b") as f:
        f.truncate(ALIGN)
    with pytest.raises(SplitError, match="units.bin has 16384 bytes"):
        load_manifest(tiny_split)


def test_split_refuses_a_model_without_ffn_tensors(tmp_path: Path) -> None:
    from engine.flash.safetensors_io import TensorSpec, write_header

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        write_header(f, [TensorSpec("x.weight", "F32", (2,))])
        f.write(np.zeros(2, np.float32).tobytes())
    with pytest.raises(SplitError, match="no FFN or expert tensors.*'mystery'"):
        split_model(tmp_path, progress=False)


def test_budget_refuses_when_pinned_weights_do_not_fit(tiny_split: Path) -> None:
    man = load_manifest(tiny_split)
    with pytest.raises(BudgetError, match=r"pinned weights alone need .* MB over"):
        plan_budget(man, 1_000_000, 2, 8192, 128)
    plan = plan_budget(man, 200_000_000, 2, 8192, 128)
    assert plan.total <= 200_000_000 and plan.context == 8192


def test_budget_shrinks_the_context_to_fit(tiny_split: Path) -> None:
    man = load_manifest(tiny_split)
    free = plan_budget(man, None, 2, 8192, 128)
    budget = free.fixed + 1000 * free.per_token
    plan = plan_budget(man, budget, 2, 8192, 128)
    assert plan.context == 1000 and plan.total <= budget


def test_reader_falls_back_where_o_direct_is_refused(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no tmpfs at /dev/shm to try O_DIRECT on")
    f = shm / f"flash-test-{tmp_path.name}"
    f.write_bytes(bytes(range(256)) * (ALIGN // 128))
    try:
        r = UnitReader(f)
        buf = AlignedBuffer(2 * ALIGN)
        r.read(buf, ALIGN, ALIGN).result()
        assert bytes(buf.view[:4]) == bytes(range(4))
        assert r.stats.bytes == ALIGN
        r.close()
        buf.close()
    finally:
        f.unlink()


@pytest.mark.parametrize("direct", [True, False])
def test_in_place_reader_gives_the_virtual_bytes_at_any_alignment(tmp_path: Path, direct: bool) -> None:
    """Extents of every size at every shard offset, read at odd offsets into rebased and plain buffers:
    the straight-in reads (moved, or not, by the shard's offset within a page), the bounced heads and
    tails and the small ranges all land where the virtual layout puts them."""
    import random
    from types import SimpleNamespace

    from engine.flash.inplace import InPlaceReader

    rng = random.Random(7)
    data = [rng.randbytes(rng.randint(2 << 20, 3 << 20)) for _ in range(2)]
    files = []
    for k, d in enumerate(data):
        files.append(tmp_path / f"shard{k}")
        files[-1].write_bytes(d)
    extents, virtual, pos = [], bytearray(), 0
    for _ in range(12):  # units: ranges of 1 B .. 1 MB from either shard, one after another
        start = pos
        for _ in range(rng.randint(1, 4)):
            n = rng.choice([rng.randint(1, 5000), rng.randint(1, 80_000), rng.randint(1, 1 << 20)])
            fi = rng.randrange(2)
            fo = rng.choice([0, 4096, 8, rng.randrange(0, len(data[fi]) - n)])
            extents.append([pos, n, fi, fo])
            virtual += data[fi][fo : fo + n]
            pos += n
        pad = -(pos - start) % ALIGN
        virtual += bytes(pad)
        pos += pad
    reader = InPlaceReader(files, extents, threads=3, direct=direct)
    buf, plain = AlignedBuffer(pos), AlignedBuffer(pos + ALIGN)
    # as moe.py's staging slots: a view into a larger buffer, never rebased
    ns = SimpleNamespace(size=plain.size - ALIGN, view=plain.view[ALIGN:])
    try:
        for _ in range(40):
            step = rng.choice([512, ALIGN])
            offset = rng.randrange(0, pos) // step * step
            length = rng.randint(1, pos - offset)
            chunk = rng.choice([None, ALIGN, 512 << 10])
            reader.read(buf, offset, length, chunk).result()
            reader.read(ns, offset, length, chunk).result()
            for v, n, _, _ in extents:  # padding between units is not read
                lo, hi = max(v, offset), min(v + n, offset + length)
                if lo < hi:
                    assert bytes(buf.view[lo - offset : hi - offset]) == bytes(virtual[lo:hi])
                    assert bytes(ns.view[lo - offset : hi - offset]) == bytes(virtual[lo:hi])
    finally:
        ns.view.release()
        reader.close(), buf.close(), plain.close()


def test_synth_gguf_export_holds_the_same_weights(tiny: Path, tmp_path: Path) -> None:
    import mlx.core as mx

    from engine.flash.synth import _permute, export_gguf

    src = tmp_path / "m"
    shutil.copytree(tiny, src)
    export_gguf(src, src / "model.gguf", progress=False)
    g, s = mx.load(str(src / "model.gguf")), mx.load(str(src / "model.safetensors"))
    for leaf in ("weight", "scales", "biases"):
        assert np.array_equal(
            np.array(g[f"blk.1.ffn_down.{leaf}"]), np.array(s[f"model.layers.1.mlp.down_proj.{leaf}"])
        )
        assert np.array_equal(
            np.array(g[f"blk.0.attn_q.{leaf}"]),
            _permute(np.array(s[f"model.layers.0.self_attn.q_proj.{leaf}"]), 4),
        )


def test_a_damaged_safetensors_header_is_said_in_words(tiny: Path, tmp_path: Path) -> None:
    """A flipped byte in a weights file's JSON header: one sentence that names the file and the fix (it was an
    unexpected UnicodeDecodeError)."""
    from engine.base import ModelLoadError

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[40] = 0xFF  # inside the header: not UTF-8 any more
    path.write_bytes(bytes(data))
    with pytest.raises(
        ModelLoadError, match=r"model.safetensors is damaged: its safetensors header .*import the model"
    ):
        read_model_tensors(model)
    with pytest.raises(SplitError, match="not an mlx-lm model directory"):
        split_model(model, tmp_path / "split", progress=False)


def test_an_in_place_split_over_other_weights_is_refused_in_words(tiny: Path, tmp_path: Path) -> None:
    from engine.flash.split import verify_pinned

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    man = load_manifest(split_model(model, progress=False))
    man.pinned_tensors["model.layers.99.input_layernorm.weight"] = {
        "dtype": "F32",
        "shape": [4],
        "nbytes": 16,
    }
    with pytest.raises(
        SplitError, match=r"no tensor model.layers.99.input_layernorm.weight.*import the model again"
    ):
        verify_pinned(man)


def test_read_queue_runs_needed_reads_before_guesses_and_promotes_or_drops_a_guess() -> None:
    """A guess (speculative read) takes the disk only while no needed read waits; a guess the router picked
    is promoted ahead of the other guesses; one it did not pick is dropped before it is read. Before, guesses
    had threads of their own and took the disk's bandwidth from the reads the compute waited for."""
    import threading

    from engine.flash.reader import ReadQueue

    q = ReadQueue(1)
    gate, ran = threading.Event(), []
    q.submit(gate.wait)  # holds the one thread while the rest is queued
    g1 = q.submit(ran.append, "guess 1", speculative=True)
    g2 = q.submit(ran.append, "guess 2", speculative=True)
    g3 = q.submit(ran.append, "guess 3", speculative=True)
    n1 = q.submit(ran.append, "needed 1")
    q.promote([g3])
    q.drop([g2])
    gate.set()
    for f in (g1, n1, g3):
        f.result(timeout=10)
    assert g2.cancelled() and ran == ["needed 1", "guess 3", "guess 1"]
    q.close()  # what is queued runs first
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(ran.append, "late")


def test_a_dropped_guess_ends_cancelled_and_a_promoted_one_reads_its_bytes(tmp_path: Path) -> None:
    from concurrent.futures import CancelledError

    f = tmp_path / "units.bin"
    f.write_bytes(np.arange(8 * ALIGN, dtype=np.uint8).tobytes())
    r = UnitReader(f, threads=1, direct=False)
    bufs = [AlignedBuffer(2 * ALIGN) for _ in range(3)]
    try:
        import threading

        gate = threading.Event()
        r.queue.submit(gate.wait)
        kept = r.read(bufs[0], 2 * ALIGN, 2 * ALIGN, chunk=ALIGN, speculative=True)
        gone = r.read(bufs[1], 4 * ALIGN, 2 * ALIGN, chunk=ALIGN, speculative=True)
        r.promote([kept])
        r.drop([gone])
        gate.set()
        kept.result(timeout=10)
        with pytest.raises(CancelledError):
            gone.result(timeout=10)
        want = np.arange(8 * ALIGN, dtype=np.uint8).tobytes()[2 * ALIGN : 4 * ALIGN]
        assert bytes(bufs[0].view[: 2 * ALIGN]) == want
        assert r.stats.bytes == 2 * ALIGN and r.stats.reads == 1  # the dropped guess: no bytes, no read
    finally:
        r.close()
        for b in bufs:
            b.close()


def test_a_read_queue_never_closed_lets_its_threads_go() -> None:
    """A reader dropped without close() (a test's, an engine's on an error path) does not keep its threads,
    as the thread pool it replaced did not."""
    import gc
    import threading
    import time

    from engine.flash.reader import ReadQueue

    q = ReadQueue(3, name="flash-read-orphan")
    assert q.submit(sum, [1, 2]).result(timeout=10) == 3
    del q
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        t.name.startswith("flash-read-orphan") for t in threading.enumerate()
    ):
        time.sleep(0.05)
    assert not any(t.name.startswith("flash-read-orphan") for t in threading.enumerate())


def test_the_reimport_advice_names_the_models_own_gguf(tmp_path: Path) -> None:
    """Damage's advice names the GGUF the model was imported from when it is still there (it said FILE.gguf)."""
    from engine.flash.safetensors_io import reimport

    model = tmp_path / "m"
    model.mkdir()
    assert reimport(model) == "`flashcode import --force FILE.gguf`"
    gguf = tmp_path / "my model.gguf"
    (model / "flashcode.json").write_text(json.dumps({"source_gguf": str(gguf)}))
    assert reimport(model) == "`flashcode import --force FILE.gguf`"  # gone: a path that would not work
    gguf.write_bytes(b"GGUF")
    assert reimport(model) == f"`flashcode import --force '{gguf}'`"
    (model / "flashcode.json").write_text("[1]")
    assert reimport(model) == "`flashcode import --force FILE.gguf`"


def test_a_file_where_the_split_goes_is_said_in_words(tmp_path: Path, tiny: Path) -> None:
    from engine.flash.split import SplitError, split_model

    (tmp_path / "split").write_text("not a folder")
    with pytest.raises(SplitError, match="is a file where the split's folder goes: move it away"):
        split_model(tiny, tmp_path / "split", progress=False)
