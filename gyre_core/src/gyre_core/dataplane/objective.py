"""The objectives a step trains on: execution-level GSPO (paper §5 "Objective", the default),
GRPO, DAPO, CISPO or a user's own, with an optional sampler–trainer correction.

**GSPO** first.

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

**The other objectives** (``training.objective``), all on the same rows, advantages and
``r_t = exp(δ_t)``; the token-level ones need no whole-execution ratio, so a split execution's
other rows are not run for them:

* ``grpo`` (DeepSeekMath; verl/slime's default): PPO's per-token clip,
  ``loss = −Σ_t W_t · min(r_t A_e, clip(r_t, 1−ε_low, 1+ε_high) A_e)``, ε = 0.2. With ``W_t`` this
  is GRPO's mean over each sample's tokens then over samples, the sample being the execution.
* ``dapo`` (DAPO): the same per-token clip with clip-higher (ε_low 0.2, ε_high 0.28) and
  token-level normalisation: every trained token weighs ``V_t = 1 / (E · L)``, ``L =
  training.token_normaliser``, so a long execution counts for more than a short one. DAPO divides
  by the batch's token count instead; a streamed step trains its first groups before the last
  ones have finished, when that count is not known yet, so Gyre divides by a constant, as
  Dr. GRPO does: the same gradient direction as DAPO's token mean, scaled by ``T / (E · L)``.
  DAPO's dynamic sampling is what Gyre's groups already do for equal rewards (zero advantages,
  no gradient); its overlong shaping is a reward decision, left to the task's reward.
* ``cispo`` (MiniMax-M1): no token is dropped; the IS weight is clipped and detached,
  ``loss = −Σ_t V_t · sg(clip(r_t, 1−ε_low, 1+ε_high)) · A_e · log π_θ(t)`` (ε_low 1: no lower
  bound; ε_high 0.28), token-level normalised as DAPO.
* a function of the user's (``"file.py:function"``, :func:`load_custom_objective`), called per
  micro-step by keyword with ``logprobs`` (with gradient), ``behaviour_logprobs``,
  ``advantages``, ``loss_weights`` (``W_t``), ``exec_ids`` (each token's execution slot
  ``0..E−1``), ``n_executions`` and ``outside_sums`` (:func:`log_ratio_sums` of a split
  execution's rows held elsewhere, or ``None``), returning this micro-step's share of the loss: a
  scalar whose sum over micro-steps is the batch loss.

**The sampler–trainer correction** (``training.correction``). The engine samples with its
kernels and batch shapes, the trainer recomputes with others; even at staleness 0 the two
log-probs differ (in bf16 on GPUs, noticeably). With a correction, the trainer's own log-prob is
the denominator of the policy ratio, and the sampler-to-trainer ratio
``ρ_t = π_trainer(t) / π_b(t)`` becomes a detached per-token weight ``c_t``:

* ``tis`` (truncated IS): ``c_t = clip(ρ_t, low, high)`` (0, 2);
* ``mis`` (masked IS): ``c_t = ρ_t`` inside ``[low, high]`` (0, 2), else 0: the token is not trained;
* ``icepop``: the same mask, two-sided by default (0.5, 5), as IcePop has it.

The trainer's log-prob of the version that sampled a token costs no extra forward here: a step
makes one optimizer update, so while its loss is computed the trainer's weights are those of the
step's version, and ``sg[log π_θ]`` is that recompute. The objective then runs with
``π_b := sg[π_θ]`` (every ratio 1 in value, so nothing is clipped and the gradient is the policy
gradient's) and each token's term times ``c_t``. A token sampled by an older version (staleness
``d > 0``) has no recompute of that version -- its weights are gone -- so ``ρ_t`` is taken against
the current one: AReaL's decoupled objective with the current policy as the proximal one, the
weight covering staleness and mismatch together. A correction needs no whole-execution ratio,
so GSPO with one skips the forward pass over a split execution's other rows too.

**A KL penalty to the reference policy** (``training.kl_coef`` β > 0, :func:`kl_penalty`): the
loss gains ``β · Σ_t w_t · KL_t`` over the trained tokens, ``w_t`` the objective's own token
weights (``W_t``, or ``V_t`` for DAPO and CISPO), ``KL_t`` an estimate of KL(π_θ ‖ π_ref) from the
sampled token (:func:`kl_to_reference`: k1, k3 or k3 clamped), with gradient through log π_θ. The
trainer runs each micro-step forward through the frozen reference weights first and hands the
per-token ``ref_logprobs`` to :func:`microstep_objective`.

Whatever the objective, the figures carry the sampler–trainer gap on the trained tokens:
``|δ_t|`` (sum and max) and the K3 estimate of KL(π_b ‖ π_θ), ``r_t − 1 − δ_t``, per token
(Schulman's k3: unbiased, never negative, for tokens sampled from π_b).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

# the settings are an option across the plugin seam
from gyre_core.interfaces import OBJECTIVE_CLIPS, OBJECTIVES, GSPOConfig, ObjectiveConfig
from gyre_core.user_code import load_user_function

CUSTOM_ARGUMENTS = ("logprobs", "behaviour_logprobs", "advantages", "loss_weights", "exec_ids",
                    "n_executions", "outside_sums")
"""The keywords a custom objective is called with."""

__all__ = [
    "CUSTOM_ARGUMENTS",
    "GSPOConfig",
    "OBJECTIVES",
    "OBJECTIVE_CLIPS",
    "ObjectiveConfig",
    "TokenBatch",
    "correction_weights",
    "kl_penalty",
    "kl_to_reference",
    "load_custom_objective",
    "objective_loss",
    "group_advantages",
    "gspo_loss",
    "log_ratio_sums",
    "microstep_objective",
    "target_logprobs",
    "token_level_loss",
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
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-step's share of the batch loss (a scalar; the batch loss is the sum of shares).

    ``logprobs`` are the current policy's log-probs of each token (:func:`target_logprobs`), with
    gradient; ``ratio_sums`` is :func:`log_ratio_sums` added over *all* micro-steps of the batch.
    """
    if ratio_sums.shape != (2, batch.n_executions):
        raise ValueError(f"ratio_sums: expected shape (2, {batch.n_executions}), got {tuple(ratio_sums.shape)}")
    dtype = logprobs.dtype
    w = batch.loss_weights.to(dtype) if scale is None else batch.loss_weights.to(dtype) * scale.to(dtype)
    adv = batch.advantages.to(dtype)
    sums = ratio_sums.to(dtype)
    log_s = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(torch.finfo(dtype).tiny), 0.0)
    s = torch.exp(log_s)[batch.exec_slots]
    clipped = ((adv > 0) & (s > 1 + config.clip_high)) | ((adv < 0) & (s < 1 - config.clip_low))
    token_weight = torch.exp(_deltas(logprobs.detach(), batch)).clamp(max=config.token_weight_cap)
    surrogate = token_weight * torch.exp(logprobs - logprobs.detach())
    return -(w * torch.where(clipped, 0.0, adv) * surrogate).sum()


