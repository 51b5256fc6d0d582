"""`symgrad inspect FILE --html out.html`: one self-contained page about a compiled step.

The page holds, with nothing loaded from elsewhere (no external src or href; the pictures are
inline SVG): the report's summary; the training step's graph (the SVG of Graphviz's `dot` where
it is installed, the DOT text otherwise); the memory plan as a timeline (each temporary of the
arena a bar over the kernels it is live in, at its offset in the arena); the kernel table; the
step memory and compile time; and the profile when one is given (`step.profile()`). Its tables
hold the report's own numbers (symgrad.backends.report.Report): bytes and FLOPs as integers.
"""

from __future__ import annotations

import dataclasses
import re
from html import escape
from pathlib import Path

from ..backends.report import Report, format_bytes

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; font-size: 12px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 2px 8px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f0f0f0; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.graph { overflow: auto; max-height: 80vh; border: 1px solid #ddd; }
details { margin: .5em 0; }
"""

# The timeline's drawing area, in SVG user units.
PLOT_WIDTH, PLOT_HEIGHT, MARGIN_LEFT, MARGIN_BOTTOM = 1100, 420, 70, 40
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")


def _table(headers: list[str], rows: list[list], numeric: set[int] = frozenset(), cls: str = "") -> str:
    """An HTML table; the columns in `numeric` are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "\n".join("<tr>" + "".join(f"<td class=\"n\">{escape(str(v))}</td>" if k in numeric
                                      else f"<td>{escape(str(v))}</td>" for k, v in enumerate(row)) + "</tr>"
                     for row in rows)
    return f"<table class=\"{cls}\"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>"


def memory_timeline_svg(report: Report) -> str:
    """The arena as a picture: x the kernels in run order, y the offset in the arena; each
    temporary a bar from the kernel that writes it to the last that reads it, as tall as its bytes."""
    buffers, kernels = report.buffer_rows, max(len(report.kernel_rows), 1)
    arena = max([report.arena_bytes, *(b["offset"] + b["bytes"] for b in buffers)]) or 1
    sx, sy = PLOT_WIDTH / kernels, PLOT_HEIGHT / arena
    height = PLOT_HEIGHT + MARGIN_BOTTOM + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{MARGIN_LEFT + PLOT_WIDTH + 10}" height="{height}" '
             f'class="timeline" font-family="sans-serif" font-size="11">',
             f'<rect x="{MARGIN_LEFT}" y="0" width="{PLOT_WIDTH}" height="{PLOT_HEIGHT}" fill="#fafafa" '
             f'stroke="#999"/>']
    for k, b in enumerate(buffers):
        x = MARGIN_LEFT + b["first"] * sx
        w = max((b["last"] - b["first"] + 1) * sx, 1.0)
        y = PLOT_HEIGHT - (b["offset"] + b["bytes"]) * sy
        h = max(b["bytes"] * sy, 0.5)
        tip = (f'{b["name"]} ({b["value"]}): {format_bytes(b["bytes"])} at offset {b["offset"]}, '
               f'live from kernel {b["first"]} to {b["last"]}')
        parts.append(f'<rect class="buffer" data-name="{escape(b["name"])}" x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" '
                     f'height="{h:.2f}" fill="{PALETTE[k % len(PALETTE)]}" fill-opacity="0.75" stroke="#333" '
                     f'stroke-width="0.3"><title>{escape(tip)}</title></rect>')
    for k in range(5):  # axis ticks: bytes up, kernels across
        value = arena * k / 4
        y = PLOT_HEIGHT - value * sy
        parts.append(f'<text x="{MARGIN_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(format_bytes(value))}</text>')
        kernel = round((kernels - 1) * k / 4)
        x = MARGIN_LEFT + (kernel + 0.5) * sx
        parts.append(f'<text x="{x:.1f}" y="{PLOT_HEIGHT + 15}" text-anchor="middle">k{kernel}</text>')
    parts.append(f'<text x="{MARGIN_LEFT + PLOT_WIDTH / 2}" y="{PLOT_HEIGHT + 32}" text-anchor="middle">'
                 f'kernels in run order ({kernels}); bars: the arena\'s {len(buffers)} temporaries at their '
                 f'offsets ({escape(format_bytes(report.arena_bytes))} in all)</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def graph_figure(dot_text: str, svg_text: str | None) -> str:
    """The graph: Graphviz's SVG inline (its XML prolog and doctype dropped, nothing linked), or
    the DOT text where `dot` is not installed."""
    if svg_text:
        svg = svg_text[svg_text.index("<svg"):]
        svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
        svg = re.sub(r'\s(?:xlink:)?href="[^"#][^"]*"', "", svg)  # a node's URL attribute: nothing leaves the page
        return f'<div class="graph">{svg}</div>'
    return ("<p>Graphviz's <code>dot</code> is not installed: the graph as DOT text (paste it into any Graphviz "
            f"viewer, or install graphviz for a picture here).</p><details><summary>graph.dot</summary>"
            f"<pre>{escape(dot_text)}</pre></details>")


def _profile_section(profile) -> str:
    """The profile (`step.profile()`'s result): its text, and its kernels as a table when it has rows."""
    out = [f"<pre>{escape(str(profile))}</pre>"]
    rows = list(getattr(profile, "rows", None) or [])
    if rows and dataclasses.is_dataclass(rows[0]):
        fields = [f.name for f in dataclasses.fields(rows[0])]
        numeric = {k for k, f in enumerate(fields) if isinstance(getattr(rows[0], f), (int, float))}
        out.append(_table(fields, [[getattr(r, f) for f in fields] for r in rows], numeric, "profile"))
    return "\n".join(out)


def html_page(title: str, report: Report, dot_text: str, svg_text: str | None = None, profile=None) -> str:
    """The whole page as text."""
    kernel_rows = [[r["index"], r["name"], r["kind"], r["flops"], r["bytes"], r["does"]] for r in report.kernel_rows]
    buffer_rows = [[b["name"], b["value"], b["bytes"], b["offset"], b["first"], b["last"]] for b in report.buffer_rows]
    memory_rows = [[part, n, format_bytes(n)] for part, n in report.step_memory.items()]
    time_rows = [[stage, f"{seconds * 1e3:.1f}"] for stage, seconds in report.compile_times.items()]
    sections = [
        f"<h1>{escape(title)}</h1>",
        "<h2 id=\"summary\">Summary</h2>", f"<pre>{escape(str(report.summary))}</pre>",
        "<h2 id=\"graph\">The training step's graph</h2>", graph_figure(dot_text, svg_text),
        "<h2 id=\"memory\">Memory plan</h2>", memory_timeline_svg(report),
        _table(["part", "bytes", ""], memory_rows, {1}, "step-memory"),
        "<details><summary>the arena's temporaries</summary>",
        _table(["buffer", "value", "bytes", "offset", "first kernel", "last kernel"], buffer_rows, {2, 3, 4, 5},
               "buffers"), "</details>",
        "<h2 id=\"kernels\">Kernels</h2>",
        _table(["#", "kernel", "kind", "FLOPs", "bytes", "what it does"], kernel_rows, {0, 3, 4}, "kernels"),
        "<h2 id=\"compile\">Compile time</h2>", _table(["stage", "ms"], time_rows, {1}, "compile-time"),
    ]
    if profile is not None:
        sections += ["<h2 id=\"profile\">Profile</h2>", _profile_section(profile)]
    sections += ["<h2 id=\"report\">The whole report</h2>",
                 "".join(f"<details><summary>{escape(s.title)}</summary><pre>{escape(str(s))}</pre></details>"
                         for s in report.sections.values())]
    body = "\n".join(sections)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")


def write_html(path: str | Path, title: str, report: Report, dot_text: str, svg_text: str | None = None,
               profile=None) -> Path:
    """Write `html_page(...)` to `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_page(title, report, dot_text, svg_text, profile), encoding="utf-8")
    return path
