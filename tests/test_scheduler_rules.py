"""Scenario tests: each rule of docs/design.md ("The scheduler's rules") on a small hand-checked situation."""

from __future__ import annotations

import pytest

from gyre_core.config import ConfigError, Mode, SchedulerConfig, ShortGroupRule
from gyre_core.scheduler import CellState, Scheduler, SchedulerError, solve_burst
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import STANDALONE, Outcome, Role


def of(out, kind):
    return [c for c in out if isinstance(c, kind)]


def finish_group(s: Scheduler, gid_execs: list[int], now: float) -> list:
    out = []
    for eid in gid_execs:
        out += s.handle(ev.ExecutionEnded(eid, Outcome.COMPLETED), now)
        out += s.handle(ev.EvaluationValid(eid), now)
    return out


def test_boundary_dispatch_fills_the_queue_and_launches_up_to_capacity() -> None:
    cfg = SchedulerConfig(cells=3, cell_capacity=4, standalone_capacity=2, group_size=2,
                          groups_per_step=2, steps_per_burst=3, extra_dispatch=0.5)
    s = Scheduler(cfg)
    out = s.handle(ev.Start(), 0.0)
    # Q_b = (0.5 + 3) * 2 = 7 groups of N = 2
    assert len(of(out, ev.DispatchGroup)) == 7 and s.d == 14
    launches = of(out, ev.Launch)
    assert len(launches) == 14 == cfg.capacity(0)
    # C(0) = 3*4 + 2 = 14: everything fits; standalone first, then cells by descending index
    engines = [l.engine for l in launches]
    assert engines == [STANDALONE] * 2 + [2] * 4 + [1] * 4 + [0] * 4


def test_launches_never_exceed_capacity_and_resume_when_slots_free() -> None:
    cfg = SchedulerConfig(cells=2, cell_capacity=2, group_size=2, groups_per_step=2,
                          steps_per_burst=1, extra_dispatch=1.0)
    s = Scheduler(cfg)
    out = s.handle(ev.Start(), 0.0)
    assert s.d == 8 and s.p == 4 and len(of(out, ev.Launch)) == 4
    out = s.handle(ev.ExecutionEnded(0, Outcome.COMPLETED), 1.0)
    assert [l.execution_id for l in of(out, ev.Launch)] == [4]
    assert s.snapshot().running == 4


def test_core_joins_only_when_waterlevel_fits_and_supply_held_for_tau() -> None:
    # K=2, C_e=4: the core may enter when w <= (2-0-1)*4 = 4, after supply >= rho*B held tau s
    cfg = SchedulerConfig(cells=2, cell_capacity=4, group_size=2, groups_per_step=2,
                          steps_per_burst=1, extra_dispatch=1.0, rho_min=0.5, supply_window_s=10.0)
    s = Scheduler(cfg)
    s.handle(ev.Start(), 0.0)  # 4 groups (8 executions), all launched
    out = finish_group(s, [0, 1], 1.0)  # group 0 ready: supply 1 >= 0.5*2, but w = 6 > 4
    assert not of(out, ev.CellToTraining)
    out = finish_group(s, [2, 3], 2.0)  # w = 4 now; supply timer runs since t=1
    assert not of(out, ev.CellToTraining)
    assert s.next_wakeup() == pytest.approx(11.0)
    out = s.handle(ev.Tick(), 11.0)
    to_training = of(out, ev.CellToTraining)
    assert [c.cell for c in to_training] == [0]
    # the core's executions were rerouted to cell 1 before it switched
    reroutes = of(out, ev.Reroute)
    assert all(r.source == 0 and r.destination == 1 for r in reroutes)
    assert out.index(reroutes[-1]) < out.index(to_training[0]) if reroutes else True
    assert s.snapshot().cell_states == (CellState.TO_TRAINING, CellState.ROLLOUT)


def test_supply_timer_resets_when_supply_drops() -> None:
    cfg = SchedulerConfig(cells=2, cell_capacity=8, group_size=1, groups_per_step=2,
                          steps_per_burst=1, extra_dispatch=0.0, rho_min=1.0, supply_window_s=10.0)
    s = Scheduler(cfg)
    s.handle(ev.Start(), 0.0)
    s.handle(ev.ExecutionEnded(0, Outcome.COMPLETED), 0.0)
    s.handle(ev.EvaluationValid(0), 0.0)
    assert s.next_wakeup() is None  # 1 ready < rho*B = 2
    s.handle(ev.ExecutionEnded(1, Outcome.COMPLETED), 5.0)
    s.handle(ev.EvaluationValid(1), 5.0)
    assert s.next_wakeup() == pytest.approx(15.0)


