"""Validated configuration of the scheduler.

Everything is checked in ``__post_init__`` so a bad value fails before any process starts, with
a message that names the field (the CLI prints it as is).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


class Mode(str, enum.Enum):
    """Scheduling mode. All three are the same state machine."""

    GYRE = "gyre"
    ASYNC = "async"
    COLOCATE = "colocate"

    @classmethod
    def parse(cls, value: "str | Mode") -> "Mode":
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ConfigError(f"mode: unknown mode {value!r} (expected one of {allowed})") from None


class ShortGroupRule(str, enum.Enum):
    """What happens to a group that can no longer reach N valid rewards.

    ``filter`` (the default, and the paper's rule): a discarded execution is filtered out of its
    group. The group keeps its identity, slot and admission version, counts once, and is ready when
    its last execution has terminated; its advantages are formed over the valid rewards it holds.
    With fewer than ``min_valid_rewards`` valid rewards (no advantage signal) it is consumed as an
    *empty* group: it still takes its place in a step and counts once, but trains nothing. d(t)
    therefore changes only at publication, and the staleness law E[d] = φ + (μ − 1)/2 holds.

    Two departures from the paper stay available by name:

    ``drop``: the group is dropped and a fresh group replaces it (at once if the burst would
    otherwise starve, else at the next publication). Dropped groups are the slow ones, so measured
    staleness falls below the law, and Colocate waits for every mid-burst replacement.
    ``top_up``: the group keeps its slot and admission version; the missing executions of the same
    query are dispatched at the next publication (or at once if the burst would otherwise starve).
    """

    FILTER = "filter"
    TOP_UP = "top_up"
    DROP = "drop"


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the elastic scheduler (the paper's notation).

    ``async_training_cells`` is Async's fixed training pool (cells 0..m-1); ``streaming`` defaults to
    True for Gyre and False for the baselines (the paper's A0 and C0); ``oversample`` is N' ≥ N
    executions launched per group (None: N' = N).
    """

    mode: Mode = Mode.GYRE
    cells: int = 8  # K
    cell_capacity: int = 144  # C_e
    standalone_capacity: int = 0  # C_s
    group_size: int = 16  # N
    groups_per_step: int = 32  # B
    steps_per_burst: int = 3  # μ
    extra_dispatch: float = 0.5  # φ
    rho_min: float = 0.25
    supply_window_s: float = 60.0  # τ
    oversample: int | None = None  # N'
    async_training_cells: int = 1
    streaming: bool | None = None
    short_group: ShortGroupRule = ShortGroupRule.FILTER
    min_valid_rewards: int | None = None  # None: min(2, N)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        try:
            object.__setattr__(self, "short_group", ShortGroupRule(self.short_group))
        except ValueError:
            raise ConfigError(
                f"short_group: unknown rule {self.short_group!r} (expected filter, top_up or drop)"
            ) from None
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("mode", "short_group", "streaming", "oversample", "min_valid_rewards"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{f.name}: expected a number, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name}: must be finite, got {value!r}")
        for name in ("cells", "cell_capacity", "group_size", "groups_per_step", "steps_per_burst"):
            value = getattr(self, name)
            if not isinstance(value, int):
                raise ConfigError(f"{name}: expected an integer, got {value!r}")
        _require(self.cells >= 1, "cells", "K must be ≥ 1", self.cells)
        _require(self.cell_capacity >= 1, "cell_capacity", "C_e must be > 0", self.cell_capacity)
        _require(
            self.standalone_capacity >= 0 and isinstance(self.standalone_capacity, int),
            "standalone_capacity", "C_s must be an integer ≥ 0", self.standalone_capacity,
        )
        _require(self.group_size >= 1, "group_size", "N must be ≥ 1", self.group_size)
        _require(self.groups_per_step >= 1, "groups_per_step", "B must be ≥ 1", self.groups_per_step)
        _require(self.steps_per_burst >= 1, "steps_per_burst", "μ must be ≥ 1", self.steps_per_burst)
        _require(self.extra_dispatch >= 0, "extra_dispatch", "φ must be ≥ 0", self.extra_dispatch)
        _require(0 < self.rho_min <= 1, "rho_min", "ρ_min must lie in (0, 1]", self.rho_min)
        _require(self.supply_window_s >= 0, "supply_window_s", "τ must be ≥ 0", self.supply_window_s)
        if self.oversample is not None:
            _require(
                isinstance(self.oversample, int) and not isinstance(self.oversample, bool)
                and self.oversample >= self.group_size,
                "oversample", "N' must be an integer ≥ N (group_size)", self.oversample,
            )
        if self.min_valid_rewards is not None:
            _require(
                isinstance(self.min_valid_rewards, int) and not isinstance(self.min_valid_rewards, bool)
                and 1 <= self.min_valid_rewards <= self.group_size,
                "min_valid_rewards", f"must be an integer in 1..N = {self.group_size}", self.min_valid_rewards,
            )
        if self.streaming is not None and not isinstance(self.streaming, bool):
            raise ConfigError(f"streaming: expected true or false, got {self.streaming!r}")
        if self.mode is Mode.ASYNC:
            _require(
                isinstance(self.async_training_cells, int) and 1 <= self.async_training_cells < self.cells,
                "async_training_cells",
                f"Async's training pool must hold 1..K-1 = {self.cells - 1} cells",
                self.async_training_cells,
            )

    # ------------------------------------------------------------------ derived quantities

    @property
    def executions_per_group(self) -> int:
        """N' (executions launched per group), N without oversampling."""
        return self.oversample if self.oversample is not None else self.group_size

    @property
    def min_valid(self) -> int:
        """Valid rewards a filtered group needs to train: below two there is no group baseline."""
        return self.min_valid_rewards if self.min_valid_rewards is not None else min(2, self.group_size)

    @property
    def queue_depth_groups(self) -> int:
        """Q_b = (φ + μ)·B groups, rounded to whole groups."""
        return int(round((self.extra_dispatch + self.steps_per_burst) * self.groups_per_step))

    @property
    def is_streaming(self) -> bool:
        return self.streaming if self.streaming is not None else self.mode is Mode.GYRE

    @property
    def expected_staleness(self) -> float:
        """E[d] = φ + (μ − 1)/2 (the paper's staleness law)."""
        return self.extra_dispatch + (self.steps_per_burst - 1) / 2

    def capacity(self, cells_in_training: int) -> int:
        """C(t) = (K − k(t))·C_e + C_s."""
        return (self.cells - cells_in_training) * self.cell_capacity + self.standalone_capacity


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"{name}: {rule}, got {value!r}")
