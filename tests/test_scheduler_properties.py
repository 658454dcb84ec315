"""Property tests: the scheduler's invariants hold for random configs and random event orders.

A random "world" drives the scheduler: it ends running executions with random outcomes, evaluates
them (valid, unresolved, finally unresolved), completes role switches, publications and training
steps in random order and at random times. After every event the invariants of docs/design.md ("The scheduler's rules") are
checked; at the end a fair world must still make progress (no deadlock).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre_core.config import Mode, SchedulerConfig, ShortGroupRule
from gyre_core.scheduler import Scheduler
from gyre_core.scheduler.state_machine import NoProgress
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Outcome, Role


@st.composite
def configs(draw) -> SchedulerConfig:
    mode = draw(st.sampled_from(list(Mode)))
    cells = draw(st.integers(2 if mode is Mode.ASYNC else 1, 4))
    n = draw(st.integers(1, 3))
    return SchedulerConfig(
        mode=mode,
        cells=cells,
        cell_capacity=draw(st.integers(1, 6)),
        standalone_capacity=draw(st.integers(0, 3)),
        group_size=n,
        groups_per_step=draw(st.integers(1, 3)),
        steps_per_burst=draw(st.integers(1, 3)),
        extra_dispatch=draw(st.sampled_from([0.0, 0.5, 1.0])),
        rho_min=draw(st.sampled_from([0.3, 0.5, 1.0])),
        supply_window_s=draw(st.sampled_from([0.0, 5.0])),
        oversample=draw(st.sampled_from([None, n + 1])),
        async_training_cells=draw(st.integers(1, cells - 1)) if mode is Mode.ASYNC else 1,
        streaming=draw(st.sampled_from([None, True, False])),
        short_group=draw(st.sampled_from(list(ShortGroupRule))),
        min_valid_rewards=draw(st.sampled_from([None, 1, n])),
    )


class World:
    """Tracks what the driver owes the scheduler and checks every property after each event."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.s = Scheduler(cfg)
        self.now = 0.0
        self.running: set[int] = set()
        self.to_cancel: set[int] = set()
        self.awaiting: set[int] = set()
        self.transitions: list[tuple[int, Role]] = []
        self.publication: int | None = None
        self.step: int | None = None
        self.closed = False
        self.group_of: dict[int, int] = {}
        self.version_of: dict[int, int] = {}
        self.valid_sent: Counter[int] = Counter()
        self.assigned: set[int] = set()
        self.launch_count = 0
        self.end_count = 0
        self.ended: set[int] = set()
        self.steps_done = 0
        self.filtered: dict[int, ev.GroupFiltered] = {}
        self.stalled: NoProgress | None = None

    def send(self, event: ev.Event) -> None:
        d_before, starv_before = self.s.d, self.s.starvation_dispatches
        w_before = self.s.d - self.s.f
        if self.stalled is not None:
            return
        try:
            out = self.s.handle(event, self.now)
        except NoProgress as e:  # a legitimate stop: that many futile groups in a row
            assert self.s.futile_groups >= self.s.futile_limit, e
            self.stalled = e
            return
        for cmd in out:
            self.apply(cmd)
        self.s.check_invariants()
        snap = self.s.snapshot()
        # d (hence w = d - f) rises only at start, at a publication, or to rescue a starving burst;
        # under the filter rule never inside a burst (Eq. 1)
        if self.cfg.short_group is ShortGroupRule.FILTER:
            assert self.s.starvation_dispatches == 0
        if self.s.d != d_before:
            assert isinstance(event, (ev.Start, ev.PublicationDone)) or (
                self.s.starvation_dispatches > starv_before
            ), f"d rose from {d_before} to {self.s.d} on {event}"
        elif not isinstance(event, ev.PublicationDone):
            assert self.s.d - self.s.f <= w_before
        # counters: every launched execution finishes exactly once
        cancelled_before_launch = self.s.p - self.launch_count
        assert self.s.f - self.end_count == cancelled_before_launch >= 0
        assert snap.running == len(self.running) + len(self.to_cancel)

    def apply(self, cmd: ev.Command) -> None:
        if isinstance(cmd, ev.DispatchGroup):
            for eid in cmd.execution_ids:
                assert eid not in self.group_of
                self.group_of[eid] = cmd.group_id
            if cmd.refill_of is None:  # a new group is admitted at the latest published version
                assert cmd.group_id not in self.version_of
                assert cmd.version == self.s.published_version
                self.version_of[cmd.group_id] = cmd.version
            else:  # a top-up keeps its group's admission version
                assert cmd.version == self.version_of[cmd.group_id]
        elif isinstance(cmd, ev.Launch):
            assert cmd.execution_id not in self.ended
            self.running.add(cmd.execution_id)
            self.launch_count += 1
        elif isinstance(cmd, ev.Cancel):
            self.running.discard(cmd.execution_id)
            self.to_cancel.add(cmd.execution_id)
        elif isinstance(cmd, ev.CellToTraining):
            self.transitions.append((cmd.cell, Role.TRAINING))
        elif isinstance(cmd, ev.CellToRollout):
            self.transitions.append((cmd.cell, Role.ROLLOUT))
        elif isinstance(cmd, ev.StartStep):
            assert self.step is None
            assert cmd.cells and 0 in cmd.cells or self.cfg.mode is Mode.COLOCATE
            self.step, self.closed = cmd.step, False
        elif isinstance(cmd, ev.GroupFiltered):
            assert self.cfg.short_group is ShortGroupRule.FILTER
            assert cmd.group_id not in self.filtered, "group filtered twice"
            members = [e for e, g in self.group_of.items() if g == cmd.group_id]
            assert not any(e in self.running or e in self.awaiting or e in self.to_cancel for e in members), \
                "filtered while an execution of the group is still pending"
            assert cmd.valid == self.valid_sent[cmd.group_id] < self.cfg.group_size
            assert cmd.empty == (cmd.valid < self.cfg.min_valid)
            self.filtered[cmd.group_id] = cmd
        elif isinstance(cmd, ev.AssignGroup):
            assert cmd.step == self.step and not self.closed
            assert cmd.group_id not in self.assigned, "group consumed twice"
            self.assigned.add(cmd.group_id)
            assert self.valid_sent[cmd.group_id] >= self.cfg.group_size or cmd.group_id in self.filtered, \
                "group assigned before ready"
            assert cmd.staleness == cmd.step - self.version_of[cmd.group_id]
        elif isinstance(cmd, ev.CloseStream):
            self.closed = True
        elif isinstance(cmd, ev.Publish):
            assert self.publication is None
            self.publication = cmd.version

    # ---- world actions; each returns False when it is not possible now

    def end_one(self, pick: int, outcome: Outcome) -> bool:
        use_cancel = self.to_cancel and (pick % 2 or not self.running)
        pool = sorted(self.to_cancel) if use_cancel else sorted(self.running)
        if not pool:
            return False
        eid = pool[pick % len(pool)]
        if eid in self.to_cancel:
            self.to_cancel.discard(eid)
            outcome = Outcome.CANCELLED
        else:
            self.running.discard(eid)
        self.ended.add(eid)
        self.end_count += 1
        if outcome not in (Outcome.CANCELLED, Outcome.OVERALL_TIMEOUT):
            self.awaiting.add(eid)
        self.send(ev.ExecutionEnded(eid, outcome))
        return True

    def evaluate_one(self, pick: int, kind: str) -> bool:
        if not self.awaiting:
            return False
        eid = sorted(self.awaiting)[pick % len(self.awaiting)]
        if kind == "valid":
            self.awaiting.discard(eid)
            self.valid_sent[self.group_of[eid]] += 1
            self.send(ev.EvaluationValid(eid))
        else:
            final = kind == "final"
            if final:
                self.awaiting.discard(eid)
            self.send(ev.EvaluationUnresolved(eid, final))
        return True

    def finish_transition(self, pick: int) -> bool:
        if not self.transitions:
            return False
        cell, role = self.transitions.pop(pick % len(self.transitions))
        self.send(ev.TransitionDone(cell, role))
        return True

    def finish_publication(self) -> bool:
        if self.publication is None:
            return False
        version, self.publication = self.publication, None
        self.send(ev.PublicationDone(version))
        return True

    def train(self) -> bool:
        if self.step is None:
            return False
        if self.closed:
            step, self.step = self.step, None
            self.steps_done += 1
            self.send(ev.MicroStepsDone(step))
        else:
            self.send(ev.BufferLow(self.step))
        return True

    def tick(self) -> bool:
        wake = self.s.next_wakeup()
        if wake is None:
            return False
        self.now = max(self.now, wake)
        self.send(ev.Tick())
        return True


