"""``gyre-orchestrate run`` with ranks started by torchrun: the multi-node start, on loopback, in
Colocate mode.

The orchestrator (``cluster.launcher = "torchrun"``) spawns no training rank: it serves its
control plane and waits; two torchrun agents (``--nnodes 2``, one rank each, as two nodes would
run them) start ``gyre_megatron.worker``, whose ranks join, and the first rank of each cell starts
that cell's SGLang server on its own "node". The ranks start from the user's checkpoint
(``model.dir``, a tiny Qwen3: per-head q/k norms, a head size of its own) and the run keeps a
Qwen3 checkpoint. Counts:
the run trains its steps, every finished execution is accounted for (zero lost), both torchrun
agents exit 0 when the run ends, and no SGLang server is left behind.

The job runs the Colocate baseline, and shows on the wire what that mode must (docs/design.md,
"The three modes"): the whole pool trains; a burst starts only once every admitted execution has
finished (nothing runs while cells train), every cell switches to training and back, and the core
publishes after the pool left training (its state offloaded); staleness within 0..μ−1. The
satellite trains every step, so it pulls the core's parameters every step: from the address the
core's node advertised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from typing import Any

from gyre_core.testing import assert_accounted

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
N, B, STEPS, PHI, MU = 4, 2, 2, 0.0, 1  # solve_burst("colocate", 0.0): two bursts, a publication between
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

from gyre_megatron.control import write_key  # noqa: E402
from gyre_megatron.testing import free_port, start_torchrun_nodes, stop_nodes  # noqa: E402


def _children_named(pids: list[int], needle: str) -> list[int]:
    """Processes whose command line holds ``needle`` and that descend from ``pids``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            sid = os.getsid(int(d.name))
        except (OSError, ProcessLookupError):
            continue
        if needle in cmd and sid in pids:
            found.append(int(d.name))
    return found


