"""The live driver: the same :class:`~gyre_core.scheduler.state_machine.Scheduler` the simulator
drives, now driving real cells, the TITO proxy, harness processes and the data plane.

One asyncio loop owns the scheduler. Everything that happens in the world (a harness exits, an
evaluation answers, a role switch or a training step completes, a publication lands, the packing
buffer runs low) becomes an event on one queue; the loop feeds each event to
``Scheduler.handle(event, now)`` and carries out the commands it returns. Blocking backend calls
(Megatron ranks, evaluators) run in worker threads and report back as events, so the scheduler is
never re-entered and never waits. Nothing here decides *what* to do -- only the scheduler does.

Accounting (what the summary reports): every dispatched execution is launched or cancelled once;
every launched one ends once (completed, harness timeout, failed, cancelled); every ended one is
trained, dropped with its group, surplus, or excluded (unresolved past its budget). A finished
execution with a valid reward is never silently lost: it is in the trajectory buffer until its
group is consumed or dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from gyre_core.dataplane.assessment import AssessmentLedger, EvalState
from gyre_core.dataplane.packing import PackingConfig, StreamPackingBuffer
from gyre_core.dataplane.trajectory_buffer import ScoredExecution, TrajectoryBuffer
from gyre_core.interfaces import (
    Assessment,
    ExecutionSpec,
    PhaseTiming,
    ServingSide,
    StateRef,
    TrainingSide,
    WeightsRef,
)
from gyre_core.orchestrator.harness import classify_end
from gyre_core.orchestrator.journal import Journal, Replay, event_from_json, selected_from_json, selected_to_json, tree_from_json, tree_to_json
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.orchestrator.resume_commands import ReplayCommands
from gyre_core.orchestrator.training_figures import training_figures
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.commands import carry_out
from gyre_core.scheduler.events import Outcome, Role
from gyre_core.scheduler.state_machine import Scheduler

__all__ = ["CellHandles", "LiveOrchestrator", "RunFailed"]

log = logging.getLogger("gyre.orchestrator")


class RunFailed(RuntimeError):
    """The run could not continue (a backend failed in a way the scheduler cannot absorb)."""


@dataclass
class CellHandles:
    """One cell's two halves and its engine's URL (what the proxy routes to)."""

    index: int
    serving: ServingSide
    training: TrainingSide
    engine_url: str


@dataclass
class StandaloneHandles:
    """The standalone rollout pool (``C_s > 0``): one engine that serves all ``C_s`` slots, is
    routed to like a cell's and never switches role; it loads every published version."""

    serving: ServingSide
    engine_url: str


@dataclass
class _Execution:
    group_id: int
    spec: ExecutionSpec | None = None
    handle: Any = None
    engine: int | None = None
    launched_on: int | None = None
    """The engine its Launch named (``engine`` follows later reroutes)."""
    launched_at: float = 0.0
    outcome: Outcome | None = None
    reward: float | None = None
    fate: str = "queued"  # queued, running, ended, trained, dropped, surplus, excluded, cancelled
    trajectory: tuple[Any, Any] | None = None
    """(tree, selected) as the execution ended: the proxy's records, kept for its evaluation."""
    harness_exit: dict[str, Any] | None = None
    """``{"code", "end"}`` when the harness exited non-zero (``end``: failed or crashed)."""


@dataclass
class _Step:
    step: int
    packing: StreamPackingBuffer
    cells: list[int]
    groups: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    started: float = 0.0
    closing: bool = False


def _with_exit(spec: ExecutionSpec, harness_exit: Mapping[str, Any]) -> ExecutionSpec:
    """``spec`` with the harness's exit for the evaluator: ``extra["harness_exit"]`` (the code)
    and ``extra["harness_end"]`` (:data:`gyre_core.orchestrator.harness.HARNESS_ENDS`)."""
    return replace(spec, extra={**spec.extra, "harness_exit": harness_exit["code"], "harness_end": harness_exit["end"]})


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj):
        return {k: _jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "value") and not isinstance(obj, (int, float, str)):
        return obj.value
    return obj


async def load_weights_on(serving: Any, ref: WeightsRef) -> None:
    """Have one serving side load ``ref``: its async method when it has one, else off the loop."""
    aload = getattr(serving, "aload_weights", None)
    if aload is not None:
        await aload(ref)
    else:
        await asyncio.to_thread(serving.load_weights, ref)


def _joins(satellites: Sequence[tuple[int, Sequence[Mapping[str, Any]]]]) -> list[dict[str, Any]]:
    """Per satellite rank that joined the step: where it pulled the core's weights from, how much
    and how fast (a rank already at the step's version pulls nothing)."""
    return [{"cell": cell, "stage": i.get("stage", 0), "pull_from": i.get("pull_from"),
             "pull_bytes": i.get("pull_bytes", 0), "pull_s": round(float(i.get("pull_s", 0.0)), 4)}
            for cell, infos in satellites for i in infos if i.get("joined")]


