"""Stop strings over a token stream (`engine.stops.StopFilter`): what is held back is exactly the end of the
text that may still become a stop string, and a long stop string costs little per token."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.stops import StopFilter

TEXT = st.text(alphabet="ab\n", max_size=12)


def held_by_definition(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@given(st.lists(st.text(alphabet="ab\n", min_size=1, max_size=8), min_size=1, max_size=4), st.lists(TEXT))
def test_what_is_shown_and_held_matches_the_definition(stops: list[str], pieces: list[str]) -> None:
    f = StopFilter(stops)
    shown, text = "", ""
    for piece in pieces:
        text += piece
        shown += f.feed(piece)
        if f.stopped:
            cut = min(i for s in stops if (i := text.find(s)) >= 0)
            assert shown == text[:cut]
            return
        assert shown + f._pending == text and len(f._pending) == held_by_definition(text, stops)
    assert shown + f.flush() == text


def test_a_long_stop_string_is_cheap_per_token() -> None:
    """Four stop strings of 300,000 characters each (the API now refuses them past 256): the old filter built
    every prefix for every token, minutes per token; this finds the held part from the text's last character."""
    f = StopFilter(["\x01" + "z" * 300_000] * 4)
    for _ in range(50):
        assert f.feed("z") == "z"
