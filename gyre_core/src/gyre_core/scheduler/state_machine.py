"""The elastic scheduler: one pure state machine for Gyre, Async and Colocate.

Feed it events with the current time (:meth:`Scheduler.handle`); it returns commands. It owns the
cumulative counters d, p, f, every group's admission version, the cells' roles, the routes of running
executions, and the batch being assembled. It performs no I/O and reads no clock: the simulator and
the live orchestrator both drive this class, so a behaviour seen in simulation is the behaviour
deployed.

The rules (numbered as the code refers to them):
  (1) boundary dispatch: Q_b groups at start, the consumed (and dropped) slots refilled at each
      publication;
  (2) staleness of a consumed group = the step consuming it − its admission version;
  (3) capacity C(t) = (K − k)·C_e + C_s and (4) launches fill it from the queue;
  (5) a cell enters training when w ≤ (K − k − 1)·C_e + C_s and the supply check has held for τ;
      cells enter serially as a growing prefix and stay for the burst;
  (6) at burst end satellites return, the core publishes, and stays only if supply and capacity allow;
  (7) trajectory classes are the data plane's business, not the scheduler's.

Groups short of N valid rewards follow :class:`~gyre_core.config.ShortGroupRule`; under the
default ``filter`` rule every group is consumed exactly once and d changes only at publication.
A run that can no longer make progress (every group comes up empty, dropped or topped up, e.g. a
workload of only overall timeouts) stops with :class:`NoProgress` after a bounded number of
groups, naming what excluded their executions.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from gyre_core.config import Mode, SchedulerConfig, ShortGroupRule
import gyre_core.scheduler.events as ev
from gyre_core.scheduler.events import STANDALONE, Outcome, Role


class SchedulerError(RuntimeError):
    """The driver broke the protocol (e.g. ended an execution twice)."""


class NoProgress(SchedulerError):
    """Too many groups in a row ended without anything to train: the run cannot make progress."""


class CellState(str, enum.Enum):
    ROLLOUT = "rollout"
    TO_TRAINING = "to_training"
    TRAINING = "training"
    TO_ROLLOUT = "to_rollout"


class ExecState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    AWAITING_EVALUATION = "awaiting_evaluation"
    VALID = "valid"
    EXCLUDED = "excluded"


_PENDING = (ExecState.QUEUED, ExecState.RUNNING, ExecState.AWAITING_EVALUATION)


class GroupState(str, enum.Enum):
    ROLLING = "rolling"
    READY = "ready"
    ASSIGNED = "assigned"
    CONSUMED = "consumed"
    DROPPED = "dropped"


@dataclass
class _Execution:
    group_id: int
    state: ExecState = ExecState.QUEUED
    engine: int | None = None


@dataclass
class _Group:
    group_id: int
    version: int
    execution_ids: list[int]
    state: GroupState = GroupState.ROLLING
    valid: int = 0
    top_up_due: int = 0
    ready_at: float | None = None
    empty: bool = False  # filter rule: fewer than min_valid valid rewards, trains nothing


class _Phase(str, enum.Enum):
    ROLLOUT = "rollout"  # no burst in progress
    ENTERING = "entering"  # the burst's first cells are switching to training
    TRAINING = "training"  # steps of the burst run
    RETURNING = "returning"  # burst over: satellites (or the pool) go back to rollout
    PUBLISHING = "publishing"


@dataclass
class _Step:
    step: int
    assigned: int = 0
    pending_pulls: int = 0
    closed: bool = False
    cells: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Snapshot:
    """A read-only view for tests, metrics and progress displays."""

    now: float
    dispatched: int
    launched: int
    finished: int
    running: int
    capacity: int
    cell_states: tuple[CellState, ...]
    published_version: int
    steps_done: int

    @property
    def waterlevel(self) -> int:
        """w(t) = d(t) − f(t)."""
        return self.dispatched - self.finished


class Scheduler:
    """Boundary dispatch and elastic cell placement, driven by events (see module docstring)."""

    def __init__(self, config: SchedulerConfig, total_steps: int | None = None) -> None:
        self.cfg = config
        self.total_steps = total_steps
        """The run's length in steps (None: unbounded). A burst ends at it even when it has run
        fewer than μ steps: no step starts past the run's last, and its policy is published."""
        self.now = 0.0
        self.d = 0
        self.p = 0
        self.f = 0
        self.published_version = 0
        self.steps_done = 0  # = the policy version held by the core
        self.staleness: list[int] = []  # one entry per consumed group, in consumption order
        self.starvation_dispatches = 0
        self.burst_dispatch_marks: list[tuple[float, int]] = []  # (time, d) after each refill

        self._cells = [CellState.ROLLOUT] * config.cells
        # running execution ids per engine (cells 0..K-1, STANDALONE)
        self._on_engine: dict[int, set[int]] = {c: set() for c in range(config.cells)}
        if config.standalone_capacity > 0:
            self._on_engine[STANDALONE] = set()
        self._live: dict[int, "_Group"] = {}  # groups holding a slot (not consumed, not dropped)
        self._execs: dict[int, _Execution] = {}
        self._groups: dict[int, _Group] = {}
        self._queue: deque[int] = deque()
        self._ready: list[tuple[int, float, int]] = []  # heap of (version, ready_at, group_id)
        self._next_group = 0
        self._next_exec = 0
        self._phase = _Phase.ROLLOUT
        self._burst_steps = 0  # steps finished in the current burst
        self._step: _Step | None = None
        self._supply_since: float | None = None
        self._started = False
        # groups in a row that ended with nothing to train, and why their executions were excluded
        self._futile_kinds: Counter[str] = Counter()
        self._exclusions: Counter[str] = Counter()
        self.futile_limit = max(2 * config.queue_depth_groups, 2 * config.groups_per_step, 8)

    # ============================================================== public API

    def handle(self, event: ev.Event, now: float) -> list[ev.Command]:
        """Apply one event at time ``now`` and return the commands it causes, in order."""
        if now < self.now - 1e-9:
            raise SchedulerError(f"time went backwards: {now} < {self.now}")
        self.now = max(now, self.now)
        out: list[ev.Command] = []
        if isinstance(event, ev.Start):
            self._on_start(out)
        elif not self._started:
            raise SchedulerError(f"{type(event).__name__} before Start")
        elif isinstance(event, ev.ExecutionEnded):
            self._on_execution_ended(event, out)
        elif isinstance(event, ev.EvaluationValid):
            self._on_evaluation_valid(event, out)
        elif isinstance(event, ev.EvaluationUnresolved):
            self._on_evaluation_unresolved(event, out)
        elif isinstance(event, ev.BufferLow):
            self._on_buffer_low(event, out)
        elif isinstance(event, ev.MicroStepsDone):
            self._on_step_done(event, out)
        elif isinstance(event, ev.TransitionDone):
            self._on_transition_done(event, out)
        elif isinstance(event, ev.PublicationDone):
            self._on_publication_done(event, out)
        elif isinstance(event, ev.Tick):
            pass
        else:  # pragma: no cover - typing guards this
            raise SchedulerError(f"unknown event {event!r}")
        self._advance(out)
        return out

    def next_wakeup(self) -> float | None:
        """When the driver must send a Tick if nothing else happens (the τ supply timer)."""
        if self._supply_since is None or not self._join_possible_soon():
            return None
        due = self._supply_since + self.cfg.supply_window_s
        return due if due > self.now else None

    def snapshot(self) -> Snapshot:
        return Snapshot(
            now=self.now,
            dispatched=self.d,
            launched=self.p,
            finished=self.f,
            running=self.p - self.f,
            capacity=self.cfg.capacity(self.cells_in_training()),
            cell_states=tuple(self._cells),
            published_version=self.published_version,
            steps_done=self.steps_done,
        )

    def publication_pending(self) -> bool:
        """The last burst is over but its policy is not published yet: satellites are still
        returning (the core publishes after them, rule 6) or the publication is in flight."""
        return self._phase in (_Phase.RETURNING, _Phase.PUBLISHING)

    def cells_in_training(self) -> int:
        """k(t): cells not serving rollouts (switching either way, or training)."""
        return sum(1 for s in self._cells if s is not CellState.ROLLOUT)

    def check_invariants(self) -> None:
        """Raise AssertionError if a structural invariant is broken (used by property tests)."""
        assert 0 <= self.f <= self.p <= self.d, (self.d, self.p, self.f)
        queued = sum(1 for e in self._execs.values() if e.state is ExecState.QUEUED)
        assert self.d - self.p == queued == len(self._queue), (self.d, self.p, queued)
        on_engines = sum(
            1 for e in self._execs.values() if e.state in (ExecState.RUNNING, ExecState.CANCELLING)
        )
        assert self.p - self.f == on_engines == sum(len(v) for v in self._on_engine.values())
        assert on_engines <= self.cfg.capacity(self.cells_in_training()), "capacity exceeded"
        for engine, running in self._on_engine.items():
            assert len(running) <= self._engine_capacity(engine), f"engine {engine} over capacity"
            assert all(self._execs[e].engine == engine for e in running)
            if engine != STANDALONE and running:
                assert self._cells[engine] is CellState.ROLLOUT, f"cell {engine} serves in {self._cells[engine]}"
        training = [s in (CellState.TO_TRAINING, CellState.TRAINING) for s in self._cells]
        k = sum(training)
        assert training == [True] * k + [False] * (len(training) - k), f"not a prefix: {self._cells}"

    # ============================================================== event handlers

    def _on_start(self, out: list[ev.Command]) -> None:
        if self._started:
            raise SchedulerError("Start received twice")
        self._started = True
        if self.cfg.mode is Mode.ASYNC:
            self._phase = _Phase.TRAINING  # the fixed training pool never leaves training
            self._to_training(range(self.cfg.async_training_cells), out)
        self._dispatch_groups(self.cfg.queue_depth_groups, out)
        self.burst_dispatch_marks.append((self.now, self.d))

    def _on_execution_ended(self, e: ev.ExecutionEnded, out: list[ev.Command]) -> None:
        x = self._execs.get(e.execution_id)
        if x is None or x.state not in (ExecState.RUNNING, ExecState.CANCELLING):
            state = None if x is None else x.state.value
            raise SchedulerError(f"execution {e.execution_id} ended while {state}")
        self.f += 1
        assert x.engine is not None
        self._on_engine[x.engine].discard(e.execution_id)
        x.engine = None
        g = self._groups[x.group_id]
        if x.state is ExecState.CANCELLING or e.outcome in (Outcome.CANCELLED, Outcome.OVERALL_TIMEOUT):
            if x.state is not ExecState.CANCELLING:
                self._exclusions["overall timeouts" if e.outcome is Outcome.OVERALL_TIMEOUT
                                 else "cancelled by the driver"] += 1
            x.state = ExecState.EXCLUDED
            self._check_short(g, out)
        else:
            x.state = ExecState.AWAITING_EVALUATION

    def _on_evaluation_valid(self, e: ev.EvaluationValid, out: list[ev.Command]) -> None:
        x = self._evaluated(e.execution_id)
        if x is None:
            return
        x.state = ExecState.VALID
        g = self._groups[x.group_id]
        if g.state is not GroupState.ROLLING:
            return  # a surplus execution finishing after its group was full: counted, not used
        g.valid += 1
        if g.valid >= self.cfg.group_size:
            self._group_ready(g, out)
        else:
            self._maybe_filter(g, out)  # its last execution may just have been evaluated

    def _on_evaluation_unresolved(self, e: ev.EvaluationUnresolved, out: list[ev.Command]) -> None:
        x = self._evaluated(e.execution_id)
        if x is None or not e.final:
            return  # retried by the evaluator against the same preserved state
        x.state = ExecState.EXCLUDED
        self._exclusions["evaluations unresolved within the budget"] += 1
        self._check_short(self._groups[x.group_id], out)

    def _evaluated(self, execution_id: int) -> _Execution | None:
        x = self._execs.get(execution_id)
        if x is None:
            raise SchedulerError(f"evaluation of unknown execution {execution_id}")
        if x.state is ExecState.EXCLUDED:
            return None  # e.g. cancelled surplus: its late evaluation is ignored
        if x.state is not ExecState.AWAITING_EVALUATION:
            raise SchedulerError(f"evaluation of execution {execution_id} while {x.state.value}")
        return x

    def _on_buffer_low(self, e: ev.BufferLow, out: list[ev.Command]) -> None:
        st = self._step
        if st is None or st.step != e.step or st.closed:
            return  # stale signal
        st.pending_pulls += 1
        self._serve_pulls(out)

    def _on_step_done(self, e: ev.MicroStepsDone, out: list[ev.Command]) -> None:
        st = self._step
        if st is None or st.step != e.step or not st.closed:
            raise SchedulerError(f"MicroStepsDone({e.step}) but the running step is {st}")
        for gid in [gid for gid, g in self._live.items() if g.state is GroupState.ASSIGNED]:
            self._live.pop(gid).state = GroupState.CONSUMED
        self._step = None
        self.steps_done += 1
        self._burst_steps += 1
        if self._burst_steps_left() > 0:
            return  # the next step of the burst starts in _advance
        self._phase = _Phase.RETURNING
        kept = self._kept_cells()
        for cell in range(self.cfg.cells):
            if cell not in kept and self._cells[cell] is CellState.TRAINING:
                self._to_rollout(cell, out)
        # cells still switching *to* training are sent back when they arrive (_on_transition_done)

    def _on_transition_done(self, e: ev.TransitionDone, out: list[ev.Command]) -> None:
        cell = e.cell
        expected = CellState.TO_TRAINING if e.role is Role.TRAINING else CellState.TO_ROLLOUT
        if not 0 <= cell < self.cfg.cells:
            raise SchedulerError(f"TransitionDone for unknown cell {cell}")
        if self._cells[cell] is not expected:
            raise SchedulerError(f"TransitionDone({cell}, {e.role.value}) while {self._cells[cell].value}")
        if e.role is Role.ROLLOUT:
            self._cells[cell] = CellState.ROLLOUT
            return
        self._cells[cell] = CellState.TRAINING
        self._supply_since = None  # timer resets after each transition
        if self._phase is _Phase.RETURNING and cell not in self._kept_cells():
            self._to_rollout(cell, out)  # arrived after its burst ended
            return
        if self._phase is _Phase.ENTERING and self._burst_ready():
            self._phase = _Phase.TRAINING
        elif self._step is not None and not self._step.closed and cell not in self._step.cells:
            self._step.cells.add(cell)
            out.append(ev.JoinStep(self._step.step, cell))

    def _on_publication_done(self, e: ev.PublicationDone, out: list[ev.Command]) -> None:
        if self._phase is not _Phase.PUBLISHING or e.version != self.steps_done:
            raise SchedulerError(f"PublicationDone({e.version}) unexpected")
        self.published_version = e.version
        self._refill(out)
        self._burst_steps = 0
        if self.cfg.mode is Mode.ASYNC:
            self._phase = _Phase.TRAINING
        elif self.cfg.mode is Mode.COLOCATE:
            self._phase = _Phase.ROLLOUT
        else:
            # rule (6): the core stays only if supply and capacity allow; w now includes the μ·N·B
            # executions just dispatched
            c = self.cfg
            supply_ok = len(self._ready) >= c.rho_min * c.groups_per_step
            capacity_ok = self.d - self.f <= (c.cells - 1) * c.cell_capacity + c.standalone_capacity
            if supply_ok and capacity_ok:
                self._phase = _Phase.TRAINING
            else:
                self._phase = _Phase.ROLLOUT
                self._to_rollout(0, out)
        self._supply_since = None

    # ============================================================== the rules

    def _advance(self, out: list[ev.Command]) -> None:
        """Apply every rule whose condition now holds, until nothing changes."""
        for _ in range(4 * self.cfg.cells + 8):
            before = len(out)
            self._update_supply_timer()
            self._launch(out)
            self._maybe_start_step(out)
            self._serve_pulls(out)
            self._maybe_finish_burst(out)
            self._update_supply_timer()
            self._maybe_enter_training(out)
            if len(out) == before:
                return

    # -- (4) launches -------------------------------------------------------------------------

    def _engine_capacity(self, engine: int) -> int:
        return self.cfg.standalone_capacity if engine == STANDALONE else self.cfg.cell_capacity

    def _destinations(self) -> list[int]:
        """Standalone first, then rollout cells by descending index (they stay in rollout longest)."""
        order = [STANDALONE] if STANDALONE in self._on_engine else []
        order += [c for c in range(self.cfg.cells - 1, -1, -1) if self._cells[c] is CellState.ROLLOUT]
        return order

    def _launch(self, out: list[ev.Command]) -> None:
        if not self._queue:
            return
        for engine in self._destinations():
            running = self._on_engine[engine]
            free = self._engine_capacity(engine) - len(running)
            while free > 0 and self._queue:
                eid = self._queue.popleft()
                x = self._execs[eid]
                x.state, x.engine = ExecState.RUNNING, engine
                running.add(eid)
                self.p += 1
                free -= 1
                out.append(ev.Launch(eid, x.group_id, engine))
            if not self._queue:
                return

    # -- (1) dispatch ---------------------------------------------------------------------------

    def _dispatch_groups(self, n_groups: int, out: list[ev.Command]) -> None:
        for _ in range(n_groups):
            gid = self._next_group
            self._next_group += 1
            eids = self._new_executions(gid, self.cfg.executions_per_group)
            self._groups[gid] = self._live[gid] = _Group(gid, self.published_version, eids)
            out.append(ev.DispatchGroup(gid, tuple(eids), self.published_version))

    def _new_executions(self, gid: int, n: int) -> list[int]:
        eids = list(range(self._next_exec, self._next_exec + n))
        self._next_exec += n
        for eid in eids:
            self._execs[eid] = _Execution(gid)
            self._queue.append(eid)
        self.d += n
        return eids

    def _top_up(self, g: _Group, out: list[ev.Command]) -> None:
        self._note_futile("topped up")
        eids = self._new_executions(g.group_id, g.top_up_due)
        g.execution_ids.extend(eids)
        g.top_up_due = 0
        out.append(ev.DispatchGroup(g.group_id, tuple(eids), g.version, refill_of=g.group_id))

    def _refill(self, out: list[ev.Command]) -> None:
        """At publication: top up short groups and restore the queue depth to Q_b."""
        for g in list(self._live.values()):
            if g.top_up_due and g.state is GroupState.ROLLING:
                self._top_up(g, out)
        self._dispatch_groups(max(0, self.cfg.queue_depth_groups - len(self._live)), out)
        self.burst_dispatch_marks.append((self.now, self.d))

    # -- groups -----------------------------------------------------------------------------------

    def _group_ready(self, g: _Group, out: list[ev.Command]) -> None:
        if g.empty:
            self._note_futile("empty")
        else:
            self._futile_kinds.clear()
            self._exclusions.clear()
        g.state = GroupState.READY
        g.ready_at = self.now
        g.top_up_due = 0
        heapq.heappush(self._ready, (g.version, self.now, g.group_id))
        self._cancel_rest(g, out)  # oversampled surplus: counted once in f

    def _cancel_rest(self, g: _Group, out: list[ev.Command]) -> None:
        for eid in g.execution_ids:
            x = self._execs[eid]
            if x.state is ExecState.QUEUED:
                # never launched: counts as launched and finished at once, so f moves exactly once
                self._queue.remove(eid)
                x.state = ExecState.EXCLUDED
                self.p += 1
                self.f += 1
            elif x.state is ExecState.RUNNING:
                x.state = ExecState.CANCELLING
                out.append(ev.Cancel(eid))

    def _maybe_filter(self, g: _Group, out: list[ev.Command]) -> None:
        """Filter rule: a group whose executions have all terminated is ready with what it holds."""
        if self.cfg.short_group is not ShortGroupRule.FILTER or g.state is not GroupState.ROLLING:
            return
        if any(self._execs[eid].state in _PENDING for eid in g.execution_ids):
            return
        g.empty = g.valid < self.cfg.min_valid
        out.append(ev.GroupFiltered(g.group_id, g.valid, g.empty))
        self._group_ready(g, out)

    @property
    def futile_groups(self) -> int:
        """Groups in a row that ended with nothing to train (empty, dropped or topped up)."""
        return sum(self._futile_kinds.values())

    def _note_futile(self, kind: str) -> None:
        self._futile_kinds[kind] += 1
        if self.futile_groups < self.futile_limit:
            return
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self._futile_kinds.items()))
        causes = ", ".join(f"{n} {k}" for k, n in self._exclusions.most_common()) or "none recorded"
        raise NoProgress(
            f"no progress: the last {self.futile_groups} groups ended with nothing to train ({kinds}; "
            f"a group needs {self.cfg.min_valid} valid rewards under the {self.cfg.short_group.value} "
            f"rule, {self.cfg.group_size} otherwise). Their executions were excluded by: {causes}. "
            f"Check the harness's overall budget and the evaluator."
        )

    def _check_short(self, g: _Group, out: list[ev.Command]) -> None:
        """A group that can no longer collect N valid rewards is filtered, topped up or dropped."""
        if g.state is not GroupState.ROLLING:
            return
        if self.cfg.short_group is ShortGroupRule.FILTER:
            self._maybe_filter(g, out)
            return
        possible = g.valid + sum(1 for eid in g.execution_ids if self._execs[eid].state in _PENDING)
        missing = self.cfg.group_size - possible - g.top_up_due
        if missing <= 0:
            return
        if self.cfg.short_group is ShortGroupRule.DROP:
            g.state = GroupState.DROPPED
            del self._live[g.group_id]
            self._cancel_rest(g, out)
            out.append(ev.GroupDropped(g.group_id))
            self._note_futile("dropped")
        else:
            g.top_up_due += missing
        self._prevent_starvation(out)

    def _prevent_starvation(self, out: list[ev.Command]) -> None:
        """If the groups in the slots can no longer supply this burst, dispatch now (not at the
        next publication, which would never come). The only way d rises inside a burst."""
        needed = self._burst_steps_left() * self.cfg.groups_per_step
        if self._step is not None:
            needed -= self._step.assigned
        if self._phase in (_Phase.RETURNING, _Phase.PUBLISHING):
            return
        completable = [
            g for g in self._live.values()
            if g.state in (GroupState.ROLLING, GroupState.READY) and not g.top_up_due
        ]
        short = sorted(
            (g for g in self._live.values() if g.state is GroupState.ROLLING and g.top_up_due),
            key=lambda g: g.group_id,
        )
        deficit = needed - len(completable)
        if deficit <= 0:
            return
        self.starvation_dispatches += 1
        for g in short[:deficit]:
            self._top_up(g, out)
            deficit -= 1
        if deficit > 0:
            self._dispatch_groups(deficit, out)

    # -- (5) entering training ------------------------------------------------------------------

    def _supply(self) -> int:
        """Ready unassigned groups, capped by the groups the current batch still needs."""
        needed = self.cfg.groups_per_step - (self._step.assigned if self._step else 0)
        if self._step is not None and self._step.closed:
            needed = 0
        return min(len(self._ready), needed)

    def _supply_ok(self) -> bool:
        return self._supply() >= self.cfg.rho_min * self.cfg.groups_per_step - 1e-9

    def _update_supply_timer(self) -> None:
        if self._supply_ok():
            if self._supply_since is None:
                self._supply_since = self.now
        else:
            self._supply_since = None

    def _supply_held(self) -> bool:
        return (
            self._supply_since is not None
            and self.now - self._supply_since >= self.cfg.supply_window_s - 1e-9
        )

    def _join_possible_soon(self) -> bool:
        mode = self.cfg.mode
        if mode is Mode.ASYNC:
            return self._phase is _Phase.TRAINING and self._step is None and self.cfg.is_streaming
        if any(s is CellState.TO_TRAINING for s in self._cells):
            return False
        if mode is Mode.COLOCATE:
            return self._phase is _Phase.ROLLOUT
        k = self.cells_in_training()
        return self._phase in (_Phase.ROLLOUT, _Phase.TRAINING) and k < self.cfg.cells

    def _maybe_enter_training(self, out: list[ev.Command]) -> None:
        c = self.cfg
        if c.mode is Mode.ASYNC or not self._join_possible_soon() or not self._supply_held():
            return
        w = self.d - self.f
        if c.mode is Mode.COLOCATE:
            if w > c.standalone_capacity or any(s is not CellState.ROLLOUT for s in self._cells):
                return
            self._phase = _Phase.ENTERING
            self._burst_steps = 0
            self._to_training(range(c.cells), out)
            return
        k = self.cells_in_training()
        if self._phase is _Phase.ROLLOUT and k != 0:
            return  # the core is still returning
        if w > (c.cells - k - 1) * c.cell_capacity + c.standalone_capacity:
            return
        if self._phase is _Phase.ROLLOUT:
            self._phase = _Phase.ENTERING
            self._burst_steps = 0
        self._to_training([k], out)

    def _to_training(self, cells: "range | list[int]", out: list[ev.Command]) -> None:
        """Stop intake on the cells, reserve capacity elsewhere and reroute their executions there
        (the router's destination order), then switch them."""
        for cell in cells:
            self._cells[cell] = CellState.TO_TRAINING
        destinations = self._destinations()
        for cell in cells:
            for eid in sorted(self._on_engine[cell]):
                for dest in destinations:
                    if len(self._on_engine[dest]) < self._engine_capacity(dest):
                        break
                else:  # pragma: no cover - rule (5) guarantees room
                    raise SchedulerError(f"no capacity to reroute execution {eid} from cell {cell}")
                self._on_engine[dest].add(eid)
                self._execs[eid].engine = dest
                out.append(ev.Reroute(eid, cell, dest))
            self._on_engine[cell].clear()
            out.append(ev.CellToTraining(cell))
        self._supply_since = None

    def _to_rollout(self, cell: int, out: list[ev.Command]) -> None:
        self._cells[cell] = CellState.TO_ROLLOUT
        out.append(ev.CellToRollout(cell))

    # -- steps ---------------------------------------------------------------------------------

    def _burst_ready(self) -> bool:
        """Every cell that the burst start needs is in training."""
        if self.cfg.mode is Mode.COLOCATE:
            return all(s is CellState.TRAINING for s in self._cells)
        return self._cells[0] is CellState.TRAINING

    def _burst_steps_left(self) -> int:
        """Steps the current burst may still start: μ less those it finished, and never past the
        run's last step."""
        left = self.cfg.steps_per_burst - self._burst_steps
        if self.total_steps is not None:
            left = min(left, self.total_steps - self.steps_done)
        return max(0, left)

    def _maybe_start_step(self, out: list[ev.Command]) -> None:
        c = self.cfg
        if self._phase is _Phase.ENTERING and self._burst_ready():
            self._phase = _Phase.TRAINING
        if self._phase is not _Phase.TRAINING or self._step is not None:
            return
        if self._burst_steps_left() <= 0:
            return
        if c.mode is Mode.ASYNC:
            if any(self._cells[i] is not CellState.TRAINING for i in range(c.async_training_cells)):
                return
            if self._burst_steps == 0 and c.is_streaming and not self._supply_held():
                return
        if not c.is_streaming and len(self._ready) < c.groups_per_step:
            return
        cells = tuple(i for i, s in enumerate(self._cells) if s is CellState.TRAINING)
        self._step = _Step(self.steps_done, cells=set(cells))
        out.append(ev.StartStep(self.steps_done, cells))
        self._supply_since = None  # timer resets at each batch start
        self._step.pending_pulls = c.groups_per_step if not c.is_streaming else 1

    def _serve_pulls(self, out: list[ev.Command]) -> None:
        st = self._step
        if st is None:
            return
        while st.pending_pulls > 0 and self._ready and not st.closed:
            version, _, gid = heapq.heappop(self._ready)
            g = self._groups[gid]
            g.state = GroupState.ASSIGNED
            st.assigned += 1
            st.pending_pulls -= 1
            staleness = st.step - g.version
            self.staleness.append(staleness)
            out.append(ev.AssignGroup(st.step, gid, staleness))
            if st.assigned == self.cfg.groups_per_step:
                st.closed = True
                st.pending_pulls = 0
                out.append(ev.CloseStream(st.step))

    def _maybe_finish_burst(self, out: list[ev.Command]) -> None:
        if self._phase is not _Phase.RETURNING:
            return
        kept = self._kept_cells()
        if any(s is not CellState.ROLLOUT for i, s in enumerate(self._cells) if i not in kept):
            return
        self._phase = _Phase.PUBLISHING
        out.append(ev.Publish(self.steps_done))

    def _kept_cells(self) -> set[int]:
        """Cells that stay in training across a burst end: Gyre's core (it decides after
        publication), Async's whole training pool, none for Colocate."""
        if self.cfg.mode is Mode.GYRE:
            return {0}
        if self.cfg.mode is Mode.ASYNC:
            return set(range(self.cfg.async_training_cells))
        return set()
