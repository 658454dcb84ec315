"""Benchmark: the paper-122b race (Gyre vs Async vs Colocate) at E[d] ∈ {1, 1.5} and a full-pool
training step of 10, 20 and 40 minutes; wall time of each simulation and the speedups it finds.
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
    for minutes in minutes_list:
        rate = calibrate_cell_rate(workload, base, minutes * 60)
        for staleness in (1.0, 1.5):
            t0 = time.perf_counter()
            r = race(base, workload, SimParams(steps=preset.steps, cell_tokens_per_s=rate),
                     staleness=staleness)
            wall = time.perf_counter() - t0
            summary = r.to_json()
            runs.append({
                "train_minutes": minutes,
                "staleness": staleness,
                "wall_s": round(wall, 2),
                "hours": {m: round(v["end_to_end_s"] / 3600, 2) for m, v in summary["modes"].items()},
                "mean_staleness": {m: v["mean_staleness"] for m, v in summary["modes"].items()},
                "async_training_cells": summary["modes"]["async"].get("async_training_cells"),
                "speedup": summary["speedup"],
            })
            print(json.dumps(runs[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "simulate_paper_122b", "runs": runs}))


if __name__ == "__main__":
    main()
