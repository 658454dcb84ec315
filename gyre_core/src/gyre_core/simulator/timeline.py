"""The per-cell role timeline (the paper's Figure 6a) as a standalone SVG: no plotting dependency."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence
from xml.sax.saxutils import escape

ROLE_COLOURS = {
    "rollout": "#8fb8de",
    "to_training": "#f2a541",
    "training": "#c0392b",
    "to_rollout": "#7f8c8d",
}

Interval = tuple[int, str, float, float]  # (cell, role, start_s, end_s)


def cell_label(cell: int) -> str:
    return "core" if cell == 0 else f"sat {cell}"


def training_shares(intervals: Sequence[Interval], n_cells: int, end_s: float) -> list[float]:
    """Fraction of [0, end_s] each cell spent in the ``training`` role."""
    shares = [0.0] * n_cells
    if end_s <= 0:
        return shares
    for cell, role, start, end in intervals:
        if role == "training":
            shares[cell] += (min(end, end_s) - max(start, 0.0)) / end_s
    return shares


def write_role_timeline_svg(
    path: str | Path, intervals: Sequence[Interval], n_cells: int, end_s: float, title: str
) -> None:
    """One row per cell, time in hours on the x axis, a legend of the four roles."""
    left, top, row_h, gap, width = 70, 40, 22, 6, 900
    plot_w = width - left - 20
    height = top + n_cells * (row_h + gap) + 60
    span = end_s if end_s > 0 else 1.0

    def x(t: float) -> float:
        return left + plot_w * min(max(t, 0.0), span) / span

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>',
    ]
    for cell in range(n_cells):
        y = top + cell * (row_h + gap)
        parts.append(f'<text x="{left - 8}" y="{y + row_h * 0.7:.1f}" text-anchor="end">{cell_label(cell)}</text>')
    for cell, role, start, end in intervals:
        if end <= start:
            continue
        y = top + cell * (row_h + gap)
        colour = ROLE_COLOURS.get(role, "#cccccc")
        parts.append(
            f'<rect x="{x(start):.2f}" y="{y}" width="{max(x(end) - x(start), 0.3):.2f}" '
            f'height="{row_h}" fill="{colour}"><title>{escape(cell_label(cell))} {role} '
            f'{start / 3600:.2f}–{end / 3600:.2f} h</title></rect>'
        )
    axis_y = top + n_cells * (row_h + gap) + 4
    parts.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="black"/>')
    hours = span / 3600
    step = next(s for s in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if hours / s <= 12)
    tick = 0.0
    while tick <= hours + 1e-9:
        tx = x(tick * 3600)
        parts.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 4}" stroke="black"/>')
        parts.append(f'<text x="{tx:.2f}" y="{axis_y + 16}" text-anchor="middle">{tick:g}</text>')
        tick += step
    parts.append(f'<text x="{left + plot_w / 2}" y="{axis_y + 32}" text-anchor="middle">hours</text>')
    lx = left
    for role, colour in ROLE_COLOURS.items():
        parts.append(f'<rect x="{lx}" y="{axis_y + 40}" width="12" height="12" fill="{colour}"/>')
        parts.append(f'<text x="{lx + 16}" y="{axis_y + 50}">{role.replace("_", " ")}</text>')
        lx += 130
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts) + "\n", encoding="utf-8")
