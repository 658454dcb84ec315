"""The scheduler's commands as a resume replays them: bookkeeping only, nothing is started.

While ``LiveOrchestrator`` rebuilds a crashed run from its journal, it feeds every journalled
event to a fresh scheduler, which answers with the same commands as in the original run. Those
commands already happened (or died with the crash), so :class:`ReplayCommands` only records
what they leave behind: which executions were launched or cancelled, which role changes and
training steps were under way, which publication was pending. What is still in flight at the
end of the journal is then redone by the orchestrator. Dispatching a group and the scheduler's
decisions on short groups do act on the data plane, exactly as in a live run.

It is handed what it may touch (the executions' records and four actions of the data plane),
never the orchestrator itself, so replay cannot reach into the live run's other state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gyre_core.orchestrator.live_executions import LiveExecution
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Role

__all__ = ["DataPlaneActions", "ReplayCommands"]


@dataclass(frozen=True)
class DataPlaneActions:
    """What replaying the scheduler's commands does to the data plane, as in the live run."""

    dispatch: Callable[[ev.DispatchGroup], None]
    """Create a dispatched group's executions (and their records)."""
    account_group: Callable[[int, str], None]
    """Move a group's ended executions to a fate (``assigned`` to a step)."""
    short_group: Callable[[ev.GroupDropped | ev.GroupFiltered], None]
    """Carry out the scheduler's decision on a group short of valid rewards."""
    register_deadline: Callable[[int, float], None]
    """Give a launched execution its evaluation deadline (the assessment ledger's)."""


class ReplayCommands:
    """A :class:`~gyre_core.scheduler.commands.CommandHandler` for journal replay; ``t`` is the
    journalled time of the event whose commands are being replayed."""

    def __init__(self, execs: Mapping[int, LiveExecution], actions: DataPlaneActions, budget_s: float,
                 launched: dict[int, ev.Launch], cancels: set[int], pending_role: dict[int, Role],
                 steps: dict[int, dict[str, Any]]) -> None:
        self.execs = execs
        self.actions = actions
        self.budget_s = budget_s
        """The harness's overall budget: a launched execution must be assessed by launch + this."""
        self.launched = launched
        self.cancels = cancels
        self.pending_role = pending_role
        self.steps = steps
        self.publish_pending: int | None = None
        self.t = 0.0

    def on_dispatch_group(self, cmd: ev.DispatchGroup) -> None:
        self.actions.dispatch(cmd)

    def on_launch(self, cmd: ev.Launch) -> None:
        self.launched[cmd.execution_id] = cmd
        ex = self.execs[cmd.execution_id]
        ex.engine, ex.launched_on, ex.launched_at, ex.fate = cmd.engine, cmd.engine, self.t, "running"
        self.actions.register_deadline(cmd.execution_id, self.t + self.budget_s)

    def on_cancel(self, cmd: ev.Cancel) -> None:
        self.execs[cmd.execution_id].fate = "cancelled"
        self.cancels.add(cmd.execution_id)

    def on_reroute(self, cmd: ev.Reroute) -> None:
        self.execs[cmd.execution_id].engine = cmd.destination

    def on_cell_to_training(self, cmd: ev.CellToTraining) -> None:
        self.pending_role[cmd.cell] = Role.TRAINING

    def on_cell_to_rollout(self, cmd: ev.CellToRollout) -> None:
        self.pending_role[cmd.cell] = Role.ROLLOUT

    def on_start_step(self, cmd: ev.StartStep) -> None:
        self.steps[cmd.step] = {"cells": list(cmd.cells), "groups": [], "staleness": [], "closed": False}

    def on_join_step(self, cmd: ev.JoinStep) -> None:
        self.steps[cmd.step]["cells"].append(cmd.cell)

    def on_assign_group(self, cmd: ev.AssignGroup) -> None:
        self.steps[cmd.step]["groups"].append(cmd.group_id)
        self.steps[cmd.step]["staleness"].append(cmd.staleness)
        self.actions.account_group(cmd.group_id, "assigned")

    def on_close_stream(self, cmd: ev.CloseStream) -> None:
        self.steps[cmd.step]["closed"] = True

    def on_publish(self, cmd: ev.Publish) -> None:
        self.publish_pending = cmd.version

    def on_group_dropped(self, cmd: ev.GroupDropped) -> None:
        self.actions.short_group(cmd)

    def on_group_filtered(self, cmd: ev.GroupFiltered) -> None:
        self.actions.short_group(cmd)
