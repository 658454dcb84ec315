"""The live run's training steps and publications.

A step trains on the groups the scheduler assigns to it as they arrive (streaming packing),
satellites join it mid-way, and its end publishes the new policy version to every engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gyre_core.dataplane.packing import StreamPackingBuffer
from gyre_core.interfaces import WeightsRef
from gyre_core.metrics import step_metrics
from gyre_core.orchestrator.live_cells import load_weights_on
from gyre_core.orchestrator.training_figures import training_figures
from gyre_core.scheduler import events as ev

log = logging.getLogger("gyre.orchestrator")


@dataclass
class _Step:
    step: int
    packing: StreamPackingBuffer
    cells: list[int]
    groups: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    started: float = 0.0
    closing: bool = False


def _joins(satellites: Sequence[tuple[int, Sequence[Mapping[str, Any]]]]) -> list[dict[str, Any]]:
    """Per satellite rank that joined the step: where it pulled the core's weights from, how much
    and how fast (a rank already at the step's version pulls nothing)."""
    return [{"cell": cell, "stage": i.get("stage", 0), "pull_from": i.get("pull_from"),
             "pull_bytes": i.get("pull_bytes", 0), "pull_s": round(float(i.get("pull_s", 0.0)), 4)}
            for cell, infos in satellites for i in infos if i.get("joined")]


class StepsMixin:
    """The training-step half of :class:`~gyre_core.orchestrator.live.LiveOrchestrator`."""

    def _start_step(self, cmd: ev.StartStep) -> None:
        core = self.cells[0].training
        queue = core.micro_step_queue(cmd.step)  # type: ignore[attr-defined]
        packing = StreamPackingBuffer(cmd.step, self.buffer, queue, self.packing_cfg, self.cfg.scheduler.groups_per_step)
        self._steps[cmd.step] = _Step(cmd.step, packing, list(cmd.cells), started=self.now())
        self.progress(f"step {cmd.step}: training on cells {list(cmd.cells)}")
        for cell in cmd.cells:
            fn = self.cells[cell].training.start_step if cell == 0 else self.cells[cell].training.join_step
            self._spawn(self._cell_call(cell, fn, cmd.step), f"cell {cell} starting step {cmd.step}")

    async def _finish_step(self, st: _Step) -> None:
        # Wait for every cell that trained in the step; the core last (it applies the update).
        for cell in sorted(st.cells, reverse=True):
            await self._cell_call(cell, self.cells[cell].training.close_stream, st.step)
        save = getattr(self.cells[0].training, "save_checkpoint", None)
        if save is not None and self.journal is not None:
            path = str(self.out_dir / "checkpoints" / f"step{st.step}")
            (self.out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            await self._cell_call(0, save, path)
            self.journal.write("checkpoint", step=st.step, path=path)
        for g in st.groups:
            self._account_group(g, "trained", from_fates=("assigned",))
        rewards = [self._execs[e].reward for g in st.groups for e in self._group_members(g)
                   if self._execs[e].reward is not None and self._execs[e].fate == "trained"]
        rec = {"step": st.step, "groups": list(st.groups), "staleness": list(st.staleness),
               "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
               "executions": len(rewards), "cells": sorted(set(st.cells)),
               "duration_s": round(self.now() - st.started, 3), "micro_steps": st.packing.micro_steps,
               "split_executions": st.packing.split_executions,
               "joins": _joins([(c, getattr(self.cells[c].training, "last_step_info", [])) for c in sorted(set(st.cells)) if c]),
               **training_figures([getattr(self.cells[c].training, "last_step_info", []) for c in sorted(set(st.cells))])}
        self.step_records.append(rec)
        self._report_metrics(rec)
        if self.event_log is not None:
            self.event_log.write(json.dumps({"t": round(self.now(), 3), "step_done": st.step, **rec}) + "\n")
            self.event_log.flush()
        self.progress(f"step {st.step} done in {rec['duration_s']:.1f} s: mean reward {rec['mean_reward']}, "
                      f"staleness {st.staleness}, loss {rec['loss']}, grad norm {rec['grad_norm']}, "
                      f"clipped {rec['clip_fraction']}, ratio mean/max {rec['ratio_mean']}/{rec['ratio_max']}, "
                      f"{rec['tokens']} tokens")
        del self._steps[st.step]
        self._emit(ev.MicroStepsDone(st.step))

    def _report_metrics(self, rec: dict[str, Any]) -> None:
        """The step's figures to the ``gyre_on_metrics`` observers (TensorBoard, W&B, plugins)."""
        mark = getattr(self, "_metrics_switch_mark", 0)
        metrics = step_metrics(rec, executions=self.executions_summary(), switches=self.role_switches[mark:],
                               interrupted_calls=self._interrupted_calls(),
                               publication=self.publications[-1] if self.publications else None)
        self._metrics_switch_mark = len(self.role_switches)
        try:
            self.pm.hook.gyre_on_metrics(step=int(rec["step"]), metrics=metrics)
        except Exception:  # an observer's failure must not stop training
            log.exception("a gyre_on_metrics observer failed at step %s", rec["step"])

    def _restart_step(self, step: int, st: dict[str, Any]) -> None:
        """Re-run an interrupted step from the last checkpoint on the groups it had been given."""
        self._start_step(ev.StartStep(step, tuple(c for c in st["cells"] if c == 0) or (0,)))
        live = self._steps[step]
        for cell in st["cells"]:
            if cell != 0:
                live.cells.append(cell)
                self._spawn(self._cell_call(cell, self.cells[cell].training.join_step, step),
                            f"cell {cell} rejoining step {step}")
        for g, stale in zip(st["groups"], st["staleness"]):
            live.packing.assign(g)
            live.groups.append(g)
            live.staleness.append(stale)
        if st["closed"]:
            live.packing.close()
            live.closing = True
            self._spawn(self._finish_step(live), f"training step {step} (resumed)")

    async def _export(self, version: int) -> WeightsRef:
        """Policy ``version`` where the engines can load it: exposed by the run's publisher (the
        core's tensors, nothing written), or written to disk by the core when there is none."""
        core = self.cells[0].training
        if self.publisher is None:
            return await self._cell_call(0, core.publish_weights, version)
        tensors = await self._cell_call(0, core.export_weights, version)
        return await asyncio.to_thread(self.publisher.publish, version, tensors)

    async def _publish(self, version: int) -> None:
        t0 = self.now()
        ref = await self._export(version)
        previous, self.weights = self.weights, ref
        exported = self.now()
        for c in self.cells:
            if self._engine_role[c.index] == "rollout":
                if self.watchdog is not None and self.watchdog.down(c.index):
                    continue  # being restarted by the watchdog: it comes back on self.weights
                url = c.engine_url
                try:
                    await load_weights_on(c.serving, ref)
                except Exception:  # an engine that died meanwhile is the watchdog's to restart
                    if self.watchdog is None or not await self.watchdog.took_over(c.index, url):
                        raise
        if self.standalone is not None:  # the pool never trains: it loads every version as it is published
            await load_weights_on(self.standalone.serving, ref)
        self.proxy.policy_version = version
        if self.publisher is not None:  # every serving engine holds `version`; a switch back may still read the previous one
            await asyncio.to_thread(self.publisher.release_older_than, previous.version)
        self.publications.append({"version": version, "transport": "disk" if self.publisher is None else "mooncake",
                                  "export_s": round(exported - t0, 4), "load_s": round(self.now() - exported, 4)})
        if self.journal is not None:
            self.journal.write("published", version=version, location=ref.location)
        self.progress(f"published policy version {version}")
        self._publishing = None
        self._emit(ev.PublicationDone(version))
