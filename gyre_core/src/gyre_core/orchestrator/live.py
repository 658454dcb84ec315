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

Where each part lives: this module holds the loop, the clock, the event queue and one method
per scheduler command (the :class:`~gyre_core.scheduler.commands.CommandHandler` interface the
simulator implements too); what the commands set in motion is in ``live_executions`` (the
:class:`LiveExecutions` component: dispatch, launch, end, evaluation, cancel, fates), ``live_cells`` (the :class:`LiveCells` component: roles, role
switches, rerouting, KV hand-off, the role timeline), ``live_publication`` (the
:class:`LivePublication` component: the served version, publications, kept model folders),
``live_steps`` (the :class:`LiveSteps` component: training steps) and ``live_resume`` (journal replay, with
``resume_commands`` replaying the scheduler's commands as bookkeeping).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import is_dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from gyre_core.dataplane.packing import PackingConfig
from gyre_core.dataplane.trajectory_buffer import TrajectoryBuffer
from gyre_core.interfaces import StreamHealth, WeightsRef
from gyre_core.orchestrator.evaluation import HeldOutEvaluation
from gyre_core.orchestrator.failure import RunFailed
from gyre_core.orchestrator.journal import Journal, Replay
from gyre_core.orchestrator.live_cells import CellHandles, LiveCells, StandaloneHandles
from gyre_core.orchestrator.live_executions import LiveExecutions, _jsonable
from gyre_core.orchestrator.live_publication import LivePublication
from gyre_core.orchestrator.live_resume import JournalResume
from gyre_core.orchestrator.live_steps import LiveSteps
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.orchestrator.status_line import StatusLine, status_text
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.commands import carry_out
from gyre_core.scheduler.state_machine import Scheduler

__all__ = ["CellHandles", "LiveOrchestrator", "RunFailed", "StandaloneHandles"]

log = logging.getLogger("gyre.orchestrator")


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
        standalone: StandaloneHandles | None = None,
        status: StatusLine | None = None,
    ) -> None:
        if len(cells) != cfg.scheduler.cells:
            raise ValueError(f"{len(cells)} cells given, scheduler.cells = {cfg.scheduler.cells}")
        if (standalone is None) != (cfg.scheduler.standalone_capacity == 0):
            raise ValueError("a standalone engine is needed exactly when scheduler.standalone_capacity > 0")
        self.status = status
        """The live status line (None: no display, e.g. when the caller takes the progress lines)."""
        self.cfg = cfg
        self.proxy = proxy
        self.proxy_url = proxy_url
        self.sandbox = dict(sandbox) if sandbox else None
        """Each harness's sandbox (:class:`gyre_core.orchestrator.sandbox.SandboxSpec` as a dict), or None."""
        self.pm = pm
        self.out_dir = Path(out_dir)
        self.clock = clock
        self.progress = progress or (lambda msg: None)
        self.event_log = event_log
        self._watchdog: Any = None
        # Harness waits and evaluator calls get their own pool: every running harness blocks a
        # thread in wait() and a hung evaluator keeps its thread until it returns, which would
        # starve the default pool (cores + 4 threads) that cell and engine calls use.
        self._blocking = ThreadPoolExecutor(max_workers=4 * cfg.scheduler.cells * cfg.scheduler.cell_capacity + 16,
                                            thread_name_prefix="gyre-blocking")
        self.journal = journal
        self.replay = replay
        self.sched = Scheduler(cfg.scheduler, total_steps=cfg.run.steps)
        self.buffer = TrajectoryBuffer(cfg.scheduler.group_size)
        self.packing_cfg = PackingConfig(token_budget=cfg.dataplane.token_budget, dp_size=1, min_fill=0.5,
                                         whole_executions=cfg.dataplane.whole_executions)
        self._events: asyncio.Queue[ev.Event] = asyncio.Queue()
        self._t0 = clock()
        self.cells = LiveCells(cells, standalone, proxy=proxy, now=self.now, emit=self._emit, record=self._record_phase)
        """The cells and the standalone pool: roles, switches, the role timeline."""
        self.publication = LivePublication(cfg, self.cells, proxy, weights, self.out_dir, now=self.now, emit=self._emit,
                                           progress=self.progress, journal=journal, published=self._published)
        """The served policy version and its publications."""
        self.executions = LiveExecutions(cfg, proxy=proxy, proxy_url=proxy_url, pm=pm, out_dir=self.out_dir,
                                         sandbox=self.sandbox, journal=journal, buffer=self.buffer, cells=self.cells,
                                         now=self.now, emit=self._emit, spawn=self._spawn, blocking=self._blocking)
        """The executions and their groups, from dispatch to a reward (and the assessment ledger)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None
        self.steps = LiveSteps(cfg, cells=self.cells, executions=self.executions, publication=self.publication,
                               buffer=self.buffer, packing_cfg=self.packing_cfg, journal=journal, out_dir=self.out_dir,
                               event_log=event_log, pm=pm, call_stats=lambda: proxy.call_stats.drain(), now=self.now, emit=self._emit,
                               spawn=self._spawn, progress=self.progress, executions_summary=self.executions_summary,
                               interrupted_calls=self._interrupted_calls)
        """The training steps: open ones, their records, failed cells' recovery, checkpoints."""
        self.evaluation = self._held_out_evaluation()
        """Held-out evaluation on publications (None without ``task.eval``)."""

    def _held_out_evaluation(self) -> HeldOutEvaluation | None:
        cfg = self.cfg
        if not cfg.task.eval:
            return None

        def report(version: int, metrics: dict[str, float]) -> None:
            try:
                self.pm.hook.gyre_on_metrics(step=version, metrics=metrics)
            except Exception as exc:  # an observer must not cost the run
                log.warning("metrics observer failed on the evaluation of version %s: %s", version, exc)

        return HeldOutEvaluation.for_run(cfg, self.pm, proxy=self.proxy, proxy_url=self.proxy_url, out_dir=self.out_dir,
                                         sandbox=self.sandbox, progress=self.progress, report=report, now=self.now)

    @property
    def weights(self) -> WeightsRef:
        """The policy version the engines serve now."""
        return self.publication.weights

    @property
    def watchdog(self) -> Any:
        """The engine watchdog (:class:`~gyre_core.orchestrator.watchdog.EngineWatchdog`), set by
        the launcher: switches wait for an engine it restarts, and a failed load is its to repair."""
        return self._watchdog

    @watchdog.setter
    def watchdog(self, watchdog: Any) -> None:
        self._watchdog = watchdog
        self.cells.wait_ready = watchdog.ready if watchdog is not None else None
        self.publication.watchdog = watchdog

    def _published(self, version: int) -> None:
        if self.evaluation is not None:  # held-out tasks on this policy, beside the run
            self.evaluation.start(version, self.cfg.run.steps)

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

    def _record_phase(self, phase: Any) -> None:
        """A phase of a role switch, for the observers and the event log."""
        self.pm.hook.gyre_on_event(time=self.now(), event=phase)
        self._log("phase", phase)

    # ------------------------------------------------------------------ main loop

    async def run(self) -> dict[str, Any]:
        steps = self.cfg.run.steps
        deadline = self.cfg.run.max_wall_s
        if self.replay is not None:
            self._t0 = self.clock() - self.replay.last_time  # the run's clock goes on from the journal's
            await JournalResume(self.cfg, sched=self.sched, cells=self.cells, executions=self.executions,
                                steps=self.steps, publication=self.publication, buffer=self.buffer, proxy=self.proxy,
                                now=self.now, emit=self._emit, spawn=self._spawn, progress=self.progress).run(self.replay)
        else:
            if self.journal is not None:
                self.journal.write("config", config=self.cfg.as_dict())
            self._handle(ev.Start())
        if self.evaluation is not None:
            self.evaluation.start(self.weights.version, steps)
        poller = asyncio.ensure_future(self._poll_buffers())
        ticker = asyncio.ensure_future(self._show_status()) if self.status is not None else None
        try:
            # end on a published policy: after the last step's burst, wait for satellites to return
            # and for the core's publication (a run whose last step a satellite joined ended unpublished)
            while self.sched.steps_done < steps or self.publication.in_flight is not None or self.sched.publication_pending():
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
            if ticker is not None:
                ticker.cancel()
                self.status.close()  # type: ignore[union-attr]
        self.cells.close_timeline()
        if self.evaluation is not None:
            await self.evaluation.finish()  # the last version's, started at its publication
        return self.summary()

    def _handle(self, event: ev.Event) -> None:
        if self.journal is not None:
            self.journal.event(self.now(), event)
        commands = self.sched.handle(event, self.now())
        self._log("event", event)
        for cmd in commands:
            self._log("command", cmd)
            self._execute(cmd)

    def status_text(self) -> str:
        """Where the run stands, in one line (see :mod:`gyre_core.orchestrator.status_line`)."""
        snap = self.sched.snapshot()
        last = next((r["mean_reward"] for r in reversed(self.steps.records) if r.get("mean_reward") is not None), None)
        return status_text(steps_done=snap.steps_done, steps_total=self.cfg.run.steps,
                           cell_roles=self.cells.roles(), running=snap.running,
                           ready_groups=len(self.buffer.ready()),
                           trained=sum(1 for ex in self.executions.records.values() if ex.fate == "trained"),
                           last_reward=last, elapsed_s=self.now())

    async def _show_status(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.status.update(self.status_text())  # type: ignore[union-attr]
            except Exception:  # a display must never stop a run
                log.exception("status line failed")
                return

    async def _poll_buffers(self) -> None:
        """Streaming pulls: the open step's packing buffer asks for a group when it runs low.

        And the core's part of an open step must still be running: if its ranks stopped (one
        raised, e.g. out of memory, or died), nobody claims the step's micro-steps, the buffer
        never runs low again and the step would never close. The run fails at once instead,
        naming the rank's error (``--resume`` redoes the step from the last checkpoint)."""
        core = self.cells[0].training
        health = core if isinstance(core, StreamHealth) else None
        while True:
            await asyncio.sleep(0.2)
            for st in list(self.steps.open.values()):
                low = st.packing.poll_low()
                if low is not None:
                    self._emit(low)
                if health is not None and not st.closing and self._failure is None and 0 in st.cells:
                    why = await asyncio.to_thread(health.stream_failure, st.step)
                    if why is not None and not st.closing:
                        self._failure = RunFailed(f"step {st.step}: the core's training ranks stopped before "
                                                  f"the step's stream closed: {why}")
                        self._emit(ev.Tick())  # wake the loop so it sees the failure

    # ------------------------------------------------------------------ commands

    def _execute(self, cmd: ev.Command) -> None:
        carry_out(self, cmd)

    # One method per scheduler command (the CommandHandler interface), on the real cells.

    def on_dispatch_group(self, cmd: ev.DispatchGroup) -> None:
        self.executions.dispatch(cmd)

    def on_launch(self, cmd: ev.Launch) -> None:
        self.executions.records[cmd.execution_id].fate = "launching"  # counted launched from now on
        self.executions.records[cmd.execution_id].launched_on = cmd.engine
        self._spawn(self.executions.launch(cmd), f"launch of execution {cmd.execution_id}")

    def on_cancel(self, cmd: ev.Cancel) -> None:
        self.executions.cancel(cmd.execution_id)

    def on_reroute(self, cmd: ev.Reroute) -> None:
        self.proxy.router.pin(cmd.execution_id, self.cells.engine_url(cmd.destination))
        self.executions.records[cmd.execution_id].engine = cmd.destination

    def on_cell_to_training(self, cmd: ev.CellToTraining) -> None:
        self.cells.set_role(cmd.cell, "to_training")
        self._spawn(self.cells.to_training(cmd.cell), f"cell {cmd.cell} to training")

    def on_cell_to_rollout(self, cmd: ev.CellToRollout) -> None:
        self.cells.set_role(cmd.cell, "to_rollout")
        self._spawn(self.cells.to_rollout(cmd.cell, self.weights), f"cell {cmd.cell} to rollout")

    def on_start_step(self, cmd: ev.StartStep) -> None:
        self.steps.start(cmd)

    def on_join_step(self, cmd: ev.JoinStep) -> None:
        self.steps.join(cmd.step, cmd.cell)

    def on_assign_group(self, cmd: ev.AssignGroup) -> None:
        self.steps.assign(cmd.step, cmd.group_id, cmd.staleness)

    def on_close_stream(self, cmd: ev.CloseStream) -> None:
        self.steps.close(cmd.step)

    def on_publish(self, cmd: ev.Publish) -> None:
        self.publication.in_flight = cmd.version
        self._spawn(self.publication.publish(cmd.version), f"publication of version {cmd.version}")

    def on_group_dropped(self, cmd: ev.GroupDropped) -> None:
        self.executions.short_group(cmd)

    def on_group_filtered(self, cmd: ev.GroupFiltered) -> None:
        self.executions.short_group(cmd)


    async def shutdown(self) -> None:
        """Stop what the run still has in flight, and account for it.

        Harnesses still running (or about to start) are killed and counted as ``stopped``:
        launched, never finished, never trained. Then every task is cancelled, and events that
        happened but were not fed yet (an execution that ended as the last step closed) are fed
        and journalled; their commands are not carried out now -- a later ``--resume`` finds them
        outstanding and carries them out then.
        """
        for ex in self.executions.records.values():
            if ex.fate in ("running", "launching"):
                ex.fate = "stopped"
                if ex.handle is not None:
                    await asyncio.to_thread(ex.handle.kill)
        if self.evaluation is not None:  # a failed run's evaluations still running
            await self.evaluation.cancel()
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
                    self.executions.dispatch(cmd)
                elif isinstance(cmd, ev.Launch):  # counted launched, never started: stopped
                    self.executions.records[cmd.execution_id].fate = "stopped"
                    self.executions.records[cmd.execution_id].launched_on = cmd.engine
        self._blocking.shutdown(wait=False)

    # ------------------------------------------------------------------ summary

    def executions_summary(self) -> dict[str, Any]:
        snap = self.sched.snapshot()
        fates: dict[str, int] = defaultdict(int)
        for ex in self.executions.records.values():
            fates[ex.fate] += 1
        launched_on: dict[str, int] = defaultdict(int)
        for ex in self.executions.records.values():
            if ex.launched_on is not None:
                launched_on["standalone" if ex.launched_on < 0 else f"cell{ex.launched_on}"] += 1
        return {"dispatched": snap.dispatched, "launched": snap.launched, "finished": snap.finished,
                "launched_on": dict(sorted(launched_on.items())),
                "trained": fates["trained"], "excluded": fates["excluded"], "dropped": fates["dropped"],
                "filtered": fates["filtered"],
                "surplus": fates["surplus"], "cancelled": fates["cancelled"],
                "waiting": fates["ended"] + fates["assigned"], "running": fates["running"],
                "stopped": fates["stopped"], "not_trained": self.not_trained(),
                # trained as the zero-reward placeholder of a complete failure the task declared
                "zero_placeholders": sum(1 for ex in self.executions.records.values() if ex.placeholder and ex.fate == "trained"),
                # answered at least once with a 5xx by Gyre (excluded unless the task vouched)
                "saw_infrastructure_errors": sum(1 for ex in self.executions.records.values() if ex.infra_errors)}

    def not_trained(self) -> dict[str, dict[str, int]]:
        """Every finished execution that was not trained, counted by fate and cause: which
        evaluator failure or timeout excluded it, which group rule filtered or dropped it, or that
        the run ended before a step took it (``waiting``). A slow machine shows here as
        exclusions by timeout or as waiting executions, never as a silent gap."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for ex in self.executions.records.values():
            if ex.fate in ("excluded", "dropped", "filtered", "surplus", "cancelled"):
                out[ex.fate][ex.why or "cause not recorded"] += 1
            elif ex.fate == "ended":
                out["waiting"]["ended after the last step took its groups"] += 1
            elif ex.fate == "assigned":
                out["waiting"]["in a step the run's end cut short"] += 1
        return {fate: dict(sorted(causes.items())) for fate, causes in sorted(out.items())}

    def summary(self) -> dict[str, Any]:
        # Over the groups of completed steps: a step the run's end cut short trained nothing.
        st = [d for rec in self.steps.records for d in rec["staleness"]]
        return {
            "mode": self.cfg.scheduler.mode.value,
            "steps": self.sched.steps_done,
            "wall_s": round(self.now(), 2),
            "mean_staleness": round(sum(st) / len(st), 4) if st else None,
            "rewards": [r["mean_reward"] for r in self.steps.records],
            "losses": [r.get("loss") for r in self.steps.records],
            "grad_norms": [r.get("grad_norm") for r in self.steps.records],
            "step_records": self.steps.records,
            "role_switches": self.cells.role_switches,
            "publications": self.publication.records,
            "executions": self.executions_summary(),
            "interrupted_calls": self._interrupted_calls(),
            "satellite_failures": self.steps.satellite_failures,
            # the elastic mechanism at work: a satellite sent into a step that was already training
            "running_step_joins": [{"step": r["step"], **j} for r in self.steps.records
                                   for j in r.get("joined_running", [])],
            # held-out pass rate and mean reward per evaluated policy version (task.eval, [eval])
            "evaluations": list(self.evaluation.results) if self.evaluation is not None else [],
        }

    def _interrupted_calls(self) -> dict[str, Any] | None:
        """Calls cut short by a role change or a dead engine: continued on the KV they handed
        off, re-prefilled (and why), or generated again; prefill tokens the hand-offs saved."""
        return dict(self.proxy.handoffs.summary())
