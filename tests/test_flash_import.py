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
from pathlib import Path

import numpy as np
import pytest

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


def test_import_keeps_each_ffn_contiguous_gate_up_down(tiny_gguf: Path, tmp_path: Path) -> None:
    from engine.flash.safetensors_io import read_model_tensors

    out = import_gguf(tiny_gguf / "model.gguf", tmp_path / "models", name="t", show_progress=False)
    refs = read_model_tensors(out)
    for layer in range(4):
        parts = [refs[f"model.layers.{layer}.mlp.{p}_proj.{s}"] for p in ("gate", "up", "down")
                 for s in ("weight", "scales", "biases")]  # fmt: skip
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
