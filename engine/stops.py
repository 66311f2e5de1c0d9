"""Stop strings over a token stream: hold back only the text that could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence


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
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