ACTIONS = st.tuples(
    st.sampled_from(["end", "evaluate", "transition", "publish", "train", "tick"]),
    st.integers(0, 1000),
    st.sampled_from(list(Outcome)[:4]),
    st.sampled_from(["valid", "valid", "valid", "retry", "final"]),
    st.floats(0, 10),
)


def drive_fairly(w: World, max_events: int = 5000) -> None:
    """Everything completes validly, in order: the scheduler must keep making steps."""
    target = w.steps_done + 2
    for _ in range(max_events):
        if w.steps_done >= target or w.stalled is not None:
            return
        w.now += 1.0
        progressed = (
            w.finish_transition(0) or w.finish_publication() or w.evaluate_one(0, "valid")
            or w.end_one(0, Outcome.COMPLETED) or w.train() or w.tick()
        )
        if not progressed:
            raise AssertionError(f"deadlock after {w.steps_done} steps: {w.s.snapshot()}")
    raise AssertionError("no progress within the event budget")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), actions=st.lists(ACTIONS, max_size=250))
def test_invariants_under_random_event_orders(cfg: SchedulerConfig, actions) -> None:
    w = World(cfg)
    w.send(ev.Start())
    assert w.s.d == cfg.queue_depth_groups * cfg.executions_per_group  # d(0) = (φ+μ)·N'·B
    for kind, pick, outcome, evaluation, dt in actions:
        w.now += dt
        if kind == "end":
            w.end_one(pick, outcome)
        elif kind == "evaluate":
            w.evaluate_one(pick, evaluation)
        elif kind == "transition":
            w.finish_transition(pick)
        elif kind == "publish":
            w.finish_publication()
        elif kind == "train":
            w.train()
        else:
            w.tick()
    drive_fairly(w)


@settings(max_examples=60, deadline=None)
@given(cfg=configs())
def test_a_fair_world_trains_and_counts_every_execution_once(cfg: SchedulerConfig) -> None:
    w = World(cfg)
    w.send(ev.Start())
    drive_fairly(w)
    drive_fairly(w)
    assert w.s.steps_done == w.steps_done >= 4
    # every finished step consumed exactly B groups (the running step may hold some already)
    assert w.steps_done * cfg.groups_per_step <= len(w.assigned) <= (w.steps_done + 1) * cfg.groups_per_step
