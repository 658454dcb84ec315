"""Time to a trained model: Gyre, Async (best split) and Colocate learning the same task side by side.

Every mode runs ``gyre-orchestrate run`` on the ``lookup`` job (``benchmarks/lookup/job.toml``: its
train and held-out files, its two-turn harness, its reward), from the same warm-started
``model.dir`` (``benchmarks/lookup/warm_start.py``) and the same seeds. The long tail is real:
``harness.paced = true`` gives each training execution the scaled duration of the recorded
execution that the paper-shaped trace assigns it (group by group, the same draws in every mode),
and the lookup agent waits it out as tool time between its two calls, so the answer comes when
the recorded execution ended. Held-out evaluations are not paced.

The modes share one target staleness E[d]: Gyre's (φ, μ) comes from the simulator's burst search
on the scaled trace (as in ``live_race.py``), Async runs every split of its K cells (the one that
reaches the target first counts, else the shorter run), Colocate φ = 0, μ = 2·E[d] + 1.

Measured per run, on the orchestrator's clock from the scheduler's start (engine start-up, the
same in every mode, is left out): the train reward of each step at its end, and the held-out
pass@1 of every ``--eval-every``-th version, placed at the time that version was published. The
held-out figures are exact: the run keeps those versions as model folders
(``checkpoint.hf_interval``) and each is evaluated afterwards on its own by ``gyre-orchestrate
eval`` (one engine serving that version alone; 64 records × ``--eval-samples``). An evaluation
beside training would be served partly by later versions, and its load on the rollout engines
would differ between modes. The warm start is version 0 of every mode (evaluated once). The
**time to target** is when the first version whose held-out pass@1 reaches ``--target`` was
published. Reported per mode: those times across seeds and the speedups, and the held-out reward
per version (do the modes learn alike per step?). Then ``simulate --calibrate-from`` reads the
first seed's Gyre run and predicts the three modes' run times: where Gyre is not ahead, what holds
it back. ``--reuse-runs`` keeps a run already in ``--out`` (its ``run.json``) and only evaluates
what is not yet evaluated.

Writes ``<out>/time_to_reward.json`` and ``<out>/time_to_reward.png`` (held-out and train reward
against wall time, one colour per mode) and prints the JSON object.

    python benchmarks/time_to_reward.py [--seeds 0] [--steps 20] [--target 0.5] [--time-scale 0.002]
        [--eval-every 5] [--eval-samples 4] [--model runs/lookup-start] [--modes gyre,async,colocate]
        [--out runs/time-to-reward] [--reuse-runs]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import live_race  # noqa: E402  (a sibling script: its CLI runner and burst search)
LOOKUP = ROOT / "benchmarks" / "lookup"
COLORS = {"gyre": "tab:blue", "async": "tab:orange", "colocate": "tab:green"}


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``gyre-orchestrate`` from the repository root (the lookup job's paths are relative to it)."""
    return live_race.cli(*args, timeout=timeout, cwd=ROOT)


def job_shape() -> dict[str, Any]:
    """The lookup job's scheduler section (cells, capacity, N, B) as the burst search needs it."""
    import tomllib

    s = tomllib.loads((LOOKUP / "job.toml").read_text())["scheduler"]
    return {"cells": int(s["cells"]), "capacity": int(s["cell_capacity"]), "n": int(s["group_size"]),
            "b": int(s["groups_per_step"]), "rho_min": float(s["rho_min"])}


def gyre_burst(a: argparse.Namespace, trace: Path, shape: dict[str, Any]) -> tuple[float, int]:
    """Gyre's (φ, μ) at the target E[d], by the live race's burst search on the scaled trace."""
    job = SimpleNamespace(**shape, time_scale=a.time_scale, staleness=a.staleness, step_s=a.step_s,
                          steps=a.steps, seed=a.seeds[0])
    phi, mu, _ = live_race.burst_search(job, trace, Path(a.out), rho_min=shape["rho_min"])
    return phi, mu


