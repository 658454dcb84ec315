"""Engine throughput and proxy latency between two metric reports.

The proxy sees every model call end to end, so it is where both are measured: a call's latency
(from its arrival to its answer), the part of it spent waiting on the engine, and the tokens the
engine generated. :meth:`CallStats.drain` turns the calls since the previous drain into the
``engines/`` and ``proxy/`` figures of one step (none at all when no call finished: a window
without calls has no latency, and its throughput is not measured as 0 either).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["CallStats", "LimitEvents"]


def _quantile(sorted_values: list[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


@dataclass
class _Window:
    start: float
    calls: int = 0
    output_tokens: int = 0
    engine_s: float = 0.0


class CallStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._window = _Window(clock())
        self._latency: list[float] = []
        self._overhead: list[float] = []

    def record(self, *, output_tokens: int, call_s: float, engine_s: float) -> None:
        """One finished call: its wall time in the proxy and the part spent in engine calls."""
        with self._lock:
            w = self._window
            w.calls += 1
            w.output_tokens += output_tokens
            w.engine_s += engine_s
            self._latency.append(call_s)
            self._overhead.append(max(0.0, call_s - engine_s))

    def drain(self) -> dict[str, float]:
        """The figures since the previous drain, and a new window."""
        with self._lock:
            now = self._clock()
            w, lat, over = self._window, sorted(self._latency), self._overhead
            self._window, self._latency, self._overhead = _Window(now), [], []
        if not w.calls:
            return {}
        wall = max(1e-9, now - w.start)
        out = {
            "engines/calls": float(w.calls),
            "engines/output_tokens": float(w.output_tokens),
            "engines/output_tokens_per_s": w.output_tokens / wall,
            "proxy/call_latency_mean_s": sum(lat) / len(lat),
            "proxy/call_latency_p50_s": _quantile(lat, 0.5),
            "proxy/call_latency_p95_s": _quantile(lat, 0.95),
            "proxy/overhead_mean_s": sum(over) / len(over),
        }
        if w.engine_s > 0:
            out["engines/tokens_per_engine_s"] = w.output_tokens / w.engine_s
        return out


class LimitEvents:
    """What the proxy's wire limits refused (see :mod:`gyre_core.proxy.http_layer`), counted per
    execution and kind (``body_too_large``, ``connections``, ``calls_in_flight``,
    ``body_bytes_in_flight``, ``body_timeout``), plus the events no execution can be named for
    (``connections_evicted``, ``connections_refused``, ``header_timeouts``, and refusals of
    requests without a valid key). Written on the event loop; read by the orchestrator."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_execution: dict[int, dict[str, int]] = {}
        self._wire: dict[str, int] = {}

    def count(self, execution_id: int | None, kind: str) -> None:
        with self._lock:
            where = self._wire if execution_id is None else self._by_execution.setdefault(execution_id, {})
            where[kind] = where.get(kind, 0) + 1

    def of(self, execution_id: int) -> dict[str, int]:
        """The execution's refusals by kind (empty when it was never over a limit)."""
        with self._lock:
            return dict(self._by_execution.get(execution_id, {}))

    def forget(self, execution_id: int) -> None:
        with self._lock:
            self._by_execution.pop(execution_id, None)

    def summary(self) -> dict[str, object]:
        """Totals by kind, the connection-level events, and the executions that were refused."""
        with self._lock:
            totals: dict[str, int] = {}
            for counts in self._by_execution.values():
                for k, n in counts.items():
                    totals[k] = totals.get(k, 0) + n
            return {"refused": totals, "wire": dict(self._wire),
                    "executions": {e: dict(c) for e, c in sorted(self._by_execution.items())}}
