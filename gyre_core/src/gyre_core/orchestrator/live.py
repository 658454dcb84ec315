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
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from gyre_core.dataplane.assessment import AssessmentLedger
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
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Outcome, Role
from gyre_core.scheduler.state_machine import Scheduler
from gyre_core.tasks.number_guess import make_instance

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
class _Execution:
    group_id: int
    spec: ExecutionSpec | None = None
    handle: Any = None
    engine: int | None = None
    launched_at: float = 0.0
    outcome: Outcome | None = None
    reward: float | None = None
    fate: str = "queued"  # queued, running, ended, trained, dropped, surplus, excluded, cancelled


@dataclass
class _Step:
    step: int
    packing: StreamPackingBuffer
    cells: list[int]
    groups: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    started: float = 0.0
    closing: bool = False


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj):
        return {k: _jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "value") and not isinstance(obj, (int, float, str)):
        return obj.value
    return obj


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
    ) -> None:
        if len(cells) != cfg.scheduler.cells:
            raise ValueError(f"{len(cells)} cells given, scheduler.cells = {cfg.scheduler.cells}")
        self.cfg = cfg
        self.cells = list(cells)
        self.proxy = proxy
        self.proxy_url = proxy_url
        self.pm = pm
        self.out_dir = Path(out_dir)
        self.weights = weights
        self.clock = clock
        self.progress = progress or (lambda msg: None)
        self.event_log = event_log
        self.sched = Scheduler(cfg.scheduler)
        self.buffer = TrajectoryBuffer(cfg.scheduler.group_size, cfg.scheduler.short_group)
        self.ledger = AssessmentLedger()
        self.packing_cfg = PackingConfig(token_budget=cfg.dataplane.token_budget, dp_size=1, min_fill=0.5)
        self._events: asyncio.Queue[ev.Event] = asyncio.Queue()
        self._t0 = clock()
        self._execs: dict[int, _Execution] = {}
        self._groups: dict[int, dict[str, Any]] = {}
        self._steps: dict[int, _Step] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None
        self._cell_locks = [asyncio.Lock() for _ in self.cells]
        self._engine_role = ["rollout"] * len(self.cells)
        # summary material
        self.role_intervals: list[tuple[int, str, float, float]] = []
        self._role_since = [(("rollout"), 0.0)] * len(self.cells)
        self.role_switches: list[dict[str, Any]] = []
        self.step_records: list[dict[str, Any]] = []
        self.staleness: list[int] = []

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
        self._handle(ev.Start())
        poller = asyncio.ensure_future(self._poll_buffers())
        try:
            while self.sched.steps_done < steps:
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

    # ------------------------------------------------------------------ commands

    def _execute(self, cmd: ev.Command) -> None:
        if isinstance(cmd, ev.DispatchGroup):
            self._dispatch(cmd)
        elif isinstance(cmd, ev.Launch):
            self._spawn(self._launch(cmd), f"launch of execution {cmd.execution_id}")
        elif isinstance(cmd, ev.Cancel):
            self._cancel(cmd.execution_id)
        elif isinstance(cmd, ev.Reroute):
            self.proxy.router.pin(cmd.execution_id, self._engine_url(cmd.destination))
            self._execs[cmd.execution_id].engine = cmd.destination
        elif isinstance(cmd, ev.CellToTraining):
            self._set_role(cmd.cell, "to_training")
            self._spawn(self._to_training(cmd.cell), f"cell {cmd.cell} to training")
        elif isinstance(cmd, ev.CellToRollout):
            self._set_role(cmd.cell, "to_rollout")
            self._spawn(self._to_rollout(cmd.cell), f"cell {cmd.cell} to rollout")
        elif isinstance(cmd, ev.StartStep):
            self._start_step(cmd)
        elif isinstance(cmd, ev.JoinStep):
            self._steps[cmd.step].cells.append(cmd.cell)
            self._spawn(self._cell_call(cmd.cell, self.cells[cmd.cell].training.join_step, cmd.step),
                        f"cell {cmd.cell} joining step {cmd.step}")
        elif isinstance(cmd, ev.AssignGroup):
            st = self._steps[cmd.step]
            self._account_group(cmd.group_id, "trained")
            st.packing.assign(cmd.group_id)
            st.groups.append(cmd.group_id)
            st.staleness.append(cmd.staleness)
            self.staleness.append(cmd.staleness)
        elif isinstance(cmd, ev.CloseStream):
            st = self._steps[cmd.step]
            st.packing.close()
            st.closing = True
            self._spawn(self._finish_step(st), f"training step {cmd.step}")
        elif isinstance(cmd, ev.Publish):
            self._spawn(self._publish(cmd.version), f"publication of version {cmd.version}")
        elif isinstance(cmd, ev.GroupDropped):
            self._account_group(cmd.group_id, "dropped")

    def _engine_url(self, engine: int) -> str:
        if engine < 0:
            raise RunFailed("standalone engines are not configured in this run")
        return self.cells[engine].engine_url

    # -- executions -----------------------------------------------------------------------------

    def _dispatch(self, cmd: ev.DispatchGroup) -> None:
        self.buffer.dispatch(cmd)
        if cmd.refill_of is None:
            inst = make_instance(cmd.group_id, self.cfg.run.seed, self.cfg.task.turns)
            self._groups[cmd.group_id] = {"instance": inst, "version": cmd.version, "rewards": []}
        for eid in cmd.execution_ids:
            self._execs[eid] = _Execution(cmd.group_id)

    async def _launch(self, cmd: ev.Launch) -> None:
        ex = self._execs[cmd.execution_id]
        inst = self._groups[cmd.group_id]["instance"]
        eid, key = self.proxy.create_execution(cmd.execution_id, metadata={"group": cmd.group_id})
        self.proxy.router.pin(eid, self._engine_url(cmd.engine))
        workdir = self.out_dir / "executions" / f"e{eid:05d}"
        extra: dict[str, Any] = dict(inst.as_extra(), model=self.cfg.model.name)
        if self.cfg.harness.kind == "command":
            extra["command"] = list(self.cfg.harness.command)
        if self.cfg.harness.kind == "claude-code":
            extra["claude_bin"] = self.cfg.harness.claude_bin
        spec = ExecutionSpec(
            execution_id=eid, workdir=str(workdir), proxy_base_url=self.proxy_url, api_key=key,
            harness_timeout_s=self.cfg.harness.timeout_s, overall_budget_s=self.cfg.harness.overall_budget_s,
            harness=self.cfg.harness.kind, task=inst.prompt, extra=extra,
        )
        ex.spec, ex.engine, ex.launched_at, ex.fate = spec, cmd.engine, self.now(), "running"
        self.ledger.register(eid, self.now() + spec.overall_budget_s)
        handle = self.pm.hook.gyre_launch_harness(spec=spec)
        if handle is None:
            raise RunFailed(f"no plugin launches harness {spec.harness!r}")
        ex.handle = handle
        code = await asyncio.to_thread(handle.wait, spec.harness_timeout_s)
        if ex.fate in ("cancelled", "stopped"):
            return  # its cancellation (or the run's end) already ended it
        if code is None:
            await asyncio.to_thread(handle.kill)
            outcome = Outcome.HARNESS_TIMEOUT
        else:
            outcome = Outcome.COMPLETED if code == 0 else Outcome.FAILED
        await self._ended(eid, outcome)

    async def _ended(self, eid: int, outcome: Outcome) -> None:
        ex = self._execs[eid]
        ex.outcome, ex.fate = outcome, "ended"
        self.proxy.close_execution(eid)
        self._emit(ev.ExecutionEnded(eid, outcome))
        state = StateRef(artifact_version="final", branch=str(ex.spec.workdir)) if ex.spec else None
        answer = self.ledger.terminated(eid, outcome, state if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT) else None)
        if answer is not None:  # a complete failure: zero-reward placeholder
            ex.reward = 0.0
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
            try:
                answer = await asyncio.wait_for(
                    asyncio.to_thread(self.ledger.evaluate, eid, evaluator, self.now()), timeout)
            except asyncio.TimeoutError:  # a hung evaluator: unresolved, retried within the budget
                answer = ev.EvaluationUnresolved(eid, final=self.now() >= self.ledger._entry(eid).deadline)
            if isinstance(answer, ev.EvaluationValid):
                reward = self.ledger.reward(eid)
                ex.reward = reward
                tree = self.proxy.records(eid).tree
                selected = self.proxy.selected(eid, self.cfg.dataplane.j_max, self.cfg.run.seed * 7919 + eid)
                used = self.buffer.put(ScoredExecution(eid, ex.group_id, reward, tree, selected))
                if not used:
                    ex.fate = "surplus"
                self._emit(answer)
                return
            if answer.final:
                ex.fate = "excluded"
                dropped = self.buffer.exclude(eid)
                self._emit(answer)
                if dropped is not None:
                    self._account_group(dropped.group_id, "dropped")
                return
            self._emit(answer)
            await asyncio.sleep(min(5.0, timeout))

    def _cancel(self, eid: int) -> None:
        ex = self._execs[eid]
        prev, ex.fate = ex.fate, "cancelled"
        if prev == "running" and ex.handle is not None:
            self._spawn(asyncio.to_thread(ex.handle.kill), f"cancel of execution {eid}")
            self.proxy.close_execution(eid)
        self._emit(ev.ExecutionEnded(eid, Outcome.CANCELLED))

    def _account_group(self, gid: int, fate: str) -> None:
        for ex in self._execs.values():
            if ex.group_id == gid and ex.fate in ("ended",):
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
        c = self.cells[cell]
        url = c.engine_url
        self._engine_role[cell] = "training"

        def hand_off(rids: Sequence[str]) -> None:
            pass  # the scheduler's Reroute commands already moved this engine's executions

        # The proxy stops routing here first, so calls aborted below retry on their new engine.
        self.proxy.reroute(url, [x.engine_url for x in self.cells if self._engine_role[x.index] == "rollout"])
        phases: list[PhaseTiming] = []
        ato = getattr(c.serving, "ato_training", None)
        if ato is not None:
            phases += await ato(hand_off)
        else:
            phases += await asyncio.to_thread(c.serving.to_training, hand_off)
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
        rewards = [self._execs[e].reward for g in st.groups for e in self._group_members(g)
                   if self._execs[e].reward is not None and self._execs[e].fate == "trained"]
        rec = {"step": st.step, "groups": list(st.groups), "staleness": list(st.staleness),
               "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
               "executions": len(rewards), "cells": sorted(set(st.cells)),
               "duration_s": round(self.now() - st.started, 3), "micro_steps": st.packing.micro_steps}
        self.step_records.append(rec)
        self.progress(f"step {st.step} done in {rec['duration_s']:.1f} s: mean reward {rec['mean_reward']}, "
                      f"staleness {st.staleness}")
        del self._steps[st.step]
        self._emit(ev.MicroStepsDone(st.step))

    def _group_members(self, gid: int) -> list[int]:
        return [e for e, x in self._execs.items() if x.group_id == gid]

    async def _publish(self, version: int) -> None:
        core = self.cells[0]
        ref = await self._cell_call(0, core.training.publish_weights, version)
        self.weights = ref
        for c in self.cells:
            if self._engine_role[c.index] == "rollout":
                aload = getattr(c.serving, "aload_weights", None)
                if aload is not None:
                    await aload(ref)
                else:
                    await asyncio.to_thread(c.serving.load_weights, ref)
        self.proxy.policy_version = version
        self.progress(f"published policy version {version}")
        self._emit(ev.PublicationDone(version))

    async def shutdown(self) -> None:
        """Stop what the run still has in flight: harnesses still running at the end are killed
        (counted as ``stopped``: launched, never finished, never trained), then every task."""
        for ex in self._execs.values():
            if ex.fate == "running" and ex.handle is not None:
                ex.fate = "stopped"
                await asyncio.to_thread(ex.handle.kill)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ summary

    def executions_summary(self) -> dict[str, int]:
        snap = self.sched.snapshot()
        fates: dict[str, int] = defaultdict(int)
        for ex in self._execs.values():
            fates[ex.fate] += 1
        return {"dispatched": snap.dispatched, "launched": snap.launched, "finished": snap.finished,
                "trained": fates["trained"], "excluded": fates["excluded"], "dropped": fates["dropped"],
                "surplus": fates["surplus"], "cancelled": fates["cancelled"],
                "waiting": fates["ended"], "running": fates["running"], "stopped": fates["stopped"]}

    def summary(self) -> dict[str, Any]:
        st = self.staleness
        return {
            "mode": self.cfg.scheduler.mode.value,
            "steps": self.sched.steps_done,
            "wall_s": round(self.now(), 2),
            "mean_staleness": round(sum(st) / len(st), 4) if st else None,
            "rewards": [r["mean_reward"] for r in self.step_records],
            "step_records": self.step_records,
            "role_switches": self.role_switches,
            "executions": self.executions_summary(),
        }
