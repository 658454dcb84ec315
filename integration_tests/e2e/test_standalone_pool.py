"""A run with a standalone rollout pool (``scheduler.standalone_capacity`` = C_s > 0).

The pool is an SGLang engine of its own: executions are launched on it and routed to it like a
cell's, it never switches role, and it loads every published version. Counts: the run trains its
steps, some executions ran on the pool, every finished execution is accounted for, the pool's
engine served the last published version, and no role switch names it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")


def test_a_standalone_pool_serves_rollouts_and_never_switches(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--json-summary", "--steps", "2",
         "--set", "scheduler.standalone_capacity=2"],
        capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    ex = summary["executions"]
    assert ex["launched_on"].get("standalone", 0) > 0, ex
    assert sum(ex["launched_on"].values()) == ex["launched"]
    accounted = ex["trained"] + ex["dropped"] + ex["filtered"] + ex["surplus"] + ex["excluded"] + ex["waiting"] + ex["cancelled"]
    assert accounted == ex["finished"] and ex["trained"] == 2 * 2 * 4
    assert {s["cell"] for s in summary["role_switches"]} <= {0, 1}
    assert (out / "engine-standalone.log").exists()
    assert [p["version"] for p in summary["publications"]] == [1, 2]  # each loaded by the pool too
