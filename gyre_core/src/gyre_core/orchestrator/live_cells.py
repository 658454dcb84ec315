"""The live run's cells: which role each engine serves, the role switches, and the role timeline.

A switch to training reroutes the cell's executions (standalone pool first, then the cells that
stay in rollout longest), hands the running calls' KV to their new engines, then releases the
engine's memory and enters training; a switch back loads the current policy and reopens intake.

:class:`LiveCells` owns this state. It reaches the rest of the run only through what it is
given: the proxy (routing and KV hand-off), the clock, and two callbacks (``emit`` a scheduler
event, ``record`` a phase for the observers and the event log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

from gyre_core.interfaces import (
    PhaseTiming,
    ServingSide,
    TrainingSide,
    WeightsRef,
)
from gyre_core.orchestrator.failure import RunFailed
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Role

__all__ = ["CellHandles", "LiveCells", "StandaloneHandles", "load_weights_on"]

log = logging.getLogger("gyre.orchestrator")


@dataclass
class CellHandles:
    """One cell's two halves and its engine's URL (what the proxy routes to)."""

    index: int
    serving: ServingSide
    training: TrainingSide
    engine_url: str


@dataclass
class StandaloneHandles:
    """The standalone rollout pool (``C_s > 0``): one engine that serves all ``C_s`` slots, is
    routed to like a cell's and never switches role; it loads every published version."""

    serving: ServingSide
    engine_url: str


async def load_weights_on(serving: ServingSide, ref: WeightsRef) -> None:
    """Have one serving side load ``ref``."""
    await serving.aload_weights(ref)


