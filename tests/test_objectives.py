"""The objectives a run can train on (GRPO, DAPO, CISPO, a user's own) against float64 references
written from their papers' formulas, split over micro-steps, with the figures every step reports,
and the config checks that come before a run starts."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from gyre_core.config import ConfigError
from gyre_core.dataplane import TokenBatch, log_ratio_sums
from gyre_core.dataplane.objective import (
    ObjectiveConfig,
    load_custom_objective,
    microstep_objective,
    objective_loss,
)
from gyre_core.interfaces import OBJECTIVE_CLIPS
from gyre_core.orchestrator.run_config import load_run_config

from test_dataplane_objective import random_batch

TOKEN_LEVEL = ("grpo", "dapo", "cispo")


def config(kind: str, **kw: float) -> ObjectiveConfig:
    low, high = OBJECTIVE_CLIPS[kind]
    return ObjectiveConfig(kind=kind, clip_low=kw.pop("clip_low", low), clip_high=kw.pop("clip_high", high),
                           token_normaliser=int(kw.pop("token_normaliser", 16)), **kw)


def reference(kind: str, logp: list[float], batch: TokenBatch, cfg: ObjectiveConfig) -> tuple[float, list[float]]:
    """Loss and d loss / d logp, in plain float64 Python, from each paper's per-token formula:

    * GRPO: ``−mean_e mean_{t∈U_e} min(r_t A, clip(r_t, 1−ε_l, 1+ε_h) A)``;
    * DAPO: the same clipped surrogate, summed over all trained tokens and divided by E·L;
    * CISPO: ``−1/(E·L) Σ_t sg(clip(r_t, 1−ε_l, 1+ε_h)) A log π(t)``.
    """
    w, blp = batch.loss_weights.tolist(), batch.behaviour_logprobs.tolist()
    adv, slot = batch.advantages.tolist(), batch.exec_slots.tolist()
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    loss, grad = 0.0, [0.0] * len(logp)
    for e in range(batch.n_executions):
        unique = [t for t in range(len(logp)) if slot[t] == e and w[t] > 0]
        for t in unique:
            a, r = adv[t], math.exp(logp[t] - blp[t])
            if kind == "grpo":
                weight = 1.0 / (batch.n_executions * len(unique))
            else:
                weight = 1.0 / (batch.n_executions * cfg.token_normaliser)
            if kind == "cispo":
                c = min(max(r, lo), hi)
                loss -= weight * c * a * logp[t]
                grad[t] = -weight * c * a
            else:
                unclipped, clipped = r * a, min(max(r, lo), hi) * a
                loss -= weight * min(unclipped, clipped)
                grad[t] = -weight * r * a if unclipped <= clipped else 0.0
    return loss, grad


def _batch(seed: int) -> tuple[TokenBatch, torch.Tensor]:
    # ratios spread far enough that every objective's bounds are crossed both ways
    return random_batch(seed, spread=0.4, big=0.1)


def _sub(batch: TokenBatch, idx: torch.Tensor) -> TokenBatch:
    return TokenBatch(batch.token_ids[idx], torch.tensor([0, len(idx)]), batch.loss_weights[idx],
                      batch.behaviour_logprobs[idx], batch.advantages[idx], batch.exec_slots[idx],
                      batch.n_executions)


@pytest.mark.parametrize("kind", TOKEN_LEVEL)
@pytest.mark.parametrize("seed", range(4))
def test_each_objective_matches_its_float64_reference(kind: str, seed: int) -> None:
    batch, logp = _batch(seed)
    cfg = config(kind)
    ref_loss, ref_grad = reference(kind, logp.tolist(), batch, cfg)
    ref_g = torch.tensor(ref_grad, dtype=torch.float64)
    assert ref_g.abs().sum() > 0
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        lp = logp.detach().to(dtype).clone().requires_grad_()
        loss = objective_loss(lp, batch, cfg, log_ratio_sums(lp, batch))
        loss.backward()
        assert abs(loss.item() - ref_loss) <= tol * abs(ref_loss)
        assert (lp.grad.double() - ref_g).norm() <= tol * ref_g.norm()


@pytest.mark.parametrize("kind", TOKEN_LEVEL)
def test_the_references_cross_every_bound(kind: str) -> None:
    """The inputs exercise what distinguishes the objectives: tokens clipped in both directions."""
    batch, logp = _batch(0)
    cfg = config(kind)
    r = (logp - batch.behaviour_logprobs).exp()[batch.loss_weights > 0]
    adv = batch.advantages[batch.loss_weights > 0]
    assert bool(((r > 1 + cfg.clip_high) & (adv > 0)).any()) and bool(((r < 1 - cfg.clip_low) & (adv < 0)).any()) \
        or kind == "cispo" and bool((r > 1 + cfg.clip_high).any())


@pytest.mark.parametrize("kind", TOKEN_LEVEL + ("gspo",))
@pytest.mark.parametrize("seed", range(3))
def test_a_batch_cut_anywhere_trains_the_batch_objective(kind: str, seed: int) -> None:
    """Micro-steps over cells: the parts' losses and gradients add up to the batch's. The token-level
    objectives need no outside sums for it; GSPO gets them (its execution ratio)."""
    batch, logp = _batch(seed)
    cfg = config(kind)
    lp = logp.clone().requires_grad_()
    whole = objective_loss(lp, batch, cfg, log_ratio_sums(logp, batch))
    whole.backward()
    cuts = torch.randperm(len(logp), generator=torch.Generator().manual_seed(seed)) % 3
    parts = [torch.nonzero(cuts == k).squeeze(1) for k in range(3)]
    sums = [log_ratio_sums(logp[idx], _sub(batch, idx)) for idx in parts]
    total, grads, fig_sum = 0.0, torch.zeros_like(logp), {}
    for k, idx in enumerate(parts):
        lpk = logp[idx].clone().requires_grad_()
        outside = sum(sums) - sums[k] if kind == "gspo" else None
        loss, fig = microstep_objective(lpk, _sub(batch, idx), cfg, outside_sums=outside)
        loss.backward()
        total += loss.item()
        grads[idx] = lpk.grad
        for name, v in fig.items():
            fig_sum[name] = max(fig_sum.get(name, 0.0), float(v)) if name.endswith("_max") else \
                fig_sum.get(name, 0.0) + float(v)
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(grads, lp.grad, rtol=1e-12, atol=1e-18)
    # figures: what was clipped, and the sampler–trainer gap, added over the parts
    trained = batch.loss_weights > 0
    d = (logp - batch.behaviour_logprobs)[trained]
    assert fig_sum["tokens"] == int(trained.sum())
    assert fig_sum["abs_delta_sum"] == pytest.approx(float(d.abs().sum()), rel=1e-12)
    assert fig_sum["abs_delta_max"] == pytest.approx(float(d.abs().max()), rel=1e-12)
    assert fig_sum["k3_sum"] == pytest.approx(float((d.exp() - 1 - d).sum()), rel=1e-12) and fig_sum["k3_sum"] > 0
    assert fig_sum["executions"] == pytest.approx(batch.n_executions, rel=1e-12)
    if kind in TOKEN_LEVEL:
        r, adv = d.exp(), batch.advantages[trained]
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        c = ((r < lo) | (r > hi)) if kind == "cispo" else (((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo)))
        assert fig_sum["clipped_tokens"] == int(c.sum()) > 0
        # each execution's share of its tokens clipped, summed over executions
        slots = batch.exec_slots[trained]
        shares = [float(c[slots == e].double().mean()) for e in range(batch.n_executions) if bool((slots == e).any())]
        assert fig_sum["clipped"] == pytest.approx(sum(shares), rel=1e-12)


def test_dapo_weighs_tokens_and_grpo_weighs_executions() -> None:
    """One execution of 30 trained tokens and one of 3, the same advantage, nothing clipped: under
    GRPO each execution's gradient sums to the same; under DAPO the long one's is 10 times larger."""
    n = [30, 3]
    slot = torch.tensor([0] * n[0] + [1] * n[1])
    w = torch.cat([torch.full((k,), 1 / (2 * k), dtype=torch.float64) for k in n])
    batch = TokenBatch(torch.zeros(33, dtype=torch.int64), torch.tensor([0, 33]), w,
                       torch.full((33,), -1.0, dtype=torch.float64), torch.ones(33, dtype=torch.float64), slot, 2)
    for kind, ratio in (("grpo", 1.0), ("dapo", 10.0)):
        lp = torch.full((33,), -1.0, dtype=torch.float64, requires_grad=True)
        objective_loss(lp, batch, config(kind), log_ratio_sums(lp, batch)).backward()
        per_exec = [float(lp.grad[slot == e].sum()) for e in (0, 1)]
        assert per_exec[0] / per_exec[1] == pytest.approx(ratio, rel=1e-12)


def test_cispo_keeps_the_gradient_of_tokens_ppo_would_clip() -> None:
    """A token far above the bound with a positive advantage: GRPO/DAPO give it no gradient; CISPO
    gives it the truncated weight's (1 + ε_high)."""
    batch, _ = _batch(0)
    lp0 = batch.behaviour_logprobs + 1.0  # every ratio e ≈ 2.7, above every upper bound
    adv_pos = batch.advantages > 0
    for kind in TOKEN_LEVEL:
        lp = lp0.clone().requires_grad_()
        objective_loss(lp, batch, config(kind), log_ratio_sums(lp, batch)).backward()
        g = lp.grad[adv_pos & (batch.loss_weights > 0)]
        if kind == "cispo":
            v = 1 / (batch.n_executions * 16)
            expected = -v * (1 + config(kind).clip_high) * batch.advantages[adv_pos & (batch.loss_weights > 0)]
            assert torch.allclose(g, expected, rtol=1e-12)
        else:
            assert bool((g == 0).all())


