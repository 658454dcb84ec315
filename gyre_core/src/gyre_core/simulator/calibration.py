"""The simulator held to a live run: its measured costs and its workload, read from the run folder.

``gyre-orchestrate simulate --calibrate-from RUN_DIR`` simulates what a finished live run did,
with what that run measured instead of the paper's figures:

- **role switches**: the median ``total_s`` of each direction (``summary.json`` ``role_switches``);
- **publication**: the median export + load time of a published version;
- **training**: per-cell throughput and a fixed per-step cost, fitted by least squares to
  ``duration = fixed + tokens / (cells × rate)`` over the run's steps, where ``tokens`` is every
  token the trainer read (``row_tokens``: contexts and replies; runs that predate it give the
  sampled ``tokens``). A step's duration in the live run also holds its waits for ready groups,
  so the fit is an upper bound on pure compute;
- **the scheduler**: the run's own ``[scheduler]`` section (from the journal's config record);
- **the workload**: for a ``replay`` run, the trace it replayed, scaled by its ``time_scale``, group
  by group as the run drew it (:class:`~gyre_core.orchestrator.replay_plan.ReplayPlan`); for any
  other harness, the executions the run measured (launch to end), group by group. Each execution
  carries the run's mean tokens read per execution.

Nothing here re-implements a rule: the result feeds :func:`gyre_core.simulator.race.race`.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from gyre_core.config import ConfigError, Mode, SchedulerConfig
from gyre_core.scheduler.burst import expected_staleness
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.engine import SimParams
from gyre_core.simulator.workload import TRACE_OUTCOMES, ExecutionRecord, GroupDraw, TraceWorkload

__all__ = ["IndexedGroups", "LiveCalibration", "calibrate_from_run", "fit_training_time"]


class IndexedGroups:
    """A workload whose i-th dispatched group is the live run's group i (then uniform draws).

    :class:`~gyre_core.simulator.race.PerGroupSeeded` calls :meth:`draw_indexed` with the
    dispatch index, so every simulated mode sees the groups the live run saw, in the same order."""

    def __init__(self, groups: Mapping[int, GroupDraw], fallback: TraceWorkload, plan: Any = None,
                 tokens: int | None = None) -> None:
        self.groups, self.fallback, self.plan, self.tokens = dict(groups), fallback, plan, tokens

    def draw_indexed(self, index: int, rng: random.Random, n: int) -> GroupDraw:
        if self.plan is not None:  # a replay: the plan's draw for that group id, as the live run made it
            recs = [self.plan.record(index, i, n) for i in range(n)]
            return GroupDraw(recs[0].query, tuple(
                ExecutionRecord(r.query, r.duration_s, Outcome(r.outcome), self.tokens) for r in recs))
        got = self.groups.get(index)
        if got is not None and len(got.executions) >= n:
            return GroupDraw(got.query, got.executions[:n])
        return self.fallback.draw_group(rng, n)

    def draw_group(self, rng: random.Random, n: int) -> GroupDraw:
        return self.fallback.draw_group(rng, n)


def fit_training_time(steps: Sequence[tuple[float, int, int]]) -> tuple[float, float]:
    """``(rate, fixed)`` from ``(duration_s, tokens, cells)`` per step: duration ≈ fixed +
    tokens / (cells × rate), least squares; a fit with a negative part falls back to fixed = 0."""
    pts = [(tok / max(1, cells), d) for d, tok, cells in steps if d > 0 and tok > 0]
    if not pts:
        raise ConfigError("calibration: the run trained no step with tokens and a duration")
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if n >= 2 and sxx > 0:
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        fixed = my - slope * mx
        if slope > 0 and fixed >= 0:
            return 1.0 / slope, fixed
    return sum(x for x, _ in pts) / sum(y for _, y in pts), 0.0


@dataclass
class LiveCalibration:
    """What :func:`calibrate_from_run` read: the run's scheduler, the simulator's world, the workload."""

    config: SchedulerConfig
    params: SimParams
    workload: IndexedGroups
    staleness: float
    source: str
    """``replay trace`` or ``measured executions``."""
    measured: dict[str, Any] = field(default_factory=dict)
    live: dict[str, Any] = field(default_factory=dict)
    """The live run's own result: mode, steps, ``run_s`` (scheduler start to the last step's end: what
    the simulator's ``end_to_end_s`` predicts), ``wall_s`` (with engine start-up), staleness."""


def _read_config(run_dir: Path) -> dict[str, Any]:
    journal = run_dir / "journal.jsonl"
    try:
        with open(journal, encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"calibrate_from: {journal}: cannot read the run's config record ({e})") from None
    if first.get("kind") != "config" or not isinstance(first.get("config"), dict):
        raise ConfigError(f"calibrate_from: {journal}: the first record is not the run's config")
    return first["config"]


def _scheduler_config(raw: Mapping[str, Any]) -> SchedulerConfig:
    names = set(SchedulerConfig.__dataclass_fields__)
    fields = {k: v for k, v in raw.items() if k in names and v is not None}
    fields["mode"] = Mode.parse(fields.get("mode", "gyre"))
    return SchedulerConfig(**fields)


