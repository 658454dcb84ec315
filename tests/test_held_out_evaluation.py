"""Held-out evaluation during a run: which versions, what is counted, what is never a zero.

The evaluation's own logic runs for real (plan, concurrency bound, per-task lines, figures); the
proxy, the harness and the task's evaluator are stand-ins named as such. The live path (real
engines, harnesses and evaluator) is covered by the example's end-to-end test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef
from gyre_core.orchestrator.evaluation import EVAL_ID_BASE, EvalPlan, HeldOutEvaluation, summarise


class StandInRouter:
    def __init__(self) -> None:
        self.assigned: list[int] = []

    def assign(self, eid: int) -> None:
        self.assigned.append(eid)


class StandInProxy:
    """Answers every execution of (version, task) in ``failing`` with a 5xx, as Gyre's proxy records them."""

    def __init__(self, failing: tuple[int, int] | None = None) -> None:
        self.router = StandInRouter()
        self.live: set[int] = set()
        self.forgotten: list[int] = []
        self.failing = failing
        self.meta: dict[int, Any] = {}

    def create_execution(self, eid: int, *, metadata: Any = None) -> tuple[int, str]:
        self.live.add(eid)
        self.meta[eid] = (metadata["eval_version"], metadata["eval_task"])
        return eid, f"key-{eid}"

    def infrastructure_errors(self, eid: int) -> list[dict[str, Any]]:
        if self.meta[eid] == self.failing:
            return [{"status": 503, "kind": "overloaded", "message": "no rollout engine is available"}]
        return []

    def forget(self, eid: int) -> None:
        self.live.discard(eid)
        self.forgotten.append(eid)

    def policy_versions(self, eid: int) -> list[int]:
        return [self.meta[eid][0]]  # served by the version it evaluates


@dataclass
class StandInTask:
    index: int
    prompt: str

    def as_extra(self) -> dict[str, Any]:
        return {"task": "file", "record_index": self.index}


class StandInHarness:
    """Writes the reward the stand-in evaluator reads; tracks how many run at once."""

    running = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, spec: ExecutionSpec) -> None:
        Path(spec.workdir).mkdir(parents=True)
        (Path(spec.workdir) / "done").write_text("1")

    def wait(self, timeout: float) -> int:
        with StandInHarness.lock:
            StandInHarness.running += 1
            StandInHarness.most = max(StandInHarness.most, StandInHarness.running)
        time.sleep(0.05)
        with StandInHarness.lock:
            StandInHarness.running -= 1
        return 0

    def kill(self) -> None:
        pass


def stand_in_evaluator(spec: ExecutionSpec, state: StateRef) -> Assessment | None:
    """Task 0 always passes, task 1 scores 0.5, task 2's evaluator fails (unresolved)."""
    task = spec.extra["record_index"]
    assert (Path(state.branch) / "done").exists()  # it judges the execution's own workspace
    if task == 2:
        return Assessment.unresolved(state, "evaluator could not run")
    return Assessment.valid(1.0 if task == 0 else 0.5, state, "scored")


def make(tmp_path: Path, plan: EvalPlan, proxy: StandInProxy, progress: list[str],
         reports: list[tuple[int, dict[str, float]]]) -> HeldOutEvaluation:
    t0 = time.monotonic()
    return HeldOutEvaluation(
        plan, [StandInTask(i, f"task {i}") for i in range(3)], proxy=proxy, proxy_url="http://proxy",
        out_dir=tmp_path, harness="command", harness_timeout_s=10.0, overall_budget_s=20.0, evaluator_timeout_s=5.0,
        harness_extra=lambda inst: inst.as_extra(), launch=StandInHarness, evaluate=stand_in_evaluator,
        progress=progress.append, report=lambda v, m: reports.append((v, m)), now=lambda: time.monotonic() - t0)


