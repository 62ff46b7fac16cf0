"""Static HTML building blocks for ``flywheel.html_report``: inline SVG plots whose marks carry
their values in ``data-*`` attributes, tables, figures and the page shell. No scripts, no
fonts or stylesheets from elsewhere: a page opens from the file system as it is.

    plot = Plot(x0=-0.5, x1=2.5, y0=0.0, y1=1.0)
    plot.axes(xticks=[(0, "0 sft"), ...], yticks=value_ticks(1.0, pct), xlabel=..., ylabel=...)
    plot.mark("circle", {"cx": plot.x(0), "cy": plot.y(0.4), "r": 5}, {"success": 0.4}, "tip")
    figure("success", [plot.svg("success per round")], legend(...), "caption", table(...))
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

GENERATOR = "flywheel report --html"  # the <meta> that marks a folder as a report
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
HTML = object()  # a table cell's raw value: the text is markup, not to be escaped

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:16px 24px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table.data{border-collapse:collapse;margin:8px 0;font-variant-numeric:tabular-nums}
table.data td,table.data th{border:1px solid #ddd;padding:3px 8px;text-align:right;white-space:nowrap}
table.data th{background:#f4f4f4}table.data td:first-child{text-align:left}
figure.plot{display:inline-block;vertical-align:top;margin:8px 16px 16px 0;max-width:580px}
figcaption{font-size:13px;color:#444}svg.chart{display:block;background:#fff}
svg .grid{stroke:#eee}svg .axis{stroke:#444}svg text{font-size:11px;fill:#333}
svg .ref-label{font-size:10px}svg .series{fill:none;stroke-width:2}
svg .errorbar{fill:none;stroke-width:1.5}svg .reference{stroke-width:1.5}
ul.legend{list-style:none;padding:0;margin:4px 0;font-size:12px}
ul.legend li{display:inline-block;margin-right:12px}
.key{display:inline-block;width:16px;height:10px;margin-right:4px;vertical-align:middle}
.key.box{background:var(--c)}.key.line{border-top:2px solid var(--c);height:0}
.key.dashed{border-top:2px dashed var(--c);height:0}
details{font-size:12px;margin-top:4px}
pre.report{font-size:12px;background:#f8f8f8;padding:8px;overflow-x:auto}
ol.messages{padding-left:24px}li.msg{margin:6px 0;border-left:4px solid #ccc;padding:2px 8px}
li.msg.trained{border-left-color:#55a868;background:#f3faf4}
li.msg pre{white-space:pre-wrap;margin:2px 0;font-size:13px}
.meta span{margin-right:10px;font-size:12px;color:#555}.meta .role{font-weight:bold;color:#222}
mark.action{background:#fde9c8}
"""


def attrs(values: dict[str, Any]) -> str:
    """`` k="v"`` pairs, escaped; floats as ``repr`` so that a test reads back the exact value."""

    def text(v: Any) -> str:
        return repr(v) if isinstance(v, float) else str(v)

    return "".join(f' {k}="{html.escape(text(v), quote=True)}"' for k, v in values.items())


def pct(p: float) -> str:
    return f"{100 * p:.1f}%"


def rate_axis(top: float) -> tuple[float, list[tuple[float, str]]]:
    """An axis of rates in [0, 1] that covers ``top`` with some headroom, ticks in percent."""
    end, ticks = nice_axis(min(1.0, max(top, 0.05) * 1.05))
    return min(end, 1.0), [(v, f"{100 * v:g}%") for v in ticks if v <= 1.0]


def nice_axis(top: float, n: int = 5, integer: bool = False) -> tuple[float, list[float]]:
    """An axis from 0 that covers ``top`` in at most ``n`` steps of 1, 2, 2.5 or 5 times a
    power of ten (whole steps with ``integer``): (axis maximum, tick values)."""
    top = top if top > 0 else 1.0
    raw = top / n
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, math.ceil(step))
    count = max(1, math.ceil(top / step - 1e-9))
    return round(step * count, 10), [round(step * i, 10) for i in range(count + 1)]


def value_ticks(top: float, fmt: Callable[[float], str], n: int = 4) -> list[tuple[float, str]]:
    return [(top * i / n, fmt(top * i / n)) for i in range(n + 1)]


