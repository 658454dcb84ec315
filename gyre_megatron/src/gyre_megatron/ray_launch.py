"""The ranks and engines of K cells as Ray actors (``cluster.launcher = "ray"``).

Where a cluster already runs Ray, the orchestrator connects to it (``ray.init(address=...)``, or a
local Ray when no address is given) and places each cell in a placement group of its own: one
bundle per rank (``CPU: 1``, ``GPU: gpus_per_rank`` and any custom resources), packed onto one node
(``STRICT_PACK``). Each rank is a :class:`RankActor` in its bundle; the cell's SGLang engine is an
:class:`EngineActor` in the cell's first bundle (no resources of its own), so it runs on the node
and the GPUs of the cell's ranks. Commands are actor calls whose answers are object refs; the
micro-step queues live in one :class:`MicroStepHub` actor on the orchestrator's node, which
ranks claim from and the orchestrator fills.

Ray replaces the torchrun path's heartbeats: actors share the orchestrator's fate (they are owned
by its driver and die with it), and an actor that dies fails its pending calls at once, which is
reported as a dead rank (with its cell) and handled like any other dead rank. Ray is imported only
when this launcher is chosen (``pip install 'gyre-megatron[ray]'``).
"""

from __future__ import annotations

import dataclasses
import os
import queue as queue_mod
import socket
import threading
import time
from typing import Any, Mapping, Sequence

from gyre_core.interfaces import EngineOptions
from gyre_megatron.launch import _Ranks
from gyre_megatron.runtime import RankOptions

__all__ = ["RayEngine", "RayWorld"]

_EMPTY = ("empty",)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError("cluster.launcher = \"ray\" needs Ray: pip install 'gyre-megatron[ray]'") from exc
    return ray


class MicroStepHub:
    """Every micro-step queue of a run, in one actor (threaded: claims wait while puts arrive)."""

    def __init__(self, n: int) -> None:
        from gyre_core.dataplane.microstep_queue import MicroStepQueue

        self.queues = [MicroStepQueue() for _ in range(n)]

    def put(self, i: int, item: Any) -> None:
        self.queues[i].put(item)

    def close(self, i: int) -> None:
        self.queues[i].close()

    def claim(self, i: int, timeout: float | None) -> Any:
        try:
            return ("item", self.queues[i].claim(timeout))
        except queue_mod.Empty:
            return _EMPTY

    def unclaimed(self, i: int) -> int:
        return self.queues[i].unclaimed()

    def closed(self, i: int) -> bool:
        return self.queues[i].closed


class HubQueue:
    """One micro-step queue of the hub, with :class:`MicroStepQueue`'s interface: what the
    orchestrator fills and a cell's leader claims from, on any node."""

    def __init__(self, hub: Any, index: int) -> None:
        self.hub, self.index = hub, index

    def _get(self, ref: Any) -> Any:
        return _ray().get(ref)

    def put(self, item: Any) -> None:
        self._get(self.hub.put.remote(self.index, item))

    def close(self) -> None:
        self._get(self.hub.close.remote(self.index))

    def claim(self, timeout: float | None = None) -> Any:
        got = self._get(self.hub.claim.remote(self.index, timeout))
        if got == _EMPTY:
            raise queue_mod.Empty
        return got[1]

    def unclaimed(self) -> int:
        return int(self._get(self.hub.unclaimed.remote(self.index)))

    @property
    def closed(self) -> bool:
        return bool(self._get(self.hub.closed.remote(self.index)))


class RankActor:
    """One rank of a cell: joins the process group, then answers commands in order."""

    def __init__(self, rank: int, log_dir: str) -> None:
        from gyre_core.procutil import die_with_parent

        die_with_parent()  # the worker process Ray made for this actor: nothing of it outlives the raylet
        self.rank = rank
        if log_dir:  # before megatron-core is imported: its notices go to the log
            from gyre_megatron.runtime import log_to

            log_to(os.path.join(log_dir, f"rank{rank}.log"))
        self.cr: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port for the process group's store."""
        ray = _ray()
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def start(self, world: int, init_method: str, opts: RankOptions, queues: Sequence[Any]) -> tuple[int, int, bool, Any]:
        import traceback

        from gyre_megatron.runtime import start_rank

        try:
            self.cr = start_rank(self.rank, world, init_method, opts, queues)
            info = self.cr.ping()
            info["gpu_ids"] = [int(g) for g in _ray().get_gpu_ids()]  # physical ids on its node
            info["host"] = info["node"]
            info["node"] = _ray().get_runtime_context().get_node_id()  # the Ray node: what placement names
            return (self.rank, -1, True, info)
        except BaseException:
            return (self.rank, -1, False, traceback.format_exc())

    def call(self, seq: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, bool, Any]:
        from gyre_megatron.runtime import answer

        return answer(self.cr, (seq, name, args, kwargs))

    def stop(self) -> None:
        from gyre_megatron.runtime import stop_rank

        stop_rank()


