"""Which recorded execution each live execution replays (``harness.kind = "replay"``).

A group draws one query of the trace, as the simulator does (:class:`~gyre_core.simulator.
workload.TraceWorkload`, seeded by the run's seed and the group id, so a resumed run replays the
same); its executions take that query's recorded executions in order, and a refill takes one more
draw of the same query. Durations are scaled by ``harness.time_scale`` and context tokens (the
trace's ``tokens``, or ones filled in proportion to duration) by ``harness.token_scale``. Without a
trace the run replays one synthesised from the paper preset: long-tailed executions that end in
clusters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from gyre_core.simulator.workload import ExecutionRecord, TraceWorkload, load_trace, with_default_tokens

__all__ = ["ReplayPlan", "ScaledRecord"]


@dataclass(frozen=True)
class ScaledRecord:
    query: str
    duration_s: float
    """Scaled: what the replay takes."""
    outcome: str
    recorded_s: float
    context_tokens: int = 0
    """Scaled: the context the replay's last call should hold (0: short tool results)."""

    def as_extra(self) -> dict[str, Any]:
        return {"query": self.query, "duration_s": self.duration_s, "outcome": self.outcome,
                "recorded_s": self.recorded_s, "context_tokens": self.context_tokens}


class ReplayPlan:
    def __init__(self, records: list[ExecutionRecord], time_scale: float, seed: int, token_scale: float = 0.0) -> None:
        self.workload = TraceWorkload(with_default_tokens(records))
        self.time_scale, self.seed, self.token_scale = time_scale, seed, token_scale
        self._groups: dict[int, tuple[str, list[ExecutionRecord]]] = {}

    @classmethod
    def from_config(cls, trace: str, time_scale: float, seed: int, token_scale: float = 0.0) -> "ReplayPlan":
        if trace:
            records = load_trace(trace)
        else:
            from gyre_core.simulator.workload import PAPER_122B, synthesize_trace

            records = synthesize_trace(PAPER_122B, n_queries=64, n_per_query=16, seed=seed)
        return cls(records, time_scale, seed, token_scale)

    def record(self, group_id: int, index: int, group_size: int) -> ScaledRecord:
        """The ``index``-th execution of group ``group_id``, a group of ``group_size`` executions
        as dispatched (indices past it are refills)."""
        if group_id not in self._groups:
            draw = self.workload.draw_group(random.Random(self.seed * 1_000_003 + group_id), group_size)
            self._groups[group_id] = (draw.query, list(draw.executions))
        query, chosen = self._groups[group_id]
        while index >= len(chosen):  # a refill: one more execution of the same query
            pool = self.workload.by_query[query]
            chosen.append(random.Random(self.seed * 7_919 + group_id * 613 + len(chosen)).choice(pool))
        r = chosen[index]
        tokens = round((r.tokens or 0) * self.token_scale)
        return ScaledRecord(query, r.duration_s * self.time_scale, r.outcome.value, r.duration_s, tokens)
