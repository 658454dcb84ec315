"""The GSPO objective in Megatron equals the core's reference, on the real multi-process path.

Real megatron-core ranks (gloo), PP = 1 and PP = 2, and a mixture of experts (Qwen3-MoE, 6
experts, 2 per token) at TP 2 × EP 2, sequence-parallel; micro-steps streamed through the cell's
queue as the live run streams them. The reference is the core's own objective
(:mod:`gyre_core.dataplane.objective`, batch-wide ratio sums) on HF transformers' model holding
the same weights (the export, or the MoE checkpoint), in float64: for the MoE that checks the
router's and every expert's gradient on the expert-parallel ranks. Behaviour log-probs are the reference model's own
minus a chosen offset per execution, so each execution's ratio ``s_e = exp(offset)`` is known:
inside the bounds, above them, below them, and with one token past the importance-weight cap.

Executions longer than one pack are split over micro-steps (and cells): each part carries the
others' rows, run forward only, so every part is clipped on the whole execution's ratio. The split
cases give each part a different ratio, so clipping part by part would train a different gradient.

Tolerance: Megatron runs in float32 against a float64 reference; gradients agree to 1e-5 of
their largest entry (measured: ~1e-7), the loss to 1e-6 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
pytest.importorskip("transformers")

from gyre_core.dataplane.objective import (  # noqa: E402
    GSPOConfig,
    ObjectiveConfig,
    kl_penalty,
    log_ratio_sums,
    objective_loss,
    target_logprobs,
)
from gyre_core.interfaces import OBJECTIVE_CLIPS, PublicationOptions  # noqa: E402
from gyre_megatron.testing import make_gspo_microsteps  # noqa: E402

# Executions 0-7 over 4 micro-steps of 2 executions each. Offsets set s_e = exp(offset):
#   e0, e1 inside [0.995, 1.005]; e2 above with A > 0 -> clipped; e3 below with A < 0 -> clipped;
#   e4 above with A < 0 and e5 below with A > 0 -> not clipped (PPO's min keeps the gradient);
#   e6 inside, one token's ratio e^2.5 > 5 -> capped at 5; e7 zero advantage.
OFFSETS = [0.001, -0.002, 0.02, -0.03, 0.04, -0.05, 0.0005, 0.003]
ADVANTAGES = [1.0, -0.5, 1.5, -1.2, -0.8, 0.7, -1.0, 0.0]
SPIKE = {6: 2.5}
EXPECTED_CLIPPED = 2
JOIN_ATTEMPTS = 3

# Executions 0-3 split: row 0 in their own micro-step, row 1 in the next. Per-row offsets make
# the parts' ratios differ from the whole's (weighted by sampled tokens: 8 in row 0, 4-8 in row 1):
#   e0 (0.008, -0.004), A > 0: whole inside, part 0 alone above  -> trained whole;
#   e1 (0.003, 0.010), A > 0: whole above, part 0 alone inside   -> clipped whole;
#   e2 (-0.008, 0.004), A < 0: whole inside, part 0 alone below  -> trained whole;
#   e3 (-0.003, -0.010), A < 0: whole below, part 0 alone inside -> clipped whole;
#   e4-e7 whole in one pack; e6 above with A > 0 -> clipped.
SPLIT_OFFSETS = [(0.008, -0.004), (0.003, 0.010), (-0.008, 0.004), (-0.003, -0.010), 0.001, -0.002, 0.02, 0.0005]
SPLIT_ADVANTAGES = [1.0, 1.0, -1.0, -0.5, 0.5, -0.7, 1.2, -0.3]
SPLIT = (0, 1, 2, 3)
SPLIT_CLIPPED = 3


@pytest.fixture(scope="module", params=["pp1", "pp2", "moe-tp2-ep2"])
def world(request, tmp_path_factory):
    from gyre_megatron.export import load_hf_model, publish
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import build_checkpoint

    if request.param.startswith("moe"):
        ckpt = tmp_path_factory.mktemp("moe")
        build_checkpoint(ckpt, seed=31, family="qwen3_moe")
        opts = RankOptions(cells=1, pp=1, tp=2, ep=2, spec=spec_from_hf_dir(ckpt), init_from=str(ckpt),
                           normalise_by_tokens=False)
    else:
        opts = RankOptions(cells=1, pp=int(request.param[-1]), normalise_by_tokens=False)
    with World(opts, n_queues=16) as w:
        ref = publish(w, PublicationOptions(folder=str(tmp_path_factory.mktemp("gspo"))), version=0)
        hf = load_hf_model(ref.location).double()
        yield w, hf


def _per_expert(grads: dict) -> dict:
    """HF gradients under the checkpoint's names: transformers 5 holds each layer's experts fused
    (``experts.gate_up_proj`` [E, 2·I, H], ``experts.down_proj`` [E, H, I])."""
    out = {}
    for n, g in grads.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(g, 2, axis=1)
            out.update({f"{n[:-len('gate_up_proj')]}{e}.{proj}.weight": t[e]
                        for e in range(g.shape[0]) for proj, t in (("gate_proj", gate), ("up_proj", up))})
        elif n.endswith("mlp.experts.down_proj"):
            out.update({f"{n[:-len('down_proj')]}{e}.down_proj.weight": g[e] for e in range(g.shape[0])})
        else:
            out[n] = g
    return out


def _logprobs(hf: torch.nn.Module, b, temperature: float = 1.0) -> torch.Tensor:
    rows = []
    for k in range(len(b.cu_seqlens) - 1):
        a, z = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
        toks = b.token_ids[a:z]
        rows.append(target_logprobs(hf(toks[None]).logits[0] / temperature, toks, torch.tensor([0, z - a])))
    return torch.cat(rows)


def _reference(hf: torch.nn.Module, micro: list, config: GSPOConfig = GSPOConfig(),
               per_pack: bool = False, temperature: float = 1.0,
               reference_model: torch.nn.Module | None = None) -> tuple[float, dict]:
    """The batch loss and gradients with each execution's ratio over all its rows (or, with
    ``per_pack``, over the rows in each pack: what clipping part by part would train); with
    ``config.kl_coef``, plus the KL penalty to ``reference_model``."""
    hf.zero_grad()
    batches = [p.to_batch() for m in micro for p in m.packs]
    lps = [_logprobs(hf, b, temperature) for b in batches]
    sums = [log_ratio_sums(lp, b) for lp, b in zip(lps, batches)]
    total = sum(sums)
    loss = sum(objective_loss(lp, b, config, s if per_pack else total) for lp, b, s in zip(lps, batches, sums))
    if config.kl_coef > 0:
        with torch.no_grad():
            refs = [_logprobs(reference_model, b, temperature) for b in batches]
        loss = loss + sum(kl_penalty(lp, b, config, r)[0] for lp, b, r in zip(lps, batches, refs))
    loss.backward()
    return float(loss.detach()), _per_expert({n: p.grad.detach().numpy().copy() for n, p in hf.named_parameters()
                                              if p.grad is not None})


def _reference_entropy(hf: torch.nn.Module, micro: list) -> float:
    """Σ over trained tokens of the entropy of the distribution that predicted each (HF, float64)."""
    total = 0.0
    with torch.no_grad():
        for b in (p.to_batch() for m in micro for p in m.packs):
            for k in range(len(b.cu_seqlens) - 1):
                a, z = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
                logp = torch.log_softmax(hf(b.token_ids[a:z][None]).logits[0], dim=-1)
                entropy = -(logp.exp() * logp).sum(-1)  # position t predicts token t + 1
                total += float(entropy[:-1][b.loss_weights[a + 1:z] > 0].sum())
    return total


def _megatron(w, micro: list, queue: int, objective: ObjectiveConfig | None = None) -> tuple[dict, dict]:
    core = w.ranks_of(0)
    tk = w.submit(core, "stream_grads_hf", queue, objective)
    q = w.queues[queue]
    for m in micro:
        q.put(m)
    q.close()
    res = w.wait(tk, 120)
    grads = {k: v for r in res for k, v in r["grads"].items()}
    return grads, next(r["objective"] for r in res if "objective" in r)  # the last stage, tensor rank 0


def test_loss_and_gradients_equal_the_float64_reference(world) -> None:
    w, hf = world
    micro = make_gspo_microsteps(hf, OFFSETS, ADVANTAGES, spike=SPIKE, seed=3)
    ref_loss, ref_grads = _reference(hf, micro)
    grads, fig = _megatron(w, micro, 0)
    assert set(grads) == set(ref_grads)
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    worst = max(float(np.abs(grads[n] - ref_grads[n]).max()) for n in ref_grads)
    print(f"\nGSPO {w.opts.spec.family} tp{w.opts.tp} ep{w.opts.ep} pp{w.opts.pp}: loss Megatron {fig['loss']:.9f} vs ref {ref_loss:.9f}; "
          f"grad max|diff| {worst:.3g} of max|g| {scale:.3g}; figures {fig}")
    assert scale > 1e-4
    assert worst <= 1e-5 * scale, (worst, scale)
    assert fig["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9)
    # what the run reports: executions seen, the clipped ones, the cap-breaking ratio
    assert fig["executions"] == len(OFFSETS) and fig["clipped"] == EXPECTED_CLIPPED
    assert fig["ratio_max"] == pytest.approx(np.exp(2.5 + OFFSETS[6]), rel=1e-3)


def _worst(grads: dict, ref: dict) -> float:
    return max(float(np.abs(grads[n] - ref[n]).max()) for n in ref)


def test_split_executions_are_clipped_on_their_whole_ratio(world) -> None:
    w, hf = world
    micro = make_gspo_microsteps(hf, SPLIT_OFFSETS, SPLIT_ADVANTAGES, split=SPLIT, seed=7)
    assert [bool(m.packs[0].outside) for m in micro] == [True, True, True, False]  # parts in micro-steps 0-2
    ref_loss, ref_grads = _reference(hf, micro)
    _, part_grads = _reference(hf, micro, per_pack=True)
    grads, fig = _megatron(w, micro, 6)
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    print(f"\nGSPO split pp{w.opts.pp}: grad max|diff| {_worst(grads, ref_grads):.3g} vs the whole-execution "
          f"reference, {_worst(grads, part_grads):.3g} vs part-by-part clipping, of max|g| {scale:.3g}; {fig}")
    assert _worst(part_grads, ref_grads) > 1e-2 * scale  # the case tells the two rules apart
    assert _worst(grads, ref_grads) <= 1e-5 * scale
    assert fig["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9)
    # executions, not parts: the split ones count once each
    assert fig["executions"] == pytest.approx(len(SPLIT_OFFSETS)) and fig["clipped"] == pytest.approx(SPLIT_CLIPPED)
    assert fig["ratio_pass_tokens"] > 0


def test_token_level_objectives_equal_their_reference_without_the_ratio_pass(world) -> None:
    """GRPO, DAPO, CISPO, and GSPO under IcePop's mask on the split executions: Megatron's
    gradient equals the float64 reference of each (the core's objective on HF's model), and no
    split execution's other rows are run forward, since none of them clips on the whole
    execution's ratio. Their offsets put
    token ratios on both sides of GSPO's bounds; a token far past the cap is past every other."""
    w, hf = world
    micro = make_gspo_microsteps(hf, SPLIT_OFFSETS, SPLIT_ADVANTAGES, split=SPLIT, spike={4: 0.6}, seed=9)
    entropy = _reference_entropy(hf, micro)
    cases = (("grpo", "none"), ("dapo", "none"), ("cispo", "none"), ("gspo", "icepop"))
    for queue, (kind, correction) in enumerate(cases, start=8):
        low, high = OBJECTIVE_CLIPS[kind]
        cfg = ObjectiveConfig(kind=kind, clip_low=low, clip_high=high, token_normaliser=8, correction=correction,
                              correction_low=0.999, correction_high=1.5)
        ref_loss, ref_grads = _reference(hf, micro, cfg)
        grads, fig = _megatron(w, micro, queue, cfg)
        scale = max(float(np.abs(g).max()) for g in ref_grads.values())
        print(f"\n{kind} pp{w.opts.pp}: grad max|diff| {_worst(grads, ref_grads):.3g} of max|g| {scale:.3g}; {fig}")
        assert scale > 1e-5
        assert _worst(grads, ref_grads) <= 1e-5 * scale
        assert fig["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9)
        assert fig["ratio_pass_tokens"] == 0 and fig["executions"] == pytest.approx(len(SPLIT_OFFSETS))
        if correction == "none":
            assert fig["clipped_tokens"] >= 1  # the spike's token (ratio e^0.6: past 1.28)
        else:  # masked: the spike's token (past 1.5) and those below 0.999
            assert fig["corrected_tokens"] >= 2 and fig["clipped_tokens"] == 0
        assert fig["k3_sum"] > 0 and fig["abs_delta_max"] == pytest.approx(0.6 + SPLIT_OFFSETS[4], rel=1e-3)
        assert fig["entropy_sum"] == pytest.approx(entropy, rel=1e-5)  # over the whole vocabulary, any TP


def test_calls_sampled_at_a_temperature_are_trained_at_it(world) -> None:
    """Behaviour log-probs of softmax(logits / 0.7), as SGLang reports them: the trainer's ratios
    are those of the tempered distribution (each execution's s_e as planned, the spike capped) and
    the gradient is the tempered reference's."""
    w, hf = world
    micro = make_gspo_microsteps(hf, OFFSETS, ADVANTAGES, spike=SPIKE, seed=8, split=(0, 1), temperature=0.7)
    ref_loss, ref_grads = _reference(hf, micro, temperature=0.7)
    grads, fig = _megatron(w, micro, 7)
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    print(f"\nGSPO T=0.7 pp{w.opts.pp}: grad max|diff| {_worst(grads, ref_grads):.3g} of max|g| {scale:.3g}; {fig}")
    assert _worst(grads, ref_grads) <= 1e-5 * scale
    assert fig["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9)
    assert fig["clipped"] == pytest.approx(EXPECTED_CLIPPED)
    assert fig["ratio_max"] == pytest.approx(np.exp(2.5 + OFFSETS[6]), rel=1e-3)


def test_flipped_advantages_flip_the_gradient_and_zero_advantages_give_none(world) -> None:
    w, hf = world
    inside = [0.001, -0.001, 0.002, -0.002]  # every ratio inside the bounds: nothing clipped
    adv = [1.0, -0.5, 0.3, 2.0]
    g_pos, _ = _megatron(w, make_gspo_microsteps(hf, inside, adv, seed=4), 1)
    g_neg, _ = _megatron(w, make_gspo_microsteps(hf, inside, [-a for a in adv], seed=4), 2)
    g_zero, fig0 = _megatron(w, make_gspo_microsteps(hf, inside, [0.0] * 4, seed=4), 3)
    scale = max(float(np.abs(g).max()) for g in g_pos.values())
    assert scale > 1e-4
    for n in g_pos:
        np.testing.assert_allclose(g_neg[n], -g_pos[n], rtol=0, atol=1e-6 * scale, err_msg=n)
        assert not np.any(g_zero[n]), n
    assert fig0["loss"] == 0.0 and fig0["clipped"] == 0


def test_a_step_with_nothing_to_train_leaves_the_weights_alone(world) -> None:
    """Filter rule: a step whose groups all came up empty streams no micro-step; after a real step
    has given Adam momentum, the empty one must not move a single weight (nor fail)."""
    w, hf = world
    core = w.ranks_of(0)
    w.call(core, "save_state")
    try:
        tk = w.submit(core, "run_step", 100, 4)
        q = w.queues[4]
        for m in make_gspo_microsteps(hf, OFFSETS, ADVANTAGES, seed=6):
            q.put(m)
        q.close()
        real = w.wait(tk, 120)
        assert "skipped_update" not in real[0] and real[0]["update_ok"]
        before = w.call(core, "params_numpy")
        w.queues[5].close()
        empty = w.wait(w.submit(core, "run_step", 101, 5), 120)
        assert empty[0]["micro_steps"] == 0 and empty[0]["total_tokens"] == 0
        assert empty[0]["skipped_update"] == "no trainable tokens"
        after = w.call(core, "params_numpy")
        for pa, pb in zip(before, after):
            for name in pa:
                np.testing.assert_array_equal(pb[name], pa[name], err_msg=name)
    finally:
        w.call(core, "restore_state")


def test_a_kl_penalty_runs_each_micro_step_through_the_reference_weights(world, tmp_path) -> None:
    """``training.kl_coef``: after one update the policy has moved from its reference (the
    weights it started with, held frozen on each rank); every micro-step runs forward once more
    through the reference, and the gradient of the objective plus β·KL equals the float64
    reference with HF's model at the updated weights and at the reference's."""
    from gyre_megatron.export import load_hf_model, publish

    w, hf = world
    core = w.ranks_of(0)
    w.call(core, "hold_reference")
    w.call(core, "save_state")
    try:
        tk = w.submit(core, "run_step", 200, 12)
        q = w.queues[12]
        for m in make_gspo_microsteps(hf, OFFSETS, ADVANTAGES, seed=11):
            q.put(m)
        q.close()
        assert w.wait(tk, 120)[0]["update_ok"]
        moved = load_hf_model(publish(w, PublicationOptions(folder=str(tmp_path)), version=201).location).double()
        micro = make_gspo_microsteps(moved, OFFSETS, ADVANTAGES, split=(0, 1), seed=12)
        for queue, estimator in ((13, "k1"), (14, "low_var")):
            cfg = ObjectiveConfig(kl_coef=0.5, kl_estimator=estimator)
            ref_loss, ref_grads = _reference(moved, micro, cfg, reference_model=hf)
            _, plain = _reference(moved, micro)
            grads, fig = _megatron(w, micro, queue, cfg)
            scale = max(float(np.abs(g).max()) for g in ref_grads.values())
            print(f"\nKL {estimator} pp{w.opts.pp} tp{w.opts.tp}: grad max|diff| {_worst(grads, ref_grads):.3g} "
                  f"of max|g| {scale:.3g}, the penalty moves it by {_worst(plain, ref_grads):.3g}; "
                  f"KL/token {fig['kl_ref_sum'] / fig['tokens']:.3g}, reference passes {fig['reference_pass_s']:.3f} s")
            assert _worst(plain, ref_grads) > 1e-3 * scale  # the penalty is not lost in the tolerance
            assert _worst(grads, ref_grads) <= 1e-5 * scale
            assert fig["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9)
            assert fig["reference_pass_s"] > 0 and fig["ratio_pass_tokens"] > 0  # the split rows ran too
            if estimator == "low_var":
                assert fig["kl_ref_sum"] > 0  # the policy moved: k3 > 0
    finally:
        w.call(core, "restore_state")
        w.call(core, "drop_reference")


@pytest.fixture(scope="module")
def world_k2(tmp_path_factory):
    from gyre_megatron.export import load_hf_model, publish
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions

    opts = RankOptions(cells=2, pp=1, normalise_by_tokens=False, keep_update_grads=True)
    with World(opts, n_queues=1 + JOIN_ATTEMPTS) as w:
        ref = publish(w, PublicationOptions(folder=str(tmp_path_factory.mktemp("gspo-k2"))), version=0)
        yield w, load_hf_model(ref.location).double()


@pytest.mark.mooncake
def test_a_satellite_that_joins_trains_the_same_objective(world_k2) -> None:
    """The same GSPO micro-steps, with executions split across them, once on the core alone and
    once with a satellite that joins mid-batch: the update's gradient (reduced over the cells,
    before the optimizer, where a scale error would show) equals the float64 reference both
    times, the cells' losses add up to it, and the updated weights agree."""
    import time

    from gyre_megatron.testing import feed_in_bursts

    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda + libibverbs1)")
    w, hf = world_k2
    micro = make_gspo_microsteps(hf, SPLIT_OFFSETS, SPLIT_ADVANTAGES, split=SPLIT, seed=5)
    ref_loss, ref_grads = _reference(hf, micro)
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    core, sat = w.ranks_of(0), w.ranks_of(1)
    w.call(core + sat, "save_state")
    tk = w.submit(core, "run_step", 0, 0)
    feed_in_bursts(w.queues[0], micro, burst=4, gap_s=0)
    alone = w.wait(tk, 120)
    grads_alone = {k: v for r in w.call(core, "update_grads_hf") for k, v in r.items()}
    params_a = w.call(core, "params_numpy")
    w.call(core + sat, "restore_state")
    for attempt in range(1, JOIN_ATTEMPTS + 1):  # a loaded machine may let the core take every micro-step
        q = w.queues[attempt]
        tk_core = w.submit(core, "run_step", attempt, attempt)
        q.put(micro[0])
        deadline = time.monotonic() + 30
        while q.unclaimed() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        tk_sat = w.submit(sat, "run_step", attempt, attempt)
        time.sleep(1.0)  # let the satellite register and pull before the rest arrives
        feed_in_bursts(q, micro[1:], burst=1, gap_s=0.5).join()
        b_core, b_sat = w.wait(tk_core, 120), w.wait(tk_sat, 120)
        if b_sat[0].get("micro_steps", 0) >= 1:
            break
        w.call(core + sat, "restore_state")
    grads_joined = {k: v for r in w.call(core, "update_grads_hf") for k, v in r.items()}
    assert b_sat[0]["joined"] and b_sat[0]["m"] == 2 and b_sat[0]["micro_steps"] >= 1, b_sat
    assert set(grads_alone) == set(grads_joined) == set(ref_grads)
    print(f"\nGSPO join: core {b_core[0]['micro_steps']} / satellite {b_sat[0]['micro_steps']} micro-steps; "
          f"grad max|diff| alone {_worst(grads_alone, ref_grads):.3g}, joined {_worst(grads_joined, ref_grads):.3g} "
          f"of max|g| {scale:.3g}")
    assert _worst(grads_alone, ref_grads) <= 1e-5 * scale
    assert _worst(grads_joined, ref_grads) <= 1e-5 * scale
    assert alone[0]["objective"]["loss"] == pytest.approx(ref_loss, rel=1e-6)
    joined = b_core[0]["objective"]["loss"] + b_sat[0]["objective"]["loss"]
    assert joined == pytest.approx(ref_loss, rel=1e-6)
    clipped = b_core[0]["objective"]["clipped"] + b_sat[0]["objective"]["clipped"]
    assert clipped == pytest.approx(SPLIT_CLIPPED)
    params_b = w.call(core, "params_numpy")
    for pa, pb in zip(params_a, params_b):
        for name in pa:
            np.testing.assert_allclose(pb[name], pa[name], rtol=0, atol=5e-6, err_msg=name)
