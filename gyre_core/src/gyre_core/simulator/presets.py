"""Named simulation settings (``gyre-orchestrate simulate --preset NAME``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gyre_core.config import ConfigError
from gyre_core.simulator.workload import PAPER_122B, SyntheticParams, SyntheticWorkload, Workload


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    scheduler: dict  # SchedulerConfig fields other than mode, φ, μ
    steps: int
    staleness: float
    full_pool_step_minutes: float
    workload: Callable[[], Workload] = field(repr=False)


PRESETS: dict[str, Preset] = {
    "paper-122b": Preset(
        name="paper-122b",
        description=(
            "The paper's main NL2RepoBench setting (Qwen 3.6 122B): 8 cells, 144 concurrent "
            "executions per cell, no standalone pool, N=16, B=32, 48 steps; synthetic executions "
            "fitted to its Figure 5 statistics. The paper gives no training time per step: the full "
            "8-cell pool trains one step in 20 minutes (override with --train-minutes)."
        ),
        scheduler=dict(cells=8, cell_capacity=144, standalone_capacity=0, group_size=16,
                       groups_per_step=32),
        steps=48,
        staleness=1.5,
        full_pool_step_minutes=20.0,
        workload=lambda: SyntheticWorkload(PAPER_122B),
    ),
    "small": Preset(
        name="small",
        description="A quick demo: 4 cells of 32 executions, N=4, B=8, 12 steps, paper-like durations.",
        scheduler=dict(cells=4, cell_capacity=32, standalone_capacity=0, group_size=4,
                       groups_per_step=8),
        steps=12,
        staleness=1.5,
        full_pool_step_minutes=10.0,
        workload=lambda: SyntheticWorkload(PAPER_122B),
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"preset: unknown preset {name!r} (expected one of {', '.join(PRESETS)})"
        ) from None


__all__ = ["PRESETS", "Preset", "SyntheticParams", "get_preset"]
