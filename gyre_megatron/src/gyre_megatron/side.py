"""The training side of a cell (:class:`gyre_core.interfaces.TrainingSide`) over megatron-core ranks.

All K cells' ranks form one world (torch cannot grow a process group), so the first
``gyre_make_training_side`` call of a run starts the whole world -- spawned here
(:class:`~gyre_megatron.launch.World`, ``launcher = "local"``) or started by ``torchrun`` on the
cluster's nodes (:class:`~gyre_megatron.launch.ClusterWorld`, ``launcher = "torchrun"``) -- and
every cell's side drives its own block of ranks through it. Methods that start work
(``start_step``, ``join_step``) return at once; ``close_stream`` waits for the cell's ranks, with
a timeout, and raises :class:`~gyre_core.interfaces.StepFailed` if the step could not complete.

Each training step uses its own micro-step queue, created before the ranks were spawned (a
``multiprocessing`` queue can only be handed to a process at creation): the orchestrator builds
the step's packing buffer on :meth:`MegatronTrainingSide.micro_step_queue`.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Sequence

from gyre_core.interfaces import EngineOptions, PhaseTiming, TrainingOptions, WeightsRef

__all__ = ["MegatronTrainingSide", "shutdown_worlds"]

_worlds: dict[tuple[Any, ...], Any] = {}
# world -> {step (or -1 - step for a redo): queue index}. Keyed by the world object itself, not its
# id(): a later world can reuse a closed one's id, and would then stream into its closed queues.
_queue_of: "weakref.WeakKeyDictionary[Any, dict[int, int]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _world_for(options: TrainingOptions) -> Any:
    from gyre_megatron.launch import World
    from gyre_megatron.model import ModelSpec
    from gyre_megatron.runtime import RankOptions

    key = repr(options)  # one world per run's options (the progress callback is not part of it)
    with _lock:
        if key not in _worlds:
            if options.init_from:  # the user's checkpoint: every size from its config.json
                from gyre_megatron.hf_import import spec_from_hf_dir

                spec = spec_from_hf_dir(options.init_from, seed=int(options.model.get("seed", 1234)))
            else:
                spec = ModelSpec(**dict(options.model))
            opts = RankOptions(
                cells=options.cells, pp=options.pp, tp=options.tp, ep=options.ep, spec=spec,
                precision=options.precision, transformer_impl=options.transformer_impl,
                lr=options.lr, clip_grad=options.clip_grad,
                megatron=dict(options.megatron), total_steps=options.total_steps,
                data_timeout_s=options.data_timeout_s, side_timeout_s=options.side_timeout_s,
                heartbeat_s=options.heartbeat_s, normalise_by_tokens=options.normalise_by_tokens,
                init_from=options.init_from, objective=options.objective,
                mooncake=options.publication.mooncake, log_dir=options.log_dir,
                weights_transport=options.publication.transport, weights_folder=options.publication.folder,
            )
            launch = options.launch
            if launch.launcher == "local":
                _worlds[key] = World(opts, n_queues=options.max_steps)
            elif launch.launcher == "torchrun":
                from gyre_megatron.launch import ClusterWorld

                _worlds[key] = ClusterWorld(
                    opts, options.max_steps, launch.control_host, launch.control_port, launch.key_file,
                    join_timeout_s=launch.join_timeout_s, announce=options.announce)
            elif launch.launcher == "ray":
                from gyre_megatron.ray_launch import RayWorld

                _worlds[key] = RayWorld(
                    opts, options.max_steps, launch.ray_address, gpus_per_rank=launch.ray_gpus_per_rank,
                    resources_per_rank=dict(launch.ray_resources_per_rank),
                    start_timeout_s=launch.join_timeout_s, announce=options.announce)
            else:
                raise ValueError(f"launcher {launch.launcher!r}: expected 'local', 'torchrun' or 'ray'")
        return _worlds[key]


def shutdown_worlds() -> None:
    """Stop every world this process started (their ranks, by pid)."""
    with _lock:
        for w in _worlds.values():
            w.close()
            _queue_of.pop(w, None)
        _worlds.clear()


class MegatronTrainingSide:
    def __init__(self, cell: int, options: TrainingOptions) -> None:
        self.cell = cell
        self.options = options
        self.world = _world_for(options)
        self.ranks = self.world.ranks_of(cell)
        self.timeout_s = options.step_timeout_s
        self.burst_steps = options.burst_steps
        self._tickets: dict[int, Any] = {}
        self.last_step_info: list[dict[str, Any]] = []
        """Per-rank statistics of the last step this cell closed (claims, m, pull, grad norm)."""

    def placement(self) -> dict[str, Any]:
        """Where this cell's ranks run (node and device per rank, as each reported at start)."""
        info = [self.world.info[r] for r in self.ranks]
        return {"cell": self.cell, "ranks": list(self.ranks), "tp": self.world.opts.tp, "pp": self.world.opts.pp,
                "nodes": sorted({str(i.get("node", "?")) for i in info}),
                "devices": [str(i.get("device", "cpu")) for i in info]}

    def _queue_index(self, step: int) -> int:
        with _lock:
            steps = _queue_of.setdefault(self.world, {})
            if step not in steps:
                steps[step] = self.world.alloc_queue()
            return steps[step]

    def micro_step_queue(self, step: int) -> Any:
        """The queue training step ``step`` streams through (shared by all cells)."""
        return self.world.queues[self._queue_index(step)]

    def _timed(self, transition: str, phase: str, method: str) -> list[PhaseTiming]:
        t0 = time.monotonic()
        self.world.call(self.ranks, method, timeout=self.timeout_s)
        return [PhaseTiming(self.cell, transition, phase, t0, time.monotonic())]

    def enter_training(self) -> Sequence[PhaseTiming]:
        return self._timed("to_training", "restore_training_state", "enter_training")

    def leave_training(self) -> Sequence[PhaseTiming]:
        return self._timed("to_rollout", "offload_training_state", "leave_training")

    def _final(self, step: int) -> bool:
        return bool(self.burst_steps) and (step + 1) % self.burst_steps == 0

    def start_step(self, step: int) -> None:
        if self.cell != 0:
            raise ValueError("start_step is for the core (cell 0); satellites join_step")
        self._submit_step(step)

    def join_step(self, step: int) -> None:
        if self.cell == 0:
            raise ValueError("the core starts steps; join_step is for satellites")
        self._submit_step(step)

    def _submit_step(self, step: int) -> None:
        qi = self._queue_index(step)
        self._tickets[step] = self.world.submit(self.ranks, "run_step", step, qi, self._final(step))

    def stream_failure(self, step: int) -> str | None:
        """Without waiting: why this cell's ranks already stopped working on ``step`` while its
        stream is still open (a rank raised, e.g. out of memory, or died), else ``None``. Nobody
        claims the step's micro-steps after that, so the run must hear it now, not at the close."""
        ticket = self._tickets.get(step)
        return None if ticket is None else self.world.failure(ticket)

    def close_stream(self, step: int) -> None:
        from gyre_megatron.launch import RankError
        from gyre_core.interfaces import StepFailed

        ticket = self._tickets.pop(step)
        try:
            self.last_step_info = self.world.wait(ticket, self.timeout_s)
        except RankError as e:  # this cell's own ranks raised, died or hung: nothing of it survives
            self.last_step_info = []
            raise StepFailed(f"cell {self.cell}, step {step}: {e}", survivors=0) from e
        failed = [i for i in self.last_step_info if i.get("failed")]
        if failed:
            requeue = {int(c): v for i in failed for c, v in i.get("requeue", {}).items()}
            survivors = int(failed[0].get("survivors", 1))
            raise StepFailed(f"cell {self.cell}, step {step}: {failed[0]['error']}", requeue, survivors)

    def resume_step(self, step: int) -> tuple[Any, Any]:
        """After :class:`StepFailed`: finish ``step`` on the surviving prefix (the core and the
        satellites below the first dead cell, ``StepFailed.survivors``), on their kept gradients
        plus the re-queued micro-steps. Call it on the core first (it allocates the queue), then
        on each surviving satellite; put the re-queued micro-steps into the returned queue and
        close it. Returns the queue and a callable that waits for this cell's part (on the core:
        the update)."""
        if self.cell == 0:
            qi = self.world.alloc_queue()
            with _lock:
                _queue_of.setdefault(self.world, {})[-1 - step] = qi
        else:
            qi = _queue_of[self.world][-1 - step]
        ticket = self.world.submit(self.ranks, "resume_step", step, qi, self._final(step))
        return self.world.queues[qi], lambda: self.world.wait(ticket, self.timeout_s)

    def restart_ranks(self) -> dict[str, Any]:
        """Core only: after a satellite's rank died, start every rank of the world anew (the way a
        cell can take part in training again) and carry the core's training state across
        (parameters, optimizer, policy version; saved and loaded through a temporary checkpoint).
        Satellites come back at no version: their next join pulls the core's weights.

        Only a world this process spawned can be restarted (``launcher = "local"``); a cluster
        launcher's ranks are the launcher's to restart, so there this raises
        :class:`NotImplementedError`. Returns ``{"restart_s", "restarts"}``."""
        if self.cell != 0:
            raise ValueError("only the core restarts the world")
        restart = getattr(self.world, "restart", None)
        if restart is None:
            raise NotImplementedError(f"{type(self.world).__name__}: ranks started by a cluster launcher are not restarted here")
        import tempfile

        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="gyre-restart-") as tmp:
            path = f"{tmp}/core"
            self.world.call(self.ranks, "save_checkpoint", path, timeout=self.timeout_s)
            restart()
            self.world.call(self.ranks, "load_checkpoint", path, timeout=self.timeout_s)
        self._tickets.clear()
        return {"restart_s": time.monotonic() - t0, "restarts": int(self.world.restarts)}

    def start_engine(self, model_dir: str, options: EngineOptions) -> Any:
        """Start this cell's SGLang server where the cell's ranks run (``launcher = "torchrun"``:
        on the cell's node, by its first rank). Returns an engine with ``url``, ``stop``, ``kill``."""
        start = getattr(self.world, "start_engine", None)
        if start is None:
            raise ValueError("start_engine is for ranks started by a cluster launcher; local runs start engines here")
        return start(self.cell, model_dir, options)

    def save_checkpoint(self, path: str) -> None:
        """Core only: persist the training state after a step (weights, optimizer, version)."""
        if self.cell != 0:
            raise ValueError("only the core holds the authoritative training state")
        self.world.call(self.ranks, "save_checkpoint", path, timeout=self.timeout_s)

    def load_checkpoint(self, path: str) -> None:
        """Core only: restore the state :meth:`save_checkpoint` wrote (resume after a crash)."""
        if self.cell != 0:
            raise ValueError("only the core holds the authoritative training state")
        self.world.call(self.ranks, "load_checkpoint", path, timeout=self.timeout_s)

    def publish_weights(self, version: int) -> WeightsRef:
        """Policy ``version`` where engines load it, by the run's ``publication`` transport: each
        stage of the core registers its own part (Mooncake), or writes its own file (disk)."""
        if self.cell != 0:
            raise ValueError("only the core publishes weights")
        from gyre_megatron.export import publish

        return publish(self.world, self.options.publication, version)

    def write_weights(self, version: int, folder: str) -> WeightsRef:
        """Policy ``version`` as an HF checkpoint's weights and ``config.json`` in ``folder``,
        each stage writing its own file (the published bytes while they are still exposed)."""
        if self.cell != 0:
            raise ValueError("only the core holds the policy")
        from gyre_megatron.export import write

        return write(self.world, version, folder)

    def release_weights_older_than(self, version: int) -> None:
        if self.cell == 0:
            from gyre_megatron.export import release_older_than

            release_older_than(self.world, version)
