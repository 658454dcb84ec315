"""A run with a standalone rollout pool (``scheduler.standalone_capacity`` = C_s > 0).

The pool is an SGLang engine of its own: executions are launched on it and routed to it like a
cell's, it never switches role, and it loads every published version. Its engine is SIGKILLed
while calls are in flight on it: the watchdog moves its executions to the cells in rollout,
restarts it on the current policy, and no finished execution is lost. Counts: the run trains
its steps, some executions ran on the pool, every finished execution is accounted for, and no
role switch names the pool.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from gyre_core.testing import assert_accounted

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

STEPS = 8  # long enough to see the restarted pool come back (a restart took 96 s in a 6-step run here)


def test_a_standalone_pool_serves_rollouts_never_switches_and_comes_back_when_killed(tmp_path: Path) -> None:
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config

    out = tmp_path / "run"
    cfg = load_run_config(SMALL_JOB, {"run.out_dir": str(out), "run.steps": STEPS, "scheduler.standalone_capacity": 2})
    parts: dict[str, Any] = {}
    killed: dict[str, Any] = {}

    async def kill_pool_mid_request() -> None:
        proxy, engine = parts["proxy"], parts["standalone_engine"]
        url = engine.url
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            await asyncio.sleep(0.02)
            if time.monotonic() - t0 >= 2.0 and proxy._inflight.get(url):
                engine.kill()  # SIGKILL, on the loop thread
                killed.update(url=url, at=parts["orchestrator"].now())
                return

    def on_started(p: dict[str, Any]) -> None:
        parts.update(p)
        parts["killer"] = p["loop"].create_task(kill_pool_mid_request())

    summary = run_live(cfg, on_started=on_started)
    print(f"\nkilled {killed}; restarts {summary['engine_restarts']}; executions {summary['executions']}")
    assert summary["steps"] == STEPS and summary["policy_version"] == STEPS
    ex = summary["executions"]
    assert ex["launched_on"].get("standalone", 0) > 0, ex
    assert sum(ex["launched_on"].values()) == ex["launched"]
    assert_accounted(ex)
    assert ex["trained"] == STEPS * 2 * 4, ex
    assert {s["cell"] for s in summary["role_switches"]} <= {0, 1}
    assert (out / "engine-standalone.log").exists()
    assert [p["version"] for p in summary["publications"]] == list(range(1, STEPS + 1))

    # the pool's engine was killed with calls in flight and came back, on a new URL
    assert killed, "the pool never had a call in flight"
    (r,) = summary["engine_restarts"]
    assert r["cell"] == -1 and r["old_url"] == killed["url"] and r["new_url"] not in (None, killed["url"])
    assert r["back_at"] is not None and r["detected_at"] - killed["at"] < 3.0
    orch = parts["orchestrator"]
    assert orch.cells.standalone.engine_url == r["new_url"]
    assert parts["proxy"].router.slot(r["new_url"]).kind == "standalone"
    assert (out / "engine-standalone.restart1.log").exists()
