"""Streaming 1F1B vs megatron-core's stock 1F1B on the same micro-batches (gloo, CPU).

Both schedules run in the same ranks on the same items, fed from memory (no queue, no pauses), so
the ratio is the schedule's own overhead (control messages on the side group). Best of
``--repeats``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from gyre_megatron.launch import World
from gyre_megatron.model import ModelSpec
from gyre_megatron.runtime import RankOptions
from gyre_megatron.testing import make_items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-steps", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    spec = ModelSpec(num_layers=2 * a.pp, hidden_size=a.hidden, ffn_hidden_size=2 * a.hidden,
                     num_attention_heads=4, num_query_groups=2, max_seq_len=a.seq_len)
    t0 = time.monotonic()
    with World(RankOptions(cells=1, pp=a.pp, spec=spec)) as w:
        start_s = time.monotonic() - t0
        items = make_items(a.micro_steps, seq_len=a.seq_len, vocab=spec.vocab_size, seed=0)
        res = w.call(w.ranks_of(0), "time_schedules", items, a.repeats, timeout=600)
    stock = max(r["stock_s"] for r in res)
    stream = max(r["stream_s"] for r in res)
    print(json.dumps({"benchmark": "megatron_streaming_vs_stock", "pp": a.pp, "micro_steps": a.micro_steps,
                      "seq_len": a.seq_len, "hidden": a.hidden, "stock_s": round(stock, 4),
                      "stream_s": round(stream, 4), "ratio_stream_over_stock": round(stream / stock, 3),
                      "world_start_s": round(start_s, 2)}))


if __name__ == "__main__":
    main()
