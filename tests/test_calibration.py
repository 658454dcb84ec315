"""``simulate --calibrate-from RUN_DIR``: the simulator fed what a live run measured.

The run folders here are written by the test in the live run's formats (the journal's config
record, ``summary.json``, ``events.jsonl``); the e2e replay test reads a real one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.cli import main
from gyre_core.config import ConfigError
from gyre_core.orchestrator.replay_plan import ReplayPlan
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.calibration import calibrate_from_run, fit_training_time
from gyre_core.simulator.workload import ExecutionRecord, write_trace

SCHED = {"mode": "gyre", "cells": 2, "cell_capacity": 4, "standalone_capacity": 0, "group_size": 2,
         "groups_per_step": 2, "steps_per_burst": 1, "extra_dispatch": 1.0, "rho_min": 0.5,
         "supply_window_s": 1.0, "oversample": None, "async_training_cells": 1, "streaming": None,
         "short_group": "filter", "min_valid_rewards": None}


def _run_dir(tmp: Path, harness: dict | None = None, status: str = "ok") -> Path:
    """A finished live run's folder: 6 groups of 2 executions, 3 steps, measured costs."""
    run = tmp / "run"
    run.mkdir()
    cfg = {"scheduler": SCHED, "run": {"steps": 3, "seed": 4}, "harness": harness or {"kind": "number-guess"}}
    (run / "journal.jsonl").write_text(json.dumps({"kind": "config", "config": cfg}) + "\n")
    events = []
    for g in range(6):
        ids = [2 * g, 2 * g + 1]
        events.append({"t": 0.0, "command": "DispatchGroup", "group_id": g, "execution_ids": ids, "version": 0})
        for i, eid in enumerate(ids):
            events.append({"t": 1.0 * g, "command": "Launch", "execution_id": eid, "group_id": g, "engine": 0})
            events.append({"t": 1.0 * g + 5.0 + i, "event": "ExecutionEnded", "execution_id": eid,
                           "outcome": "completed" if i == 0 else "harness_timeout"})
    events.append({"t": 30.0, "event": "ExecutionEnded", "execution_id": 99, "outcome": "cancelled"})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    # steps: duration = 0.5 + tokens / (cells * 100)
    steps = [{"step": 0, "cells": [0], "tokens": 400, "executions": 4, "duration_s": 4.5, "ended_s": 12.0},
             {"step": 1, "cells": [0, 1], "tokens": 400, "executions": 4, "duration_s": 2.5, "ended_s": 20.0},
             {"step": 2, "cells": [0, 1], "tokens": 800, "executions": 4, "duration_s": 4.5, "ended_s": 31.0}]
    summary = {"status": status, "mode": "gyre", "steps": 3, "wall_s": 95.0, "mean_staleness": 0.5,
               "step_records": steps,
               "role_switches": [{"transition": "to_training", "total_s": t} for t in (0.2, 0.4, 9.0)]
               + [{"transition": "to_rollout", "total_s": t} for t in (1.0, 3.0)],
               "publications": [{"export_s": 0.1, "load_s": 0.2}, {"export_s": 0.3, "load_s": 0.3},
                                {"export_s": 0.1, "load_s": 0.1}]}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


@settings(max_examples=50, deadline=None)
@given(rate=st.floats(10.0, 1e6), fixed=st.floats(0.0, 30.0),
       pts=st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 8)), min_size=2, max_size=12))
def test_the_training_fit_recovers_rate_and_fixed_cost(rate: float, fixed: float, pts: list) -> None:
    if len({tok / cells for tok, cells in pts}) < 2:
        return  # one abscissa: the fit cannot separate the two
    steps = [(fixed + tok / (cells * rate), tok, cells) for tok, cells in pts]
    got_rate, got_fixed = fit_training_time(steps)
    assert got_rate == pytest.approx(rate, rel=1e-6)
    assert got_fixed == pytest.approx(fixed, rel=1e-6, abs=1e-6)


def test_one_step_gives_a_throughput_with_no_fixed_cost() -> None:
    assert fit_training_time([(4.0, 800, 2)]) == (100.0, 0.0)
    with pytest.raises(ConfigError, match="no step"):
        fit_training_time([(0.0, 0, 1)])


