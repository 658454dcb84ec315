"""Held-out evaluation during a run: the policy of a step on every eval task, never trained on.

After the publication of version ``v`` (the policy after ``v`` steps) with ``v`` a multiple of
``eval.interval`` -- and of version 0 with ``eval.before_train``, and of the run's last version --
each task of ``task.eval`` runs ``eval.samples`` times through the same harness, sandbox, proxy and
evaluator as training executions, and the results are written to ``eval/step<v>.jsonl`` (one line a
task) and kept for ``summary.json`` (``evaluations``) and the metrics observers (``eval/``).

What it may cost training, by construction:

* an evaluation never waits on a training step and no step waits on it: it runs beside the
  scheduler, which does not know it;
* its executions take rollout engines the proxy's router picks (standalone pool first, as the
  router places any execution) and move with them on a role switch, at most ``eval.max_concurrent``
  at once: the extra load on the rollout engines is bounded by that, not by the eval set's size;
* the run's end waits for the evaluations still running, each bounded by the harness timeout and
  one evaluator attempt.

Its executions get ids from :data:`EVAL_ID_BASE` up, their own keys and workspaces
(``eval/v<v>/e<id>``); their records never reach the trajectory buffer. A reward is as the task's
evaluator gives it, under the same rules as in training: an unresolved assessment (a crash, a
timeout, an infrastructure error) counts as unresolved, never as a zero. Evaluations are not
journalled: a resumed run evaluates from where it resumes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gyre_core.interfaces import Assessment, ExecutionSpec, HarnessEnds, StateRef, Validity
from gyre_core.orchestrator.live_executions import harness_extra, infra_verdict
from gyre_core.orchestrator.plugin_options import task_options

log = logging.getLogger(__name__)

__all__ = ["EVAL_ID_BASE", "EvalPlan", "HeldOutEvaluation", "summarise"]

EVAL_ID_BASE = 1 << 30
"""Evaluation executions' ids start here, far above any training execution's."""


@dataclass(frozen=True)
class EvalPlan:
    interval: int
    """Evaluate after every ``interval`` steps (0: only ``before_train`` and the last version)."""
    before_train: bool
    samples: int
    """Executions per task: the pass rate is pass@``samples``."""
    max_concurrent: int
    pass_threshold: float
    """A sample passes when its reward is at least this."""

    def due(self, version: int, last: int) -> bool:
        if version == 0:
            return self.before_train
        return version == last or (self.interval > 0 and version % self.interval == 0)


def summarise(version: int, per_task: Sequence[Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """One evaluation's figures: pass@k over tasks with at least one valid reward, the mean of the
    valid rewards, and how many samples were unresolved (never counted as zeros).

    The evaluation runs beside training on the rollout engines, which load every version published
    meanwhile: a long evaluation of version ``v`` is partly served by later versions. So it also
    says how many samples had a call served by a later version (``served_later``) and the mean
    reward of the samples served by ``v`` alone (``mean_reward_on_version``, over
    ``executions_on_version``): the figure to read as version ``v``'s."""
    rewards = [r for t in per_task for r in t["rewards"] if r is not None]
    judged = [t for t in per_task if any(r is not None for r in t["rewards"])]
    samples = sum(len(t["rewards"]) for t in per_task)
    served = [(r, list(s)) for t in per_task for r, s in zip(t["rewards"], t.get("served") or [[]] * len(t["rewards"]))]
    on_version = [r for r, s in served if r is not None and s and set(s) == {version}]
    return {
        "step": version, "policy_version": version, "tasks": len(per_task), "executions": samples,
        "unresolved": samples - len(rewards),
        "pass_rate": round(sum(1 for t in judged if t["passed"]) / len(judged), 4) if judged else None,
        "mean_reward": round(math.fsum(rewards) / len(rewards), 4) if rewards else None,
        "served_later": sum(1 for _, s in served if s and max(s) > version),
        "executions_on_version": len(on_version),
        "mean_reward_on_version": round(math.fsum(on_version) / len(on_version), 4) if on_version else None,
        "wall_s": round(wall_s, 2),
    }


