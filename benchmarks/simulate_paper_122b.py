"""Benchmark: the paper-122b race (Gyre vs Async vs Colocate) at E[d] ∈ {1, 1.5} and a full-pool
training step of 10, 20 and 40 minutes, over seeds 0-2 (one seed's trace is noisy: its heavy tail
moves end-to-end times by ±10%); wall time of each race, the speedups it finds, and each mode's
measured mean staleness next to the law φ + (μ − 1)/2 (``max_staleness_error``).
Prints one JSON object (a few minutes on 2 cores; pass a subset of minutes as arguments).
"""

from __future__ import annotations

import json
import sys
import time

from gyre_core.config import SchedulerConfig
from gyre_core.simulator.engine import SimParams
from gyre_core.simulator.presets import get_preset
from gyre_core.simulator.race import calibrate_cell_rate, race


def main() -> None:
    minutes_list = [float(a) for a in sys.argv[1:]] or [10.0, 20.0, 40.0]
    preset = get_preset("paper-122b")
    workload = preset.workload()
    base = SchedulerConfig(**preset.scheduler)
    runs = []
    seeds = (0, 1, 2)
    for minutes in minutes_list:
        rate = calibrate_cell_rate(workload, base, minutes * 60)
        for staleness in (1.0, 1.5):
            per_seed = []
            for seed in seeds:
                t0 = time.perf_counter()
                r = race(base, workload, SimParams(steps=preset.steps, seed=seed, cell_tokens_per_s=rate),
                         staleness=staleness)
                summary = r.to_json()
                per_seed.append({
                    "seed": seed,
                    "wall_s": round(time.perf_counter() - t0, 2),
                    "hours": {m: round(v["end_to_end_s"] / 3600, 2) for m, v in summary["modes"].items()},
                    "mean_staleness": {m: v["mean_staleness"] for m, v in summary["modes"].items()},
                    "law": {m: v["phi"] + (v["mu"] - 1) / 2 for m, v in summary["modes"].items()},
                    "async_training_cells": summary["modes"]["async"].get("async_training_cells"),
                    "speedup": summary["speedup"],
                })
            mean = {k: round(sum(p["speedup"][k] for p in per_seed) / len(per_seed), 3)
                    for k in per_seed[0]["speedup"]}
            modes = per_seed[0]["hours"]
            mean_hours = {m: round(sum(p["hours"][m] for p in per_seed) / len(per_seed), 2) for m in modes}
            mean_st = {m: round(sum(p["mean_staleness"][m] for p in per_seed) / len(per_seed), 4) for m in modes}
            error = max(abs(p["mean_staleness"][m] - p["law"][m]) for p in per_seed for m in modes)
            row = {"train_minutes": minutes, "staleness": staleness, "mean_speedup": mean,
                   "mean_hours": mean_hours, "mean_staleness": mean_st, "max_staleness_error": round(error, 4)}
            runs.append({**row, "seeds": per_seed})
            print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"benchmark": "simulate_paper_122b", "runs": runs}))


if __name__ == "__main__":
    main()
