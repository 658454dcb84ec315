"""The live run's cells: role switches of real engines and ranks, and where calls are rerouted.

A switch to training reroutes the cell's executions (standalone pool first, then the cells that
stay in rollout longest), hands the running calls' KV to their new engines, then releases the
engine's memory and enters training; a switch back loads the current policy and reopens intake.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gyre_core.interfaces import (
    PhaseTiming,
    ServingSide,
    TrainingSide,
    WeightsRef,
)
from gyre_core.orchestrator.failure import RunFailed
from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Role

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


class CellsMixin:
    """The cell half of :class:`~gyre_core.orchestrator.live.LiveOrchestrator`."""

    async def _cell_call(self, cell: int, fn: Callable[..., Any], *args: Any) -> Any:
        async with self._cell_locks[cell]:
            return await asyncio.to_thread(fn, *args)

    def _record_phases(self, cell: int, transition: str, phases: Sequence[PhaseTiming]) -> None:
        for p in phases:
            self.pm.hook.gyre_on_event(time=self.now(), event=p)
            self._log("phase", p)
        self.role_switches.append({"cell": cell, "transition": transition, "at_s": round(self.now(), 3),
                                   "phases": {p.phase: round(p.duration, 4) for p in phases},
                                   "total_s": round(sum(p.duration for p in phases), 4)})

    async def _to_training(self, cell: int) -> None:
        if self.watchdog is not None:  # an engine being restarted switches once it is back
            await self.watchdog.ready(cell)
        c = self.cells[cell]
        url = c.engine_url
        self._engine_role[cell] = "training"

        async def hand_off(rids: Sequence[str]) -> None:
            """The running calls' KV goes to the engines their executions were just rerouted to;
            each continues there (re-prefilling only when its hand-off could not be done)."""
            await self.proxy.hand_off(url, rids)

        # The proxy stops routing here first, so calls cut short below continue on their new engine.
        self.proxy.reroute(url, self._reroute_destinations())
        phases: list[PhaseTiming] = list(await c.serving.ato_training(hand_off))
        phases += await self._cell_call(cell, c.training.enter_training)
        self._record_phases(cell, "to_training", phases)
        self._set_role(cell, "training")
        self._emit(ev.TransitionDone(cell, Role.TRAINING))

    async def _to_rollout(self, cell: int) -> None:
        c = self.cells[cell]
        phases: list[PhaseTiming] = list(await self._cell_call(cell, c.training.leave_training))
        phases += await c.serving.ato_rollout(self.weights)
        self._engine_role[cell] = "rollout"
        self.proxy.restore_engine(c.engine_url)
        self._record_phases(cell, "to_rollout", phases)
        self._set_role(cell, "rollout")
        self._emit(ev.TransitionDone(cell, Role.ROLLOUT))

    async def _physical_to_training(self, cell: int) -> None:
        """A resumed cell the scheduler has in training: move the fresh cell there (no event)."""
        c = self.cells[cell]
        self._engine_role[cell] = "training"
        self.proxy.reroute(c.engine_url, self._reroute_destinations())
        phases = list(await c.serving.ato_training(lambda rids: None))
        phases += await self._cell_call(cell, c.training.enter_training)
        self._record_phases(cell, "to_training", phases)
        self._set_role(cell, "training")

    def _engine_url(self, engine: int) -> str:
        if engine < 0:
            if self.standalone is None:
                raise RunFailed("standalone engines are not configured in this run")
            return self.standalone.engine_url
        return self.cells[engine].engine_url

    def _reroute_destinations(self) -> list[str]:
        """Where a cell leaving rollout sends its calls: the standalone pool first, then the
        cells still in rollout (the scheduler's Reroute commands pin each execution exactly)."""
        cells = [x.engine_url for x in self.cells if self._engine_role[x.index] == "rollout"]
        return ([self.standalone.engine_url] if self.standalone is not None else []) + cells
