"""The simulator drives the real scheduler: the paper's laws hold on long runs, the CLI's output
has the documented shape, and bad input is rejected before anything runs."""

from __future__ import annotations

import heapq
import json
import random
import statistics

import pytest

from gyre_core.cli import main
from gyre_core.config import Mode, SchedulerConfig
from gyre_core.scheduler import solve_burst
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.engine import SimParams, Simulation
from gyre_core.simulator.race import PerGroupSeeded, race
from gyre_core.simulator.workload import ExecutionRecord, GroupDraw, synthesize_trace, write_trace


class LognormalWorkload:
    """Hour-long executions with a query effect; no invalid outcomes unless asked."""

    def __init__(self, overall_timeout_rate: float = 0.0) -> None:
        self.rate = overall_timeout_rate

    def draw_group(self, rng: random.Random, n: int) -> GroupDraw:
        q = rng.lognormvariate(0.0, 0.4)
        records = []
        for _ in range(n):
            d = 3600.0 * q * rng.lognormvariate(0.0, 0.3)
            outcome = Outcome.OVERALL_TIMEOUT if rng.random() < self.rate else Outcome.COMPLETED
            records.append(ExecutionRecord("q", d, outcome, tokens=int(d)))
        return GroupDraw("q", tuple(records))


def small_config(mode: str, target: float, **kw) -> SchedulerConfig:
    phi, mu = solve_burst(mode, target)
    base = dict(cells=4, cell_capacity=24, group_size=4, groups_per_step=6, supply_window_s=30.0,
                rho_min=0.25, extra_dispatch=phi, steps_per_burst=mu)
    if mode == "async":
        base["async_training_cells"] = 1
    base.update(kw)
    return SchedulerConfig(mode=Mode(mode), **base)


def run(cfg: SchedulerConfig, steps: int, rate: float = 60.0, workload=None, **params):
    sim = Simulation(cfg, PerGroupSeeded(workload or LognormalWorkload(), 7),
                     SimParams(steps=steps, cell_tokens_per_s=rate, **params))
    return sim.run()


@pytest.mark.parametrize("mode", ["gyre", "async", "colocate"])
@pytest.mark.parametrize("target", [1.0, 1.5])
def test_mean_staleness_follows_the_law(mode: str, target: float) -> None:
    cfg = small_config(mode, target)
    result = run(cfg, steps=240)
    # E[d] = φ + (μ−1)/2 within 0.02 over 240 steps (the start-up bursts are the only bias)
    assert result.mean_staleness == pytest.approx(cfg.expected_staleness, abs=0.02)
    assert result.steps == 240
    assert len(result.staleness) == 240 * cfg.groups_per_step


@pytest.mark.parametrize("mode", ["gyre", "async"])
def test_step_time_agrees_with_littles_law(mode: str) -> None:
    """Appendix analysis with μ = 1 and no rollout saturation (Assumption A.2):
    Q_b·T_b = B·(L + W + T_train + T_gap), i.e. T_b = (L + T_train + T_gap)/(φ + μ − 1 + β)."""
    cfg = small_config(mode, 1.5, cell_capacity=400, steps_per_burst=1, extra_dispatch=1.5)
    result = run(cfg, steps=300)
    starts, ends = result.step_start_s, result.step_end_s
    skip = 30  # drop the start-up transient
    t_b = (ends[-1] - ends[skip]) / (len(ends) - 1 - skip)
    L, offsets, train, gap = [], [], [], []
    for g in result.groups.values():
        if g.step is None or g.step <= skip or g.step >= len(ends) - 1:
            continue
        L.append(g.ready - g.dispatched)
        offsets.append(g.ready - starts[g.step - 1])
        train.append(ends[g.step] - starts[g.step])
        next_publication = min(t for t, _ in result.extra["refills"] if t >= ends[g.step])
        gap.append(next_publication - ends[g.step])
    beta = statistics.fmean(offsets) / t_b
    predicted = (statistics.fmean(L) + statistics.fmean(train) + statistics.fmean(gap)) / (
        cfg.extra_dispatch + cfg.steps_per_burst - 1 + beta
    )
    assert t_b == pytest.approx(predicted, rel=0.01)


def test_every_mode_sees_the_same_groups() -> None:
    wl = LognormalWorkload()
    a = PerGroupSeeded(wl, 3)
    b = PerGroupSeeded(wl, 3)
    draws_a = [a.draw_group(random.Random(1), 4) for _ in range(5)]
    draws_b = [b.draw_group(random.Random(99), 4) for _ in range(5)]
    assert draws_a == draws_b