def time_to_target(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """When the first version whose held-out reward reached ``target`` was published (None: never)."""
    return next((t for _, t, r in curve if r >= target), None)


def _set_value(v: Any) -> str:
    """A ``--set`` value as TOML reads it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v) if isinstance(v, list) else str(v)


def run_mode(label: str, seed: int, sets: dict[str, Any], a: argparse.Namespace, trace: Path,
             timeout_s: float) -> dict[str, Any]:
    """One training run; its kept versions are evaluated later (:func:`held_out_curve`)."""
    out = Path(a.out) / f"{label}-seed{seed}"
    saved = out / "run.json"
    if a.reuse_runs and saved.is_file():
        return dict(json.loads(saved.read_text()))
    base = {"run.seed": seed, "run.steps": a.steps, "model.dir": str(a.model), "run.max_wall_s": a.max_wall_s,
            "harness.paced": True, "harness.trace": str(trace), "harness.time_scale": a.time_scale,
            "harness.timeout_s": timeout_s, "harness.overall_budget_s": timeout_s + 120.0,
            "metrics.backends": [], "checkpoint.hf_interval": a.eval_every,
            # no evaluation beside training: each kept version is evaluated alone afterwards
            "task.eval": "", "eval.interval": 0, "eval.before_train": False}
    args = ["run", "--config", str(LOOKUP / "job.toml"), "--out", str(out), "--json-summary"]
    for k, v in {**base, **sets}.items():
        args += ["--set", f"{k}={_set_value(v)}"]
    p = cli(*args, timeout=a.max_wall_s + 600)
    if p.returncode != 0:
        raise RuntimeError(f"{label} seed {seed} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    s = json.loads(p.stdout.strip().splitlines()[-1])
    published = {int(x["version"]): float(x["at_s"]) for x in s.get("publications", [])}
    published[0] = 0.0
    kept = {v: str(out / "hf" / f"step{v}") for v in range(a.eval_every, a.steps + 1, a.eval_every)
            if (out / "hf" / f"step{v}" / "config.json").is_file()}
    if a.steps not in kept and (out / "checkpoint" / "config.json").is_file():
        kept[a.steps] = str(out / "checkpoint")
    recs = s["step_records"]
    ends = [float(r["ended_s"]) for r in recs if "ended_s" in r]
    r = {"label": label, "seed": seed, "phi": sets["scheduler.extra_dispatch"],
         "mu": sets["scheduler.steps_per_burst"], "published_s": {str(v): t for v, t in sorted(published.items())},
         "kept": {str(v): d for v, d in kept.items()}, "run_s": round(max(ends), 2) if ends else None,
         "train": [(int(r["step"]), float(r["ended_s"]), r.get("mean_reward")) for r in recs if "ended_s" in r],
         "mean_staleness": s["mean_staleness"], "clip_fraction": [r.get("clip_fraction") for r in recs],
         "role_switches": len(s.get("role_switches", [])), "executions": s["executions"], "out": str(out)}
    saved.write_text(json.dumps(r, indent=1))
    return r


def exact_eval(model: str, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    """``gyre-orchestrate eval`` of one model folder on the held-out records (kept in ``out``)."""
    saved = out / "summary.json"
    if not saved.is_file():
        p = cli("eval", "--model", model, "--config", str(LOOKUP / "job.toml"), "--out", str(out), "--json-summary",
                "--set", f"eval.samples={a.eval_samples}", "--set", f"eval.max_concurrent={a.eval_concurrency}",
                timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"evaluation of {model} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    ev = json.loads(saved.read_text())["evaluation"]
    return {"mean_reward": ev["mean_reward"], "executions": ev["executions"], "unresolved": ev["unresolved"]}


def held_out_curve(run: dict[str, Any], start: dict[str, Any], a: argparse.Namespace) -> None:
    """``run["held_out"]``: (version, published at, exact held-out pass@1), version 0 the warm start;
    and the time to the target."""
    curve = [(0, 0.0, start["mean_reward"])]
    for v, model in sorted(run["kept"].items(), key=lambda kv: int(kv[0])):
        ev = exact_eval(model, Path(run["out"]) / f"eval-v{v}", a)
        curve.append((int(v), run["published_s"].get(v, math.nan), ev["mean_reward"]))
    run["held_out"] = curve
    run["time_to_target_s"] = time_to_target(curve, a.target)


def times_to_target(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each mode's time to the target by seed, and Gyre's speedup on each other mode by seed
    (where both runs of that seed reached it)."""
    ttt = {m: {r["seed"]: r["time_to_target_s"] for r in rs} for m, rs in runs.items()}
    gyre = ttt.get("gyre", {})
    speedup = {f"gyre_vs_{m}": {seed: (round(t / gyre[seed], 3) if t and gyre.get(seed) else None)
                                for seed, t in ts.items() if seed in gyre}
               for m, ts in ttt.items() if m != "gyre" and gyre}
    return ttt, speedup


def best_async(splits: list[dict[str, Any]]) -> dict[str, Any]:
    """The split that reached the target first; if none did, the one whose run ended first."""
    reached = [r for r in splits if r["time_to_target_s"] is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_target_s"])
    return min(splits, key=lambda r: r["run_s"] or math.inf)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, runs in result["runs"].items():
        for i, r in enumerate(runs):
            c = COLORS.get(mode, "gray")
            label = f"{mode} (φ={r['phi']:g}, μ={r['mu']})" if i == 0 else None
            held.plot([t for _, t, _ in r["held_out"]], [x for _, _, x in r["held_out"]], "o-", color=c, label=label)
            pts = [(t, x) for _, t, x in r["train"] if x is not None]
            train.plot([t for t, _ in pts], [x for _, x in pts], ".-", color=c, alpha=0.7, label=label)
    held.axhline(result["target"], color="black", ls="--", lw=0.8, label=f"target {result['target']:g}")
    held.set(title="held-out mean reward at each evaluated version", xlabel="wall time (s) when published",
             ylabel="pass@1 (held-out)")
    train.set(title="train reward per step", xlabel="wall time (s) at the step's end", ylabel="mean reward")
    for ax in (held, train):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"lookup task, {len(result['seeds'])} seed(s), time scale {result['time_scale']:g}, "
                 f"E[d] = {result['staleness']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--target", type=float, default=0.5, help="held-out pass@1 that counts as trained")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="keep and evaluate every this many versions (0: the least common multiple of the "
                         "modes' μ, so that every mode publishes those versions)")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per held-out record")
    ap.add_argument("--eval-concurrency", type=int, default=16)
    ap.add_argument("--reuse-runs", action="store_true", help="keep the runs already in --out; evaluate what is left")
    ap.add_argument("--time-scale", type=float, default=0.002, help="seconds of execution per recorded second")
    ap.add_argument("--staleness", type=float, default=1.0, help="the common target E[d]")
    ap.add_argument("--step-s", type=float, default=4.0, help="estimated full-pool step, for the burst search")
    ap.add_argument("--model", default="runs/lookup-start", help="the warm-started model.dir (built if missing)")
    ap.add_argument("--modes", default="gyre,async,colocate")
    ap.add_argument("--max-wall-s", type=float, default=3600.0)
    ap.add_argument("--out", default=f"runs/time-to-reward-{time.strftime('%Y%m%d-%H%M%S')}")
    a = ap.parse_args()
    a.seeds = [int(s) for s in a.seeds.split(",")]
    from gyre_core.scheduler.burst import solve_burst
    from gyre_core.simulator.workload import PAPER_122B, synthesize_trace, write_trace

    from learning_curve import warm_start

    root = Path(a.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    a.out, a.model = str(root), Path(a.model).resolve()
    start = warm_start(a.model, 0)
    shape = job_shape()
    trace = root / "trace-paper.jsonl"
    write_trace(synthesize_trace(PAPER_122B, n_queries=64, n_per_query=16, seed=a.seeds[0]), trace)
    # every paced execution ends its second call before the harness timeout (the tail is waited out)
    timeout_s = round(PAPER_122B.harness_timeout_h * 3600 * a.time_scale + 60.0, 1)
    phi_g, mu_g = gyre_burst(a, trace, shape)
    print(f"burst search: Gyre φ={phi_g:g}, μ={mu_g} at E[d]={a.staleness:g}", file=sys.stderr, flush=True)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    burst = {m: (phi_g, mu_g) if m == "gyre" else solve_burst(m, a.staleness) for m in modes}
    # only published versions are kept as model folders, and a mode publishes every μ-th one
    a.eval_every = a.eval_every or math.lcm(*(mu for _, mu in burst.values()))
    print(f"evaluating versions {a.eval_every}, {2 * a.eval_every}, ... and {a.steps}", file=sys.stderr, flush=True)
    trained: list[tuple[str, int, list[dict[str, Any]]]] = []  # (mode, seed, its runs)
    failures: list[dict[str, Any]] = []
    for mode in modes:
        phi, mu = burst[mode]
        sets = {"scheduler.mode": mode, "scheduler.extra_dispatch": float(phi), "scheduler.steps_per_burst": mu}
        for seed in a.seeds:
            variants = [(mode, sets)] if mode != "async" else [
                (f"async-{m}", {**sets, "scheduler.async_training_cells": m}) for m in range(1, shape["cells"])]
            done = []
            for label, s in variants:
                print(f"running {label} seed {seed} (φ={phi:g}, μ={mu}) ...", file=sys.stderr, flush=True)
                try:
                    r = run_mode(label, seed, s, a, trace, timeout_s)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other runs still count
                    failures.append({"label": label, "seed": seed, "error": str(e)[-2000:]})
                    print(f"{label} seed {seed} failed: {str(e)[-500:]}", file=sys.stderr, flush=True)
                    continue
                print(json.dumps({k: r[k] for k in ("label", "seed", "run_s", "published_s")}), file=sys.stderr,
                      flush=True)
                done.append(r)
            if done:
                trained.append((mode, seed, done))
    # every run has ended: each kept version is evaluated alone, with the machine to itself
    print("evaluating the warm start and the kept versions ...", file=sys.stderr, flush=True)
    start_eval = exact_eval(str(a.model), root / "eval-warm-start", a)
    runs: dict[str, list[dict[str, Any]]] = {}
    splits_seen: dict[str, Any] = {}
    for mode, seed, done in trained:
        for r in done:
            try:
                held_out_curve(r, start_eval, a)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failures.append({"label": r["label"], "seed": seed, "error": str(e)[-2000:]})
                r["held_out"], r["time_to_target_s"] = [], None
            print(json.dumps({k: r[k] for k in ("label", "seed", "time_to_target_s", "held_out")}), file=sys.stderr,
                  flush=True)
        best = best_async(done) if mode == "async" else done[0]
        if mode == "async":
            splits_seen[str(seed)] = {r["label"]: r["time_to_target_s"] for r in done}
        runs.setdefault(mode, []).append(best)

    ttt, speedup = times_to_target(runs)
    result: dict[str, Any] = {
        "benchmark": "time_to_reward", "task": "lookup", "seeds": a.seeds, "steps": a.steps, "target": a.target,
        "time_scale": a.time_scale, "staleness": a.staleness, "eval_every": a.eval_every, "harness_timeout_s": timeout_s,
        "job": shape, "warm_start": {**{k: start[k] for k in ("pass_rate", "steps", "hidden", "layers")},
                                    "held_out_exact": start_eval},
        "eval_samples_per_record": a.eval_samples,
        "gyre_burst": {"phi": phi_g, "mu": mu_g}, "async_splits": splits_seen,
        "time_to_target_s": ttt, "speedup_to_target": speedup,
        "run_s": {m: {r["seed"]: r["run_s"] for r in rs} for m, rs in runs.items()},
        "held_out_per_version": {m: [{v: x for v, _, x in r["held_out"]} for r in rs] for m, rs in runs.items()},
        "runs": runs, "failures": failures,
    }
    if "gyre" in runs:
        p = cli("simulate", "--calibrate-from", runs["gyre"][0]["out"], "--modes", ",".join(runs), "--json",
                "--quiet", timeout=600)
        if p.returncode == 0:
            sim = json.loads(p.stdout)
            result["simulated"] = {"calibration": sim["calibration"]["measured"], "speedup": sim["speedup"],
                                   "run_s": {m: r["end_to_end_s"] for m, r in sim["modes"].items()}}
        else:
            result["simulated"] = {"error": p.stderr[-2000:]}
    (root / "time_to_reward.json").write_text(json.dumps(result, indent=1))
    plot(result, root / "time_to_reward.png")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
