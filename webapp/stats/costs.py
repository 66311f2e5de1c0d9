"""What the same tokens would have cost on a cloud API: a price table the user can edit.

What it knows: prices per million tokens (input, cached input, output) for a few cloud models, each
with the date it was taken; how to load and save that table as `$FLASHCODE_HOME/prices.json`; the
cost arithmetic:

    cost = (prompt - cached) x input + cached x cached_input + completion x output   (per 1e6 tokens)

Why a JSON file and not SQLite: the table is configuration a person edits (by hand, or in the Stats
window), not a measurement. A file can be opened in an editor, kept in a dotfiles repo, and survives
deleting the database. Costs are never stored: they are computed from recorded token counts at the
current prices, so editing a price re-prices all history ("what would this have cost today").
Until the user saves, the shipped defaults are used and no file is written.

What it does not know: where token counts come from (`store.py`), HTML.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine import paths

PRICES_FILE = "prices.json"
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
MAX_MODELS = 50


class PriceTableError(ValueError):
    """The price table file is malformed; the message names the file and how to fix it."""


@dataclass(frozen=True)
class Price:
    """USD per million tokens."""

    name: str
    input: float
    cached_input: float
    output: float
    as_of: str  # YYYY-MM-DD: when the price was taken from the provider's price page

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("a price needs a model name")
        for field_name in ("input", "cached_input", "output"):
            value = getattr(self, field_name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{self.name}: {field_name} must be a number >= 0, got {value!r}")
        if not DATE_RE.match(self.as_of) or not _real_date(self.as_of):
            raise ValueError(f"{self.name}: as_of must be a date like 2025-10-15, got {self.as_of!r}")


def _real_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


# List prices published by Anthropic and OpenAI (PRICE_SOURCES), per million tokens, as of the date on each
# row. Cached input is the price of a cache read (Anthropic) / cached input (OpenAI).
PRICE_SOURCES: tuple[tuple[str, str], ...] = (
    ("Anthropic", "https://www.anthropic.com/pricing#api"),
    ("OpenAI", "https://openai.com/api/pricing/"),
)
DEFAULT_PRICES: tuple[Price, ...] = (
    Price("Claude Sonnet 4.5", 3.00, 0.30, 15.00, "2025-10-15"),
    Price("Claude Haiku 4.5", 1.00, 0.10, 5.00, "2025-10-15"),
    Price("GPT-4.1", 2.00, 0.50, 8.00, "2025-10-15"),
    Price("GPT-4o", 2.50, 1.25, 10.00, "2025-10-15"),
)


def cost(price: Price, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """Dollars for one reply (or for summed counts). Cached tokens are part of `prompt_tokens`."""
    cached = max(0, min(cached_tokens, prompt_tokens))
    uncached = max(0, prompt_tokens - cached)
    return (uncached * price.input + cached * price.cached_input + completion_tokens * price.output) / 1e6


def costs_for(
    prices: tuple[Price, ...] | list[Price], prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> list[tuple[Price, float]]:
    """Each price with the cost of the given counts, most expensive first."""
    rows = [(p, cost(p, prompt_tokens, cached_tokens, completion_tokens)) for p in prices]
    return sorted(rows, key=lambda r: -r[1])


# --------------------------------------------------------------------------- the file
def prices_path(data_dir: Path | None = None) -> Path:
    if data_dir is None:
        data_dir = paths.home()
    return Path(data_dir) / PRICES_FILE


def load_prices(path: Path) -> tuple[Price, ...]:
    """The user's table, or the shipped defaults when `path` does not exist."""
    if not path.exists():
        return DEFAULT_PRICES
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PriceTableError(
            f"cannot read the price table {path}: {exc}; fix it or delete it to use the defaults"
        ) from exc
    return parse_prices(data, source=str(path))