class EngineActor:
    """A cell's SGLang server, started on the node of the cell's first rank (its bundle)."""

    def __init__(self) -> None:
        from gyre_core.procutil import die_with_parent

        die_with_parent()
        self.engine: Any = None

    def start(self, model_dir: str, options: EngineOptions) -> tuple[str, str]:
        from gyre_core.plugins import plugin_manager

        if options.log_path:
            os.makedirs(os.path.dirname(options.log_path) or ".", exist_ok=True)
        ray = _ray()
        engine = plugin_manager().hook.gyre_start_engine(model_dir=model_dir, options=options)
        if engine is None:
            raise RuntimeError("no serving backend on this node: install gyre-sglang (and SGLang)")
        self.engine = engine
        url = engine.url
        if options.host in ("0.0.0.0", "::", ""):
            from urllib.parse import urlsplit, urlunsplit

            parts = urlsplit(url)
            url = urlunsplit(parts._replace(netloc=f"{ray.util.get_node_ip_address()}:{parts.port}"))
        return url, ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def kill(self) -> None:
        if self.engine is not None:
            self.engine.kill()
            self.engine = None

    def alive(self) -> bool:
        proc = getattr(self.engine, "proc", None)
        return proc is not None and proc.poll() is None


class RayEngine:
    """The orchestrator's handle on a cell's engine actor."""

    def __init__(self, actor: Any, url: str, node: str, timeout_s: float) -> None:
        self.actor, self.url, self.node, self.timeout_s = actor, url, node, timeout_s

    def alive(self) -> None:
        """Not told from here: the watchdog's health checks decide for an engine on a Ray node."""
        return None

    def placement(self) -> str:
        return f"on node {self.node}"

    def stop(self) -> None:
        ray = _ray()
        try:
            ray.get(self.actor.stop.remote(), timeout=self.timeout_s)
        finally:
            ray.kill(self.actor)

    def kill(self) -> None:
        ray = _ray()
        try:
            ray.get(self.actor.kill.remote(), timeout=self.timeout_s)
        except Exception:
            pass
        ray.kill(self.actor)