@pytest.mark.parametrize("mode", ["gyre", "async", "colocate"])
@pytest.mark.parametrize("target", [1.0, 1.5])
def test_staleness_law_holds_under_filtering_and_d_stays_fixed_in_bursts(mode: str, target: float) -> None:
    """Overall timeouts in 10% of executions: every group still counts once (filter rule), so the
    law holds as without them; and no group is dispatched between publications."""
    cfg = small_config(mode, target)
    sim = Simulation(cfg, PerGroupSeeded(LognormalWorkload(overall_timeout_rate=0.10), 7),
                     SimParams(steps=240, cell_tokens_per_s=60.0))
    result = sim.run()
    assert result.mean_staleness == pytest.approx(cfg.expected_staleness, abs=0.02)
    assert len(result.staleness) == 240 * cfg.groups_per_step
    assert result.starvation_dispatches == 0
    # every dispatch happened at Start or at a publication (each leaves a mark with d after it)
    assert result.dispatched == result.extra["refills"][-1][1]


def test_d_never_rises_inside_a_burst_under_filtering() -> None:
    cfg = small_config("gyre", 1.5)
    sim = Simulation(cfg, PerGroupSeeded(LognormalWorkload(overall_timeout_rate=0.3), 7),
                     SimParams(steps=30, cell_tokens_per_s=60.0))
    seen: list[tuple[type, int]] = []
    handle = sim.sched.handle

    def spy(event, now):
        before = sim.sched.d
        out = handle(event, now)
        if sim.sched.d != before:
            seen.append((type(event).__name__, sim.sched.d - before))
        return out

    sim.sched.handle = spy  # type: ignore[method-assign]
    result = sim.run()
    assert result.steps == 30
    assert {kind for kind, _ in seen} == {"Start", "PublicationDone"}


