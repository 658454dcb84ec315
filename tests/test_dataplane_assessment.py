"""Assessment semantics (docs/design.md, "The data plane": rewards): what becomes a reward, what is retried, what is excluded."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.dataplane import AssessmentLedger, EvalState, RewardRange
from gyre_core.interfaces import Assessment, StateRef
from gyre_core.scheduler.events import EvaluationUnresolved, EvaluationValid, Outcome

FINAL = StateRef("v3", "main")


class Evaluator:
    """Answers from a script and remembers which states it was asked about."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.asked: list[StateRef] = []

    def __call__(self, state: StateRef) -> Assessment | None:
        self.asked.append(state)
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        if a == "unresolved":
            return Assessment.unresolved(state, "evaluator container crashed")
        return None if a is None else Assessment.valid(a, state)


def ended(outcome: Outcome = Outcome.COMPLETED, deadline: float = 100.0) -> AssessmentLedger:
    ledger = AssessmentLedger()
    ledger.register(1, deadline=deadline)
    assert ledger.terminated(1, outcome, FINAL) is None
    return ledger


def test_evaluator_failures_are_unresolved_never_zero_and_retried_on_the_same_state() -> None:
    ledger = ended()
    ev = Evaluator("unresolved", RuntimeError("sandbox gone"), None, 0.0)
    for t in (1.0, 2.0, 3.0):
        assert ledger.evaluate(1, ev, now=t) == EvaluationUnresolved(1, final=False)
        assert ledger.state(1) is EvalState.AWAITING
        with pytest.raises(ValueError, match="no valid reward"):
            ledger.reward(1)
        assert ledger.retry_target(1) == FINAL
    # a valid zero is a reward like any other, distinct from the failures before it
    assert ledger.evaluate(1, ev, now=4.0) == EvaluationValid(1)
    assert ledger.reward(1) == 0.0
    assert ev.asked == [FINAL] * 4
    assert [a.validity.value for a in ledger.assessments(1)] == ["unresolved"] * 3 + ["valid"]


def test_budget_expiry_excludes_and_stops_retries() -> None:
    ledger = ended(deadline=10.0)
    ev = Evaluator("unresolved")
    assert ledger.evaluate(1, ev, now=9.0) == EvaluationUnresolved(1, final=False)
    assert ledger.evaluate(1, ev, now=10.0) == EvaluationUnresolved(1, final=True)
    assert ev.asked == [FINAL]  # no attempt once the budget is spent
    assert ledger.state(1) is EvalState.EXCLUDED
    with pytest.raises(ValueError, match="not awaiting"):
        ledger.evaluate(1, ev, now=11.0)


def test_expire_excludes_only_executions_past_their_budget_awaiting_a_score() -> None:
    ledger = AssessmentLedger()
    for eid, deadline in ((1, 5.0), (2, 50.0), (3, 5.0)):
        ledger.register(eid, deadline)
        ledger.terminated(eid, Outcome.HARNESS_TIMEOUT, FINAL)
    ledger.evaluate(3, Evaluator(0.5), now=1.0)
    assert ledger.expire(now=6.0) == [EvaluationUnresolved(1, final=True)]
    assert [ledger.state(e) for e in (1, 2, 3)] == [EvalState.EXCLUDED, EvalState.AWAITING, EvalState.VALID]


def test_complete_failure_gets_a_valid_zero_placeholder_and_overall_timeout_is_excluded() -> None:
    ledger = AssessmentLedger()
    for eid in (1, 2, 3):
        ledger.register(eid, 100.0)
    assert ledger.terminated(1, Outcome.FAILED, None) == EvaluationValid(1)
    assert ledger.reward(1) == 0.0 and ledger.is_placeholder(1)
    assert ledger.terminated(2, Outcome.OVERALL_TIMEOUT, None) is None
    assert ledger.terminated(3, Outcome.CANCELLED, None) is None
    assert ledger.state(2) is ledger.state(3) is EvalState.EXCLUDED
    ledger.register(4, 100.0)
    with pytest.raises(ValueError, match="needs the preserved state"):
        ledger.terminated(4, Outcome.HARNESS_TIMEOUT, None)
    assert ledger.state(4) is EvalState.RUNNING


