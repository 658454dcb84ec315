"""The ``sum-file`` task's evaluator: a verdict on the workspace, and *unresolved* only when it cannot look.

A coding agent that ran to its end and wrote nothing (or the wrong number) failed the task: that
is a valid reward of 0. A workspace that does not exist is not a verdict: unresolved, never 0.
"""

from __future__ import annotations

from pathlib import Path

from gyre_core.interfaces import ExecutionSpec, StateRef, TaskOptions
from gyre_core.tasks import sum_file

STATE = StateRef("final", "main")


def _spec(workdir: Path, a: int = 12, b: int = 30) -> ExecutionSpec:
    return ExecutionSpec(execution_id=1, workdir=str(workdir), proxy_base_url="http://127.0.0.1:1", api_key="k",
                         harness_timeout_s=10, overall_budget_s=20, harness="claude-code",
                         task=sum_file.SumFileInstance(a, b).prompt, extra={"task": "sum-file", "a": a, "b": b})


def test_right_answer_scores_one_whitespace_ignored(tmp_path: Path) -> None:
    (tmp_path / "answer.txt").write_text(" 42\n")
    a = sum_file.gyre_evaluate(spec=_spec(tmp_path), state=STATE)
    assert a.score == 1.0


def test_wrong_or_missing_answer_is_a_valid_zero(tmp_path: Path) -> None:
    assert sum_file.gyre_evaluate(spec=_spec(tmp_path), state=STATE).score == 0.0
    (tmp_path / "answer.txt").write_text("41")
    assert sum_file.gyre_evaluate(spec=_spec(tmp_path), state=STATE).score == 0.0


def test_missing_workspace_is_unresolved_not_zero(tmp_path: Path) -> None:
    a = sum_file.gyre_evaluate(spec=_spec(tmp_path / "gone"), state=STATE)
    assert a.score is None and a.validity.value == "unresolved"


def test_other_tasks_are_not_claimed(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    spec.extra["task"] = "number-guess"
    assert sum_file.gyre_evaluate(spec=spec, state=STATE) is None


def test_instances_are_deterministic_and_hide_nothing_needed() -> None:
    i = sum_file.gyre_task_instance(task="sum-file", group_id=3, seed=1, options=TaskOptions())
    assert i == sum_file.gyre_task_instance(task="sum-file", group_id=3, seed=1, options=TaskOptions())
    assert str(i.a) in i.prompt and str(i.b) in i.prompt and "answer.txt" in i.prompt
    assert sum_file.gyre_task_instance(task="other", group_id=3, seed=1, options=TaskOptions()) is None


def test_a_crashed_harness_without_an_answer_is_unresolved_but_its_answer_still_counts(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    crashed = ExecutionSpec(**{**spec.__dict__, "extra": {**spec.extra, "harness_exit": -9, "harness_end": "crashed"}})
    a = sum_file.gyre_evaluate(spec=crashed, state=STATE)
    assert a.score is None and a.validity.value == "unresolved" and "crashed" in a.detail
    failed = ExecutionSpec(**{**spec.__dict__, "extra": {**spec.extra, "harness_exit": 1, "harness_end": "failed"}})
    assert sum_file.gyre_evaluate(spec=failed, state=STATE).score == 0.0  # ran to its end: a real zero
    (tmp_path / "answer.txt").write_text("42")
    assert sum_file.gyre_evaluate(spec=crashed, state=STATE).score == 1.0  # what it left is assessed
