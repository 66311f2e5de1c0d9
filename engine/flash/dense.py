"""Dense FFN streaming: each FFN projection read from the split while the previous one computes.

What it knows: the order the FFN weights are needed in — layer 0..N-1, and inside a layer its
pieces (gate, up, then down: one projection's tensors each, when the unit stores them in that
order; the whole unit otherwise) — the read-ahead that overlaps the next piece's read with the
current piece's compute, turning a piece's bytes into MLX arrays, and the FFN math of mlx-lm's
llama-family MLP (SwiGLU over three quantized linears) written with `mx.quantized_matmul` on those
arrays — nothing is assigned into the nn.Module tree. Attention, norms and embeddings stay the
model's own modules with pinned weights. Streaming a projection at a time instead of a whole FFN
cuts what is resident for streaming from two FFNs to two projections (llama-8b: 220 -> 73 MB).

What it does not know: where the bytes come from (reader.py) or memory budgets (budget.py).
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import cpu_fast
from .reader import AlignedBuffer, UnitReader
from .split import ALIGN, Manifest, SplitError, Unit, UnitTensor, first_layer, unit_damaged

_NP = {
    "U32": np.uint32,
    "U8": np.uint8,
    "F16": np.float16,
    "F32": np.float32,
    "BF16": np.uint16,
    "I32": np.int32,
}
ORDER = ("gate_proj", "up_proj", "down_proj")  # the order the FFN needs its weights in


def tensor_arrays(tensors: list[UnitTensor], raw: np.ndarray, base: int = 0) -> dict[str, Any]:
    """Copy tensors out of the (reused) buffer into MLX arrays; `raw[t.offset - base]` is a tensor's first byte.
    Scales and biases stay float16: `quantized_matmul` is 8-20% faster with float32 ones on the CPU, but
    converting a piece's costs more than that saves (12 vs 6 ms per llama-8b projection, measured)."""
    import mlx.core as mx

    out = {}
    for t in tensors:
        arr = raw[t.offset - base : t.offset - base + t.nbytes].view(_NP[t.dtype]).reshape(t.shape)
        a = mx.array(arr)
        out[t.name] = a.view(mx.bfloat16) if t.dtype == "BF16" else a
    return out


