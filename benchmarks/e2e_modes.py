"""The same small live job in Gyre, Async and Colocate modes: end-to-end time and staleness.

Issue 7 §6. One job (seed, steps, N, B, K = 2 cells, the built-in number-guess task, real
Megatron ranks, real SGLang CPU engines, the TITO proxy, one harness process per execution) is run
with ``run_live`` once per mode. Each mode uses the scheduler's own (φ, μ) for one common target
mean staleness E[d] (:func:`~gyre_core.scheduler.burst.solve_burst`, as ``gyre-orchestrate
simulate`` picks them): Async μ = 1, φ = E[d]; Colocate φ = 0, μ = 2·E[d] + 1; Gyre φ = min(0.5,
E[d]) and the longest burst the rest allows. The default step count (6) is a multiple of every
mode's μ at E[d] = 1, so each run ends on a burst boundary.

Each mode runs in its own child process (its own engines, ranks and ports; a world's bookkeeping
never leaks into the next mode). Times come from the run's event log, on the orchestrator's clock
(t = 0 when the scheduler starts, after the engines are up), so start-up -- identical work in every
mode and the noisiest part here -- is reported separately (``wall_s`` includes it, ``run_s`` does
not). Absolute times are noisy on a shared 2-core machine: compare the ratios.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("gyre", "async", "colocate")


def mode_overrides(mode: str, target: float, args: argparse.Namespace) -> dict[str, Any]:
    """The run-config overrides of ``mode``: the common job plus the mode's own (φ, μ)."""
    from gyre_core.scheduler.burst import solve_burst

    phi, mu = solve_burst(mode, target)
    o: dict[str, Any] = {
        "scheduler.mode": mode, "scheduler.extra_dispatch": float(phi), "scheduler.steps_per_burst": mu,
        "scheduler.cells": args.cells, "scheduler.group_size": args.n, "scheduler.groups_per_step": args.b,
        "run.steps": args.steps, "run.seed": args.seed, "run.max_wall_s": float(args.max_wall_s),
    }
    if mode == "async":
        o["scheduler.async_training_cells"] = 1
    return o


def _child(mode: str, overrides_json: str, out: str, result: str) -> int:
    """Run one mode in this process and write its summary to ``result``."""
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config

    overrides = {**json.loads(overrides_json), "run.out_dir": out}
    cfg = load_run_config(None, overrides)
    summary = run_live(cfg, progress=lambda m: print(f"[{mode}] {m}", file=sys.stderr, flush=True))
    Path(result).write_text(json.dumps(summary))
    return 0


def timings(event_log: Path, steps: int) -> dict[str, Any]:
    """Time to the first finished step, the run's end (the last step's end), and the mean
    interval between finished steps, all on the orchestrator's clock."""
    done: list[float] = []
    for line in event_log.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "MicroStepsDone":
            done.append(float(rec["t"]))
    done = done[:steps]
    if not done:
        return {"first_step_s": None, "run_s": None, "mean_step_interval_s": None}
    interval = (done[-1] - done[0]) / (len(done) - 1) if len(done) > 1 else None
    return {"first_step_s": round(done[0], 2), "run_s": round(done[-1], 2),
            "mean_step_interval_s": None if interval is None else round(interval, 2)}


def run_mode(mode: str, target: float, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    overrides = mode_overrides(mode, target, args)
    out, result = root / mode, root / f"{mode}.json"
    cmd = [sys.executable, __file__, "--child", mode, "--overrides", json.dumps(overrides),
           "--out", str(out), "--result", str(result)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None if args.verbose else subprocess.PIPE,
                          text=True, timeout=args.max_wall_s + 300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr or "")[-3000:]
        raise RuntimeError(f"{mode} run failed (exit {proc.returncode}):\n{tail}")
    s = json.loads(result.read_text())
    switches = s.get("role_switches", [])
    return {
        "phi": overrides["scheduler.extra_dispatch"], "mu": overrides["scheduler.steps_per_burst"],
        "steps": s["steps"], "wall_s": s["wall_s"], "process_s": round(time.monotonic() - t0, 2),
        **timings(Path(s["event_log"]), args.steps),
        "mean_staleness": s["mean_staleness"],
        "staleness_per_step": [r["staleness"] for r in s["step_records"]],
        "cells_per_step": [r["cells"] for r in s["step_records"]],
        "rewards": s["rewards"],
        "role_switches": len(switches),
        "role_switches_by_cell": {str(c): sum(1 for x in switches if x["cell"] == c) for c in range(args.cells)},
        "role_switch_s": round(sum(x["total_s"] for x in switches), 3),
        "executions": s["executions"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--staleness", type=float, default=1.0, help="the common target E[d]")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cells", type=int, default=2)
    ap.add_argument("--n", type=int, default=4, help="executions per group (N)")
    ap.add_argument("--b", type=int, default=2, help="groups per step (B)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-wall-s", type=float, default=1200.0)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--verbose", action="store_true", help="show the runs' progress on stderr")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a.child, a.overrides, a.out, a.result)

    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="gyre-e2e-modes-") as tmp:
        root = Path(a.out) if a.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        per_mode: dict[str, Any] = {}
        for mode in modes:
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            per_mode[mode] = run_mode(mode, a.staleness, a, root)
            print(f"{mode}: {json.dumps({k: per_mode[mode][k] for k in ('run_s', 'wall_s', 'mean_staleness')})}",
                  file=sys.stderr, flush=True)

    def ratio(mode: str, key: str) -> float | None:
        if "gyre" not in per_mode or mode not in per_mode:
            return None
        x, g = per_mode[mode][key], per_mode["gyre"][key]
        return round(x / g, 3) if x is not None and g else None

    result = {
        "job": {"cells": a.cells, "N": a.n, "B": a.b, "steps": a.steps, "seed": a.seed, "task": "number-guess",
                "target_staleness": a.staleness,
                "burst_rule": "gyre_core.scheduler.burst.solve_burst(mode, target): async μ=1, colocate φ=0, gyre φ=min(0.5, E[d])"},
        "modes": per_mode,
        "ratios_vs_gyre": {
            f"{m}/gyre": {"run_s": ratio(m, "run_s"), "wall_s": ratio(m, "wall_s"),
                          "mean_step_interval_s": ratio(m, "mean_step_interval_s")}
            for m in modes if m != "gyre"
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
