"""The execution-level GSPO objective against a hand-written float64 reference, and its gradients."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.dataplane import (
    GSPOConfig,
    TokenBatch,
    TrajectoryBuffer,
    group_advantages,
    gspo_loss,
    log_ratio_sums,
    materialise_group,
    target_logprobs,
)
from gyre_core.dataplane.packing import Pack
from gyre_core.scheduler.events import DispatchGroup

from test_dataplane_buffers import scored


CFG = GSPOConfig()


def random_batch(seed: int, n_exec: int = 12, dtype=torch.float64, spread: float = 0.01,
                 big: float = 0.05) -> tuple[TokenBatch, torch.Tensor]:
    """Tokens of ``n_exec`` executions; per-execution log-ratio shifts straddle the clip bounds."""
    g = torch.Generator().manual_seed(seed)
    slots, weights, shifts = [], [], []
    for e in range(n_exec):
        n = int(torch.randint(3, 40, (1,), generator=g))
        unique = torch.rand(n, generator=g) < 0.7  # the rest: context or a repeated response
        unique[0] = True
        slots += [e] * n
        weights.append(unique.to(dtype) / (n_exec * int(unique.sum())))
        shifts.append(torch.full((n,), float(torch.empty(1).uniform_(-spread, spread, generator=g))))
    slot = torch.tensor(slots)
    behaviour = -torch.rand(len(slot), generator=g, dtype=dtype) * 3
    noise = torch.randn(len(slot), generator=g, dtype=dtype) * spread
    spikes = (torch.rand(len(slot), generator=g) < big).to(dtype) * 2.0  # ratio e² > 5: capped
    logp = behaviour + torch.cat(shifts).to(dtype) + noise + spikes
    adv = torch.randn(n_exec, generator=g, dtype=dtype)[slot]
    batch = TokenBatch(torch.zeros(len(slot), dtype=torch.int64), torch.tensor([0, len(slot)]),
                       torch.cat(weights), behaviour, adv, slot, n_exec)
    return batch, logp


def reference(logp: list[float], batch: TokenBatch, cfg: GSPOConfig) -> tuple[float, list[float]]:
    """Loss and d loss / d logp from the definitions, in plain float64 Python."""
    w, blp = batch.loss_weights.tolist(), batch.behaviour_logprobs.tolist()
    adv, slot = batch.advantages.tolist(), batch.exec_slots.tolist()
    loss, grad = 0.0, [0.0] * len(logp)
    for e in range(batch.n_executions):
        unique = [t for t in range(len(logp)) if slot[t] == e and w[t] > 0]
        if not unique:
            continue
        s = math.exp(sum(logp[t] - blp[t] for t in unique) / len(unique))  # geometric mean
        a = adv[unique[0]]
        if (a > 0 and s > 1 + cfg.clip_high) or (a < 0 and s < 1 - cfg.clip_low):
            continue  # the whole execution is clipped
        for t in unique:
            token_weight = min(math.exp(logp[t] - blp[t]), cfg.token_weight_cap)
            loss -= w[t] * a * token_weight
            grad[t] = -w[t] * a * token_weight
    return loss, grad


@pytest.mark.parametrize("seed", range(8))
def test_loss_and_gradient_match_the_float64_reference(seed: int) -> None:
    batch, logp = random_batch(seed)
    ref_loss, ref_grad = reference(logp.tolist(), batch, CFG)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        lp = logp.detach().to(dtype).clone().requires_grad_()
        loss = gspo_loss(lp, batch, log_ratio_sums(lp, batch), CFG)
        loss.backward()
        ref_g = torch.tensor(ref_grad, dtype=torch.float64)
        assert abs(loss.item() - ref_loss) <= tol * abs(ref_loss)
        assert (lp.grad.double() - ref_g).norm() <= tol * ref_g.norm()


def test_reference_inputs_exercise_clipping_and_the_cap() -> None:
    batch, logp = random_batch(0)
    d = (logp - batch.behaviour_logprobs)[batch.loss_weights > 0]
    assert bool((d.exp() > CFG.token_weight_cap).any())
    sums = log_ratio_sums(logp, batch)
    s = (sums[0] / sums[1]).exp()
    outside = (s > 1 + CFG.clip_high) | (s < 1 - CFG.clip_low)
    assert 0 < int(outside.sum()) < batch.n_executions


def test_clipping_bounds_and_cap_are_configurable() -> None:
    batch, logp = random_batch(3)
    wide = GSPOConfig(token_weight_cap=100.0, clip_low=0.5, clip_high=0.5)
    lp = logp.clone().requires_grad_()
    gspo_loss(lp, batch, log_ratio_sums(lp, batch), wide).backward()
    ref = torch.tensor(reference(logp.tolist(), batch, wide)[1], dtype=torch.float64)
    assert torch.allclose(lp.grad, ref, rtol=1e-12, atol=0)
    # nothing clipped, nothing capped: every weighted token has gradient -W·A·ratio
    expected = -batch.loss_weights * batch.advantages * (logp - batch.behaviour_logprobs).exp()
    assert torch.allclose(lp.grad, torch.where(batch.loss_weights > 0, expected, 0.0), rtol=1e-12)
    with pytest.raises(ValueError):
        GSPOConfig(clip_low=1.0)


def test_loss_is_additive_over_micro_steps() -> None:
    batch, logp = random_batch(5)
    sums = log_ratio_sums(logp, batch)
    lp = logp.clone().requires_grad_()
    whole = gspo_loss(lp, batch, sums)
    whole.backward()
    parts = torch.randint(0, 3, (len(logp),), generator=torch.Generator().manual_seed(1))
    total, grads, part_sums = 0.0, torch.zeros_like(logp), torch.zeros_like(sums)
    for k in range(3):
        idx = torch.nonzero(parts == k).squeeze(1)
        sub = TokenBatch(batch.token_ids[idx], torch.tensor([0, len(idx)]), batch.loss_weights[idx],
                         batch.behaviour_logprobs[idx], batch.advantages[idx], batch.exec_slots[idx],
                         batch.n_executions)
        part_sums += log_ratio_sums(logp[idx], sub)
        lpk = logp[idx].clone().requires_grad_()
        lk = gspo_loss(lpk, sub, sums)
        lk.backward()
        total += lk.item()
        grads[idx] = lpk.grad
    assert torch.allclose(part_sums, sums, rtol=1e-12)
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(grads, lp.grad, rtol=1e-12, atol=1e-18)


def test_gradcheck_in_float64() -> None:
    # away from the cap and the clip bounds the surrogate's gradient is the true derivative
    batch, logp = random_batch(2, n_exec=5, spread=0.001, big=0.0)
    sums = log_ratio_sums(logp, batch)
    loose = GSPOConfig(clip_low=0.1, clip_high=0.1)
    assert torch.autograd.gradcheck(lambda lp: gspo_loss(lp, batch, sums, loose), (logp.clone().requires_grad_(),))

    # through the logits of a packed sequence of two rows (checks the per-row shift)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (7,), generator=g)
    cu = torch.tensor([0, 3, 7])
    packed = TokenBatch(tokens, cu, torch.tensor([0, 0.2, 0.3, 0, 0.1, 0.1, 0.3], dtype=torch.float64),
                        torch.zeros(7, dtype=torch.float64) - 1.6, torch.tensor([1.0] * 3 + [-0.5] * 4,
                        dtype=torch.float64), torch.tensor([0, 0, 0, 1, 1, 1, 1]), 2)
    logits = (torch.randn(7, 5, generator=g, dtype=torch.float64) * 0.01).requires_grad_()
    fixed = log_ratio_sums(target_logprobs(logits, tokens, cu), packed)

    def f(x: torch.Tensor) -> torch.Tensor:
        return gspo_loss(target_logprobs(x, tokens, cu), packed, fixed, loose)

    assert torch.autograd.gradcheck(f, (logits,))


def test_target_logprobs_shift_within_each_row() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (9,), generator=g)
    cu = torch.tensor([0, 4, 5, 9])
    logits = torch.randn(9, 6, generator=g, dtype=torch.float64)
    out = target_logprobs(logits, tokens, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert out[a] == 0
        for t in range(a + 1, b):
            assert out[t] == pytest.approx(torch.log_softmax(logits[t - 1], -1)[tokens[t]].item(), rel=1e-12)


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0], rel=1e-5)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    adv = group_advantages([0.9, 0.1, 0.5, 0.5])
    assert sum(adv) == pytest.approx(0.0, abs=1e-12) and adv[0] > adv[2] > adv[1]


def weighted_group(members: list, share_root: bool) -> TokenBatch:
    buf = TrajectoryBuffer(len(members))
    buf.dispatch(DispatchGroup(0, tuple(range(len(members))), 0))
    for eid, (reward, root, branches) in enumerate(members):
        buf.put(scored(eid, 0, reward, tuple(branches), root, share_root))
    rows = materialise_group(buf.take(0), 0, len(members))
    return Pack(tuple(rows), len(members)).to_batch()


members = st.lists(st.tuples(st.floats(0, 1), st.tuples(st.integers(1, 5), st.integers(1, 6)),
                             st.lists(st.tuples(st.integers(1, 9), st.integers(1, 30)), min_size=1, max_size=5)),
                   min_size=2, max_size=5)


@settings(max_examples=30, deadline=None)
@given(members)
def test_every_execution_weighs_the_same_and_a_shared_response_counts_once(members: list) -> None:
    naive, selected = weighted_group(members, True), weighted_group(members, False)
    for batch in (naive, selected):
        per_exec = torch.zeros(len(members), dtype=torch.float64).index_add_(
            0, batch.exec_slots, batch.loss_weights.double())
        assert torch.allclose(per_exec, torch.full_like(per_exec, 1 / len(members)), rtol=1e-6)
        # on-policy (ratio 1, nothing clipped): each execution's gradient mass is -A_e / E
        lp = batch.behaviour_logprobs.double().clone().requires_grad_()
        gspo_loss(lp, batch, log_ratio_sums(lp, batch)).backward()
        mass = torch.zeros(len(members), dtype=torch.float64).index_add_(0, batch.exec_slots, lp.grad)
        adv = torch.tensor(group_advantages([m[0] for m in members]), dtype=torch.float64)
        assert torch.allclose(mass, -adv / len(members), rtol=1e-5, atol=1e-12)
    # the shared root response is trained once whether or not every trajectory claimed it
    assert int((naive.loss_weights > 0).sum()) == int((selected.loss_weights > 0).sum())
    rnd = random.Random(len(members))
    shift = {k: rnd.uniform(-0.003, 0.003) for k in range(len(members))}
    losses = []
    for batch in (naive, selected):
        lp = batch.behaviour_logprobs.double() + torch.tensor([shift[int(s)] for s in batch.exec_slots])
        losses.append(gspo_loss(lp, batch, log_ratio_sums(lp, batch)).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_microstep_objective_on_whole_executions_is_the_batch_objective(seed: int) -> None:
    """Split a batch by execution (as the packer does): each part's own loss, with its own ratio
    sums, adds up to the batch loss with batch-wide sums; and its figures count what happened."""
    from gyre_core.dataplane.objective import microstep_objective

    batch, logp = random_batch(seed)
    lp = logp.clone().requires_grad_()
    whole = gspo_loss(lp, batch, log_ratio_sums(logp, batch))
    whole.backward()
    ref_loss, _ = reference(logp.tolist(), batch, CFG)
    total, grads, clipped, execs = 0.0, torch.zeros_like(logp), 0.0, 0.0
    for part in range(3):
        idx = torch.nonzero(batch.exec_slots % 3 == part).squeeze(1)
        sub = TokenBatch(batch.token_ids[idx], torch.tensor([0, len(idx)]), batch.loss_weights[idx],
                         batch.behaviour_logprobs[idx], batch.advantages[idx], batch.exec_slots[idx],
                         batch.n_executions)
        lpk = logp[idx].clone().requires_grad_()
        loss, fig = microstep_objective(lpk, sub)
        loss.backward()
        total += loss.item()
        grads[idx] = lpk.grad
        clipped += float(fig["clipped"])
        execs += float(fig["executions"])
        assert float(fig["loss"]) == pytest.approx(loss.item(), rel=1e-12)
    assert total == pytest.approx(whole.item(), rel=1e-12) and total == pytest.approx(ref_loss, rel=1e-9)
    assert torch.allclose(grads, lp.grad, rtol=1e-12, atol=1e-18)
    adv = {int(s): float(a) for s, a in zip(batch.exec_slots, batch.advantages)}
    sums = log_ratio_sums(logp, batch)
    s = torch.exp(sums[0] / sums[1])
    expect = sum(1 for e in range(batch.n_executions)
                 if (adv[e] > 0 and s[e] > 1 + CFG.clip_high) or (adv[e] < 0 and s[e] < 1 - CFG.clip_low))
    assert execs == batch.n_executions and clipped == expect and expect > 0


@pytest.mark.parametrize("seed", range(4))
def test_microstep_objective_on_split_executions_with_outside_sums_is_the_batch_objective(seed: int) -> None:
    """Cut the batch anywhere, executions included: each part, given the ratio sums of its
    executions' tokens held by the other parts, trains exactly the batch objective (every part of
    an execution clipped on the whole execution's ratio), and the parts' figures add up to whole
    executions. Without the outside sums the parts would not."""
    from gyre_core.dataplane.objective import microstep_objective

    batch, logp = random_batch(seed)
    lp = logp.clone().requires_grad_()
    gspo_loss(lp, batch, log_ratio_sums(logp, batch)).backward()
    cuts = torch.randperm(len(logp), generator=torch.Generator().manual_seed(seed)) % 3
    parts = [torch.nonzero(cuts == k).squeeze(1) for k in range(3)]

    def sub(idx: torch.Tensor) -> TokenBatch:
        return TokenBatch(batch.token_ids[idx], torch.tensor([0, len(idx)]), batch.loss_weights[idx],
                          batch.behaviour_logprobs[idx], batch.advantages[idx], batch.exec_slots[idx],
                          batch.n_executions)

    sums = [log_ratio_sums(logp[idx], sub(idx)) for idx in parts]
    total = sum(sums)
    grads, alone, execs, clipped = torch.zeros_like(logp), torch.zeros_like(logp), 0.0, 0.0
    for k, idx in enumerate(parts):
        lpk = logp[idx].clone().requires_grad_()
        loss, fig = microstep_objective(lpk, sub(idx), CFG, outside_sums=total - sums[k])
        loss.backward()
        grads[idx] = lpk.grad
        execs += float(fig["executions"])
        clipped += float(fig["clipped"])
        lpa = logp[idx].clone().requires_grad_()
        microstep_objective(lpa, sub(idx), CFG)[0].backward()
        alone[idx] = lpa.grad
    assert torch.allclose(grads, lp.grad, rtol=1e-12, atol=1e-18)
    assert not torch.allclose(alone, lp.grad, rtol=1e-6, atol=1e-12)  # part-by-part clipping differs
    adv = {int(s): float(a) for s, a in zip(batch.exec_slots, batch.advantages)}
    s = torch.exp(total[0] / total[1])
    expect = sum(1 for e in range(batch.n_executions)
                 if (adv[e] > 0 and s[e] > 1 + CFG.clip_high) or (adv[e] < 0 and s[e] < 1 - CFG.clip_low))
    assert execs == pytest.approx(batch.n_executions, rel=1e-12) and clipped == pytest.approx(expect, rel=1e-12)
