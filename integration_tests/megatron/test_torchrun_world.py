"""Ranks started by ``torchrun`` (two "nodes" on loopback) join a run's control plane and train.

This is how a cluster starts Gyre's training ranks: the orchestrator serves its control plane,
and each node runs ``torchrun ... -m gyre_megatron.worker``. Here two torchrun agents, each one
node of one rank, make a world of two cells; a satellite joins the core's step mid-batch through
micro-step queues served over TCP, both cells end with identical parameters, each micro-step is
claimed exactly once, and the weights export (tensors travel by value) matches the ranks'.
Everything the test starts it stops by process group.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
pytest.importorskip("megatron.core")

from gyre_megatron.testing import (  # noqa: E402
    feed_in_bursts, free_port, make_items, start_torchrun_nodes, stop_nodes, wait_claimed)


@pytest.fixture(scope="module")
def torchrun_sides(tmp_path_factory):
    from gyre_core.plugins import plugin_manager
    from gyre_megatron.control import write_key
    from gyre_megatron.side import shutdown_worlds

    tmp = tmp_path_factory.mktemp("torchrun")
    key_file = tmp / "control.key"
    write_key(key_file)
    port = free_port()
    # two "nodes" with addresses of their own: the satellite must read the core's parameters
    # from the address node 0 advertised (127.0.0.2), not from any loopback it would assume
    procs = start_torchrun_nodes(2, 1, f"127.0.0.1:{port}", key_file, tmp,
                                 node_env=[{"GYRE_MOONCAKE_HOST": "127.0.0.2"}, {"GYRE_MOONCAKE_HOST": "127.0.0.4"}])
    pm = plugin_manager()
    from gyre_core.interfaces import LaunchOptions, MooncakeOptions, PublicationOptions, TrainingOptions

    opts = TrainingOptions(
        cells=2, pp=1, lr=1e-3, data_timeout_s=10.0, side_timeout_s=10.0, heartbeat_s=0.3, max_steps=4,
        step_timeout_s=120,
        publication=PublicationOptions(transport="mooncake", folder=str(tmp / "weights"),
                                       mooncake=MooncakeOptions(peer="127.0.0.1")),
        launch=LaunchOptions(launcher="torchrun", control_host="127.0.0.1", control_port=port,
                             key_file=str(key_file), join_timeout_s=180))
    try:
        s0 = pm.hook.gyre_make_training_side(cell=0, options=opts)
        s1 = pm.hook.gyre_make_training_side(cell=1, options=opts)
        yield s0, s1, procs, tmp
    finally:
        shutdown_worlds()
        codes = stop_nodes(procs)
        print("torchrun exit codes", codes, (tmp / "node0.log").read_text()[-2000:])


def test_torchrun_ranks_train_a_joined_step(torchrun_sides) -> None:
    from gyre_megatron.launch import ClusterWorld

    s0, s1, procs, _ = torchrun_sides
    assert isinstance(s0.world, ClusterWorld) and s0.world is s1.world
    assert s0.world.server.joined() == [0, 1]
    for s in (s0, s1):
        s.leave_training()
        s.enter_training()
    items = make_items(8, seed=3)
    q = s0.micro_step_queue(0)
    s0.start_step(0)
    for it in items[:3]:
        q.put(it)
    wait_claimed(q)
    s1.join_step(0)
    time.sleep(0.5)
    feed_in_bursts(q, items[3:], burst=1, gap_s=0.2).join()
    s0.close_stream(0)
    s1.close_stream(0)
    (core,), (sat,) = s0.last_step_info, s1.last_step_info
    assert core["m"] == sat["m"] == 2 and sat["joined"]
    assert sat["pull_bytes"] > 0 and sat["pull_from"].rsplit(":", 1)[0] == "127.0.0.2"
    assert sorted(core["claimed"] + sat["claimed"]) == list(range(8))  # each micro-step exactly once
    params = s0.world.call([0, 1], "params_numpy")
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])


def test_export_from_torchrun_ranks_matches_their_logits(torchrun_sides) -> None:
    """Version 1, published over Mooncake (this run's transport) and then written as a checkpoint
    from the bytes still exposed, assembled from tensors that crossed the control plane by value,
    is the model the ranks hold: HF Qwen2 on it gives the core's logits."""
    import json

    import torch

    from gyre_megatron.export import load_hf_model

    s0, _, _, tmp = torchrun_sides
    assert json.loads(s0.publish_weights(1).location)["format"] == "gyre.mooncake.parts.v1"
    ref = s0.write_weights(1, str(tmp / "written" / "v1"))
    tokens = make_items(1, seed=5)[0]["tokens"]
    (mlogits,) = s0.world.call([0], "logits", tokens)
    with torch.no_grad():
        hlogits = load_hf_model(ref.location)(tokens).logits.numpy()
    assert hlogits.shape == mlogits.shape
    assert float(np.abs(hlogits - mlogits).max()) <= 1e-4
    assert float(np.abs(mlogits).max()) > 0.1


def test_ranks_exit_cleanly_when_the_run_ends(torchrun_sides) -> None:
    from gyre_megatron.side import shutdown_worlds

    _, _, procs, _ = torchrun_sides
    shutdown_worlds()
    assert stop_nodes(procs, grace=30.0) == [0, 0]


ORCHESTRATOR_STUB = """
import sys, time
from gyre_megatron.launch import ClusterWorld
from gyre_megatron.runtime import RankOptions
w = ClusterWorld(RankOptions(cells=2, pp=1), 2, "127.0.0.1", int(sys.argv[1]), sys.argv[2], join_timeout_s=120)
print("joined", flush=True)
time.sleep(600)
"""


def test_ranks_exit_when_the_orchestrator_is_killed(tmp_path) -> None:
    """A killed orchestrator (SIGKILL: no goodbye) leaves no rank behind on any node."""
    import signal
    import subprocess
    import sys

    from gyre_megatron.control import write_key

    key_file = tmp_path / "control.key"
    write_key(key_file)
    port = free_port()
    orch = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR_STUB, str(port), str(key_file)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    procs = start_torchrun_nodes(2, 1, f"127.0.0.1:{port}", key_file, tmp_path)
    try:
        assert orch.stdout is not None and orch.stdout.readline().strip() == "joined"
        orch.send_signal(signal.SIGKILL)
        orch.wait()
        t0 = time.monotonic()
        for p in procs:
            p.wait(timeout=60)
        assert time.monotonic() - t0 < 30
        assert all(p.returncode != 0 for p in procs)  # torchrun reports the lost run as a failure
    finally:
        stop_nodes(procs, grace=0.1)
        if orch.poll() is None:
            orch.kill()
            orch.wait()


def test_a_launcher_that_started_the_wrong_world_fails_the_join_at_once(tmp_path) -> None:
    """Three ranks for a two-rank run: the orchestrator says so, instead of waiting out its timeout."""
    from gyre_megatron.control import write_key
    from gyre_megatron.launch import ClusterWorld, RankError
    from gyre_megatron.runtime import RankOptions

    key_file = tmp_path / "control.key"
    write_key(key_file)
    port = free_port()
    procs = start_torchrun_nodes(1, 3, f"127.0.0.1:{port}", key_file, tmp_path)
    t0 = time.monotonic()
    try:
        with pytest.raises(RankError, match="world of 2 rank"):
            ClusterWorld(RankOptions(cells=2, pp=1), 2, "127.0.0.1", port, str(key_file), join_timeout_s=240)
        assert time.monotonic() - t0 < 120
    finally:
        stop_nodes(procs, grace=10.0)
