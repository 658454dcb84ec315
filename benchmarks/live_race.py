"""A live race of Gyre, Async and Colocate on one scaled long-tailed trace, beside the simulator.

Every mode runs ``gyre-orchestrate run`` for real (Megatron ranks, SGLang CPU engines, the TITO
proxy, Mooncake publication) with the ``replay`` harness: each execution replays one recorded
execution of the same trace (``--trace``, or one generated from the paper preset: long-tailed
executions that end in clusters), scaled by ``--time-scale``, with its recorded context scaled by
``--token-scale`` (the tool results grow each replay's context, so a step trains on contexts in
proportion to the recording's: what makes training a real fraction of an execution, as in the
paper's regime), so every mode sees the same groups in the same order. The modes share one target staleness E[d]: Gyre's (φ, μ) comes from the
simulator's burst search on the scaled trace (``simulate --auto-burst``, with ``--step-s`` as the
estimated full-pool step), Async runs every split of its K cells (the best one counts), Colocate
φ = 0, μ = 2·E[d] + 1. Then ``simulate --calibrate-from`` reads the Gyre run (its measured switch,
publication and training times and the groups it replayed) and predicts all three modes: the
predicted speedups are printed beside the live ones.

Times are on the orchestrator's clock from the scheduler's start to the last step's end
(``run_s``; engine start-up, the same in every mode, is left out). Prints one JSON object.

    python benchmarks/live_race.py [--steps 6] [--cells 3] [--staleness 1] [--out runs/race]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIG = """\
[model]
hidden_size = {hidden}
num_layers = {layers}

[scheduler]
cells = {cells}
cell_capacity = {capacity}
standalone_capacity = 0
group_size = {n}
groups_per_step = {b}
rho_min = 0.5
supply_window_s = 0.5

[run]
steps = {steps}
seed = {seed}
max_wall_s = {max_wall}

[task]
name = "digits"

[harness]
kind = "replay"
trace = "{trace}"
time_scale = {scale}
token_scale = {token_scale}
timeout_s = {timeout}
overall_budget_s = {budget}
replay_calls = 2

[serving]
max_total_tokens = {kv_tokens}

[sampling]
temperature = 1.0
max_new_tokens = 16

[metrics]
backends = []
"""


def cli(*args: str, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gyre_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def burst_search(a: Any, trace: Path, root: Path, rho_min: float = 0.5) -> tuple[float, int, dict[str, Any]]:
    """Gyre's (φ, μ) at the target E[d], chosen by simulation on the scaled trace."""
    from gyre_core.simulator.workload import ExecutionRecord, load_trace, with_default_tokens, write_trace

    scaled = root / "trace-scaled.jsonl"
    write_trace([ExecutionRecord(r.query, r.duration_s * a.time_scale, r.outcome, r.tokens)
                 for r in with_default_tokens(load_trace(trace))], scaled)
    p = cli("simulate", "--trace", str(scaled), "--modes", "gyre", "--auto-burst", "--staleness", str(a.staleness),
            "--cells", str(a.cells), "--cell-capacity", str(a.capacity), "--standalone-capacity", "0",
            "--group-size", str(a.n), "--groups-per-step", str(a.b), "--rho-min", str(rho_min), "--tau", "0.5",
            "--train-minutes", str(a.step_s / 60.0), "--publication-s", "0.3", "--steps", str(a.steps),
            "--seed", str(a.seed), "--json", "--quiet", timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"burst search failed: {p.stderr[-2000:]}")
    s = json.loads(p.stdout)
    g = s["modes"]["gyre"]
    return float(g["phi"]), int(g["mu"]), {"searched": s.get("auto_burst", [])}