CUSTOM = """
import torch

def reinforce(*, logprobs, behaviour_logprobs, advantages, loss_weights, exec_ids, n_executions, outside_sums):
    # plain REINFORCE on the execution-normalised weights
    return -(loss_weights * advantages * logprobs).sum()

def no_outside(*, logprobs, behaviour_logprobs, advantages, loss_weights, exec_ids, n_executions):
    return logprobs.sum()

def detached(**kw):
    return kw["logprobs"].detach().sum()

raise_here = None
"""


def test_a_custom_objective_is_called_per_micro_step(tmp_path: Path) -> None:
    path = tmp_path / "my_loss.py"
    path.write_text(textwrap.dedent(CUSTOM))
    cfg = ObjectiveConfig(kind="custom", custom=f"{path}:reinforce")
    batch, logp = _batch(1)
    lp = logp.clone().requires_grad_()
    loss, fig = microstep_objective(lp, batch, cfg)
    loss.backward()
    assert torch.allclose(lp.grad, -batch.loss_weights * batch.advantages, rtol=1e-12)
    assert float(fig["clipped"]) == 0 and float(fig["tokens"]) == int((batch.loss_weights > 0).sum())
    with pytest.raises(ValueError, match="must accept the keywords"):
        load_custom_objective(f"{path}:no_outside")
    with pytest.raises(ValueError, match="one-element tensor with gradient"):
        microstep_objective(logp.clone().requires_grad_(), batch, ObjectiveConfig(kind="custom", custom=f"{path}:detached"))
    with pytest.raises(ValueError, match="has no function 'raise_here'"):
        load_custom_objective(f"{path}:raise_here")
    with pytest.raises(ValueError, match="does not exist"):
        load_custom_objective(f"{tmp_path}/absent.py:f")