def _measured_groups(run_dir: Path) -> dict[int, GroupDraw]:
    """Launch-to-end durations of the run's executions, by group (``events.jsonl``)."""
    group_of: dict[int, int] = {}
    launched: dict[int, float] = {}
    ended: dict[int, tuple[float, Outcome]] = {}
    outcomes = {o.value: o for o in TRACE_OUTCOMES}
    with open(run_dir / "events.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            kind = r.get("command") or r.get("event")
            if kind == "DispatchGroup":
                for eid in r.get("execution_ids", []):
                    group_of[int(eid)] = int(r["group_id"])
            elif kind == "Launch":
                launched.setdefault(int(r["execution_id"]), float(r["t"]))
            elif kind == "ExecutionEnded" and r.get("outcome") in outcomes:
                ended[int(r["execution_id"])] = (float(r["t"]), outcomes[r["outcome"]])
    by_group: dict[int, list[ExecutionRecord]] = {}
    for eid, (t_end, outcome) in sorted(ended.items()):
        if eid in launched and eid in group_of and t_end > launched[eid]:
            g = group_of[eid]
            by_group.setdefault(g, []).append(ExecutionRecord(f"group-{g}", t_end - launched[eid], outcome))
    return {g: GroupDraw(recs[0].query, tuple(recs)) for g, recs in by_group.items()}


def calibrate_from_run(run_dir: str | Path, steps: int | None = None, seed: int | None = None) -> LiveCalibration:
    """Read a finished live run's folder (``journal.jsonl``, ``summary.json``, ``events.jsonl``)."""
    run_dir = Path(run_dir)
    cfg_raw = _read_config(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"calibrate_from: {run_dir / 'summary.json'}: {e}") from None
    if summary.get("status") != "ok":
        raise ConfigError(f"calibrate_from: {run_dir} did not finish (status {summary.get('status')!r})")
    config = _scheduler_config(cfg_raw.get("scheduler", {}))

    switches = summary.get("role_switches") or []
    to_train = [float(s["total_s"]) for s in switches if s.get("transition") == "to_training"]
    to_roll = [float(s["total_s"]) for s in switches if s.get("transition") == "to_rollout"]
    pubs = [float(p.get("export_s", 0.0)) + float(p.get("load_s", 0.0)) for p in summary.get("publications") or []]
    def read(r: Mapping[str, Any]) -> int:
        return int(r.get("row_tokens") or r.get("tokens") or 0)

    trained = [r for r in summary.get("step_records") or [] if read(r) and r.get("duration_s")]
    rate, fixed = fit_training_time([(float(r["duration_s"]), read(r), len(r.get("cells") or [0])) for r in trained])
    per_exec = sum(read(r) for r in trained) / max(1, sum(int(r.get("executions") or 0) for r in trained))
    tokens = max(1, round(per_exec))
    defaults = SimParams()
    run_seed = int(cfg_raw.get("run", {}).get("seed", 0)) if seed is None else seed
    params = SimParams(
        steps=int(steps if steps is not None else summary.get("steps") or cfg_raw.get("run", {}).get("steps", 1)),
        seed=run_seed,
        cell_tokens_per_s=rate,
        rollout_to_training_s=statistics.median(to_train) if to_train else defaults.rollout_to_training_s,
        training_to_rollout_s=statistics.median(to_roll) if to_roll else defaults.training_to_rollout_s,
        publication_s=statistics.median(pubs) if pubs else defaults.publication_s,
        optimizer_s=fixed,
    )
    harness = cfg_raw.get("harness", {})
    if harness.get("kind") == "replay":
        from gyre_core.orchestrator.replay_plan import ReplayPlan

        plan = ReplayPlan.from_config(str(harness.get("trace", "")), float(harness.get("time_scale", 1.0)), run_seed)
        scaled = [ExecutionRecord(r.query, r.duration_s * plan.time_scale, r.outcome, tokens)
                  for recs in plan.workload.by_query.values() for r in recs]
        workload = IndexedGroups({}, TraceWorkload(scaled), plan=plan, tokens=tokens)
        source = "replay trace"
    else:
        groups = _measured_groups(run_dir)
        if not groups:
            raise ConfigError(f"calibrate_from: {run_dir}: no execution with a launch and an end in events.jsonl")
        groups = {g: GroupDraw(d.query, tuple(ExecutionRecord(r.query, r.duration_s, r.outcome, tokens)
                                             for r in d.executions)) for g, d in groups.items()}
        workload = IndexedGroups(groups, TraceWorkload([r for d in groups.values() for r in d.executions]))
        source = "measured executions"
    measured = {"rollout_to_training_s": round(params.rollout_to_training_s, 4),
                "training_to_rollout_s": round(params.training_to_rollout_s, 4),
                "publication_s": round(params.publication_s, 4), "cell_tokens_per_s": round(rate, 2),
                "step_fixed_s": round(fixed, 4), "tokens_per_execution": tokens,
                "switches": {"to_training": len(to_train), "to_rollout": len(to_roll)}, "publications": len(pubs),
                "steps_fitted": len(trained)}
    ends = [float(r["ended_s"]) for r in summary.get("step_records") or [] if "ended_s" in r]
    live = {"mode": summary.get("mode"), "steps": summary.get("steps"), "wall_s": summary.get("wall_s"),
            "run_s": round(max(ends), 3) if ends else None, "mean_staleness": summary.get("mean_staleness")}
    return LiveCalibration(config, params, workload, expected_staleness(config.extra_dispatch, config.steps_per_burst),
                           source, measured, live)