def _run_to_first_step(cfg: SchedulerConfig) -> tuple[Scheduler, list]:
    s = Scheduler(cfg)
    out = s.handle(ev.Start(), 0.0)
    eids = [e for d in of(out, ev.DispatchGroup) for e in d.execution_ids]
    out = []
    for e in eids:
        out += s.handle(ev.ExecutionEnded(e, Outcome.COMPLETED), 1.0)
        out += s.handle(ev.EvaluationValid(e), 1.0)
    return s, out


def test_gyre_cells_enter_as_a_growing_prefix_and_satellites_join_the_running_step() -> None:
    cfg = SchedulerConfig(cells=3, cell_capacity=4, group_size=1, groups_per_step=2,
                          steps_per_burst=2, extra_dispatch=0.0, rho_min=0.5, supply_window_s=0.0)
    s, out = _run_to_first_step(cfg)
    assert [c.cell for c in of(out, ev.CellToTraining)] == [0]  # serial: one at a time
    out = s.handle(ev.TransitionDone(0, Role.TRAINING), 2.0)
    start = of(out, ev.StartStep)
    assert start and start[0].cells == (0,)
    assigned = of(out, ev.AssignGroup)
    assert len(assigned) == 1  # streaming: one group per pull
    # 3 ready unassigned groups remain, the batch needs 1 more: supply 1 >= 0.5*2 -> satellite 1
    assert [c.cell for c in of(out, ev.CellToTraining)] == [1]
    out = s.handle(ev.TransitionDone(1, Role.TRAINING), 3.0)
    assert of(out, ev.JoinStep) == [ev.JoinStep(0, 1)]
    # still 1 group needed and 3 ready: the next cell of the prefix follows, serially
    assert of(out, ev.CellToTraining) == [ev.CellToTraining(2)]
    out = s.handle(ev.BufferLow(0), 4.0)
    assert of(out, ev.CloseStream) == [ev.CloseStream(0)]
    out = s.handle(ev.MicroStepsDone(0), 5.0)
    assert of(out, ev.StartStep) == [ev.StartStep(1, (0, 1))]  # non-final: satellites stay
    out = s.handle(ev.BufferLow(1), 6.0)
    assert of(out, ev.CloseStream)
    out = s.handle(ev.MicroStepsDone(1), 7.0)
    # burst end: satellites return first (cell 2 once it has arrived); publication waits for them
    assert of(out, ev.CellToRollout) == [ev.CellToRollout(1)] and not of(out, ev.Publish)
    out = s.handle(ev.TransitionDone(2, Role.TRAINING), 7.5)
    assert of(out, ev.CellToRollout) == [ev.CellToRollout(2)] and not of(out, ev.JoinStep)
    out = s.handle(ev.TransitionDone(1, Role.ROLLOUT), 8.0)
    assert not of(out, ev.Publish)
    out = s.handle(ev.TransitionDone(2, Role.ROLLOUT), 8.0)
    assert of(out, ev.Publish) == [ev.Publish(2)]
    out = s.handle(ev.PublicationDone(2), 9.0)
    # all 4 groups consumed, 4 new dispatched at version 2; no ready group -> core returns
    assert [d.version for d in of(out, ev.DispatchGroup)] == [2] * 4
    assert of(out, ev.CellToRollout) == [ev.CellToRollout(0)]
    assert s.staleness == [0, 0, 1, 1]


def test_core_stays_after_publication_when_supply_and_capacity_allow() -> None:
    cfg = SchedulerConfig(cells=2, cell_capacity=8, group_size=1, groups_per_step=1,
                          steps_per_burst=1, extra_dispatch=2.0, rho_min=1.0, supply_window_s=0.0)
    s, out = _run_to_first_step(cfg)  # 3 groups ready
    s.handle(ev.TransitionDone(0, Role.TRAINING), 2.0)
    out = s.handle(ev.MicroStepsDone(0), 3.0)
    assert of(out, ev.Publish) == [ev.Publish(1)]
    out = s.handle(ev.PublicationDone(1), 4.0)
    # 2 ready groups >= rho*B and w + mu*N*B = 1 <= (K-1)*C_e: the core stays and trains on
    assert not of(out, ev.CellToRollout)
    assert of(out, ev.StartStep) == [ev.StartStep(1, (0,))]