def parse_prices(data: Any, source: str = "price table") -> tuple[Price, ...]:
    rows = data.get("models") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise PriceTableError(
            f'{source}: expected {{"models": [...]}}; fix it or delete it to use the defaults'
        )
    if len(rows) > MAX_MODELS:
        raise PriceTableError(f"{source}: at most {MAX_MODELS} models, got {len(rows)}")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(
                Price(
                    str(row["name"]),
                    float(row["input"]),
                    float(row["cached_input"]),
                    float(row["output"]),
                    str(row["as_of"]),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PriceTableError(
                f"{source}: model #{i + 1} needs name, input, cached_input, output (USD per million tokens) "
                f"and as_of (YYYY-MM-DD): {exc}"
            ) from exc
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise PriceTableError(f"{source}: model names must be unique")
    return tuple(out)


def keep_unreadable(path: Path) -> Path | None:
    """A table at `path` that cannot be read (a hand edit's typo) is copied aside before the Stats window's
    Save or Reset replaces it (the window had shown the defaults, so saving dropped the user's own rows);
    the copy's path, or None when there was nothing to keep."""
    if not path.exists():
        return None
    try:
        load_prices(path)
        return None
    except PriceTableError:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kept = path.with_name(f"{path.stem}.unreadable-{stamp}{path.suffix}")
        n = 2
        while kept.exists():  # two in one second: never one over another
            kept, n = path.with_name(f"{path.stem}.unreadable-{stamp}-{n}{path.suffix}"), n + 1
        shutil.copy2(path, kept)
        return kept


def save_prices(path: Path, prices: tuple[Price, ...] | list[Price]) -> None:
    """Write atomically (a half-written table would lose the user's edits)."""
    data = {"currency": "USD", "unit": "per million tokens", "models": [asdict(p) for p in prices]}
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.write_text_atomic(path, json.dumps(data, indent=2) + "\n")


FORM_COLUMNS = (("input", "Input"), ("cached_input", "Cached"), ("output", "Output"))  # field, column heading


def form_rows(
    names: list[str], inputs: list[str], cached: list[str], outputs: list[str], dates: list[str]
) -> list[dict[str, str]]:
    """The Stats window's price form as typed: parallel lists, one dict a row (drawn again after a refusal)."""
    if (
        len({len(names), len(inputs), len(cached), len(outputs), len(dates)}) != 1
    ):  # never from the form itself
        raise PriceTableError("the price form came with rows of different lengths: open Stats again and save")
    return [
        {"name": n, "input": i, "cached_input": c, "output": o, "as_of": d}
        for n, i, c, o, d in zip(names, inputs, cached, outputs, dates, strict=False)
    ]


def prices_from_form(
    names: list[str], inputs: list[str], cached: list[str], outputs: list[str], dates: list[str]
) -> tuple[Price, ...]:
    """The Stats window's price form: parallel lists; rows with an empty name are dropped. A refusal names the
    row and the column as the form shows them (it said "model #1 needs name, input, … : could not convert
    string to float: 'abc'": walkthrough)."""
    rows = []
    for row in form_rows(names, inputs, cached, outputs, dates):
        name = row["name"].strip()
        if not name:
            continue
        for field_name, heading in FORM_COLUMNS:
            text = row[field_name].strip()
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < 0:
                raise PriceTableError(
                    f"{name}: {heading} needs a price in US dollars per million tokens, such as 3 or 0.3"
                    + (f" (it says {text[:20]!r})" if text else " (it is empty)")
                )
        if not DATE_RE.match(row["as_of"].strip()) or not _real_date(row["as_of"].strip()):
            raise PriceTableError(f"{name}: As of needs the date of the price, such as 2025-10-15")
        rows.append({**row, "name": name, "as_of": row["as_of"].strip()})
    return parse_prices({"models": rows}, source="the price form")


def format_usd(amount: float) -> str:
    """$12.34; below a dollar two significant digits (up to four decimals), so a few replies do not read as
    $0.00 and the rows of one table compare: $0.015 and $0.014, not $0.01 twice next to $0.0095."""
    if amount == 0:
        return "$0.00"
    if 0 < abs(amount) < 0.0001:
        return "<$0.0001"
    if abs(amount) < 1:
        decimals = min(4, max(2, 1 - math.floor(math.log10(abs(amount)))))
        return f"${amount:.{decimals}f}"
    return f"${amount:,.2f}"
