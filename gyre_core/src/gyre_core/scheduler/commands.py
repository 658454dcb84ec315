"""How a driver carries out the scheduler's commands: one handler method per command type.

The scheduler (:mod:`gyre_core.scheduler.state_machine`) decides; its drivers act. The simulator
acts in simulated time, the live orchestrator on real engines and ranks, and the live
orchestrator's resume only rebuilds its bookkeeping from the journal. Each implements
:class:`CommandHandler`, and :func:`carry_out` picks the method by the command's type. A new
command type is then one entry in :data:`HANDLER_METHODS` and one method per driver, and a
driver that lacks it fails loudly (``tests/test_commands.py`` checks every driver) instead of
ignoring the command in a forgotten ``isinstance`` branch.
"""

from __future__ import annotations

from typing import Protocol

from gyre_core.scheduler import events as ev

__all__ = ["HANDLER_METHODS", "CommandHandler", "carry_out"]


class CommandHandler(Protocol):
    """What a driver does with each scheduler command."""

    def on_dispatch_group(self, cmd: ev.DispatchGroup) -> None: ...

    def on_launch(self, cmd: ev.Launch) -> None: ...

    def on_cancel(self, cmd: ev.Cancel) -> None: ...

    def on_reroute(self, cmd: ev.Reroute) -> None: ...

    def on_cell_to_training(self, cmd: ev.CellToTraining) -> None: ...

    def on_cell_to_rollout(self, cmd: ev.CellToRollout) -> None: ...

    def on_start_step(self, cmd: ev.StartStep) -> None: ...

    def on_join_step(self, cmd: ev.JoinStep) -> None: ...

    def on_assign_group(self, cmd: ev.AssignGroup) -> None: ...

    def on_close_stream(self, cmd: ev.CloseStream) -> None: ...

    def on_publish(self, cmd: ev.Publish) -> None: ...

    def on_group_dropped(self, cmd: ev.GroupDropped) -> None: ...

    def on_group_filtered(self, cmd: ev.GroupFiltered) -> None: ...


HANDLER_METHODS: dict[type, str] = {
    ev.DispatchGroup: "on_dispatch_group",
    ev.Launch: "on_launch",
    ev.Cancel: "on_cancel",
    ev.Reroute: "on_reroute",
    ev.CellToTraining: "on_cell_to_training",
    ev.CellToRollout: "on_cell_to_rollout",
    ev.StartStep: "on_start_step",
    ev.JoinStep: "on_join_step",
    ev.AssignGroup: "on_assign_group",
    ev.CloseStream: "on_close_stream",
    ev.Publish: "on_publish",
    ev.GroupDropped: "on_group_dropped",
    ev.GroupFiltered: "on_group_filtered",
}
"""Command type -> the :class:`CommandHandler` method that carries it out."""


def carry_out(handler: CommandHandler, cmd: ev.Command) -> None:
    """Have ``handler`` carry out ``cmd`` (a ``TypeError`` for anything not a scheduler command)."""
    try:
        name = HANDLER_METHODS[type(cmd)]
    except KeyError:
        raise TypeError(f"not a scheduler command: {cmd!r}") from None
    getattr(handler, name)(cmd)
