"""Activation recompute (``[training.megatron]`` ``recompute_granularity``) at a long row: a
rank's peak memory over one streamed micro-step with and without it (gloo, CPU, PP 1).

Each setting runs in fresh ranks on the same row; the figure is the kernel's high-water mark of
the rank's resident memory during the micro-step (reset just before it) minus what it held
before: the activations and the gradients. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

from gyre_megatron.launch import World
from gyre_megatron.model import ModelSpec
from gyre_megatron.runtime import RankOptions
from gyre_megatron.testing import make_items

SETTINGS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    spec = ModelSpec(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden, num_attention_heads=8,
                     num_query_groups=4, vocab_size=1024, max_seq_len=a.seq_len)
    out: dict[str, object] = {"benchmark": "recompute_memory", "seq_len": a.seq_len, "layers": a.layers,
                              "hidden": a.hidden}
    for name, table in SETTINGS.items():
        with World(RankOptions(cells=1, pp=1, spec=spec, megatron=table), n_queues=1) as w:
            q = w.queues[0]
            q.put(make_items(1, seq_len=a.seq_len, vocab=spec.vocab_size, seed=0)[0])
            q.close()
            (r,) = w.call(w.ranks_of(0), "step_peak_memory", 0, timeout=600)
        out[name] = {"step_peak_over_before_mib": round(r["peak_mib"] - r["rss_before_mib"], 1),
                     "seconds": round(r["seconds"], 2)}
    base = out["none"]["step_peak_over_before_mib"]  # type: ignore[index]
    for name in ("selective", "full"):
        out[f"{name}_memory_ratio"] = round(out[name]["step_peak_over_before_mib"] / base, 3)  # type: ignore[index]
        out[f"{name}_time_ratio"] = round(out[name]["seconds"] / out["none"]["seconds"], 3)  # type: ignore[index]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
