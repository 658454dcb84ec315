"""Sticky routing of executions to rollout engines, and rerouting when an engine leaves rollout.

An execution stays on one engine for its whole life (its prefix stays hot in that engine's KV
cache). When a cell switches to training, the orchestrator calls :meth:`EngineRouter.reroute`: the
engine stops taking executions, and each execution on it is moved to a destination with reserved
capacity -- standalone engines first, then rollout cells in descending cell index (they stay in
rollout longest) -- so the retry of an aborted call lands where there is room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from gyre_core.interfaces import EngineClient

__all__ = ["EngineRouter", "EngineSlot", "NoEngineAvailable", "RerouteResult"]


class NoEngineAvailable(RuntimeError):
    """No engine is accepting executions right now."""


@dataclass
class EngineSlot:
    client: EngineClient
    kind: Literal["standalone", "cell"] = "standalone"
    cell_index: int | None = None
    capacity: float = math.inf
    """How many executions may be pinned here (C_e for a cell, C_s share for a standalone)."""
    accepting: bool = True
    executions: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def load(self) -> float:
        return len(self.executions) / self.capacity if self.capacity > 0 else math.inf


@dataclass(frozen=True)
class RerouteResult:
    moved: dict[int, str]
    """Execution id -> the engine URL it now runs on."""
    over_capacity: int
    """Executions placed beyond every destination's reserved capacity (the orchestrator's
    waterlevel rule should keep this at 0)."""


def destination_order(slots: Sequence[EngineSlot]) -> list[EngineSlot]:
    """Standalone engines first (in registration order), then cells by descending index."""
    standalone = [s for s in slots if s.kind == "standalone"]
    cells = sorted((s for s in slots if s.kind == "cell"), key=lambda s: -(s.cell_index or 0))
    return standalone + cells


class EngineRouter:
    """Which engine serves which execution. Single-threaded (the proxy's event loop)."""

    def __init__(self) -> None:
        self._slots: dict[str, EngineSlot] = {}
        self._pinned: dict[int, str] = {}
        self.version = 0
        """Bumped on every move, so a waiting retry can tell that something changed."""

    def add_engine(
        self,
        client: EngineClient,
        *,
        kind: Literal["standalone", "cell"] = "standalone",
        cell_index: int | None = None,
        capacity: float = math.inf,
    ) -> EngineSlot:
        url = client.url
        if url in self._slots:
            raise ValueError(f"engine {url} registered twice")
        if kind == "cell" and cell_index is None:
            raise ValueError(f"engine {url}: a cell engine needs its cell index")
        slot = EngineSlot(client, kind, cell_index, capacity)
        self._slots[url] = slot
        return slot

    def engines(self) -> list[EngineSlot]:
        return list(self._slots.values())

    def slot(self, url: str) -> EngineSlot:
        try:
            return self._slots[url]
        except KeyError:
            raise KeyError(f"unknown engine {url}") from None

    def engine_of(self, execution_id: int) -> str | None:
        return self._pinned.get(execution_id)

    def _pin(self, execution_id: int, slot: EngineSlot) -> None:
        old = self._pinned.get(execution_id)
        if old is not None:
            self._slots[old].executions.discard(execution_id)
        slot.executions.add(execution_id)
        self._pinned[execution_id] = slot.url
        self.version += 1

    def pin(self, execution_id: int, engine_url: str) -> None:
        """Pin an execution to an engine the orchestrator chose (its ``Launch`` / ``Reroute``)."""
        self._pin(execution_id, self.slot(engine_url))

    def assign(self, execution_id: int, *, exclude: frozenset[str] = frozenset()) -> EngineSlot:
        """The execution's engine: its pinned one while that accepts, else the least-loaded one."""
        url = self._pinned.get(execution_id)
        if url is not None and url not in exclude and self._slots[url].accepting:
            return self._slots[url]
        open_slots = [s for s in self._slots.values() if s.accepting and s.url not in exclude]
        if not open_slots:
            raise NoEngineAvailable("no rollout engine is accepting executions")
        best = min(open_slots, key=lambda s: (s.load, len(s.executions)))
        self._pin(execution_id, best)
        return best

    def release(self, execution_id: int) -> None:
        url = self._pinned.pop(execution_id, None)
        if url is not None:
            self._slots[url].executions.discard(execution_id)

    def reroute(self, engine_url: str, destinations: Sequence[str] | None = None) -> RerouteResult:
        """Take ``engine_url`` out of rollout and move its executions (see the module docstring).

        ``destinations`` limits where they may go (default: every other accepting engine); they
        are filled in the fixed destination order up to each one's capacity, and any surplus goes
        to the least-loaded destination (counted in ``over_capacity``).
        """
        source = self.slot(engine_url)
        source.accepting = False
        if destinations is None:
            cands = [s for s in self._slots.values() if s.accepting and s.url != engine_url]
        else:
            cands = [self.slot(u) for u in destinations if u != engine_url]
            cands = [s for s in cands if s.accepting]
        order = destination_order(cands)
        moved: dict[int, str] = {}
        over = 0
        for eid in sorted(source.executions):
            dest = next((s for s in order if len(s.executions) < s.capacity), None)
            if dest is None:
                if not order:
                    break  # nowhere to go: they stay pinned; a retry fails over when one opens
                dest = min(order, key=lambda s: (s.load, len(s.executions)))
                over += 1
            self._pin(eid, dest)
            moved[eid] = dest.url
        return RerouteResult(moved, over)

    def restore(self, engine_url: str) -> None:
        """The engine is back in rollout: it takes new executions again (moved ones stay put)."""
        self.slot(engine_url).accepting = True
        self.version += 1