def slug(text: str) -> str:
    """``text`` as a piece of an id or file name."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "x"


@dataclass
class Bar:
    group: int  # x position of the group
    series: int  # index among the bars of a group
    value: float
    color: str
    data: dict[str, Any]
    tip: str
    se: float | None = None  # an error bar of ± se


@dataclass
class Plot:
    """A plot area: data ranges mapped to pixels, and the SVG elements drawn so far."""

    x0: float
    x1: float
    y0: float
    y1: float
    width: int = 560
    height: int = 280
    left: int = 60
    right: int = 16
    top: int = 14
    bottom: int = 46
    parts: list[str] = field(default_factory=list)
    labels: list[float] = field(default_factory=list)  # y of the reference labels drawn

    def x(self, v: float) -> float:
        span = self.width - self.left - self.right
        return round(self.left + (v - self.x0) / ((self.x1 - self.x0) or 1) * span, 2)

    def y(self, v: float) -> float:
        span = self.height - self.top - self.bottom
        return round(
            self.height - self.bottom - (v - self.y0) / ((self.y1 - self.y0) or 1) * span, 2
        )

    def _text(self, x: float, y: float, text: str, cls: str, anchor: str, extra: str = "") -> None:
        self.parts.append(
            f'<text class="{cls}" x="{x}" y="{y}" text-anchor="{anchor}"{extra}>'
            f"{html.escape(text)}</text>"
        )

    def _line(self, cls: str, x1: float, x2: float, y1: float, y2: float) -> None:
        self.parts.append(f'<line class="{cls}" x1="{x1}" x2="{x2}" y1="{y1}" y2="{y2}"/>')

    def axes(
        self,
        xticks: Sequence[tuple[float, str]],
        yticks: Sequence[tuple[float, str]],
        xlabel: str,
        ylabel: str,
    ) -> None:
        base, right = self.y(self.y0), self.x(self.x1)
        for v, label in yticks:
            self._line("grid", self.left, right, self.y(v), self.y(v))
            self._text(self.left - 6, self.y(v) + 4, label, "tick", "end")
        for v, label in xticks:
            self._text(self.x(v), base + 16, label, "tick", "middle")
        self._line("axis", self.left, right, base, base)
        self._line("axis", self.left, self.left, self.top, base)
        self._text((self.left + right) / 2, self.height - 6, xlabel, "label", "middle")
        mid = (self.top + base) / 2
        self._text(14, mid, ylabel, "label", "middle", f' transform="rotate(-90 14 {mid})"')

    def mark(self, tag: str, geometry: dict[str, Any], data: dict[str, Any], tip: str) -> None:
        """A drawn value: ``class="mark ..."``, its values as ``data-*``, a tooltip."""
        cls = f"mark {geometry.pop('class', '')}".strip()
        values = attrs({"class": cls, **geometry, **{f"data-{k}": v for k, v in data.items()}})
        self.parts.append(f"<{tag}{values}><title>{html.escape(tip)}</title></{tag}>")

    def errorbar(self, x: float, lo: float, hi: float, color: str) -> None:
        a, b, px = self.y(max(lo, self.y0)), self.y(min(hi, self.y1)), self.x(x)
        self.parts.append(
            f'<path class="errorbar" stroke="{color}" '
            f'd="M{px} {a}V{b}M{px - 4} {a}h8M{px - 4} {b}h8"/>'
        )

    def reference(self, y: float, label: str, color: str, dash: str, data: dict[str, Any]) -> None:
        """A horizontal line across the plot, labelled at its right end."""
        py, right = self.y(y), self.x(self.x1)
        at = py + 4
        while any(abs(at - taken) < 11 for taken in self.labels):
            at += 11  # equal or close values: stack the labels instead of overprinting them
        self.labels.append(at)
        geometry = {"class": "reference", "x1": self.left, "x2": right, "y1": py, "y2": py}
        self.mark("line", {**geometry, "stroke": color, "stroke-dasharray": dash}, data, label)
        self.parts.append(
            f'<text class="ref-label" x="{right + 4}" y="{at}" fill="{color}">'
            f"{html.escape(label)}</text>"
        )

    def bars(self, bars: list[Bar], n_series: int) -> None:
        """Grouped bars: group g spans x in [g - 0.4, g + 0.4], one slot per series."""
        width = 0.8 / max(n_series, 1)
        for bar in bars:
            left = bar.group - 0.4 + bar.series * width
            x, y = self.x(left), self.y(bar.value)
            geometry = {
                "class": "bar",
                "x": x,
                "y": y,
                "width": round(self.x(left + width * 0.92) - x, 2),
                "height": round(self.y(self.y0) - y, 2),
                "fill": bar.color,
            }
            self.mark("rect", geometry, bar.data, bar.tip)
            if bar.se is not None:
                mid = left + width * 0.46
                self.errorbar(mid, bar.value - bar.se, bar.value + bar.se, "#333")

    def svg(self, label: str, **data: Any) -> str:
        values = {
            "class": "chart",
            "viewBox": f"0 0 {self.width} {self.height}",
            "width": self.width,
            "height": self.height,
            "role": "img",
            "aria-label": label,
            **{f"data-{k}": v for k, v in data.items()},
        }
        return f"<svg{attrs(values)}>{''.join(self.parts)}</svg>"


def legend(items: list[tuple[str, str, str]]) -> str:
    """``(label, color, style)`` entries; style ``line``, ``dashed`` or ``box``."""
    keys = (
        f'<li><span class="key {style}" style="--c:{color}"></span>{html.escape(label)}</li>'
        for label, color, style in items
    )
    return f'<ul class="legend">{"".join(keys)}</ul>'


def table(
    header: list[str], body: list[list[tuple[Any, Any]]], cls: str = "data", id: str = ""
) -> str:
    """Cells are (text, raw): a number ``raw`` goes into ``data-value``; ``raw is HTML`` means
    the text is markup."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    lines = []
    for row in body:
        cells = []
        for text, raw in row:
            if raw is HTML:
                cells.append(f"<td>{text}</td>")
                continue
            extra = attrs({"data-value": raw}) if isinstance(raw, int | float) else ""
            cells.append(f"<td{extra}>{html.escape(str(text))}</td>")
        lines.append(f"<tr>{''.join(cells)}</tr>")
    at = f' id="{id}"' if id else ""
    return (
        f'<table class="{cls}"{at}><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(lines)}</tbody></table>"
    )


def figure(fig_id: str, svgs: list[str], keys: str, caption: str, values: str) -> str:
    """A plot (one or more SVGs), its legend and caption, and the table of its values."""
    return (
        f'<figure class="plot" id="{fig_id}">{"".join(svgs)}{keys}'
        f"<figcaption>{caption}</figcaption>"
        f"<details><summary>values</summary>{values}</details></figure>"
    )


def page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="generator" content="{GENERATOR}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>"
        f"<body>{body}</body></html>\n"
    )
