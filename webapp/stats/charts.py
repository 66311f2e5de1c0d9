"""Server-rendered SVG charts in a classic-Mac look: black 1-bit lines, dithered fills, no JS.

What it knows: the geometry of a line chart (one line per series, told apart by dash and marker,
not colour) and of a bar chart (bars filled with a dither pattern): scales, ticks, points and
labels. The SVG itself is drawn by `templates/stats/charts.html`, which escapes every label.

What it does not know: where the numbers come from (`store.py`) or the page around the chart.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..render import make_environment

DASHES = ("", "4 2", "1 2", "6 2 1 2")
MARKERS = ("square", "circle", "diamond", "cross")
LAST_MARKERS = 60  # markers drawn on a series' latest points only
_ids = itertools.count(1)

Point = tuple[float, float]


def nice_ceiling(value: float) -> float:
    """The next 1/2/5 x 10^n at or above `value` (axis maximum)."""
    if value <= 0:
        return 1.0
    exp = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * 10**exp >= value:
            return float(step * 10**exp)
    return float(10 ** (exp + 1))


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.2f}".rstrip("0").rstrip(".")


def time_label(t: float) -> str:
    return time.strftime("%b %d %H:%M", time.localtime(t))


# --------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Tick:
    y: float
    label: str


@dataclass(frozen=True)
class Axis:
    left: float
    top: float
    bottom: float
    right: float
    unit: str
    ticks: tuple[Tick, ...]


@dataclass(frozen=True)
class Series:
    name: str
    points: str  # "x,y x,y ..." for the polyline
    dash: str
    marker: str
    markers: tuple[Point, ...]
    legend_x: float
    legend_y: float


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    value_text: str
    cx: float
    height: float


@dataclass(frozen=True)
class Chart:
    id: str
    width: int
    height: int
    title: str
    empty: str | None = None  # the message drawn instead of a chart
    axis: Axis | None = None
    x_first: str = ""
    x_last: str | None = None
    series: tuple[Series, ...] = ()
    bars: tuple[Bar, ...] = ()
    bar_width: float = 0.0


def _axis(left: float, top: float, bottom: float, right: float, y_max: float, unit: str) -> Axis:
    ticks = tuple(Tick(bottom - (bottom - top) * i / 4, format_number(y_max * i / 4)) for i in range(5))
    return Axis(left, top, bottom, right, unit, ticks)


def line_geometry(
    series: dict[str, Sequence[Point]],
    title: str,
    unit: str = "",
    width: int = 420,
    height: int = 180,
    x_label: Callable[[float], str] = time_label,
    empty: str = "No replies yet",
) -> Chart:
    """One line per named series over a shared x axis (time by default)."""
    chart_id = f"chart-{next(_ids)}"
    points = [p for pts in series.values() for p in pts]
    if not points:
        return Chart(chart_id, width, height, title, empty=empty)
    legend_h = 14 if len(series) > 0 else 0
    left, right, top, bottom = 44.0, width - 12.0, 30.0, height - 24.0 - legend_h
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    span = (x1 - x0) or 1.0
    y_max = nice_ceiling(max(p[1] for p in points))

    def sx(x: float) -> float:
        return left + (right - left) * ((x - x0) / span if x1 > x0 else 0.5)

    def sy(y: float) -> float:
        return bottom - (bottom - top) * y / y_max

    lines, lx = [], left
    for i, (name, pts) in enumerate(series.items()):
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        markers = tuple((sx(x), sy(y)) for x, y in pts[-LAST_MARKERS:])
        marker = MARKERS[i % len(MARKERS)]
        lines.append(Series(name, coords, DASHES[i % len(DASHES)], marker, markers, lx, height - 9))
        lx += 30 + 6 * len(name)
    return Chart(
        chart_id,
        width,
        height,
        title,
        axis=_axis(left, top, bottom, right, y_max, unit),
        x_first=x_label(x0),
        x_last=x_label(x1) if x1 > x0 else None,
        series=tuple(lines),
    )


def bar_geometry(
    bars: Sequence[tuple[str, float]],
    title: str,
    unit: str = "",
    width: int = 420,
    height: int = 180,
    empty: str = "No replies yet",
) -> Chart:
    """One dithered bar per (label, value), value printed above it."""
    chart_id = f"chart-{next(_ids)}"
    if not bars:
        return Chart(chart_id, width, height, title, empty=empty)
    left, right, top, bottom = 44.0, width - 12.0, 30.0, height - 22.0
    y_max = nice_ceiling(max(v for _, v in bars))
    slot = (right - left) / len(bars)
    drawn = tuple(
        Bar(label, value, format_number(value), left + slot * (i + 0.5), (bottom - top) * value / y_max)
        for i, (label, value) in enumerate(bars)
    )
    return Chart(
        chart_id,
        width,
        height,
        title,
        axis=_axis(left, top, bottom, right, y_max, unit),
        bars=drawn,
        bar_width=min(48.0, slot * 0.6),
    )


# --------------------------------------------------------------------------- drawn
@functools.lru_cache(maxsize=1)
def _macros() -> Any:
    return make_environment().get_template("stats/charts.html").module


def line_chart(series: dict[str, Sequence[Point]], title: str, unit: str = "", **kw: Any) -> str:
    """`line_geometry` drawn as an inline `<svg>`."""
    return str(_macros().line_chart(line_geometry(series, title, unit, **kw)))


def bar_chart(bars: Sequence[tuple[str, float]], title: str, unit: str = "", **kw: Any) -> str:
    """`bar_geometry` drawn as an inline `<svg>`."""
    return str(_macros().bar_chart(bar_geometry(bars, title, unit, **kw)))
