"""The role-timeline picture is valid SVG with one labelled row per cell; training shares match a
hand computation and stay in [0, 1] whatever the intervals."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre_core.simulator.timeline import ROLE_COLOURS, training_shares, write_role_timeline_svg

SVG = "{http://www.w3.org/2000/svg}"

INTERVALS = [
    (0, "rollout", 0.0, 3600.0),
    (0, "to_training", 3600.0, 3610.0),
    (0, "training", 3610.0, 7200.0),
    (1, "rollout", 0.0, 5400.0),
    (1, "to_training", 5400.0, 5408.52),
    (1, "training", 5408.52, 9000.0),  # runs past end_s: clipped
    (2, "rollout", 0.0, 1800.0),
    (2, "training", 1800.0, 2700.0),
    (2, "to_rollout", 2700.0, 2703.46),
    (2, "rollout", 2703.46, 7200.0),
]


def test_training_shares_match_a_hand_computation() -> None:
    shares = training_shares(INTERVALS, 4, 7200.0)
    assert shares == pytest.approx([3590 / 7200, (7200 - 5408.52) / 7200, 900 / 7200, 0.0])


def test_training_shares_count_overlaps_once_and_clip_to_the_window() -> None:
    intervals = [(0, "training", -100.0, 100.0), (0, "training", 50.0, 150.0), (0, "training", 900.0, 2000.0)]
    assert training_shares(intervals, 1, 1000.0) == pytest.approx([(150 + 100) / 1000])
    assert training_shares(intervals, 1, 0.0) == [0.0]


@pytest.mark.parametrize(
    "interval,needle",
    [((3, "training", 0.0, 1.0), "cell"), ((-1, "training", 0.0, 1.0), "cell"),
     ((0, "idle", 0.0, 1.0), "role"), ((0, "training", 5.0, 1.0), "start_s")],
)
def test_bad_intervals_are_rejected(interval, needle: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=needle):
        training_shares([interval], 3, 10.0)
    with pytest.raises(ValueError, match=needle):
        write_role_timeline_svg(tmp_path / "t.svg", [interval], 3, 10.0, "t")


interval_st = st.tuples(
    st.integers(0, 2), st.sampled_from(sorted(ROLE_COLOURS)),
    st.floats(-1e4, 1e5), st.floats(0.0, 1e5),
).map(lambda t: (t[0], t[1], t[2], t[2] + t[3]))


@given(intervals=st.lists(interval_st, max_size=20), end_s=st.floats(0.0, 1e5))
def test_training_shares_are_fractions(intervals, end_s: float) -> None:
    shares = training_shares(intervals, 3, end_s)
    assert len(shares) == 3 and all(0.0 <= s <= 1.0 + 1e-12 for s in shares)


def test_svg_parses_and_labels_every_cell(tmp_path) -> None:
    path = tmp_path / "t.svg"
    write_role_timeline_svg(path, INTERVALS, n_cells=4, end_s=7200.0, title="gyre <test> & co")
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    for label in ("core", "sat 1", "sat 2", "sat 3"):
        assert texts.count(label) == 1
    assert "sat 4" not in texts
    assert "gyre <test> & co" in texts
    # x axis in hours: numeric ticks from 0 to 2 h, increasing, and an axis label
    ticks = [float(t) for t in texts if t and t.replace(".", "", 1).isdigit()]
    assert ticks[0] == 0 and ticks == sorted(ticks) and max(ticks) == 2 and len(ticks) >= 3
    assert "time (h)" in texts
    # a legend entry for each of the four roles, in four distinct colours
    legend = {t.get("data-role") for t in root.iter(f"{SVG}text") if t.get("data-role")}
    assert legend == set(ROLE_COLOURS) and len(set(ROLE_COLOURS.values())) == 4
    # every interval is drawn in its role's colour (the 8.5 s switch too, at least 1 px wide)
    fills = [r.get("fill") for r in root.iter(f"{SVG}rect")]
    for role, colour in ROLE_COLOURS.items():
        n_role = sum(1 for iv in INTERVALS if iv[1] == role)
        assert fills.count(colour) == n_role + 1  # intervals + legend swatch
    switch = [r for r in root.iter(f"{SVG}rect") if r.get("fill") == ROLE_COLOURS["to_rollout"]]
    assert all(float(r.get("width")) >= 1.0 for r in switch)


def test_an_empty_run_still_draws(tmp_path) -> None:
    path = tmp_path / "t.svg"
    write_role_timeline_svg(path, [], n_cells=1, end_s=0.0, title="nothing")
    texts = [t.text for t in ET.parse(path).getroot().iter(f"{SVG}text")]
    assert "core" in texts and "nothing" in texts


@pytest.mark.parametrize("end_s, unit, top_tick", [(120.0, "s", 120), (1800.0, "min", 30), (36000.0, "h", 10)])
def test_the_time_axis_unit_fits_the_runs_length(tmp_path, end_s: float, unit: str, top_tick: float) -> None:
    path = tmp_path / "t.svg"
    write_role_timeline_svg(path, [(0, "rollout", 0.0, end_s)], n_cells=1, end_s=end_s, title="t")
    texts = [t.text for t in ET.parse(path).getroot().iter(f"{SVG}text")]
    assert f"time ({unit})" in texts
    ticks = [float(t) for t in texts if t and t.replace(".", "", 1).isdigit()]
    assert max(ticks) == top_tick


def test_steps_and_publications_are_drawn_where_they_happened(tmp_path) -> None:
    path = tmp_path / "t.svg"
    steps = [(0, 10.0, 30.0), (1, 50.0, 80.0)]
    write_role_timeline_svg(path, [(0, "training", 10.0, 30.0), (1, "rollout", 0.0, 100.0)], n_cells=2,
                            end_s=100.0, title="t", steps=steps, publications=[(1, 32.0), (2, 82.0)])
    root = ET.parse(path).getroot()
    boxes = {int(r.get("data-step")): r for r in root.iter(f"{SVG}rect") if r.get("data-step")}
    assert sorted(boxes) == [0, 1]
    training = next(r for r in root.iter(f"{SVG}rect") if r.get("fill") == ROLE_COLOURS["training"])
    assert boxes[0].get("x") == training.get("x") and boxes[0].get("width") == training.get("width")
    lines = {int(ln.get("data-version")): float(ln.get("x1")) for ln in root.iter(f"{SVG}line") if ln.get("data-version")}
    assert sorted(lines) == [1, 2] and lines[1] < float(boxes[1].get("x")) < lines[2]
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "steps" in texts and "v1" in texts and "v2" in texts
    with pytest.raises(ValueError, match="steps"):
        write_role_timeline_svg(path, [], n_cells=1, end_s=1.0, title="t", steps=[(0, 2.0, 1.0)])


def test_a_satellite_joining_a_running_step_is_marked_on_its_row_at_the_join_time(tmp_path) -> None:
    path = tmp_path / "t.svg"
    intervals = [(0, "training", 10.0, 40.0), (1, "rollout", 0.0, 20.0), (1, "to_training", 20.0, 21.0),
                 (1, "training", 21.0, 40.0)]
    write_role_timeline_svg(path, intervals, n_cells=2, end_s=60.0, title="t", steps=[(0, 10.0, 40.0)],
                            joins=[(0, 1, 21.0)])
    root = ET.parse(path).getroot()
    marks = [p for p in root.iter(f"{SVG}path") if p.get("data-join-step")]
    assert len(marks) == 1 and marks[0].get("data-cell") == "1" and marks[0].get("data-join-step") == "0"
    tip = marks[0].find(f"{SVG}title").text
    assert tip == "sat 1 joined running step 0 at 21 s"
    sat_training = next(r for r in root.iter(f"{SVG}rect")
                        if r.get("fill") == ROLE_COLOURS["training"] and "sat 1" in r.find(f"{SVG}title").text)
    apex_x = float(marks[0].get("d").split(" L ")[2].split()[0])  # the marker points at the join time
    assert apex_x == pytest.approx(float(sat_training.get("x")), abs=0.01)
    with pytest.raises(ValueError, match="joins"):
        write_role_timeline_svg(path, intervals, n_cells=2, end_s=60.0, title="t", joins=[(0, 2, 21.0)])
