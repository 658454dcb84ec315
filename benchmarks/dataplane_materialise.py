"""Benchmark: materialisation throughput, from stored trajectory trees to token rows.

Reads the paper-like step of ``dataplane_packing.py`` (B = 32 groups of N = 16 executions, trees of
tool-result + response segments, J ≤ 5 selected trajectories each) and times, on one thread:

* ``rows``: every selected root-to-leaf path into a validated ``TrajectoryRow``;
* ``weighted``: whole groups through ``materialise_group`` (rows plus the objective's per-token
  weights, with shared-response de-duplication), which is what the packing buffer runs.

Throughput counts the tokens of the produced rows (trainable and context). Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dataplane_packing import GROUP_SIZE, GROUPS, paper_like_step
from gyre_core.dataplane import materialise_group
from gyre_core.trajectory import TrajectoryRow


def main() -> None:
    torch.set_num_threads(1)
    buf = paper_like_step()
    groups = [buf.take(gid) for gid in buf.ready()]

    started = time.perf_counter()
    rows = [
        TrajectoryRow.from_tree(s.tree, sel, g.group_id)
        for g in groups for s in g.executions if s.tree is not None for sel in s.selected
    ]
    rows_s = time.perf_counter() - started
    row_tokens = sum(len(r) for r in rows)

    started = time.perf_counter()
    weighted = [r for k, g in enumerate(groups) for r in materialise_group(g, k * GROUP_SIZE, GROUPS * GROUP_SIZE)]
    weighted_s = time.perf_counter() - started
    weighted_tokens = sum(len(r) for r in weighted)

    nodes = sum(len(list(s.tree)) for g in groups for s in g.executions if s.tree is not None)
    json.dump({
        "benchmark": "dataplane_materialise",
        "rows_tokens_per_s": round(row_tokens / rows_s),
        "weighted_tokens_per_s": round(weighted_tokens / weighted_s),
        "rows": len(rows),
        "tokens": row_tokens,
        "tree_nodes": nodes,
        "rows_s": round(rows_s, 3),
        "weighted_s": round(weighted_s, 3),
        "threads": torch.get_num_threads(),
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