def run_mode(label: str, config: Path, sets: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    args = ["run", "--config", str(config), "--out", str(out), "--json-summary"]
    for k, v in sets.items():
        args += ["--set", f"{k}={json.dumps(v) if isinstance(v, str) else v}"]
    t0 = time.monotonic()
    p = cli(*args, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{label} run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    s = json.loads(p.stdout.strip().splitlines()[-1])
    recs = s["step_records"]
    ends = [float(r["ended_s"]) for r in recs if "ended_s" in r]
    joins = [j for r in recs for j in r.get("joins", [])]
    return {"phi": sets["scheduler.extra_dispatch"], "mu": sets["scheduler.steps_per_burst"],
            "run_s": round(max(ends), 2) if ends else None, "wall_s": s["wall_s"],
            "process_s": round(time.monotonic() - t0, 1), "steps": s["steps"],
            "mean_staleness": s["mean_staleness"], "role_switches": len(s.get("role_switches", [])),
            "satellite_joins": len(joins), "steps_with_joins": sum(1 for r in recs if r.get("joins")),
            "running_step_joins": len(s.get("running_step_joins", [])),
            "cells_per_step": [r.get("cells") for r in recs], "step_s": [r.get("duration_s") for r in recs],
            "rewards": s["rewards"], "executions": s["executions"], "out": str(out)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="", help="JSON-lines trace (the simulator's format); default: paper preset")
    ap.add_argument("--time-scale", type=float, default=0.004, help="replay seconds per recorded second")
    ap.add_argument("--token-scale", type=float, default=0.004,
                    help="context tokens per recorded token (0.004: ~1.2 k for a 2 h execution); 0: one-line tool results")
    ap.add_argument("--harness-timeout-h", type=float, help="the recording's harness timeout (default 4 h, the preset's)")
    ap.add_argument("--staleness", type=float, default=1.0, help="the common target E[d]")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cells", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=4, help="C_e, executions per cell in rollout")
    ap.add_argument("--n", type=int, default=4, help="executions per group (N)")
    ap.add_argument("--b", type=int, default=4, help="groups per step (B)")
    ap.add_argument("--hidden", type=int, default=256, help="the policy's hidden size (sets the training cost)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=3.0, help="estimated full-pool step, for the burst search")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="gyre,async,colocate")
    ap.add_argument("--max-wall-s", type=float, default=1500.0)
    ap.add_argument("--out", default=f"runs/live-race-{time.strftime('%Y%m%d-%H%M%S')}")
    a = ap.parse_args()
    from gyre_core.scheduler.burst import solve_burst
    from gyre_core.simulator.workload import PAPER_122B, synthesize_trace, write_trace

    root = Path(a.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    trace = Path(a.trace).resolve() if a.trace else root / "trace-paper.jsonl"
    if not a.trace:
        write_trace(synthesize_trace(PAPER_122B, n_queries=64, n_per_query=16, seed=a.seed), trace)
    limit_h = PAPER_122B.harness_timeout_h  # a given trace: the same 4 h limit unless --harness-timeout-h
    if a.harness_timeout_h is not None:
        limit_h = a.harness_timeout_h
    timeout = round(limit_h * 3600 * a.time_scale, 2)
    config = root / "race.toml"
    # each engine's KV pool holds a full cell of replayed contexts at once (a row is at most one
    # 2 048-token micro-step), so a large C_e measures the schedule, not SGLang queueing for KV room
    kv_tokens = max(16384, a.capacity * 2048)
    config.write_text(CONFIG.format(kv_tokens=kv_tokens, hidden=a.hidden, layers=a.layers, cells=a.cells, capacity=a.capacity, n=a.n,
                                    b=a.b, steps=a.steps, seed=a.seed, max_wall=a.max_wall_s, trace=trace,
                                    scale=a.time_scale, token_scale=a.token_scale, timeout=timeout, budget=round(timeout * 1.0625, 2)))
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    phi_g, mu_g, search = burst_search(a, trace, root)
    print(f"burst search: Gyre φ={phi_g:g}, μ={mu_g} at E[d]={a.staleness:g}", file=sys.stderr, flush=True)
    live: dict[str, Any] = {}
    splits: dict[str, Any] = {}
    for mode in modes:
        phi, mu = (phi_g, mu_g) if mode == "gyre" else solve_burst(mode, a.staleness)
        sets = {"scheduler.mode": mode, "scheduler.extra_dispatch": float(phi), "scheduler.steps_per_burst": mu}
        variants = [(mode, sets)] if mode != "async" else [
            (f"async-{m}", {**sets, "scheduler.async_training_cells": m}) for m in range(1, a.cells)]
        for label, s in variants:
            print(f"running {label} (φ={phi:g}, μ={mu}) ...", file=sys.stderr, flush=True)
            r = run_mode(label, config, s, root / label, a.max_wall_s + 300)
            print(f"{label}: {json.dumps({k: r[k] for k in ('run_s', 'steps', 'mean_staleness', 'satellite_joins')})}",
                  file=sys.stderr, flush=True)
            if mode == "async":
                splits[label] = r
            else:
                live[mode] = r
    if splits:
        best = min(splits, key=lambda k: splits[k]["run_s"] or float("inf"))
        live["async"] = {**splits[best], "split": int(best.split("-")[1]),
                         "splits_run_s": {k: v["run_s"] for k, v in splits.items()}}

    def speedups(times: dict[str, float | None]) -> dict[str, float | None]:
        g = times.get("gyre")
        return {f"gyre_vs_{m}": (round(t / g, 3) if t and g else None) for m, t in times.items() if m != "gyre"}

    result: dict[str, Any] = {
        "benchmark": "live_race",
        "job": {"cells": a.cells, "C_e": a.capacity, "N": a.n, "B": a.b, "steps": a.steps, "seed": a.seed,
                "target_staleness": a.staleness, "time_scale": a.time_scale,
                "token_scale": a.token_scale, "trace": str(trace),
                "harness_timeout_s": timeout, "model": {"hidden_size": a.hidden, "num_layers": a.layers},
                "gyre_burst": {"phi": phi_g, "mu": mu_g, **search}},
        "modes": live,
        "speedup_live": speedups({m: r["run_s"] for m, r in live.items()}),
    }
    if "gyre" in live:
        p = cli("simulate", "--calibrate-from", live["gyre"]["out"], "--modes", ",".join(modes), "--json", "--quiet",
                timeout=600)
        if p.returncode != 0:
            result["simulated"] = {"error": p.stderr[-2000:]}
        else:
            sim = json.loads(p.stdout)
            cal = sim["calibration"]
            result["simulated"] = {
                "calibration": cal["measured"], "source": cal["source"],
                "modes": {m: {"run_s": r["end_to_end_s"], "mean_staleness": r["mean_staleness"],
                              **({"split": r["async_training_cells"]} if "async_training_cells" in r else {})}
                          for m, r in sim["modes"].items()},
                "speedup": sim["speedup"]}
            gaps = {}
            for k, v in sim["speedup"].items():
                lv = result["speedup_live"].get(k)
                gaps[k] = round(v / lv - 1.0, 3) if lv else None
            result["simulated"]["speedup_gap"] = gaps
            result["simulated"]["gyre_time_gap"] = cal.get("gap")
        # the fraction the paper's regime is about: a full-pool step against the mean execution
        steps_full = [d for d, c in zip(live["gyre"]["step_s"], live["gyre"]["cells_per_step"])
                      if d and c and len(c) == a.cells]
        result["job"]["measured_step_s"] = [d for d in live["gyre"]["step_s"] if d]
        if steps_full:
            result["job"]["full_pool_step_s"] = round(sum(steps_full) / len(steps_full), 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