class HeldOutEvaluation:
    """The run's evaluations: started on publications, awaited at the run's end.

    ``instances`` are the eval tasks' instances (``gyre_task_instance`` over the eval file);
    ``harness_extra(instance)`` gives an execution's ``extra`` exactly as a training execution of
    that instance gets it; ``launch(spec)`` starts its harness and ``evaluate(spec, state)`` asks
    the task for its assessment (the plugin hooks).
    """

    def __init__(self, plan: EvalPlan, instances: Sequence[Any], *, proxy: Any, proxy_url: str, out_dir: Path,
                 harness: str, harness_timeout_s: float, overall_budget_s: float, evaluator_timeout_s: float,
                 harness_extra: Callable[[Any], dict[str, Any]], launch: Callable[[ExecutionSpec], Any],
                 evaluate: Callable[[ExecutionSpec, StateRef], Assessment | None],
                 progress: Callable[[str], None], report: Callable[[int, dict[str, float]], None],
                 now: Callable[[], float]) -> None:
        self.plan = plan
        self.instances = list(instances)
        self.results: list[dict[str, Any]] = []
        self._proxy, self._proxy_url, self._out = proxy, proxy_url, out_dir / "eval"
        self._harness, self._timeout, self._budget = harness, harness_timeout_s, overall_budget_s
        self._eval_timeout = evaluator_timeout_s
        self._extra, self._launch, self._evaluate = harness_extra, launch, evaluate
        self._progress, self._report, self._now = progress, report, now
        self._ids = itertools.count(EVAL_ID_BASE)
        self._slots = asyncio.Semaphore(plan.max_concurrent)
        self._tasks: list[asyncio.Task[Any]] = []
        self._started: set[int] = set()
        self._handles: set[Any] = set()
        self._threads = ThreadPoolExecutor(max_workers=2 * plan.max_concurrent, thread_name_prefix="gyre-eval")

    @classmethod
    def for_run(cls, cfg: Any, pm: Any, *, proxy: Any, proxy_url: str, out_dir: Path,
                sandbox: Mapping[str, Any] | None, progress: Callable[[str], None],
                report: Callable[[int, dict[str, float]], None], now: Callable[[], float],
                plan: EvalPlan | None = None) -> HeldOutEvaluation:
        """The evaluation of run configuration ``cfg`` (``task.eval``, ``[eval]``, the harness),
        its tasks drawn through the plugin hooks: every record of the eval file once, in order."""
        from gyre_core.tasks.file_tasks import load_records

        options = task_options(cfg, held_out=True)  # the eval file, drawn like a train file
        instances = [pm.hook.gyre_task_instance(task=cfg.task.name, group_id=g, seed=cfg.run.seed, options=options)
                     for g in range(len(load_records(cfg.task.eval)))]
        instances.sort(key=lambda inst: getattr(inst, "index", 0))
        e = cfg.eval
        return cls(
            plan or EvalPlan(e.interval, e.before_train, e.samples, e.max_concurrent, e.pass_threshold), instances,
            proxy=proxy, proxy_url=proxy_url, out_dir=out_dir, harness=cfg.harness.kind,
            harness_timeout_s=cfg.harness.timeout_s, overall_budget_s=cfg.harness.overall_budget_s,
            evaluator_timeout_s=cfg.harness.evaluator_bound_s,
            harness_extra=lambda inst: harness_extra(cfg, inst, sandbox),
            launch=lambda spec: pm.hook.gyre_launch_harness(spec=spec),
            evaluate=lambda spec, state: pm.hook.gyre_evaluate(spec=spec, state=state),
            progress=progress, report=report, now=now)

    def start(self, version: int, last: int) -> None:
        """Evaluate policy ``version`` in the background if the plan says so (once per version)."""
        if version in self._started or not self.plan.due(version, last) or not self.instances:
            return
        self._started.add(version)
        self._tasks.append(asyncio.ensure_future(self._evaluate_version(version)))

    async def finish(self) -> None:
        """Wait for the evaluations still running (each execution is bounded: see the module)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._threads.shutdown(wait=False)

    async def cancel(self) -> None:
        """Kill the evaluation harnesses still running and drop their evaluations (a run that
        failed, or was stopped)."""
        for handle in list(self._handles):
            await asyncio.to_thread(handle.kill)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._threads.shutdown(wait=False)

    async def _evaluate_version(self, version: int) -> None:
        t0 = self._now()
        self._progress(f"evaluating policy version {version} on {len(self.instances)} held-out task(s) "
                       f"× {self.plan.samples}")
        try:
            jobs = [self._one(version, i, inst) for i, inst in enumerate(self.instances) for _ in range(self.plan.samples)]
            outcomes = await asyncio.gather(*jobs)
        except Exception as e:  # an evaluation must never cost the run
            log.warning("evaluation of version %s failed: %s", version, e)
            self._progress(f"evaluation of version {version} failed: {type(e).__name__}: {e}")
            return
        per_task = []
        for i, inst in enumerate(self.instances):
            mine = [o for o in outcomes if o["task"] == i]
            rewards = [o["reward"] for o in mine]
            per_task.append({"task": i, "record_index": getattr(inst, "index", i), "rewards": rewards,
                             "passed": any(r is not None and r >= self.plan.pass_threshold for r in rewards),
                             "details": [o["detail"] for o in mine], "served": [o["served"] for o in mine]})
        self._out.mkdir(parents=True, exist_ok=True)
        with open(self._out / f"step{version}.jsonl", "w") as f:
            for t in per_task:
                f.write(json.dumps(t) + "\n")
        result = summarise(version, per_task, self._now() - t0)
        self.results.append(result)
        self.results.sort(key=lambda r: r["step"])
        self._progress(f"evaluation of version {version}: pass rate {result['pass_rate']}, mean reward "
                       f"{result['mean_reward']} over {result['executions']} execution(s), "
                       f"{result['unresolved']} unresolved")
        self._report(version, {f"eval/{k}": float(v) for k, v in result.items()
                               if k in ("pass_rate", "mean_reward", "executions", "unresolved") and v is not None})

    async def _assign(self, eid: int) -> None:
        """Pin the execution to a rollout engine, waiting (up to the harness timeout) while every
        engine trains: in Colocate the whole pool may be training when an evaluation starts."""
        deadline = self._now() + self._timeout
        while True:
            try:
                self._proxy.router.assign(eid)
                return
            except Exception:
                if self._now() >= deadline:
                    raise
                await asyncio.sleep(1.0)

    async def _one(self, version: int, task: int, inst: Any) -> dict[str, Any]:
        async with self._slots:
            eid = next(self._ids)
            loop = asyncio.get_running_loop()
            eid, key = self._proxy.create_execution(eid, metadata={"eval_version": version, "eval_task": task})
            workdir = self._out / f"v{version}" / f"e{eid}"
            spec = ExecutionSpec(execution_id=eid, workdir=str(workdir), proxy_base_url=self._proxy_url,
                                 api_key=key, harness_timeout_s=self._timeout, overall_budget_s=self._budget,
                                 harness=self._harness, task=inst.prompt, extra=self._extra(inst))
            try:
                await self._assign(eid)
                handle = await loop.run_in_executor(self._threads, self._launch, spec)
                self._handles.add(handle)
                try:
                    code = await loop.run_in_executor(self._threads, handle.wait, self._timeout)
                finally:
                    self._handles.discard(handle)
                if code is None:
                    await loop.run_in_executor(self._threads, handle.kill)
                elif code != 0:
                    end = handle.end_kind(int(code)) if isinstance(handle, HarnessEnds) else "failed"
                    spec = replace(spec, extra={**spec.extra, "harness_exit": int(code), "harness_end": end})
            except Exception as e:  # no engine, a harness that cannot start: unresolved, never a zero
                self._proxy.forget(eid)
                return {"task": task, "reward": None, "detail": f"not run: {type(e).__name__}: {e}"[:300], "served": []}
            errors = self._proxy.infrastructure_errors(eid)
            served = self._proxy.policy_versions(eid)
            self._proxy.forget(eid)  # its records are never trained on
            state = StateRef(artifact_version="final", branch=str(workdir))
            spec = replace(spec, extra={**spec.extra, "evaluator_timeout_s": self._eval_timeout,
                                        **({"infrastructure_errors": errors} if errors else {})})
            try:
                got = await asyncio.wait_for(
                    loop.run_in_executor(self._threads, self._evaluate, spec, state), self._eval_timeout)
            except Exception as e:  # a hung or crashing evaluator: unresolved
                got = Assessment.unresolved(state, f"evaluator: {type(e).__name__}: {e}"[:300])
            got = infra_verdict(got, errors)
            if got is None or got.validity is not Validity.VALID:
                return {"task": task, "reward": None, "detail": "" if got is None else got.detail[:300], "served": served}
            return {"task": task, "reward": float(got.score), "detail": got.detail[:300], "served": served}  # type: ignore[arg-type]
