"""``harness.kind = "replay"`` end to end: a recorded workload replayed on real parts, and the
elastic mechanism it exists to show.

The trace (the simulator's format) holds 32 queries of 4 executions of about 25 recorded minutes
each, some recorded as complete failures; at time scale 0.004 each replays in ~6 s, making two
model calls through the TITO proxy (the policy's own replies fed back) with tool time between
them, and a tool result that grows its context to the recorded tokens at token scale 0.2 (~300). 16 executions run at once on a core and one satellite and end in one cluster: the core
starts the step on the first finished groups while the satellite serves the rest, and once nothing
is left to serve (w = 0, rule 5 with K = 2 and no pool) the satellite joins the running step.
Checked: the join (mid-step, and it trained; over the disk transport, as every publication of
this run), the replayed outcomes scored by the digits task's
evaluator (a recorded failure is a reward of 0, never a missing one), and every execution
accounted for.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gyre_core.testing import assert_accounted, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(600)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

STEPS, N, B = 2, 4, 4
TOKEN_SCALE = 0.2  # the trace has no tokens: 1 per recorded second, so ~300 of context per replay
CONFIG = """
[model]
hidden_size = 384   # a step of ~2.5 s: long enough for the satellite to arrive while it runs
num_layers = 4
[scheduler]
mode = "gyre"
cells = 2
cell_capacity = 8
group_size = {n}
groups_per_step = {b}
steps_per_burst = 1
extra_dispatch = 0.0
rho_min = 0.25
supply_window_s = 0.0
[run]
steps = {steps}
[task]
name = "digits"
[harness]
kind = "replay"
trace = "{trace}"
time_scale = 0.004
timeout_s = 90.0        # a replay takes ~6 s here; margin for a machine twice as slow under load
overall_budget_s = 150.0
replay_calls = 2
token_scale = {token_scale}
[dataplane]
token_budget = 512
[sampling]
max_new_tokens = 32
[publication]
transport = "disk"      # the files path, live: publications and the satellite's pulls alike
"""


def _clustered_trace(path: Path) -> dict[str, list[str]]:
    rng = random.Random(0)
    outcomes: dict[str, list[str]] = {}
    with path.open("w") as f:
        for q in range(32):
            for i in range(N):
                outcome = "failed" if (q + i) % 7 == 0 else "completed"
                outcomes.setdefault(f"q{q}", []).append(outcome)
                f.write(json.dumps({"query": f"q{q}", "duration_s": round(1500 + rng.uniform(-60, 60), 1),
                                    "outcome": outcome}) + "\n")
    return outcomes


def test_a_replayed_workload_trains_and_a_satellite_joins_a_running_step(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _clustered_trace(trace)
    cfg = tmp_path / "replay.toml"
    cfg.write_text(CONFIG.format(n=N, b=B, steps=STEPS, trace=trace, token_scale=TOKEN_SCALE))
    out = tmp_path / "run"
    summary, _ = run_job(out, "--config", str(cfg), timeout=540)
    assert summary["steps"] == STEPS and summary["policy_version"] == STEPS

    # the mechanism: a satellite sent into a step the core was already training, and it trained
    joins = summary["running_step_joins"]
    assert joins, [(r["step"], r["cells"], r["duration_s"]) for r in summary["step_records"]]
    for j in joins:
        rec = next(r for r in summary["step_records"] if r["step"] == j["step"])
        assert j["cell"] == 1 and rec["started_s"] < j["at_s"] < rec["ended_s"] and j["trained"]
        assert 1 in rec["cells"] and rec["tokens"] > 0 and rec["grad_norm"] > 0

    # publication.transport = "disk": each version reached the engines as files, and the satellite
    # pulled the core's parameters from a file as well (one seam, gyre_core.weight_parts), which
    # the core removed once the step's window closed
    assert [p["transport"] for p in summary["publications"]] == ["disk"] * STEPS
    assert sorted(d.name for d in (out / "weights").iterdir()) == ["satellite", *[f"v{v}" for v in range(STEPS + 1)]]
    satellite = (out / "weights" / "satellite").resolve()
    pulls = [k for r in summary["step_records"] for k in r["joins"] if k.get("pull_bytes")]
    assert pulls and all(k["pull_from"].startswith(f"{satellite}/") for k in pulls), pulls
    assert not list(satellite.rglob("*.safetensors*"))

    # every execution accounted for, each one not trained with its cause; each step took B groups
    # of N, and each of their executions was trained unless its assessment was excluded (on a slow
    # machine a replay can outrun its budget: that is an exclusion with its cause, never a loss)
    ex = summary["executions"]
    assert_accounted(ex)
    journal = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    excluded = {r["execution_id"]: r["why"] for r in journal if r.get("kind") == "excluded"}
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    members = {e["group_id"]: e["execution_ids"] for e in events if e.get("command") == "DispatchGroup"}
    for rec in summary["step_records"]:
        assert len(rec["groups"]) == B and rec["mean_reward"] is not None
        took = [eid for g in rec["groups"] for eid in members[g]]
        assert len(took) == B * N and rec["executions"] == sum(1 for e in took if e not in excluded), (rec, excluded)
        # the trainer read the replayed contexts (~300 tokens each), not only the sampled replies
        assert rec["row_tokens"] >= 0.8 * 0.9 * TOKEN_SCALE * 1440 * rec["executions"] > rec["tokens"], rec
    assert ex["trained"] == sum(r["executions"] for r in summary["step_records"]) >= STEPS * B * N // 2, ex
    assert all(why for why in excluded.values()), excluded

    # replayed as recorded: each execution replays the record the run's replay plan gives it; a
    # recorded failure leaves nothing to assess but an empty reply, which the digits evaluator
    # scores 0 -- a reward, never a missing one; completed replays are scored from their replies
    from gyre_core.orchestrator.replay_plan import ReplayPlan

    plan = ReplayPlan.from_config(str(trace), 0.004, 0, TOKEN_SCALE)
    records = {eid: plan.record(e["group_id"], i, len(e["execution_ids"]))
               for e in events if e.get("command") == "DispatchGroup" for i, eid in enumerate(e["execution_ids"])}
    recorded = {eid: r.outcome for eid, r in records.items()}
    rewards = {r["execution_id"]: r["reward"] for r in journal if r.get("kind") == "scored"}
    failed = [e for e in rewards if recorded[e] == "failed"]
    assert failed and all(rewards[e] == 0.0 for e in failed), {e: rewards[e] for e in failed}
    assert any(rewards[e] > 0 for e in rewards if recorded[e] == "completed")
    assert all((out / "executions" / f"e{e:05d}" / "reply.txt").read_text() == "" for e in failed)

    # the recorded tokens reach what trains: each replay's trajectory (the rows its step trained)
    # holds about the scaled context, within the one-row token budget
    sizes = {r["execution_id"]: sum(len(n["tokens"]) for n in r["tree"]["nodes"])
             for r in journal if r.get("kind") == "trajectory"}
    assert sizes
    for eid, n in sizes.items():
        assert 0.8 * records[eid].context_tokens <= n <= 512, (eid, n, records[eid].context_tokens)
