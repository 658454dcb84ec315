"""The shared queue from which training cells claim micro-steps.

Cells claim as they have capacity, so faster or earlier cells take more micro-steps and all cells
finish a batch at about the same time. Each micro-step is handed out exactly once, across threads
and processes: a claim takes a ticket (a shared counter) under one lock and removes the item from a
``multiprocessing`` queue while still holding it, so no two claimants can get the same item and
none can skip one. Pass the queue to worker processes at creation (as a ``Process`` argument), like
any ``multiprocessing`` primitive.

A claimant may be killed at any moment (a satellite rank that dies mid-step), so waiting never
goes through a ``multiprocessing.Condition``: a process killed inside ``Condition.wait`` stays
counted as a sleeper, and the next ``notify_all`` -- the producer's ``put`` -- waits for it to wake,
forever. Claimants wait on a semaphore instead, a wake-up hint with no owner and no sleeper count
(a token a dead claimant took is made up for: a claimant whose wait times out still looks at the
counters). The lock itself is held only for counter updates and one pipe read.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import pickle
import queue
import time
from typing import Generic, TypeVar

__all__ = ["MicroStepQueue", "QueueClosed"]

T = TypeVar("T")

_SLICE_S = 0.5
"""Longest a waiting claimant sleeps before it looks at the counters without a token."""


class QueueClosed(RuntimeError):
    """An item was put after :meth:`MicroStepQueue.close`."""


class MicroStepQueue(Generic[T]):
    """FIFO of micro-steps with atomic claims and an end-of-stream mark.

    :meth:`claim` returns the next item, ``None`` once the stream is closed and every item has been
    claimed (the cell drains its pipeline), and raises :class:`queue.Empty` if nothing arrived
    within ``timeout`` while the stream is still open (the cell pauses and tries again).
    """

    def __init__(self, ctx: multiprocessing.context.BaseContext | None = None) -> None:
        ctx = ctx or multiprocessing.get_context()
        self._items = ctx.Queue()
        # Micro-steps nobody claimed are worthless once their producer exits: it must not wait for
        # them to drain through the pipe. Items are pickled in put(), so the queue's feeder thread
        # only ever writes bytes and can be abandoned at exit.
        self._items.cancel_join_thread()
        self._lock = ctx.Lock()
        self._wake = ctx.Semaphore(0)  # one token per item put, plus one once closed
        self._enqueued = ctx.Value("q", 0, lock=False)
        self._claimed = ctx.Value("q", 0, lock=False)
        self._closed = ctx.Value("b", 0, lock=False)

    def put(self, item: T) -> None:
        with self._lock:
            if self._closed.value:
                raise QueueClosed("micro-step queue is closed")
            self._items.put(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
            self._enqueued.value += 1
        self._wake.release()

    def close(self) -> None:
        """No more items: claimants get ``None`` once the queue is drained. Idempotent."""
        with self._lock:
            if self._closed.value:
                return
            self._closed.value = 1
        self._wake.release()  # the end-of-stream token, passed on by every claimant that sees it

    def claim(self, timeout: float | None = None) -> T | None:
        raw = self.claim_pickled(timeout)
        return None if raw is None else pickle.loads(raw)

    def claim_pickled(self, timeout: float | None = None) -> bytes | None:
        """:meth:`claim`, the item still pickled: what a claimant on another node receives (a
        tensor must travel by value, not as a handle to this machine's shared memory)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Wake on a token; in slices, so a token lost with a killed claimant costs one slice.
            woke = self._wake.acquire(timeout=_SLICE_S if remaining is None else min(_SLICE_S, remaining))
            with self._lock:
                if self._claimed.value < self._enqueued.value:
                    raw: bytes = self._items.get()  # put before the count rose: it is in the pipe
                    self._claimed.value += 1
                    return raw
                if self._closed.value:
                    if woke:
                        self._wake.release()  # the end-of-stream token: the next claimant's
                    return None
            if remaining is not None and remaining <= 0:
                raise queue.Empty

    def unclaimed(self) -> int:
        """Items enqueued and not yet claimed."""
        with self._lock:
            return int(self._enqueued.value - self._claimed.value)

    @property
    def closed(self) -> bool:
        return bool(self._closed.value)