def test_the_config_names_an_objective_and_its_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_run_config()
    assert cfg.training.objective_config() == ObjectiveConfig()  # GSPO, the paper's bounds
    dapo = load_run_config(overrides={"training.objective": '"dapo"'}).training.objective_config()
    assert (dapo.kind, dapo.clip_low, dapo.clip_high) == ("dapo", 0.2, 0.28)
    cispo = load_run_config(overrides={"training.objective": '"cispo"', "training.clip_high": "2.0"})
    assert (cispo.training.objective_config().clip_low, cispo.training.objective_config().clip_high) == (1.0, 2.0)
    with pytest.raises(ConfigError, match="training.objective: expected one of gspo, grpo, dapo, cispo"):
        load_run_config(overrides={"training.objective": '"ppo"'})
    with pytest.raises(ConfigError, match="training.clip_low: need 0 <= clip_low < 1"):
        load_run_config(overrides={"training.objective": '"grpo"', "training.clip_low": "1.0"})
    # a custom objective: relative to the config file's folder, loaded and checked before the run
    (tmp_path / "losses").mkdir()
    (tmp_path / "losses" / "mine.py").write_text(textwrap.dedent(CUSTOM))
    (tmp_path / "run.toml").write_text('[training]\nobjective = "losses/mine.py:reinforce"\n')
    monkeypatch.chdir("/")
    mine = load_run_config(tmp_path / "run.toml").training.objective_config()
    assert mine.kind == "custom" and mine.custom == f"{tmp_path}/losses/mine.py:reinforce"
    (tmp_path / "bad.toml").write_text('[training]\nobjective = "losses/mine.py:no_outside"\n')
    with pytest.raises(ConfigError, match="training.objective: .*must accept the keywords"):
        load_run_config(tmp_path / "bad.toml")
    (tmp_path / "gone.toml").write_text('[training]\nobjective = "losses/absent.py:f"\n')
    with pytest.raises(ConfigError, match="training.objective: .*does not exist"):
        load_run_config(tmp_path / "gone.toml")


