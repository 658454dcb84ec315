"""A publication whose load does not take on one rollout engine: the watchdog's, not the run's end.

The live run's publication (:class:`LivePublication`) and the real :class:`EngineWatchdog` run
here against stand-ins for the engines (no SGLang process can be made to refuse a load on demand):
one rollout engine never reports the version it was given. The publication must complete on the
others, the failed engine must be taken out of routing at once (its executions moved), restarted,
brought to the version just published and routed to again, and the run is told the publication is
done. With no restart left, the failure is the run's, with the engine named.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gyre_core.interfaces import EngineError, WeightsRef
from gyre_core.orchestrator.live_cells import CellHandles, LiveCells
from gyre_core.orchestrator.live_publication import LivePublication
from gyre_core.orchestrator.watchdog import EngineWatchdog, WatchdogGaveUp
from gyre_core.proxy.routing import EngineRouter
from gyre_core.scheduler import events as ev


class StandInEngineClient:
    def __init__(self, url: str) -> None:
        self.url = url


class StandInServing:
    """Stand-in serving side: loads a version, or (``stuck``) fails every load the way a load
    whose version never shows does after the serving side's retries."""

    def __init__(self, url: str, stuck: bool = False) -> None:
        self.url, self.stuck, self.version = url, stuck, 0
        self.loads: list[int] = []

    async def aload_weights(self, ref: WeightsRef) -> str:
        self.loads.append(ref.version)
        if self.stuck:
            raise EngineError("/model_info", 200, f"engine reports weight_version '{self.version}' after loading {ref.version}")
        self.version = ref.version
        return str(ref.version)

    async def ahealth(self) -> bool:
        return True  # it answers; only its loads fail


class StandInProxy:
    def __init__(self) -> None:
        self.router = EngineRouter()
        self.policy_version = 0

    def reroute(self, url: str, destinations: list[str]) -> Any:
        return self.router.reroute(url, destinations)

    def restore_engine(self, url: str) -> None:
        self.router.restore(url)


class StandInCoreTraining:
    """The core's training side as a publication uses it: it exports a version (a reference
    handed over as is) and releases the ones before, which it records."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def publish_weights(self, version: int) -> WeightsRef:
        return WeightsRef(version, f"v{version}")

    def release_weights_older_than(self, version: int) -> None:
        self.released.append(version)


class StandInOrchestrator:
    """Just what the watchdog reads of the live driver, around a real :class:`LiveCells` and
    :class:`LivePublication`: cells 1 and 2 serve rollouts, the core (cell 0) trains."""

    def __init__(self, stuck_cell: int) -> None:
        self.t0 = time.monotonic()
        self.proxy = StandInProxy()
        handles = []
        for i in range(3):
            url = f"http://engine{i}"
            self.proxy.router.add_engine(StandInEngineClient(url), kind="cell", cell_index=i, capacity=4)  # type: ignore[arg-type]
            training = StandInCoreTraining() if i == 0 else None
            handles.append(CellHandles(i, StandInServing(url, stuck=i == stuck_cell), training, url))  # type: ignore[arg-type]
        self.events: list[Any] = []
        self.cells = LiveCells(handles, None, proxy=self.proxy, now=self.now, emit=self._emit, record=lambda p: None)
        self.cells.route_away(0)  # the core trains
        self.messages: list[str] = []
        self.started: list[str] = []
        cfg = SimpleNamespace(checkpoint=SimpleNamespace(hf_interval=0), run=SimpleNamespace(steps=3),
                              publication=SimpleNamespace(transport="mooncake"))
        self.publication = LivePublication(cfg, self.cells, self.proxy, WeightsRef(1, "v1"), Path("."),  # type: ignore[arg-type]
                                           now=self.now, emit=self._emit, progress=self.progress, journal=None,
                                           published=lambda version: None)
        self.publication.in_flight = 2

        def make_serving(engine: int, options: Any) -> StandInServing:
            return StandInServing(options.url)

        self.pm = SimpleNamespace(hook=SimpleNamespace(
            gyre_make_engine_client=lambda url, options: StandInEngineClient(url),
            gyre_make_serving_side=make_serving))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def progress(self, msg: str) -> None:
        self.messages.append(msg)

    def _emit(self, event: Any) -> None:
        self.events.append(event)

    @property
    def weights(self) -> WeightsRef:
        return self.publication.weights


def _watchdog(orch: StandInOrchestrator, max_restarts: int = 2) -> EngineWatchdog:
    async def restart(cell: int) -> Any:
        await asyncio.sleep(0.05)  # the engine's start
        orch.started.append(f"http://engine{cell}-restarted")
        return SimpleNamespace(url=f"http://engine{cell}-restarted")

    # health checks far apart: only the publication's report can find the engine failed here
    return EngineWatchdog(restart, interval_s=0.02, health_every_s=3600.0, max_restarts=max_restarts,
                          initial_version=0, progress=orch.progress).attach(orch)


def test_a_load_that_does_not_take_restarts_the_engine_and_the_run_goes_on() -> None:
    orch = StandInOrchestrator(stuck_cell=2)
    for eid in (7, 8):
        orch.proxy.router.pin(eid, "http://engine2")

    async def scenario() -> None:
        orch.watchdog = orch.publication.watchdog = _watchdog(orch)
        watch = asyncio.ensure_future(orch.watchdog.run())
        try:
            await orch.publication.publish(2)
            # the publication completed without the failed engine, which left routing at once
            assert orch.events == [ev.PublicationDone(2)] and orch.publication.in_flight is None
            assert orch.publication.records[-1]["version"] == 2 and orch.proxy.policy_version == 2
            assert orch.cells[1].serving.version == 2  # type: ignore[attr-defined]
            assert orch.cells[0].training.released == [1]  # type: ignore[attr-defined] # the one before stays
            assert orch.watchdog.down(2)
            assert not orch.proxy.router.slot("http://engine2").accepting
            assert {orch.proxy.router.engine_of(e) for e in (7, 8)} == {"http://engine1"}
            await asyncio.wait_for(orch.watchdog.ready(2), 5.0)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(scenario())
    (rec,) = orch.watchdog.restarts
    assert rec.cell == 2 and "publication of version 2 failed" in rec.reason and rec.moved == 2
    # back on the version just published, under its new URL, routed to again
    assert rec.weight_version == 2 and rec.new_url == "http://engine2-restarted" == orch.cells[2].engine_url
    assert orch.cells[2].serving.version == 2  # type: ignore[attr-defined]
    assert orch.proxy.router.slot("http://engine2-restarted").accepting
    assert not orch.proxy.router.slot("http://engine2").accepting
    assert orch.started == ["http://engine2-restarted"]


def test_with_no_restart_left_the_failure_is_the_runs_and_names_the_engine() -> None:
    orch = StandInOrchestrator(stuck_cell=1)

    async def scenario() -> None:
        orch.publication.watchdog = _watchdog(orch, max_restarts=0)
        await orch.publication.publish(2)

    with pytest.raises(WatchdogGaveUp, match=r"engine of cell 1 \(http://engine1\) failed again "
                                             r"\(publication of version 2 failed"):
        asyncio.run(scenario())
    assert orch.events == []  # the publication is not reported done


def test_without_a_watchdog_the_load_error_ends_the_publication() -> None:
    orch = StandInOrchestrator(stuck_cell=1)
    assert orch.publication.watchdog is None
    with pytest.raises(EngineError, match="after loading 2"):
        asyncio.run(orch.publication.publish(2))
