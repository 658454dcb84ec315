"""§2-§4 on one shared world of 2 cells x PP=2 (gloo, real megatron-core, Mooncake over TCP).

Order matters (pytest keeps file order): the data-timeout probe, which leaves a stray message on
the pipeline group, runs last.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

from gyre_megatron.testing import feed_in_bursts, make_items  # noqa: E402


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_stream_in_bursts_equals_stock_1f1b_pp2(world_k2_pp2) -> None:
    w = world_k2_pp2
    items = make_items(7, seed=1)
    tk = w.submit(w.ranks_of(0), "stock_vs_stream", items, 0)
    feed_in_bursts(w.queues[0], items, burst=3, gap_s=1.2)
    res = w.wait(tk, 120)
    from gyre_megatron.compat import mcore_version

    assert {i["mcore"] for i in w.info} == {mcore_version()}  # ranks run the release under test
    last = res[-1]
    assert len(last["stream_losses"]) == 7
    assert last["stream_losses"] == last["stock_losses"]  # bit-identical per micro-step
    for r in res:
        assert r["micro_steps"] == 7
        assert r["pauses"] >= 1  # bursts really paused the pipeline
        print(f"\npp2: grad max|diff| {_max_diff(r['stock_grads'], r['stream_grads']):.3g}, pauses {r['pauses']}")
        assert _max_diff(r["stock_grads"], r["stream_grads"]) <= 1e-6
        assert max(float(np.abs(g).max()) for g in r["stock_grads"]) > 0


@pytest.mark.mooncake
def test_satellite_joins_mid_batch_and_matches_core_alone(world_k2_pp2) -> None:
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda + libibverbs1)")
    w = world_k2_pp2
    core, sat = w.ranks_of(0), w.ranks_of(1)
    everyone = core + sat
    items = make_items(12, seed=2)
    w.call(everyone, "save_state")
    # run A: the core alone processes every micro-step
    tk = w.submit(core, "run_step", 0, 1)
    feed_in_bursts(w.queues[1], items, burst=4, gap_s=0.2)
    a = w.wait(tk, 120)
    assert all(r["m"] == 1 and r["micro_steps"] == 12 for r in a)
    params_a = w.call(core, "params_numpy")
    w.call(everyone, "restore_state")
    # run B: same micro-steps, the satellite joins while the batch runs
    q = w.queues[2]
    tk_core = w.submit(core, "run_step", 1, 2)
    for it in items[:4]:
        q.put(it)
    deadline = time.monotonic() + 30
    while q.unclaimed() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    tk_sat = w.submit(sat, "run_step", 1, 2)
    time.sleep(1.0)  # let the satellite register and pull before the rest arrives
    feed_in_bursts(q, items[4:], burst=2, gap_s=0.3).join()
    b_core = w.wait(tk_core, 120)
    b_sat = w.wait(tk_sat, 120)
    assert all(r["joined"] and r["m"] == 2 for r in b_sat)
    assert b_sat[0]["micro_steps"] >= 1, "the satellite took no micro-step"
    assert b_core[0]["micro_steps"] + b_sat[0]["micro_steps"] == 12
    claimed = sorted(b_core[0]["claimed"] + b_sat[0]["claimed"])
    assert claimed == list(range(12))  # every micro-step exactly once
    assert all(r["pull_bytes"] > 0 for r in b_sat)
    params_b = w.call(core, "params_numpy")
    params_sat = w.call(sat, "params_numpy")
    worst = max(float(np.abs(pb[n] - pa[n]).max()) for pa, pb in zip(params_a, params_b) for n in pa)
    print(f"\njoin: core {b_core[0]['micro_steps']} / satellite {b_sat[0]['micro_steps']} micro-steps, "
          f"pulled {[r['pull_bytes'] for r in b_sat]} B in {[round(r['pull_s'], 4) for r in b_sat]} s, "
          f"params max|core+sat - core alone| {worst:.3g}")
    for pa, pb, ps in zip(params_a, params_b, params_sat):
        for name in pa:
            np.testing.assert_allclose(pb[name], pa[name], rtol=0, atol=5e-6, err_msg=name)
            assert np.array_equal(ps[name], pb[name]), f"satellite differs from core: {name}"


def test_leave_enter_training_roundtrip_is_bit_exact(world_k2_pp2) -> None:
    w = world_k2_pp2
    core = w.ranks_of(0)
    before = w.call(core, "state_digest")
    left = w.call(core, "leave_training")
    assert all(r["released_bytes"] > 0 and r["remaining_bytes"] == 0 for r in left)
    w.call(core, "enter_training")
    assert w.call(core, "state_digest") == before


def test_export_pp2_losses_match_hf(world_k2_pp2, tmp_path) -> None:
    pytest.importorskip("transformers")
    import torch

    from gyre_megatron.export import load_hf_model, publish
    from gyre_core.interfaces import PublicationOptions

    w = world_k2_pp2
    ref = publish(w, PublicationOptions(folder=str(tmp_path)), version=1)
    items = make_items(3, seed=6)
    tk = w.submit(w.ranks_of(0), "stock_vs_stream", items, 4)
    feed_in_bursts(w.queues[4], items, burst=3, gap_s=0)
    losses = w.wait(tk, 120)[-1]["stock_losses"]
    hf = load_hf_model(ref.location)
    for it, mloss in zip(items, losses):
        with torch.no_grad():
            logits = hf(it["tokens"]).logits[0]
        ce = torch.nn.functional.cross_entropy(logits, it["labels"][0], reduction="none")
        hloss = float((ce * it["loss_mask"][0]).sum())
        print(f"\nexport pp2: loss HF {hloss:.6f} vs Megatron {mloss:.6f}")
        assert abs(hloss - mloss) <= 1e-4 * max(1.0, abs(mloss)), (hloss, mloss)


def test_data_plane_microsteps_stream_like_stock(world_k2_pp2) -> None:
    """Real ``MicroStep`` values from the data plane's queue, weighted by their ``W_t``."""
    from gyre_megatron.microsteps import microstep_to_item
    from gyre_megatron.testing import make_microsteps

    w = world_k2_pp2
    steps = make_microsteps(5, rows=2, seq_len=16, seed=7)
    items = [microstep_to_item(m) for m in steps]
    assert items[0]["tokens"].shape == (2, 16)
    w0 = items[0]["loss_mask"][0]  # row of 16 tokens: 8 context, then 8 sampled
    assert float(w0[:7].sum()) == 0 and float(w0[7]) > 0 and float(w0[15]) == 0  # position t weighs W_{t+1}
    tk = w.submit(w.ranks_of(0), "stock_vs_stream", items, 5)
    feed_in_bursts(w.queues[5], steps, burst=2, gap_s=0.5)  # the queue carries the MicroSteps
    res = w.wait(tk, 120)
    assert res[-1]["stream_losses"] == res[-1]["stock_losses"]
    for r in res:
        assert r["micro_steps"] == 5
        assert _max_diff(r["stock_grads"], r["stream_grads"]) <= 1e-6


def test_pause_longer_than_data_group_timeout_completes(world_k2_pp2) -> None:
    w = world_k2_pp2
    DATA_TIMEOUT_S = w.opts.data_timeout_s
    items = make_items(4, seed=3)
    pause = DATA_TIMEOUT_S * 1.75
    tk = w.submit(w.ranks_of(0), "stock_vs_stream", items, 3)
    feed_in_bursts(w.queues[3], items, burst=2, gap_s=pause)
    res = w.wait(tk, 120)
    assert res[-1]["stream_losses"] == res[-1]["stock_losses"]
    for r in res:
        assert r["pauses"] >= 1 and r["paused_s"] >= DATA_TIMEOUT_S


def test_negative_control_data_group_times_out_without_side_group(world_k2_pp2) -> None:
    """Without the side group a paused stage blocked in a pipeline recv would fail."""
    w = world_k2_pp2
    out = w.call(w.ranks_of(1), "probe_data_timeout", w.opts.data_timeout_s * 1.75)
    assert out[1].startswith("timeout"), out
