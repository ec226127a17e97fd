"""The docs' charts: a ```` ```chart ```` block on a page holds the measured points (YAML, the one place they are
written) and becomes a line chart drawn at build time with matplotlib, an SVG in the page, so it shows offline (a
mermaid chart needs mermaid.js from a CDN) and follows the theme's colours (light and dark schemes).

A block::

    title: tiny-guess-digit: training reward (2026-11-25, CPU box)
    x: {label: step, values: [10, 30, 70, 100]}
    y: {label: train/reward, min: 0.7, max: 1.0, values: [0.77, 0.905, 0.98, 0.98]}
"""

from __future__ import annotations

import io
import re
from html import escape
from typing import Any

import yaml

# matplotlib draws in these stand-in colours; the SVG then takes the theme's (CSS custom properties of Material).
THEME = {"#010101": "var(--md-default-fg-color--light, #0000008a)",
         "#020202": "var(--md-typeset-a-color, #4051b5)",  # the links' colour: lighter in the dark scheme
         "#030303": "var(--md-default-fg-color--lightest, #00000012)"}
FIELDS = "title, x: {label, values}, y: {label, values, and optionally min, max}"


def parse_chart(text: str) -> dict[str, Any]:
    """A chart block's fields, checked: a bad block names what is wrong and fails the (strict) build."""
    try:
        chart = yaml.safe_load(text)
        x, y = chart["x"], chart["y"]
        ok = (isinstance(chart["title"], str) and len(x["values"]) == len(y["values"]) > 1
              and all(isinstance(v, (int, float)) for v in [*x["values"], *y["values"]]))
    except (yaml.YAMLError, KeyError, TypeError) as err:
        raise ValueError(f"chart block: {err}; its fields are {FIELDS}") from None
    if not ok:
        raise ValueError(f"chart block {chart.get('title')!r}: x and y need as many numbers, two or more ({FIELDS})")
    return chart


def chart_svg(chart: dict[str, Any]) -> str:
    """The chart as an SVG element (no XML header), its text real text in the page's font, its colours the theme's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = chart["x"], chart["y"]
    style = {"svg.fonttype": "none", "svg.hashsalt": chart["title"], "font.size": 11, "text.color": "#010101",
             "axes.labelcolor": "#010101", "axes.edgecolor": "#010101", "xtick.color": "#010101",
             "ytick.color": "#010101", "grid.color": "#030303", "grid.alpha": 1.0}
    with plt.rc_context(style):
        fig, ax = plt.subplots(figsize=(7.2, 3.0))
        try:
            ax.plot(x["values"], y["values"], color="#020202", linewidth=2, marker="o", markersize=6)
            for xv, yv in zip(x["values"], y["values"]):
                ax.annotate(f"{yv:g}", (xv, yv), textcoords="offset points", xytext=(0, 8), ha="center",
                            fontsize=10)
            ax.set_xlabel(x["label"])
            ax.set_ylabel(y["label"])
            ax.set_ylim(y.get("min"), y.get("max"))
            ax.set_xticks(x["values"])
            ax.grid(True, linewidth=0.8)
            ax.spines[["top", "right"]].set_visible(False)
            fig.tight_layout()
            out = io.StringIO()
            fig.savefig(out, format="svg", transparent=True, metadata={"Date": None, "Creator": None})
        finally:
            plt.close(fig)
    svg = re.sub(r"<metadata>.*?</metadata>", "", out.getvalue()[out.getvalue().index("<svg"):], flags=re.S)
    for stand_in, theme in THEME.items():
        svg = svg.replace(stand_in, theme)
    # the page's font (matplotlib laid the text out for DejaVu Sans, about as wide); its own rules kept to the chart
    svg = re.sub(r"font-family: [^;\"]*", "font-family: var(--md-text-font-family, sans-serif)", svg)
    svg = svg.replace("*{stroke-linejoin", ".grpo-chart *{stroke-linejoin")
    # as wide as the page allows, up to its drawn size
    width = re.search(r'<svg [^>]*?width="([\d.]+)pt"', svg).group(1)
    svg = re.sub(r'<svg ([^>]*?)width="[\d.]+pt" height="[\d.]+pt"',
                 rf'<svg class="grpo-chart" role="img" \1style="max-width:{float(width) * 4 / 3:.0f}px"', svg, count=1)
    points = ", ".join(f"{x['label']} {xv}: {yv}" for xv, yv in zip(x["values"], y["values"]))
    head_end = svg.index(">") + 1
    return f"{svg[:head_end]}<title>{escape(chart['title'])}: {escape(points)}</title>{svg[head_end:]}"

def chart_figure(text: str) -> str:
    """A chart block's HTML: the chart and its title as the caption."""
    chart = parse_chart(text)
    return f'<figure class="grpo-figure">{chart_svg(chart)}<figcaption>{escape(chart["title"])}</figcaption></figure>'
