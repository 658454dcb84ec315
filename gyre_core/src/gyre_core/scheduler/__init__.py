"""The elastic scheduler: one pure state machine (``state_machine.Scheduler``) that the simulator
and the live orchestrator both drive, its event/command vocabulary (``events``) and the (φ, μ)
solver (``burst``)."""

from gyre_core.scheduler.burst import solve_burst
from gyre_core.scheduler.state_machine import CellState, Scheduler, SchedulerError, Snapshot

__all__ = ["CellState", "Scheduler", "SchedulerError", "Snapshot", "solve_burst"]
