"""``cluster.launcher = "ray"``: the job on a two-node Ray cluster, and a rank actor killed mid-step.

A Ray head and a second raylet start on this machine as two "nodes", each offering one unit of a
custom resource (``gyre_slot``) that every rank's bundle asks for, so each cell's placement group
can only land on its own node. The job runs Colocate with two cells (the satellite, cell 1, trains
in every step) for three steps. In step 1, once cell 1 has joined, its rank actor is killed
(``ray.kill``): the step finishes on the core, what the dead rank had claimed is streamed again,
the ranks start anew in new placement groups with the core's state, and cell 1 joins step 2,
pulling the core's weights.

Checked: each rank ran on the node its cell's placement group reserved, the two cells on
different nodes, each engine on its cell's node; a satellite joined; the killed actor was
reported by cell and rank and handled; every finished execution is accounted for; and after the
run and the cluster's shutdown no Ray or SGLang process of the test is left.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gyre_core.testing import assert_accounted

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")
pytest.importorskip("ray")

N, B, STEPS, KILL_AT = 4, 2, 3, 1


def _processes_holding(needle: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            found.append(int(d.name))
    return found


@pytest.fixture()
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"gyre_slot": 1}, "object_store_memory": 100 * 2**20})
    cluster.add_node(num_cpus=2, resources={"gyre_slot": 1}, object_store_memory=100 * 2**20)
    session = cluster.head_node.get_session_dir_path()
    try:
        yield cluster
    finally:
        cluster.shutdown()
    deadline = time.monotonic() + 30
    while _processes_holding(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_holding(session) == [], "Ray processes outlived the cluster's shutdown"


def test_ray_placed_cells_run_the_job_and_survive_a_killed_rank(tmp_path: Path, two_nodes) -> None:
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config
    from gyre_megatron.testing import kill_once_joined

    out = tmp_path / "run"
    cfg = load_run_config(SMALL_JOB, {
        "run.out_dir": str(out), "run.steps": STEPS, "run.max_wall_s": 720.0,
        "scheduler.mode": "colocate", "scheduler.extra_dispatch": 0.0, "scheduler.steps_per_burst": 1,
        "scheduler.group_size": N, "scheduler.groups_per_step": B,
        "dataplane.token_budget": 512, "training.collective_timeout_s": 5.0,
        "cluster.launcher": '"ray"', "cluster.ray_address": f'"{two_nodes.address}"',
        "cluster.ray_resources_per_rank": "{gyre_slot = 1}", "cluster.join_timeout_s": 180.0})
    placed: dict[str, Any] = {}

    def kill(world: Any) -> dict[str, Any]:  # where everything ran, then the satellite's rank actor
        placed.update(info=list(world.info), bundles=[world.bundle_nodes(c) for c in range(2)],
                      engines={c: e.node for c, e in world.engines.items()})
        world.kill_rank(1)
        return {}

    on_started, parts, killed = kill_once_joined(KILL_AT, 1, kill)

    summary = run_live(cfg, on_started=on_started)
    print(f"\nkilled {killed}; satellite failures {summary['satellite_failures']}; "
          f"steps {[(r['step'], r['cells'], r['micro_steps'], r['duration_s']) for r in summary['step_records']]}")

    assert killed and "error" not in killed, f"the satellite never joined step {KILL_AT} ({killed})"
    # placement: each rank where its cell's group was reserved, the cells on different nodes,
    # each engine on its cell's node
    info, bundles = placed["info"], placed["bundles"]
    assert [i["node"] for i in info] == [bundles[0][0], bundles[1][0]]
    assert bundles[0][0] != bundles[1][0]
    assert placed["engines"] == {0: bundles[0][0], 1: bundles[1][0]}

    # the killed actor: reported by cell and rank, the step finished on the core
    (failure,) = summary["satellite_failures"]
    assert failure["step"] == KILL_AT and failure["cells"] == [1] and failure["survivors"] == [0], failure
    assert "rank 1 (cell 1) actor died" in failure["error"] or failure["restarted"], failure
    assert failure["redone_micro_steps"] == len([i for i in killed["claimed"].split(",") if i])
    by_step = {r["step"]: r for r in summary["step_records"]}
    assert by_step[KILL_AT]["cells"] == [0]
    # a satellite joined (before and after the kill), pulling the core's weights
    assert by_step[0]["cells"] == [0, 1] and by_step[KILL_AT + 1]["cells"] == [0, 1]
    (join,) = by_step[KILL_AT + 1]["joins"]
    assert join["cell"] == 1 and join["pull_bytes"] > 0

    # nothing lost
    assert summary["steps"] == STEPS
    ex = summary["executions"]
    assert_accounted(ex)
    assert ex["trained"] == STEPS * B * N, ex
    world = parts["orchestrator"].cells[0].training.world
    assert world.restarts == 1
    time.sleep(1.0)
    assert _processes_holding(str(out / "weights")) == [], "an SGLang server outlived the run"
