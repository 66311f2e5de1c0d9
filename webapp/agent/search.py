"""Web search behind a small interface: `SearchProvider.search(query, kind) -> list[SearchResult]`.

Providers: `DDGSProvider` (the `ddgs` package: text and news) for users, run off the event loop in
a thread with a timeout, throttled, and cached for the life of the provider (one per chat
session); `LocalSearchProvider` serves fixed results (tests, offline demos). Failures raise
`SearchUnavailableError` whose message starts "web search is unavailable:" — the agent shows it and
finishes the turn. Results are untrusted text: the agent quotes them to the model as data.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol
from urllib.parse import urlparse

SearchKind = Literal["text", "news"]


class SearchUnavailableError(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(f"web search is unavailable: {detail}")


@dataclass(frozen=True)
class SearchResult:
    title: str
    url: str
    snippet: str
    kind: SearchKind = "text"
    date: str | None = None
    source: str | None = None  # the publisher, for news

    @property
    def site(self) -> str:
        host = urlparse(self.url).hostname or ""
        return host.removeprefix("www.") or self.source or ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "site": self.site}


class SearchProvider(Protocol):
    name: str

    async def search(
        self, query: str, kind: SearchKind = "text", max_results: int = 5
    ) -> list[SearchResult]: ...


def result_from_ddgs(row: Mapping[str, Any], kind: SearchKind) -> SearchResult:
    return SearchResult(
        title=str(row.get("title") or "").strip(),
        url=str(row.get("href") or row.get("url") or "").strip(),
        snippet=str(row.get("body") or row.get("snippet") or "").strip(),
        kind=kind,
        date=row.get("date"),
        source=row.get("source"),
    )


class DDGSProvider:
    """DuckDuckGo & co. through `ddgs`. One instance per session: its cache lives as long as it."""

    name = "ddgs"

    def __init__(self, timeout_s: float = 8.0, min_interval_s: float = 1.5, region: str = "wt-wt") -> None:
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self.region = region
        self._cache: dict[tuple[str, str, int], list[SearchResult]] = {}
        self._lock = asyncio.Lock()
        self._last = 0.0

    async def search(self, query: str, kind: SearchKind = "text", max_results: int = 5) -> list[SearchResult]:
        key = (kind, " ".join(query.split()).lower(), max_results)
        if key in self._cache:
            return self._cache[key]
        async with self._lock:  # throttle: one request at a time, spaced by min_interval_s
            wait = self._last + self.min_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                rows = await asyncio.wait_for(
                    asyncio.to_thread(self._fetch, query, kind, max_results), self.timeout_s
                )
            except TimeoutError:
                raise SearchUnavailableError(f"no answer within {self.timeout_s:.0f} s") from None
            except Exception as exc:  # noqa: BLE001 - network, rate limit, parser: all mean "unavailable"
                raise SearchUnavailableError(_short(exc)) from exc
            finally:
                self._last = time.monotonic()
        results = [r for r in (result_from_ddgs(row, kind) for row in rows) if r.url]
        self._cache[key] = results
        return results

    def _fetch(self, query: str, kind: SearchKind, max_results: int) -> list[dict[str, Any]]:
        from ddgs import DDGS

        ddgs = DDGS(timeout=max(1, int(self.timeout_s)))
        fn = ddgs.news if kind == "news" else ddgs.text
        return list(fn(query, region=self.region, max_results=max_results) or [])


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


class LocalSearchProvider:
    """Fixed results: `results` maps a query (case-insensitive) to its rows, or serves one list for all.

    It records the queries it was asked (`history`) and can simulate being offline."""

    name = "local"

    def __init__(
        self,
        results: Mapping[str, Iterable[SearchResult]] | Iterable[SearchResult] = (),
        unavailable: str | None = None,
    ) -> None:
        if isinstance(results, Mapping):
            self._by_query = {k.lower(): list(v) for k, v in results.items()}
            self._default: list[SearchResult] = []
        else:
            self._by_query = {}
            self._default = list(results)
        self.unavailable = unavailable
        self.history: list[tuple[str, SearchKind]] = []

    async def search(self, query: str, kind: SearchKind = "text", max_results: int = 5) -> list[SearchResult]:
        self.history.append((query, kind))
        if self.unavailable:
            raise SearchUnavailableError(self.unavailable)
        rows = self._by_query.get(query.strip().lower(), self._default)
        return [r for r in rows if r.kind == kind or kind == "text"][:max_results]