def _token_weights(batch: TokenBatch, config: ObjectiveConfig, dtype: torch.dtype) -> torch.Tensor:
    """Per-token loss weights: ``W_t`` (per-execution mean) for GRPO, ``V_t = 1 / (E · L)`` on the
    same trained tokens for the token-normalised DAPO and CISPO."""
    w = batch.loss_weights.to(dtype)
    if config.kind in ("dapo", "cispo"):
        v = torch.full_like(w, 1.0 / (batch.n_executions * config.token_normaliser))
        return torch.where(w > 0, v, torch.zeros_like(w))
    return w


def _token_clipped(ratio: torch.Tensor, adv: torch.Tensor, config: ObjectiveConfig) -> torch.Tensor:
    """Tokens a token-level objective clipped: PPO's clip branch taken (GRPO, DAPO: the ratio
    left its bound in the direction of the advantage), or a CISPO weight truncated."""
    lo, hi = 1 - config.clip_low, 1 + config.clip_high
    if config.kind == "cispo":
        return (ratio < lo) | (ratio > hi)
    return ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))


def token_level_loss(logprobs: torch.Tensor, batch: TokenBatch, config: ObjectiveConfig,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO, DAPO or CISPO: this micro-step's share of the batch loss (see the module docstring);
    ``scale``: a detached per-token factor (a correction's ``c_t``)."""
    dtype = logprobs.dtype
    v = _token_weights(batch, config, dtype)
    if scale is not None:
        v = v * scale.to(dtype)
    adv = batch.advantages.to(dtype)
    delta = _deltas(logprobs, batch)  # with gradient; 0 off the trained tokens
    lo, hi = 1 - config.clip_low, 1 + config.clip_high
    if config.kind == "cispo":
        weight = torch.exp(delta.detach()).clamp(min=lo, max=hi)
        trained = torch.where(v > 0, logprobs, torch.zeros_like(logprobs))  # no 0 · inf off the targets
        return -(v * weight * adv * trained).sum()
    ratio = torch.exp(delta)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    return -(v * surrogate).sum()


@functools.lru_cache(maxsize=8)
def load_custom_objective(spec: str) -> Callable[..., torch.Tensor]:
    """The function ``spec`` names (``/path/file.py:function``), checked to take
    :data:`CUSTOM_ARGUMENTS` by keyword; a ``ValueError`` naming what is wrong otherwise.
    Loaded once per process (each trainer rank imports the file)."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"objective {spec!r}: expected file.py:function")
    try:
        fn = load_user_function(spec)
    except ValueError as exc:
        raise ValueError(f"objective {spec!r}: {exc}") from None
    try:
        inspect.signature(fn).bind(**{k: None for k in CUSTOM_ARGUMENTS})
    except TypeError as exc:
        raise ValueError(f"objective {spec!r}: {name} must accept the keywords {', '.join(CUSTOM_ARGUMENTS)} "
                         f"({exc})") from None
    return fn


def _custom_loss(logprobs: torch.Tensor, batch: TokenBatch, config: ObjectiveConfig,
                 outside_sums: torch.Tensor | None) -> torch.Tensor:
    fn = load_custom_objective(config.custom)
    loss = fn(logprobs=logprobs, behaviour_logprobs=batch.behaviour_logprobs.to(logprobs.dtype),
              advantages=batch.advantages.to(logprobs.dtype), loss_weights=batch.loss_weights.to(logprobs.dtype),
              exec_ids=batch.exec_slots, n_executions=batch.n_executions, outside_sums=outside_sums)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ValueError(f"objective {config.custom!r} must return a one-element tensor with gradient, "
                         f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
    return loss.reshape(())


def correction_weights(logprobs: torch.Tensor, batch: TokenBatch, config: ObjectiveConfig
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token the correction's detached weight ``c_t`` (see the module docstring), and which
    trained tokens it truncated (``tis``) or masked (``mis``, ``icepop``)."""
    rho = torch.exp(_deltas(logprobs.detach(), batch))  # 1 off the trained tokens
    lo, hi = config.correction_low, config.correction_high
    outside = ((rho < lo) | (rho > hi)) & (batch.loss_weights > 0)
    if config.correction == "tis":
        return rho.clamp(min=lo, max=hi), outside
    return torch.where(outside, torch.zeros_like(rho), rho), outside


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token the estimate of KL(π_θ ‖ π_ref) from a token sampled by (about) π_θ, with
    gradient through ``logprobs``: ``k1`` = log π_θ − log π_ref; ``k3`` = e^{−k1} − 1 + k1
    (unbiased, never negative); ``low_var`` = k3 clamped to [−10, 10] (verl's ``low_var_kl``)."""
    k1 = logprobs - ref_logprobs.to(logprobs.dtype)
    if estimator == "k1":
        return k1
    r = (-k1).clamp(-20.0, 20.0) if estimator == "low_var" else -k1  # log π_ref − log π_θ
    k3 = torch.expm1(r) - r  # e^r − 1 − r without the cancellation of a small r
    return k3.clamp(-10.0, 10.0) if estimator == "low_var" else k3


def kl_penalty(logprobs: torch.Tensor, batch: TokenBatch, config: ObjectiveConfig,
               ref_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``β · Σ_t w_t · KL_t`` over the trained tokens, weighted as the objective weighs them
    (``W_t``; DAPO and CISPO: ``V_t``), and the per-token KL estimates (0 off them)."""
    w = _token_weights(batch, config, logprobs.dtype)
    kl = torch.where(w > 0, kl_to_reference(logprobs, ref_logprobs, config.kl_estimator), torch.zeros_like(logprobs))
    return config.kl_coef * (w * kl).sum(), kl.detach()


def objective_loss(logprobs: torch.Tensor, batch: TokenBatch, config: ObjectiveConfig,
                   ratio_sums: torch.Tensor, outside_sums: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-step's share of the batch loss under ``config.kind`` and ``config.correction``;
    ``ratio_sums`` are the whole executions' :func:`log_ratio_sums` (GSPO's clip),
    ``outside_sums`` the part held elsewhere (given to a custom objective)."""
    if config.correction != "none":
        scale, _ = correction_weights(logprobs, batch, config)
        on_policy = TokenBatch(batch.token_ids, batch.cu_seqlens, batch.loss_weights, logprobs.detach(),
                               batch.advantages, batch.exec_slots, batch.n_executions)
        if config.kind == "gspo":
            return gspo_loss(logprobs, on_policy, log_ratio_sums(logprobs, on_policy), config, scale)
        return token_level_loss(logprobs, on_policy, config, scale)
    if config.kind == "gspo":
        return gspo_loss(logprobs, batch, ratio_sums, config)
    if config.kind == "custom":
        return _custom_loss(logprobs, batch, config, outside_sums)
    return token_level_loss(logprobs, batch, config)


def microstep_objective(
    logprobs: torch.Tensor,
    batch: TokenBatch,
    config: ObjectiveConfig = ObjectiveConfig(),
    outside_sums: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This pack's share of the batch loss under ``config``'s objective, and its figures.

    ``outside_sums`` (shape ``(2, E)``) are :func:`log_ratio_sums` of the rows of this pack's split
    executions that other packs hold (the trainer's forward-only pass over
    :attr:`~gyre_core.dataplane.packing.Pack.outside`); with them every execution's ratio is its
    whole-execution ``s_e``. Without them the ratio is taken over the rows in this pack, which is
    exact for every execution the packer kept whole.

    The figures (detached, additive over packs except the maxima): ``loss``; ``executions``
    and ``clipped`` (executions with a trainable token here, and, for GSPO, those whose ``s_e``
    left the bounds in the direction of their advantage; for the token-level objectives each
    execution's share of its tokens clipped; a split execution counts in each pack by the share
    of its weight ``Σ W_t`` held there, so the parts add up to one execution); ``clipped_tokens``;
    ``corrected_tokens`` (those a correction truncated or masked);
    ``ratio_sum``, ``ratio_max`` and ``tokens`` over the weighted tokens' raw ratios ``π/π_b``;
    ``abs_delta_sum``, ``abs_delta_max`` and ``k3_sum``, the sampler–trainer gap on them;
    with a KL penalty (``ref_logprobs``: the reference policy's log-probs, laid out as
    ``logprobs``), ``kl_ref_sum``, its estimate summed over the trained tokens. A custom
    objective's clipping is its own: it reports none.
    """
    here = log_ratio_sums(logprobs, batch)
    sums = here if outside_sums is None else here + outside_sums.to(here.dtype)
    loss = objective_loss(logprobs, batch, config, sums, outside_sums)
    kl_ref = None
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs of this micro-step")
        penalty, kl_ref = kl_penalty(logprobs, batch, config, ref_logprobs)
        loss = loss + penalty
    with torch.no_grad():
        present = here[1] > 0
        tiny = torch.finfo(sums.dtype).tiny
        log_s = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(tiny), 0.0)
        s = torch.exp(log_s)
        if config.sequence_level:  # the outside sums complete each execution's Σ W_t
            total_w = sums[1].to(torch.float64)
            share = torch.where(present, here[1].to(torch.float64) / total_w.clamp_min(tiny), 0.0)  # 1 if whole
        else:  # no outside pass: an execution's W_t sum to 1/E, so E · Σ W_t here is its share
            share = here[1].to(torch.float64) * batch.n_executions
        weighted = batch.loss_weights > 0
        delta = _deltas(logprobs.detach(), batch)
        ratio_all = torch.exp(delta)
        adv_t = batch.advantages.to(sums.dtype)
        corrected = torch.zeros_like(weighted)
        if config.correction != "none":  # the ratio to the trainer's own is 1: nothing is clipped
            _, corrected = correction_weights(logprobs, batch, config)
            clipped_tok = torch.zeros_like(weighted)
            clipped = torch.zeros((), dtype=torch.float64)
        elif config.kind == "gspo" or config.kind == "custom":
            adv = torch.zeros(batch.n_executions, dtype=sums.dtype, device=sums.device)
            adv[batch.exec_slots] = adv_t  # one advantage per execution
            clipped_exec = present & (((adv > 0) & (s > 1 + config.clip_high)) | ((adv < 0) & (s < 1 - config.clip_low)))
            if config.kind == "custom":  # its clipping is its own: none is claimed
                clipped_exec = torch.zeros_like(clipped_exec)
            clipped_tok = clipped_exec[batch.exec_slots] & weighted
            clipped = (share * clipped_exec).sum()
        else:
            clipped_tok = _token_clipped(ratio_all, adv_t, config) & weighted
            # each execution's share of its tokens clipped (W_t · E sums to 1 over an execution)
            clipped = (batch.loss_weights.to(torch.float64) * batch.n_executions * clipped_tok).sum()
        ratio = ratio_all[weighted]
        d = delta[weighted].to(torch.float64)
        zero = torch.zeros((), dtype=torch.float64)
        stats = {
            "loss": loss.detach().to(torch.float64),
            "executions": share.sum(),
            "clipped": clipped,
            "clipped_tokens": clipped_tok.sum().to(torch.float64),
            "corrected_tokens": corrected.sum().to(torch.float64),
            "ratio_sum": ratio.to(torch.float64).sum(),
            "ratio_max": ratio.max().to(torch.float64) if len(ratio) else zero,
            "tokens": weighted.sum().to(torch.float64),
            # the sampler–trainer gap on the trained tokens (see the module docstring)
            "abs_delta_sum": d.abs().sum(),
            "abs_delta_max": d.abs().max() if len(d) else zero,
            "k3_sum": (torch.exp(d) - 1 - d).sum(),
        }
        if kl_ref is not None:  # the penalty's own estimate, over the trained tokens
            stats["kl_ref_sum"] = kl_ref[weighted].to(torch.float64).sum()
    return loss, stats
