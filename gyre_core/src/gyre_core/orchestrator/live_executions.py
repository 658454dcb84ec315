"""The live run's executions: dispatch, launch through the harness hook, end, evaluation, cancel.

Each execution gets its own proxy credential and workspace; its end becomes an ``ExecutionEnded``
event, its evaluation an ``EvaluationValid`` / ``EvaluationUnresolved`` event, and its fate
(trained, dropped, filtered, surplus, excluded, cancelled) is kept here for the summary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gyre_core.dataplane.assessment import AssessmentLedger

from gyre_core.dataplane.trajectory_buffer import ScoredExecution, TrajectoryBuffer
from gyre_core.interfaces import Assessment, ExecutionSpec, HarnessEnds, StateRef
from gyre_core.orchestrator.failure import RunFailed
from gyre_core.orchestrator.harness import TaskSetupFailed, classify_end
from gyre_core.orchestrator.journal import Journal, selected_to_json, tree_to_json
from gyre_core.orchestrator.live_cells import LiveCells
from gyre_core.orchestrator.plugin_options import task_options
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Outcome

log = logging.getLogger("gyre.orchestrator")


@dataclass
class LiveExecution:
    """One execution as the live run tracks it: where it runs, how it ended, what became of it."""

    group_id: int
    spec: ExecutionSpec | None = None
    handle: Any = None
    engine: int | None = None
    launched_on: int | None = None
    """The engine its Launch named (``engine`` follows later reroutes)."""
    launched_at: float = 0.0
    outcome: Outcome | None = None
    reward: float | None = None
    fate: str = "queued"  # queued, running, ended, trained, dropped, surplus, excluded, cancelled
    trajectory: tuple[Any, Any] | None = None
    """(tree, selected) as the execution ended: the proxy's records, kept for its evaluation."""
    harness_exit: dict[str, Any] | None = None
    """``{"code", "end"}`` when the harness exited non-zero (``end``: failed or crashed)."""
    why: str = ""
    """Why a finished execution was not trained (its fate's cause, counted in the summary)."""
    infra_errors: list[dict[str, Any]] | None = None
    """The proxy's 5xx answers to it (taken as it ended): Gyre's failures, not its policy's."""
    placeholder: bool = False
    """Its reward is the zero-reward placeholder of a complete failure (no token trained)."""


INFRA_DETAIL = "infrastructure error"


def infra_verdict(got: Assessment | None, errors: Sequence[Mapping[str, Any]] | None) -> Assessment | None:
    """The assessment to take for an execution the proxy answered with ``errors`` (5xx): a valid
    score stands only if the evaluator vouches for it despite them; otherwise it is unresolved
    (the harness may have ended *because* Gyre failed it, and only the task decides a zero)."""
    if not errors or got is None or got.score is None or got.despite_infrastructure_errors:
        return got
    last = errors[-1]
    return Assessment.unresolved(got.state, f"{INFRA_DETAIL}: the proxy answered {len(errors)} call(s) with "
                                            f"{last.get('status')} ({last.get('kind')}: {str(last.get('message'))[:120]})")


def exclusion_cause(assessments: Sequence[Assessment], harness_crashed: bool) -> str:
    """Why an execution's assessment never resolved, in a few words a summary can count: the
    harness crashed (nothing to assess), the evaluator timed out or raised, it answered
    unresolved, or the budget ended before any attempt could start."""
    if harness_crashed:
        return "harness crashed"
    if assessments and assessments[-1].detail.startswith(INFRA_DETAIL):
        return "infrastructure error"
    if not assessments:
        return "budget spent before any assessment"
    detail = assessments[-1].detail
    if detail.startswith("evaluator gave no answer"):
        return "evaluator timed out"
    if detail.startswith("evaluator raised"):
        return "evaluator raised"
    return "evaluator answered unresolved"


def harness_extra(cfg: RunConfig, inst: Any, sandbox: Mapping[str, Any] | None) -> dict[str, Any]:
    """An execution's ``extra``: the task instance's, then what the run's harness needs."""
    extra: dict[str, Any] = dict(inst.as_extra(), model=cfg.model.name)
    if cfg.harness.kind == "command":
        extra["command"] = list(cfg.harness.command)
    if cfg.harness.kind == "claude-code":
        extra["claude_bin"] = cfg.harness.claude_bin
        extra["claude_args"] = list(cfg.harness.args)
    if sandbox is not None:
        extra["sandbox"] = dict(sandbox)
    return extra


