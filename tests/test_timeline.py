"""The role-timeline picture is valid SVG with a row per cell; training shares add up."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from gyre_core.simulator.timeline import training_shares, write_role_timeline_svg

INTERVALS = [
    (0, "rollout", 0.0, 3600.0),
    (0, "to_training", 3600.0, 3610.0),
    (0, "training", 3610.0, 7200.0),
    (1, "rollout", 0.0, 5400.0),
    (1, "training", 5400.0, 7200.0),
    (2, "rollout", 0.0, 7200.0),
]


def test_training_shares_match_a_hand_computation() -> None:
    shares = training_shares(INTERVALS, 3, 7200.0)
    assert shares == pytest.approx([3590 / 7200, 0.25, 0.0])


def test_svg_parses_and_labels_every_cell(tmp_path) -> None:
    path = tmp_path / "t.svg"
    write_role_timeline_svg(path, INTERVALS, n_cells=3, end_s=7200.0, title="gyre <test>")
    root = ET.parse(path).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"core", "sat 1", "sat 2"} <= set(texts)
    assert "gyre <test>" in texts
    rects = list(root.iter("{http://www.w3.org/2000/svg}rect"))
    assert len(rects) >= len(INTERVALS) + 4 + 1  # intervals, legend, background
