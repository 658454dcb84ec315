"""§3/§4/§7 through the plugin seam: ``gyre_make_training_side`` for 3 cells x PP = 1.

Cells enter as a growing prefix: cell 1 joins step 0 mid-batch (prefix of 2), stays for step 1,
which cell 2 joins mid-batch (prefix of 3, the second prefix group set).

The sides come from the entry-point-loaded plugin manager, as ``gyre-orchestrate`` gets them.
The fault test kills a satellite mid-batch: the core must notice within a bounded time, apply
nothing, report the dead cell's claimed micro-steps for re-queueing (none counted twice), and
finish the batch with the surviving cells with the same result as a core-only run.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.mooncake, pytest.mark.timeout(300)]
pytest.importorskip("megatron.core")
pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda + libibverbs1)")

from gyre_megatron.testing import feed_in_bursts, make_items, rank_store, wait_claimed  # noqa: E402


def _wait_joined(world, step: int, cell: int, timeout_s: float = 60.0) -> None:
    """Until cell ``cell`` has registered in step ``step`` (a loaded machine, e.g. a CI matrix run,
    can otherwise let the core drain the queue before the satellite's rank gets to it)."""
    store = rank_store(world.port)
    key = f"gyre/step{step}/join{cell}"
    deadline = time.monotonic() + timeout_s
    while not (store.check([key]) and store.get(key) == b"joined"):
        assert time.monotonic() < deadline, f"cell {cell} did not join step {step}"
        time.sleep(0.02)

DATA_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    from gyre_core.plugins import plugin_manager
    from gyre_megatron.side import shutdown_worlds

    pm = plugin_manager()
    from gyre_core.interfaces import PublicationOptions, TrainingOptions

    opts = TrainingOptions(cells=3, pp=1, lr=1e-3, data_timeout_s=DATA_TIMEOUT_S, side_timeout_s=DATA_TIMEOUT_S,
                           heartbeat_s=0.3, max_steps=8, step_timeout_s=120,
                           publication=PublicationOptions(folder=str(tmp_path_factory.mktemp("weights"))))
    try:
        s0 = pm.hook.gyre_make_training_side(cell=0, options=opts)
        s1 = pm.hook.gyre_make_training_side(cell=1, options=opts)
        s2 = pm.hook.gyre_make_training_side(cell=2, options=opts)
        yield s0, s1, s2
    finally:
        shutdown_worlds()


def test_hook_gives_training_sides_that_run_a_joined_step(sides) -> None:
    from gyre_core.interfaces import TrainingSide

    s0, s1, s2 = sides
    assert all(isinstance(s, TrainingSide) for s in sides)
    assert s0.world is s1.world is s2.world
    for s in sides:
        (t,) = s.leave_training()
        assert (t.transition, t.phase) == ("to_rollout", "offload_training_state")
        (t,) = s.enter_training()
        assert t.transition == "to_training" and t.duration >= 0
    items = make_items(8, seed=20)
    q = s0.micro_step_queue(0)
    s0.start_step(0)
    for it in items[:3]:
        q.put(it)
    wait_claimed(q)
    s1.join_step(0)
    _wait_joined(s0.world, 0, 1)
    feed_in_bursts(q, items[3:], burst=1, gap_s=0.2).join()
    s0.close_stream(0)
    s1.close_stream(0)
    (core,), (sat,) = s0.last_step_info, s1.last_step_info
    assert core["m"] == sat["m"] == 2 and sat["joined"]
    assert sorted(core["claimed"] + sat["claimed"]) == list(range(8))
    params = s0.world.call([0, 1], "params_numpy")
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])
    # the next step of the burst: cell 1 stays and needs no pull (it got the update); cell 2 joins
    items = make_items(8, seed=22)
    q = s0.micro_step_queue(1)
    s0.start_step(1)
    s1.join_step(1)
    for it in items[:3]:
        q.put(it)
    wait_claimed(q)
    s2.join_step(1)
    _wait_joined(s0.world, 1, 1)
    _wait_joined(s0.world, 1, 2)
    feed_in_bursts(q, items[3:], burst=1, gap_s=0.2).join()
    for s in sides:
        s.close_stream(1)
    (core,), (sat1,), (sat2,) = (s.last_step_info for s in sides)
    assert sat1["joined"] and "pull_bytes" not in sat1 and sat2["pull_bytes"] > 0
    assert core["m"] == sat1["m"] == sat2["m"] == 3
    assert sorted(core["claimed"] + sat1["claimed"] + sat2["claimed"]) == list(range(8))
    params = s0.world.call([0, 1, 2], "params_numpy")
    assert all(np.array_equal(params[0][k], p[k]) for p in params[1:] for k in params[0])
    ref = s0.publish_weights(1)
    assert ref.version == 1
    import os

    assert os.path.isfile(os.path.join(ref.location, "model.safetensors"))
    # Exporting (and reading parameters out) must not pin their storages: the cells can still
    # leave training right after a publication, and come back bit-exact.
    for s in sides:
        s.leave_training()
        s.enter_training()
    after = s0.world.call([0], "params_numpy")[0]
    assert all(np.array_equal(after[k], params[0][k]) for k in after)


