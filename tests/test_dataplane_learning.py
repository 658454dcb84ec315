"""Learning check: a tiny causal LM trained through the whole data plane raises a verifiable reward.

Each execution is a small tree: the prompt and a first response, then two branches that share it --
a tool result followed by a response (main task) and an evaluator critique followed by a response
(summary). Both selected trajectories claim the shared first response, so the run only learns
well if the weights count it once; the critique is context only. Reward: the fraction of sampled
tokens equal to ``TARGET``. Everything between sampling and the optimizer is the real data plane:
trajectory buffer, stream packing buffer, micro-step queue, two passes (ratio sums, then the loss).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from gyre_core.dataplane import (
    MicroStepQueue,
    PackingConfig,
    ScoredExecution,
    StreamPackingBuffer,
    TokenBatch,
    TrajectoryBuffer,
    gspo_loss,
    log_ratio_sums,
    target_logprobs,
)
from gyre_core.interfaces import RoleClass
from gyre_core.scheduler.events import DispatchGroup
from gyre_core.trajectory import Provenance, SelectedTrajectory, TrajectoryTree, TreeNode


VOCAB, TARGET = 12, 7
B, N, STEPS = 4, 8, 30
MARGIN = 0.4


class TinyCausalLM(nn.Module):
    """One pre-norm transformer block over a packed sequence (block-diagonal causal attention)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 24, heads: int = 2, max_len: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``tokens``, ``positions``, ``rows`` (row index per token): ``(T,)`` → logits ``(T, V)``."""
        x = (self.tok(tokens) + self.pos(positions))[None]
        idx = torch.arange(len(tokens))
        blocked = (rows[:, None] != rows[None, :]) | (idx[None, :] > idx[:, None])
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=blocked, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x)[0]


def packed_logprobs(model: TinyCausalLM, batch: TokenBatch) -> torch.Tensor:
    rows = torch.repeat_interleave(torch.arange(len(batch.cu_seqlens) - 1), batch.cu_seqlens.diff())
    logits = model(batch.token_ids, batch.position_ids, rows)
    return target_logprobs(logits, batch.token_ids, batch.cu_seqlens)


@torch.no_grad()
def sample(model: TinyCausalLM, context: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue every context (a batch of equal-length rows) by ``n`` sampled tokens."""
    seqs, logps = context, []
    for _ in range(n):
        t, length = seqs.shape
        positions = torch.arange(length).repeat(t)
        rows = torch.arange(t).repeat_interleave(length)
        logits = model(seqs.reshape(-1), positions, rows).reshape(t, length, -1)[:, -1]
        dist = torch.distributions.Categorical(logits=logits)
        tok = dist.sample()
        logps.append(dist.log_prob(tok))
        seqs = torch.cat([seqs, tok[:, None]], dim=1)
    return seqs[:, context.shape[1]:], torch.stack(logps, dim=1)


def node(nid: int, parent: int | None, context: torch.Tensor, kind: Provenance,
         tokens: torch.Tensor, logps: torch.Tensor) -> TreeNode:
    prov = [int(kind)] * len(context) + [int(Provenance.SAMPLED)] * len(tokens)
    return TreeNode(nid, parent, torch.cat([context, tokens]), torch.tensor(prov),
                    torch.cat([torch.zeros(len(context)), logps]))


def rollout(model: TinyCausalLM, step: int, gen: torch.Generator) -> tuple[list[ScoredExecution], float]:
    """B groups (one prompt each) of N executions, scored by the verifiable reward."""
    prompts = torch.randint(0, VOCAB, (B, 3), generator=gen).repeat_interleave(N, dim=0)
    tool = torch.randint(0, VOCAB, (B * N, 2), generator=gen)
    critique = torch.randint(0, VOCAB, (B * N, 2), generator=gen)
    r1, l1 = sample(model, prompts, 3)
    root = torch.cat([prompts, r1], dim=1)
    r2, l2 = sample(model, torch.cat([root, tool], dim=1), 3)
    r3, l3 = sample(model, torch.cat([root, critique], dim=1), 2)
    sampled = torch.cat([r1, r2, r3], dim=1)
    rewards = (sampled == TARGET).double().mean(dim=1)
    out = []
    for i in range(B * N):
        eid = step * B * N + i
        tree = TrajectoryTree(eid, [
            node(0, None, prompts[i], Provenance.EXTERNAL, r1[i], l1[i]),
            node(1, 0, tool[i], Provenance.EXTERNAL, r2[i], l2[i]),
            node(2, 0, critique[i], Provenance.EVALUATOR, r3[i], l3[i]),
        ])
        selected = (SelectedTrajectory(1, RoleClass.MAIN_AGENT_TASK, frozenset({0, 1})),
                    SelectedTrajectory(2, RoleClass.MAIN_AGENT_SUMMARY, frozenset({0, 2})))
        out.append(ScoredExecution(eid, step * B + i // N, float(rewards[i]), tree, selected))
    return out, float(rewards.mean())


def train_step(model: TinyCausalLM, opt: torch.optim.Optimizer, step: int,
               executions: list[ScoredExecution]) -> None:
    buf = TrajectoryBuffer(N)
    for g in range(B):
        members = executions[g * N:(g + 1) * N]
        buf.dispatch(DispatchGroup(step * B + g, tuple(e.execution_id for e in members), step))
        for e in members:
            buf.put(e)
    queue: MicroStepQueue = MicroStepQueue()
    packer = StreamPackingBuffer(step, buf, queue, PackingConfig(token_budget=64, dp_size=2), B)
    while (gid := buf.oldest_ready()) is not None:
        packer.assign(gid)
    packer.close()
    micro = []
    while (m := queue.claim(timeout=5)) is not None:
        micro.append(m)
    batches = [p.to_batch() for m in micro for p in m.packs if p.rows]
    with torch.no_grad():  # pass 1: the execution ratios need every micro-step
        sums = sum(log_ratio_sums(packed_logprobs(model, b), b) for b in batches)
    opt.zero_grad()
    for b in batches:  # pass 2: gradients summed over micro-steps, as across cells
        gspo_loss(packed_logprobs(model, b), b, sums).backward()
    opt.step()


def test_gspo_through_the_data_plane_raises_the_verifiable_reward() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = TinyCausalLM()
    assert sum(p.numel() for p in model.parameters()) < 10_000
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    started = time.monotonic()
    rewards = []
    for step in range(STEPS):
        executions, mean_reward = rollout(model, step, gen)
        rewards.append(mean_reward)
        train_step(model, opt, step, executions)
    before, after = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward: first 5 steps {before:.3f}, last 5 steps {after:.3f}, "
          f"{time.monotonic() - started:.1f} s")
    assert after - before >= MARGIN, (before, after)
