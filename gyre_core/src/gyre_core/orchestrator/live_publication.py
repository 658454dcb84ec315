"""The policy the live run's engines serve, and how a new version reaches them.

A publication exports the version from the core (its stages register their parts for the engines
to pull, or write files), loads it on every engine that serves rollouts (cells in rollout and the
standalone pool; an engine being restarted comes back on it), and then lets the core release the
version before it. Every ``checkpoint.hf_interval`` versions it is also kept as a model folder.

:class:`LivePublication` owns the current version, the record of each publication and the kept
folders. It reaches the rest of the run through what it is given: the cells, the proxy (which
stamps calls with the policy version), the journal, and callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

from gyre_core.interfaces import WeightsRef
from gyre_core.orchestrator.hf_folders import model_dtype, prunable_hf, write_hf_folder
from gyre_core.orchestrator.journal import Journal
from gyre_core.orchestrator.live_cells import LiveCells, load_weights_on
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.scheduler import events as ev

__all__ = ["LivePublication"]

log = logging.getLogger("gyre.orchestrator")


class LivePublication:
    """Publishes policy versions to the engines. ``weights`` is the version they serve now;
    ``published(version)`` runs once a version is on every serving engine (held-out evaluation)."""

    def __init__(self, cfg: RunConfig, cells: LiveCells, proxy: Any, weights: WeightsRef, out_dir: Path, *,
                 now: Callable[[], float], emit: Callable[[ev.Event], None], progress: Callable[[str], None],
                 journal: Journal | None, published: Callable[[int], None]) -> None:
        self.cfg = cfg
        self._cells = cells
        self._proxy = proxy
        self.weights = weights
        self.serving_dir = Path(weights.location)
        """The model folder the engines started on (its ``config.json`` is the served model's)."""
        self._out_dir = out_dir
        self._now = now
        self._emit = emit
        self._progress = progress
        self._journal = journal
        self._published = published
        self.watchdog: Any = None
        """The engine watchdog, once attached: a failed load is its to repair, not the run's end."""
        self.in_flight: int | None = None
        """The version being published (the run does not end while one is)."""
        self.records: list[dict[str, Any]] = []
        """Each publication: version, transport, export and load times (the summary's ``publications``)."""
        self.hf_saved: dict[int, Path] = {}
        """Periodic model folders (``checkpoint.hf_interval``) still kept, by step."""

    async def _export(self, version: int) -> WeightsRef:
        """Policy ``version`` where the engines can load it, by the run's transport."""
        return await self._cells.call(0, self._cells[0].training.publish_weights, version)

    async def publish(self, version: int) -> None:
        t0 = self._now()
        ref = await self._export(version)
        previous, self.weights = self.weights, ref
        exported = self._now()
        for engine, handles in self._cells.rollout_engines():
            if self.watchdog is not None and self.watchdog.down(engine):
                continue  # being restarted by the watchdog: it comes back on self.weights
            url = handles.engine_url
            try:
                await load_weights_on(handles.serving, ref)
            except Exception as e:
                # A load that did not take after its retries (or an engine that died meanwhile)
                # is the watchdog's: it takes the engine out of routing now and restarts it on
                # self.weights, the version just published. The run goes on.
                if self.watchdog is None:
                    raise
                self.watchdog.report_failed(engine, url, f"publication of version {version} failed: "
                                                         f"{type(e).__name__}: {str(e)[:200]}")
                log.warning("engine %s did not load version %s; the watchdog restarts it: %s", url, version, e)
        self._proxy.policy_version = version
        # every serving engine holds `version`; a switch back may still read the previous one
        await self._cells.call(0, self._cells[0].training.release_weights_older_than, previous.version)
        self.records.append({"version": version, "transport": self.cfg.publication.transport,
                             "export_s": round(exported - t0, 4), "load_s": round(self._now() - exported, 4),
                             "at_s": round(self._now(), 3)})
        if self._journal is not None:
            self._journal.write("published", version=version, location=ref.location)
        self._progress(f"published policy version {version}")
        self.in_flight = None
        self._emit(ev.PublicationDone(version))
        self._published(version)
        every = self.cfg.checkpoint.hf_interval
        if every > 0 and version % every == 0 and version < self.cfg.run.steps:  # the last: checkpoint/
            dest = self._out_dir / "hf" / f"step{version}"
            if await asyncio.to_thread(self.save_hf, version, dest):
                self.hf_saved[version] = dest
                self._progress(f"saved the policy after step {version} to {dest}")
                for old in prunable_hf(self.hf_saved, self.cfg.checkpoint.hf_keep_last):
                    await asyncio.to_thread(shutil.rmtree, self.hf_saved.pop(old), True)

    def save_hf(self, version: int, dest: Path) -> bool:
        """Write published ``version`` (the current one) as a model folder at ``dest``, in the
        model's own dtype (:mod:`gyre_core.orchestrator.hf_folders`): the core's stages write
        their own weight files. False if the core no longer holds that version."""
        if self.weights.version != version:
            return False
        tokenizer = Path(self.cfg.model.dir) if self.cfg.model.dir else self._out_dir / "tokenizer-src"
        core = self._cells[0].training

        def write(folder: Path) -> None:
            core.write_weights(version, str(folder))

        try:
            write_hf_folder(dest, write, self.serving_dir / "config.json", tokenizer, model_dtype(self.cfg.model.dir))
        except Exception as e:  # noqa: BLE001 - a lost core (a failed run) keeps its earlier folders
            log.warning("policy version %s not saved to %s: %s", version, dest, e)
            return False
        return True