def test_dead_satellite_fails_step_cleanly_and_survivors_finish_batch(sides) -> None:
    """Cells 1 and 2 join; cell 2 dies mid-batch. The step fails without applying anything, cell
    2's claimed micro-steps are re-queued, and the core with cell 1 (the surviving prefix)
    finishes the batch on their kept gradients: the result equals a core-only run."""
    from gyre_megatron.launch import RankError
    from gyre_megatron.runtime import StepFailed

    s0, s1, s2 = sides
    w = s0.world
    items = make_items(10, seed=21)
    w.call([0, 1, 2], "save_state")
    # reference: the core alone
    q = s0.micro_step_queue(2)
    s0.start_step(2)
    feed_in_bursts(q, items, burst=5, gap_s=0.1).join()
    s0.close_stream(2)
    ref = w.call([0], "params_numpy")[0]
    w.call([0, 1, 2], "restore_state")
    # cells 1 and 2 join; cell 2 dies after claiming 2 micro-steps (or at the end of the stream)
    q = s0.micro_step_queue(3)
    s0.start_step(3)
    for it in items[:2]:
        q.put(it)
    wait_claimed(q)
    s1.join_step(3)
    time.sleep(0.3)
    sat_ticket = w.submit([2], "run_step", 3, s2._queue_index(3), False, 2)
    time.sleep(0.5)
    feed_in_bursts(q, items[2:], burst=3, gap_s=0.3).join()
    t0 = time.monotonic()
    with pytest.raises(StepFailed) as failure:
        s0.close_stream(3)
    detect_s = time.monotonic() - t0
    assert detect_s <= DATA_TIMEOUT_S + 10, detect_s
    with pytest.raises(StepFailed):
        s1.close_stream(3)
    with pytest.raises(RankError, match="died"):
        w.wait(sat_ticket, 30)
    assert failure.value.survivors == 2
    assert list(failure.value.requeue) == [2]
    requeued = failure.value.requeue[2]
    (core,), (sat1,) = s0.last_step_info, s1.last_step_info
    assert sorted(core["claimed"] + sat1["claimed"] + requeued) == list(range(10))  # none lost or twice
    print(f"\nfault: detected in {detect_s:.2f} s after the stream closed; re-queued {requeued}; "
          f"core kept {len(core['claimed'])}, cell 1 kept {len(sat1['claimed'])}")
    # the surviving prefix finishes the batch with the re-queued micro-steps
    q2, done0 = s0.resume_step(3)
    _, done1 = s1.resume_step(3)
    for i in requeued:
        q2.put(items[i])
    q2.close()
    (info,) = done0()
    (info1,) = done1()
    assert info["m"] == info1["m"] == 2 and info["update_ok"]
    assert info["micro_steps"] + info1["micro_steps"] == len(requeued)
    got = w.call([0, 1], "params_numpy")
    print(f"fault: params max|survivors - core alone| {max(float(np.abs(got[0][k] - ref[k]).max()) for k in ref):.3g}")
    for k in ref:
        np.testing.assert_allclose(got[0][k], ref[k], rtol=0, atol=5e-6, err_msg=k)
        assert np.array_equal(got[1][k], got[0][k]), k


def test_after_a_death_the_restarted_world_carries_the_core_and_the_dead_cell_rejoins(sides) -> None:
    """The cell that died in the test above comes back: every rank is started anew, the core's
    parameters, optimizer and version carried across, and the dead cell joins the next step,
    pulling the core's weights (it comes back at no version)."""
    s0, s1, s2 = sides
    w = s0.world
    before = w.call([0], "params_numpy")[0]
    old_pids = [p.pid for p in w.procs]
    info = s0.restart_ranks()
    print(f"\nrestart: every rank anew in {info['restart_s']:.2f} s")
    assert info["restarts"] == 1 and not set(old_pids) & {p.pid for p in w.procs}
    after = w.call([0], "params_numpy")[0]
    assert all(np.array_equal(after[k], before[k]) for k in before)
    items = make_items(8, seed=23)
    q = s0.micro_step_queue(4)
    s0.start_step(4)
    for it in items[:3]:
        q.put(it)
    wait_claimed(q)
    s1.join_step(4)
    s2.join_step(4)
    time.sleep(0.5)
    feed_in_bursts(q, items[3:], burst=1, gap_s=0.2).join()
    for s in sides:
        s.close_stream(4)
    (core,), (sat1,), (sat2,) = (s.last_step_info for s in sides)
    assert core["m"] == 3 and sat2["joined"] and sat2["pull_bytes"] > 0 and core["update_ok"]
    assert sorted(core["claimed"] + sat1["claimed"] + sat2["claimed"]) == list(range(8))
    params = w.call([0, 1, 2], "params_numpy")
    assert all(np.array_equal(params[0][k], p[k]) for p in params[1:] for k in params[0])
    assert not all(np.array_equal(params[0][k], before[k]) for k in before)  # the step updated the core


def test_a_core_whose_ranks_stop_mid_stream_says_so_before_the_stream_closes(sides) -> None:
    """The core's rank raises on a micro-step (as one out of memory would). Nobody claims the
    step's micro-steps after that, so the live run cannot wait for the close to hear it:
    ``stream_failure`` names the rank's error at once, while the stream is still open, and
    says nothing while the step runs."""
    from gyre_core.interfaces import StepFailed, StreamHealth

    s0, _, _ = sides
    assert isinstance(s0, StreamHealth)
    items = make_items(4, seed=24)
    q = s0.micro_step_queue(5)
    s0.start_step(5)
    q.put(items[0])
    wait_claimed(q)
    assert s0.stream_failure(5) is None  # running, well
    q.put({"index": items[1]["index"]})  # a micro-step the model cannot read: the rank raises
    deadline = time.monotonic() + 30
    while (why := s0.stream_failure(5)) is None:
        assert time.monotonic() < deadline, "the core's failure was not seen while the stream was open"
        time.sleep(0.1)
    print(f"\nstream failure seen: {why[:120]}")
    assert why.startswith("rank 0:") and "KeyError" in why
    q.close()
    with pytest.raises(StepFailed) as failure:  # the close still reports it, as before
        s0.close_stream(5)
    assert failure.value.survivors == 0
