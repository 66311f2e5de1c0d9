"""Dense FFN streaming: each layer's FFN read from the split while the previous layer computes.

What it knows: the order layers run in (0..N-1, then 0 again for the next token), the double
buffering that overlaps the next unit's read with the current layer's compute, turning a unit's
bytes into MLX arrays, and the FFN math of mlx-lm's llama-family MLP (SwiGLU over three quantized
linears) written with `mx.quantized_matmul` on those arrays — nothing is assigned into the
nn.Module tree. Attention, norms and embeddings stay the model's own modules with pinned weights.

What it does not know: where the bytes come from (reader.py) or memory budgets (budget.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from .reader import AlignedBuffer, UnitReader
from .split import Manifest, Unit, check_unit

_NP = {"U32": np.uint32, "U8": np.uint8, "F16": np.float16, "F32": np.float32, "BF16": np.uint16, "I32": np.int32}


def unit_arrays(unit: Unit, data: memoryview) -> dict[str, Any]:
    """Copy a unit's bytes out of the (reused) buffer into MLX arrays, one per tensor."""
    import mlx.core as mx

    raw = np.frombuffer(data, dtype=np.uint8, count=unit.length)
    out = {}
    for t in unit.tensors:
        arr = raw[t.offset : t.offset + t.nbytes].view(_NP[t.dtype]).reshape(t.shape)
        a = mx.array(arr)
        out[t.name] = a.view(mx.bfloat16) if t.dtype == "BF16" else a
    return out


class LayerStream:
    """Hands out layer i's FFN arrays, keeping the next `depth` layers' reads in flight."""

    def __init__(self, man: Manifest, reader: UnitReader, depth: int = 2, verify: bool = False) -> None:
        self.man = man
        self.units = man.dense_units()
        self.reader = reader
        self.depth = max(1, depth)
        self.buffers = [AlignedBuffer(man.max_unit_bytes) for _ in range(self.depth)]
        self.free = list(self.buffers)
        self.pending: dict[int, tuple[Future[float], AlignedBuffer]] = {}
        self.verify_left = set(range(len(self.units))) if verify else set()
        self.lock = threading.Lock()

    @property
    def n_layers(self) -> int:
        return len(self.units)

    def _submit(self, i: int) -> None:
        if i in self.pending or not self.free:
            return
        buf = self.free.pop()
        u = self.units[i]
        self.pending[i] = (self.reader.read(buf, u.offset, u.length), buf)

    def _drain(self) -> None:
        for fut, buf in self.pending.values():
            fut.exception()
            self.free.append(buf)
        self.pending.clear()

    def get(self, i: int) -> dict[str, Any]:
        if i not in self.pending:
            if not self.free:  # out of order (an aborted forward): drop the stale prefetches
                self._drain()
            self._submit(i)
        fut, buf = self.pending.pop(i)
        try:
            fut.result()
            if i in self.verify_left:
                check_unit(self.man, self.units[i], buf.view)
                self.verify_left.discard(i)
            arrays = unit_arrays(self.units[i], buf.view)
        finally:
            self.free.append(buf)
        for k in range(1, self.depth + 1):  # the next layers (wrapping into the next token)
            self._submit((i + k) % self.n_layers)
        return arrays

    def close(self) -> None:
        self._drain()
        for b in self.buffers:
            b.close()


class StreamedFFN:
    """Drop-in for a llama-family `mlp`: down(silu(gate(x)) * up(x)) on streamed quantized weights."""

    def __init__(self, stream: LayerStream, layer: int) -> None:
        self.stream = stream
        self.layer = layer
        self.q = {p: stream.man.quant_for(layer, p) for p in ("gate_proj", "up_proj", "down_proj")}

    def _linear(self, x: Any, w: dict[str, Any], proj: str) -> Any:
        import mlx.core as mx

        q = self.q[proj]
        y = mx.quantized_matmul(x, w[f"{proj}.weight"], scales=w[f"{proj}.scales"], biases=w.get(f"{proj}.biases"),
                                transpose=True, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"))  # fmt: skip
        if f"{proj}.bias" in w:
            y = y + w[f"{proj}.bias"]
        return y

    def __call__(self, x: Any) -> Any:
        import mlx.core as mx
        from mlx_lm.models.activations import swiglu

        w = self.stream.get(self.layer)
        y = self._linear(swiglu(self._linear(x, w, "gate_proj"), self._linear(x, w, "up_proj")), w, "down_proj")
        mx.eval(y)  # compute now, so this layer's weights are released before the next one lands
        return y


def attach(model: Any, stream: LayerStream) -> None:
    """Point every transformer block's `mlp` at a StreamedFFN (the pinned model has no FFN weights)."""
    layers = model.layers
    if len(layers) != stream.n_layers:
        raise ValueError(f"the split has {stream.n_layers} FFN units but the model has {len(layers)} layers")
    for i, layer in enumerate(layers):
        if not hasattr(layer, "mlp"):
            raise ValueError(f"layer {i} of {type(model).__name__} has no `mlp`: not a dense llama-family block")
        if "mlp" in layer:  # drop the placeholder MLP (lazy, never evaluated) from the parameter tree
            del layer["mlp"]
        layer.mlp = StreamedFFN(stream, i)