def _with_exit(spec: ExecutionSpec, harness_exit: Mapping[str, Any]) -> ExecutionSpec:
    """``spec`` with the harness's exit for the evaluator: ``extra["harness_exit"]`` (the code)
    and ``extra["harness_end"]`` (:data:`gyre_core.orchestrator.harness.HARNESS_ENDS`)."""
    return replace(spec, extra={**spec.extra, "harness_exit": harness_exit["code"], "harness_end": harness_exit["end"]})


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj):
        return {k: _jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "value") and not isinstance(obj, (int, float, str)):
        return obj.value
    return obj


class LiveExecutions:
    """The run's executions and their groups, from dispatch to a reward: launch of each harness,
    its end, its assessment (the ledger) and what becomes of it (its fate).

    Owns the execution records, the groups' task instances and the assessment ledger. Reaches the
    rest of the run through what it is given: the proxy (credentials, routing, records), the
    cells (an engine's URL), the trajectory buffer (scored executions go there), the journal,
    and callbacks (``emit`` an event, ``spawn`` a task, ``now``)."""

    def __init__(self, cfg: RunConfig, *, proxy: Any, proxy_url: str, pm: Any, out_dir: Path,
                 sandbox: Mapping[str, Any] | None, journal: Journal | None, buffer: TrajectoryBuffer,
                 cells: LiveCells, now: Callable[[], float], emit: Callable[[ev.Event], None],
                 spawn: Callable[[Any, str], None], blocking: Executor) -> None:
        self.cfg = cfg
        self._task_options = task_options(cfg)
        self.proxy = proxy
        self.proxy_url = proxy_url
        self.pm = pm
        self.out_dir = out_dir
        self.sandbox = dict(sandbox) if sandbox else None
        self.journal = journal
        self.buffer = buffer
        self.cells = cells
        self.now = now
        self._emit = emit
        self._spawn = spawn
        self._blocking = blocking
        """Harness waits and evaluator calls (see the driver: they must not starve its pool)."""
        self.ledger = AssessmentLedger()
        self.records: dict[int, LiveExecution] = {}
        self.groups: dict[int, dict[str, Any]] = {}
        """Per group: its task instance, the policy version it was dispatched under, rewards."""
        self.replay_plan: Any = None
        """``harness.kind = "replay"`` or ``harness.paced``: which recorded execution each execution
        replays (or takes its duration from)."""
        if cfg.harness.kind == "replay" or cfg.harness.paced:
            from gyre_core.orchestrator.replay_plan import ReplayPlan

            self.replay_plan = ReplayPlan.from_config(cfg.harness.trace, cfg.harness.time_scale, cfg.run.seed,
                                                      cfg.harness.token_scale)
        self._tool_output_rate: float | None = None
        """``replay``: tokens per word of the replay's tool output (measured on first use)."""

    def dispatch(self, cmd: ev.DispatchGroup) -> None:
        self.buffer.dispatch(cmd)
        if cmd.refill_of is None:
            inst = self.pm.hook.gyre_task_instance(task=self.cfg.task.name, group_id=cmd.group_id,
                                                   seed=self.cfg.run.seed, options=self._task_options)
            if inst is None:
                raise RunFailed(f"no plugin provides task {self.cfg.task.name!r}")
            self.groups[cmd.group_id] = {"instance": inst, "version": cmd.version, "rewards": []}
        for eid in cmd.execution_ids:
            self.records[eid] = LiveExecution(cmd.group_id)

    async def launch(self, cmd: ev.Launch, relaunch: bool = False) -> None:
        ex = self.records[cmd.execution_id]
        if not relaunch and ex.fate != "launching":
            return  # cancelled (or the run ended) before its launch got to run
        inst = self.groups[cmd.group_id]["instance"]
        eid, key = self.proxy.create_execution(cmd.execution_id, metadata={"group": cmd.group_id})
        self.proxy.router.pin(eid, self.cells.engine_url(cmd.engine))
        workdir = self.out_dir / "executions" / f"e{eid:05d}"
        if relaunch and workdir.exists():  # a crashed attempt: keep it for inspection, start clean
            workdir.rename(workdir.with_name(f"{workdir.name}.crashed-{int(time.time())}"))
        extra = self._harness_extra(inst)
        if self.replay_plan is not None:  # replay, or paced: the recorded execution this one takes
            members = self.group_members(cmd.group_id)  # in dispatch order; refills come last
            recorded = self.replay_plan.record(cmd.group_id, members.index(cmd.execution_id), len(members))
            if self.cfg.harness.kind == "replay":
                extra["replay"] = {**recorded.as_extra(), "calls": self.cfg.harness.replay_calls,
                                   "context_tokens": min(recorded.context_tokens, self._replay_context_cap()),
                                   "tokens_per_word": self._replay_tokens_per_word()}
            else:  # its duration, for the harness to wait out
                extra["env"] = {**dict(extra.get("env") or {}), "GYRE_PACE_S": repr(recorded.duration_s)}
        spec = ExecutionSpec(
            execution_id=eid, workdir=str(workdir), proxy_base_url=self.proxy_url, api_key=key,
            harness_timeout_s=self.cfg.harness.timeout_s, overall_budget_s=self.cfg.harness.overall_budget_s,
            harness=self.cfg.harness.kind, task=inst.prompt, extra=extra,
        )
        ex.spec, ex.engine, ex.launched_at, ex.fate = spec, cmd.engine, self.now(), "running"
        if relaunch:
            self.ledger.relaunch(eid, self.now() + spec.overall_budget_s)
        else:
            self.ledger.register(eid, self.now() + spec.overall_budget_s)
        try:  # in a thread: copying a repository and the task's set-up take time
            handle = await asyncio.to_thread(self._start_harness, ex, spec)
        except TaskSetupFailed as e:
            await self._setup_failed(eid, str(e))
            return
        if handle is None:
            raise RunFailed(f"no plugin launches harness {spec.harness!r}")
        if ex.fate in ("cancelled", "stopped"):
            return  # stopped while it started: _start_harness killed it
        code = await asyncio.get_running_loop().run_in_executor(self._blocking, handle.wait, spec.harness_timeout_s)
        if ex.fate in ("cancelled", "stopped"):
            return  # its cancellation (or the run's end) already ended it
        if code is None:
            await asyncio.to_thread(handle.kill)
            outcome = Outcome.HARNESS_TIMEOUT
        else:
            # A non-zero exit is assessed like any end: the evaluator is told how the harness
            # ended and judges what the workspace holds. Only the task may call it a zero (a
            # harness that ran to its end and produced nothing); a crash never is one.
            if code != 0:
                end = handle.end_kind(int(code)) if isinstance(handle, HarnessEnds) else classify_end(spec.harness, int(code))
                ex.harness_exit = {"code": int(code), "end": end}
                ex.spec = _with_exit(spec, ex.harness_exit)
            outcome = Outcome.COMPLETED
        await self._ended(eid, outcome)

    async def _ended(self, eid: int, outcome: Outcome) -> None:
        ex = self.records[eid]
        ex.outcome, ex.fate = outcome, "ended"
        ex.infra_errors = self.proxy.infrastructure_errors(eid) or None
        self.proxy.close_execution(eid)
        if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
            # Its token records live only in this process: journal them *before* its end, so a
            # crash either keeps both (the resumed run evaluates it) or neither (it is re-run).
            ex.trajectory = (self.proxy.records(eid).tree,
                             self.proxy.selected(eid, self.cfg.dataplane.j_max, self.cfg.run.seed * 7919 + eid))
            if self.journal is not None:
                self.journal.write("trajectory", execution_id=eid, tree=tree_to_json(ex.trajectory[0]),
                                   selected=selected_to_json(ex.trajectory[1]), harness_exit=ex.harness_exit)
        self._emit(ev.ExecutionEnded(eid, outcome))
        state = self.final_state(eid)
        answer = self.ledger.terminated(eid, outcome, state if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT) else None)
        if answer is not None:  # a complete failure: zero-reward placeholder
            ex.reward, ex.placeholder = 0.0, True
            if self.journal is not None:
                self.journal.write("placeholder", execution_id=eid, group=ex.group_id)
            self.buffer.put(ScoredExecution.placeholder(eid, ex.group_id))
            self._emit(answer)
            return
        if outcome in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT):
            await self.evaluate(eid)

    async def evaluate(self, eid: int) -> None:
        ex = self.records[eid]
        spec = ex.spec
        assert spec is not None
        if ex.infra_errors:  # the evaluator learns what Gyre answered: it may vouch for its score
            spec = ex.spec = replace(spec, extra={**spec.extra, "infrastructure_errors": list(ex.infra_errors)})
        timeout = self.cfg.harness.evaluator_bound_s
        spec = ex.spec = replace(spec, extra={**spec.extra, "evaluator_timeout_s": timeout})  # its bound

        def evaluator(state: StateRef) -> Assessment | None:
            return self.pm.hook.gyre_evaluate(spec=spec, state=state)

        while True:
            answer = await self._assess_once(eid, evaluator, timeout)
            if isinstance(answer, ev.EvaluationValid):
                reward = self.ledger.reward(eid)
                ex.reward = reward
                if self.ledger.assessments(eid)[-1].nothing_to_assess:  # the task's complete failure
                    ex.placeholder = True
                    if self.journal is not None:
                        self.journal.write("placeholder", execution_id=eid, group=ex.group_id)
                    if not self.buffer.put(ScoredExecution.placeholder(eid, ex.group_id)):
                        ex.fate, ex.why = "surplus", "its group already had its rewards"
                    self._emit(answer)
                    return
                assert ex.trajectory is not None, f"execution {eid} was evaluated without its records"
                tree, selected = ex.trajectory
                if self.journal is not None:  # the records are in its "trajectory" entry
                    self.journal.write("scored", execution_id=eid, group=ex.group_id, reward=reward)
                used = self.buffer.put(ScoredExecution(eid, ex.group_id, reward, tree, selected))
                if not used:
                    ex.fate, ex.why = "surplus", "its group already had its rewards"
                self._emit(answer)
                return
            crashed = bool(ex.harness_exit and ex.harness_exit.get("end") == "crashed")
            last = self.ledger.assessments(eid)[-1:]
            infra = bool(last) and last[0].detail.startswith(INFRA_DETAIL)
            # nothing a retry could change: the harness left nothing, or Gyre failed the execution
            if not answer.final and (crashed or infra):
                answer = self.ledger.exclude(eid)
            if answer.final:
                ex.fate, ex.why = "excluded", exclusion_cause(self.ledger.assessments(eid), crashed)
                if self.journal is not None:
                    self.journal.write("excluded", execution_id=eid, why=ex.why)
                self.buffer.exclude(eid)
                self._emit(answer)
                return
            self._emit(answer)
            await asyncio.sleep(max(0.0, min(5.0, timeout, self.ledger.deadline(eid) - self.now())))

    def _start_harness(self, ex: LiveExecution, spec: ExecutionSpec) -> Any:
        """Launch (worker thread). The handle is recorded before the fate is read again, so a
        cancellation or the run's end either finds it and kills it, or was seen here first."""
        handle = self.pm.hook.gyre_launch_harness(spec=spec)
        ex.handle = handle
        if handle is not None and ex.fate in ("cancelled", "stopped"):
            handle.kill()
        return handle

    async def _setup_failed(self, eid: int, detail: str) -> None:
        """The task's set-up failed before the harness started: excluded with that cause (the
        scheduler learns it as an execution ended without a reward), never scored."""
        ex = self.records[eid]
        if ex.fate in ("cancelled", "stopped"):
            return  # already ended (and announced) by its cancellation or the run's end
        log.warning("execution %s: %s", eid, detail)
        ex.outcome, ex.fate, ex.why = Outcome.OVERALL_TIMEOUT, "excluded", "task set-up failed"
        self.proxy.close_execution(eid)
        self.ledger.terminated(eid, Outcome.OVERALL_TIMEOUT, None)
        if self.journal is not None:
            self.journal.write("excluded", execution_id=eid, why=ex.why)
        self.buffer.exclude(eid)
        self._emit(ev.ExecutionEnded(eid, Outcome.OVERALL_TIMEOUT))

    async def _assess_once(self, eid: int, evaluator: Callable[[StateRef], Assessment | None],
                           timeout: float) -> ev.EvaluationValid | ev.EvaluationUnresolved:
        """One assessment attempt, bounded by ``timeout`` and by what is left of the budget.

        Only the evaluator runs in a worker thread; the ledger is updated here, on the loop, so an
        attempt that hangs past its bound and answers later changes nothing (its answer is
        dropped) and can never race the retry. Unresolved once the budget is spent: excluded."""
        state = self.ledger.retry_target(eid)
        started, deadline = self.now(), self.ledger.deadline(eid)
        bound = min(timeout, deadline - started)
        if bound <= 0:
            return self.ledger.evaluate(eid, evaluator, started)  # no attempt starts: excluded
        try:
            got: Assessment | None = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._blocking, evaluator, state), bound)
        except asyncio.TimeoutError:  # a hung evaluator: unresolved, retried within the budget
            got = Assessment.unresolved(state, f"evaluator gave no answer within {bound:.1f} s")
        except Exception as exc:  # a crashing evaluator: unresolved, retried within the budget
            got = Assessment.unresolved(state, f"evaluator raised {exc!r}")
        got = infra_verdict(got, self.records[eid].infra_errors)
        answer = self.ledger.evaluate(eid, lambda s: got, started)
        if isinstance(answer, ev.EvaluationUnresolved) and not answer.final and self.now() >= deadline:
            answer = self.ledger.evaluate(eid, evaluator, self.now())  # budget spent: excluded
        return answer

    def _replay_context_cap(self) -> int:
        """The most context a replay may grow to: its last reply must still fit one micro-step row
        (``dataplane.token_budget``; a longer row cannot be trained), with room for the sizing's error."""
        room = self.cfg.dataplane.token_budget - self.cfg.sampling.max_new_tokens
        return max(0, int(0.9 * room) - 64)

    def _replay_tokens_per_word(self) -> float:
        """Tokens per word of the replay's tool output under the run's tokenizer: where each
        replay's sizing starts (it then corrects itself from the proxy's usage counts)."""
        rate = self._tool_output_rate
        if rate is None:
            from gyre_core.tasks.replay_harness import tool_output

            text = tool_output(400, 0)
            rate = self._tool_output_rate = round(len(self.proxy.renderer.encode(text)) / len(text.split()), 3)
        return rate

    def cancel(self, eid: int) -> None:
        ex = self.records[eid]
        prev, ex.fate, ex.why = ex.fate, "cancelled", "its group was complete (oversampled surplus)"
        if prev == "running" and ex.handle is not None:
            self._spawn(asyncio.to_thread(ex.handle.kill), f"cancel of execution {eid}")
            self.proxy.close_execution(eid)
        self._emit(ev.ExecutionEnded(eid, Outcome.CANCELLED))

    def account_group(self, gid: int, fate: str, from_fates: tuple[str, ...] = ("ended",), why: str = "") -> None:
        """Move a group's executions from ``from_fates`` to ``fate`` (``trained`` only once the
        step that consumed them has applied its update)."""
        for ex in self.records.values():
            if ex.group_id == gid and ex.fate in from_fates:
                ex.fate, ex.why = fate, why

    def group_members(self, gid: int) -> list[int]:
        return [e for e, x in self.records.items() if x.group_id == gid]

    def spec_for(self, eid: int) -> ExecutionSpec:
        ex = self.records[eid]
        inst = self.groups[ex.group_id]["instance"]
        spec = ExecutionSpec(
            execution_id=eid, workdir=str(self.out_dir / "executions" / f"e{eid:05d}"), proxy_base_url=self.proxy_url,
            api_key="", harness_timeout_s=self.cfg.harness.timeout_s, overall_budget_s=self.cfg.harness.overall_budget_s,
            harness=self.cfg.harness.kind, task=inst.prompt, extra=dict(inst.as_extra(), model=self.cfg.model.name,
                                                                        **({"sandbox": self.sandbox} if self.sandbox else {})))
        return _with_exit(spec, ex.harness_exit) if ex.harness_exit else spec

    def _harness_extra(self, inst: Any) -> dict[str, Any]:
        return harness_extra(self.cfg, inst, self.sandbox)

    def final_state(self, eid: int) -> StateRef:
        return StateRef(artifact_version="final", branch=str(self.out_dir / "executions" / f"e{eid:05d}"))

    def mean_reward(self, groups: Sequence[int]) -> float | None:
        rs = [x.reward for g in groups for x in (self.records[e] for e in self.group_members(g)) if x.reward is not None]
        return round(sum(rs) / len(rs), 4) if rs else None

    def short_group(self, cmd: ev.GroupDropped | ev.GroupFiltered) -> None:
        """The scheduler's decision on a group short of N valid rewards, carried out in the buffer."""
        if isinstance(cmd, ev.GroupDropped):
            self.buffer.drop(cmd)
            self.account_group(cmd.group_id, "dropped", why="group could no longer reach N valid rewards (drop rule)")
            return
        self.buffer.filter(cmd)
        if cmd.empty:  # its few valid rewards give no group baseline: nothing of it is trained
            self.account_group(cmd.group_id, "filtered",
                                why="group held fewer valid rewards than min_valid_rewards (filter rule: empty group)")
