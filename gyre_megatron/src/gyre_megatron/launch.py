"""Start and drive the ranks of K training cells (``torch.multiprocessing`` spawn, gloo).

The micro-step queues are ``multiprocessing`` primitives, which can only be handed to a process at
its creation, so the driver creates them (``n_queues``, one per step the run will take) before
spawning. Each rank serves commands (a method name of :class:`~gyre_megatron.runtime.CellRank`)
from its own command queue; :meth:`World.submit` returns a ticket and :meth:`World.wait` collects
the answers with a timeout, so no call can hang forever. :meth:`World.close` stops every rank it
started, by pid, and the context manager guarantees it.
"""

from __future__ import annotations

import itertools
import os
import queue as queue_mod
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch.multiprocessing as mp

from gyre_core.dataplane.microstep_queue import MicroStepQueue
from gyre_core.interfaces import EngineOptions
from gyre_megatron.runtime import RankOptions, worker_main

__all__ = ["ClusterWorld", "RankError", "RemoteEngine", "World"]


class RankError(RuntimeError):
    """A rank raised, died, or did not answer in time."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Ticket:
    ranks: tuple[int, ...]
    seq: int


class _Ranks:
    """Commands to ranks and their answers, with timeouts; how ranks are reached is the subclass's."""

    opts: RankOptions
    size: int
    info: list[Any]

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._answers: dict[tuple[int, int], tuple[bool, Any]] = {}

    # what a subclass provides
    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _receive(self, timeout: float) -> tuple[int, int, bool, Any]:
        """The next answer; ``queue.Empty`` if none came within ``timeout``."""
        raise NotImplementedError

    def _dead(self, rank: int) -> str | None:
        """Why ``rank`` is dead, or ``None`` while it lives."""
        raise NotImplementedError

    # shared
    def ranks_of(self, cell: int) -> tuple[int, ...]:
        n = self.opts.cell_size
        return tuple(range(cell * n, (cell + 1) * n))

    def submit(self, ranks: Sequence[int], method: str, *args: Any, **kwargs: Any) -> Ticket:
        seq = next(self._seq)
        for r in ranks:
            self._send(r, (seq, method, args, kwargs))
        return Ticket(tuple(ranks), seq)

    def wait(self, ticket: Ticket, timeout: float = 120.0) -> list[Any]:
        return self._collect(ticket, timeout)

    def failure(self, ticket: Ticket) -> str | None:
        """Without waiting: why the ticket's work already failed (a rank raised or died), or
        ``None`` while it runs or once it succeeded. The answers that have come are filed as
        :meth:`wait` files them, so a later wait still finds them."""
        while True:
            try:
                r, seq, ok, payload = self._receive(0.0)
            except queue_mod.Empty:
                break
            self._answers[(r, seq)] = (ok, payload)
        return self._stopped(ticket)

    def _stopped(self, ticket: Ticket) -> str | None:
        """Why the ticket cannot complete, from the answers filed so far: a rank raised (its peers
        may be blocked on it, so nobody waits for them) or died before answering."""
        failed = [r for r in ticket.ranks if not self._answers.get((r, ticket.seq), (True,))[0]]
        if failed:
            return "\n".join(f"rank {r}: {self._answers[(r, ticket.seq)][1]}" for r in failed)
        dead = {r: why for r in ticket.ranks if (r, ticket.seq) not in self._answers
                and (why := self._dead(r)) is not None}
        if dead:
            return f"rank(s) {sorted(dead)} died ({'; '.join(dead.values())})"
        return None

    def call(self, ranks: Sequence[int], method: str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        return self.wait(self.submit(ranks, method, *args, **kwargs), timeout)

    def _collect(self, ticket: Ticket, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while not all((r, ticket.seq) in self._answers for r in ticket.ranks):
            why = self._stopped(ticket)
            if why is not None:
                raise RankError(why)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ticket.ranks if (r, ticket.seq) not in self._answers]
                raise RankError(f"no answer from rank(s) {missing} within {timeout} s")
            try:  # short: another thread (``failure``) may file this ticket's answer meanwhile
                r, seq, ok, payload = self._receive(min(left, 0.05))
                self._answers[(r, seq)] = (ok, payload)
            except queue_mod.Empty:
                pass
        out = []
        errors = []
        for r in ticket.ranks:
            ok, payload = self._answers.pop((r, ticket.seq))
            (out if ok else errors).append(payload if ok else f"rank {r}: {payload}")
        if errors:
            raise RankError("\n".join(errors))
        return out

    def _join(self, timeout: float) -> None:
        """Wait for every rank's start-up answer; stop what was started if one never comes."""
        try:
            self.info = self._collect(Ticket(tuple(range(self.size)), -1), timeout)
        except BaseException:
            self.close()
            raise

    def alloc_queue(self) -> int:
        """Index of a micro-step queue nobody used yet (one per step or redo)."""
        i = self._next_queue
        if i >= len(self.queues):
            raise RuntimeError(f"all {len(self.queues)} micro-step queues used (raise max_steps)")
        self._next_queue += 1
        return i

    def __enter__(self) -> "_Ranks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


class World(_Ranks):
    """The ranks of K cells, spawned by this process on this machine."""

    def __init__(self, opts: RankOptions, n_queues: int = 4, start_timeout_s: float = 120.0) -> None:
        super().__init__()
        self.opts = opts
        self.size = opts.cells * opts.cell_size
        self.ctx = mp.get_context("spawn")
        self.queues = [MicroStepQueue(self.ctx) for _ in range(n_queues)]
        self._next_queue = 0
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._spawn()

    def _spawn(self) -> None:
        # Answers and commands get new pipes each time: a rank killed while writing one may have
        # left it half-written or locked.
        self._res = self.ctx.Queue()
        self._cmd = [self.ctx.Queue() for _ in range(self.size)]
        port = self.port = _free_port()  # the ranks' rendezvous: rank 0 serves the c10d store there
        self.procs = [
            self.ctx.Process(target=worker_main, args=(r, self.size, port, self.opts, self.queues, self._cmd[r], self._res),
                             daemon=True, name=f"gyre-rank{r}")
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()
        self._join(self.start_timeout_s)

    def restart(self) -> None:
        """Every rank anew, in a new process group: the way back for a cell whose rank died.

        Torch cannot admit a new process into a process group, so one dead rank means a new world:
        the survivors are stopped and all ``cells × pp`` ranks spawned again (the micro-step queues
        are kept; unused ones still serve later steps). The new ranks hold freshly built models:
        carrying the core's training state across is the caller's part
        (:meth:`gyre_megatron.side.MegatronTrainingSide.restart_ranks`)."""
        self.close()
        self._answers.clear()
        self.restarts += 1
        self._spawn()

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        self._cmd[rank].put(message)

    def _receive(self, timeout: float) -> tuple[int, int, bool, Any]:
        return self._res.get(timeout=timeout)  # type: ignore[no-any-return]

    def _dead(self, rank: int) -> str | None:
        p = self.procs[rank]
        if p.is_alive():
            return None
        where = f" (its output: {os.path.join(self.opts.log_dir, f'rank{rank}.log')})" if self.opts.log_dir else ""
        return f"rank {rank} exit code {p.exitcode}{where}"

    def close(self, timeout: float = 10.0) -> None:
        for r, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self._cmd[r].put((-2, "exit", (), {}))
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
                p.join(5)


class _HubQueues:
    """The orchestrator's micro-step queues of a cluster world (created on first use)."""

    def __init__(self, server: Any, n: int) -> None:
        self._server, self._n = server, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> MicroStepQueue[Any]:
        if not 0 <= index < self._n:
            raise IndexError(index)
        return self._server.hub.microstep_queue(index)


class RemoteEngine:
    """A cell's SGLang server that the cell's first rank started on its own node."""

    def __init__(self, world: "ClusterWorld", rank: int, engine_id: int, url: str) -> None:
        self.world, self.rank, self.engine_id, self.url = world, rank, engine_id, url

    def alive(self) -> None:
        """Not told from here: the watchdog's health checks decide for an engine on another node."""
        return None

    def placement(self) -> str:
        return f"started by rank {self.rank}"

    def stop(self) -> None:
        self.world.engine_call(self.rank, "stop", self.engine_id)

    def kill(self) -> None:
        self.world.engine_call(self.rank, "kill", self.engine_id)


class ClusterWorld(_Ranks):
    """The ranks of K cells, started by a cluster launcher (``torchrun``) on any number of nodes.

    The orchestrator serves the control plane (:mod:`gyre_megatron.control`) on ``(host, port)``
    and waits up to ``join_timeout_s`` for ``cells × tp × pp`` ranks to report in; the key in
    ``key_file`` (created, 0600, if absent) must be readable on every node. Each node runs::

        GYRE_CONTROL=host:port GYRE_CONTROL_KEY_FILE=key torchrun --nnodes N --nproc-per-node G \\
            --rdzv-backend c10d --rdzv-endpoint head:29400 -m gyre_megatron.worker

    Global ranks are assigned node by node, so cell c (the ``n = tp·pp`` ranks from ``c·n``)
    lives on one node when ``n`` divides the ranks per node -- and its SGLang server is started there too
    (:meth:`start_engine`), on the same devices.
    """

    def __init__(self, opts: RankOptions, n_queues: int, host: str, port: int, key_file: str,
                 join_timeout_s: float = 600.0, dead_after_s: float = 15.0,
                 announce: Any = None) -> None:
        from gyre_megatron.control import ADDRESS_ENV, KEY_ENV, ControlServer, read_key, write_key

        super().__init__()
        self.opts = opts
        self.size = opts.cells * opts.cell_size
        self.dead_after_s = dead_after_s
        key = read_key(key_file) if os.path.exists(key_file) else write_key(key_file)
        self.server = ControlServer(self.size, opts, host, port, key)
        self.queues = _HubQueues(self.server, n_queues)
        self._next_queue = 0
        h, p = self.server.address
        if h in ("0.0.0.0", "::", ""):
            h = socket.getfqdn()  # what the other nodes dial
        self.command = (f"{ADDRESS_ENV}={h}:{p} {KEY_ENV}={key_file} torchrun --nnodes <nodes> "
                        f"--nproc-per-node <{self.size} / nodes> --rdzv-backend c10d --rdzv-endpoint <head>:29400 "
                        f"-m gyre_megatron.worker")
        if announce is not None:
            announce(f"waiting for {self.size} rank(s) to join; on each node run: {self.command}")
        self._join(join_timeout_s)

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        self.server.send_command(rank, message)  # by value, over the control wire (no pickle)

    def _receive(self, timeout: float) -> tuple[int, int, bool, Any]:
        return self.server.hub.results.get(timeout=timeout)  # type: ignore[no-any-return]

    def _dead(self, rank: int) -> str | None:
        if self.server.hub.refused:  # the launcher started the wrong world: waiting cannot help
            return f"a rank was refused: {self.server.hub.refused[0]}"
        if rank not in self.server.joined():
            return None  # not joined yet: the join timeout decides
        if self.server.seen_within(rank, self.dead_after_s):
            return None
        return f"rank {rank} silent for {self.dead_after_s:.0f} s"

    def engine_call(self, rank: int, op: str, *args: Any, timeout: float = 120.0) -> Any:
        seq = next(self._seq)
        self.server.send_engine(rank, (seq, op, args, {}))
        return self._collect(Ticket((rank,), seq), timeout)[0]

    def start_engine(self, cell: int, model_dir: str, options: EngineOptions) -> RemoteEngine:
        """Start cell ``cell``'s SGLang server on the cell's node (by its first rank)."""
        rank = self.ranks_of(cell)[0]
        timeout = options.start_timeout_s + 30.0
        engine_id, url = self.engine_call(rank, "start", model_dir, options, timeout=timeout)
        return RemoteEngine(self, rank, engine_id, url)

    def close(self, timeout: float = 10.0) -> None:
        for r in range(self.size):
            self.server.send_engine(r, (-2, "exit", (), {}))
            self._send(r, (-2, "exit", (), {}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.server.seen_within(r, 1.5) for r in self.server.joined()):
            time.sleep(0.25)  # ranks stop beating as they exit
        self.server.close()