def test_colocate_switches_the_whole_pool_once_all_admitted_executions_finished() -> None:
    cfg = SchedulerConfig(mode=Mode.COLOCATE, cells=3, cell_capacity=2, group_size=1,
                          groups_per_step=2, steps_per_burst=2, extra_dispatch=0.0,
                          supply_window_s=0.0, rho_min=0.5)
    s = Scheduler(cfg)
    s.handle(ev.Start(), 0.0)
    for e in range(3):
        out = s.handle(ev.ExecutionEnded(e, Outcome.COMPLETED), 1.0)
        out += s.handle(ev.EvaluationValid(e), 1.0)
        assert not of(out, ev.CellToTraining)  # w > C_s = 0
    out = s.handle(ev.ExecutionEnded(3, Outcome.COMPLETED), 1.0)
    out += s.handle(ev.EvaluationValid(3), 1.0)
    assert [c.cell for c in of(out, ev.CellToTraining)] == [0, 1, 2]
    for c in range(3):
        out = s.handle(ev.TransitionDone(c, Role.TRAINING), 2.0)
    assert of(out, ev.StartStep) == [ev.StartStep(0, (0, 1, 2))]
    assert len(of(out, ev.AssignGroup)) == 2 and of(out, ev.CloseStream)  # not streaming


def test_async_keeps_a_fixed_training_pool_and_publishes_after_every_step() -> None:
    cfg = SchedulerConfig(mode=Mode.ASYNC, cells=3, cell_capacity=2, group_size=1,
                          groups_per_step=1, steps_per_burst=1, extra_dispatch=1.0,
                          async_training_cells=1)
    s = Scheduler(cfg)
    out = s.handle(ev.Start(), 0.0)
    assert of(out, ev.CellToTraining) == [ev.CellToTraining(0)]
    assert {l.engine for l in of(out, ev.Launch)} <= {1, 2}
    s.handle(ev.TransitionDone(0, Role.TRAINING), 1.0)
    out = finish_group(s, [0], 2.0)
    assert of(out, ev.StartStep) == [ev.StartStep(0, (0,))]
    out = s.handle(ev.MicroStepsDone(0), 3.0)
    assert of(out, ev.Publish) == [ev.Publish(1)] and not of(out, ev.CellToRollout)


def test_oversampled_surplus_is_cancelled_and_counted_once() -> None:
    cfg = SchedulerConfig(cells=1, cell_capacity=3, group_size=2, oversample=4, groups_per_step=1,
                          steps_per_burst=1, extra_dispatch=0.0)
    s = Scheduler(cfg)
    s.handle(ev.Start(), 0.0)  # 4 executions, 3 launched, 1 queued
    s.handle(ev.ExecutionEnded(0, Outcome.COMPLETED), 1.0)  # frees a slot: exec 3 launches
    s.handle(ev.EvaluationValid(0), 1.0)
    s.handle(ev.ExecutionEnded(1, Outcome.COMPLETED), 1.0)
    out = s.handle(ev.EvaluationValid(1), 1.0)
    assert sorted(c.execution_id for c in of(out, ev.Cancel)) == [2, 3]
    f = s.f
    s.handle(ev.ExecutionEnded(2, Outcome.CANCELLED), 2.0)
    s.handle(ev.ExecutionEnded(3, Outcome.COMPLETED), 2.0)  # raced its cancellation
    assert s.f == f + 2 == s.p == s.d == 4
    with pytest.raises(SchedulerError):
        s.handle(ev.ExecutionEnded(3, Outcome.CANCELLED), 3.0)


