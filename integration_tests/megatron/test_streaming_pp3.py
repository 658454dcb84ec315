"""§2 at PP = 3: streaming 1F1B over bursty arrivals equals megatron-core's stock 1F1B.

Bursts of 1 and 2 micro-steps put pauses into the warm-up (stage 0 has two outstanding forwards
at PP = 3), the steady phase and just before the drain.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

from gyre_megatron.testing import feed_in_bursts, make_items  # noqa: E402


@pytest.fixture(scope="module")
def world_k1_pp3():
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions

    from gyre_megatron.model import ModelSpec

    opts = RankOptions(cells=1, pp=3, spec=ModelSpec(num_layers=3), data_timeout_s=30, side_timeout_s=30,
                       heartbeat_s=0.3)
    with World(opts, n_queues=2) as w:
        yield w


@pytest.mark.parametrize("n,burst", [(5, 1), (8, 3)])
def test_stream_in_bursts_equals_stock_1f1b_pp3(world_k1_pp3, n: int, burst: int) -> None:
    w = world_k1_pp3
    qi = 0 if burst == 1 else 1
    items = make_items(n, seed=10 + n)
    tk = w.submit(w.ranks_of(0), "stock_vs_stream", items, qi)
    feed_in_bursts(w.queues[qi], items, burst=burst, gap_s=0.7)
    res = w.wait(tk, 120)
    assert res[-1]["stream_losses"] == res[-1]["stock_losses"]
    assert len(res[-1]["stream_losses"]) == n
    for r in res:
        assert r["micro_steps"] == n and r["pauses"] >= 1
        diff = max(float(np.abs(a - b).max()) for a, b in zip(r["stock_grads"], r["stream_grads"]))
        assert diff <= 1e-6, diff
