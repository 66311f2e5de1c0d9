"""Values typed on the command line, in a form or a websocket frame: an infinite or absurd number is a
clear refusal, never an OverflowError (it was a traceback for `serve --memory-budget inf`, a 500 for
the budget form and /v1's max_tokens, "internal error" in the chat)."""

from __future__ import annotations

import argparse

import pytest

from webapp.api.openai import APIError, parse_sampling
from webapp.chat.protocol import ProtocolError, parse
from webapp.units import parse_budget, parse_size


def test_sizes_in_range_and_refusals() -> None:
    assert parse_size("300MB") == 300_000_000 and parse_size("4GiB") == 4 << 30 and parse_size("1024") == 1024
    assert parse_budget("auto") == "auto"
    for text in ("inf", "1e999MB", "nan", "1e400GB", "-1GB", "lots", "5XB"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_budget(text)
    # a budget no model can run under is refused where it is typed (`1.5` was 1.5 bytes, refused only at load)
    assert parse_budget("1.5GB") == 1_500_000_000 and parse_budget("64MB") == 64_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="under 64 MB.*without a unit is bytes.*1.5GB"):
        parse_budget("1.5")
    for text in ("0", "10MB", "0GB"):
        with pytest.raises(argparse.ArgumentTypeError, match="under 64 MB, which cannot hold the runtime"):
            parse_budget(text)


def test_infinite_max_tokens_is_a_clear_refusal() -> None:
    with pytest.raises(APIError, match="max_tokens must be an integer") as refused:
        parse_sampling({"messages": [], "max_tokens": float("inf")})
    assert refused.value.param == "max_tokens"
    with pytest.raises(ProtocolError, match="max_tokens must be a number"):
        parse('{"type": "send", "text": "hi", "max_tokens": 1e400}')
