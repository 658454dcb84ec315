"""The ``digits`` task: its reward is what the policy sampled, and only a missing reply is unresolved."""

from __future__ import annotations

from pathlib import Path

from gyre_core.interfaces import ExecutionSpec, StateRef, TaskOptions
from gyre_core.tasks import digits

STATE = StateRef("final", "main")


def _spec(workdir: Path) -> ExecutionSpec:
    return ExecutionSpec(execution_id=1, workdir=str(workdir), proxy_base_url="http://127.0.0.1:1", api_key="k",
                         harness_timeout_s=10, overall_budget_s=20, harness="reply", task="t",
                         extra={"task": "digits"})


def test_reward_is_the_fraction_of_digits() -> None:
    assert digits.score_reply("12 34") == 1.0
    assert digits.score_reply("a1b2") == 0.5
    assert digits.score_reply("  \n") == 0.0 and digits.score_reply("") == 0.0


def test_evaluator_scores_the_reply_and_a_missing_reply_is_unresolved(tmp_path: Path) -> None:
    a = digits.gyre_evaluate(spec=_spec(tmp_path), state=STATE)
    assert a.score is None and a.validity.value == "unresolved"
    (tmp_path / "reply.txt").write_text("x9")
    assert digits.gyre_evaluate(spec=_spec(tmp_path), state=STATE).score == 0.5
    other = ExecutionSpec(**{**_spec(tmp_path).__dict__, "extra": {"task": "sum-file"}})
    assert digits.gyre_evaluate(spec=other, state=STATE) is None


def test_instances_are_per_group_and_reproducible() -> None:
    a = digits.gyre_task_instance(task="digits", group_id=3, seed=1, options=TaskOptions())
    assert a == digits.gyre_task_instance(task="digits", group_id=3, seed=1, options=TaskOptions())
    assert digits.gyre_task_instance(task="number-guess", group_id=3, seed=1, options=TaskOptions()) is None
    assert "digits" in a.prompt
