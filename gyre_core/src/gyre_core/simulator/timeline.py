"""The per-cell role timeline (the paper's Figure 6a) as a standalone SVG.

Hand-written SVG rather than matplotlib: the core must not depend on a plotting stack, and the
picture is a handful of rectangles. One row per cell (cell 0 is the core cell, the others are
satellites), one colour per role, and optionally a band of training steps above the rows and a
dashed line per weight publication. The time axis is in seconds, minutes or hours, whichever fits
the run (:func:`time_unit`): a two-minute CPU run and a two-day cluster run both read naturally.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence
from xml.sax.saxutils import escape, quoteattr

ROLE_COLOURS: dict[str, str] = {
    "rollout": "#4e79a7",  # blue
    "to_training": "#edc948",  # yellow: switching rollout → training
    "training": "#e15759",  # red
    "to_rollout": "#59a14f",  # green: switching training → rollout
}
"""The four roles a cell can be in; the two ``to_*`` roles are switching phases."""

_SWITCHING = ("to_training", "to_rollout")

Interval = tuple[int, str, float, float]
"""(cell index, role, start_s, end_s)."""


def cell_label(cell: int) -> str:
    """Row label: cell 0 is the core cell, the others are satellites 1..K-1."""
    return "core" if cell == 0 else f"sat {cell}"


def _check(intervals: Sequence[Interval], n_cells: int, end_s: float) -> None:
    """Reject what would silently draw or count wrong (a bad cell index wraps around in Python)."""
    if isinstance(n_cells, bool) or not isinstance(n_cells, int) or n_cells < 1:
        raise ValueError(f"n_cells: must be an integer ≥ 1, got {n_cells!r}")
    if not (math.isfinite(end_s) and end_s >= 0):
        raise ValueError(f"end_s: must be a finite number ≥ 0, got {end_s!r}")
    for i, (cell, role, start, end) in enumerate(intervals):
        if isinstance(cell, bool) or not isinstance(cell, int) or not 0 <= cell < n_cells:
            raise ValueError(f"intervals[{i}]: cell must be in 0..{n_cells - 1}, got {cell!r}")
        if role not in ROLE_COLOURS:
            raise ValueError(f"intervals[{i}]: role must be one of {', '.join(ROLE_COLOURS)}, got {role!r}")
        if not (math.isfinite(start) and math.isfinite(end) and end >= start):
            raise ValueError(f"intervals[{i}]: need finite start_s ≤ end_s, got {start!r}, {end!r}")


def training_shares(intervals: Sequence[Interval], n_cells: int, end_s: float) -> list[float]:
    """Fraction of [0, end_s] each cell spent in the ``training`` role.

    Intervals are clipped to [0, end_s] and overlapping ones counted once, so a share is always
    in [0, 1]. With ``end_s == 0`` there is no time to share and every cell gets 0.
    """
    _check(intervals, n_cells, end_s)
    if end_s == 0:
        return [0.0] * n_cells
    per_cell: list[list[tuple[float, float]]] = [[] for _ in range(n_cells)]
    for cell, role, start, end in intervals:
        lo, hi = max(start, 0.0), min(end, end_s)
        if role == "training" and hi > lo:
            per_cell[cell].append((lo, hi))
    shares: list[float] = []
    for spans in per_cell:
        total, covered_to = 0.0, -math.inf
        for lo, hi in sorted(spans):  # sweep: add only the part not covered yet (the union)
            if hi > covered_to:
                total += hi - max(lo, covered_to)
                covered_to = hi
        shares.append(min(total / end_s, 1.0))
    return shares


def time_unit(span_s: float) -> tuple[str, float]:
    """The axis unit for a run of ``span_s`` seconds: (label, seconds per unit)."""
    if span_s < 300:
        return "s", 1.0
    if span_s < 2 * 3600:
        return "min", 60.0
    return "h", 3600.0


def _tick_step_h(span_h: float, max_ticks: int = 12) -> float:
    """A 1-2-2.5-5 × 10^k step giving at most ``max_ticks`` intervals over the span."""
    raw = span_h / max_ticks
    base = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if base * m >= raw:
            return base * m
    return base * 10.0  # pragma: no cover


def write_role_timeline_svg(
    path: str | os.PathLike[str],
    intervals: Sequence[Interval],
    n_cells: int,
    end_s: float,
    title: str,
    *,
    steps: Sequence[tuple[int, float, float]] = (),
    publications: Sequence[tuple[int, float]] = (),
    joins: Sequence[tuple[int, int, float]] = (),
) -> None:
    """Write a Gantt-style picture: one row per cell, a time axis with ticks, a legend.

    Switching phases last seconds against hours of rollout and training, so they are drawn on top
    and at least one pixel wide: every switch stays visible as a thin mark. ``steps`` are
    ``(step, start_s, end_s)`` of each training step, drawn as a band above the cells;
    ``publications`` are ``(version, at_s)``, drawn as a dashed line through the rows; ``joins``
    are ``(step, cell, at_s)``, a satellite sent into a step already training, drawn as a marker
    on the cell's row.
    """
    _check(intervals, n_cells, end_s)
    for i, (_, a, b) in enumerate(steps):
        if not (math.isfinite(a) and math.isfinite(b) and b >= a):
            raise ValueError(f"steps[{i}]: need finite start_s ≤ end_s, got {a!r}, {b!r}")
    for i, (_, at) in enumerate(publications):
        if not math.isfinite(at):
            raise ValueError(f"publications[{i}]: need a finite time, got {at!r}")
    for i, (_, cell, at) in enumerate(joins):
        if not (0 <= cell < n_cells and math.isfinite(at)):
            raise ValueError(f"joins[{i}]: need a cell in 0..{n_cells - 1} and a finite time, got {cell!r}, {at!r}")
    band = bool(steps)
    left, right, row_h, gap = 72, 24, 20, 4
    top = 44 + (row_h + gap if band else 0) + (14 if publications else 0)
    plot_w = 860
    width = left + plot_w + right
    rows_h = n_cells * (row_h + gap) - gap
    axis_y = top + rows_h + 6
    legend_y = axis_y + 60
    height = legend_y + 24
    span_s = end_s if end_s > 0 else 1.0
    unit, per = time_unit(span_s)
    span_u = span_s / per

    def x(t: float) -> float:
        return left + plot_w * min(max(t, 0.0), span_s) / span_s

    def row_y(cell: int) -> int:
        return top + cell * (row_h + gap)

    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="24" font-size="15">{escape(title)}</text>',
    ]
    # ticks and vertical grid lines first, so rectangles sit on top of the grid
    step_u = _tick_step_h(span_u)
    n_ticks = int(math.floor(span_u / step_u + 1e-9))
    for i in range(n_ticks + 1):
        tick = i * step_u
        tx = x(tick * per)
        out.append(f'<line x1="{tx:.2f}" y1="{top}" x2="{tx:.2f}" y2="{axis_y}" stroke="#dddddd"/>')
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="black"/>')
        out.append(f'<text x="{tx:.2f}" y="{axis_y + 18}" text-anchor="middle">{round(tick, 9):g}</text>')
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="black"/>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{axis_y + 34}" text-anchor="middle">time ({unit})</text>')

    if band:  # training steps: one box each, above the cells
        by = top - row_h - gap
        out.append(f'<text x="{left - 8}" y="{by + row_h * 0.7:.1f}" text-anchor="end">steps</text>')
        for step, a, b in steps:
            x0, x1 = x(a), x(b)
            tip = f"step {step}: {a / per:.3g}–{b / per:.3g} {unit}"
            out.append(f'<rect x="{x0:.2f}" y="{by}" width="{max(x1 - x0, 1.0):.2f}" height="{row_h}" '
                       f'fill="{"#bab0ac" if step % 2 else "#d7d2cf"}" stroke="#79706e" stroke-width="0.5" '
                       f'data-step="{step}"><title>{escape(tip)}</title></rect>')
            if x1 - x0 >= 14:
                out.append(f'<text x="{(x0 + x1) / 2:.2f}" y="{by + row_h * 0.7:.1f}" text-anchor="middle" '
                           f'font-size="10">{step}</text>')

    for cell in range(n_cells):
        y = row_y(cell)
        out.append(f'<text x="{left - 8}" y="{y + row_h * 0.7:.1f}" text-anchor="end">{cell_label(cell)}</text>')

    # long roles first, switching phases on top
    ordered = sorted(intervals, key=lambda iv: iv[1] in _SWITCHING)
    for cell, role, start, end in ordered:
        lo, hi = max(start, 0.0), min(end, span_s)
        if hi < lo or (hi == lo and role not in _SWITCHING):  # outside the window, or empty
            continue
        x0, x1 = x(lo), x(hi)
        w = max(x1 - x0, 1.0 if role in _SWITCHING else 0.2)
        tip = f"{cell_label(cell)}: {role} {start / per:.4g}–{end / per:.4g} {unit}"
        out.append(
            f'<rect x="{x0:.2f}" y="{row_y(cell)}" width="{w:.2f}" height="{row_h}" '
            f'fill="{ROLE_COLOURS[role]}"><title>{escape(tip)}</title></rect>'
        )

    for version, at in publications:  # each publication: a dashed line through every row
        px = x(at)
        out.append(f'<line x1="{px:.2f}" y1="{top - (row_h + gap if band else 0) - 4}" x2="{px:.2f}" y2="{axis_y}" '
                   f'stroke="#b07aa1" stroke-dasharray="3,2" data-version="{version}">'
                   f'<title>{escape(f"published v{version} at {at / per:.3g} {unit}")}</title></line>')
        out.append(f'<text x="{px:.2f}" y="{top - (row_h + gap if band else 0) - 6}" text-anchor="middle" '
                   f'font-size="9" fill="#b07aa1">v{version}</text>')

    for step, cell, at in joins:  # a satellite joining a running step: a marker at its row's top
        jx, jy = x(at), row_y(cell)
        out.append(f'<path d="M {jx - 5:.2f} {jy - 7} L {jx + 5:.2f} {jy - 7} L {jx:.2f} {jy + 2} Z" '
                   f'fill="#e15759" stroke="#333333" stroke-width="0.5" data-join-step="{step}" data-cell="{cell}">'
                   f'<title>{escape(f"{cell_label(cell)} joined running step {step} at {at / per:.3g} {unit}")}'
                   f'</title></path>')

    lx = left
    for role, colour in ROLE_COLOURS.items():
        label = {"to_training": "switch → training", "to_rollout": "switch → rollout"}.get(role, role)
        out.append(f'<rect x="{lx}" y="{legend_y - 10}" width="12" height="12" fill="{colour}" '
                   f'stroke="#333333" stroke-width="0.5"/>')
        out.append(f'<text x="{lx + 17}" y="{legend_y}" data-role={quoteattr(role)}>{escape(label)}</text>')
        lx += 150
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")