class RayWorld(_Ranks):
    """The ranks of K cells as Ray actors, one placement group per cell."""

    def __init__(self, opts: RankOptions, n_queues: int, address: str = "", *, gpus_per_rank: float = 0.0,
                 resources_per_rank: Mapping[str, float] | None = None, start_timeout_s: float = 600.0,
                 announce: Any = None) -> None:
        super().__init__()
        ray = _ray()
        self.opts = opts
        self.size = opts.cells * opts.cell_size
        self.gpus_per_rank = float(gpus_per_rank)
        self.resources_per_rank = dict(resources_per_rank or {})
        self.start_timeout_s = start_timeout_s
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(address=address or None, namespace="gyre", log_to_driver=False,
                     include_dashboard=False, configure_logging=False)
        self.ray = ray
        self.address = address
        node = ray.get_runtime_context().get_node_id()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        hub_cls = ray.remote(num_cpus=0, max_concurrency=64)(MicroStepHub)
        self.hub = hub_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(n_queues)
        self.queues = [HubQueue(self.hub, i) for i in range(n_queues)]
        self._next_queue = 0
        self.restarts = 0
        self.groups: list[Any] = []
        self.actors: list[Any] = []
        self._pending: dict[Any, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._died: dict[int, str] = {}
        self.engines: dict[int, RayEngine] = {}
        """The last engine started for each cell (its actor, URL and Ray node)."""
        if announce is not None:
            announce(f"placing {opts.cells} cell(s) of {opts.cell_size} rank(s) on Ray at "
                     f"{ray.get_runtime_context().gcs_address}")
        self._spawn()

    # ------------------------------------------------------------------ placement
    def _bundle(self) -> dict[str, float]:
        b = {"CPU": 1.0, **self.resources_per_rank}
        if self.gpus_per_rank:
            b["GPU"] = self.gpus_per_rank
        return b

    def _spawn(self) -> None:
        from ray.util.placement_group import placement_group

        ray, n = self.ray, self.opts.cell_size
        self.groups = [placement_group([self._bundle() for _ in range(n)], strategy="STRICT_PACK",
                                       name=f"gyre-cell{c}") for c in range(self.opts.cells)]
        try:
            ray.get([g.ready() for g in self.groups], timeout=self.start_timeout_s)
        except Exception as exc:
            self.close()
            raise RuntimeError(f"Ray could not place {self.opts.cells} cell(s) of {n} × {self._bundle()} "
                               f"within {self.start_timeout_s:.0f} s: {exc}") from exc
        self._start_ranks()

    def _start_ranks(self) -> None:
        """A rank actor in each bundle of the reserved groups; wait for all to join."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, n = self.ray, self.opts.cell_size
        actor_cls = ray.remote(max_restarts=0, max_concurrency=1)(RankActor)
        self.actors = []
        for r in range(self.size):
            cell, i = divmod(r, n)
            self.actors.append(actor_cls.options(
                num_cpus=1, num_gpus=self.gpus_per_rank, resources=self.resources_per_rank or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.groups[cell], placement_group_bundle_index=i),
                name=None).remote(r, self.opts.log_dir))
        host, port = ray.get(self.actors[0].rendezvous.remote(), timeout=self.start_timeout_s)
        self.host, self.port = host, port  # rank 0's c10d store (where steps keep their keys)
        init = f"tcp://{host}:{port}"
        with self._lock:
            self._pending = {a.start.remote(self.size, init, self.opts, self.queues): (r, -1)
                             for r, a in enumerate(self.actors)}
        self._join(self.start_timeout_s)

    def bundle_nodes(self, cell: int) -> list[str]:
        """The Ray node of each bundle of cell ``cell``'s placement group."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.groups[cell])
        return [table["bundles_to_node_id"][i] for i in range(self.opts.cell_size)]

    # ------------------------------------------------------------------ commands
    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        seq, name, args, kwargs = message
        ref = self.actors[rank].call.remote(seq, name, args, kwargs)
        with self._lock:
            self._pending[ref] = (rank, seq)

    def _receive(self, timeout: float) -> tuple[int, int, bool, Any]:
        # Several cells' sides wait at once (one thread each): any of them may collect any answer
        # (the base class files it under its ticket); each ref is taken by exactly one.
        with self._lock:
            refs = list(self._pending)
        if not refs:
            time.sleep(min(timeout, 0.05))
            raise queue_mod.Empty
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        with self._lock:
            taken = self._pending.pop(ready[0], None) if ready else None
        if taken is None:
            raise queue_mod.Empty
        rank, seq = taken
        try:
            return self.ray.get(ready[0])  # type: ignore[no-any-return]
        except self.ray.exceptions.RayActorError as exc:
            why = f"rank {rank} (cell {rank // self.opts.cell_size}) actor died: {str(exc).splitlines()[0][:200]}"
            self._died[rank] = why
            return (rank, seq, False, why)

    def _dead(self, rank: int) -> str | None:
        return self._died.get(rank)

    def kill_rank(self, rank: int) -> None:
        """Kill rank ``rank``'s actor outright (fault injection)."""
        self.ray.kill(self.actors[rank], no_restart=True)

    def start_engine(self, cell: int, model_dir: str, options: EngineOptions) -> RayEngine:
        """Start cell ``cell``'s SGLang server as an actor in the cell's first bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = self.ray.remote(num_cpus=0, max_restarts=0)(EngineActor)
        # The engine holds no GPU of its own in Ray's books: it shares the cell's GPUs with the
        # cell's ranks (they take turns). So Ray must not hide the node's GPUs from it, and it
        # starts at the first GPU Ray gave the cell's ranks, spanning all of them.
        gpus = sorted(g for r in self.ranks_of(cell) for g in self.info[r].get("gpu_ids", []))
        if gpus:
            options = dataclasses.replace(options, base_gpu_id=gpus[0], tp_size=len(gpus))
        actor = cls.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.groups[cell], placement_group_bundle_index=0),
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}).remote()
        timeout = options.start_timeout_s + 30.0
        url, node = self.ray.get(actor.start.remote(model_dir, options), timeout=timeout)
        self.engines[cell] = RayEngine(actor, url, node, 60.0)
        return self.engines[cell]

    def restart(self) -> None:
        """Every rank anew (a dead rank means a new process group), in the same placement groups:
        the cells keep their nodes, and their engines (actors in the same groups) keep serving."""
        self._kill_ranks()
        self._answers.clear()
        self._died.clear()
        self.restarts += 1
        self._start_ranks()

    def _kill_ranks(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:
                pass
        with self._lock:
            self.actors, self._pending = [], {}

    def _stop_ranks(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self._kill_ranks()
        for g in self.groups:
            try:
                remove_placement_group(g)
            except Exception:
                pass
        with self._lock:
            self.actors, self.groups, self._pending = [], [], {}

    def close(self, timeout: float = 10.0) -> None:
        if not self.ray.is_initialized():
            return
        self._stop_ranks()
        try:
            self.ray.kill(self.hub)
        except Exception:
            pass
        if self._own_ray:
            self.ray.shutdown()