def test_unresolved_evaluation_is_never_a_valid_reward() -> None:
    cfg = SchedulerConfig(cells=2, cell_capacity=4, group_size=2, groups_per_step=1,
                          steps_per_burst=1, extra_dispatch=0.0, supply_window_s=0.0,
                          short_group=ShortGroupRule.TOP_UP)
    s = Scheduler(cfg)
    s.handle(ev.Start(), 0.0)
    s.handle(ev.ExecutionEnded(0, Outcome.HARNESS_TIMEOUT), 1.0)  # scored and used
    s.handle(ev.EvaluationValid(0), 1.0)
    s.handle(ev.ExecutionEnded(1, Outcome.COMPLETED), 1.0)
    out = s.handle(ev.EvaluationUnresolved(1, final=False), 1.0)  # retried: group still waits
    assert not of(out, ev.CellToTraining) and not of(out, ev.DispatchGroup)
    out = s.handle(ev.EvaluationUnresolved(1, final=True), 2.0)  # budget spent: excluded
    # the group is short and the burst would starve: one top-up of the same group, same version
    tops = of(out, ev.DispatchGroup)
    assert tops == [ev.DispatchGroup(0, (2,), 0, refill_of=0)]
    assert s.starvation_dispatches == 1


def test_drop_rule_drops_a_short_group_and_refills_its_slot() -> None:
    cfg = SchedulerConfig(cells=2, cell_capacity=8, group_size=2, groups_per_step=1,
                          steps_per_burst=1, extra_dispatch=1.0, short_group=ShortGroupRule.DROP)
    s = Scheduler(cfg)
    s.handle(ev.Start(), 0.0)  # groups 0 (execs 0,1) and 1 (execs 2,3)
    out = s.handle(ev.ExecutionEnded(0, Outcome.OVERALL_TIMEOUT), 1.0)
    assert of(out, ev.GroupDropped) == [ev.GroupDropped(0)]
    assert of(out, ev.Cancel) == [ev.Cancel(1)]
    assert not of(out, ev.DispatchGroup)  # group 1 can still supply the burst: refill waits


def test_protocol_violations_are_errors() -> None:
    s = Scheduler(SchedulerConfig())
    with pytest.raises(SchedulerError):
        s.handle(ev.Tick(), 0.0)
    s.handle(ev.Start(), 0.0)
    with pytest.raises(SchedulerError):
        s.handle(ev.TransitionDone(0, Role.TRAINING), 1.0)
    with pytest.raises(SchedulerError, match="unknown cell"):
        s.handle(ev.TransitionDone(99, Role.TRAINING), 1.0)
    with pytest.raises(SchedulerError):
        s.handle(ev.Tick(), 0.5)  # time went backwards


@pytest.mark.parametrize(
    "mode,target,expected",
    [("async", 1.5, (1.5, 1)), ("colocate", 1.5, (0.0, 4)), ("gyre", 1.5, (0.5, 3)),
     ("async", 1.0, (1.0, 1)), ("colocate", 1.0, (0.0, 3)), ("gyre", 1.0, (0.5, 2))],
)
def test_burst_solver_matches_the_paper(mode: str, target: float, expected: tuple) -> None:
    assert solve_burst(mode, target) == expected


def test_burst_solver_overrides_and_rejects_impossible_choices() -> None:
    assert solve_burst("gyre", 1.5, mu=2) == (1.0, 2)
    assert solve_burst("gyre", 1.5, phi=1.5) == (1.5, 1)
    with pytest.raises(ConfigError, match="extra_dispatch"):
        solve_burst("gyre", 1.0, mu=4)
    with pytest.raises(ConfigError, match="not a whole number"):
        solve_burst("gyre", 1.0, phi=0.25)
    with pytest.raises(ConfigError, match="mode"):
        solve_burst("hybrid", 1.0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"extra_dispatch": -0.5}, "extra_dispatch"),
        ({"steps_per_burst": 0}, "steps_per_burst"),
        ({"rho_min": 0.0}, "rho_min"),
        ({"rho_min": 1.5}, "rho_min"),
        ({"cell_capacity": 0}, "cell_capacity"),
        ({"cells": 0}, "cells"),
        ({"groups_per_step": 0}, "groups_per_step"),
        ({"group_size": 0}, "group_size"),
        ({"mode": "hybrid"}, "mode"),
        ({"oversample": 3}, "oversample"),
        ({"extra_dispatch": float("nan")}, "extra_dispatch"),
        ({"mode": "async", "async_training_cells": 8}, "async_training_cells"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**kwargs)
