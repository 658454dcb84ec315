"""The scheduler's vocabulary: events it consumes and commands it emits.

The scheduler never performs I/O. A driver (the simulator, or the live orchestrator) turns the
world into :class:`Event` values, feeds them to :meth:`Scheduler.handle` together with the current
time, and carries out the :class:`Command` values it gets back. Keeping both sides as plain frozen
dataclasses lets the same state machine be replayed from an event log.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union


class Outcome(str, enum.Enum):
    """How an execution terminated.

    ``completed`` and ``harness_timeout`` are assessed and used for training; ``failed`` is a
    complete failure that gets a zero-reward placeholder; ``overall_timeout`` exhausted the
    execution's budget before a valid reward and is excluded; ``cancelled`` is a surplus or
    aborted execution that produces no reward.
    """

    COMPLETED = "completed"
    HARNESS_TIMEOUT = "harness_timeout"
    OVERALL_TIMEOUT = "overall_timeout"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Role(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAINING = "training"


STANDALONE = -1
"""Engine id of the optional standalone rollout pool (cells are 0..K-1)."""


# --------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Start:
    """The driver is ready: engines of every cell serve version 0."""


@dataclass(frozen=True)
class ExecutionEnded:
    """An execution terminated (its harness exited, timed out, or was cancelled)."""

    execution_id: int
    outcome: Outcome


@dataclass(frozen=True)
class EvaluationValid:
    """The evaluator returned a valid score for a terminated execution (zero placeholders too)."""

    execution_id: int


@dataclass(frozen=True)
class EvaluationUnresolved:
    """The evaluator gave no valid score.

    ``final`` is False while retries against the preserved state remain inside the execution's
    overall budget (the scheduler keeps waiting) and True once the budget is spent: the execution
    is then excluded and can never count towards its group.
    """

    execution_id: int
    final: bool


@dataclass(frozen=True)
class BufferLow:
    """The packing buffer of the running step wants one more ready group (streaming pull)."""

    step: int


@dataclass(frozen=True)
class MicroStepsDone:
    """Every micro-step of ``step`` has been trained and the core applied the optimizer update."""

    step: int


@dataclass(frozen=True)
class TransitionDone:
    """A cell finished switching to ``role`` (engines restored, or training state restored)."""

    cell: int
    role: Role


@dataclass(frozen=True)
class PublicationDone:
    """Every rollout engine now serves policy ``version``."""

    version: int


@dataclass(frozen=True)
class Tick:
    """Nothing happened but time passed (lets the supply timer τ fire)."""


Event = Union[
    Start,
    ExecutionEnded,
    EvaluationValid,
    EvaluationUnresolved,
    BufferLow,
    MicroStepsDone,
    TransitionDone,
    PublicationDone,
    Tick,
]


# ------------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class DispatchGroup:
    """A new rollout group was admitted: the driver picks its query.

    ``execution_ids`` are the queued entries (N, or N' with oversampling); ``version`` is the
    latest published policy version at admission (v_d). ``refill_of`` names the short group whose
    missing executions these are (top-up rule), else None.
    """

    group_id: int
    execution_ids: tuple[int, ...]
    version: int
    refill_of: int | None = None


@dataclass(frozen=True)
class Launch:
    """Create the harness and sandbox for a queued execution, routed to ``engine``."""

    execution_id: int
    group_id: int
    engine: int


@dataclass(frozen=True)
class Cancel:
    """Cancel a running execution (oversampled surplus); the driver answers ExecutionEnded."""

    execution_id: int


@dataclass(frozen=True)
class Reroute:
    """Move a running execution's model calls from one engine to another (harness untouched)."""

    execution_id: int
    source: int
    destination: int


@dataclass(frozen=True)
class CellToTraining:
    cell: int


@dataclass(frozen=True)
class CellToRollout:
    cell: int


@dataclass(frozen=True)
class StartStep:
    """Open the stream of training step ``step`` on the given training cells.

    The step consumes policy version ``step`` and produces ``step + 1``.
    """

    step: int
    cells: tuple[int, ...]


@dataclass(frozen=True)
class JoinStep:
    """A cell that just entered training joins the running step (pulls the core's snapshot)."""

    step: int
    cell: int


@dataclass(frozen=True)
class AssignGroup:
    """Hand a ready group to the packing buffer of ``step``; ``staleness`` = step - v_d."""

    step: int
    group_id: int
    staleness: int


@dataclass(frozen=True)
class CloseStream:
    """All B groups of ``step`` are assigned: drain once the queue is empty."""

    step: int


@dataclass(frozen=True)
class Publish:
    """Publish policy ``version`` from the core to every rollout engine."""

    version: int


@dataclass(frozen=True)
class GroupDropped:
    """A group can no longer reach N valid rewards and was dropped (drop rule)."""

    group_id: int


@dataclass(frozen=True)
class GroupFiltered:
    """Filter rule: every execution of a group short of N valid rewards has terminated.

    The group is ready with the ``valid`` rewards it holds (advantages over those), or, with fewer
    than the configured minimum, ``empty``: it is consumed like any group but trains nothing. The
    data plane's trajectory buffer follows this command rather than deciding for itself.
    """

    group_id: int
    valid: int
    empty: bool


Command = Union[
    DispatchGroup,
    Launch,
    Cancel,
    Reroute,
    CellToTraining,
    CellToRollout,
    StartStep,
    JoinStep,
    AssignGroup,
    CloseStream,
    Publish,
    GroupDropped,
    GroupFiltered,
]
