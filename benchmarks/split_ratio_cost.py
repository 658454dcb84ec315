"""The cost of exact ratios for split executions: one training step with and without the
forward-only pass over each split part's other rows (real megatron-core ranks, gloo, CPU).

A step of ``--executions`` executions of ``--rows`` rows each, row lengths long-tailed (lognormal)
so that a share of the executions do not fit one pack of ``--budget`` tokens together and are
split, packed by the stream packer's own best-fit rule. The same micro-steps are trained twice
from the same weights: as packed (each part carries its execution's other rows, ``Pack.outside``,
run forward only: exact) and with ``outside`` stripped (each part clipped on its own ratio, the
old behaviour). Best of ``--repeats``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import torch

from gyre_core.dataplane.materialise import TrainingRow
from gyre_core.dataplane.packing import MicroStep, _pack, _RowPool, _units
from gyre_core.interfaces import RoleClass
from gyre_core.trajectory import NO_RESPONSE, TrajectoryRow
from gyre_megatron.launch import World
from gyre_megatron.model import ModelSpec
from gyre_megatron.runtime import RankOptions


def make_step(n_exec: int, rows: int, budget: int, vocab: int, seed: int) -> list[MicroStep]:
    rng = random.Random(seed)
    all_rows: list[TrainingRow] = []
    for e in range(n_exec):
        lengths = [max(8, min(budget, int(rng.lognormvariate(5.0, 0.8)))) for _ in range(rows)]
        sampled = sum(n - n // 2 for n in lengths)
        advantage = rng.uniform(-1, 1)  # one per execution, as the objective has it
        for j, n in enumerate(lengths):
            mask = torch.zeros(n, dtype=torch.bool)
            mask[n // 2:] = True
            rid = torch.where(mask, torch.full((n,), 1000 * e + j), torch.full((n,), NO_RESPONSE))
            row = TrajectoryRow(e, e // 4, RoleClass.MAIN_AGENT_TASK, torch.randint(0, vocab, (n,)), mask,
                                torch.where(mask, torch.full((n,), -2.0), torch.zeros(n)), rid)
            weights = torch.where(mask, torch.full((n,), 1.0 / (n_exec * sampled)), torch.zeros(n))
            all_rows.append(TrainingRow(row, e, advantage, weights))
    units, split = _units(all_rows, budget)
    pool = _RowPool()
    for u in units:
        pool.add(u)
    micro = []
    while len(pool):
        packed = tuple(r for u in pool.fill(budget) for r in u)
        micro.append(MicroStep(0, len(micro), (_pack(packed, n_exec, split),)))
    return micro


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executions", type=int, default=32)
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    spec = ModelSpec(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden,
                     num_attention_heads=8, num_query_groups=4, max_seq_len=a.budget)
    micro = make_step(a.executions, a.rows, a.budget, spec.vocab_size, seed=0)
    stripped = [replace(m, packs=tuple(replace(p, outside=()) for p in m.packs)) for m in micro]
    split = len({r.exec_slot for m in micro for p in m.packs for r in p.outside})
    with World(RankOptions(cells=1, pp=1, spec=spec, normalise_by_tokens=False), n_queues=2 * a.repeats) as w:
        core = w.ranks_of(0)
        w.call(core, "save_state")
        times: dict[str, list[float]] = {"exact": [], "per_part": []}
        figures: dict[str, dict] = {}
        for k in range(a.repeats):
            for i, (name, items) in enumerate((("exact", micro), ("per_part", stripped))):
                q = 2 * k + i
                for m in items:
                    w.queues[q].put(m)
                w.queues[q].close()
                t0 = time.monotonic()
                info = w.wait(w.submit(core, "run_step", q, q), 600)
                times[name].append(time.monotonic() - t0)
                figures[name] = info[0]["objective"]
                w.call(core, "restore_state")
    exact, per_part = min(times["exact"]), min(times["per_part"])
    tokens = sum(p.tokens for m in micro for p in m.packs)
    outside = sum(len(r) for m in micro for p in m.packs for r in p.outside)
    print(json.dumps({
        "benchmark": "split_ratio_cost", "executions": a.executions, "split_executions": split,
        "micro_steps": len(micro), "budget": a.budget, "hidden": a.hidden, "layers": a.layers,
        "trained_tokens": tokens, "ratio_pass_tokens": outside,
        "step_s_exact": round(exact, 3), "step_s_per_part": round(per_part, 3),
        "extra_fraction_of_step": round((exact - per_part) / exact, 4),
        "ratio_pass_s": round(figures["exact"]["ratio_pass_s"], 3),
        "ratio_pass_fraction_of_step": round(figures["exact"]["ratio_pass_s"] / exact, 4),
        # executions counted as such when exact; without the pass each part counts as one
        "executions_exact": round(figures["exact"]["executions"], 3),
        "clipped_exact": round(figures["exact"]["clipped"], 3),
        "counted_per_part": round(figures["per_part"]["executions"], 3),
        "clipped_per_part": round(figures["per_part"]["clipped"], 3),
    }))


if __name__ == "__main__":
    main()