def test_torchrun_started_ranks_run_the_job(tmp_path: Path) -> None:
    out = tmp_path / "run"
    key = tmp_path / "control.key"
    write_key(key)
    port = free_port()
    from gyre_core.tiny_model import cached_tiny_model

    # Qwen3 with YaRN (as its long-context releases are run): SGLang serves it, the ranks train it
    model = cached_tiny_model(family="qwen3", hidden_size=64, num_layers=2, max_position_embeddings=2048,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    orch = subprocess.Popen(
        [sys.executable, "-m", "gyre_core.cli", "run", "--config", str(SMALL_JOB), "--out", str(out), "--json-summary",
         "--steps", str(STEPS), "--set", 'cluster.launcher="torchrun"', "--set", f"cluster.control_port={port}",
         "--set", f'cluster.key_file="{key}"', "--set", "cluster.join_timeout_s=240", "--set", f"model.dir={model}",
         "--set", "scheduler.mode=colocate", "--set", f"scheduler.extra_dispatch={PHI}",
         "--set", f"scheduler.steps_per_burst={MU}", "--set", f"scheduler.group_size={N}",
         "--set", f"scheduler.groups_per_step={B}", "--set", "run.max_wall_s=420.0"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "orchestrator.log", "wb"), text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )
    # two "hosts" on loopback, node 0 and node 1: each Mooncake peer must read from the address
    # its owner advertised, none from an assumed one (the orchestrator publishes nothing itself)
    nodes = start_torchrun_nodes(2, 1, f"127.0.0.1:{port}", key, tmp_path,
                                 node_env=[{"GYRE_MOONCAKE_HOST": "127.0.0.2"}, {"GYRE_MOONCAKE_HOST": "127.0.0.4"}])
    try:
        stdout, _ = orch.communicate(timeout=840)
        log = (tmp_path / "orchestrator.log").read_text()
        assert orch.returncode == 0, log[-4000:] + (tmp_path / "node1.log").read_text()[-3000:]
        codes = stop_nodes(nodes, grace=60.0)
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, 9)
            orch.wait()
        stop_nodes(nodes, grace=0.1)

    assert "waiting for 2 rank(s) to join" in log and "gyre_megatron.worker" in log
    summary = json.loads(stdout.strip().splitlines()[-1])
    kept = json.loads((out / "checkpoint" / "config.json").read_text())
    assert kept["rope_scaling"]["rope_type"] == "yarn" and kept["rope_scaling"]["factor"] == 4.0
    assert summary["steps"] == STEPS and summary["policy_version"] == STEPS
    ex = summary["executions"]
    assert_accounted(ex)
    assert ex["trained"] == STEPS * B * N, ex
    for rec in summary["step_records"]:
        assert len(rec["groups"]) == B and rec["executions"] == B * N, rec
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    _assert_colocate(summary, events)
    # published over Mooncake by the core's rank on node 0 (127.0.0.2), pulled by both nodes'
    # engines: no weight files, and no bytes through the orchestrator
    assert [p["transport"] for p in summary["publications"]] == ["mooncake", "mooncake"]
    assert sorted(d.name for d in (out / "weights").iterdir()) == ["v0"]
    journal = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    from gyre_core.published_weights import parse_parts

    sessions = {part.session.rsplit(":", 1)[0] for r in journal if r.get("kind") == "published"
                for part in parse_parts(r["location"])}
    assert sessions == {"127.0.0.2"}
    # the satellite read the core's parameters where node 0 advertised them, every step it trained
    # with weights older than the step's
    joins = [j for rec in summary["step_records"] for j in rec["joins"]]
    assert any(j["pull_bytes"] for j in joins), joins
    assert all(j["cell"] == 1 and j["pull_from"].rsplit(":", 1)[0] == "127.0.0.2" for j in joins if j["pull_bytes"])
    # the engines were started by the ranks (their logs are where the orchestrator asked)
    assert (out / "engine0.log").exists() and (out / "engine1.log").exists()
    assert codes == [0, 0]
    kept = json.loads((out / "checkpoint" / "config.json").read_text())
    assert (kept["model_type"], kept["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    time.sleep(1.0)
    assert _children_named([n.pid for n in nodes], "sglang.launch_server") == []


def _assert_colocate(summary: dict[str, Any], events: list[dict[str, Any]]) -> None:
    assert summary["mode"] == "colocate"
    # every cell trains in every step, and switches both ways
    assert all(rec["cells"] == [0, 1] for rec in summary["step_records"])
    switches = summary["role_switches"]
    for cell in (0, 1):
        mine = [s["transition"] for s in switches if s["cell"] == cell]
        assert mine.count("to_training") == STEPS // MU, (cell, mine)
        assert mine.count("to_rollout") >= STEPS // MU - 1, (cell, mine)
        assert mine[0] == "to_training"
    # a burst starts only once every admitted execution finished (w = 0): nothing runs in training
    first = next(i for i, e in enumerate(events) if e.get("command") == "CellToTraining")
    launched = sum(1 for e in events[:first] if e.get("command") == "Launch")
    ended = sum(1 for e in events[:first] if e.get("event") == "ExecutionEnded")
    assert launched == ended == (PHI + MU) * B * N
    away: set[int] = set()  # cells not (yet back) in rollout
    for e in events:
        if e.get("command") == "CellToTraining":
            away.add(e["cell"])
        elif e.get("event") == "TransitionDone" and e.get("role") == "rollout":
            away.discard(e["cell"])
        elif e.get("command") == "Launch":
            assert not away, e
    # the core published from its offloaded state after the pool left training, after every burst
    # (the last one too: the run ends on the policy its last step trained)
    pubs = [e for e in events if e.get("event") == "PublicationDone"]
    assert [e["version"] for e in pubs] == list(range(MU, STEPS + 1, MU))
    assert summary["policy_version"] == pubs[-1]["version"] == STEPS
    for rec in summary["step_records"]:
        assert all(0 <= d <= MU - 1 for d in rec["staleness"]), rec
    assert summary["mean_staleness"] == 0.0
