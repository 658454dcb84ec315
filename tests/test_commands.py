"""Every driver carries out every scheduler command through the one handler interface.

The simulator, the live orchestrator and the live orchestrator's journal replay each implement
``CommandHandler``; a command type the scheduler can emit but a driver has no method for would be
a command silently ignored in one driver only.
"""

from __future__ import annotations

import typing

import pytest

from gyre_core.orchestrator.live import LiveOrchestrator
from gyre_core.orchestrator.resume_commands import ReplayCommands
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.commands import HANDLER_METHODS, CommandHandler, carry_out
from gyre_core.simulator.engine import Simulation


def test_every_command_type_has_a_handler_method() -> None:
    assert set(HANDLER_METHODS) == set(typing.get_args(ev.Command))
    protocol_methods = {n for n in vars(CommandHandler) if n.startswith("on_")}
    assert set(HANDLER_METHODS.values()) == protocol_methods


@pytest.mark.parametrize("driver", [Simulation, LiveOrchestrator, ReplayCommands])
def test_every_driver_handles_every_command(driver: type) -> None:
    missing = [m for m in HANDLER_METHODS.values() if not callable(getattr(driver, m, None))]
    assert not missing, f"{driver.__name__} lacks {missing}"


def test_carry_out_calls_the_method_of_the_command_type_and_refuses_anything_else() -> None:
    seen: list[tuple[str, object]] = []

    class Recorder:
        def __getattr__(self, name: str):
            return lambda cmd: seen.append((name, cmd))

    cmd = ev.Reroute(execution_id=3, source=0, destination=1)
    carry_out(Recorder(), cmd)  # type: ignore[arg-type]
    assert seen == [("on_reroute", cmd)]
    with pytest.raises(TypeError, match="not a scheduler command"):
        carry_out(Recorder(), ev.Tick())  # type: ignore[arg-type]