def test_a_run_folder_gives_its_scheduler_its_costs_and_its_groups_in_order(tmp_path: Path) -> None:
    cal = calibrate_from_run(_run_dir(tmp_path))
    assert (cal.config.cells, cal.config.group_size, cal.config.extra_dispatch) == (2, 2, 1.0)
    assert cal.staleness == 1.0  # φ + (μ − 1)/2
    p = cal.params
    assert (p.rollout_to_training_s, p.training_to_rollout_s) == (0.4, 2.0)  # medians
    assert p.publication_s == pytest.approx(0.3)
    assert p.cell_tokens_per_s == pytest.approx(100.0) and p.optimizer_s == pytest.approx(0.5)
    assert (p.steps, p.seed) == (3, 4)
    assert cal.source == "measured executions" and cal.measured["tokens_per_execution"] == 133
    assert cal.live["run_s"] == 31.0
    rng = random.Random(0)
    for g in range(6):  # the simulator's i-th group is the run's group i, launch to end
        draw = cal.workload.draw_indexed(g, rng, 2)
        assert [(r.duration_s, r.outcome) for r in draw.executions] == [(5.0, Outcome.COMPLETED),
                                                                        (6.0, Outcome.HARNESS_TIMEOUT)]
        assert all(r.tokens == 133 for r in draw.executions)
    assert len(cal.workload.draw_indexed(50, rng, 2).executions) == 2  # past the run: drawn from its executions


def test_the_fit_reads_every_token_the_trainer_read_where_the_run_recorded_it(tmp_path: Path) -> None:
    """A replay's contexts cost training as much as its replies: ``row_tokens`` (contexts and
    replies) is what the fit and the simulated executions use; ``tokens`` (sampled) only where a
    run predates it."""
    run = _run_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    for rec in summary["step_records"]:  # 10x the sampled tokens read: same durations, 10x the rate
        rec["row_tokens"] = 10 * rec["tokens"]
    (run / "summary.json").write_text(json.dumps(summary))
    cal = calibrate_from_run(run)
    assert cal.params.cell_tokens_per_s == pytest.approx(1000.0) and cal.params.optimizer_s == pytest.approx(0.5)
    assert cal.measured["tokens_per_execution"] == 1333


def test_a_replay_run_is_simulated_on_the_draws_it_replayed(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    recs = [ExecutionRecord(f"q{q}", 1000.0 * (i + 1) + q, Outcome.COMPLETED) for q in range(5) for i in range(4)]
    write_trace(recs, trace)
    cal = calibrate_from_run(_run_dir(tmp_path, {"kind": "replay", "trace": str(trace), "time_scale": 0.01}))
    assert cal.source == "replay trace"
    plan = ReplayPlan.from_config(str(trace), 0.01, 4)
    for g in range(8):
        draw = cal.workload.draw_indexed(g, random.Random(1), 2)
        assert [r.duration_s for r in draw.executions] == [plan.record(g, i, 2).duration_s for i in range(2)]


def test_the_cli_prints_the_live_time_beside_the_prediction(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _run_dir(tmp_path)
    assert main(["simulate", "--calibrate-from", str(run), "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"gyre", "async", "colocate"}
    assert out["modes"]["gyre"]["steps"] == 3
    c = out["calibration"]
    assert c["live"]["run_s"] == 31.0
    assert c["gap"] == pytest.approx(c["predicted_s"] / 31.0 - 1.0, abs=1e-3)
    assert {"gyre_vs_async", "gyre_vs_colocate"} <= set(out["speedup"])


@pytest.mark.parametrize("extra, said", [
    (["--trace", "x.jsonl"], "--trace: measured by the live run"),
    (["--train-minutes", "3"], "--train-minutes"),
    (["--preset", "small"], "--preset"),
])
def test_the_cli_refuses_what_the_run_measured(tmp_path: Path, capsys: pytest.CaptureFixture, extra: list,
                                               said: str) -> None:
    assert main(["simulate", "--calibrate-from", str(_run_dir(tmp_path)), *extra]) == 2
    assert said in capsys.readouterr().err


def test_a_missing_or_failed_run_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--calibrate-from", str(tmp_path / "nowhere")]) == 2
    assert "cannot read the run's config record" in capsys.readouterr().err
    assert main(["simulate", "--calibrate-from", str(_run_dir(tmp_path, status="failed"))]) == 2
    assert "did not finish" in capsys.readouterr().err
