"""Does a live run learn? ``gyre-orchestrate run`` next to a shuffled-reward control.

``--task lookup`` (the default): the two-turn ``lookup`` task (``benchmarks/lookup/``: the prompt
names an entry, a tool result holds its code, the answer must repeat it), from the warm-started
checkpoint ``benchmarks/lookup/warm_start.py`` makes, for each of ``--seeds``: a **real** run and a
**control** run whose training rewards are shuffled across executions (evaluations keep the true
reward). The measure is the held-out pass rate (64 eval records, never trained on) before
training and every ``[eval] interval`` steps; per seed the rise is the last evaluation's pass rate
minus the first's. A second measure, less noisy (every trained execution counts, 64 a step): the
true reward of each step's trained executions, its rise the mean of the last 5 steps minus the
first 5 (the control's true rewards, not the shuffled ones it trained on). Reported for each: each
run's curve, the mean rise of each arm with its 95% confidence interval across seeds (Student's
t), and the paired difference real − control with its interval: **learns** when that interval lies
above zero.

``--task digits`` (the older check):
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

    python benchmarks/learning_curve.py [--task lookup] [--seeds 0,1,2] [--steps 20] [--out runs/learning]
    python benchmarks/learning_curve.py --task digits [--steps 20] [--lr 1e-2]
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
    last ``pool`` true rewards (this execution's included); the true one is kept for the curve.
    Training executions only (``<out>/executions/``): held-out evaluations keep their true reward."""

    def __init__(self, pool: int, seed: int, task: str = "digits") -> None:
        self.pool: list[float] = []
        self.size = pool
        self.rng = random.Random(seed)
        self.task = task
        self.true: dict[int, float] = {}

    def _true_score(self, spec: ExecutionSpec) -> float | None:
        if self.task == "lookup":
            return _lookup_reward()(spec.extra["record"], spec.workdir, spec.extra)
        from gyre_core.tasks.digits import score_workspace

        try:
            return score_workspace(spec.workdir)[0]
        except OSError:
            return None

    @hookimpl
    def gyre_evaluate(self, spec: ExecutionSpec, state: StateRef) -> Assessment | None:
        if Path(spec.workdir).parent.name != "executions":
            return None  # an evaluation: the task's own reward
        score = self._true_score(spec)
        if score is None:
            return None  # the task's evaluator reports it unresolved
        self.true[spec.execution_id] = score
        self.pool = (self.pool + [score])[-self.size:]
        return Assessment.valid(self.rng.choice(self.pool), state, "shuffled")


LOOKUP = Path(__file__).parent / "lookup"
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t, two-sided 95%, by degrees of freedom."""


def _lookup_reward() -> Any:
    """``benchmarks/lookup/reward.py:score`` (imported once; the folder is not a package)."""
    if str(LOOKUP) not in sys.path:
        sys.path.insert(0, str(LOOKUP))
    from reward import score

    return score


def mean_ci(xs: list[float]) -> dict[str, Any]:
    """Mean and the half-width of its 95% confidence interval (Student's t over ``len(xs) − 1``;
    ``None`` with one seed)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return {"mean": round(m, 4), "ci95": None, "n": len(xs)}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return {"mean": round(m, 4), "ci95": round(T95.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs)), 4), "n": len(xs)}


def warm_start(model: Path, seed: int) -> dict[str, Any]:
    """The warm-started checkpoint (built once: ``benchmarks/lookup/warm_start.py``)."""
    import subprocess

    stats = model / "warm_start.json"
    if not stats.exists():
        proc = subprocess.run([sys.executable, str(LOOKUP / "warm_start.py"), "--out", str(model), "--seed", str(seed)],
                              capture_output=True, text=True, check=True)
        stats.write_text(proc.stdout.strip().splitlines()[-1])
    return dict(json.loads(stats.read_text()))


