"""`flashcode split`: an MLX model directory -> a streamable layout, and that layout read back.

What it knows: which tensors are streamed units (a dense layer's FFN: `model.layers.N.mlp.*`; one
expert of a MoE layer: `model.layers.N.{mlp,block_sparse_moe}.switch_mlp.*[e]`, mlx-lm's SwitchGLU
in qwen3_moe / qwen3_next / olmoe and mixtral) and which are pinned (everything
else); the on-disk layout:

    split/manifest.json            units, their offsets, tensor layout, quantization, checksums
    split/model-pinned.safetensors the pinned tensors (an mlx-lm model dir minus the streamed ones)
    split/units.bin                every unit as one contiguous block, each aligned to 16 KiB; a
                                   dense unit holds gate, up, down in that order (streamed in turn)
    split/config.json, tokenizer*  copied, so the split directory is self-describing

That is the copied layout (`flashcode split --copy`, manifest version 1). The default, in place
(version 2), writes no weights at all: the units are laid out in a *virtual* units.bin (the same
offsets, tensor positions and checksums) whose byte ranges map to where the model's own safetensors
shards hold them (`extents`), read by inplace.py; the pinned tensors are loaded from the shards too.

What it does not know: how units are read (reader.py) or computed (dense.py).
Checksums are CRC-32 per unit and of the pinned file; the manifest is written last, so a split
without a manifest is an unfinished one.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..base import ModelLoadError
from .safetensors_io import (
    DTYPE_SIZES,
    TensorRef,
    TensorSpec,
    iter_chunks,
    read_model_tensors,
    reimport,
    write_header,
)

log = logging.getLogger(__name__)

ALIGN = 16 << 10  # one unit = one aligned read; 16 KiB covers 4K-sector O_DIRECT and Apple SSD pages
MANIFEST_VERSION = (
    1  # the copied layout; IN_PLACE_VERSION: units and pinned tensors read from the model's shards
)
IN_PLACE_VERSION = 2
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_DENSE = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases|bias)$"
)
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)


class SplitError(ModelLoadError):
    """A model cannot be split, or a split is missing, stale or damaged."""


@dataclass
class UnitTensor:
    name: str  # inside the unit, e.g. "gate_proj.weight"
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the unit's start
    nbytes: int


@dataclass
class Unit:
    key: str  # "layers.3.mlp" or "layers.3.expert.17"
    kind: str  # "dense_ffn" | "expert"
    layer: int
    expert: int | None
    offset: int  # in units.bin, multiple of ALIGN
    length: int  # bytes of data
    crc32: int
    tensors: list[UnitTensor] = field(default_factory=list)

    @property
    def padded(self) -> int:
        return -(-self.length // ALIGN) * ALIGN


@dataclass
class Manifest:
    root: Path
    config: dict[str, Any]
    units: list[Unit]
    quant: dict[str, dict[str, Any]]  # projection name -> {group_size, bits, mode}, per layer key
    pinned_file: str
    pinned_crc32: int
    pinned_bytes: int
    pinned_tensors: dict[str, dict[str, Any]]  # name -> {dtype, shape, nbytes}
    source: dict[str, Any]
    layout: str = "copy"  # or "in_place": no units.bin / pinned file, `extents` into `files`
    files: list[Path] = field(default_factory=list)
    extents: list[list[int]] = field(default_factory=list)  # [virtual start, length, file index, file offset]
    weights_dir: Path | None = None  # in place: the model directory whose shards hold the weights

    @property
    def in_place(self) -> bool:
        return self.layout == "in_place"

    @property
    def units_path(self) -> Path:
        if self.in_place:  # no units.bin: the largest shard stands for it (bandwidth measurements)
            return max(self.files, key=lambda f: f.stat().st_size)
        return self.root / "units.bin"

    @property
    def weights_root(self) -> Path:
        """The directory mlx-lm loads the pinned tensors from (strict=False: streamed ones are dropped)."""
        return self.weights_dir if self.in_place and self.weights_dir else self.root

    @property
    def max_unit_bytes(self) -> int:
        return max((u.padded for u in self.units), default=0)

    @property
    def streamed_bytes(self) -> int:
        return sum(u.length for u in self.units)

    def dense_units(self) -> list[Unit]:
        return sorted((u for u in self.units if u.kind == "dense_ffn"), key=lambda u: u.layer)

    def quant_for(self, layer: int, proj: str) -> dict[str, Any]:
        return self.quant.get(f"model.layers.{layer}.mlp.{proj}") or self.quant["default"]

    def shard(self, start: int, end: int) -> Manifest:
        """The manifest of a pipeline rank that holds layers [start, end) (engine/pipeline.py): only their
        units stream, and only their pinned tensors and the shared ones (embedding, final norm, head) count
        in its budget. The pinned checksum stays the whole model's: verify with the full manifest."""

        def mine(name: str) -> bool:
            m = _LAYER.match(name)
            return m is None or start <= int(m[1]) < end

        return replace(
            self,
            config={**self.config, "num_hidden_layers": end - start},
            units=[u for u in self.units if start <= u.layer < end],
            pinned_tensors={n: t for n, t in self.pinned_tensors.items() if mine(n)},
        )