class LiveOrchestrator:
    """Drive one run. ``cells[0]`` is the core. ``proxy`` is a
    :class:`~gyre_core.proxy.service.ProxyService` serving on ``proxy_url``; ``pm`` the plugin
    manager (harness launch and evaluation hooks); ``weights`` the version the engines serve at
    start."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        cells: Sequence[CellHandles],
        proxy: Any,
        proxy_url: str,
        pm: Any,
        out_dir: Path,
        weights: WeightsRef,
        clock: Callable[[], float] = time.monotonic,
        progress: Callable[[str], None] | None = None,
        event_log: IO[str] | None = None,
        journal: Journal | None = None,
        replay: Replay | None = None,
        sandbox: Mapping[str, Any] | None = None,
        publisher: Any = None,
        standalone: StandaloneHandles | None = None,
    ) -> None:
        if len(cells) != cfg.scheduler.cells:
            raise ValueError(f"{len(cells)} cells given, scheduler.cells = {cfg.scheduler.cells}")
        if (standalone is None) != (cfg.scheduler.standalone_capacity == 0):
            raise ValueError("a standalone engine is needed exactly when scheduler.standalone_capacity > 0")
        self.standalone = standalone
        self.cfg = cfg
        self.cells = list(cells)
        self.proxy = proxy
        self.proxy_url = proxy_url
        self.sandbox = dict(sandbox) if sandbox else None
        """Each harness's sandbox (:class:`gyre_core.orchestrator.sandbox.SandboxSpec` as a dict), or None."""
        self.pm = pm
        self.publisher = publisher
        """The run's :class:`~gyre_core.interfaces.WeightPublisher` (Mooncake), or None: disk files."""
        self.out_dir = Path(out_dir)
        self.weights = weights
        self.clock = clock
        self.progress = progress or (lambda msg: None)
        self.event_log = event_log
        self.watchdog: Any = None  # an EngineWatchdog (orchestrator.watchdog), set by the launcher
        # Harness waits and evaluator calls get their own pool: every running harness blocks a
        # thread in wait() and a hung evaluator keeps its thread until it returns, which would
        # starve the default pool (cores + 4 threads) that cell and engine calls use.
        self._blocking = ThreadPoolExecutor(max_workers=4 * cfg.scheduler.cells * cfg.scheduler.cell_capacity + 16,
                                            thread_name_prefix="gyre-blocking")
        self.journal = journal
        self.replay = replay
        self.sched = Scheduler(cfg.scheduler)
        self.buffer = TrajectoryBuffer(cfg.scheduler.group_size)
        self.ledger = AssessmentLedger()
        self.packing_cfg = PackingConfig(token_budget=cfg.dataplane.token_budget, dp_size=1, min_fill=0.5,
                                         whole_executions=cfg.dataplane.whole_executions)
        self._events: asyncio.Queue[ev.Event] = asyncio.Queue()
        self._t0 = clock()
        self._execs: dict[int, _Execution] = {}
        self._groups: dict[int, dict[str, Any]] = {}
        self._steps: dict[int, _Step] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None
        self._cell_locks = [asyncio.Lock() for _ in self.cells]
        self._engine_role = ["rollout"] * len(self.cells)
        self._publishing: int | None = None
        # summary material
        self.role_intervals: list[tuple[int, str, float, float]] = []
        self._role_since = [(("rollout"), 0.0)] * len(self.cells)
        self.role_switches: list[dict[str, Any]] = []
        self.step_records: list[dict[str, Any]] = []
        self.publications: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ clock, events, tasks

    def now(self) -> float:
        return self.clock() - self._t0

    def _emit(self, event: ev.Event) -> None:
        self._events.put_nowait(event)

    def _spawn(self, coro: Any, what: str) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and self._failure is None:
                self._failure = RunFailed(f"{what}: {type(t.exception()).__name__}: {t.exception()}")
                self._failure.__cause__ = t.exception()
                self._events.put_nowait(ev.Tick())  # wake the loop so it sees the failure

        task.add_done_callback(done)

    def _log(self, kind: str, obj: Any) -> None:
        if self.event_log is not None:
            rec = {"t": round(self.now(), 3), kind: type(obj).__name__, **(_jsonable(obj) if is_dataclass(obj) else {})}
            self.event_log.write(json.dumps(rec, default=str) + "\n")
            self.event_log.flush()

    def _set_role(self, cell: int, role: str) -> None:
        prev, since = self._role_since[cell]
        if self.now() > since:
            self.role_intervals.append((cell, prev, since, self.now()))
        self._role_since[cell] = (role, self.now())

    # ------------------------------------------------------------------ main loop

    async def run(self) -> dict[str, Any]:
        steps = self.cfg.run.steps
        deadline = self.cfg.run.max_wall_s
        if self.replay is not None:
            await self._resume(self.replay)
        else:
            if self.journal is not None:
                self.journal.write("config", config=self.cfg.as_dict())
            self._handle(ev.Start())
        poller = asyncio.ensure_future(self._poll_buffers())
        try:
            while self.sched.steps_done < steps or self._publishing is not None:  # end on a published policy
                if self._failure is not None:
                    raise self._failure
                if self.now() > deadline:
                    raise RunFailed(f"run.max_wall_s ({deadline:.0f} s) reached after {self.sched.steps_done} steps")
                wake = self.sched.next_wakeup()
                timeout = 1.0 if wake is None else max(0.0, min(1.0, wake - self.now()))
                try:
                    event = await asyncio.wait_for(self._events.get(), timeout)
                except asyncio.TimeoutError:
                    event = ev.Tick()
                self._handle(event)
        finally:
            poller.cancel()
        for cell, (role, since) in enumerate(self._role_since):
            if self.now() > since:
                self.role_intervals.append((cell, role, since, self.now()))
        return self.summary()

    def _handle(self, event: ev.Event) -> None:
        if self.journal is not None:
            self.journal.event(self.now(), event)
        commands = self.sched.handle(event, self.now())
        self._log("event", event)
        for cmd in commands:
            self._log("command", cmd)
            self._execute(cmd)

    async def _poll_buffers(self) -> None:
        """Streaming pulls: the open step's packing buffer asks for a group when it runs low."""
        while True:
            await asyncio.sleep(0.2)
            for st in list(self._steps.values()):
                low = st.packing.poll_low()
                if low is not None:
                    self._emit(low)

    # ------------------------------------------------------------------ resume

    async def _resume(self, replay: Replay) -> None:
        """Rebuild the scheduler and the data plane from the journal, then redo exactly what was
        in flight at the crash (see module doc of ``journal``):

        - executions that were running are started again from scratch under the same id (the
          scheduler counted them launched once and will count them finished once);
        - executions that had ended but whose evaluation had not answered are evaluated again
          against their preserved workspace;
        - an unfinished training step is re-run from the last checkpoint on the same groups
          (its partial update died with the ranks, so nothing is trained twice);
        - an unfinished publication, role switch or cancellation is carried out again.
        """
        self._t0 = self.clock() - replay.last_time
        launched: dict[int, ev.Launch] = {}
        ended: set[int] = set()
        cancels: set[int] = set()
        pending_role: dict[int, Role] = {}
        role = ["rollout"] * len(self.cells)
        steps: dict[int, dict[str, Any]] = {}
        done_steps: set[int] = set()
        evaluated: set[int] = set()
        verdict_fed: set[int] = set()  # executions whose EvaluationValid / final Unresolved was fed

        replayed = ReplayCommands(self, launched, cancels, pending_role, steps)
        for rec in replay.order:
            kind = rec["kind"]
            if kind == "event":
                t = float(rec["t"])
                event = event_from_json(rec["event"])
                if isinstance(event, ev.ExecutionEnded):
                    eid = event.execution_id
                    ended.add(eid)
                    cancels.discard(eid)
                    ex = self._execs[eid]
                    ex.outcome = event.outcome
                    if ex.fate == "running":
                        ex.fate = "ended"
                    if eid in self.ledger and self.ledger.state(eid) is EvalState.RUNNING:
                        if event.outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
                            self.ledger.terminated(eid, event.outcome, self._final_state(eid))
                        elif event.outcome is not Outcome.FAILED:
                            self.ledger.terminated(eid, event.outcome, None)
                elif isinstance(event, ev.EvaluationValid) or (isinstance(event, ev.EvaluationUnresolved) and event.final):
                    verdict_fed.add(event.execution_id)
                elif isinstance(event, ev.TransitionDone):
                    role[event.cell] = event.role.value
                    pending_role.pop(event.cell, None)
                elif isinstance(event, ev.MicroStepsDone):
                    done_steps.add(event.step)
                    st = steps.pop(event.step, None)
                    if st is not None:
                        for g in st["groups"]:
                            self.buffer.take(g)
                            self._account_group(g, "trained", from_fates=("assigned",))
                        self.step_records.append({"step": event.step, "groups": st["groups"],
                                                  "staleness": st["staleness"], "mean_reward": self._mean_reward(st["groups"]),
                                                  "cells": sorted(set(st["cells"])), "replayed": True})
                elif isinstance(event, ev.PublicationDone):
                    if replayed.publish_pending == event.version:
                        replayed.publish_pending = None
                replayed.t = t
                for cmd in self.sched.handle(event, t):
                    carry_out(replayed, cmd)
            elif kind == "trajectory":
                ex = self._execs[int(rec["execution_id"])]
                ex.trajectory = (tree_from_json(rec["tree"]), selected_from_json(rec["selected"]))
                ex.harness_exit = rec.get("harness_exit")
            elif kind in ("scored", "placeholder"):
                eid = int(rec["execution_id"])
                ex = self._execs[eid]
                evaluated.add(eid)
                running = self.ledger.state(eid) is EvalState.RUNNING  # its end is journalled next
                if kind == "placeholder":
                    ex.reward = 0.0
                    if running:
                        self.ledger.terminated(eid, Outcome.FAILED, None)
                    self.buffer.put(ScoredExecution.placeholder(eid, ex.group_id))
                else:
                    reward = float(rec["reward"])
                    ex.reward = reward
                    if running:
                        self.ledger.terminated(eid, Outcome.COMPLETED, self._final_state(eid))
                    self.ledger.evaluate(eid, lambda st, r=reward: Assessment.valid(r, st), self.now())
                    if "tree" in rec:  # journals written before trajectories had their own entry
                        ex.trajectory = (tree_from_json(rec["tree"]), selected_from_json(rec["selected"]))
                    assert ex.trajectory is not None, f"journal: execution {eid} scored without its records"
                    if not self.buffer.put(ScoredExecution(eid, ex.group_id, reward, *ex.trajectory)):
                        ex.fate = "surplus"
            elif kind == "excluded":
                eid = int(rec["execution_id"])
                evaluated.add(eid)
                self._execs[eid].fate = "excluded"
                self.buffer.exclude(eid)
        self.progress(f"resumed from the journal at t={replay.last_time:.1f} s: {self.sched.steps_done} steps done, "
                      f"{len(launched) - len(ended)} execution(s) to restart")
        if replay.published:
            v = max(replay.published)
            self.proxy.policy_version = v

        # Bring the fresh cells to the roles the scheduler believes in, then redo what was in flight.
        for cell, r in enumerate(role):
            if r == "training":
                await self._physical_to_training(cell)
        for cell, target in sorted(pending_role.items()):
            if target is Role.TRAINING:
                self._spawn(self._to_training(cell), f"cell {cell} to training (resumed)")
            else:
                self._spawn(self._to_rollout(cell), f"cell {cell} to rollout (resumed)")
        for step, st in sorted(steps.items()):
            self._restart_step(step, st)
        if replayed.publish_pending is not None:
            v = replayed.publish_pending
            self._spawn(self._publish(v), f"publication of version {v} (resumed)")
        for eid, cmd in launched.items():
            if eid not in ended and eid not in cancels:
                if self._execs[eid].trajectory is not None or eid in evaluated:
                    self._feed_unjournalled_end(eid)  # it had ended: never run it again
                    continue
                self._spawn(self._launch(cmd, relaunch=True), f"relaunch of execution {eid}")
        for eid in cancels:
            self._emit(ev.ExecutionEnded(eid, Outcome.CANCELLED))
        for eid in ended:
            ex = self._execs[eid]
            if eid in evaluated and eid not in verdict_fed:  # its verdict was journalled, not yet fed
                valid = self.ledger.state(eid) is EvalState.VALID
                self._emit(ev.EvaluationValid(eid) if valid else ev.EvaluationUnresolved(eid, final=True))
            if eid not in evaluated and ex.outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
                ex.spec = self._spec_for(eid)
                self._spawn(self._evaluate(eid), f"evaluation of execution {eid} (resumed)")

    def _feed_unjournalled_end(self, eid: int) -> None:
        """An execution whose records (and maybe its verdict) reached the journal before the crash
        but whose ``ExecutionEnded`` had not been fed yet (its evaluation runs as soon as it ends,
        while the end event waits in the queue): feed the end now, then what its verdict was."""
        ex = self._execs[eid]
        ex.outcome = Outcome.COMPLETED
        state = self.ledger.state(eid)
        if state is EvalState.RUNNING:
            self.ledger.terminated(eid, Outcome.COMPLETED, self._final_state(eid))
        self._emit(ev.ExecutionEnded(eid, Outcome.COMPLETED))
        if ex.fate == "excluded":
            if self.ledger.state(eid) is EvalState.AWAITING:
                self.ledger.exclude(eid)
            self._emit(ev.EvaluationUnresolved(eid, final=True))
        elif self.ledger.state(eid) is EvalState.VALID:
            if ex.fate == "running":
                ex.fate = "ended"
            self._emit(ev.EvaluationValid(eid))
        else:  # records only: evaluate it now, as any ended execution
            ex.fate = "ended"
            ex.spec = self._spec_for(eid)
            self._spawn(self._evaluate(eid), f"evaluation of execution {eid} (resumed)")

    def _final_state(self, eid: int) -> StateRef:
        return StateRef(artifact_version="final", branch=str(self.out_dir / "executions" / f"e{eid:05d}"))

    def _mean_reward(self, groups: Sequence[int]) -> float | None:
        rs = [x.reward for g in groups for x in (self._execs[e] for e in self._group_members(g)) if x.reward is not None]
        return round(sum(rs) / len(rs), 4) if rs else None

    def _spec_for(self, eid: int) -> ExecutionSpec:
        ex = self._execs[eid]
        inst = self._groups[ex.group_id]["instance"]
        spec = ExecutionSpec(
            execution_id=eid, workdir=str(self.out_dir / "executions" / f"e{eid:05d}"), proxy_base_url=self.proxy_url,
            api_key="", harness_timeout_s=self.cfg.harness.timeout_s, overall_budget_s=self.cfg.harness.overall_budget_s,
            harness=self.cfg.harness.kind, task=inst.prompt, extra=dict(inst.as_extra(), model=self.cfg.model.name))
        return _with_exit(spec, ex.harness_exit) if ex.harness_exit else spec

    async def _physical_to_training(self, cell: int) -> None:
        """A resumed cell the scheduler has in training: move the fresh cell there (no event)."""
        c = self.cells[cell]
        self._engine_role[cell] = "training"
        self.proxy.reroute(c.engine_url, self._reroute_destinations())
        ato = getattr(c.serving, "ato_training", None)
        phases = list(await ato(lambda rids: None)) if ato is not None else list(
            await asyncio.to_thread(c.serving.to_training, lambda rids: None))
        phases += await self._cell_call(cell, c.training.enter_training)
        self._record_phases(cell, "to_training", phases)
        self._set_role(cell, "training")

    def _restart_step(self, step: int, st: dict[str, Any]) -> None:
        """Re-run an interrupted step from the last checkpoint on the groups it had been given."""
        self._start_step(ev.StartStep(step, tuple(c for c in st["cells"] if c == 0) or (0,)))
        live = self._steps[step]
        for cell in st["cells"]:
            if cell != 0:
                live.cells.append(cell)
                self._spawn(self._cell_call(cell, self.cells[cell].training.join_step, step),
                            f"cell {cell} rejoining step {step}")
        for g, stale in zip(st["groups"], st["staleness"]):
            live.packing.assign(g)
            live.groups.append(g)
            live.staleness.append(stale)
        if st["closed"]:
            live.packing.close()
            live.closing = True
            self._spawn(self._finish_step(live), f"training step {step} (resumed)")

    # ------------------------------------------------------------------ commands

    def _execute(self, cmd: ev.Command) -> None:
        carry_out(self, cmd)

    # One method per scheduler command (the CommandHandler interface), on the real cells.

    def on_dispatch_group(self, cmd: ev.DispatchGroup) -> None:
        self._dispatch(cmd)

    def on_launch(self, cmd: ev.Launch) -> None:
        self._execs[cmd.execution_id].fate = "launching"  # counted launched from now on
        self._execs[cmd.execution_id].launched_on = cmd.engine
        self._spawn(self._launch(cmd), f"launch of execution {cmd.execution_id}")

    def on_cancel(self, cmd: ev.Cancel) -> None:
        self._cancel(cmd.execution_id)

    def on_reroute(self, cmd: ev.Reroute) -> None:
        self.proxy.router.pin(cmd.execution_id, self._engine_url(cmd.destination))
        self._execs[cmd.execution_id].engine = cmd.destination

    def on_cell_to_training(self, cmd: ev.CellToTraining) -> None:
        self._set_role(cmd.cell, "to_training")
        self._spawn(self._to_training(cmd.cell), f"cell {cmd.cell} to training")

    def on_cell_to_rollout(self, cmd: ev.CellToRollout) -> None:
        self._set_role(cmd.cell, "to_rollout")
        self._spawn(self._to_rollout(cmd.cell), f"cell {cmd.cell} to rollout")

    def on_start_step(self, cmd: ev.StartStep) -> None:
        self._start_step(cmd)

    def on_join_step(self, cmd: ev.JoinStep) -> None:
        self._steps[cmd.step].cells.append(cmd.cell)
        self._spawn(self._cell_call(cmd.cell, self.cells[cmd.cell].training.join_step, cmd.step),
                    f"cell {cmd.cell} joining step {cmd.step}")

    def on_assign_group(self, cmd: ev.AssignGroup) -> None:
        st = self._steps[cmd.step]
        self._account_group(cmd.group_id, "assigned")
        st.packing.assign(cmd.group_id)
        st.groups.append(cmd.group_id)
        st.staleness.append(cmd.staleness)

    def on_close_stream(self, cmd: ev.CloseStream) -> None:
        st = self._steps[cmd.step]
        st.packing.close()
        st.closing = True
        self._spawn(self._finish_step(st), f"training step {cmd.step}")

    def on_publish(self, cmd: ev.Publish) -> None:
        self._publishing = cmd.version
        self._spawn(self._publish(cmd.version), f"publication of version {cmd.version}")

    def on_group_dropped(self, cmd: ev.GroupDropped) -> None:
        self._short_group(cmd)

    def on_group_filtered(self, cmd: ev.GroupFiltered) -> None:
        self._short_group(cmd)

    def _short_group(self, cmd: ev.GroupDropped | ev.GroupFiltered) -> None:
        """The scheduler's decision on a group short of N valid rewards, carried out in the buffer."""
        if isinstance(cmd, ev.GroupDropped):
            self.buffer.drop(cmd)
            self._account_group(cmd.group_id, "dropped")
            return
        self.buffer.filter(cmd)
        if cmd.empty:  # its few valid rewards give no group baseline: nothing of it is trained
            self._account_group(cmd.group_id, "filtered")

    def _engine_url(self, engine: int) -> str:
        if engine < 0:
            if self.standalone is None:
                raise RunFailed("standalone engines are not configured in this run")
            return self.standalone.engine_url
        return self.cells[engine].engine_url

    def _reroute_destinations(self) -> list[str]:
        """Where a cell leaving rollout sends its calls: the standalone pool first, then the
        cells still in rollout (the scheduler's Reroute commands pin each execution exactly)."""
        cells = [x.engine_url for x in self.cells if self._engine_role[x.index] == "rollout"]
        return ([self.standalone.engine_url] if self.standalone is not None else []) + cells

    # -- executions -----------------------------------------------------------------------------

    def _dispatch(self, cmd: ev.DispatchGroup) -> None:
        self.buffer.dispatch(cmd)
        if cmd.refill_of is None:
            inst = self.pm.hook.gyre_task_instance(task=self.cfg.task.name, group_id=cmd.group_id,
                                                   seed=self.cfg.run.seed, options=asdict(self.cfg.task))
            if inst is None:
                raise RunFailed(f"no plugin provides task {self.cfg.task.name!r}")
            self._groups[cmd.group_id] = {"instance": inst, "version": cmd.version, "rewards": []}
        for eid in cmd.execution_ids:
            self._execs[eid] = _Execution(cmd.group_id)

    async def _launch(self, cmd: ev.Launch, relaunch: bool = False) -> None:
        ex = self._execs[cmd.execution_id]
        if not relaunch and ex.fate != "launching":
            return  # cancelled (or the run ended) before its launch got to run
        inst = self._groups[cmd.group_id]["instance"]
        eid, key = self.proxy.create_execution(cmd.execution_id, metadata={"group": cmd.group_id})
        self.proxy.router.pin(eid, self._engine_url(cmd.engine))
        workdir = self.out_dir / "executions" / f"e{eid:05d}"
        if relaunch and workdir.exists():  # a crashed attempt: keep it for inspection, start clean
            workdir.rename(workdir.with_name(f"{workdir.name}.crashed-{int(time.time())}"))
        extra: dict[str, Any] = dict(inst.as_extra(), model=self.cfg.model.name)
        if self.cfg.harness.kind == "command":
            extra["command"] = list(self.cfg.harness.command)
        if self.cfg.harness.kind == "claude-code":
            extra["claude_bin"] = self.cfg.harness.claude_bin
            extra["claude_args"] = list(self.cfg.harness.args)
        if self.sandbox is not None:
            extra["sandbox"] = self.sandbox
        spec = ExecutionSpec(
            execution_id=eid, workdir=str(workdir), proxy_base_url=self.proxy_url, api_key=key,
            harness_timeout_s=self.cfg.harness.timeout_s, overall_budget_s=self.cfg.harness.overall_budget_s,
            harness=self.cfg.harness.kind, task=inst.prompt, extra=extra,
        )
        ex.spec, ex.engine, ex.launched_at, ex.fate = spec, cmd.engine, self.now(), "running"
        if relaunch:
            self.ledger.relaunch(eid, self.now() + spec.overall_budget_s)
        else:
            self.ledger.register(eid, self.now() + spec.overall_budget_s)
        handle = self.pm.hook.gyre_launch_harness(spec=spec)
        if handle is None:
            raise RunFailed(f"no plugin launches harness {spec.harness!r}")
        ex.handle = handle
        code = await asyncio.get_running_loop().run_in_executor(self._blocking, handle.wait, spec.harness_timeout_s)
        if ex.fate in ("cancelled", "stopped"):
            return  # its cancellation (or the run's end) already ended it
        if code is None:
            await asyncio.to_thread(handle.kill)
            outcome = Outcome.HARNESS_TIMEOUT
        else:
            # A non-zero exit is assessed like any end: the evaluator is told how the harness
            # ended and judges what the workspace holds. Only the task may call it a zero (a
            # harness that ran to its end and produced nothing); a crash never is one.
            if code != 0:
                end_kind = getattr(handle, "end_kind", None)
                end = end_kind(int(code)) if end_kind is not None else classify_end(spec.harness, int(code))
                ex.harness_exit = {"code": int(code), "end": end}
                ex.spec = _with_exit(spec, ex.harness_exit)
            outcome = Outcome.COMPLETED
        await self._ended(eid, outcome)

    async def _ended(self, eid: int, outcome: Outcome) -> None:
        ex = self._execs[eid]
        ex.outcome, ex.fate = outcome, "ended"
        self.proxy.close_execution(eid)
        if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
            # Its token records live only in this process: journal them *before* its end, so a
            # crash either keeps both (the resumed run evaluates it) or neither (it is re-run).
            ex.trajectory = (self.proxy.records(eid).tree,
                             self.proxy.selected(eid, self.cfg.dataplane.j_max, self.cfg.run.seed * 7919 + eid))
            if self.journal is not None:
                self.journal.write("trajectory", execution_id=eid, tree=tree_to_json(ex.trajectory[0]),
                                   selected=selected_to_json(ex.trajectory[1]), harness_exit=ex.harness_exit)
        self._emit(ev.ExecutionEnded(eid, outcome))
        state = self._final_state(eid)
        answer = self.ledger.terminated(eid, outcome, state if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT) else None)
        if answer is not None:  # a complete failure: zero-reward placeholder
            ex.reward = 0.0
            if self.journal is not None:
                self.journal.write("placeholder", execution_id=eid, group=ex.group_id)
            self.buffer.put(ScoredExecution.placeholder(eid, ex.group_id))
            self._emit(answer)
            return
        if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
            await self._evaluate(eid)

    async def _evaluate(self, eid: int) -> None:
        ex = self._execs[eid]
        spec = ex.spec
        assert spec is not None
        timeout = max(1.0, min(60.0, spec.overall_budget_s / 4))

        def evaluator(state: StateRef) -> Assessment | None:
            return self.pm.hook.gyre_evaluate(spec=spec, state=state)

        while True:
            answer = await self._assess_once(eid, evaluator, timeout)
            if isinstance(answer, ev.EvaluationValid):
                reward = self.ledger.reward(eid)
                ex.reward = reward
                assert ex.trajectory is not None, f"execution {eid} was evaluated without its records"
                tree, selected = ex.trajectory
                if self.journal is not None:  # the records are in its "trajectory" entry
                    self.journal.write("scored", execution_id=eid, group=ex.group_id, reward=reward)
                used = self.buffer.put(ScoredExecution(eid, ex.group_id, reward, tree, selected))
                if not used:
                    ex.fate = "surplus"
                self._emit(answer)
                return
            if not answer.final and ex.harness_exit and ex.harness_exit.get("end") == "crashed":
                # nothing the crashed harness left can be assessed, and a retry would read the same
                answer = self.ledger.exclude(eid)
            if answer.final:
                ex.fate = "excluded"
                if self.journal is not None:
                    self.journal.write("excluded", execution_id=eid)
                self.buffer.exclude(eid)
                self._emit(answer)
                return
            self._emit(answer)
            await asyncio.sleep(max(0.0, min(5.0, timeout, self.ledger.deadline(eid) - self.now())))

    async def _assess_once(self, eid: int, evaluator: Callable[[StateRef], Assessment | None],
                           timeout: float) -> ev.EvaluationValid | ev.EvaluationUnresolved:
        """One assessment attempt, bounded by ``timeout`` and by what is left of the budget.

        Only the evaluator runs in a worker thread; the ledger is updated here, on the loop, so an
        attempt that hangs past its bound and answers later changes nothing (its answer is
        dropped) and can never race the retry. Unresolved once the budget is spent: excluded."""
        state = self.ledger.retry_target(eid)
        started, deadline = self.now(), self.ledger.deadline(eid)
        bound = min(timeout, deadline - started)
        if bound <= 0:
            return self.ledger.evaluate(eid, evaluator, started)  # no attempt starts: excluded
        try:
            got: Assessment | None = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._blocking, evaluator, state), bound)
        except asyncio.TimeoutError:  # a hung evaluator: unresolved, retried within the budget
            got = Assessment.unresolved(state, f"evaluator gave no answer within {bound:.1f} s")
        except Exception as exc:  # a crashing evaluator: unresolved, retried within the budget
            got = Assessment.unresolved(state, f"evaluator raised {exc!r}")
        answer = self.ledger.evaluate(eid, lambda s: got, started)
        if isinstance(answer, ev.EvaluationUnresolved) and not answer.final and self.now() >= deadline:
            answer = self.ledger.evaluate(eid, evaluator, self.now())  # budget spent: excluded
        return answer

    def _cancel(self, eid: int) -> None:
        ex = self._execs[eid]
        prev, ex.fate = ex.fate, "cancelled"
        if prev == "running" and ex.handle is not None:
            self._spawn(asyncio.to_thread(ex.handle.kill), f"cancel of execution {eid}")
            self.proxy.close_execution(eid)
        self._emit(ev.ExecutionEnded(eid, Outcome.CANCELLED))

    def _account_group(self, gid: int, fate: str, from_fates: tuple[str, ...] = ("ended",)) -> None:
        """Move a group's executions from ``from_fates`` to ``fate`` (``trained`` only once the
        step that consumed them has applied its update)."""
        for ex in self._execs.values():
            if ex.group_id == gid and ex.fate in from_fates:
                ex.fate = fate

    # -- cells ----------------------------------------------------------------------------------

    async def _cell_call(self, cell: int, fn: Callable[..., Any], *args: Any) -> Any:
        async with self._cell_locks[cell]:
            return await asyncio.to_thread(fn, *args)

    def _record_phases(self, cell: int, transition: str, phases: Sequence[PhaseTiming]) -> None:
        for p in phases:
            self.pm.hook.gyre_on_event(time=self.now(), event=p)
            self._log("phase", p)
        self.role_switches.append({"cell": cell, "transition": transition, "at_s": round(self.now(), 3),
                                   "phases": {p.phase: round(p.duration, 4) for p in phases},
                                   "total_s": round(sum(p.duration for p in phases), 4)})

    async def _to_training(self, cell: int) -> None:
        if self.watchdog is not None:  # an engine being restarted switches once it is back
            await self.watchdog.ready(cell)
        c = self.cells[cell]
        url = c.engine_url
        self._engine_role[cell] = "training"

        async def hand_off(rids: Sequence[str]) -> None:
            """The running calls' KV goes to the engines their executions were just rerouted to;
            each continues there (re-prefilling only when its hand-off could not be done)."""
            handoff = getattr(self.proxy, "hand_off", None)
            if handoff is not None:
                await handoff(url, rids)

        # The proxy stops routing here first, so calls cut short below continue on their new engine.
        self.proxy.reroute(url, self._reroute_destinations())
        phases: list[PhaseTiming] = []
        ato = getattr(c.serving, "ato_training", None)
        if ato is not None:
            phases += await ato(hand_off)
        else:
            loop = asyncio.get_running_loop()
            phases += await asyncio.to_thread(
                c.serving.to_training,
                lambda rids: asyncio.run_coroutine_threadsafe(hand_off(rids), loop).result())
        phases += await self._cell_call(cell, c.training.enter_training)
        self._record_phases(cell, "to_training", phases)
        self._set_role(cell, "training")
        self._emit(ev.TransitionDone(cell, Role.TRAINING))

    async def _to_rollout(self, cell: int) -> None:
        c = self.cells[cell]
        phases: list[PhaseTiming] = list(await self._cell_call(cell, c.training.leave_training))
        ato = getattr(c.serving, "ato_rollout", None)
        if ato is not None:
            phases += await ato(self.weights)
        else:
            phases += await asyncio.to_thread(c.serving.to_rollout, self.weights)
        self._engine_role[cell] = "rollout"
        self.proxy.restore_engine(c.engine_url)
        self._record_phases(cell, "to_rollout", phases)
        self._set_role(cell, "rollout")
        self._emit(ev.TransitionDone(cell, Role.ROLLOUT))

    # -- training -------------------------------------------------------------------------------

    def _start_step(self, cmd: ev.StartStep) -> None:
        core = self.cells[0].training
        queue = core.micro_step_queue(cmd.step)  # type: ignore[attr-defined]
        packing = StreamPackingBuffer(cmd.step, self.buffer, queue, self.packing_cfg, self.cfg.scheduler.groups_per_step)
        self._steps[cmd.step] = _Step(cmd.step, packing, list(cmd.cells), started=self.now())
        self.progress(f"step {cmd.step}: training on cells {list(cmd.cells)}")
        for cell in cmd.cells:
            fn = self.cells[cell].training.start_step if cell == 0 else self.cells[cell].training.join_step
            self._spawn(self._cell_call(cell, fn, cmd.step), f"cell {cell} starting step {cmd.step}")

    async def _finish_step(self, st: _Step) -> None:
        # Wait for every cell that trained in the step; the core last (it applies the update).
        for cell in sorted(st.cells, reverse=True):
            await self._cell_call(cell, self.cells[cell].training.close_stream, st.step)
        save = getattr(self.cells[0].training, "save_checkpoint", None)
        if save is not None and self.journal is not None:
            path = str(self.out_dir / "checkpoints" / f"step{st.step}")
            (self.out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            await self._cell_call(0, save, path)
            self.journal.write("checkpoint", step=st.step, path=path)
        for g in st.groups:
            self._account_group(g, "trained", from_fates=("assigned",))
        rewards = [self._execs[e].reward for g in st.groups for e in self._group_members(g)
                   if self._execs[e].reward is not None and self._execs[e].fate == "trained"]
        rec = {"step": st.step, "groups": list(st.groups), "staleness": list(st.staleness),
               "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
               "executions": len(rewards), "cells": sorted(set(st.cells)),
               "duration_s": round(self.now() - st.started, 3), "micro_steps": st.packing.micro_steps,
               "split_executions": st.packing.split_executions,
               "joins": _joins([(c, getattr(self.cells[c].training, "last_step_info", [])) for c in sorted(set(st.cells)) if c]),
               **training_figures([getattr(self.cells[c].training, "last_step_info", []) for c in sorted(set(st.cells))])}
        self.step_records.append(rec)
        if self.event_log is not None:
            self.event_log.write(json.dumps({"t": round(self.now(), 3), "step_done": st.step, **rec}) + "\n")
            self.event_log.flush()
        self.progress(f"step {st.step} done in {rec['duration_s']:.1f} s: mean reward {rec['mean_reward']}, "
                      f"staleness {st.staleness}, loss {rec['loss']}, grad norm {rec['grad_norm']}, "
                      f"clipped {rec['clip_fraction']}, ratio mean/max {rec['ratio_mean']}/{rec['ratio_max']}, "
                      f"{rec['tokens']} tokens")
        del self._steps[st.step]
        self._emit(ev.MicroStepsDone(st.step))

    def _group_members(self, gid: int) -> list[int]:
        return [e for e, x in self._execs.items() if x.group_id == gid]

    async def _export(self, version: int) -> WeightsRef:
        """Policy ``version`` where the engines can load it: exposed by the run's publisher (the
        core's tensors, nothing written), or written to disk by the core when there is none."""
        core = self.cells[0].training
        if self.publisher is None:
            return await self._cell_call(0, core.publish_weights, version)
        tensors = await self._cell_call(0, core.export_weights, version)
        return await asyncio.to_thread(self.publisher.publish, version, tensors)

    async def _publish(self, version: int) -> None:
        t0 = self.now()
        ref = await self._export(version)
        previous, self.weights = self.weights, ref
        exported = self.now()
        for c in self.cells:
            if self._engine_role[c.index] == "rollout":
                if self.watchdog is not None and self.watchdog.down(c.index):
                    continue  # being restarted by the watchdog: it comes back on self.weights
                url = c.engine_url
                try:
                    await load_weights_on(c.serving, ref)
                except Exception:  # an engine that died meanwhile is the watchdog's to restart
                    if self.watchdog is None or not await self.watchdog.took_over(c.index, url):
                        raise
        if self.standalone is not None:  # the pool never trains: it loads every version as it is published
            await load_weights_on(self.standalone.serving, ref)
        self.proxy.policy_version = version
        if self.publisher is not None:  # every serving engine holds `version`; a switch back may still read the previous one
            await asyncio.to_thread(self.publisher.release_older_than, previous.version)
        self.publications.append({"version": version, "transport": "disk" if self.publisher is None else "mooncake",
                                  "export_s": round(exported - t0, 4), "load_s": round(self.now() - exported, 4)})
        if self.journal is not None:
            self.journal.write("published", version=version, location=ref.location)
        self.progress(f"published policy version {version}")
        self._publishing = None
        self._emit(ev.PublicationDone(version))

    async def shutdown(self) -> None:
        """Stop what the run still has in flight, and account for it.

        Harnesses still running (or about to start) are killed and counted as ``stopped``:
        launched, never finished, never trained. Then every task is cancelled, and events that
        happened but were not fed yet (an execution that ended as the last step closed) are fed
        and journalled; their commands are not carried out now -- a later ``--resume`` finds them
        outstanding and carries them out then.
        """
        for ex in self._execs.values():
            if ex.fate in ("running", "launching"):
                ex.fate = "stopped"
                if ex.handle is not None:
                    await asyncio.to_thread(ex.handle.kill)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        while not self._events.empty():
            event = self._events.get_nowait()
            if isinstance(event, ev.Tick):
                continue
            if self.journal is not None:
                self.journal.event(self.now(), event)
            for cmd in self.sched.handle(event, self.now()):
                self._log("command", cmd)
                if isinstance(cmd, ev.DispatchGroup):  # bookkeeping only: nothing starts now
                    self._dispatch(cmd)
                elif isinstance(cmd, ev.Launch):  # counted launched, never started: stopped
                    self._execs[cmd.execution_id].fate = "stopped"
                    self._execs[cmd.execution_id].launched_on = cmd.engine
        self._blocking.shutdown(wait=False)

    # ------------------------------------------------------------------ summary

    def executions_summary(self) -> dict[str, Any]:
        snap = self.sched.snapshot()
        fates: dict[str, int] = defaultdict(int)
        for ex in self._execs.values():
            fates[ex.fate] += 1
        launched_on: dict[str, int] = defaultdict(int)
        for ex in self._execs.values():
            if ex.launched_on is not None:
                launched_on["standalone" if ex.launched_on < 0 else f"cell{ex.launched_on}"] += 1
        return {"dispatched": snap.dispatched, "launched": snap.launched, "finished": snap.finished,
                "launched_on": dict(sorted(launched_on.items())),
                "trained": fates["trained"], "excluded": fates["excluded"], "dropped": fates["dropped"],
                "filtered": fates["filtered"],
                "surplus": fates["surplus"], "cancelled": fates["cancelled"],
                "waiting": fates["ended"] + fates["assigned"], "running": fates["running"],
                "stopped": fates["stopped"]}

    def summary(self) -> dict[str, Any]:
        # Over the groups of completed steps: a step the run's end cut short trained nothing.
        st = [d for rec in self.step_records for d in rec["staleness"]]
        return {
            "mode": self.cfg.scheduler.mode.value,
            "steps": self.sched.steps_done,
            "wall_s": round(self.now(), 2),
            "mean_staleness": round(sum(st) / len(st), 4) if st else None,
            "rewards": [r["mean_reward"] for r in self.step_records],
            "losses": [r.get("loss") for r in self.step_records],
            "grad_norms": [r.get("grad_norm") for r in self.step_records],
            "step_records": self.step_records,
            "role_switches": self.role_switches,
            "publications": self.publications,
            "executions": self.executions_summary(),
            "interrupted_calls": self._interrupted_calls(),
        }

    def _interrupted_calls(self) -> dict[str, Any] | None:
        """Calls cut short by a role change or a dead engine: continued on the KV they handed
        off, re-prefilled (and why), or generated again; prefill tokens the hand-offs saved."""
        handoffs = getattr(self.proxy, "handoffs", None)
        return handoffs.summary() if handoffs is not None else None