def run_lookup(kind: str, seed: int, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the lookup job (``benchmarks/lookup/job.toml``) from ``model``."""
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config

    out = Path(args.out) / f"{kind}-seed{seed}"
    overrides: dict[str, Any] = {"run.out_dir": json.dumps(str(out)), "run.seed": seed,
                                 "model.dir": json.dumps(str(model)), "run.max_wall_s": 3600}
    if args.steps is not None:
        overrides["run.steps"] = args.steps
    if args.lr is not None:
        overrides["training.lr"] = args.lr
    cfg = load_run_config(str(LOOKUP / "job.toml"), overrides)
    control = ShuffledRewards(args.pool, seed, "lookup") if kind == "control" else None
    parts: dict[str, Any] = {}
    t0 = time.monotonic()
    summary = run_live(cfg, lambda m: None, plugins=[control] if control else [], on_started=parts.update)
    # held-out mean reward: with a 0/1 reward, the share of evaluation executions that passed (pass@1
    # over ``eval.samples`` draws per record; the summary's ``pass_rate`` is pass@samples)
    evals = [(e["policy_version"], e["mean_reward"]) for e in summary["evaluations"]]
    # the same over the samples that version alone served (versions published during an
    # evaluation serve its later samples): (version, mean, samples, samples a later version served)
    on_version = [(e["policy_version"], e.get("mean_reward_on_version"), e.get("executions_on_version"),
                   e.get("served_later")) for e in summary["evaluations"]]
    # the true reward of each step's trained executions (the control trains on shuffled ones)
    orch = parts["orchestrator"]
    true = control.true if control else {e: x.reward for e, x in orch.executions.records.items()}
    curve = _true_rewards_per_step(summary, orch, true.get)
    result = {"eval_pass_rate": evals, "rise": round(evals[-1][1] - evals[0][1], 4), "eval_on_version": on_version,
              "true_train_reward_per_step": curve, "train_rise": round(_rise(curve)[0], 4),
              "lr": cfg.training.lr, "steps": cfg.run.steps,
              "clip_fraction": [r["clip_fraction"] for r in summary["step_records"]],
              "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps({"run": kind, "seed": seed, **result}), file=sys.stderr, flush=True)
    return result


def lookup_main(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model or Path(args.out) / "warm-start")
    start = warm_start(model, 0)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, dict[str, Any]]] = {"real": {}, "control": {}}
    for s in seeds:  # seed by seed, so a stopped benchmark still has pairs
        for kind in ("real", "control"):
            runs[kind][s] = run_lookup(kind, s, model, args)

    def arms(key: str) -> dict[str, Any]:
        real = [runs["real"][s][key] for s in seeds]
        control = [runs["control"][s][key] for s in seeds]
        diff = mean_ci([r - c for r, c in zip(real, control)])
        return {"real": mean_ci(real), "control": mean_ci(control), "real_minus_control": diff,
                "learns": diff["ci95"] is not None and diff["mean"] - diff["ci95"] > 0}

    return {"benchmark": "learning_curve", "task": "lookup", "steps": runs["real"][seeds[0]]["steps"], "seeds": seeds,
            "warm_start": {k: start[k] for k in ("pass_rate", "steps", "hidden", "layers", "lr", "seconds")},
            "runs": runs, "held_out_rise": arms("rise"), "train_rise": arms("train_rise")}


def _true_rewards_per_step(summary: dict[str, Any], orch: Any, score_of: Any) -> list[float]:
    """Per step, the mean true score (``score_of(execution_id)``; None: unscored) of its trained
    executions."""
    curve = []
    for rec in summary["step_records"]:
        scores = [score_of(e) for g in rec["groups"] for e in orch.executions.group_members(g) if orch.executions.records[e].fate == "trained"]
        scores = [x for x in scores if x is not None]
        curve.append(round(sum(scores) / len(scores), 4) if scores else float("nan"))
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
    from gyre_core.tasks.digits import score_workspace

    curve = _true_rewards_per_step(summary, parts["orchestrator"],
                                   lambda e: score_workspace(out / "executions" / f"e{e:05d}")[0])
    rise, se = _rise(curve)
    return {"true_reward_per_step": [round(x, 4) for x in curve], "rise": round(rise, 4), "se": round(se, 4),
            "rewards_trained_on": summary["rewards"], "losses": summary["losses"],
            "clip_fraction": [r["clip_fraction"] for r in summary["step_records"]],
            "mean_staleness": summary["mean_staleness"], "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("lookup", "digits"), default="lookup")
    ap.add_argument("--steps", type=int, default=None, help="default: the job's (lookup 20), 20 for digits")
    ap.add_argument("--lr", type=float, default=None, help="default: the job's (lookup 1e-4), 1e-2 for digits")
    ap.add_argument("--seed", type=int, default=0, help="digits: the one seed")
    ap.add_argument("--seeds", default="0,1,2", help="lookup: the seeds, each a real and a control run")
    ap.add_argument("--model", default=None, help="lookup: the warm-started model.dir (default: built under --out)")
    ap.add_argument("--pool", type=int, default=32)
    ap.add_argument("--config", default=None, help="a run config to start from (default: the embedded job)")
    ap.add_argument("--out", default=f"runs/learning-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    if args.task == "lookup":
        print(json.dumps(lookup_main(args)))
        return 0
    if args.lr is None:
        args.lr = 1e-2
    if args.steps is None:
        args.steps = 20
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
