"""Benchmark: the scheduler's cost per event at 10,000 concurrent executions and K = 64 cells.

Drives the real Scheduler through the simulator with a workload of short, uniform executions so
that the run stays at full concurrency; only time spent inside ``Scheduler.handle`` is counted.
Prints one JSON object.
"""

from __future__ import annotations

import json
import random
import sys
import time

from gyre_core.config import SchedulerConfig
from gyre_core.scheduler import Scheduler
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.engine import SimParams, Simulation
from gyre_core.simulator.workload import ExecutionRecord, GroupDraw


class UniformWorkload:
    def draw_group(self, rng: random.Random, n: int) -> GroupDraw:
        base = rng.uniform(1800, 7200)
        return GroupDraw("q", tuple(
            ExecutionRecord("q", base * rng.uniform(0.5, 1.5), Outcome.COMPLETED, 1000) for _ in range(n)
        ))


def main() -> None:
    cells, capacity = 64, 157  # C(0) = 10,048 concurrent executions
    # Q_b = 3.5 * 180 groups * 16 = 10,080 executions: the rollout pool runs full
    cfg = SchedulerConfig(cells=cells, cell_capacity=capacity, group_size=16, groups_per_step=180,
                          steps_per_burst=3, extra_dispatch=0.5, supply_window_s=60.0)
    spent = 0.0
    calls = 0
    peak = 0
    original = Scheduler.handle

    def timed(self, event, now):  # type: ignore[no-untyped-def]
        nonlocal spent, calls, peak
        t0 = time.perf_counter()
        try:
            return original(self, event, now)
        finally:
            spent += time.perf_counter() - t0
            calls += 1
            peak = max(peak, self.p - self.f)

    Scheduler.handle = timed  # type: ignore[method-assign]
    wall0 = time.perf_counter()
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    # full-pool step ~10 min of simulated time
    result = Simulation(cfg, UniformWorkload(), SimParams(steps=steps, cell_tokens_per_s=180 * 16 * 1000 / (64 * 600))).run()
    wall = time.perf_counter() - wall0
    Scheduler.handle = original  # type: ignore[method-assign]
    print(json.dumps({
        "benchmark": "scheduler_event_cost",
        "cells": cells,
        "capacity": cfg.capacity(0),
        "peak_concurrent_executions": peak,
        "events": calls,
        "executions": result.dispatched,
        "scheduler_s": round(spent, 3),
        "us_per_event": round(1e6 * spent / calls, 2),
        "simulation_wall_s": round(wall, 3),
        "steps": result.steps,
    }))


if __name__ == "__main__":
    main()
