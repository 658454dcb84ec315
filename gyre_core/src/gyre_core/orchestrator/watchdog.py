"""Engine watchdog: notice a rollout engine that died or hangs, move its executions, restart it.

The live driver runs one watchdog task per run. For each cell whose engine serves rollouts it
checks the engine cheaply and often (``alive``: is the process still there, when the launcher can
tell) and health-checks it less often (its serving side's ``ahealth``, SGLang's ``GET
/health_generate``, bounded by ``health_timeout_s``; ``failures`` consecutive failures mean dead).
A dead engine is then, in this order:

1. taken out of routing: ``proxy.reroute(url, <the other rollout engines>)`` pins its executions
   elsewhere, so the proxy's retry of every call that was in flight there (an ``EngineUnreachable``)
   finds its execution already moved and fails over at once -- the harness sees no error;
2. killed for good (a hung engine must not keep calls waiting) and started again through the
   ``restart`` callback (the embedded run: ``gyre_start_engine`` on the initial checkpoint), then
   brought to the current policy version (``orch.weights``) through a fresh serving side;
3. registered with the proxy router under its new URL (a restarted server gets a new port) and
   swapped into the cell (``CellHandles.engine_url`` / ``.serving``); the old slot stays
   registered and never accepts again.

What the scheduler is told: nothing. The scheduler has no "engine died" event, and none is needed:
the cell stays *in rollout* for it while its engine restarts; executions it launches on that cell
meanwhile are pinned to the dead slot, which does not accept, so the proxy routes their calls to
the least-loaded open engine (possibly over its reserved capacity for a while). A role switch or a
publication that needs the engine waits for :meth:`EngineWatchdog.ready`. Only engines in rollout
are watched: one that dies while its cell trains fails the run at the switch back (a clear error).
The standalone pool's engine (engine ``-1``, when ``C_s > 0``) is watched the same way, always (it
never trains); a cell's dead engine sends its executions to the pool first, as a role switch does.
After ``max_restarts`` restarts of one engine the watchdog raises, which fails the run.

A caller may also find an engine failed: a publication whose load did not take after its retries
(:meth:`EngineWatchdog.report_failed`). The engine is then taken out of routing at once and its
watch restarts it exactly as above, so one engine's slow or refused load never ends the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from gyre_core.interfaces import EngineError, ServingOptions

__all__ = ["EngineRestart", "EngineWatchdog", "WatchdogGaveUp"]

log = logging.getLogger("gyre.orchestrator")


class WatchdogGaveUp(RuntimeError):
    """An engine kept dying (or would not start again): the run cannot serve rollouts."""


@dataclass
class EngineRestart:
    """One recovery, for the summary and for tests."""

    cell: int
    old_url: str
    reason: str
    detected_at: float
    moved: int
    """Executions the reroute pinned elsewhere."""
    new_url: str | None = None
    back_at: float | None = None
    weight_version: int | None = None


class EngineWatchdog:
    """Watches the engines of ``orch.cells`` (a :class:`~gyre_core.orchestrator.live.LiveOrchestrator`).

    ``restart(cell)`` kills what is left of the cell's engine and starts a new one on the initial
    checkpoint (version ``initial_version``), returning an object with ``.url``; ``alive(cell)``
    says whether the engine's process still runs (``None``: cannot tell, rely on health checks).
    """

    def __init__(
        self,
        restart: Callable[[int], Awaitable[Any]],
        *,
        alive: Callable[[int], bool | None] | None = None,
        interval_s: float = 0.5,
        health_every_s: float = 5.0,
        health_timeout_s: float = 10.0,
        failures: int = 3,
        max_restarts: int = 2,
        initial_version: int = 0,
        progress: Callable[[str], None] | None = None,
        serving_options: ServingOptions | None = None,
    ) -> None:
        if failures < 1 or interval_s <= 0 or health_every_s <= 0 or health_timeout_s <= 0:
            raise ValueError("watchdog: failures ≥ 1 and positive intervals/timeouts are required")
        self.restart = restart
        self.alive = alive
        self.interval_s = interval_s
        self.health_every_s = health_every_s
        self.health_timeout_s = health_timeout_s
        self.failures = failures
        self.max_restarts = max_restarts
        self.initial_version = initial_version
        self.progress = progress or (lambda msg: None)
        self.serving_options = serving_options or ServingOptions(url="")
        """What a restarted engine's client and serving side need (the run's engine key), at its new URL."""
        self.restarts: list[EngineRestart] = []
        self.orch: Any = None
        self._ready: dict[int, asyncio.Event] = {}
        self._reported: dict[int, EngineRestart] = {}
        """Engines a caller found failed (:meth:`report_failed`), taken down, awaiting restart."""

    # ------------------------------------------------------------------ what the driver uses

    def attach(self, orch: Any) -> "EngineWatchdog":
        """Bind to the orchestrator (before :meth:`run`); every engine starts out up."""
        self.orch = orch
        ids = list(range(len(orch.cells))) + ([-1] if orch.cells.standalone is not None else [])
        self._ready = {i: asyncio.Event() for i in ids}
        for e in self._ready.values():
            e.set()
        return self

    def down(self, cell: int) -> bool:
        """The engine (a cell's, or ``-1``: the standalone pool's) is being replaced right now."""
        return cell in self._ready and not self._ready[cell].is_set()

    async def ready(self, cell: int) -> None:
        """Return once the engine is up (at once, unless it is being restarted)."""
        if cell in self._ready:
            await self._ready[cell].wait()

    async def run(self) -> None:
        """Watch every cell until cancelled; raises :class:`WatchdogGaveUp` to fail the run."""
        if self.orch is None:
            raise RuntimeError("EngineWatchdog.run before attach(orch)")
        await asyncio.gather(*(self._watch(cell) for cell in self._ready))

    # ------------------------------------------------------------------ detection

    def _handles(self, cell: int) -> Any:
        """What holds the engine's URL and serving side: the cell, or the standalone pool."""
        return self.orch.cells.handles_of(cell)

    @staticmethod
    def _name(cell: int) -> str:
        return "the standalone pool" if cell < 0 else f"cell {cell}"

    def _in_rollout(self, cell: int) -> bool:
        return bool(self.orch.cells.serves_rollout(cell))

    async def _healthy(self, cell: int) -> bool:
        """One bounded health check through the cell's serving side (SGLang: ``/health_generate``)."""
        try:
            return bool(await asyncio.wait_for(self._handles(cell).serving.ahealth(), self.health_timeout_s))
        except (EngineError, asyncio.TimeoutError, OSError):
            return False

    async def _watch(self, cell: int) -> None:
        fails = 0
        last_health = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            reported = self._reported.pop(cell, None)
            if reported is not None:  # a caller found it failed and took it down already
                fails = 0
                await self._bring_back(cell, reported)
                last_health = time.monotonic()
                continue
            if not self._in_rollout(cell):
                fails, last_health = 0, time.monotonic()
                continue
            url = self._handles(cell).engine_url
            reason = None
            if self.alive is not None and self.alive(cell) is False:
                reason = "engine process exited"
            elif time.monotonic() - last_health >= self.health_every_s:
                last_health = time.monotonic()
                ok = await self._healthy(cell)
                if not self._in_rollout(cell) or url != self._handles(cell).engine_url:
                    fails = 0  # it changed role meanwhile: that check says nothing
                    continue
                fails = 0 if ok else fails + 1
                if fails >= self.failures:
                    reason = f"{fails} failed health checks"
            if reason is not None:
                fails = 0
                await self._recover(cell, reason)
                last_health = time.monotonic()

    # ------------------------------------------------------------------ recovery

    def report_failed(self, cell: int, url: str, reason: str) -> None:
        """A caller saw the engine at ``url`` fail (a publication's load that never took): take it
        out of routing now and have its watch restart it on the current policy, as if the watch
        had found it dead. Nothing happens if the engine is already being (or has been) replaced;
        raises :class:`WatchdogGaveUp` when it has used up its restarts."""
        if self.down(cell) or self._handles(cell).engine_url != url or cell in self._reported:
            return
        self._reported[cell] = self._take_down(cell, reason)

    async def _recover(self, cell: int, reason: str) -> None:
        await self._bring_back(cell, self._take_down(cell, reason))

    def _take_down(self, cell: int, reason: str) -> EngineRestart:
        """Mark the engine down and move its executions to the engines that serve (synchronous:
        no call can be routed to it once this returns)."""
        orch = self.orch
        c = self._handles(cell)
        name = self._name(cell)
        if sum(1 for r in self.restarts if r.cell == cell) >= self.max_restarts:
            raise WatchdogGaveUp(f"engine of {name} ({c.engine_url}) failed again ({reason}) "
                                 f"after {self.max_restarts} restart(s)")
        self._ready[cell].clear()
        old_url = c.engine_url
        pool = [orch.cells.standalone.engine_url] if cell >= 0 and -1 in self._ready and not self.down(-1) else []
        others = pool + [x.engine_url for x in orch.cells
                         if x.index != cell and self._in_rollout(x.index) and not self.down(x.index)]
        moved = orch.proxy.reroute(old_url, others)
        rec = EngineRestart(cell, old_url, reason, orch.now(), len(moved.moved))
        self.restarts.append(rec)
        msg = (f"engine of {name} at {old_url} is down ({reason}): {len(moved.moved)} execution(s) "
               f"moved to {sorted(set(moved.moved.values())) or 'nowhere yet'}; restarting it")
        log.warning(msg)
        self.progress(msg)
        return rec

    async def _bring_back(self, cell: int, rec: EngineRestart) -> None:
        """Restart the engine, bring it to the current policy and route to it again."""
        orch = self.orch
        c = self._handles(cell)
        name = self._name(cell)
        old_url = rec.old_url
        try:
            engine = await self.restart(cell)
        except Exception as e:
            raise WatchdogGaveUp(f"engine of {name} could not be restarted: {type(e).__name__}: {e}") from e
        new_url = str(engine.url)
        old_slot = orch.proxy.router.slot(old_url)
        options = dataclasses.replace(self.serving_options, url=new_url)
        client = orch.pm.hook.gyre_make_engine_client(url=new_url, options=options)
        serving = orch.pm.hook.gyre_make_serving_side(engine=cell, options=options)
        if client is None or serving is None:
            raise WatchdogGaveUp(f"no plugin makes an engine client / serving side for {new_url}")
        # Bring it to the version the other engines serve; a publication meanwhile skips this cell
        # (it is down) and sets orch.weights first, so loop until the version is stable.
        version = self.initial_version
        while orch.weights.version != version:
            target = orch.weights
            from gyre_core.orchestrator.live_cells import load_weights_on

            await load_weights_on(serving, target)
            version = target.version
        # Register under the new URL (the old slot was taken out of routing by the reroute).
        slot = orch.proxy.router.add_engine(client, kind=old_slot.kind, cell_index=old_slot.cell_index,
                                            capacity=old_slot.capacity)
        c.serving, c.engine_url = serving, new_url
        if not self._in_rollout(cell):  # cannot happen while down (switches wait), but never route to training
            slot.accepting = False
        else:
            orch.proxy.restore_engine(new_url)
        rec.new_url, rec.back_at, rec.weight_version = new_url, orch.now(), version
        self._ready[cell].set()
        msg = (f"engine of {name} back at {new_url} (policy version {version}) "
               f"after {rec.back_at - rec.detected_at:.1f} s")
        log.warning(msg)
        self.progress(msg)
