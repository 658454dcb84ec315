"""A KV import from a fragmented pool is read in bounded batches that cover every byte once.

A long context on a busy engine sits in scattered KV slots, so the import has one Mooncake entry
per run of consecutive slots and per buffer; Mooncake's TCP transport refuses a batch that
overfills its queue (seen in a live run: every hand-off of a 1000-token call failed), so the
read is split. Property test over random slot layouts.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_sglang.server_plugin.kv_handoff import _address_runs, _batches


@settings(max_examples=200, deadline=None)
@given(
    src=st.lists(st.integers(0, 4000), min_size=1, max_size=600, unique=True),
    seed=st.integers(0, 2**16),
    n_buffers=st.integers(1, 6),
    batch=st.integers(1, 300),
)
def test_batches_cover_every_token_of_every_buffer_once(src: list[int], seed: int, n_buffers: int, batch: int) -> None:
    import random

    rng = random.Random(seed)
    dst = rng.sample(range(5000), len(src))
    bpt = [rng.choice([64, 128, 256]) for _ in range(n_buffers)]
    src_base = [10**9 * (i + 1) for i in range(n_buffers)]
    dst_base = [10**12 * (i + 1) for i in range(n_buffers)]
    local, remote, lens = _address_runs(src_base, dst_base, bpt, src, dst)
    parts = _batches(local, remote, lens, batch)
    assert all(len(p[2]) <= batch for p in parts)
    flat = [(lo, re_, ln) for p in parts for lo, re_, ln in zip(*p)]
    assert flat == list(zip(local, remote, lens))
    # byte for byte: each (buffer, token) is read once, from its source slot into its destination slot
    want = {(b, dst_base[b] + d * bpt[b], src_base[b] + s * bpt[b]) for b in range(n_buffers) for s, d in zip(src, dst)}
    got = set()
    for lo, re_, ln in flat:
        b = next(i for i in range(n_buffers) if dst_base[i] <= lo < dst_base[i] + 10**11)
        for k in range(ln // bpt[b]):
            got.add((b, lo + k * bpt[b], re_ + k * bpt[b]))
    assert got == want and sum(lens) == len(src) * sum(bpt)