class LiveCells:
    """The run's cells (``cells[0]`` is the core) and its standalone pool.

    Two views of a cell's role are kept apart: the *engine's* (does the proxy route calls to it:
    it stops the moment a switch to training begins, and starts again only once a switch back has
    loaded the current policy) and the *timeline's* (``rollout``, ``to_training``, ``training``,
    ``to_rollout``: what the summary and the role-timeline picture show)."""

    def __init__(self, cells: Sequence[CellHandles], standalone: StandaloneHandles | None, *, proxy: Any,
                 now: Callable[[], float], emit: Callable[[ev.Event], None],
                 record: Callable[[PhaseTiming], None]) -> None:
        self._cells = list(cells)
        self.standalone = standalone
        self._proxy = proxy
        self._now = now
        self._emit = emit
        self._record = record
        self.wait_ready: Callable[[int], Awaitable[None]] | None = None
        """The engine watchdog's ``ready`` once one is attached: a switch waits for an engine
        being restarted."""
        self._locks = [asyncio.Lock() for _ in self._cells]
        self._engine_role = ["rollout"] * len(self._cells)
        self._since: list[tuple[str, float]] = [("rollout", 0.0)] * len(self._cells)
        self.role_intervals: list[tuple[int, str, float, float]] = []
        """``(cell, role, from_s, to_s)`` for the role-timeline picture."""
        self.role_switches: list[dict[str, Any]] = []
        """Each completed switch with its phases' durations (the summary's ``role_switches``)."""

    # ------------------------------------------------------------------ the cells themselves

    def __getitem__(self, cell: int) -> CellHandles:
        return self._cells[cell]

    def __len__(self) -> int:
        return len(self._cells)

    def __iter__(self) -> Iterator[CellHandles]:
        return iter(self._cells)

    def handles_of(self, engine: int) -> CellHandles | StandaloneHandles:
        """A cell's handles, or (``engine < 0``) the standalone pool's."""
        if engine < 0:
            if self.standalone is None:
                raise RunFailed("standalone engines are not configured in this run")
            return self.standalone
        return self._cells[engine]

    def engine_url(self, engine: int) -> str:
        return self.handles_of(engine).engine_url

    async def call(self, cell: int, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking call on the cell's training side, one at a time per cell, in a thread."""
        async with self._locks[cell]:
            return await asyncio.to_thread(fn, *args)

    @contextlib.asynccontextmanager
    async def all_held(self) -> AsyncIterator[None]:
        """No cell's training side is called meanwhile (e.g. while every rank is restarted)."""
        for lock in self._locks:
            await lock.acquire()
        try:
            yield
        finally:
            for lock in self._locks:
                lock.release()

    # ------------------------------------------------------------------ roles

    def serves_rollout(self, engine: int) -> bool:
        """The engine takes calls (the standalone pool always does)."""
        return engine < 0 or self._engine_role[engine] == "rollout"

    def rollout_engines(self) -> list[tuple[int, CellHandles | StandaloneHandles]]:
        """Every engine that serves rollouts now, with its index (``-1``: the standalone pool)."""
        out: list[tuple[int, CellHandles | StandaloneHandles]] = [
            (c.index, c) for c in self._cells if self.serves_rollout(c.index)]
        return out + ([(-1, self.standalone)] if self.standalone is not None else [])

    def role(self, cell: int) -> str:
        """The cell's role on the timeline (``rollout``, ``to_training``, ``training``, ``to_rollout``)."""
        return self._since[cell][0]

    def roles(self) -> list[str]:
        return [role for role, _ in self._since]

    def set_role(self, cell: int, role: str) -> None:
        prev, since = self._since[cell]
        now = self._now()
        if now > since:
            self.role_intervals.append((cell, prev, since, now))
        self._since[cell] = (role, now)

    def close_timeline(self) -> None:
        """The run ended: every cell's current role lasted until now."""
        now = self._now()
        for cell, (role, since) in enumerate(self._since):
            if now > since:
                self.role_intervals.append((cell, role, since, now))

    def _reroute_destinations(self) -> list[str]:
        """Where a cell leaving rollout sends its calls: the standalone pool first, then the
        cells still in rollout (the scheduler's Reroute commands pin each execution exactly)."""
        engines = self.rollout_engines()
        return [h.engine_url for e, h in engines if e < 0] + [h.engine_url for e, h in engines if e >= 0]

    def route_away(self, cell: int) -> None:
        """The cell's engine stops taking calls; its executions move to the engines that serve."""
        self._engine_role[cell] = "training"
        self._proxy.reroute(self._cells[cell].engine_url, self._reroute_destinations())

    def _record_phases(self, cell: int, transition: str, phases: Sequence[PhaseTiming]) -> None:
        for p in phases:
            self._record(p)
        self.role_switches.append({"cell": cell, "transition": transition, "at_s": round(self._now(), 3),
                                   "phases": {p.phase: round(p.duration, 4) for p in phases},
                                   "total_s": round(sum(p.duration for p in phases), 4)})

    # ------------------------------------------------------------------ switches

    async def to_training(self, cell: int) -> None:
        if self.wait_ready is not None:  # an engine being restarted switches once it is back
            await self.wait_ready(cell)
        c = self._cells[cell]
        url = c.engine_url

        async def hand_off(rids: Sequence[str]) -> None:
            """The running calls' KV goes to the engines their executions were just rerouted to;
            each continues there (re-prefilling only when its hand-off could not be done)."""
            await self._proxy.hand_off(url, rids)

        # The proxy stops routing here first, so calls cut short below continue on their new engine.
        self.route_away(cell)
        phases: list[PhaseTiming] = list(await c.serving.ato_training(hand_off))
        phases += await self.call(cell, c.training.enter_training)
        self._record_phases(cell, "to_training", phases)
        self.set_role(cell, "training")
        self._emit(ev.TransitionDone(cell, Role.TRAINING))

    async def to_rollout(self, cell: int, weights: WeightsRef) -> None:
        """Back to serving, on ``weights`` (the policy published last)."""
        c = self._cells[cell]
        phases: list[PhaseTiming] = list(await self.call(cell, c.training.leave_training))
        phases += await c.serving.ato_rollout(weights)
        self._engine_role[cell] = "rollout"
        self._proxy.restore_engine(c.engine_url)
        self._record_phases(cell, "to_rollout", phases)
        self.set_role(cell, "rollout")
        self._emit(ev.TransitionDone(cell, Role.ROLLOUT))

    async def resume_in_training(self, cell: int) -> None:
        """A resumed cell the scheduler has in training: move the fresh cell there (no event)."""
        c = self._cells[cell]
        self.route_away(cell)
        phases = list(await c.serving.ato_training(lambda rids: None))
        phases += await self.call(cell, c.training.enter_training)
        self._record_phases(cell, "to_training", phases)
        self.set_role(cell, "training")
