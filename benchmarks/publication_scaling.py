"""Sharded publication at three model sizes: nothing gathers the whole model, and the
orchestrator's memory does not grow with it.

For each size (``--sizes``: ~50M, ~200M and ~500M parameters by default, dense Qwen2 layout,
vocabulary 32000) one cell of ``--pp`` pipeline stages starts from a seeded random init, then:

* **sharded publication** (what ``gyre-orchestrate run`` does): each stage of the core registers its
  own part over Mooncake (``gyre_megatron.export.publish``); the orchestrator process only
  composes the location. ``publish_s`` is the wall time, and each process's peak resident memory
  *during* the publication is sampled every 10 ms (the orchestrator's own and every rank's).
* **an engine's pull**: a separate process runs :class:`~gyre_core.published_weights.WeightPuller`
  (the code SGLang's loader runs) on the location: ``pull_s`` (every part, verified).
* **the old path, for contrast**: the whole model gathered into the orchestrator process in float32
  (``gather_serving_tensors``, which publications used to go through); its peak there.

fp32 on this CPU machine (bf16 needs CUDA here); bytes scale with the dtype. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

SIZES = {  # name -> (hidden, layers, ffn, heads, kv groups)
    "50M": (512, 8, 1408, 8, 4),
    "200M": (1024, 12, 2816, 16, 8),
    "500M": (1536, 16, 4096, 16, 8),
}
VOCAB = 32000

PULLER = r"""
import json, resource, sys, time
from gyre_core.published_weights import WeightPuller
q = WeightPuller("127.0.0.1")
t0 = time.perf_counter()
got = q.pull(sys.argv[1])
total = time.perf_counter() - t0
print(json.dumps({"bytes": got.nbytes, "parts_read_s": got.pull_s, "pull_verify_s": total,
                  "tensors": len(got.entries), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
q.close()
"""


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak_during(pids: list[int], work: Callable[[], Any]) -> tuple[Any, dict[int, float], float]:
    """Run ``work`` while sampling each pid's resident memory every 10 ms: (result, peaks, seconds)."""
    peaks = {p: _rss_mib(p) for p in pids}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for p in pids:
                peaks[p] = max(peaks[p], _rss_mib(p))
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        out = work()
    finally:
        secs = time.perf_counter() - t0
        done.set()
        t.join()
    return out, peaks, secs


def one_size(name: str, pp: int) -> dict[str, Any]:
    from gyre_megatron.export import gather_serving_tensors, publish, release_older_than
    from gyre_core.interfaces import PublicationOptions
    from gyre_megatron.launch import World
    from gyre_megatron.model import ModelSpec
    from gyre_megatron.runtime import RankOptions

    hidden, layers, ffn, heads, groups = SIZES[name]
    spec = ModelSpec(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                     num_query_groups=groups, vocab_size=VOCAB, max_seq_len=2048)
    me = os.getpid()
    with World(RankOptions(cells=1, pp=pp, spec=spec), n_queues=1) as w:
        ranks = [int(i["pid"]) for i in w.info]
        before = {p: _rss_mib(p) for p in [me, *ranks]}
        ref, peaks, publish_s = peak_during([me, *ranks], lambda: publish(w, PublicationOptions(transport="mooncake"), 1))
        proc = subprocess.run([sys.executable, "-c", PULLER, ref.location], capture_output=True, text=True,
                              timeout=900, env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        pulled = json.loads(proc.stdout.strip().splitlines()[-1])
        release_older_than(w, 2)
        # the old path: everything through this process, in float32
        base = _rss_mib(me)
        tensors, old_peaks, gather_s = peak_during([me], lambda: gather_serving_tensors(w))
        params = sum(t.numel() for t in tensors.values())
        del tensors
    return {
        "size": name, "params": params, "pp": pp, "model_mib_fp32": round(params * 4 / 2**20, 1),
        "publish_s": round(publish_s, 3), "pull_s": round(pulled["pull_verify_s"], 3),
        "pulled_mib": round(pulled["bytes"] / 2**20, 1), "puller_peak_rss_mib": round(pulled["peak_rss_mib"], 1),
        "orchestrator_rss_before_mib": round(before[me], 1),
        "orchestrator_peak_during_publish_mib": round(peaks[me], 1),
        "orchestrator_growth_during_publish_mib": round(peaks[me] - before[me], 1),
        "rank_peak_during_publish_mib": [round(peaks[p], 1) for p in ranks],
        "rank_growth_during_publish_mib": [round(peaks[p] - before[p], 1) for p in ranks],
        "old_gather_s": round(gather_s, 3),
        "old_orchestrator_growth_mib": round(old_peaks[me] - base, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50M,200M,500M")
    ap.add_argument("--pp", type=int, default=2)
    a = ap.parse_args()
    rows = [one_size(s, a.pp) for s in a.sizes.split(",")]
    print(json.dumps({"benchmark": "publication_scaling", "transport": "mooncake-tcp-loopback", "dtype": "float32",
                      "sizes": rows}))


if __name__ == "__main__":
    main()
