"""Benchmark: packing efficiency of the stream packing buffer on a paper-like length mix.

One training step of B = 32 groups of N = 16 executions (the paper's NL2RepoBench setting). Each
execution has one or two long main-agent trajectories (a second one after a compaction restarts
the context) and up to three short sub-agent trajectories, stored as trajectory trees of
tool-result + response segments; J ≤ 5. Lengths are the paper's scaled down 4× so that a step
fits this 2-core box: main trajectories 4–16 K tokens, sub-agents 128–1 K, a 16 K-token budget per
rank (efficiency depends on lengths relative to the budget, which the scaling keeps). Groups are
assigned one at a time, as the scheduler streams them, and the stream is closed after the last.

Efficiency = (trainable + context tokens emitted) / (micro-steps × dp ranks × token budget); target
≥ 98 %. The default packs whole executions (exact execution ratios for the GSPO objective); the
same step packed row by row is reported next to it. Prints one JSON object.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time

import torch

from gyre_core.dataplane import MicroStepQueue, PackingConfig, ScoredExecution, StreamPackingBuffer, TrajectoryBuffer
from gyre_core.interfaces import RoleClass
from gyre_core.scheduler.events import DispatchGroup
from gyre_core.trajectory import Provenance, SelectedTrajectory, TrajectoryTree, TreeNode

GROUPS, GROUP_SIZE = 32, 16
TOKEN_BUDGET, DP_SIZE = 16384, 2
TARGET = 0.98


def _segment(rng: random.Random, nid: int, parent: int | None, context: int, sampled: int) -> TreeNode:
    n = context + sampled
    prov = torch.full((n,), int(Provenance.EXTERNAL), dtype=torch.int8)
    prov[context:] = int(Provenance.SAMPLED)
    logprobs = torch.zeros(n)
    logprobs[context:] = -torch.rand(sampled, generator=torch.Generator().manual_seed(rng.getrandbits(32))) * 2
    return TreeNode(nid, parent, torch.randint(0, 150_000, (n,)), prov, logprobs)


def _chain(rng: random.Random, tree: TrajectoryTree, length: int, first_context: int,
           step_context: tuple[int, int], step_sampled: tuple[int, int]) -> list[int]:
    """A linear trajectory of about ``length`` tokens from the root; returns its node ids."""
    nids: list[int] = []
    total, context = 0, first_context
    while True:
        sampled = rng.randint(*step_sampled)
        if nids and total + context + sampled > length:
            return nids
        nid = len(list(tree))
        tree.add(_segment(rng, nid, nids[-1] if nids else None, context, sampled))
        nids.append(nid)
        total += context + sampled
        context = rng.randint(*step_context)


def paper_like_execution(rng: random.Random, execution_id: int, group_id: int, reward: float) -> ScoredExecution:
    tree = TrajectoryTree(execution_id)
    selected = []
    n_main = 1 if rng.random() < 0.7 else 2  # the main agent, restarted once by a compaction
    for _ in range(n_main):
        length = int(math.exp(rng.uniform(math.log(4096), math.log(TOKEN_BUDGET))))
        nodes = _chain(rng, tree, length, rng.randint(800, 2000), (40, 600), (20, 300))
        selected.append(SelectedTrajectory(nodes[-1], RoleClass.MAIN_AGENT_TASK, frozenset(nodes)))
    for _ in range(rng.randint(2, 5 - n_main)):  # sub-agents: short, own context; J ≤ 5
        length = int(math.exp(rng.uniform(math.log(128), math.log(4096))))
        nodes = _chain(rng, tree, length, rng.randint(60, 200), (20, 200), (10, 120))
        selected.append(SelectedTrajectory(nodes[-1], RoleClass.SUB_AGENT_TASK, frozenset(nodes)))
    return ScoredExecution(execution_id, group_id, reward, tree, tuple(selected))


def paper_like_step(seed: int = 0) -> TrajectoryBuffer:
    """A trajectory buffer holding B ready groups of N paper-like executions."""
    rng = random.Random(seed)
    buf = TrajectoryBuffer(GROUP_SIZE)
    for g in range(GROUPS):
        eids = tuple(range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE))
        buf.dispatch(DispatchGroup(g, eids, 0))
        for eid in eids:
            buf.put(paper_like_execution(rng, eid, g, rng.random()))
    return buf


def main() -> None:
    torch.set_num_threads(1)  # the data plane's ops are small: intra-op threads only add sync latency
    buf = paper_like_step()
    queue: MicroStepQueue = MicroStepQueue()
    packer = StreamPackingBuffer(0, buf, queue, PackingConfig(TOKEN_BUDGET, DP_SIZE), GROUPS)
    started = time.perf_counter()
    while (gid := buf.oldest_ready()) is not None:
        packer.assign(gid)
    before_close = packer.micro_steps
    packer.close()
    seconds = time.perf_counter() - started
    rows = trainable = 0
    lengths = []
    while (m := queue.claim(timeout=10)) is not None:
        for p in m.packs:
            rows += len(p.rows)
            lengths += [len(r) for r in p.rows]
            trainable += sum(int(r.row.loss_mask.sum()) for r in p.rows)
    # the same step packed row by row (whole_executions=False): the price of exact execution ratios
    row_buf = paper_like_step()
    row_packer = StreamPackingBuffer(0, row_buf, MicroStepQueue(),
                                     PackingConfig(TOKEN_BUDGET, DP_SIZE, whole_executions=False), GROUPS)
    while (gid := row_buf.oldest_ready()) is not None:
        row_packer.assign(gid)
    row_packer.close()
    json.dump({
        "benchmark": "dataplane_packing",
        "efficiency": round(packer.efficiency, 5),
        "whole_executions": True,
        "split_executions": packer.split_executions,
        "efficiency_row_level": round(row_packer.efficiency, 5),
        "row_level_meets_target": row_packer.efficiency >= TARGET,
        "target": TARGET,
        "meets_target": packer.efficiency >= TARGET,
        "groups": GROUPS,
        "group_size": GROUP_SIZE,
        "token_budget": TOKEN_BUDGET,
        "dp_size": DP_SIZE,
        "micro_steps": packer.micro_steps,
        "micro_steps_before_close": before_close,
        "rows": rows,
        "rows_over_4k_tokens": sum(1 for n in lengths if n > 4096),
        "rows_under_1k_tokens": sum(1 for n in lengths if n <= 1024),
        "tokens": packer.tokens_emitted,
        "trainable_tokens": trainable,
        "assign_and_close_s": round(seconds, 3),
        "threads": torch.get_num_threads(),
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
