"""Discrete-event simulation that drives the real :class:`~gyre_core.scheduler.Scheduler`.

The simulator plays the world: harness executions take the durations a workload gives them,
evaluation takes ``evaluation_s``, role switches and publication take their measured costs, and a
training step processes its groups' tokens at ``cell_tokens_per_s`` per training cell (perfect
scaling across cells; no gradient-reduction cost). Everything the scheduler decides is the
scheduler's own code — nothing here re-implements a rule.
"""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import asdict, dataclass, field
from typing import IO, Callable

from gyre_core.config import ConfigError, SchedulerConfig
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.commands import carry_out
from gyre_core.scheduler.events import Outcome, Role
from gyre_core.scheduler.state_machine import Scheduler
from gyre_core.simulator.timeline import training_shares
from gyre_core.simulator.workload import ExecutionRecord, GroupDraw, Workload


class SimulationStalled(RuntimeError):
    """The event queue ran dry before the requested steps: a scheduling deadlock."""


@dataclass(frozen=True)
class SimParams:
    """The world the scheduler is simulated against (times in seconds)."""

    steps: int = 48
    seed: int = 0
    cell_tokens_per_s: float = 1.0e4
    rollout_to_training_s: float = 8.52  # paper, Figure 6
    training_to_rollout_s: float = 3.46  # paper, Figure 6
    publication_s: float = 30.0
    evaluation_s: float = 0.0
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"steps: must be an integer ≥ 1, got {self.steps!r}")
        if not self.cell_tokens_per_s > 0:
            raise ConfigError(f"cell_tokens_per_s: must be > 0, got {self.cell_tokens_per_s!r}")
        for name in ("rollout_to_training_s", "training_to_rollout_s", "publication_s",
                     "evaluation_s", "optimizer_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: must be ≥ 0, got {getattr(self, name)!r}")


@dataclass
class GroupTimes:
    """Per-group timestamps, for the Little's-law check and reports."""

    dispatched: float
    version: int
    ready: float | None = None
    step: int | None = None


@dataclass
class SimResult:
    mode: str
    phi: float
    mu: int
    end_to_end_s: float
    steps: int
    staleness: list[int]
    cell_training_share: list[float]
    intervals: list[tuple[int, str, float, float]]
    step_start_s: list[float]
    step_end_s: list[float]
    groups: dict[int, GroupTimes]
    dispatched: int
    launched: int
    finished: int
    reroutes: int
    role_switches: dict[str, int]
    starvation_dispatches: int
    async_training_cells: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0

    def summary(self) -> dict:
        """The per-mode object of ``gyre-orchestrate simulate --json``."""
        out = {
            "end_to_end_s": round(self.end_to_end_s, 3),
            "steps": self.steps,
            "mean_staleness": round(self.mean_staleness, 4),
            "phi": self.phi,
            "mu": self.mu,
            "cell_training_share": [round(s, 4) for s in self.cell_training_share],
            "role_switches": self.role_switches,
            "reroutes": self.reroutes,
            "executions": {"dispatched": self.dispatched, "launched": self.launched,
                           "finished": self.finished},
        }
        if self.async_training_cells is not None:
            out["async_training_cells"] = self.async_training_cells
        return out


# kinds of simulated happenings, in the heap as (time, seq, kind, payload)
_END, _CANCEL, _EVAL, _TRANSITION, _PUBLICATION, _TRAIN, _BUFFER_LOW, _STEP_DONE, _TICK = range(9)


