"""The live run's training steps.

A step trains on the groups the scheduler assigns to it as they arrive (streaming packing),
satellites join it mid-way, and a cell that dies in it leaves the step to the survivors. Its end
is what the scheduler publishes (:mod:`gyre_core.orchestrator.live_publication`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from gyre_core.dataplane.packing import PackingConfig, StreamPackingBuffer
from gyre_core.dataplane.trajectory_buffer import TrajectoryBuffer
from gyre_core.interfaces import Checkpointing, StepFailed, StepRecovery
from gyre_core.metrics import step_metrics
from gyre_core.orchestrator.failure import RunFailed
from gyre_core.orchestrator.journal import Journal
from gyre_core.orchestrator.live_cells import LiveCells
from gyre_core.orchestrator.live_executions import LiveExecutions
from gyre_core.orchestrator.live_publication import LivePublication
from gyre_core.orchestrator.run_config import RunConfig
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
    joined_running: dict[int, float] = field(default_factory=dict)  # cell -> run time it joined mid-step


class LostTraining:
    """The training side of a cell whose ranks died and cannot be restarted here (a cluster
    launcher's processes): it takes part in nothing, so the cell only serves from now on."""

    def __init__(self, cell: int, why: str) -> None:
        self.cell, self.why = cell, why
        self.last_step_info: list[dict[str, Any]] = []

    def enter_training(self) -> list[Any]:
        return []

    def leave_training(self) -> list[Any]:
        return []

    def join_step(self, step: int) -> None:
        pass

    def close_stream(self, step: int) -> None:
        self.last_step_info = [{"joined": False, "lost": self.why}]

    def placement(self) -> dict[str, Any]:
        return {"cell": self.cell, "ranks": [], "lost": self.why}


def prunable(checkpoints: Mapping[int, str], keep_last: int, published: int, interval: int = 1) -> list[int]:
    """Steps whose checkpoints may go: all but the ``keep_last`` newest of those taken every
    ``interval`` steps (after steps ``interval``, ``2·interval``, ...; 0: none go), and never the
    newest one (``--resume`` continues from it) nor the one a resume needs to rebuild published
    policy ``published`` (the state after step ``published - 1``; a Mooncake publication lives only
    in memory)."""
    if keep_last <= 0 or not checkpoints:
        return []
    kept = [s for s in sorted(checkpoints) if (s + 1) % max(1, interval) == 0][-keep_last:]
    keep = set(kept) | {max(checkpoints), published - 1}
    return sorted(s for s in checkpoints if s not in keep)


def _joins(satellites: Sequence[tuple[int, Sequence[Mapping[str, Any]]]]) -> list[dict[str, Any]]:
    """Per satellite rank that joined the step: where it pulled the core's weights from, how much
    and how fast (a rank already at the step's version pulls nothing)."""
    return [{"cell": cell, "stage": i.get("stage", 0), "pull_from": i.get("pull_from"),
             "pull_bytes": i.get("pull_bytes", 0), "pull_s": round(float(i.get("pull_s", 0.0)), 4)}
            for cell, infos in satellites for i in infos if i.get("joined")]


class LiveSteps:
    """The run's training steps: each one open from its start to its update, the cells in it,
    the groups streamed into it, a failed cell's recovery, the checkpoint after it, its record.

    Owns the open steps, the step records, the satellite failures and the checkpoints taken.
    Reaches the rest of the run through what it is given: the cells (training sides), the
    executions (which groups' executions it trained), the publication (the version a checkpoint
    must keep), the trajectory buffer, the journal and callbacks."""

    def __init__(self, cfg: RunConfig, *, cells: LiveCells, executions: LiveExecutions, publication: LivePublication,
                 buffer: TrajectoryBuffer, packing_cfg: PackingConfig, journal: Journal | None, out_dir: Path,
                 event_log: IO[str] | None, pm: Any, call_stats: Callable[[], Any], now: Callable[[], float],
                 emit: Callable[[ev.Event], None], spawn: Callable[[Any, str], None], progress: Callable[[str], None],
                 executions_summary: Callable[[], dict[str, Any]],
                 interrupted_calls: Callable[[], dict[str, Any] | None]) -> None:
        self.cfg = cfg
        self.cells = cells
        self.executions = executions
        self.publication = publication
        self.buffer = buffer
        self.packing_cfg = packing_cfg
        self.journal = journal
        self.out_dir = out_dir
        self.event_log = event_log
        self.pm = pm
        self._call_stats = call_stats
        """The proxy's per-call figures since the last step (taken once per step, for the metrics)."""
        self.now = now
        self._emit = emit
        self._spawn = spawn
        self.progress = progress
        self._executions_summary = executions_summary
        self._interrupted_calls = interrupted_calls
        self.open: dict[int, _Step] = {}
        """Steps started and not yet done, by step."""
        self.records: list[dict[str, Any]] = []
        """One per completed step (the summary's ``step_records``)."""
        self.satellite_failures: list[dict[str, Any]] = []
        """Steps that lost a cell and finished on the survivors (and whether the ranks restarted)."""
        self.checkpoints: dict[int, str] = {}
        """Step -> the core's saved training state, as journalled (``checkpoint.keep_last`` prunes)."""
        self._metrics_switch_mark = 0
        """Role switches already reported to the metrics observers."""

    # ------------------------------------------------------------------ the scheduler's commands

    def join(self, step: int, cell: int) -> None:
        """A satellite joins ``step`` while it runs."""
        st = self.open[step]
        st.cells.append(cell)
        st.joined_running[cell] = self.now()
        self.progress(f"cell {cell} joins running step {step} ({self.now() - st.started:.1f} s in)")
        self._spawn(self.cells.call(cell, self.cells[cell].training.join_step, step),
                    f"cell {cell} joining step {step}")

    def assign(self, step: int, group_id: int, staleness: int) -> None:
        """A ready group streams into ``step``."""
        st = self.open[step]
        self.executions.account_group(group_id, "assigned")
        st.packing.assign(group_id)
        st.groups.append(group_id)
        st.staleness.append(staleness)

    def close(self, step: int) -> None:
        """Its last group is in: close the stream and finish the step."""
        st = self.open[step]
        st.packing.close()
        st.closing = True
        self._spawn(self._finish_step(st), f"training step {step}")


    def start(self, cmd: ev.StartStep) -> None:
        core = self.cells[0].training
        queue = core.micro_step_queue(cmd.step)  # type: ignore[attr-defined]
        packing = StreamPackingBuffer(cmd.step, self.buffer, queue, self.packing_cfg, self.cfg.scheduler.groups_per_step)
        self.open[cmd.step] = _Step(cmd.step, packing, list(cmd.cells), started=self.now())
        self.progress(f"step {cmd.step}: training on cells {list(cmd.cells)}")
        for cell in cmd.cells:
            fn = self.cells[cell].training.start_step if cell == 0 else self.cells[cell].training.join_step
            self._spawn(self.cells.call(cell, fn, cmd.step), f"cell {cell} starting step {cmd.step}")

    async def _close_streams(self, st: _Step) -> dict[int, list[dict[str, Any]]]:
        """Wait for every cell that trained in the step, the core last (it applies the update);
        per cell, its ranks' statistics. A satellite that died takes nothing with it: the step
        finishes on the cells that survived, and the training processes are restarted."""
        infos: dict[int, list[dict[str, Any]]] = {}
        failed: dict[int, BaseException] = {}
        for cell in sorted(set(st.cells), reverse=True):
            side = self.cells[cell].training
            try:
                await self.cells.call(cell, side.close_stream, st.step)
            except StepFailed as e:
                if cell == 0 and e.survivors == 0:
                    raise  # the core itself is gone: the run's journal resumes it
                failed[cell] = e
            infos[cell] = list(side.last_step_info)
        if not failed:
            return infos
        gone = sorted(c for c, e in failed.items() if e.survivors == 0)
        core = failed.get(0)
        if core is None:  # the update went through without them: a gone satellite added nothing to it
            if len(gone) != len(failed):
                raise RunFailed(f"step {st.step}: cells {sorted(failed)} failed while the core's update went through: "
                                + "; ".join(str(e) for e in failed.values()))
            survivors, redone = [c for c in infos if c not in failed], 0
        else:
            survivors = sorted(c for c in set(st.cells) if c < core.survivors)
            redone = await self._finish_on_survivors(st, survivors, core, infos)
        for c in set(st.cells) - set(survivors):
            infos.pop(c, None)
        restart = await self._restart_training(st.step, gone) if gone else None
        self.satellite_failures.append({"step": st.step, "cells": gone, "survivors": survivors,
                                        "redone_micro_steps": redone, "error": str(failed[gone[0]] if gone else core)[:300],
                                        **(restart or {})})
        self.progress(f"step {st.step}: cell(s) {gone} died; finished on cells {survivors} "
                      f"({redone} micro-steps streamed again)")
        return infos

    async def _finish_on_survivors(self, st: _Step, survivors: list[int], failure: StepFailed,
                                   infos: dict[int, list[dict[str, Any]]]) -> int:
        """The surviving cells kept their gradients: they stream what the dropped cells had
        claimed, then reduce and update as the step would have. Returns the re-streamed count."""
        indices = sorted(i for claimed in failure.requeue.values() for i in claimed)
        waits = []
        for cell in survivors:  # the core first: it makes the queue the others claim from
            side = self.cells[cell].training
            if not isinstance(side, StepRecovery):
                raise RunFailed(f"step {st.step} failed and cell {cell}'s backend cannot finish it: {failure}")
            queue, wait = await self.cells.call(cell, side.resume_step, st.step)
            if cell == 0:
                redo_queue = queue
            waits.append((cell, wait))
        await asyncio.to_thread(st.packing.redo, indices, redo_queue)
        for cell, wait in waits:
            infos[cell] = infos.get(cell, []) + list(await self.cells.call(cell, wait))
        return len(indices)

    async def _restart_training(self, step: int, gone: list[int]) -> dict[str, Any]:
        """Cells whose ranks died come back: every training process is started anew with the
        core's state (torch cannot re-admit a process into a group). No cell's rank is busy
        meanwhile (every cell's lock is held); cells settled in rollout then offload again."""
        core = self.cells[0].training
        restart = core.restart_ranks if isinstance(core, StepRecovery) else None
        async with self.cells.all_held():
            try:
                if restart is None:
                    raise NotImplementedError("the training backend cannot restart its ranks")
                info = dict(await asyncio.to_thread(restart))
            except NotImplementedError as e:
                for c in gone:  # they stay out of training; their engines keep serving
                    self.cells[c].training = LostTraining(c, str(e))
                log.warning("cells %s left out of training for the rest of the run: %s", gone, e)
                return {"restarted": False, "reason": str(e)}
            for c in range(1, len(self.cells)):
                if self.cells.role(c) == "rollout":  # fresh ranks hold their training state
                    await asyncio.to_thread(self.cells[c].training.leave_training)
        self.progress(f"training ranks restarted after step {step} in {info.get('restart_s', 0.0):.1f} s; "
                      f"cells {gone} rejoin at later steps")
        return {"restarted": True, "restart_s": round(float(info.get("restart_s", 0.0)), 3)}

    async def _finish_step(self, st: _Step) -> None:
        infos = await self._close_streams(st)
        core = self.cells[0].training
        save = core.save_checkpoint if isinstance(core, Checkpointing) else None
        if save is not None and self.journal is not None:
            path = str(self.out_dir / "checkpoints" / f"step{st.step}")
            (self.out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            await self.cells.call(0, save, path)
            self.journal.write("checkpoint", step=st.step, path=path)
            self.checkpoints[st.step] = path
            for old in prunable(self.checkpoints, self.cfg.checkpoint.keep_last, self.publication.weights.version,
                                self.cfg.checkpoint.interval):
                self.journal.write("checkpoint_deleted", step=old)  # first: a crash now never names a gone one
                await asyncio.to_thread(shutil.rmtree, self.checkpoints.pop(old), True)
        for g in st.groups:
            self.executions.account_group(g, "trained", from_fates=("assigned",))
        rewards = [self.executions.records[e].reward for g in st.groups for e in self.executions.group_members(g)
                   if self.executions.records[e].reward is not None and self.executions.records[e].fate == "trained"]
        rec = {"step": st.step, "groups": list(st.groups), "staleness": list(st.staleness),
               "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
               "executions": len(rewards), "cells": sorted(infos),
               "duration_s": round(self.now() - st.started, 3), "started_s": round(st.started, 3),
               "ended_s": round(self.now(), 3), "micro_steps": st.packing.micro_steps,
               # every token the trainer read (contexts and replies; ``tokens`` counts the sampled ones)
               "row_tokens": st.packing.tokens_emitted,
               "split_executions": st.packing.split_executions,
               # sampled tokens whose recorded log-prob was NaN or infinite: context, not targets
               "masked_nonfinite_tokens": st.packing.masked_nonfinite,
               "rows_over_budget": st.packing.rows_over_budget,  # left out: longer than one micro-step
               "joins": _joins([(c, infos[c]) for c in sorted(infos) if c]),
               # satellites the scheduler sent into the step while it was already training
               "joined_running": [{"cell": c, "at_s": round(t, 3), "after_s": round(t - st.started, 3),
                                   "trained": c in infos and any(i.get("joined") for i in infos[c])}
                                  for c, t in sorted(st.joined_running.items())],
               **training_figures([infos[c] for c in sorted(infos)])}
        self.records.append(rec)
        self._report_metrics(rec)
        if self.event_log is not None:
            self.event_log.write(json.dumps({"t": round(self.now(), 3), "step_done": st.step, **rec}) + "\n")
            self.event_log.flush()
        self.progress(f"step {st.step} done in {rec['duration_s']:.1f} s: mean reward {rec['mean_reward']}, "
                      f"staleness {st.staleness}, loss {rec['loss']}, grad norm {rec['grad_norm']}, lr {rec['lr']}, "
                      f"clipped {rec['clip_fraction']}, ratio mean/max {rec['ratio_mean']}/{rec['ratio_max']}, "
                      f"|Δlog p| mean/max {rec['logp_diff_mean']}/{rec['logp_diff_max']}, KL k3 {rec['kl_k3']}, "
                      f"entropy {rec['entropy']}, "
                      f"{rec['tokens']} tokens")
        del self.open[st.step]
        self._emit(ev.MicroStepsDone(st.step))

    def _report_metrics(self, rec: dict[str, Any]) -> None:
        """The step's figures to the ``gyre_on_metrics`` observers (TensorBoard, W&B, plugins)."""
        mark = self._metrics_switch_mark
        metrics = step_metrics(rec, executions=self._executions_summary(), switches=self.cells.role_switches[mark:],
                               interrupted_calls=self._interrupted_calls(),
                               publication=self.publication.records[-1] if self.publication.records else None,
                               call_stats=self._call_stats())
        self._metrics_switch_mark = len(self.cells.role_switches)
        try:
            self.pm.hook.gyre_on_metrics(step=int(rec["step"]), metrics=metrics)
        except Exception:  # an observer's failure must not stop training
            log.exception("a gyre_on_metrics observer failed at step %s", rec["step"])

    def restart(self, step: int, st: dict[str, Any]) -> None:
        """Re-run an interrupted step from the last checkpoint on the groups it had been given."""
        self.start(ev.StartStep(step, tuple(c for c in st["cells"] if c == 0) or (0,)))
        live = self.open[step]
        for cell in st["cells"]:
            if cell != 0:
                live.cells.append(cell)
                self._spawn(self.cells.call(cell, self.cells[cell].training.join_step, step),
                            f"cell {cell} rejoining step {step}")
        for g, stale in zip(st["groups"], st["staleness"]):
            live.packing.assign(g)
            live.groups.append(g)
            live.staleness.append(stale)
        if st["closed"]:
            live.packing.close()
            live.closing = True
            self._spawn(self._finish_step(live), f"training step {step} (resumed)")
