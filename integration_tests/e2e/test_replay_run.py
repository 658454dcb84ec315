"""A short ``replay`` job end to end, then the simulator held to it.

``examples/configs/replay-cpu.toml``: a core, one satellite and a standalone pool (real Megatron
ranks, three SGLang CPU servers, the TITO proxy, Mooncake), each execution replaying one recorded
execution of a long-tailed trace at 0.002× its recorded time through the proxy. Checked: a
satellite joined a running step and pulled the core's weights, the steps it joined trained whole
batches, every execution is accounted for, and ``simulate --calibrate-from`` reads the run back
(its measured costs and its own groups) into a prediction of the same run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.mooncake,
              pytest.mark.timeout(1200)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "replay-cpu.toml"


def test_a_replay_job_has_a_satellite_join_a_running_step_and_the_simulator_reads_it_back(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "gyre_core.cli", "run", "--config", str(CONFIG), "--out", str(out),
                           "--json-summary"], capture_output=True, text=True, timeout=1140, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["status"] == "ok" and s["steps"] == 3

    ex = s["executions"]
    accounted = (ex["trained"] + ex["dropped"] + ex["filtered"] + ex["surplus"] + ex["excluded"] + ex["waiting"]
                 + ex["cancelled"])
    assert accounted == ex["finished"] and ex["launched"] - ex["finished"] == ex["stopped"] + ex["running"]
    recs = s["step_records"]
    assert [len(r["groups"]) for r in recs] == [6, 6, 6]  # B groups a step, each counted once
    assert sum(r["executions"] for r in recs) == ex["trained"]

    joined = [r for r in recs if r["joins"]]
    assert joined, f"no satellite joined a running step: cells per step {[r['cells'] for r in recs]}"
    for r in joined:
        assert 1 in r["cells"] and r["tokens"] > 0 and r["micro_steps"] >= 2
        assert all(j["cell"] == 1 for j in r["joins"])
    assert any(j["pull_bytes"] > 0 for r in joined for j in r["joins"])  # it pulled the core's weights

    sim = subprocess.run([sys.executable, "-m", "gyre_core.cli", "simulate", "--calibrate-from", str(out), "--json",
                          "--quiet"], capture_output=True, text=True, timeout=300, env=env)
    assert sim.returncode == 0, sim.stderr[-3000:]
    pred = json.loads(sim.stdout)
    cal = pred["calibration"]
    assert cal["source"] == "replay trace" and cal["measured"]["steps_fitted"] == 3
    assert cal["measured"]["switches"]["to_training"] >= 2  # the core's, and the satellite's join
    assert pred["modes"]["gyre"]["steps"] == 3 and math.isfinite(cal["gap"])
    assert cal["live"]["run_s"] == max(r["ended_s"] for r in recs)
