"""Shared launches for the megatron-core tests: one world of ranks serves several tests.

Start-up (spawning ranks, importing megatron-core, building groups) costs most of each test's
time, so the worlds are module-scoped and torn down (every rank stopped, by pid) at module end.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

DATA_TIMEOUT_S = 4.0
"""Timeout of the data groups in the shared worlds: short, so the pause test is meaningful."""


@pytest.fixture(scope="module")
def world_k2_pp2():
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions

    opts = RankOptions(cells=2, pp=2, data_timeout_s=DATA_TIMEOUT_S, side_timeout_s=DATA_TIMEOUT_S,
                       heartbeat_s=0.5, store_timeout_s=60.0)
    with World(opts, n_queues=6) as w:
        yield w