class Simulation:
    """One run of one mode on one workload."""

    def __init__(
        self,
        config: SchedulerConfig,
        workload: Workload,
        params: SimParams,
        event_log: IO[str] | None = None,
        progress: Callable[[int, float], None] | None = None,
    ) -> None:
        self.cfg = config
        self.workload = workload
        self.params = params
        self.sched = Scheduler(config, total_steps=params.steps)
        self.rng = random.Random(params.seed)
        self.event_log = event_log
        self.progress = progress
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        # world state
        self._records: dict[int, ExecutionRecord] = {}
        self._draws: dict[int, GroupDraw] = {}
        self._exec_group: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._valid_tokens: dict[int, list[int]] = {}
        self._groups: dict[int, GroupTimes] = {}
        self._tick_at: float | None = None
        # training (a fluid model of the streaming step)
        self._step: int | None = None
        self._train_cells: set[int] = set()
        self._work_left = 0.0
        self._train_t = 0.0
        self._train_token = 0
        self._closed = False
        self._awaiting_group = False
        # metrics
        self._role: list[tuple[str, float]] = [("rollout", 0.0)] * config.cells
        self._intervals: list[tuple[int, str, float, float]] = []
        self._step_start: list[float] = []
        self._step_end: list[float] = []
        self._reroutes = 0
        self._switches = {"to_training": 0, "to_rollout": 0}

    # ------------------------------------------------------------------ loop

    def run(self) -> SimResult:
        self._handle(ev.Start())
        while self.sched.steps_done < self.params.steps:
            if not self._heap:
                snap = self.sched.snapshot()
                raise SimulationStalled(
                    f"{self.cfg.mode.value}: nothing left to happen at t={self.now:.0f}s after "
                    f"{snap.steps_done} steps (d={snap.dispatched}, p={snap.launched}, "
                    f"f={snap.finished}, cells={[s.value for s in snap.cell_states]})"
                )
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            self._fire(kind, payload)
        for cell, (role, since) in enumerate(self._role):
            self._close_interval(cell, role, since)
        return self._result()

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _fire(self, kind: int, payload: object) -> None:
        if kind == _END:
            eid, outcome = payload  # type: ignore[misc]
            if eid in self._cancelled:
                return  # its cancellation already ended it
            self._handle(ev.ExecutionEnded(eid, outcome))
            if outcome is Outcome.OVERALL_TIMEOUT:
                return  # budget spent before a valid reward: excluded, nothing to evaluate
            self._push(self.now + self.params.evaluation_s, _EVAL, eid)
        elif kind == _EVAL:
            eid = payload  # type: ignore[assignment]
            self._on_valid(eid)
            self._handle(ev.EvaluationValid(eid))
        elif kind == _TRANSITION:
            cell, role = payload  # type: ignore[misc]
            self._set_role(cell, role.value)
            self._handle(ev.TransitionDone(cell, role))
        elif kind == _PUBLICATION:
            self._handle(ev.PublicationDone(payload))  # type: ignore[arg-type]
        elif kind == _TRAIN:
            if payload == self._train_token:
                self._train_sync()
                self._work_left = 0.0
                self._after_work_change()
        elif kind == _CANCEL:
            self._handle(ev.ExecutionEnded(payload, Outcome.CANCELLED))  # type: ignore[arg-type]
        elif kind == _BUFFER_LOW:
            self._handle(ev.BufferLow(payload))  # type: ignore[arg-type]
        elif kind == _STEP_DONE:
            step = payload
            if self.progress is not None:
                self.progress(step + 1, self.now)  # type: ignore[operator]
            self._handle(ev.MicroStepsDone(step))  # type: ignore[arg-type]
        elif kind == _TICK:
            self._tick_at = None
            self._handle(ev.Tick())

    def _handle(self, event: ev.Event) -> None:
        commands = self.sched.handle(event, self.now)
        if self.event_log is not None:
            self._log("event", event)
        for cmd in commands:
            if self.event_log is not None:
                self._log("command", cmd)
            self._execute(cmd)
        wake = self.sched.next_wakeup()
        if wake is not None and (self._tick_at is None or wake < self._tick_at):
            self._tick_at = wake
            self._push(wake, _TICK, None)

    def _log(self, kind: str, obj: object) -> None:
        record = {"t": round(self.now, 3), kind: type(obj).__name__, **asdict(obj)}  # type: ignore[call-overload]
        self.event_log.write(json.dumps(record, default=str) + "\n")  # type: ignore[union-attr]

    # ------------------------------------------------------------------ commands

    def _execute(self, cmd: ev.Command) -> None:
        carry_out(self, cmd)

    # One method per scheduler command (the CommandHandler interface), in simulated time.

    def on_dispatch_group(self, cmd: ev.DispatchGroup) -> None:
        self._dispatch(cmd)

    def on_launch(self, cmd: ev.Launch) -> None:
        rec = self._records[cmd.execution_id]
        self._push(self.now + rec.duration_s, _END, (cmd.execution_id, rec.outcome))

    def on_cancel(self, cmd: ev.Cancel) -> None:
        # immediate in the simulated world; queued so the scheduler is not re-entered
        self._cancelled.add(cmd.execution_id)
        self._push(self.now, _CANCEL, cmd.execution_id)

    def on_reroute(self, cmd: ev.Reroute) -> None:
        self._reroutes += 1

    def on_cell_to_training(self, cmd: ev.CellToTraining) -> None:
        self._switches["to_training"] += 1
        self._set_role(cmd.cell, "to_training")
        self._push(self.now + self.params.rollout_to_training_s, _TRANSITION, (cmd.cell, Role.TRAINING))

    def on_cell_to_rollout(self, cmd: ev.CellToRollout) -> None:
        self._switches["to_rollout"] += 1
        self._set_role(cmd.cell, "to_rollout")
        self._push(self.now + self.params.training_to_rollout_s, _TRANSITION, (cmd.cell, Role.ROLLOUT))

    def on_start_step(self, cmd: ev.StartStep) -> None:
        self._step, self._closed, self._work_left = cmd.step, False, 0.0
        self._train_cells = set(cmd.cells)
        self._train_t = self.now
        self._awaiting_group = True  # the scheduler serves the step's first pull itself
        self._step_start.append(self.now)

    def on_join_step(self, cmd: ev.JoinStep) -> None:
        self._train_sync()
        self._train_cells.add(cmd.cell)
        self._after_work_change()

    def on_assign_group(self, cmd: ev.AssignGroup) -> None:
        self._train_sync()
        self._groups[cmd.group_id].step = cmd.step
        self._work_left += sum(self._valid_tokens[cmd.group_id][: self.cfg.group_size])
        self._awaiting_group = False
        self._after_work_change()

    def on_close_stream(self, cmd: ev.CloseStream) -> None:
        self._train_sync()
        self._closed = True
        self._after_work_change()

    def on_publish(self, cmd: ev.Publish) -> None:
        self._push(self.now + self.params.publication_s, _PUBLICATION, cmd.version)

    def on_group_filtered(self, cmd: ev.GroupFiltered) -> None:
        if cmd.empty:
            self._valid_tokens[cmd.group_id] = []  # consumed once, trains nothing
        self._groups[cmd.group_id].ready = self.now

    def on_group_dropped(self, cmd: ev.GroupDropped) -> None:
        pass  # the simulated buffer holds nothing to discard

    def _dispatch(self, cmd: ev.DispatchGroup) -> None:
        n = len(cmd.execution_ids)
        if cmd.refill_of is None:
            draw = self.workload.draw_group(self.rng, n)
            self._draws[cmd.group_id] = draw
            self._groups[cmd.group_id] = GroupTimes(self.now, cmd.version)
            self._valid_tokens[cmd.group_id] = []
            records = list(draw.executions)
        else:  # top-up: more executions of the same query, resampled from its recorded ones
            pool = self._draws[cmd.refill_of].executions
            records = [self.rng.choice(pool) for _ in range(n)]
        for eid, rec in zip(cmd.execution_ids, records):
            self._records[eid] = rec
            self._exec_group[eid] = cmd.group_id

    def _on_valid(self, eid: int) -> None:
        gid = self._exec_group[eid]
        tokens = self._valid_tokens[gid]
        rec = self._records[eid]
        tokens.append(rec.tokens if rec.tokens is not None else 0)
        g = self._groups[gid]
        if len(tokens) == self.cfg.group_size and g.ready is None:
            g.ready = self.now

    # ------------------------------------------------------------------ training model

    def _rate(self) -> float:
        return self.params.cell_tokens_per_s * len(self._train_cells)

    def _train_sync(self) -> None:
        if self._step is not None:
            self._work_left = max(0.0, self._work_left - self._rate() * (self.now - self._train_t))
        self._train_t = self.now

    def _after_work_change(self) -> None:
        """Schedule the moment the assigned work runs out, or act on it now."""
        if self._step is None:
            return
        self._train_token += 1
        if self._work_left > 1e-9:
            self._push(self.now + self._work_left / self._rate(), _TRAIN, self._train_token)
            return
        if self._closed:
            step = self._step
            self._step = None
            self._step_end.append(self.now + self.params.optimizer_s)
            self._push(self.now + self.params.optimizer_s, _STEP_DONE, step)
        elif not self._awaiting_group:
            self._awaiting_group = True
            self._push(self.now, _BUFFER_LOW, self._step)

    # ------------------------------------------------------------------ metrics

    def _set_role(self, cell: int, role: str) -> None:
        prev, since = self._role[cell]
        self._close_interval(cell, prev, since)
        self._role[cell] = (role, self.now)

    def _close_interval(self, cell: int, role: str, since: float) -> None:
        if self.now > since:
            self._intervals.append((cell, role, since, self.now))

    def _result(self) -> SimResult:
        end = self.now
        share = training_shares(self._intervals, self.cfg.cells, end)
        snap = self.sched.snapshot()
        return SimResult(
            mode=self.cfg.mode.value,
            phi=self.cfg.extra_dispatch,
            mu=self.cfg.steps_per_burst,
            end_to_end_s=end,
            steps=snap.steps_done,
            staleness=list(self.sched.staleness),
            cell_training_share=share,
            intervals=self._intervals,
            step_start_s=self._step_start,
            step_end_s=self._step_end,
            groups=self._groups,
            dispatched=snap.dispatched,
            launched=snap.launched,
            finished=snap.finished,
            reroutes=self._reroutes,
            role_switches=dict(self._switches),
            starvation_dispatches=self.sched.starvation_dispatches,
            extra={"refills": list(self.sched.burst_dispatch_marks)},
            async_training_cells=(
                self.cfg.async_training_cells if self.cfg.mode.value == "async" else None
            ),
        )