def first_layer(model: Any) -> int:
    """The number of `model.layers[0]`: 0, or a pipeline rank's first layer (mlx-lm's `start_idx`)."""
    return int(getattr(getattr(model, "model", None), "start_idx", 0) or 0)


# --------------------------------------------------------------------------- writing
def _quant_table(
    config: dict[str, Any], units: list[tuple[str, list[TensorRef]]]
) -> dict[str, dict[str, Any]]:
    q = config.get("quantization") or {}
    default = {
        "group_size": q.get("group_size", 64),
        "bits": q.get("bits", 4),
        "mode": q.get("mode", "affine"),
    }
    table: dict[str, dict[str, Any]] = {"default": default}
    for key, entry in q.items():
        if isinstance(entry, dict):
            table[key] = {**default, **entry}
    return table


def plan_units(
    refs: dict[str, TensorRef],
) -> tuple[list[tuple[str, str, int, int | None, list[tuple[str, TensorRef, int, int]]]], set[str]]:
    """[(key, kind, layer, expert, [(name in unit, source ref, byte start, nbytes)])], streamed names."""
    dense: dict[int, list[tuple[str, TensorRef, int, int]]] = {}
    experts: dict[tuple[int, int], list[tuple[str, TensorRef, int, int]]] = {}
    streamed: set[str] = set()
    for name, ref in sorted(refs.items()):
        if m := _DENSE.match(name):
            dense.setdefault(int(m[1]), []).append((f"{m[2]}.{m[3]}", ref, 0, ref.nbytes))
            streamed.add(name)
        elif m := _EXPERT.match(name):
            n_exp = ref.shape[0]
            per = ref.nbytes // n_exp  # contiguous rows: expert e is one byte range
            for e in range(n_exp):
                experts.setdefault((int(m[1]), e), []).append((f"{m[2]}.{m[3]}", ref, e * per, per))
            streamed.add(name)
    order = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}  # the order the FFN needs them: read one at a time
    plan = [(f"layers.{i}.mlp", "dense_ffn", i, None, sorted(dense[i], key=lambda p: (order[p[0].split(".")[0]], p[0])))
            for i in sorted(dense)]  # fmt: skip
    plan += [(f"layers.{i}.expert.{e}", "expert", i, e, experts[(i, e)]) for (i, e) in sorted(experts)]
    return plan, streamed


def _copy_range(ref: TensorRef, start: int, nbytes: int, out: Any, crc: int) -> int:
    with open(ref.path, "rb") as f:
        f.seek(ref.offset + start)
        left = nbytes
        while left:
            data = f.read(min(16 << 20, left))
            out.write(data)
            crc = zlib.crc32(data, crc)
            left -= len(data)
    return crc


