"""Stop strings over a token stream: hold back only the text that could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_CHARS = 256  # a stop string's length at most: every token is checked against each one's prefixes


class StopFilter:
    """Feed text pieces; get back what is safe to show, and whether a stop string was hit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if not self.stops:
            return piece
        text = self._pending + piece
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = max((self._held(text, s) for s in self.stops), default=0)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    @staticmethod
    def _held(text: str, stop: str) -> int:
        """The longest end of `text` that begins `stop` (so may still become it), 0 if none: tried from the
        longest down, and only where `stop` holds the text's last character."""
        last = text[-1:]
        k = min(len(stop) - 1, len(text))
        while k > 0:
            k = stop.rfind(last, 0, k) + 1  # the longest prefix no longer than k that ends with `last`
            if k and text.endswith(stop[:k]):
                return k
            k -= 1
        return 0

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