def test_a_trace_of_only_overall_timeouts_ends_with_a_clear_error(tmp_path, capsys) -> None:
    trace = tmp_path / "ot.jsonl"
    write_trace([ExecutionRecord(f"q{i % 5}", 3600.0 + i, Outcome.OVERALL_TIMEOUT, 1000) for i in range(40)], trace)
    rc = main(["simulate", "--preset", "small", "--trace", str(trace), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "overall timeouts" in err and "no group would ever have anything to train" in err
    assert "carry no tokens" not in err


@pytest.mark.parametrize("rule", ["filter", "drop", "top_up"])
def test_a_run_that_cannot_progress_stops_within_a_bounded_number_of_events(rule: str) -> None:
    from gyre_core.scheduler.state_machine import NoProgress

    cfg = small_config("gyre", 1.5, short_group=rule)
    sim = Simulation(cfg, PerGroupSeeded(LognormalWorkload(overall_timeout_rate=1.0), 7),
                     SimParams(steps=48, cell_tokens_per_s=60.0))
    with pytest.raises(NoProgress, match=r"no progress: the last \d+ groups ended with nothing to train") as e:
        sim.run()
    assert "overall timeouts" in str(e.value)
    assert sim.sched.snapshot().dispatched <= (sim.sched.futile_limit + cfg.queue_depth_groups) * cfg.executions_per_group


def test_invalid_executions_never_count_and_the_run_still_finishes() -> None:
    for rule in ("filter", "top_up", "drop"):
        cfg = small_config("gyre", 1.5, short_group=rule)
        result = run(cfg, steps=30, workload=LognormalWorkload(overall_timeout_rate=0.05))
        assert result.steps == 30
        assert result.finished <= result.launched <= result.dispatched


def test_race_reports_every_mode_and_the_best_async_split() -> None:
    base = small_config("gyre", 1.5)
    r = race(base, LognormalWorkload(), SimParams(steps=12, cell_tokens_per_s=60.0), staleness=1.5)
    out = r.to_json()
    assert set(out["modes"]) == {"gyre", "async", "colocate"}
    splits = out["async_splits"]
    assert set(splits) == {"1", "2", "3"}
    best = min(splits, key=lambda k: splits[k])
    assert out["modes"]["async"]["async_training_cells"] == int(best)
    assert out["speedup"]["gyre_vs_async"] == pytest.approx(
        out["modes"]["async"]["end_to_end_s"] / out["modes"]["gyre"]["end_to_end_s"], rel=1e-3)


# ------------------------------------------------------------------------------ the command


def test_simulate_json_and_outputs(tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    rc = main(["simulate", "--preset", "small", "--steps", "6", "--json", "--quiet",
               "--out", str(out_dir)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    for mode in ("gyre", "async", "colocate"):
        m = summary["modes"][mode]
        assert isinstance(m["end_to_end_s"], float) and m["end_to_end_s"] > 0
        assert m["steps"] == 6 and isinstance(m["mu"], int) and isinstance(m["phi"], float)
        assert len(m["cell_training_share"]) == 4
        assert all(0.0 <= s <= 1.0 for s in m["cell_training_share"])
        assert (out_dir / f"timeline_{mode}.svg").read_text().lstrip().startswith("<")
        assert (out_dir / f"training_shares_{mode}.csv").exists()
        first = json.loads((out_dir / f"events_{mode}.jsonl").open().readline())
        assert first["event"] == "Start" and first["t"] == 0
    assert set(summary["speedup"]) == {"gyre_vs_async", "gyre_vs_colocate"}


def test_simulate_from_a_trace_with_auto_burst(tmp_path, capsys) -> None:
    from gyre_core.simulator.workload import PAPER_122B

    trace = tmp_path / "trace.jsonl"
    write_trace(synthesize_trace(PAPER_122B, n_queries=40, n_per_query=4, seed=1), trace)
    rc = main(["simulate", "--preset", "small", "--trace", str(trace), "--steps", "6",
               "--modes", "gyre", "--auto-burst", "--json", "--quiet"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    tried = summary["auto_burst"]
    # every μ allowed at E[d] = 1.5, each with φ on the law
    assert [(t["phi"], t["mu"]) for t in tried] == [(1.5, 1), (1.0, 2), (0.5, 3), (0.0, 4)]
    assert all(t["expected_staleness"] == 1.5 for t in tried)
    chosen = summary["modes"]["gyre"]
    fastest = min(tried, key=lambda t: t["end_to_end_s"])
    assert (chosen["phi"], chosen["mu"]) == (fastest["phi"], fastest["mu"])


def test_auto_burst_with_phi_searches_mu_within_the_target(capsys) -> None:
    rc = main(["simulate", "--preset", "small", "--steps", "6", "--modes", "gyre", "--auto-burst",
               "--phi", "0.5", "--staleness", "1.5", "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    table = out[out.index("burst search"):].splitlines()[2:]
    rows = [line.split()[:3] for line in table if line.strip()]
    assert [(float(p), int(m), float(e)) for p, m, e in rows] == [(0.5, 1, 0.5), (0.5, 2, 1.0), (0.5, 3, 1.5)]
    assert sum("<- chosen" in line for line in table) == 1
    assert main(["simulate", "--preset", "small", "--auto-burst", "--mu", "2", "--quiet"]) == 2


def test_burst_search_prefers_a_shorter_burst_with_more_extra_dispatch_on_hard_queries() -> None:
    """A hard-query class (30% of queries) whose executions stall to a 12 h harness limit together:
    extra dispatch lets bursts go on without those groups, a long burst waits for them, so the
    search leaves Gyre's default μ = 3, φ = 0.5 for a shorter burst with more extra dispatch."""
    import dataclasses

    from gyre_core.simulator.race import calibrate_cell_rate
    from gyre_core.simulator.workload import PAPER_122B, SyntheticWorkload

    wl = SyntheticWorkload(dataclasses.replace(PAPER_122B, hard_query_fraction=0.3,
                                               harness_timeout_h=12.0, overall_budget_h=12.25))
    base = SchedulerConfig(cells=4, cell_capacity=32, group_size=4, groups_per_step=8)
    rate = calibrate_cell_rate(wl, base, 20 * 60)
    r = race(base, wl, SimParams(steps=24, seed=0, cell_tokens_per_s=rate), modes=["gyre"],
             staleness=1.5, auto_burst=True)
    chosen = r.results["gyre"]
    assert chosen.mu < 3 and chosen.phi > 0.5
    by_mu = {t.mu: t.end_to_end_s for t in r.auto_burst}
    assert by_mu[chosen.mu] < 0.9 * by_mu[3]  # the default pair is clearly beaten


@pytest.mark.parametrize("mode", ["gyre", "async", "colocate"])
def test_a_run_shorter_than_a_burst_ends_on_its_last_step_and_publishes_it(mode: str) -> None:
    """run.steps = 2 with μ = 3: the burst ends after step 1 (no step 2 is started) and the
    policy of version 2 is published. Before, the third step of the burst started past the run's
    end, the live run left its loop with nothing published and waited for an evaluation of a
    version that never came."""
    import io

    cfg = small_config(mode, 1.0, steps_per_burst=3)
    log = io.StringIO()
    sim = Simulation(cfg, PerGroupSeeded(LognormalWorkload(), 7), SimParams(steps=2, cell_tokens_per_s=60.0),
                     event_log=log)
    sim.run()
    for _ in range(100_000):  # on past the run's last step: what the scheduler commands next
        if not sim._heap:
            break
        t, _, kind, payload = heapq.heappop(sim._heap)
        sim.now = t
        sim._fire(kind, payload)
        if sim.sched.published_version == 2:
            break
    lines = [json.loads(x) for x in log.getvalue().splitlines()]
    started = [x["step"] for x in lines if x.get("command") == "StartStep"]
    assert started == [0, 1]
    assert sim.sched.steps_done == 2 and sim.sched.published_version == 2
