"""Values typed on the command line: sizes ('1.5GB'), counts, non-negative numbers.

Each parser is an `argparse` type: it returns the value or raises `argparse.ArgumentTypeError` with
a message that says what would be accepted. What it does not know: which command uses it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from engine.stops import MAX_STOP_CHARS

# what the options every command shares mean, said once for every parser's --help
HELP = {
    "backend": "engine: mlx (in RAM), llama (llama-server), flash (streamed from SSD); auto: MLX on a Mac or a GPU, "
    "llama-server on a Linux CPU (serve, ask and chat: flash when the model does not fit with room to spare)",
    "data_dir": "flashcode's data directory (default $FLASHCODE_HOME or ~/.local/share/flashcode)",
    "seed": "sampling seed, for a reply that can be had again (default: a new one each time)",
    "temperature": "sampling temperature; 0 is greedy",
    "top_p": "nucleus sampling: the smallest set of tokens whose probabilities add up to this",
    "max_tokens": "the most tokens a reply may have",
}

SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "kib": 1024,
    "m": 1e6, "mb": 1e6, "mib": 1 << 20,
    "g": 1e9, "gb": 1e9, "gib": 1 << 30,
    "t": 1e12, "tb": 1e12, "tib": 1 << 40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'300MB', '1.5GB', '4GiB', '1024' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 300MB, 1.5GB or 4GiB)") from None
    if unit not in SIZE_UNITS or not 0 <= value * SIZE_UNITS[unit] < 1 << 62:  # inf, nan, absurd
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 300MB, 1.5GB or 4GiB)")
    return int(value * SIZE_UNITS[unit])


MIN_BUDGET = 64_000_000  # below it no model runs: Python, MLX and a tokenizer alone hold more


def parse_budget(text: str) -> int | str:
    """'auto' (what the machine or its memory cgroup can spare, engine/flash/memory.py) or a size of at least
    MIN_BUDGET (`1.5` was 1.5 bytes, refused only at load with a shortfall of the whole runtime)."""
    if text.strip().lower() == "auto":
        return "auto"
    size = parse_size(text)
    if size < MIN_BUDGET:
        bare = not any(c.isalpha() for c in text)
        raise argparse.ArgumentTypeError(
            f"{text!r} is under 64 MB, which cannot hold the runtime"
            + (": a number without a unit is bytes; give one, e.g. 1.5GB or 300MB" if bare else "")
        )
    return size


def _checked(text: str, cast: type, ok: Callable[[Any], bool], accepted: str) -> Any:
    """`text` as `cast`, when `ok` says it is in range; else the error that says what is `accepted`."""
    try:
        value = cast(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "a whole number of 1 or more")


def seed(text: str) -> int:
    """A sampling seed: a whole number, 0 or more (MLX takes 64 bits unsigned)."""
    return _checked(text, int, lambda v: 0 <= v < 2**64, "a seed: a whole number, 0 or more, e.g. 42")


def gpu_layers(text: str) -> int:
    """llama.cpp's --n-gpu-layers: a count of layers, or -1 for all of them."""
    return _checked(text, int, lambda v: v >= -1, "a number of layers (0 or more), or -1 for all")


def non_negative_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 <= v < float("inf"), "a number of 0 or more, e.g. 1.0")


def port_number(text: str) -> int:
    """A TCP port: 1-65535, or 0 (the system picks a free one)."""
    return _checked(text, int, lambda v: 0 <= v <= 65535, "a port: use 1-65535 (or 0 for any free one)")


def stop_string(text: str) -> str:
    """A stop string: not empty, at most MAX_STOP_CHARS characters (each token is checked against it)."""
    if not 0 < len(text) <= MAX_STOP_CHARS:
        raise argparse.ArgumentTypeError(
            f"a stop string is 1 to {MAX_STOP_CHARS} characters, not {len(text):,}"
        )
    return text


def probability(text: str) -> float:
    """A share in (0, 1], e.g. top-p."""
    return _checked(text, float, lambda v: 0 < v <= 1, "a number above 0 and at most 1, e.g. 0.9")
