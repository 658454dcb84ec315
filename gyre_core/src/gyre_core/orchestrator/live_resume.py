"""Resume of a crashed live run from its journal.

The journalled events are fed to a fresh scheduler; its commands are replayed as bookkeeping
(:mod:`gyre_core.orchestrator.resume_commands`), and what was in flight at the crash is redone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from gyre_core.dataplane.assessment import EvalState
from gyre_core.dataplane.trajectory_buffer import ScoredExecution, TrajectoryBuffer
from gyre_core.interfaces import Assessment
from gyre_core.orchestrator.journal import Replay, event_from_json, selected_from_json, tree_from_json
from gyre_core.orchestrator.live_cells import LiveCells
from gyre_core.orchestrator.live_executions import LiveExecutions
from gyre_core.orchestrator.live_publication import LivePublication
from gyre_core.orchestrator.live_steps import LiveSteps
from gyre_core.orchestrator.resume_commands import DataPlaneActions, ReplayCommands
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.commands import carry_out
from gyre_core.scheduler.events import Outcome, Role
from gyre_core.scheduler.state_machine import Scheduler

log = logging.getLogger("gyre.orchestrator")


class JournalResume:
    """Journal replay for the live run: a fold of the journal into the scheduler's state and the
    components' (executions, steps, cells), then a redo of what was in flight, through the same
    components the live run uses. Its clock must already read the journal's last time."""

    def __init__(self, cfg: RunConfig, *, sched: Scheduler, cells: LiveCells, executions: LiveExecutions,
                 steps: LiveSteps, publication: LivePublication, buffer: TrajectoryBuffer, proxy: Any,
                 now: Callable[[], float], emit: Callable[[ev.Event], None], spawn: Callable[[Any, str], None],
                 progress: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.sched = sched
        self.cells = cells
        self.executions = executions
        self.steps = steps
        self.publication = publication
        self.buffer = buffer
        self.proxy = proxy
        self.now = now
        self._emit = emit
        self._spawn = spawn
        self.progress = progress

    async def run(self, replay: Replay) -> None:
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
        self.steps.checkpoints = dict(replay.checkpoints)  # the ones still on disk (keep_last pruned the rest)
        launched: dict[int, ev.Launch] = {}
        ended: set[int] = set()
        cancels: set[int] = set()
        pending_role: dict[int, Role] = {}
        role = ["rollout"] * len(self.cells)
        steps: dict[int, dict[str, Any]] = {}
        done_steps: set[int] = set()
        evaluated: set[int] = set()
        verdict_fed: set[int] = set()  # executions whose EvaluationValid / final Unresolved was fed

        actions = DataPlaneActions(dispatch=self.executions.dispatch, account_group=self.executions.account_group,
                                   short_group=self.executions.short_group, register_deadline=self.executions.ledger.register)
        replayed = ReplayCommands(self.executions.records, actions, self.cfg.harness.overall_budget_s,
                                  launched, cancels, pending_role, steps)
        for rec in replay.order:
            kind = rec["kind"]
            if kind == "event":
                t = float(rec["t"])
                event = event_from_json(rec["event"])
                if isinstance(event, ev.ExecutionEnded):
                    eid = event.execution_id
                    ended.add(eid)
                    cancels.discard(eid)
                    ex = self.executions.records[eid]
                    ex.outcome = event.outcome
                    if ex.fate == "running":
                        ex.fate = "ended"
                    if eid in self.executions.ledger and self.executions.ledger.state(eid) is EvalState.RUNNING:
                        if event.outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
                            self.executions.ledger.terminated(eid, event.outcome, self.executions.final_state(eid))
                        elif event.outcome is not Outcome.FAILED:
                            self.executions.ledger.terminated(eid, event.outcome, None)
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
                            self.executions.account_group(g, "trained", from_fates=("assigned",))
                        self.steps.records.append({"step": event.step, "groups": st["groups"],
                                                  "staleness": st["staleness"], "mean_reward": self.executions.mean_reward(st["groups"]),
                                                  "cells": sorted(set(st["cells"])), "replayed": True})
                elif isinstance(event, ev.PublicationDone):
                    if replayed.publish_pending == event.version:
                        replayed.publish_pending = None
                replayed.t = t
                for cmd in self.sched.handle(event, t):
                    carry_out(replayed, cmd)
            elif kind == "trajectory":
                ex = self.executions.records[int(rec["execution_id"])]
                ex.trajectory = (tree_from_json(rec["tree"]), selected_from_json(rec["selected"]))
                ex.harness_exit = rec.get("harness_exit")
            elif kind in ("scored", "placeholder"):
                eid = int(rec["execution_id"])
                ex = self.executions.records[eid]
                evaluated.add(eid)
                running = self.executions.ledger.state(eid) is EvalState.RUNNING  # its end is journalled next
                if kind == "placeholder":
                    ex.reward, ex.placeholder = 0.0, True
                    if running:
                        self.executions.ledger.terminated(eid, Outcome.FAILED, None)
                    elif self.executions.ledger.state(eid) is EvalState.AWAITING:  # the task declared it after it ended
                        self.executions.ledger.evaluate(eid, lambda st: Assessment.complete_failure(st), self.now())
                    self.buffer.put(ScoredExecution.placeholder(eid, ex.group_id))
                else:
                    reward = float(rec["reward"])
                    ex.reward = reward
                    if running:
                        self.executions.ledger.terminated(eid, Outcome.COMPLETED, self.executions.final_state(eid))
                    self.executions.ledger.evaluate(eid, lambda st, r=reward: Assessment.valid(r, st), self.now())
                    if "tree" in rec:  # journals written before trajectories had their own entry
                        ex.trajectory = (tree_from_json(rec["tree"]), selected_from_json(rec["selected"]))
                    assert ex.trajectory is not None, f"journal: execution {eid} scored without its records"
                    if not self.buffer.put(ScoredExecution(eid, ex.group_id, reward, *ex.trajectory)):
                        ex.fate, ex.why = "surplus", "its group already had its rewards"
            elif kind == "excluded":
                eid = int(rec["execution_id"])
                evaluated.add(eid)
                self.executions.records[eid].fate = "excluded"
                self.executions.records[eid].why = str(rec.get("why") or "evaluation unresolved (journalled before causes were)")
                self.buffer.exclude(eid)
        self.progress(f"resumed from the journal at t={replay.last_time:.1f} s: {self.sched.steps_done} steps done, "
                      f"{len(launched) - len(ended)} execution(s) to restart")
        if replay.published:
            v = max(replay.published)
            self.proxy.policy_version = v

        # Bring the fresh cells to the roles the scheduler believes in, then redo what was in flight.
        for cell, r in enumerate(role):
            if r == "training":
                await self.cells.resume_in_training(cell)
        for cell, target in sorted(pending_role.items()):
            if target is Role.TRAINING:
                self._spawn(self.cells.to_training(cell), f"cell {cell} to training (resumed)")
            else:
                self._spawn(self.cells.to_rollout(cell, self.publication.weights), f"cell {cell} to rollout (resumed)")
        for step, st in sorted(steps.items()):
            self.steps.restart(step, st)
        if replayed.publish_pending is not None:
            v = replayed.publish_pending
            self._spawn(self.publication.publish(v), f"publication of version {v} (resumed)")
        for eid, cmd in launched.items():
            if eid not in ended and eid not in cancels:
                if self.executions.records[eid].trajectory is not None or eid in evaluated:
                    self._feed_unjournalled_end(eid)  # it had ended: never run it again
                    continue
                self._spawn(self.executions.launch(cmd, relaunch=True), f"relaunch of execution {eid}")
        for eid in cancels:
            self._emit(ev.ExecutionEnded(eid, Outcome.CANCELLED))
        for eid in ended:
            ex = self.executions.records[eid]
            if eid in evaluated and eid not in verdict_fed:  # its verdict was journalled, not yet fed
                valid = self.executions.ledger.state(eid) is EvalState.VALID
                self._emit(ev.EvaluationValid(eid) if valid else ev.EvaluationUnresolved(eid, final=True))
            if eid not in evaluated and ex.outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
                ex.spec = self.executions.spec_for(eid)
                self._spawn(self.executions.evaluate(eid), f"evaluation of execution {eid} (resumed)")

    def _feed_unjournalled_end(self, eid: int) -> None:
        """An execution whose records (and maybe its verdict) reached the journal before the crash
        but whose ``ExecutionEnded`` had not been fed yet (its evaluation runs as soon as it ends,
        while the end event waits in the queue): feed the end now, then what its verdict was."""
        ex = self.executions.records[eid]
        ex.outcome = Outcome.COMPLETED
        state = self.executions.ledger.state(eid)
        if state is EvalState.RUNNING:
            self.executions.ledger.terminated(eid, Outcome.COMPLETED, self.executions.final_state(eid))
        self._emit(ev.ExecutionEnded(eid, Outcome.COMPLETED))
        if ex.fate == "excluded":
            if self.executions.ledger.state(eid) is EvalState.AWAITING:
                self.executions.ledger.exclude(eid)
            self._emit(ev.EvaluationUnresolved(eid, final=True))
        elif self.executions.ledger.state(eid) is EvalState.VALID:
            if ex.fate == "running":
                ex.fate = "ended"
            self._emit(ev.EvaluationValid(eid))
        else:  # records only: evaluate it now, as any ended execution
            ex.fate = "ended"
            ex.spec = self.executions.spec_for(eid)
            self._spawn(self.executions.evaluate(eid), f"evaluation of execution {eid} (resumed)")
