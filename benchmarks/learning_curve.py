"""Does a live run learn? ``gyre-orchestrate run`` on the built-in ``digits`` task, next to a control.

Two live runs with the same seed and settings (real Megatron cells, SGLang engines, proxy, one
``reply`` harness process per execution), each for ``--steps`` steps:

* **real**: the task's rewards (the fraction of digits in each reply);
* **control**: the same evaluator, but each execution is given the reward of a random execution
  among the last ``--pool`` assessed (rewards shuffled across executions), so the rewards carry no
  information about what the policy sampled.

The curve is the *true* mean reward per trained step (the digits fraction of the trained
executions' replies) in both runs. The test: the rise (mean of the last 5 steps minus the mean of
the first 5) of the real run exceeds the control's rise by more than two standard errors of the
difference of the two rises (each rise's standard error from its 10 step means). Prints one JSON
object.

    python benchmarks/learning_curve.py [--steps 20] [--lr 1e-2] [--out runs/learning]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef


class ShuffledRewards:
    """Control evaluator (called before the task's own): a valid reward drawn from the pool of the
    last ``pool`` true rewards (this execution's included); the true one is kept for the curve."""

    def __init__(self, pool: int, seed: int) -> None:
        self.pool: list[float] = []
        self.size = pool
        self.rng = random.Random(seed)
        self.true: dict[int, float] = {}

    @hookimpl
    def gyre_evaluate(self, spec: ExecutionSpec, state: StateRef) -> Assessment | None:
        from gyre_core.tasks.digits import score_workspace

        try:
            score, _ = score_workspace(spec.workdir)
        except OSError:
            return None  # the task's evaluator reports it unresolved
        self.true[spec.execution_id] = score
        self.pool = (self.pool + [score])[-self.size:]
        return Assessment.valid(self.rng.choice(self.pool), state, "shuffled")


def _true_rewards_per_step(summary: dict[str, Any], orch: Any, out: Path) -> list[float]:
    from gyre_core.tasks.digits import score_workspace

    curve = []
    for rec in summary["step_records"]:
        scores = []
        for g in rec["groups"]:
            for eid in orch._group_members(g):
                if orch._execs[eid].fate == "trained":
                    scores.append(score_workspace(out / "executions" / f"e{eid:05d}")[0])
        curve.append(sum(scores) / len(scores) if scores else float("nan"))
    return curve


def _rise(curve: list[float], k: int = 5) -> tuple[float, float]:
    """(mean of the last k − mean of the first k, its standard error)."""
    first, last = curve[:k], curve[-k:]

    def var(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    return sum(last) / k - sum(first) / k, math.sqrt(var(first) / k + var(last) / k)


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config

    out = Path(args.out) / kind
    cfg = load_run_config(args.config, {
        "run.out_dir": str(out), "run.steps": args.steps, "run.seed": args.seed, "task.name": '"digits"',
        "harness.kind": '"reply"', "training.lr": args.lr, "run.max_wall_s": 3600})
    plugins = [ShuffledRewards(args.pool, args.seed)] if kind == "control" else []
    parts: dict[str, Any] = {}
    t0 = time.monotonic()
    summary = run_live(cfg, lambda m: None, plugins=plugins, on_started=parts.update)
    curve = _true_rewards_per_step(summary, parts["orchestrator"], out)
    rise, se = _rise(curve)
    return {"true_reward_per_step": [round(x, 4) for x in curve], "rise": round(rise, 4), "se": round(se, 4),
            "rewards_trained_on": summary["rewards"], "losses": summary["losses"],
            "clip_fraction": [r["clip_fraction"] for r in summary["step_records"]],
            "mean_staleness": summary["mean_staleness"], "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=32)
    ap.add_argument("--config", default=None, help="a run config to start from (default: the embedded job)")
    ap.add_argument("--out", default=f"runs/learning-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    if args.steps < 10:
        ap.error("--steps must be ≥ 10 (first 5 against last 5)")
    real = run("real", args)
    control = run("control", args)
    margin = real["rise"] - control["rise"]
    se = math.sqrt(real["se"] ** 2 + control["se"] ** 2)
    print(json.dumps({"benchmark": "learning_curve", "task": "digits", "steps": args.steps, "lr": args.lr,
                      "real": real, "control": control, "rise_margin": round(margin, 4),
                      "two_se": round(2 * se, 4), "learns": margin > 2 * se}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
