"""The execution-level GSPO objective (paper §5 "Objective").

Notation: a training step consumes B groups of N executions, E = B·N. Execution ``e`` has
advantage ``A_e`` and a set ``U_e`` of *unique* trainable tokens: targets of its selected
trajectories, a response shared by several of them counted once. For a token ``t``,
``δ_t = log π_θ(t) − log π_b(t)`` with ``π_b`` the behaviour policy that sampled it.

* **Advantages** (GRPO style): ``A_e = (r_e − mean(r)) / (std(r) + eps)`` over the group's N valid
  rewards, population std; a group whose rewards are all equal gets zero advantages. Every
  trajectory of an execution inherits ``A_e``.
* **Execution ratio**: ``s_e = exp(mean_{t∈U_e} δ_t)``, the geometric mean of the token ratios over
  the whole execution (GSPO's sequence ratio, at execution level).
* **Execution-level clipping**: PPO's ``min(s·A, clip(s, 1−ε_low, 1+ε_high)·A)`` taken at execution
  level, i.e. an execution whose ``s_e`` left ``[1−ε_low, 1+ε_high]`` in the direction its
  advantage pushes contributes no gradient at all (default bounds ``[0.995, 1.005]``).
* **Token-level importance weights**: inside an unclipped execution each token's gradient is
  weighted by its own ratio ``ŵ_t = min(exp(δ_t), 5)``, detached as in GSPO-token: the per-token
  surrogate ``ŵ_t · exp(log π_θ(t) − sg[log π_θ(t)])`` has value ``ŵ_t`` and gradient
  ``ŵ_t ∇log π_θ(t)``.
* **Execution-level normalisation**: loss ``= −Σ_t W_t · g_e · A_e · ŵ_t · exp(log π_θ − sg[log π_θ])``
  with ``W_t = 1 / (E · |U_e|)`` on one occurrence of each unique token and 0 elsewhere, so every
  execution carries total weight ``1/E`` however many trajectories it has and however long they
  are, and a shared response counts once. ``W_t`` is precomputed at materialisation and carried in
  the rows, which makes the loss a plain sum over tokens: micro-steps of one batch spread over
  cells give the batch loss (and gradient) by summation, with no cross-micro-step normaliser.

``s_e`` needs every token of the execution, and an execution longer than one pack is split over
micro-steps (and possibly over cells). Its numerator and denominator (``Σ W_t δ_t`` and ``Σ W_t``)
are sums: :func:`log_ratio_sums` gives them for the rows at hand. A pack holding part of a split
execution also carries that execution's other rows (:attr:`gyre_core.dataplane.packing.Pack.outside`);
the trainer runs them forward only, without gradient, and passes their sums as ``outside_sums`` to
:func:`microstep_objective`, so every part is clipped on the whole execution's ``s_e``, whichever
cell trains it. π_θ is fixed during a step (the optimizer updates once per step), so every part
sees the same ratio. The cost is one extra forward of a split execution's other rows per part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from gyre_core.interfaces import GSPOConfig  # the settings are an option across the plugin seam

__all__ = [
    "GSPOConfig",
    "TokenBatch",
    "group_advantages",
    "gspo_loss",
    "log_ratio_sums",
    "microstep_objective",
    "target_logprobs",
]


@dataclass(frozen=True)
class TokenBatch:
    """Flat per-token tensors of one packed sequence (one data-parallel rank of a micro-step).

    Rows are concatenated; ``cu_seqlens`` holds their boundaries (``[0, len_0, len_0+len_1, ...]``),
    as varlen attention kernels expect. ``loss_weights`` is ``W_t`` (0 on context tokens and on
    repeated occurrences of a shared response), ``exec_slots`` the execution's index ``0..E−1`` in
    the batch.
    """

    token_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_weights: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    exec_slots: torch.Tensor
    n_executions: int

    @property
    def position_ids(self) -> torch.Tensor:
        """Position of each token inside its own row (positions restart at every row)."""
        lengths = self.cu_seqlens.diff()
        starts = torch.repeat_interleave(self.cu_seqlens[:-1], lengths)
        return torch.arange(len(self.token_ids), device=starts.device) - starts


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """``(r − mean) / (std + eps)`` over one group's valid rewards (population std), in float64."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    n = len(rewards)
    mean = math.fsum(rewards) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def target_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``log π(token_t | tokens_<t of its row)`` for every position of a packed sequence.

    ``logits[t]`` predicts token ``t+1`` of the same row; a row's first token has no prediction
    and gets 0 (it is never a target).
    """
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, token_ids[1:, None]).squeeze(-1)
    out = torch.cat([lp.new_zeros(1), lp])
    first = torch.zeros(len(token_ids), dtype=torch.bool, device=out.device)
    first[cu_seqlens[:-1]] = True
    return torch.where(first, torch.zeros_like(out), out)


def _deltas(logprobs: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """``δ_t`` on weighted tokens, 0 elsewhere (so an unused position can never inject inf/NaN)."""
    d = logprobs - batch.behaviour_logprobs.to(logprobs.dtype)
    return torch.where(batch.loss_weights > 0, d, torch.zeros_like(d))


def log_ratio_sums(logprobs: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """Per execution ``[Σ W_t δ_t, Σ W_t]`` (shape ``(2, E)``, detached): add over micro-steps."""
    w = batch.loss_weights.to(logprobs.dtype)
    d = _deltas(logprobs.detach(), batch)
    out = torch.zeros(2, batch.n_executions, dtype=logprobs.dtype, device=logprobs.device)
    out[0].index_add_(0, batch.exec_slots, w * d)
    out[1].index_add_(0, batch.exec_slots, w)
    return out


def gspo_loss(
    logprobs: torch.Tensor,
    batch: TokenBatch,
    ratio_sums: torch.Tensor,
    config: GSPOConfig = GSPOConfig(),
) -> torch.Tensor:
    """This micro-step's share of the batch loss (a scalar; the batch loss is the sum of shares).

    ``logprobs`` are the current policy's log-probs of each token (:func:`target_logprobs`), with
    gradient; ``ratio_sums`` is :func:`log_ratio_sums` added over *all* micro-steps of the batch.
    """
    if ratio_sums.shape != (2, batch.n_executions):
        raise ValueError(f"ratio_sums: expected shape (2, {batch.n_executions}), got {tuple(ratio_sums.shape)}")
    dtype = logprobs.dtype
    w = batch.loss_weights.to(dtype)
    adv = batch.advantages.to(dtype)
    sums = ratio_sums.to(dtype)
    log_s = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(torch.finfo(dtype).tiny), 0.0)
    s = torch.exp(log_s)[batch.exec_slots]
    clipped = ((adv > 0) & (s > 1 + config.clip_high)) | ((adv < 0) & (s < 1 - config.clip_low))
    token_weight = torch.exp(_deltas(logprobs.detach(), batch)).clamp(max=config.token_weight_cap)
    surrogate = token_weight * torch.exp(logprobs - logprobs.detach())
    return -(w * torch.where(clipped, 0.0, adv) * surrogate).sum()


def microstep_objective(
    logprobs: torch.Tensor,
    batch: TokenBatch,
    config: GSPOConfig = GSPOConfig(),
    outside_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This pack's share of the batch loss, and its figures.

    ``outside_sums`` (shape ``(2, E)``) are :func:`log_ratio_sums` of the rows of this pack's split
    executions that other packs hold (the trainer's forward-only pass over
    :attr:`~gyre_core.dataplane.packing.Pack.outside`); with them every execution's ratio is its
    whole-execution ``s_e``. Without them the ratio is taken over the rows in this pack, which is
    exact for every execution the packer kept whole.

    The figures (detached, additive over packs except ``ratio_max``): ``loss``; ``executions``
    and ``clipped`` (executions with a trainable token here, and those whose ``s_e`` left the
    bounds in the direction of their advantage; a split execution counts in each pack by the
    share of its weight ``Σ W_t`` held there, so the parts add up to one execution);
    ``ratio_sum``, ``ratio_max`` and ``tokens`` over the weighted tokens' raw ratios ``π/π_b``.
    """
    here = log_ratio_sums(logprobs, batch)
    sums = here if outside_sums is None else here + outside_sums.to(here.dtype)
    loss = gspo_loss(logprobs, batch, sums, config)
    with torch.no_grad():
        present = here[1] > 0
        tiny = torch.finfo(sums.dtype).tiny
        log_s = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(tiny), 0.0)
        s = torch.exp(log_s)
        total_w = sums[1].to(torch.float64)
        share = torch.where(present, here[1].to(torch.float64) / total_w.clamp_min(tiny), 0.0)  # 1 if whole
        adv = torch.zeros(batch.n_executions, dtype=sums.dtype, device=sums.device)
        adv[batch.exec_slots] = batch.advantages.to(sums.dtype)  # one advantage per execution
        clipped = present & (((adv > 0) & (s > 1 + config.clip_high)) | ((adv < 0) & (s < 1 - config.clip_low)))
        weighted = batch.loss_weights > 0
        ratio = torch.exp(_deltas(logprobs.detach(), batch))[weighted]
        stats = {
            "loss": loss.detach().to(torch.float64),
            "executions": share.sum(),
            "clipped": (share * clipped).sum(),
            "ratio_sum": ratio.to(torch.float64).sum(),
            "ratio_max": ratio.max().to(torch.float64) if len(ratio) else torch.zeros((), dtype=torch.float64),
            "tokens": weighted.sum().to(torch.float64),
        }
    return loss, stats
