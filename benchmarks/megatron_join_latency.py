"""A satellite's join latency against the bytes it pulls from the core (Mooncake, loopback TCP).

Two cells of one rank each. For each size the core exposes a buffer through the same
:class:`~gyre_megatron.transfer.SatelliteWeights` path as its weights and the satellite pulls it
(location from the c10d store, one read, CRC32 and manifest checked, copied into place). A real mid-batch join of the model's weights
is timed as well. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from gyre_megatron.launch import World
from gyre_megatron.runtime import RankOptions
from gyre_megatron.testing import make_items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    points = []
    with World(RankOptions(cells=2, pp=1), n_queues=2) as w:
        for mib in (float(x) for x in a.sizes_mib.split(",")):
            nbytes = int(mib * 2**20)
            best = None
            for r in range(a.repeats):
                key = f"bench/{mib}/{r}"
                w.call([0], "expose_buffer", key, nbytes)
                got, secs = w.call([1], "pull_buffer", key, nbytes)[0]
                best = secs if best is None else min(best, secs)
            points.append({"bytes": got, "pull_s": round(best, 5), "gb_per_s": round(got / best / 1e9, 3)})
        # a real join of the model's weights during a running step
        q = w.queues[0]
        items = make_items(6)
        core = w.submit([0], "run_step", 0, 0)
        for it in items[:2]:
            q.put(it)
        t0 = time.monotonic()
        sat = w.submit([1], "run_step", 0, 0)
        time.sleep(0.5)
        for it in items[2:]:
            q.put(it)
        q.close()
        w.wait(core)
        (info,) = w.wait(sat)
        join = {"bytes": info["pull_bytes"], "pull_s": round(info["pull_s"], 5),
                "submit_to_done_s": round(time.monotonic() - t0, 3)}
    print(json.dumps({"benchmark": "megatron_join_latency", "transport": "mooncake-tcp-loopback",
                      "pulls": points, "model_join": join}))


if __name__ == "__main__":
    main()
