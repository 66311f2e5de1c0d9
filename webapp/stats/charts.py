"""Server-rendered SVG charts in a classic-Mac look: black 1-bit lines, dithered fills, no JS.

What it knows: how to draw a line chart (one line per series, told apart by dash and marker, not
colour) and a bar chart (bars filled with a dither pattern) as an inline `<svg>` string with a title
and axis labels. Every label is escaped. Inline SVG is allowed by the app's CSP (it is markup, not
an image or a script).

What it does not know: where the numbers come from (`webapp.stats`) or the page around the chart.
"""

from __future__ import annotations

import html
import itertools
import math
import time
from collections.abc import Callable, Sequence

FONT = 'font-family="Geneva, Chicago_12, ChicagoFLF, sans-serif" font-size="10"'
DASHES = ("", "4 2", "1 2", "6 2 1 2")
MARKERS = ("square", "circle", "diamond", "cross")
_ids = itertools.count(1)

Point = tuple[float, float]


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


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


def _frame(width: int, height: int, title: str, body: list[str], chart_id: str) -> str:
    pattern = (f'<pattern id="{chart_id}-dither" width="2" height="2" patternUnits="userSpaceOnUse">'
               '<rect width="1" height="1" fill="#000"/><rect x="1" y="1" width="1" height="1" fill="#000"/></pattern>')  # fmt: skip
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{chart_id}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(title)}" shape-rendering="crispEdges">'
        f"<title>{_esc(title)}</title><defs>{pattern}</defs>"
        f'<rect x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" fill="#fff" stroke="#000"/>'
        f'<text x="{width / 2}" y="13" text-anchor="middle" {FONT} font-weight="bold">{_esc(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def _empty(width: int, height: int, title: str, chart_id: str, message: str) -> str:
    return _frame(width, height, title, [
        f'<text x="{width / 2}" y="{height / 2 + 4}" text-anchor="middle" {FONT} fill="#000">{_esc(message)}</text>'
    ], chart_id)  # fmt: skip


def _y_axis(left: float, top: float, bottom: float, right: float, y_max: float, unit: str) -> list[str]:
    out = [f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#000"/>',
           f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#000"/>']  # fmt: skip
    for i in range(5):
        v = y_max * i / 4
        y = bottom - (bottom - top) * i / 4
        out.append(f'<line x1="{left - 3}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#000"/>')
        if i:
            out.append(
                f'<line x1="{left + 1}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#000" stroke-dasharray="1 3"/>'
            )
        out.append(
            f'<text x="{left - 5}" y="{y + 3:.1f}" text-anchor="end" {FONT}>{_esc(format_number(v))}</text>'
        )
    if unit:
        out.append(f'<text x="{left - 5}" y="{top - 6}" text-anchor="end" {FONT}>{_esc(unit)}</text>')
    return out


def _marker(kind: str, x: float, y: float) -> str:
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="#fff" stroke="#000"/>'
    if kind == "diamond":
        return f'<path d="M{x:.1f} {y - 3:.1f}L{x + 3:.1f} {y:.1f}L{x:.1f} {y + 3:.1f}L{x - 3:.1f} {y:.1f}Z" fill="#000"/>'
    if kind == "cross":
        return f'<path d="M{x - 3:.1f} {y - 3:.1f}L{x + 3:.1f} {y + 3:.1f}M{x - 3:.1f} {y + 3:.1f}L{x + 3:.1f} {y - 3:.1f}" stroke="#000"/>'
    return f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="4" height="4" fill="#000"/>'


def time_label(t: float) -> str:
    return time.strftime("%b %d %H:%M", time.localtime(t))


def line_chart(series: dict[str, Sequence[Point]], title: str, unit: str = "", width: int = 420,
               height: int = 180, x_label: Callable[[float], str] = time_label,
               empty: str = "No replies yet") -> str:  # fmt: skip
    """One line per named series over a shared x axis (time by default)."""
    chart_id = f"chart-{next(_ids)}"
    points = [p for pts in series.values() for p in pts]
    if not points:
        return _empty(width, height, title, chart_id, empty)
    legend_h = 14 if len(series) > 0 else 0
    left, right, top, bottom = 44.0, width - 12.0, 30.0, height - 24.0 - legend_h
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    span = (x1 - x0) or 1.0
    y_max = nice_ceiling(max(p[1] for p in points))

    def sx(x: float) -> float:
        return left + (right - left) * ((x - x0) / span if x1 > x0 else 0.5)

    def sy(y: float) -> float:
        return bottom - (bottom - top) * y / y_max

    body = _y_axis(left, top, bottom, right, y_max, unit)
    body.append(f'<text x="{left}" y="{bottom + 13}" text-anchor="start" {FONT}>{_esc(x_label(x0))}</text>')
    if x1 > x0:
        body.append(
            f'<text x="{right}" y="{bottom + 13}" text-anchor="end" {FONT}>{_esc(x_label(x1))}</text>'
        )
    lx = left
    for i, (name, pts) in enumerate(series.items()):
        dash, marker = DASHES[i % len(DASHES)], MARKERS[i % len(MARKERS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        body.append(f'<g class="series" data-series="{_esc(name)}">'
                    f'<polyline points="{coords}" fill="none" stroke="#000" stroke-width="1.5"{dash_attr} shape-rendering="auto"/>'
                    + "".join(_marker(marker, sx(x), sy(y)) for x, y in pts[-60:]) + "</g>")  # fmt: skip
        ly = height - 9
        body.append(f'<line x1="{lx}" y1="{ly - 3}" x2="{lx + 18}" y2="{ly - 3}" stroke="#000" stroke-width="1.5"{dash_attr}/>'
                    + _marker(marker, lx + 9, ly - 3)
                    + f'<text x="{lx + 22}" y="{ly}" {FONT}>{_esc(name)}</text>')  # fmt: skip
        lx += 30 + 6 * len(name)
    return _frame(width, height, title, body, chart_id)


def bar_chart(bars: Sequence[tuple[str, float]], title: str, unit: str = "", width: int = 420,
              height: int = 180, empty: str = "No replies yet") -> str:  # fmt: skip
    """One dithered bar per (label, value), value printed above it."""
    chart_id = f"chart-{next(_ids)}"
    if not bars:
        return _empty(width, height, title, chart_id, empty)
    left, right, top, bottom = 44.0, width - 12.0, 30.0, height - 22.0
    y_max = nice_ceiling(max(v for _, v in bars))
    body = _y_axis(left, top, bottom, right, y_max, unit)
    slot = (right - left) / len(bars)
    bar_w = min(48.0, slot * 0.6)
    for i, (label, value) in enumerate(bars):
        cx = left + slot * (i + 0.5)
        h = (bottom - top) * value / y_max
        body.append(
            f'<g class="bar" data-label="{_esc(label)}" data-value="{value:.4g}">'
            f'<rect x="{cx - bar_w / 2:.1f}" y="{bottom - h:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
            f'fill="url(#{chart_id}-dither)" stroke="#000"/>'
            f'<text x="{cx:.1f}" y="{bottom - h - 3:.1f}" text-anchor="middle" {FONT}>{_esc(format_number(value))}</text>'
            f'<text x="{cx:.1f}" y="{bottom + 13}" text-anchor="middle" {FONT}>{_esc(label[:24])}</text></g>'
        )
    return _frame(width, height, title, body, chart_id)
