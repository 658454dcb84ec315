"""Each training step streams through a micro-step queue of the world its ranks belong to.

A closed world's queues are closed for good; a world started later (the next test, a restarted
run in the same process) must never be handed one of them. CPython reuses a freed object's id at
once, so a step-to-queue map keyed by ``id(world)`` did exactly that: the second world's step 3
got the first world's (closed) queue, and putting a micro-step into it raised ``QueueClosed``.
"""

from __future__ import annotations

import gc

from gyre_megatron.side import MegatronTrainingSide, shutdown_worlds


class _WorldStub:
    """Stands in for a started world: only the queue allocation the side asks of it (no ranks)."""

    def __init__(self) -> None:
        self.allocated = 0

    def alloc_queue(self) -> int:
        self.allocated += 1
        return self.allocated - 1


def _side_on(world: _WorldStub, cell: int) -> MegatronTrainingSide:
    side = MegatronTrainingSide.__new__(MegatronTrainingSide)  # without starting ranks
    side.cell, side.world = cell, world
    return side


def test_a_later_world_never_gets_a_step_queue_of_an_earlier_one() -> None:
    seen_ids = set()
    for _ in range(20):
        world = _WorldStub()
        seen_ids.add(id(world))
        core, satellite = _side_on(world, 0), _side_on(world, 1)
        assert core._queue_index(3) == satellite._queue_index(3) == 0  # one queue per step, shared
        assert core._queue_index(4) == 1
        assert world.allocated == 2
        del world, core, satellite
        gc.collect()
    assert len(seen_ids) < 20  # ids were reused, so the check above covered the reuse
    shutdown_worlds()