def test_the_plan_evaluates_the_start_every_interval_and_the_last_version() -> None:
    plan = EvalPlan(interval=2, before_train=True, samples=1, max_concurrent=1, pass_threshold=1.0)
    assert [v for v in range(6) if plan.due(v, last=5)] == [0, 2, 4, 5]
    plan = EvalPlan(interval=0, before_train=False, samples=1, max_concurrent=1, pass_threshold=1.0)
    assert [v for v in range(6) if plan.due(v, last=5)] == [5]


def test_an_evaluation_runs_every_task_k_times_and_counts_unresolved_apart(tmp_path: Path) -> None:
    plan = EvalPlan(interval=1, before_train=True, samples=3, max_concurrent=2, pass_threshold=1.0)
    proxy = StandInProxy(failing=(1, 0))  # version 1's task 0: every sample got a 5xx from Gyre
    progress: list[str] = []
    reports: list[tuple[int, dict[str, float]]] = []
    StandInHarness.most = 0

    async def main() -> HeldOutEvaluation:
        ev = make(tmp_path, plan, proxy, progress, reports)
        ev.start(0, last=2)
        ev.start(0, last=2)  # once per version
        ev.start(1, last=2)
        await ev.finish()
        return ev

    ev = asyncio.run(main())
    assert [r["step"] for r in ev.results] == [0, 1]
    first, second = ev.results
    # 3 tasks × 3 samples; task 2's evaluator fails every time: unresolved, not judged
    assert first["executions"] == 9 and first["tasks"] == 3 and first["unresolved"] == 3
    assert first["pass_rate"] == 0.5  # task 0 passes, task 1 (0.5 < 1.0) does not; task 2 was never judged
    assert first["mean_reward"] == 0.75
    # version 1: task 0's samples got a 5xx from Gyre, so their scores are not taken either
    assert second["unresolved"] == 6 and second["pass_rate"] == 0.0 and second["mean_reward"] == 0.5
    lines = [json.loads(x) for x in (tmp_path / "eval" / "step0.jsonl").read_text().splitlines()]
    assert [t["task"] for t in lines] == [0, 1, 2]
    assert lines[2]["rewards"] == [None, None, None] and not lines[2]["passed"]  # unresolved: never a zero
    assert lines[0]["passed"] and lines[1]["rewards"] == [0.5] * 3
    assert StandInHarness.most <= 2  # the bound on the rollout engines' extra load
    assert proxy.live == set() and len(proxy.forgotten) == 18  # no record kept to be trained on
    assert all(eid >= EVAL_ID_BASE for eid in proxy.router.assigned)
    assert [v for v, _ in reports] == [0, 1] and "eval/pass_rate" in reports[0][1]
    assert any("evaluation of version 0: pass rate 0.5" in m for m in progress)


def test_summarise_counts_pass_at_k_over_judged_tasks() -> None:
    tasks = [{"rewards": [0.0, 1.0], "passed": True}, {"rewards": [None, 0.0], "passed": False},
             {"rewards": [None, None], "passed": False}]
    s = summarise(4, tasks, 1.0)
    assert s["pass_rate"] == 0.5 and s["unresolved"] == 3 and s["executions"] == 6
    assert s["mean_reward"] == pytest.approx(1 / 3, abs=1e-4)


def test_samples_served_by_later_versions_are_told_apart() -> None:
    """Version 4's evaluation ran while versions 5 and 6 were published: the samples a later
    version served are counted, and the version's own figure is over the samples it served alone."""
    tasks = [{"rewards": [1.0, 0.0, 1.0], "passed": True, "served": [[4], [4, 5], [4]]},
             {"rewards": [0.0, None, 0.0], "passed": False, "served": [[5, 6], [4], [4]]}]
    s = summarise(4, tasks, 1.0)
    assert s["served_later"] == 2 and s["executions_on_version"] == 3
    assert s["mean_reward_on_version"] == pytest.approx(2 / 3, abs=1e-4)  # 1.0, 1.0, 0.0
    assert s["mean_reward"] == pytest.approx(2 / 5, abs=1e-4)  # every valid sample, whoever served it
