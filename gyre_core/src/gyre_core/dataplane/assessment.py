"""Assessment of terminated executions: the reward, its validity, and what the scheduler is told.

Rules (the paper, "Rewards"):

* An execution is assessed after it terminates -- including after a harness timeout -- against the
  state it left, which is preserved (:class:`~gyre_core.interfaces.StateRef`).
* The reward is the evaluator's score, verbatim. Elapsed time, trajectory length and termination
  status never enter it: nothing here reads them except to decide *whether* to assess.
* An evaluator failure (an ``UNRESOLVED`` answer, an exception, or no evaluator answering) is
  unresolved, never a zero. It may be retried, against the same preserved state only, until the
  execution's overall budget expires; then the execution is excluded.
* A complete failure with nothing to assess (``Outcome.FAILED``, e.g. an image-pull failure) gets a
  zero-reward placeholder, which counts as a valid reward.
* Intermediate assessments stay attached to the state they assessed, in an append-only log per
  execution; nothing ever overwrites them, and they never become the reward.

Every method that changes what the scheduler must know returns the scheduler event to forward
(:class:`EvaluationValid` or :class:`EvaluationUnresolved`), so the ledger and the scheduler cannot
disagree about an execution.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable

from gyre_core.interfaces import Assessment, StateRef, Validity
from gyre_core.scheduler.events import EvaluationUnresolved, EvaluationValid, Outcome

__all__ = ["AssessmentLedger", "EvalState", "RewardRange"]

Evaluator = Callable[[StateRef], Assessment | None]
"""Assesses one preserved state; typically ``lambda s: hook.gyre_evaluate(spec=spec, state=s)``."""


@dataclass(frozen=True)
class RewardRange:
    """The closed interval valid rewards must lie in (default ``[0, 1]``).

    A score outside it, or NaN, is a broken evaluator or task definition: it is refused where it
    enters (an error), not clipped, because a clipped reward would silently train on a wrong signal.
    """

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise ValueError(f"reward range: need finite low <= high, got [{self.low}, {self.high}]")

    def check(self, score: object, what: str) -> float:
        """``score`` as a float, or a ValueError that names ``what``."""
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise ValueError(f"{what}: reward must be a number, got {score!r}")
        value = float(score)
        if math.isnan(value) or not self.low <= value <= self.high:
            raise ValueError(f"{what}: reward {score!r} outside [{self.low}, {self.high}]")
        return value


class EvalState(str, enum.Enum):
    RUNNING = "running"
    """Registered, not yet terminated."""
    AWAITING = "awaiting"
    """Terminated with assessable work; the final state is preserved; no valid score yet."""
    VALID = "valid"
    EXCLUDED = "excluded"
    """Budget expired without a valid score, overall timeout, or cancelled."""


@dataclass
class _Entry:
    deadline: float
    state: EvalState = EvalState.RUNNING
    final_state: StateRef | None = None
    reward: float | None = None
    placeholder: bool = False
    log: list[Assessment] = field(default_factory=list)


class AssessmentLedger:
    """Per-execution assessment bookkeeping between an execution's end and its reward.

    ``deadline`` of an execution is the end of its overall budget on the driver's clock (launch
    time + ``ExecutionSpec.overall_budget_s``); ``now`` arguments use the same clock.
    """

    def __init__(self, reward_range: RewardRange = RewardRange()) -> None:
        self.reward_range = reward_range
        self._entries: dict[int, _Entry] = {}

    # ----------------------------------------------------------------- lifecycle

    def register(self, execution_id: int, deadline: float) -> None:
        """An execution was launched; its overall budget ends at ``deadline``."""
        if execution_id in self._entries:
            raise ValueError(f"execution {execution_id} registered twice")
        if not math.isfinite(deadline):
            raise ValueError(f"execution {execution_id}: deadline must be finite, got {deadline!r}")
        self._entries[execution_id] = _Entry(float(deadline))

    def relaunch(self, execution_id: int, deadline: float) -> None:
        """The execution was running when the orchestrator crashed and is started again from
        scratch (same id, counted once): its budget restarts and nothing assessed survives."""
        e = self._entry(execution_id)
        if e.state is not EvalState.RUNNING:
            raise ValueError(f"execution {execution_id} is {e.state.value}: only a running one restarts")
        self._entries[execution_id] = _Entry(float(deadline))

    def record_intermediate(self, execution_id: int, assessment: Assessment) -> None:
        """Keep an assessment of an intermediate artifact, attached to the state it assessed.

        It is appended to the execution's log and is never the reward. A critique derived from it
        and shown to the policy is context only (``Provenance.EVALUATOR`` in the trajectory tree).
        """
        e = self._entry(execution_id)
        if assessment.validity is Validity.VALID:
            self.reward_range.check(assessment.score, f"execution {execution_id} (intermediate)")
        e.log.append(assessment)

    def terminated(
        self, execution_id: int, outcome: Outcome, state: StateRef | None
    ) -> EvaluationValid | None:
        """The execution ended with ``outcome``; ``state`` is the preserved final state, if any.

        ``COMPLETED`` and ``HARNESS_TIMEOUT`` need ``state`` and wait for :meth:`evaluate`.
        ``FAILED`` (nothing to assess) becomes a zero-reward placeholder at once: the returned
        :class:`EvaluationValid` is for the scheduler. ``OVERALL_TIMEOUT`` and ``CANCELLED`` are
        excluded; the scheduler already learns that from the ``ExecutionEnded`` event itself.
        """
        e = self._entry(execution_id)
        if e.state is not EvalState.RUNNING:
            raise ValueError(f"execution {execution_id} terminated twice")
        outcome = Outcome(outcome)
        if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
            if state is None:
                raise ValueError(
                    f"execution {execution_id}: {outcome.value} needs the preserved state to assess"
                )
            e.final_state, e.state = state, EvalState.AWAITING
            return None
        if outcome is Outcome.FAILED:
            e.state, e.reward, e.placeholder = EvalState.VALID, 0.0, True
            return EvaluationValid(execution_id)
        e.state = EvalState.EXCLUDED
        return None

    def evaluate(
        self, execution_id: int, evaluator: Evaluator, now: float
    ) -> EvaluationValid | EvaluationUnresolved:
        """Assess the preserved final state (a first attempt or a retry) and say what it gave.

        ``evaluator`` is always called with the preserved state. An exception or ``None`` counts as
        unresolved, which is retryable (``final=False``): call again later, or let :meth:`expire`
        exclude it. Once ``now`` has reached the deadline no attempt starts and the execution is
        excluded (``final=True``). A valid score outside the reward range, or an answer about a
        different state, raises and changes nothing.
        """
        e = self._entry(execution_id)
        if e.state is not EvalState.AWAITING:
            raise ValueError(f"execution {execution_id} is {e.state.value}, not awaiting assessment")
        assert e.final_state is not None
        if now >= e.deadline:  # no attempt may start once the budget is spent
            return self._exclude(execution_id, e)
        try:
            answer = evaluator(e.final_state)
        except Exception as exc:  # an evaluator crash is an unresolved assessment
            answer = Assessment.unresolved(e.final_state, f"evaluator raised {exc!r}")
        if answer is None:
            answer = Assessment.unresolved(e.final_state, "no evaluator answered")
        if answer.state != e.final_state:
            raise ValueError(
                f"execution {execution_id}: evaluator assessed {answer.state}, "
                f"not the preserved state {e.final_state}"
            )
        reward = None
        if answer.validity is Validity.VALID:
            reward = self.reward_range.check(answer.score, f"execution {execution_id}")
        e.log.append(answer)
        if reward is not None:
            e.state, e.reward = EvalState.VALID, reward
            e.placeholder = answer.nothing_to_assess  # the task's complete failure: a zero placeholder
            return EvaluationValid(execution_id)
        return EvaluationUnresolved(execution_id, final=False)

    def exclude(self, execution_id: int) -> EvaluationUnresolved:
        """Exclude an execution awaiting assessment now, before its budget ends: for one whose
        harness crashed and left nothing to assess, where a retry could only answer the same."""
        e = self._entry(execution_id)
        if e.state is not EvalState.AWAITING:
            raise ValueError(f"execution {execution_id} is {e.state.value}, not awaiting assessment")
        return self._exclude(execution_id, e)

    def expire(self, now: float) -> list[EvaluationUnresolved]:
        """Exclude every execution still awaiting a valid score whose budget ended by ``now``."""
        return [
            self._exclude(eid, e)
            for eid, e in self._entries.items()
            if e.state is EvalState.AWAITING and now >= e.deadline
        ]

    # ----------------------------------------------------------------- queries

    def __contains__(self, execution_id: object) -> bool:
        return execution_id in self._entries

    def deadline(self, execution_id: int) -> float:
        return self._entry(execution_id).deadline

    def state(self, execution_id: int) -> EvalState:
        return self._entry(execution_id).state

    def reward(self, execution_id: int) -> float:
        """The execution's valid reward (0.0 for a placeholder); an error if it has none."""
        e = self._entry(execution_id)
        if e.state is not EvalState.VALID or e.reward is None:
            raise ValueError(f"execution {execution_id} has no valid reward ({e.state.value})")
        return e.reward

    def is_placeholder(self, execution_id: int) -> bool:
        return self._entry(execution_id).placeholder

    def retry_target(self, execution_id: int) -> StateRef:
        """The preserved state every retry must assess."""
        e = self._entry(execution_id)
        if e.state is not EvalState.AWAITING or e.final_state is None:
            raise ValueError(f"execution {execution_id} is {e.state.value}, nothing to retry")
        return e.final_state

    def assessments(self, execution_id: int, state: StateRef | None = None) -> tuple[Assessment, ...]:
        """Every assessment recorded for the execution (optionally: of ``state``), oldest first."""
        return tuple(
            a for a in self._entry(execution_id).log if state is None or a.state == state
        )

    # ----------------------------------------------------------------- internals

    def _entry(self, execution_id: int) -> _Entry:
        try:
            return self._entries[execution_id]
        except KeyError:
            raise ValueError(f"unknown execution {execution_id}") from None

    @staticmethod
    def _exclude(execution_id: int, e: _Entry) -> EvaluationUnresolved:
        e.state = EvalState.EXCLUDED
        return EvaluationUnresolved(execution_id, final=True)
