"""The micro-step queue under contention: every item claimed exactly once, by threads and processes."""

from __future__ import annotations

import multiprocessing
import queue as stdlib_queue
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from gyre_core.dataplane import MicroStepQueue, QueueClosed
from gyre_core.dataplane.materialise import TrainingRow
from gyre_core.dataplane.packing import MicroStep, Pack
from gyre_core.trajectory import TrajectoryRow

ITEMS = 400


def micro_step(i: int) -> MicroStep:
    row = TrajectoryRow(i, 0, 0, torch.tensor([1, i]), torch.tensor([False, True]),
                        torch.tensor([0.0, -1.0]), torch.tensor([-1, 0]))
    return MicroStep(0, i, (Pack((TrainingRow(row, 0, 1.0, torch.tensor([0.0, 1.0])),), 1),))


def claim_all(q: MicroStepQueue, out, delay: float) -> None:
    while True:
        try:
            item = q.claim(timeout=10)
        except stdlib_queue.Empty:  # pragma: no cover - would mean a lost wake-up
            out.put(("stalled", -1))
            return
        if item is None:
            return
        out.put(("claimed", item.index))
        if delay:
            time.sleep(delay)


def produce(q: MicroStepQueue, n: int) -> None:
    for i in range(n):
        q.put(micro_step(i))
        if i % 50 == 0:
            time.sleep(0.002)  # let claimants catch up and wait on an empty, open queue
    q.close()


def test_threads_claim_every_micro_step_exactly_once_and_fast_cells_take_more() -> None:
    q: MicroStepQueue = MicroStepQueue()
    results: list[stdlib_queue.SimpleQueue] = [stdlib_queue.SimpleQueue() for _ in range(6)]
    delays = [0.0, 0.0, 0.0, 0.002, 0.002, 0.002]
    workers = [threading.Thread(target=claim_all, args=(q, r, d)) for r, d in zip(results, delays)]
    for w in workers:
        w.start()
    produce(q, ITEMS)
    for w in workers:
        w.join(timeout=30)
        assert not w.is_alive()
    per_worker = []
    for r in results:
        got = []
        while not r.empty():
            kind, index = r.get()
            assert kind == "claimed"
            got.append(index)
        per_worker.append(got)
    claimed = Counter(i for got in per_worker for i in got)
    assert sorted(claimed) == list(range(ITEMS)) and set(claimed.values()) == {1}
    fast, slow = sum(map(len, per_worker[:3])), sum(map(len, per_worker[3:]))
    assert fast > slow  # work goes to whoever has capacity
    assert q.claim(timeout=0.1) is None and q.unclaimed() == 0


def test_processes_claim_every_micro_step_exactly_once() -> None:
    ctx = multiprocessing.get_context("spawn")
    q: MicroStepQueue = MicroStepQueue(ctx)
    out = ctx.Queue()
    procs = [ctx.Process(target=claim_all, args=(q, out, 0.0)) for _ in range(3)]
    for p in procs:
        p.start()
    produce(q, ITEMS)
    claims = []
    deadline = time.monotonic() + 120  # spawned workers import torch: slow on a loaded machine
    while len(claims) < ITEMS and time.monotonic() < deadline:
        try:
            claims.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
        except stdlib_queue.Empty:
            break
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert all(kind == "claimed" for kind, _ in claims)
    indices = Counter(i for _, i in claims)
    assert sorted(indices) == list(range(ITEMS)) and set(indices.values()) == {1}
    assert q.claim(timeout=0.1) is None


def test_open_empty_queue_times_out_and_a_closed_queue_refuses_puts() -> None:
    q: MicroStepQueue = MicroStepQueue()
    with pytest.raises(stdlib_queue.Empty):
        q.claim(timeout=0.05)
    q.put(micro_step(0))
    q.close()
    with pytest.raises(QueueClosed):
        q.put(micro_step(1))
    assert q.claim(timeout=1).index == 0
    assert q.claim(timeout=1) is None and q.closed


def test_a_producer_exits_promptly_with_micro_steps_left_unclaimed() -> None:
    # more than a pipe buffer of unclaimed data must not keep the producer from exiting
    code = (
        "import torch\n"
        "from gyre_core.dataplane import MicroStepQueue\n"
        "q = MicroStepQueue()\n"
        "q.put(torch.zeros(1_000_000))\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def _wait_forever(q: MicroStepQueue) -> None:
    q.claim(timeout=600)  # killed while waiting here, on an empty open queue


def test_a_claimant_killed_while_waiting_does_not_stall_the_producer_or_the_others() -> None:
    """A satellite rank that dies mid-step is often waiting for its next micro-step; the core's
    stream (and the orchestrator, which puts and closes) must go on as if it had never waited."""
    import os
    import signal

    ctx = multiprocessing.get_context("spawn")
    q: MicroStepQueue = MicroStepQueue(ctx)
    victims = [ctx.Process(target=_wait_forever, args=(q,)) for _ in range(2)]
    for p in victims:
        p.start()
    time.sleep(8.0)  # spawned: they import torch, then wait on the empty queue
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    out = ctx.Queue()
    survivor = ctx.Process(target=claim_all, args=(q, out, 0.0))
    survivor.start()
    t0 = time.monotonic()
    done = threading.Thread(target=produce, args=(q, 20))
    done.start()
    done.join(timeout=30)
    assert not done.is_alive(), "put/close blocked on a dead claimant"
    survivor.join(timeout=120)
    assert survivor.exitcode == 0
    got = sorted(out.get(timeout=5)[1] for _ in range(20))
    assert got == list(range(20)) and time.monotonic() - t0 < 120
