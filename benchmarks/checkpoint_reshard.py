"""Training checkpoints (megatron-core distributed format): how long the core takes to save its
state after a step, to load it at the same layout, and to load it at another (gloo, CPU).

A core at TP 2 x PP 1 trains one step and saves (twice: the first save plans, the second is the
steady state a run sees after every step); a core at TP 2 loads it, and a core at TP 1 x PP 2
loads it resharded. Figures: seconds per save and load, the folder's bytes against the state's
(parameters and Adam's two moments, float32). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from gyre_megatron.launch import World
from gyre_megatron.model import ModelSpec
from gyre_megatron.runtime import RankOptions
from gyre_megatron.testing import make_items


def _timed(w: World, method: str, path: str) -> float:
    t0 = time.monotonic()
    w.call(w.ranks_of(0), method, path, timeout=600)
    return round(time.monotonic() - t0, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    spec = ModelSpec(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden, num_attention_heads=8,
                     num_query_groups=4, vocab_size=4096, max_seq_len=256)
    out: dict[str, object] = {"benchmark": "checkpoint_reshard", "layers": a.layers, "hidden": a.hidden}
    with tempfile.TemporaryDirectory(prefix="gyre-ckpt-bench-") as tmp:
        ckpt = str(Path(tmp) / "step0")
        with World(RankOptions(cells=1, tp=2, pp=1, spec=spec), n_queues=1) as w:
            q = w.queues[0]
            for it in make_items(2, seq_len=64, vocab=spec.vocab_size, seed=0):
                q.put(it)
            q.close()
            w.call(w.ranks_of(0), "run_step", 0, 0, timeout=600)
            out["first_save_s"] = _timed(w, "save_checkpoint", ckpt)
            out["save_s"] = _timed(w, "save_checkpoint", ckpt)
            out["load_same_layout_s"] = _timed(w, "load_checkpoint", ckpt)
        with World(RankOptions(cells=1, tp=1, pp=2, spec=spec), n_queues=1) as w:
            out["load_tp2_to_pp2_s"] = _timed(w, "load_checkpoint", ckpt)
        on_disk = sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())
        from megatron.core.dist_checkpointing import load_tensors_metadata

        params = sum(math.prod(t.global_shape) for k, t in load_tensors_metadata(ckpt).items()
                     if not k.startswith("optimizer."))
    out["parameters"] = params
    out["state_mib"] = round(params * 4 * 3 / 2**20, 1)  # weights and Adam's two moments, float32
    out["folder_mib"] = round(on_disk / 2**20, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
