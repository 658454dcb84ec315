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
from gyre_megatron.runtime import RankOptions, worker_main

__all__ = ["RankError", "World"]


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


class World:
    def __init__(self, opts: RankOptions, n_queues: int = 4, start_timeout_s: float = 120.0) -> None:
        self.opts = opts
        self.size = opts.cells * opts.pp
        self.ctx = mp.get_context("spawn")
        self.queues = [MicroStepQueue(self.ctx) for _ in range(n_queues)]
        self._res = self.ctx.Queue()
        self._cmd = [self.ctx.Queue() for _ in range(self.size)]
        self._seq = itertools.count()
        self._next_queue = 0
        self._answers: dict[tuple[int, int], tuple[bool, Any]] = {}
        port = _free_port()
        self.procs = [
            self.ctx.Process(target=worker_main, args=(r, self.size, port, opts, self.queues, self._cmd[r], self._res),
                             daemon=True, name=f"gyre-rank{r}")
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()
        try:
            self.info = self._collect(Ticket(tuple(range(self.size)), -1), start_timeout_s)
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

    def ranks_of(self, cell: int) -> tuple[int, ...]:
        return tuple(range(cell * self.opts.pp, (cell + 1) * self.opts.pp))

    def submit(self, ranks: Sequence[int], method: str, *args: Any, **kwargs: Any) -> Ticket:
        seq = next(self._seq)
        for r in ranks:
            self._cmd[r].put((seq, method, args, kwargs))
        return Ticket(tuple(ranks), seq)

    def wait(self, ticket: Ticket, timeout: float = 120.0) -> list[Any]:
        return self._collect(ticket, timeout)

    def call(self, ranks: Sequence[int], method: str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        return self.wait(self.submit(ranks, method, *args, **kwargs), timeout)

    def _collect(self, ticket: Ticket, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while not all((r, ticket.seq) in self._answers for r in ticket.ranks):
            failed = [r for r in ticket.ranks if not self._answers.get((r, ticket.seq), (True,))[0]]
            if failed:  # one rank raised: its peers may be blocked on it, do not wait for them
                raise RankError("\n".join(f"rank {r}: {self._answers[(r, ticket.seq)][1]}" for r in failed))
            dead = [r for r in ticket.ranks if not self.procs[r].is_alive() and (r, ticket.seq) not in self._answers]
            if dead:
                raise RankError(f"rank(s) {dead} died (exit codes {[self.procs[r].exitcode for r in dead]})")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ticket.ranks if (r, ticket.seq) not in self._answers]
                raise RankError(f"no answer from rank(s) {missing} within {timeout} s")
            try:
                r, seq, ok, payload = self._res.get(timeout=min(left, 0.5))
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

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
