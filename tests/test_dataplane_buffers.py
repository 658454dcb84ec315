"""Group readiness, the trajectory buffer and the stream packing buffer."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.config import Mode, SchedulerConfig, ShortGroupRule
from gyre_core.dataplane import (
    AssessmentLedger,
    GroupNotReady,
    MicroStepQueue,
    PackingConfig,
    ScoredExecution,
    StreamPackingBuffer,
    TrajectoryBuffer,
    group_advantages,
    materialise_group,
)
from gyre_core.interfaces import Assessment, RoleClass, StateRef
from gyre_core.scheduler import Scheduler
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import DispatchGroup, GroupDropped, GroupFiltered, Outcome
from gyre_core.trajectory import Provenance, SelectedTrajectory, TrajectoryTree, TreeNode


def segment(nid: int, parent: int | None, context: int, sampled: int) -> TreeNode:
    prov = [Provenance.EXTERNAL] * context + [Provenance.SAMPLED] * sampled
    return TreeNode(nid, parent, torch.arange(len(prov)) % 50, torch.tensor([int(p) for p in prov]),
                    torch.tensor([0.0] * context + [-1.0] * sampled))


def scored(eid: int, gid: int, reward: float = 0.5, branches=((2, 3),), root=(4, 3),
           share_root: bool = False) -> ScoredExecution:
    """Root (prompt + response) with one child per branch; every leaf selected.

    Like selection, only the first trajectory owns the root's response -- unless ``share_root``,
    where every trajectory claims it and the objective's weights must count it once.
    """
    tree = TrajectoryTree(eid, [segment(0, None, *root)])
    sel = []
    for i, (ctx, smp) in enumerate(branches, start=1):
        tree.add(segment(i, 0, ctx, smp))
        owned = {0, i} if (i == 1 or share_root) else {i}
        sel.append(SelectedTrajectory(i, RoleClass.MAIN_AGENT_TASK if i == 1 else RoleClass.SUB_AGENT_TASK,
                                      frozenset(owned)))
    return ScoredExecution(eid, gid, reward, tree, tuple(sel))


def opened(n: int = 2, executions: int | None = None, groups=((0, 0),)):
    buf = TrajectoryBuffer(n)
    m = executions or n
    for gid, version in groups:
        buf.dispatch(DispatchGroup(gid, tuple(range(gid * 100, gid * 100 + m)), version))
    return buf


# ------------------------------------------------------------------------- readiness


def test_group_is_ready_with_n_valid_rewards_and_carries_its_advantages() -> None:
    buf = opened(n=3)
    assert buf.put(scored(0, 0, 1.0)) and buf.put(scored(1, 0, 0.0))
    assert buf.ready() == []
    with pytest.raises(GroupNotReady, match=r"2 of 3 .*missing executions: \[2\]"):
        buf.peek(0)
    buf.put(ScoredExecution.placeholder(2, 0))  # a complete failure counts, as a zero
    g = buf.take(0)
    assert [s.execution_id for s in g.executions] == [0, 1, 2] and g.version == 0
    assert g.advantages == pytest.approx(group_advantages([1.0, 0.0, 0.0]))
    assert g.advantages[0] > 0 > g.advantages[1] == g.advantages[2]
    with pytest.raises(GroupNotReady):
        buf.take(0)


def test_oversampling_surplus_is_recorded_once_and_its_late_rewards_are_ignored() -> None:
    buf = opened(n=2, executions=4)
    buf.put(scored(1, 0, 1.0))
    buf.exclude(3)  # an evaluator that never resolved: one fewer candidate, still enough
    buf.put(scored(2, 0, 0.0))
    assert buf.ready() == [0] and buf.surplus == {0}
    assert buf.put(scored(0, 0, 1.0)) is False  # finished after the group filled
    buf.exclude(0)  # surplus: nothing changes
    assert buf.surplus == {0}
    assert [s.execution_id for s in buf.take(0).executions] == [1, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=12), st.randoms())
def test_ready_groups_come_oldest_policy_version_first(groups: list, rnd: random.Random) -> None:
    buf = TrajectoryBuffer(1)
    for gid, (version, _) in enumerate(groups):
        buf.dispatch(DispatchGroup(gid, (gid,), version))
    order = list(range(len(groups)))
    rnd.shuffle(order)
    for gid in order:
        buf.put(scored(gid, gid))
    expected = sorted(order, key=lambda g: (groups[g][0], order.index(g)))
    assert buf.ready() == expected
    taken = []
    while (gid := buf.oldest_ready()) is not None:
        taken.append(buf.take(gid).group_id)
    assert taken == expected


def test_short_group_top_up_waits_for_the_missing_executions_and_keeps_its_version() -> None:
    buf = opened(n=2, groups=((0, 4),))
    buf.put(scored(0, 0))
    buf.exclude(1)  # short, but under top_up it waits for the scheduler's top-up
    buf.dispatch(DispatchGroup(0, (7,), 4, refill_of=0))
    buf.put(scored(7, 0))
    g = buf.take(0)
    assert g.version == 4 and [s.execution_id for s in g.executions] == [0, 7]
    with pytest.raises(ValueError, match="keep its id and version"):
        opened(n=2, groups=((1, 4),)).dispatch(DispatchGroup(1, (9,), 5, refill_of=1))


def test_short_group_drop_discards_the_group_on_the_schedulers_word() -> None:
    buf = opened(n=3, executions=4)
    buf.put(scored(0, 0))
    buf.exclude(1)
    buf.exclude(2)
    assert buf.ready() == [] and buf.dropped == set()  # the buffer does not decide
    buf.drop(GroupDropped(0))
    assert buf.dropped == {0} and buf.ready() == []
    assert buf.put(scored(3, 0)) is False  # late news about a dropped group is ignored
    with pytest.raises(GroupNotReady):
        buf.peek(0)


def test_filtered_group_is_ready_with_its_valid_rewards_and_advantages_over_them() -> None:
    buf = opened(n=4)
    buf.put(scored(0, 0, 1.0))
    buf.exclude(1)
    buf.put(scored(2, 0, 0.0))
    # execution 3 was an overall timeout: the scheduler heard of it, the buffer did not
    with pytest.raises(ValueError, match="scheduler counted 3 valid rewards, the buffer holds 2"):
        buf.filter(GroupFiltered(0, 3, False))
    buf.filter(GroupFiltered(0, 2, False))
    g = buf.take(0)
    assert [s.execution_id for s in g.executions] == [0, 2]
    assert g.advantages == pytest.approx(group_advantages([1.0, 0.0]))


def test_empty_group_is_consumed_with_nothing_to_train() -> None:
    buf = opened(n=3)
    buf.put(scored(0, 0, 1.0))
    buf.exclude(1)
    buf.exclude(2)
    buf.filter(GroupFiltered(0, 1, True))
    assert buf.ready() == [0]
    g = buf.take(0)
    assert g.executions == () and g.advantages == ()
    assert materialise_group(g, 0, 3) == []


@pytest.mark.parametrize("rule", list(ShortGroupRule))
def test_buffer_follows_the_schedulers_short_group_decision(rule: ShortGroupRule) -> None:
    """One decision: the scheduler applies the configured rule, the buffer carries it out."""
    cfg = SchedulerConfig(cells=2, cell_capacity=8, group_size=2, groups_per_step=1,
                          steps_per_burst=1, extra_dispatch=0.0, short_group=rule)
    sched = Scheduler(cfg)
    buf = TrajectoryBuffer(cfg.group_size)

    def carry_out(out: list) -> list:
        for cmd in out:
            if isinstance(cmd, DispatchGroup):
                buf.dispatch(cmd)
            elif isinstance(cmd, GroupDropped):
                buf.drop(cmd)
            elif isinstance(cmd, GroupFiltered):
                buf.filter(cmd)
        return out

    carry_out(sched.handle(ev.Start(), 0.0))
    sched.handle(ev.ExecutionEnded(0, Outcome.COMPLETED), 1.0)
    buf.put(scored(0, 0))
    sched.handle(ev.EvaluationValid(0), 1.0)
    sched.handle(ev.ExecutionEnded(1, Outcome.COMPLETED), 2.0)
    buf.exclude(1)
    out = carry_out(sched.handle(ev.EvaluationUnresolved(1, final=True), 3.0))
    if rule is ShortGroupRule.DROP:
        assert [c for c in out if isinstance(c, GroupDropped)] == [GroupDropped(0)]
        assert buf.dropped == {0}
    elif rule is ShortGroupRule.FILTER:
        assert [c for c in out if isinstance(c, GroupFiltered)] == [GroupFiltered(0, 1, True)]
        assert buf.take(0).executions == ()  # consumed once, trains nothing
        assert not [c for c in out if isinstance(c, DispatchGroup)], "d does not rise inside a burst"
    else:
        refill = [c for c in out if isinstance(c, DispatchGroup) and c.refill_of == 0]
        assert refill, "the scheduler tops the group up (it would otherwise starve the burst)"
        buf.put(scored(refill[0].execution_ids[0], 0))
        assert buf.ready() == [0]


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1.5, -0.01])
def test_bad_rewards_are_refused_and_nothing_is_stored(bad: float) -> None:
    buf = opened(n=2)
    buf.put(scored(0, 0, 1.0))
    with pytest.raises(ValueError, match="reward"):
        buf.put(scored(1, 0, bad))
    buf.put(scored(1, 0, 0.0))  # the same execution is still pending: the bad put left no trace
    assert buf.take(0).advantages == pytest.approx(group_advantages([1.0, 0.0]))


def test_foreign_duplicate_and_malformed_executions_are_refused() -> None:
    buf = opened(n=2, groups=((0, 0), (1, 0)))
    with pytest.raises(ValueError, match="belongs to group 0, not 1"):
        buf.put(scored(0, 1))
    with pytest.raises(ValueError, match="no dispatched group"):
        buf.put(scored(55, 0))
    buf.put(scored(0, 0))
    with pytest.raises(ValueError, match="already valid"):
        buf.put(scored(0, 0))
    with pytest.raises(ValueError, match="already belong"):
        buf.dispatch(DispatchGroup(2, (1, 500), 0))
    with pytest.raises(ValueError, match="dispatched twice"):
        buf.dispatch(DispatchGroup(1, (600,), 0))
    tree = TrajectoryTree(1, [segment(0, None, 2, 2), segment(1, 0, 1, 1)])
    with pytest.raises(ValueError, match="not a leaf"):
        ScoredExecution(1, 0, 0.5, tree, (SelectedTrajectory(0, 0, frozenset({0})),))
    with pytest.raises(ValueError, match="belongs to execution 1"):
        ScoredExecution(2, 0, 0.5, tree, ())
    assert buf.ready() == []


# ------------------------------------------------------------------------- packing


def packer(buf: TrajectoryBuffer, groups: int, budget: int = 64, dp: int = 2, **kw):
    q: MicroStepQueue = MicroStepQueue()
    return q, StreamPackingBuffer(3, buf, q, PackingConfig(budget, dp, **kw), groups)


def drain(q: MicroStepQueue) -> list:
    out = []
    while (m := q.claim(timeout=5)) is not None:
        out.append(m)
    return out


executions = st.lists(
    st.tuples(st.floats(0, 1), st.tuples(st.integers(1, 6), st.integers(0, 8)),
              st.lists(st.tuples(st.integers(1, 8), st.integers(0, 12)), min_size=1, max_size=4),
              st.booleans()),
    min_size=2, max_size=2)


@settings(max_examples=60, deadline=None)
@given(st.lists(executions, min_size=1, max_size=3), st.integers(1, 3), st.integers(34, 80))
def test_packing_puts_every_trainable_token_in_exactly_one_micro_step_within_budget(
    groups: list, dp: int, budget: int
) -> None:
    buf = TrajectoryBuffer(2)
    expected: Counter = Counter()
    for gid, members in enumerate(groups):
        buf.dispatch(DispatchGroup(gid, (2 * gid, 2 * gid + 1), 0))
        for k, (reward, root, branches, share) in enumerate(members):
            s = scored(2 * gid + k, gid, reward, tuple(branches), root, share)
            buf.put(s)
            for leaf in s.tree.leaves():  # unique sampled tokens: each node's response once
                expected[(s.execution_id, leaf)] += int((s.tree.node(leaf).provenance == 1).sum())
            expected[(s.execution_id, 0)] += root[1]
    q, pb = packer(buf, len(groups), budget, dp)
    for gid in range(len(groups)):
        pb.assign(gid)
    pb.close()
    micro = drain(q)
    assert [m.index for m in micro] == list(range(pb.micro_steps)) and q.closed
    seen: Counter = Counter()
    per_exec = Counter()
    where: dict[int, set] = {}
    length: Counter = Counter()
    def key(r):  # micro-steps come through the queue as copies: compare rows by content
        return (r.exec_slot, tuple(r.row.token_ids.tolist()), tuple(r.row.response_ids.tolist()))

    all_rows = Counter(key(r) for m in micro for p in m.packs for r in p.rows)
    for m in micro:
        assert len(m.packs) == dp
        for k, p in enumerate(m.packs):
            assert p.tokens <= budget
            # a split execution's part carries exactly its other rows, for the whole-execution ratio
            slots = {r.exec_slot for r in p.rows}
            others = Counter({r: n for r, n in all_rows.items() if r[0] in slots}) - Counter(map(key, p.rows))
            assert Counter(map(key, p.outside)) == others
            for r in p.rows:
                where.setdefault(r.row.execution_id, set()).add((m.index, k))
                length[r.row.execution_id] += len(r)
                w = r.loss_weights
                per_exec[r.row.execution_id] += float(w.double().sum())
                for rid in r.row.response_ids[w > 0].tolist():
                    seen[(r.row.execution_id, rid)] += 1
    assert seen == +expected  # every unique trainable token exactly once, nothing else
    for eid, places in where.items():  # an execution that fits one pack is in one pack: exact s_e
        assert len(places) == 1 or length[eid] > budget, (eid, places, length[eid])
    assert pb.split_executions == sum(1 for eid in where if length[eid] > budget)
    n_exec = 2 * len(groups)
    for eid, total in per_exec.items():
        assert total == pytest.approx(1 / n_exec, rel=1e-5)  # equal weight per execution
    assert pb.tokens_emitted == sum(m.tokens for m in micro)


def test_micro_steps_wait_for_fillers_until_the_stream_closes() -> None:
    buf = opened(n=1, groups=((0, 0), (1, 0)))
    buf.put(scored(0, 0, branches=((10, 30),), root=(4, 4)))  # one 48-token row
    buf.put(scored(100, 1, branches=((4, 4),), root=(4, 4)))  # a 16-token row
    q, pb = packer(buf, 2, budget=64, dp=1, min_fill=0.95)
    pb.assign(0)
    assert pb.micro_steps == 0 and pb.pending_tokens == 48  # 48/64 is not worth a micro-step yet
    pb.assign(1)
    pb.close()
    (m,) = drain(q)
    assert m.tokens == 64 and pb.efficiency == 1.0  # the short rows filled the gap


def test_low_signal_pulls_one_group_at_a_time_and_stops_at_b() -> None:
    buf = opened(n=1, groups=((0, 2), (1, 1), (2, 0)))
    for gid in range(3):
        buf.put(scored(gid * 100, gid, branches=((4, 60),), root=(1, 1)))  # 66-token rows
    q, pb = packer(buf, 3, budget=67, dp=1, low_watermark=1)
    assert pb.poll_low() is None  # StartStep already asked for the first group
    pb.assign(buf.oldest_ready())
    assert pb.assigned == [2] and q.unclaimed() == 1
    assert pb.poll_low() is None  # a micro-step waits: not low
    q.claim(timeout=1)
    assert pb.poll_low() == ev.BufferLow(3)
    assert pb.poll_low() is None  # one pull outstanding at a time
    pb.assign(buf.oldest_ready())
    q.claim(timeout=1)
    assert pb.poll_low() == ev.BufferLow(3)
    pb.assign(buf.oldest_ready())
    q.claim(timeout=1)
    assert pb.assigned == [2, 1, 0] and pb.poll_low() is None  # all B groups in
    with pytest.raises(ValueError, match="already has its 3 groups"):
        pb.assign(0)
    pb.close()
    assert q.claim(timeout=1) is None


def test_failed_assignments_leave_both_buffers_untouched() -> None:
    buf = opened(n=2, groups=((0, 0), (1, 0)))
    buf.put(scored(0, 0))
    q, pb = packer(buf, 2, budget=20, dp=1)
    with pytest.raises(GroupNotReady, match="missing executions: \\[1\\]"):
        pb.assign(0)  # a group with a missing execution
    buf.put(scored(1, 0, branches=((4, 30),)))  # a 41-token row > 20-token budget
    bad_tree = TrajectoryTree(100, [segment(0, None, 2, 2), segment(1, 0, 1, 1), segment(2, 0, 1, 1)])
    buf.put(ScoredExecution(100, 1, 0.5, bad_tree, (SelectedTrajectory(1, 0, frozenset({2})),)))
    buf.put(scored(101, 1))
    with pytest.raises(ValueError, match="not on the path"):
        pb.assign(1)  # materialisation fails: nothing taken, nothing enqueued
    assert buf.ready() == [0, 1] and q.unclaimed() == 0 and pb.assigned == []
    with pytest.raises(ValueError, match="closing with 0 of 2"):
        pb.close()
    assert not q.closed


def test_a_row_longer_than_a_micro_step_is_left_out_and_counted_never_raised() -> None:
    """One long execution must not end an hours-long run: its over-budget row is not trained
    (the proxy refuses calls that would make one; this is the last line), the rest of the group
    is, and the step counts what it left out."""
    buf = opened(n=2, groups=((0, 0),))
    buf.put(scored(0, 0))
    buf.put(scored(1, 0, branches=((4, 30),)))  # a 41-token row > 20-token budget
    q, pb = packer(buf, 1, budget=20, dp=1)
    pb.assign(0)
    pb.close()
    assert pb.assigned == [0] and pb.rows_over_budget == 1
    items = []
    while (item := q.claim(timeout=1)) is not None:
        items.append(item)
    assert items and all(len(row) <= 20 for ms in items for pack in ms.packs for row in pack.rows)


# ------------------------------------------------------------------------- the contracts fit


def test_scheduler_ledger_and_buffers_run_streaming_steps_together() -> None:
    """A miniature orchestrator: forward the scheduler's commands and the data plane's events."""
    cfg = SchedulerConfig(mode=Mode.GYRE, cells=2, cell_capacity=6, group_size=2, groups_per_step=2,
                          steps_per_burst=2, extra_dispatch=0.5, oversample=3, rho_min=0.5,
                          supply_window_s=0.0)
    rng = random.Random(7)
    sched, ledger = Scheduler(cfg), AssessmentLedger()
    buf = TrajectoryBuffer(cfg.group_size)
    group_of: dict[int, int] = {}
    pending: list = [ev.Start()]
    state = StateRef("final", "main")
    pb = queue = None
    packed_groups: list[int] = []
    now = 0.0

    def evaluator(s: StateRef) -> Assessment:
        return Assessment.unresolved(s) if rng.random() < 0.3 else Assessment.valid(rng.random(), s)

    while sched.steps_done < 4:
        assert pending, "the run stalled"
        event, follow = pending.pop(0), []
        now += 1.0
        if isinstance(event, ev.ExecutionEnded):
            eid = event.execution_id
            if ledger.terminated(eid, event.outcome, state if event.outcome is Outcome.COMPLETED else None):
                buf.put(ScoredExecution.placeholder(eid, group_of[eid]))
                follow.append(ev.EvaluationValid(eid))
            elif event.outcome is Outcome.COMPLETED:
                follow.append(("evaluate", eid))
            else:
                buf.exclude(eid)
        elif isinstance(event, tuple):  # (re)try the evaluator against the preserved state
            eid = event[1]
            event = ledger.evaluate(eid, evaluator, now)
            if isinstance(event, ev.EvaluationValid):
                buf.put(scored(eid, group_of[eid], ledger.reward(eid)))
            elif event.final:
                buf.exclude(eid)
            else:
                follow.append(("evaluate", eid))
        for cmd in sched.handle(event, now):
            if isinstance(cmd, DispatchGroup):
                buf.dispatch(cmd)
                group_of.update({e: cmd.group_id for e in cmd.execution_ids})
            elif isinstance(cmd, GroupFiltered):
                buf.filter(cmd)
            elif isinstance(cmd, ev.Launch):
                ledger.register(cmd.execution_id, deadline=now + 30.0)
                outcome = Outcome.FAILED if rng.random() < 0.1 else Outcome.COMPLETED
                follow.append(ev.ExecutionEnded(cmd.execution_id, outcome))
            elif isinstance(cmd, ev.Cancel):  # the surplus execution ends as cancelled instead
                (i,) = [i for i, e in enumerate(pending + follow)
                        if isinstance(e, ev.ExecutionEnded) and e.execution_id == cmd.execution_id]
                cancelled = ev.ExecutionEnded(cmd.execution_id, Outcome.CANCELLED)
                if i < len(pending):
                    pending[i] = cancelled
                else:
                    follow[i - len(pending)] = cancelled
            elif isinstance(cmd, ev.CellToTraining):
                follow.append(ev.TransitionDone(cmd.cell, ev.Role.TRAINING))
            elif isinstance(cmd, ev.CellToRollout):
                follow.append(ev.TransitionDone(cmd.cell, ev.Role.ROLLOUT))
            elif isinstance(cmd, ev.StartStep):
                queue = MicroStepQueue()
                pb = StreamPackingBuffer(cmd.step, buf, queue, PackingConfig(64, 2), cfg.groups_per_step)
            elif isinstance(cmd, ev.AssignGroup):
                pb.assign(cmd.group_id)
                packed_groups.append(cmd.group_id)
                while queue.unclaimed():
                    queue.claim(timeout=1)  # a fast cell trains everything at once
                if (low := pb.poll_low()) is not None:
                    follow.append(low)
            elif isinstance(cmd, ev.CloseStream):
                pb.close()
                drain(queue)
                follow.append(ev.MicroStepsDone(cmd.step))
            elif isinstance(cmd, ev.Publish):
                follow.append(ev.PublicationDone(cmd.version))
        pending.extend(follow)
        sched.check_invariants()
    assert len(packed_groups) == 4 * cfg.groups_per_step == len(set(packed_groups))
    assert buf.surplus, "oversampling produced surplus executions"
