"""A satellite's rank dies mid-step, and the run goes on (issue 14 §4).

Colocate with two cells, so the satellite (cell 1) trains in every step. In step 1 its rank is
SIGKILLed once it has joined the step (registered in the ranks' c10d store, as the core reads it).
The step must finish on the core, with the micro-steps the dead rank had claimed streamed again;
every training process is then started anew with the core's state, and cell 1 joins step 2,
pulling the core's weights. Every finished execution is accounted for and each step trains N·B.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from gyre_core.testing import assert_accounted

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

N, B, STEPS, KILL_AT = 4, 2, 3, 1


def test_a_satellite_killed_mid_step_leaves_the_run_going(tmp_path: Path) -> None:
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config
    from gyre_megatron.testing import rank_store, strike_once_joined

    cfg = load_run_config(SMALL_JOB, {
        "run.out_dir": str(tmp_path / "run"), "run.steps": STEPS, "run.max_wall_s": 720.0,
        "scheduler.mode": "colocate", "scheduler.extra_dispatch": 0.0, "scheduler.steps_per_burst": 1,
        "scheduler.group_size": N, "scheduler.groups_per_step": B,
        "dataplane.token_budget": 512, "training.collective_timeout_s": 5.0})
    parts: dict[str, Any] = {}
    killed: dict[str, Any] = {}

    async def kill_satellite_once_joined() -> None:
        orch = parts["orchestrator"]
        world = orch.cells[1].training.world
        pid = world.procs[1].pid
        claimed = await strike_once_joined(rank_store(world.port), KILL_AT, 1, lambda: os.kill(pid, signal.SIGKILL))
        killed.update(pid=pid, at=orch.now(), claimed=claimed)

    async def killer() -> None:
        try:
            await kill_satellite_once_joined()
        except Exception as e:  # seen in the assertion below, not lost in a task
            killed["error"] = f"{type(e).__name__}: {e}"

    def on_started(p: dict[str, Any]) -> None:
        parts.update(p)
        parts["killer"] = p["loop"].create_task(killer())

    summary = run_live(cfg, on_started=on_started)
    print(f"\nkilled {killed}; satellite failures {summary['satellite_failures']}; "
          f"steps {[(r['step'], r['cells'], r['micro_steps'], r['duration_s']) for r in summary['step_records']]}")
    assert killed and "error" not in killed, f"the satellite never joined step 1 ({killed})"

    # the run trained all its steps, each on its N·B executions, nothing lost
    assert summary["steps"] == STEPS and len(summary["step_records"]) == STEPS
    ex = summary["executions"]
    assert_accounted(ex)
    assert ex["trained"] == STEPS * B * N, ex
    for rec in summary["step_records"]:
        assert rec["executions"] == B * N and rec["grad_norm"] is not None, rec

    # step 1 lost cell 1 and finished on the core, re-streaming what cell 1 had claimed
    (failure,) = summary["satellite_failures"]
    redone = [int(i) for i in killed["claimed"].split(",") if i]
    assert failure["step"] == KILL_AT and failure["cells"] == [1] and failure["survivors"] == [0], failure
    assert failure["redone_micro_steps"] == len(redone) and failure["restarted"] and failure["restart_s"] > 0
    by_step = {r["step"]: r for r in summary["step_records"]}
    assert by_step[KILL_AT]["cells"] == [0]
    assert by_step[KILL_AT]["tokens"] > 0 and by_step[KILL_AT]["loss"] is not None  # the survivors' figures

    # the restarted cell 1 joined the next step, pulling the core's weights
    assert by_step[KILL_AT + 1]["cells"] == [0, 1]
    (join,) = by_step[KILL_AT + 1]["joins"]
    assert join["cell"] == 1 and join["pull_bytes"] > 0
    world = parts["orchestrator"].cells[0].training.world
    assert world.restarts == 1 and killed["pid"] not in [p.pid for p in world.procs]
    assert not any(p.is_alive() for p in world.procs)  # the run's end stopped every rank it started