# ------------------------------------------------------------------ the sampler–trainer correction

CORRECTION_BOUNDS = {"tis": (0.0, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}


def corrected_reference(kind: str, correction: str, logp: list[float], batch: TokenBatch,
                        cfg: ObjectiveConfig) -> tuple[float, list[float]]:
    """The gradient with the trainer's own log-prob as the ratio's denominator (every ratio 1,
    nothing clipped) and each token's term times ``c_t`` from ``ρ_t = π_trainer / π_sampler``;
    the loss value is the surrogate's at ratio 1 (``−Σ weight · c_t · A``, CISPO's ``· log π``)."""
    w, blp = batch.loss_weights.tolist(), batch.behaviour_logprobs.tolist()
    adv, slot = batch.advantages.tolist(), batch.exec_slots.tolist()
    lo, hi = cfg.correction_low, cfg.correction_high
    loss, grad = 0.0, [0.0] * len(logp)
    for e in range(batch.n_executions):
        unique = [t for t in range(len(logp)) if slot[t] == e and w[t] > 0]
        for t in unique:
            rho = math.exp(logp[t] - blp[t])
            c = min(max(rho, lo), hi) if correction == "tis" else (rho if lo <= rho <= hi else 0.0)
            weight = w[t] if kind in ("gspo", "grpo") else 1.0 / (batch.n_executions * cfg.token_normaliser)
            loss -= weight * c * adv[t] * (logp[t] if kind == "cispo" else 1.0)
            grad[t] = -weight * c * adv[t]
    return loss, grad


@pytest.mark.parametrize("correction", sorted(CORRECTION_BOUNDS))
@pytest.mark.parametrize("kind", ("gspo",) + TOKEN_LEVEL)
def test_each_correction_matches_its_float64_reference(kind: str, correction: str) -> None:
    batch, logp = _batch(2)
    low, high = CORRECTION_BOUNDS[correction]
    cfg = ObjectiveConfig(kind=kind, clip_low=OBJECTIVE_CLIPS[kind][0], clip_high=OBJECTIVE_CLIPS[kind][1],
                          token_normaliser=16, correction=correction, correction_low=low, correction_high=high)
    assert not cfg.sequence_level  # no whole-execution ratio needed: no forward pass over split rows
    ref_loss, ref_grad = corrected_reference(kind, correction, logp.tolist(), batch, cfg)
    lp = logp.clone().requires_grad_()
    loss, fig = microstep_objective(lp, batch, cfg)
    loss.backward()
    ref_g = torch.tensor(ref_grad, dtype=torch.float64)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    assert (lp.grad - ref_g).norm() <= 1e-12 * ref_g.norm()
    rho = (logp - batch.behaviour_logprobs).exp()[batch.loss_weights > 0]
    outside = int(((rho < low) | (rho > high)).sum())
    assert float(fig["corrected_tokens"]) == outside > 0  # the spikes (ρ = e²) pass every upper bound
    assert float(fig["clipped"]) == 0 and float(fig["clipped_tokens"]) == 0
    # masked tokens carry no gradient; truncated ones carry the bound's
    out_mask = ((logp - batch.behaviour_logprobs).exp() > high) & (batch.loss_weights > 0)
    if correction == "tis":
        assert bool((lp.grad[out_mask] != 0).any())
    else:
        assert bool((lp.grad[out_mask] == 0).all())


def test_a_correction_is_checked_and_named_in_the_config() -> None:
    tis = load_run_config(overrides={"training.correction": '"tis"'}).training.objective_config()
    assert (tis.correction, tis.correction_low, tis.correction_high) == ("tis", 0.0, 2.0)
    ice = load_run_config(overrides={"training.objective": '"dapo"', "training.correction": '"icepop"',
                                     "training.correction_high": "3.0"}).training.objective_config()
    assert (ice.kind, ice.correction_low, ice.correction_high) == ("dapo", 0.5, 3.0)
    with pytest.raises(ConfigError, match="training.correction"):
        load_run_config(overrides={"training.correction": '"clip"'})
    with pytest.raises(ConfigError, match="training.correction_high"):
        load_run_config(overrides={"training.correction": '"mis"', "training.correction_high": "0.5"})


def kl_reference(estimator: str, logp: list[float], ref: list[float], weights: list[float]) -> tuple[float, list[float]]:
    """Σ_t w_t KL_t and its gradient in plain float64 Python: k1 = δ, k3 = e^{−δ} − 1 + δ
    (δ = log π_θ − log π_ref); low_var is k3 clamped to [−10, 10] (its gradient 0 where clamped)."""
    loss, grad = 0.0, [0.0] * len(logp)
    for t, (lp, r, w) in enumerate(zip(logp, ref, weights)):
        if w <= 0:
            continue
        d = lp - r
        if estimator == "k1":
            k, g = d, 1.0
        else:
            k, g = math.exp(-d) - 1 + d, 1 - math.exp(-d)
            if estimator == "low_var" and not -10 <= k <= 10:
                k, g = max(-10.0, min(10.0, k)), 0.0
        loss += w * k
        grad[t] = w * g
    return loss, grad


@pytest.mark.parametrize("estimator", ("k1", "k3", "low_var"))
@pytest.mark.parametrize("kind", ("gspo", "dapo"))
def test_a_kl_penalty_matches_its_float64_reference(kind: str, estimator: str) -> None:
    """The objective plus β · Σ w_t KL_t (w_t the objective's own token weights), with one
    token's log-ratio to the reference past low_var's clamp."""
    batch, logp = _batch(3)
    g = torch.Generator().manual_seed(5)
    ref = logp.detach() + 0.3 * torch.randn(len(logp), generator=g, dtype=torch.float64)
    trained = torch.nonzero(batch.loss_weights > 0).flatten()
    ref[trained[0]] = logp[trained[0]] + 12.0  # k3 = e^12 - 13: clamped by low_var
    plain = config(kind)
    cfg = ObjectiveConfig(**{**plain.__dict__, "kl_coef": 0.1, "kl_estimator": estimator})
    weights = (batch.loss_weights.tolist() if kind == "gspo" else
               [1.0 / (batch.n_executions * cfg.token_normaliser) if w > 0 else 0.0 for w in batch.loss_weights.tolist()])
    kl_loss, kl_grad = kl_reference(estimator, logp.tolist(), ref.tolist(), weights)
    lp0 = logp.clone().requires_grad_()
    base, _ = microstep_objective(lp0, batch, plain)
    base.backward()
    lp = logp.clone().requires_grad_()
    loss, fig = microstep_objective(lp, batch, cfg, ref_logprobs=ref)
    loss.backward()
    assert loss.item() == pytest.approx(base.item() + 0.1 * kl_loss, rel=1e-12)
    want = lp0.grad + 0.1 * torch.tensor(kl_grad, dtype=torch.float64)
    assert (lp.grad - want).norm() <= 1e-12 * want.norm()
    if estimator != "k1":
        assert float(fig["kl_ref_sum"]) >= 0  # k3 is never negative
    with pytest.raises(ValueError, match="reference"):
        microstep_objective(logp, batch, cfg)  # asked for, and nothing to compare with: refused


def test_a_kl_penalty_is_set_in_the_config() -> None:
    cfg = load_run_config(overrides={"training.kl_coef": "0.05", "training.kl_estimator": '"k3"'}).training
    assert (cfg.objective_config().kl_coef, cfg.objective_config().kl_estimator) == (0.05, "k3")
    with pytest.raises(ConfigError, match="training.kl_estimator"):
        load_run_config(overrides={"training.kl_estimator": '"k2"'})
    with pytest.raises(ConfigError, match="training.kl_coef"):
        load_run_config(overrides={"training.kl_coef": "-1.0"})
