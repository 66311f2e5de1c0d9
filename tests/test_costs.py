"""Cost arithmetic against hand-computed values, and the editable price table file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from webapp.stats import costs
from webapp.stats.costs import Price

SONNET = Price("Claude Sonnet 4.5", 3.00, 0.30, 15.00, "2025-10-15")
GPT41 = Price("GPT-4.1", 2.00, 0.50, 8.00, "2025-10-15")
GPT4O = Price("GPT-4o", 2.50, 1.25, 10.00, "2025-10-15")


def test_cost_matches_hand_computed_values() -> None:
    # 800,000 uncached x $3 + 200,000 cached x $0.30 + 100,000 out x $15 = 2.40 + 0.06 + 1.50
    assert costs.cost(SONNET, 1_000_000, 200_000, 100_000) == pytest.approx(3.96)
    # 10,000 x $2 + 2,345 x $0.50 + 678 x $8 = 0.02 + 0.0011725 + 0.005424
    assert costs.cost(GPT41, 12_345, 2_345, 678) == pytest.approx(0.0265965)
    # 1,000 x $2.50 + 500 x $10 = 0.0025 + 0.005
    assert costs.cost(GPT4O, 1_000, 0, 500) == pytest.approx(0.0075)
    # everything cached: 50,000 x $1.25 + 0 out
    assert costs.cost(GPT4O, 50_000, 50_000, 0) == pytest.approx(0.0625)
    assert costs.cost(SONNET, 0, 0, 0) == 0


def test_cost_clamps_cached_to_prompt_tokens() -> None:
    assert costs.cost(SONNET, 100, 500, 0) == pytest.approx(100 * 0.30 / 1e6)


def test_defaults_carry_the_issue_prices_with_a_date() -> None:
    by_name = {p.name: p for p in costs.DEFAULT_PRICES}
    assert (
        by_name["Claude Sonnet 4.5"].input,
        by_name["Claude Sonnet 4.5"].cached_input,
        by_name["Claude Sonnet 4.5"].output,
    ) == (3.0, 0.3, 15.0)
    assert (by_name["GPT-4.1"].input, by_name["GPT-4.1"].cached_input, by_name["GPT-4.1"].output) == (
        2.0,
        0.5,
        8.0,
    )
    assert (by_name["GPT-4o"].input, by_name["GPT-4o"].cached_input, by_name["GPT-4o"].output) == (
        2.5,
        1.25,
        10.0,
    )
    assert all(costs.DATE_RE.match(p.as_of) for p in costs.DEFAULT_PRICES)


def test_costs_for_sorts_most_expensive_first() -> None:
    rows = costs.costs_for([GPT41, SONNET, GPT4O], 1_000_000, 0, 0)
    assert [p.name for p, _ in rows] == ["Claude Sonnet 4.5", "GPT-4o", "GPT-4.1"]
    assert [d for _, d in rows] == pytest.approx([3.0, 2.5, 2.0])


def test_prices_file_round_trips_and_defaults_when_missing(tmp_path: Path) -> None:
    path = costs.prices_path(tmp_path)
    assert costs.load_prices(path) == costs.DEFAULT_PRICES
    mine = (Price("Local GPU", 0.1, 0.0, 0.2, "2026-11-01"), SONNET)
    costs.save_prices(path, mine)
    assert costs.load_prices(path) == mine
    assert json.loads(path.read_text())["unit"] == "per million tokens"


def test_malformed_prices_file_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = costs.prices_path(tmp_path)
    path.write_text("{not json")
    with pytest.raises(costs.PriceTableError, match="prices.json.*delete it"):
        costs.load_prices(path)
    path.write_text(
        json.dumps(
            {"models": [{"name": "X", "input": -1, "cached_input": 0, "output": 1, "as_of": "2025-01-01"}]}
        )
    )
    with pytest.raises(costs.PriceTableError, match="model #1.*input must be a number >= 0"):
        costs.load_prices(path)
    path.write_text(
        json.dumps({"models": [{"name": "X", "input": 1, "cached_input": 0, "output": 1, "as_of": "May"}]})
    )
    with pytest.raises(costs.PriceTableError, match="as_of"):
        costs.load_prices(path)
    path.write_bytes('{"models": [{"name": "café"}]}'.encode("latin-1"))  # saved by an editor as Latin-1
    with pytest.raises(costs.PriceTableError, match="prices.json.*delete it"):
        costs.load_prices(path)


def test_prices_from_form_drops_empty_rows_and_rejects_duplicates() -> None:
    prices = costs.prices_from_form(
        ["A", "", "B"], ["1", "", "2"], ["0.1", "", "0.2"], ["3", "", "4"], ["2025-10-15", "", "2025-10-16"]
    )
    assert [p.name for p in prices] == ["A", "B"]
    with pytest.raises(costs.PriceTableError, match="unique"):
        costs.prices_from_form(["A", "A"], ["1", "1"], ["0", "0"], ["1", "1"], ["2025-10-15", "2025-10-15"])
    # each refusal names the row and the column as the form shows them (it said "could not convert string to
    # float: 'abc'" after a list of every field: walkthrough)
    for typed, said in (
        (
            ["abc", "0", "1"],
            "A: Input needs a price in US dollars per million tokens, such as 3 or 0.3 (it says 'abc')",
        ),
        (
            ["1", "", "1"],
            "A: Cached needs a price in US dollars per million tokens, such as 3 or 0.3 (it is empty)",
        ),
        (["1", "0", "-5"], "A: Output needs a price"),
        (["1", "0", "inf"], "A: Output needs a price"),
    ):
        with pytest.raises(costs.PriceTableError) as refused:
            costs.prices_from_form(["A"], *([t] for t in typed), ["2025-10-15"])
        assert str(refused.value).startswith(said), refused.value
    with pytest.raises(costs.PriceTableError, match="rows of different lengths"):  # a forged post: none kept
        costs.prices_from_form(["A", "B"], ["1"], ["0", "0"], ["1", "1"], ["2025-10-15", "2025-10-15"])
    with pytest.raises(
        costs.PriceTableError, match="A: As of needs the date"
    ):  # the shape of a date is not one
        costs.prices_from_form(["A"], ["1"], ["0"], ["1"], ["2025-13-45"])
    assert costs.PRICE_SOURCES and all(url.startswith("https://") for _, url in costs.PRICE_SOURCES)


def test_format_usd_keeps_small_amounts_visible() -> None:
    assert costs.format_usd(0) == "$0.00"
    assert costs.format_usd(0.0026) == "$0.0026"
    assert costs.format_usd(0.0000425) == "<$0.0001"
    assert costs.format_usd(1234.5) == "$1,234.50"
    # below a dollar, two significant digits: rows that differ read differently (a walkthrough saw $0.01 twice)
    assert [costs.format_usd(x) for x in (0.0146, 0.0136, 0.0095, 0.123, 0.5)] == [
        "$0.015", "$0.014", "$0.0095", "$0.12", "$0.50"
    ]  # fmt: skip