@dataclass
class Piece:
    """A byte range of a dense unit holding whole projections; the pieces of a unit tile it exactly."""

    unit: Unit
    index: int  # inside the unit
    last: bool
    start: int  # from the unit's start
    end: int
    tensors: list[UnitTensor]

    @property
    def projections(self) -> list[str]:
        names = {t.name.split(".")[0] for t in self.tensors}
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else -1)

    @property
    def read_start(self) -> int:  # O_DIRECT reads start and end on ALIGN boundaries (units start on one)
        return self.start // ALIGN * ALIGN

    @property
    def read_length(self) -> int:
        return -(-(self.end - self.read_start) // ALIGN) * ALIGN


def unit_pieces(unit: Unit) -> list[Piece]:
    """One piece per projection when the unit stores them gate, up, down (down last is what matters:
    it needs both others' outputs); a single piece for any other layout."""
    tensors = sorted(unit.tensors, key=lambda t: t.offset)
    groups: list[list[UnitTensor]] = []
    for t in tensors:
        proj = t.name.split(".")[0]
        if groups and groups[-1][0].name.split(".")[0] == proj:
            groups[-1].append(t)
        else:
            groups.append([t])
    names = [g[0].name.split(".")[0] for g in groups]
    if len(set(names)) != len(names) or set(names) != set(ORDER) or names[-1] != "down_proj":
        groups = [tensors]
    starts = [0] + [g[0].offset for g in groups[1:]]
    ends = starts[1:] + [unit.length]
    return [
        Piece(unit, k, k == len(groups) - 1, s, e, g)
        for k, (s, e, g) in enumerate(zip(starts, ends, groups, strict=True))
    ]


def max_piece_bytes(man: Manifest) -> int:
    """The largest read (with its alignment) the dense stream makes: what one buffer must hold."""
    return max((p.read_length for u in man.dense_units() for p in unit_pieces(u)), default=0)


class LayerStream:
    """Hands out the FFN pieces in the order they are computed, keeping the next `depth` reads in flight."""

    def __init__(self, man: Manifest, reader: UnitReader, depth: int = 2, verify: bool = False,
                 units: list[Unit] | None = None) -> None:  # fmt: skip
        self.man = man
        self.units = (
            man.dense_units() if units is None else units
        )  # the streamed ones (the rest are resident)
        self.pieces = [p for u in self.units for p in unit_pieces(u)]
        self.first = {}  # layer -> index of its first piece
        for k, p in enumerate(self.pieces):
            self.first.setdefault(p.unit.layer, k)
        self.by_layer = {u.layer: [p for p in self.pieces if p.unit.layer == u.layer] for u in self.units}
        self.reader = reader
        self.depth = max(1, depth)
        size = max(p.read_length for p in self.pieces)
        self.buffers = [AlignedBuffer(size) for _ in range(self.depth)]
        self.free = list(self.buffers)
        self.pending: dict[int, tuple[Future[float], AlignedBuffer]] = {}
        self.verify_left = {u.layer for u in self.units} if verify else set()
        self.crc: dict[int, tuple[int, int]] = {}  # layer -> (next piece index, running CRC-32)

    @property
    def n_layers(self) -> int:
        return len(self.units)

    def _submit(self, k: int) -> None:
        if k in self.pending or not self.free:
            return
        buf = self.free.pop()
        p = self.pieces[k]
        self.pending[k] = (self.reader.read(buf, p.unit.offset + p.read_start, p.read_length), buf)

    def _drain(self) -> None:
        for fut, buf in self.pending.values():
            fut.exception()
            self.free.append(buf)
        self.pending.clear()

    def _verify(self, p: Piece, data: memoryview) -> None:
        """Running CRC over a unit's pieces in order; checked against the unit's at its last piece."""
        layer = p.unit.layer
        index, crc = self.crc.get(layer, (0, 0))
        if index != p.index:  # an aborted forward skipped pieces: check this unit on a later pass
            self.crc.pop(layer, None)
            if p.index:
                return
            index, crc = 0, 0
        crc = zlib.crc32(data, crc)
        if not p.last:
            self.crc[layer] = (index + 1, crc)
            return
        self.crc.pop(layer, None)
        if crc != p.unit.crc32:
            raise SplitError(unit_damaged(self.man, p.unit))
        self.verify_left.discard(layer)

    def pieces_of(self, layer: int) -> list[Piece]:
        return self.by_layer[layer]

    def get(self, layer: int, index: int) -> dict[str, Any]:
        """The arrays of piece `index` of `layer`'s FFN; starts the reads of the pieces after it."""
        k = self.first[layer] + index
        if k not in self.pending:
            if not self.free:  # out of order (an aborted forward): drop the stale prefetches
                self._drain()
            self._submit(k)
        fut, buf = self.pending.pop(k)
        p = self.pieces[k]
        try:
            fut.result()
            raw = np.frombuffer(buf.view, dtype=np.uint8, count=p.read_length)
            if layer in self.verify_left:
                self._verify(p, buf.view[p.start - p.read_start : p.end - p.read_start])
            arrays = tensor_arrays(p.tensors, raw, p.read_start)
        finally:
            self.free.append(buf)
        for d in range(1, self.depth + 1):  # the next pieces (wrapping into the next token)
            self._submit((k + d) % len(self.pieces))
        return arrays

    def close(self) -> None:
        self._drain()
        for b in self.buffers:
            b.close()


class StreamedFFN:
    """Drop-in for a llama-family `mlp`: down(silu(gate(x)) * up(x)) on streamed quantized weights."""

    rows_path = False  # the CPU's many-rows path (`cpu_fast.rows_path`): set by `attach` for every FFN

    def __init__(self, stream: LayerStream, layer: int) -> None:
        self.stream = stream
        self.layer = layer
        self.q = {p: stream.man.quant_for(layer, p) for p in ORDER}

    def pieces(self) -> list[Piece]:
        return self.stream.pieces_of(self.layer)

    def weights(self, piece: Piece) -> dict[str, Any]:
        return self.stream.get(self.layer, piece.index)

    def _linear(self, x: Any, w: dict[str, Any], proj: str) -> Any:
        import mlx.core as mx

        q = self.q[proj]
        weight, scales, biases = w[f"{proj}.weight"], w[f"{proj}.scales"], w.get(f"{proj}.biases")
        mode = q.get("mode", "affine")
        if self.rows_path and x.size // x.shape[-1] >= cpu_fast.min_rows():
            # prefill on the CPU: dequantize and BLAS-multiply, as MLXBackend's layers do (MLX's CPU
            # `quantized_matmul` costs per row what decode does: flash prefilled 15x slower than MLX in RAM)
            y = cpu_fast.quantized_matmul(x, weight, scales, biases, q["group_size"], q["bits"], mode)
        else:
            y = mx.quantized_matmul(x, weight, scales=scales, biases=biases, transpose=True,
                                    group_size=q["group_size"], bits=q["bits"], mode=mode)  # fmt: skip
        if f"{proj}.bias" in w:
            y = y + w[f"{proj}.bias"]
        return y

    def __call__(self, x: Any) -> Any:
        import mlx.core as mx
        from mlx_lm.models.activations import swiglu

        out: dict[str, Any] = {}
        for piece in self.pieces():
            w = self.weights(piece)
            for proj in piece.projections:
                if proj == "down_proj":
                    out[proj] = self._linear(swiglu(out.pop("gate_proj"), out.pop("up_proj")), w, proj)
                else:
                    out[proj] = self._linear(x, w, proj)
            mx.eval(
                list(out.values())
            )  # compute now, so this piece's weights are released before the next lands
            del w
        return out["down_proj"]


class ResidentFFN(StreamedFFN):
    """The same FFN on weights read once at load and kept (partial residency: what the budget allows).
    The same pieces, in the same order, through the same math: the tokens do not change."""

    def __init__(self, man: Manifest, unit: Unit, arrays: dict[str, Any]) -> None:
        self.layer, self.arrays, self._pieces = unit.layer, arrays, unit_pieces(unit)
        self.q = {p: man.quant_for(unit.layer, p) for p in ORDER}

    def pieces(self) -> list[Piece]:
        return self._pieces

    def weights(self, piece: Piece) -> dict[str, Any]:
        return {t.name: self.arrays[t.name] for t in piece.tensors}

    def __call__(self, x: Any) -> Any:
        """The same projections, left lazy: nothing to release between pieces, so the FFN joins the
        token's one graph (as in MLXBackend) instead of one evaluation per projection."""
        from mlx_lm.models.activations import swiglu

        w = self.arrays
        return self._linear(
            swiglu(self._linear(x, w, "gate_proj"), self._linear(x, w, "up_proj")), w, "down_proj"
        )


def load_resident(
    man: Manifest, reader: UnitReader, units: list[Unit], float_bytes: int = 2
) -> dict[int, ResidentFFN]:
    """Read `units` once (checksum checked) into MLX arrays that stay: layer -> ResidentFFN. With
    `float_bytes` 4 (the CPU) float16/bfloat16 scales and biases are cast to float32 once, as MLXBackend
    holds them: `quantized_matmul` is faster with them there, and the cast is exact."""
    import mlx.core as mx

    from .split import check_unit

    out: dict[int, ResidentFFN] = {}
    if not units:
        return out
    buf = AlignedBuffer(max(u.padded for u in units))
    try:
        for u in units:
            reader.read(buf, u.offset, u.length).result()
            check_unit(man, u, buf.view)
            arrays = tensor_arrays(u.tensors, np.frombuffer(buf.view, dtype=np.uint8, count=u.padded))
            if float_bytes == 4:
                arrays = {
                    k: v.astype(mx.float32)
                    if k.endswith((".scales", ".biases")) and v.dtype in (mx.float16, mx.bfloat16)
                    else v
                    for k, v in arrays.items()
                }
            mx.eval(list(arrays.values()))
            out[u.layer] = ResidentFFN(man, u, arrays)
    finally:
        buf.close()
    return out


def attach(model: Any, stream: LayerStream | None, moe_layers: set[int] | None = None,
           resident: dict[int, ResidentFFN] | None = None) -> None:  # fmt: skip
    """Point each dense block's `mlp` at a StreamedFFN (the pinned model has no FFN weights), or at its
    ResidentFFN when the budget keeps it. In a MoE model the layers in `moe_layers` keep their
    (expert-streamed) block; every other layer needs a unit."""
    layers, moe_layers, resident = model.layers, moe_layers or set(), resident or {}
    first = first_layer(model)  # a pipeline rank's layers keep their numbers in the model
    dense = {u.layer for u in stream.units} if stream is not None else set()
    dense |= set(resident)
    missing = [i for i in range(first, first + len(layers)) if i not in dense and i not in moe_layers]
    if missing or len(dense) + len(moe_layers) != len(layers):
        raise ValueError(
            f"the split has FFN units for {len(dense)} layers and experts for {len(moe_layers)}, "
            f"but the model has {len(layers)} layers (no FFN for layers {missing[:8]})"
        )
    fast = cpu_fast.rows_path()  # prefill's dequantize-then-BLAS path, as patch_model gives the pinned layers
    for i in sorted(dense):
        layer = layers[i - first]
        if not hasattr(layer, "mlp"):
            raise ValueError(
                f"layer {i} of {type(model).__name__} has no `mlp`: not a dense llama-family block"
            )
        if "mlp" in layer:  # drop the placeholder MLP (lazy, never evaluated) from the parameter tree
            del layer["mlp"]
        ffn = resident[i] if i in resident else StreamedFFN(stream, i)  # type: ignore[arg-type]
        ffn.rows_path = fast
        layer.mlp = ffn
