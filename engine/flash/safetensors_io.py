"""Raw safetensors headers: read tensor byte ranges and write files tensor by tensor.

What it knows: the safetensors container (8-byte little-endian header length, a JSON header of
name -> dtype/shape/data_offsets, then the data). It copies bytes; it never decodes a tensor, so
any dtype (bf16 included) round-trips exactly and no file is held in RAM whole.
"""

from __future__ import annotations

import json
import shlex
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..base import ModelLoadError

DTYPE_SIZES = {
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    dtype: str  # safetensors spelling: U32, F16, BF16, F32...
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute, from the start of the file
    nbytes: int


class DamagedHeaderError(ModelLoadError, ValueError):
    """A weights file whose safetensors header cannot be read (cut, overwritten, not safetensors)."""


def read_header(path: Path) -> dict[str, TensorRef]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, h in header.items():
            if name == "__metadata__":
                continue
            start, end = h["data_offsets"]
            out[name] = TensorRef(name, h["dtype"], tuple(h["shape"]), path, base + start, end - start)
    except (
        struct.error,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
    ) as exc:  # UnicodeDecodeError: a ValueError
        raise DamagedHeaderError(
            f"{path} is damaged: its safetensors header cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
            f"import the model again ({reimport(path.parent)})"
        ) from exc
    return out


def read_model_tensors(model_dir: Path) -> dict[str, TensorRef]:
    """Every tensor of an mlx-lm model directory (one or several model*.safetensors files)."""
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {model_dir}")
    refs: dict[str, TensorRef] = {}
    for f in files:
        refs.update(read_header(f))
    return refs


def iter_chunks(ref: TensorRef, chunk: int = 16 << 20) -> Iterator[bytes]:
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        left = ref.nbytes
        while left:
            data = f.read(min(chunk, left))
            if not data:
                raise OSError(f"{ref.path} ends inside tensor {ref.name}")
            left -= len(data)
            yield data


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def write_header(f: BinaryIO, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    """Write the header for `specs` (data must follow in the same order); returns the data start."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "mlx"}}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    return 8 + len(raw)


def reimport(model_dir: Path) -> str:
    """The command that imports a model again: with its own GGUF when it is still there, else a placeholder."""
    from ..models import source_gguf

    src = source_gguf(model_dir)
    return (
        f"`flashcode import --force {shlex.quote(str(src))}`"
        if src
        else "`flashcode import --force FILE.gguf`"
    )
