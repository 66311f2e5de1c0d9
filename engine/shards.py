"""Sharded safetensors files written piece by piece, laid out as mlx-lm's `save_model` lays them out.

What it knows: how to place tensors (given only names, dtypes and shapes) into shards of at most
`shard_bytes` — `model.safetensors` when one shard is enough, else `model-0000K-of-0000N.safetensors`
— with `model.safetensors.index.json` (`metadata.total_size`, `weight_map`); writing a tensor's bytes
in any number of consecutive chunks at their final place (so no tensor, let alone a model, is ever
held in memory whole); and keeping the page cache small while doing so (written ranges are synced
and dropped every `flush_bytes`: a memory cgroup charges the page cache, and dirty pages cannot be
reclaimed until written).

What it does not know: what the tensors mean (engine/gguf.py converts them). Data lies in the order
the specs are given, so a caller can keep tensors that are read together next to each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .flash.safetensors_io import TensorSpec, write_header

SHARD_BYTES = 5 << 30  # mlx-lm's default max_file_size_gb
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class _Place:
    shard: int
    offset: int  # absolute, in the shard file
    nbytes: int


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def plan_shards(groups: list[list[TensorSpec]], shard_bytes: int = SHARD_BYTES) -> list[list[TensorSpec]]:
    """Groups (tensors that must share a shard) packed in order into shards of at most `shard_bytes`
    (a group larger than that gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for group in groups:
        n = sum(s.nbytes for s in group)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += n
    return shards


class ShardWriter:
    """Creates the shard files with their headers up front; `write` puts bytes at a tensor's offset."""

    def __init__(self, out_dir: Path, shards: list[list[TensorSpec]], flush_bytes: int = 256 << 20) -> None:
        self.out_dir = Path(out_dir)
        self.names = shard_names(len(shards))
        self.places: dict[str, _Place] = {}
        self.fds: list[int] = []
        self.flush_bytes = flush_bytes
        self._unflushed = [0] * len(shards)
        self.total = 0
        for k, specs in enumerate(shards):
            path = self.out_dir / self.names[k]
            with open(path, "wb") as f:
                start = write_header(f, specs)
            pos = start
            for s in specs:
                self.places[s.name] = _Place(k, pos, s.nbytes)
                pos += s.nbytes
                self.total += s.nbytes
            fd = os.open(path, os.O_WRONLY)
            os.ftruncate(fd, pos)  # the final size now: a short file is an unfinished one
            self.fds.append(fd)

    def write(self, name: str, start: int, data: bytes | memoryview) -> None:
        """`data` is bytes [start, start + len) of tensor `name`."""
        p = self.places[name]
        view = memoryview(data).cast("B")
        if start + len(view) > p.nbytes:
            raise ValueError(f"{name}: bytes {start}..{start + len(view)} run past its {p.nbytes} bytes")
        fd = self.fds[p.shard]
        at = p.offset + start
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        self._unflushed[p.shard] += len(data)
        if self._unflushed[p.shard] >= self.flush_bytes:
            self._flush(p.shard)

    def _flush(self, shard: int) -> None:
        fd = self.fds[shard]
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and synced: drop from the cache
        self._unflushed[shard] = 0

    def finish(self) -> Path:
        """Sync every shard, write the index; returns its path."""
        for k in range(len(self.fds)):
            self._flush(k)
        self.close()
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": {name: self.names[p.shard] for name, p in sorted(self.places.items())},
        }
        path = self.out_dir / INDEX_NAME
        path.write_text(json.dumps(index, indent=4))
        return path

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