def split_model(
    model_dir: Path, out: Path | None = None, progress: bool = True, copy: bool = False, force: bool = False
) -> Path:
    """Write the split layout for `model_dir` into `out` (default model_dir/split); returns `out`.
    In place (the default) it writes only the manifest and small files; `copy` writes units.bin and the
    pinned file (weights twice on disk: for a split on another disk than the model). An in-place split
    made again over weights whose bytes no longer match the last one's checksums is refused unless
    `force`: taking the new checksums would make damaged weights pass (an import replaces the folder,
    split included, so unchanged weights are the only case here)."""
    from tqdm import tqdm

    model_dir = Path(model_dir)
    out = Path(out) if out else model_dir / "split"
    try:
        config = json.loads((model_dir / "config.json").read_text())
        refs = read_model_tensors(model_dir)
    except (OSError, ValueError) as exc:
        raise SplitError(f"cannot split {model_dir}: not an mlx-lm model directory ({exc})") from exc
    plan, streamed = plan_units(refs)
    if not plan:
        raise SplitError(
            f"cannot split {model_dir}: no FFN or expert tensors named model.layers.N.mlp.* "
            f"(model_type {config.get('model_type')!r} is not a supported dense or MoE layout)"
        )
    if any(not refs[n].dtype == "U32" for n in streamed if n.endswith(".weight")):
        raise SplitError(
            f"cannot split {model_dir}: streamed FFN weights must be MLX-quantized (uint32 packed)"
        )
    if out.exists() and not out.is_dir():
        raise SplitError(f"{out} is a file where the split's folder goes: move it away, then split again")
    out.mkdir(parents=True, exist_ok=True)
    before = _previous_in_place(out) if not copy and not force else None
    if copy:  # units.bin is written again: an interrupted re-split must not look complete
        (out / "manifest.json").unlink(missing_ok=True)
    # (in place, the last split's manifest stays until the new one is whole: a failed re-split keeps its checksums)
    total = sum(r.nbytes for r in refs.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"split {model_dir.name}", disable=not progress)
    if not copy:
        try:
            manifest = _split_in_place(model_dir, out, config, refs, plan, streamed, bar)
        finally:
            bar.close()  # its line ends before an error is printed
        if before is not None and (changed := _changed_units(before, manifest)):
            (out / "manifest.json").write_text(
                json.dumps(before, indent=1)
            )  # the last split stays, and refuses
            raise SplitError(
                f"the weights in {model_dir} no longer match the checksums of their last split ({changed}): "
                f"they are damaged or were changed. Import the model again ({reimport(model_dir)}); "
                "weights you changed on purpose: `flashcode split MODEL --force`"
            )
        _copy_small_files(model_dir, out)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for old in ("units.bin", "model-pinned.safetensors"):  # a copied split made before: its space back
            (out / old).unlink(missing_ok=True)
        log.info("split %s in place: %d units, %.1f MB streamed, %.1f MB pinned", model_dir.name,
                 len(manifest["units"]), sum(u["length"] for u in manifest["units"]) / 1e6,
                 manifest["pinned"]["bytes"] / 1e6)  # fmt: skip
        return out

    units: list[dict[str, Any]] = []
    with open(out / "units.bin", "wb") as f:
        for key, kind, layer, expert, parts in plan:
            start = f.tell()
            crc, tensors, pos = 0, [], 0
            for name, ref, s, n in parts:
                shape = ref.shape[1:] if kind == "expert" else ref.shape
                tensors.append(
                    {"name": name, "dtype": ref.dtype, "shape": list(shape), "offset": pos, "nbytes": n}
                )
                crc = _copy_range(ref, s, n, f, crc)
                pos += n
                bar.update(n)
            f.write(b"\0" * (-pos % ALIGN))
            units.append({"key": key, "kind": kind, "layer": layer, "expert": expert, "offset": start,
                          "length": pos, "crc32": crc, "tensors": tensors})  # fmt: skip

    pinned = [refs[n] for n in sorted(refs) if n not in streamed]
    specs = [TensorSpec(r.name, r.dtype, r.shape) for r in pinned]
    head = io.BytesIO()
    write_header(head, specs)
    crc = zlib.crc32(head.getvalue())
    with open(out / "model-pinned.safetensors", "wb") as f:
        f.write(head.getvalue())
        for r in pinned:
            for data in iter_chunks(r):
                f.write(data)
                crc = zlib.crc32(data, crc)
                bar.update(len(data))
    bar.close()

    _copy_small_files(model_dir, out)
    manifest = {
        "version": MANIFEST_VERSION,
        "align": ALIGN,
        "source": {"dir": str(model_dir), "bytes": total, "tensors": len(refs)},
        "quant": _quant_table(config, []),
        "pinned": {"file": "model-pinned.safetensors", "crc32": crc, "bytes": sum(r.nbytes for r in pinned),
                   "tensors": {r.name: {"dtype": r.dtype, "shape": list(r.shape), "nbytes": r.nbytes} for r in pinned}},
        "units": units,
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log.info("split %s: %d units, %.1f MB streamed, %.1f MB pinned", model_dir.name, len(units),
             sum(u["length"] for u in units) / 1e6, manifest["pinned"]["bytes"] / 1e6)  # fmt: skip
    return out


def _previous_in_place(out: Path) -> dict[str, Any] | None:
    try:
        m = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("layout") == "in_place" else None


def _changed_units(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What of the same bytes (unit key and length, or the pinned tensors) has another checksum now."""
    old = {(u["key"], u["length"]): u["crc32"] for u in before.get("units", ())}
    changed = [u["key"] for u in after["units"] if old.get((u["key"], u["length"]), u["crc32"]) != u["crc32"]]
    b, a = before.get("pinned", {}), after["pinned"]
    if b.get("tensors") == a["tensors"] and b.get("crc32") != a["crc32"]:
        changed.append("the pinned weights")
    if not changed:
        return ""
    return ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def _copy_small_files(model_dir: Path, out: Path) -> None:
    for p in model_dir.iterdir():  # config, tokenizer, chat template: everything but weights
        if (p.is_file() and p.suffix in (".json", ".jinja", ".txt", ".model") and p.name != "flashcode.json"
                and not p.name.endswith(".index.json")):  # fmt: skip
            shutil.copy2(p, out / p.name)


def _crc_range(path: Path, start: int, nbytes: int, crc: int) -> int:
    with open(path, "rb") as f:
        f.seek(start)
        left = nbytes
        while left:
            data = f.read(min(16 << 20, left))
            if not data:
                raise SplitError(
                    f"{path} ends inside a tensor at {start + nbytes - left}: the model is damaged"
                )
            crc = zlib.crc32(data, crc)
            left -= len(data)
    return crc


def _split_in_place(model_dir: Path, out: Path, config: dict[str, Any], refs: dict[str, TensorRef],
                    plan: list[Any], streamed: set[str], bar: Any) -> dict[str, Any]:  # fmt: skip
    """The manifest of an in-place split: the copied layout's units at virtual offsets, and the extents
    that map them to the shards (adjacent ranges merged: an FFN written gate, up, down is one extent)."""
    files = sorted({r.path for r in refs.values()})
    index = {f: k for k, f in enumerate(files)}
    extents: list[list[int]] = []
    units: list[dict[str, Any]] = []
    pos = 0
    for key, kind, layer, expert, parts in plan:
        start, crc, tensors, upos = pos, 0, [], 0
        for name, ref, s, n in parts:
            shape = ref.shape[1:] if kind == "expert" else ref.shape
            tensors.append(
                {"name": name, "dtype": ref.dtype, "shape": list(shape), "offset": upos, "nbytes": n}
            )
            crc = _crc_range(ref.path, ref.offset + s, n, crc)
            fi, fo = index[ref.path], ref.offset + s
            last = extents[-1] if extents else None
            if last and last[0] + last[1] == pos + upos and last[2] == fi and last[3] + last[1] == fo:
                last[1] += n
            else:
                extents.append([pos + upos, n, fi, fo])
            upos += n
            bar.update(n)
        units.append({"key": key, "kind": kind, "layer": layer, "expert": expert, "offset": start,
                      "length": upos, "crc32": crc, "tensors": tensors})  # fmt: skip
        pos = start + -(-upos // ALIGN) * ALIGN
    pinned = [refs[n] for n in sorted(refs) if n not in streamed]
    crc = 0
    for r in pinned:
        crc = _crc_range(r.path, r.offset, r.nbytes, crc)
        bar.update(r.nbytes)
    bar.close()
    return {
        "version": IN_PLACE_VERSION,
        "align": ALIGN,
        "layout": "in_place",
        "weights_dir": os.path.relpath(model_dir, out),
        "files": [os.path.relpath(f, out) for f in files],
        "source": {"dir": str(model_dir), "bytes": sum(r.nbytes for r in refs.values()), "tensors": len(refs)},
        "quant": _quant_table(config, []),
        "pinned": {"file": None, "crc32": crc, "bytes": sum(r.nbytes for r in pinned),
                   "tensors": {r.name: {"dtype": r.dtype, "shape": list(r.shape), "nbytes": r.nbytes} for r in pinned}},
        "units": units,
        "extents": extents,
    }  # fmt: skip


# --------------------------------------------------------------------------- reading
def load_manifest(root: Path) -> Manifest:
    root = Path(root)
    path = root / "manifest.json"
    if not path.exists():
        raise SplitError(f"no split at {root} (manifest.json missing): run `flashcode split MODEL`")
    try:
        m = json.loads(path.read_text())
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SplitError(
            f"the split at {root} is damaged ({exc}): run `flashcode split MODEL` again"
        ) from exc
    if m.get("version") not in (MANIFEST_VERSION, IN_PLACE_VERSION) or m.get("align") != ALIGN:
        raise SplitError(f"the split at {root} has an unknown format: run `flashcode split MODEL` again")
    units = [
        Unit(u["key"], u["kind"], u["layer"], u["expert"], u["offset"], u["length"], u["crc32"],
             [UnitTensor(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"]) for t in u["tensors"]])
        for u in m["units"]
    ]  # fmt: skip
    p = m["pinned"]
    man = Manifest(
        root, config, units, m["quant"], p["file"], p["crc32"], p["bytes"], p["tensors"], m["source"]
    )
    if m.get("layout") == "in_place":
        man.layout, man.extents = "in_place", m["extents"]
        man.files = [(root / f).resolve() for f in m["files"]]
        man.weights_dir = (root / m["weights_dir"]).resolve()
        for k, f in enumerate(man.files):
            need = max((fo + n for _, n, fi, fo in man.extents if fi == k), default=0)
            have = f.stat().st_size if f.exists() else -1
            if have < need:
                raise SplitError(f"the model's weights in {f} are missing or truncated ({have} bytes, the split "
                                 f"needs {need}): import the model again ({reimport(man.weights_dir)})")  # fmt: skip
        return man
    need = max((u.offset + u.padded for u in units), default=0)
    have = man.units_path.stat().st_size if man.units_path.exists() else -1
    if have < need:
        raise SplitError(f"the split at {root} is damaged: units.bin has {have} bytes, the manifest needs {need}; "
                         "run `flashcode split MODEL` again")  # fmt: skip
    return man


def crc_file(path: Path, chunk: int = 4 << 20) -> int:
    crc = 0
    buf = bytearray(chunk)  # one buffer reused: checking the pinned file adds 4 MB to RSS, not 2 chunks
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def verify_pinned(man: Manifest) -> None:
    if man.in_place:
        assert man.weights_dir is not None
        refs = read_model_tensors(man.weights_dir)
        crc = 0
        for name in sorted(man.pinned_tensors):
            if name not in refs:  # another model's weights where this split's were
                raise SplitError(
                    damaged(man, f"the weights have no tensor {name}, which this split was made for")
                )
            crc = _crc_range(refs[name].path, refs[name].offset, refs[name].nbytes, crc)
        if crc != man.pinned_crc32:
            raise SplitError(damaged(man, "the pinned weights fail their checksum"))
        return
    if crc_file(man.root / man.pinned_file) != man.pinned_crc32:
        raise SplitError(damaged(man, f"{man.pinned_file} fails its checksum"))


def check_unit(man: Manifest, unit: Unit, data: memoryview) -> None:
    if zlib.crc32(data[: unit.length]) != unit.crc32:
        raise SplitError(unit_damaged(man, unit))


def unit_damaged(man: Manifest, unit: Unit) -> str:
    return damaged(man, f"unit {unit.key} (offset {unit.offset}) fails its checksum")


def damaged(man: Manifest, what: str) -> str:
    """What to do about bytes that fail their checksum. In place, the bytes are the model's own files, so
    splitting again would only take the damage's checksums: the model is imported again instead."""
    if man.in_place:
        return (f"the model's weights in {man.weights_dir} are damaged (or changed since they were split): {what}; "
                f"import the model again ({reimport(man.weights_dir)}): its split is made again at its next load")  # fmt: skip
    return f"the split at {man.root} is damaged: {what}; run `flashcode split MODEL` again"


def dtype_size(dtype: str) -> int:
    return DTYPE_SIZES[dtype]