def test_intermediate_assessments_stay_attached_and_are_never_overwritten() -> None:
    ledger = AssessmentLedger()
    ledger.register(1, 100.0)
    v1, v2 = StateRef("v1", "main"), StateRef("v2", "try-b")
    first = Assessment.valid(0.2, v1, "2/10 tests")
    again = Assessment.valid(0.4, v1, "re-run: 4/10 tests")
    branch = Assessment.unresolved(v2, "timeout")
    for a in (first, again, branch):
        ledger.record_intermediate(1, a)
    ledger.terminated(1, Outcome.COMPLETED, FINAL)
    ledger.evaluate(1, Evaluator(0.9), now=1.0)
    assert ledger.assessments(1, v1) == (first, again)
    assert ledger.assessments(1, v2) == (branch,)
    assert ledger.reward(1) == 0.9  # the designated final assessment, not an intermediate one
    assert len(ledger.assessments(1)) == 4


@settings(max_examples=200, deadline=None)
@given(
    score=st.floats(0.0, 1.0),
    outcome=st.sampled_from([Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT]),
    launched=st.floats(0.0, 1e6),
    budget=st.floats(1.0, 1e6),
    elapsed_share=st.floats(0.0, 0.999),
    failures=st.integers(0, 3),
)
def test_reward_is_the_evaluators_score_whatever_the_duration_or_outcome(
    score: float, outcome: Outcome, launched: float, budget: float, elapsed_share: float, failures: int
) -> None:
    ledger = AssessmentLedger()
    ledger.register(1, deadline=launched + budget)
    ledger.terminated(1, outcome, FINAL)
    now = launched + elapsed_share * budget
    ev = Evaluator(*(["unresolved"] * failures), score)
    for _ in range(failures):
        ledger.evaluate(1, ev, now)
    assert ledger.evaluate(1, ev, now) == EvaluationValid(1)
    assert ledger.reward(1) == score  # exactly: no time, length or termination term


@pytest.mark.parametrize("score", [1.5, -0.1])
def test_out_of_range_scores_are_refused_and_change_nothing(score: float) -> None:
    ledger = ended()
    with pytest.raises(ValueError, match="outside"):
        ledger.evaluate(1, Evaluator(score), now=1.0)
    assert ledger.state(1) is EvalState.AWAITING and ledger.assessments(1) == ()
    with pytest.raises(ValueError, match="outside"):
        ledger.record_intermediate(1, Assessment.valid(score, FINAL))
    assert ledger.assessments(1) == ()
    # a range that admits the score accepts it verbatim
    wide = AssessmentLedger(RewardRange(-1.0, 2.0))
    wide.register(1, 100.0)
    wide.terminated(1, Outcome.COMPLETED, FINAL)
    assert wide.evaluate(1, Evaluator(score), now=1.0) == EvaluationValid(1) and wide.reward(1) == score


def test_nan_and_foreign_states_are_refused() -> None:
    for bad in (math.nan, math.inf, "0.5", True):
        with pytest.raises(ValueError):
            RewardRange().check(bad, "x")
    with pytest.raises(ValueError, match="finite"):
        Assessment.valid(math.nan, FINAL)
    ledger = ended()
    with pytest.raises(ValueError, match="not the preserved state"):
        ledger.evaluate(1, lambda _: Assessment.valid(1.0, StateRef("v9", "main")), now=1.0)
    assert ledger.state(1) is EvalState.AWAITING and ledger.assessments(1) == ()


def test_protocol_errors() -> None:
    ledger = ended()
    with pytest.raises(ValueError, match="registered twice"):
        ledger.register(1, 5.0)
    with pytest.raises(ValueError, match="terminated twice"):
        ledger.terminated(1, Outcome.COMPLETED, FINAL)
    with pytest.raises(ValueError, match="unknown execution"):
        ledger.reward(99)
