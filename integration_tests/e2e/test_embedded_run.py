"""``gyre-orchestrate run`` end to end: the embedded default job on this machine.

Real parts throughout: Megatron ranks (gloo), two SGLang CPU servers with Gyre's plugin, the TITO
proxy, one harness process per execution (official OpenAI SDK), the built-in number-guess task.
Counts what every run must account for: each dispatched execution launched once, each launched
one finished once, each finished one trained, dropped, surplus or excluded -- zero lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_core.testing import assert_accounted, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")


def test_embedded_default_runs_three_steps_and_accounts_for_every_execution(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # sampled at temperature 0.7: engines report log-probs of softmax(logits / 0.7), and the trainer
    # must take its own at the same temperature for the on-policy ratio below to be 1
    summary, console = run_job(out, "--set", "sampling.temperature=0.7", timeout=840)
    # a healthy run's console holds Gyre's lines only: upstream's every-run notices went to the logs
    for noise in ("Local segment descriptor not found", "InitGoogleLogging", "Transformer Engine and Apex",
                  "Writing model shards", "transfer_engine_impl.cpp"):
        assert noise not in console, noise
    # (Mooncake's notice, when a transfer prints it, comes from the engines and ranks: the
    # orchestrator runs no transfer engine of its own, so it lands in their logs, if anywhere)
    assert "Transformer Engine and Apex" in (out / "upstream.log").read_text()
    assert (out / "rank0.log").exists() and (out / "rank1.log").exists()
    # the plan: where each cell's ranks and engine run, printed once the engines are up
    assert "cell 0 (core): node " in console and "devices cpu · ranks [0] (tp 1 × pp 1) · engine http://127.0.0.1:" in console
    assert "cell 1 (satellite): node " in console

    assert summary["steps"] == 3
    assert len(summary["rewards"]) == 3 and all(r is None or 0.0 <= r <= 1.0 for r in summary["rewards"])
    assert summary["mean_staleness"] is not None and 0.0 <= summary["mean_staleness"] <= 2.0
    ex = summary["executions"]
    # every finished execution is accounted for; none is lost
    assert_accounted(ex)
    assert ex["trained"] == 3 * 4 * 4  # 3 steps × B=4 groups × N=4

    switches = summary["role_switches"]
    assert any(s["transition"] == "to_training" for s in switches)
    assert any(s["transition"] == "to_rollout" for s in switches)
    for s in switches:
        assert s["total_s"] >= 0 and s["phases"]
    assert {"stop_intake", "abort", "flush", "release_memory"} <= set(
        next(s for s in switches if s["transition"] == "to_training")["phases"])

    assert (out / "checkpoint" / "model.safetensors").stat().st_size > 0
    # every version after the start one went over Mooncake: engines pulled it, no weight file written
    assert [p["version"] for p in summary["publications"]] == [1, 2, 3]
    assert {p["transport"] for p in summary["publications"]} == {"mooncake"}
    assert sorted(d.name for d in (out / "weights").iterdir()) == ["v0"]
    _assert_final_checkpoint_is_the_last_publication(out)
    # calls a role change caught in flight continued on their new engine (with their KV unless
    # a reason says otherwise); how many are caught depends on timing, often none at 24 tokens
    ic = summary["interrupted_calls"]
    assert ic["handed_off"] + ic["reprefilled"] <= ic["interrupted"]
    assert sum(ic["reasons"].values()) == ic["reprefilled"]
    assert not [r for r in ic["reasons"] if "import on the destination failed" in r], ic["reasons"]
    _assert_tensorboard_holds_every_step(out / "metrics" / "tensorboard", summary)
    _assert_a_satellite_joined_a_running_step(summary, console, out / "role_timeline.svg")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert sum(1 for e in events if e.get("event") == "MicroStepsDone") == 3
    assert summary["policy_version"] == 3
    # harnesses went through the proxy: every trained execution has a workspace with its answer
    answers = list((out / "executions").glob("e*/answer.json"))
    assert len(answers) >= ex["trained"]
    # the step trained the GSPO objective, and said so: per-step figures in the summary and the event log
    assert summary["status"] == "ok"
    for rec in summary["step_records"]:
        assert rec["tokens"] > 0 and rec["grad_norm"] > 0 and rec["loss"] is not None
        # on-policy (the default's φ = 0, μ = 1: staleness 0), the trainer's log-probs are the
        # engine's up to float noise: the ratio is 1 (measured at temperature 1: mean 1.0000, max
        # 1.0009) and nothing is clipped; a wrong temperature, a lost token or stale weights would
        # show here
        assert rec["staleness"] == [0] * len(rec["staleness"]), rec["staleness"]
        assert abs(rec["ratio_mean"] - 1.0) <= 1e-3 and rec["ratio_max"] <= 1.01, rec
        assert rec["clip_fraction"] == 0.0, rec
        # on-policy on CPU in float32: sampler and trainer agree on the sampled tokens' log-probs
        assert rec["logp_diff_max"] <= 0.05 and 0 <= rec["kl_k3"] <= 1e-3, rec
        assert rec["split_executions"] == 0  # every execution's rows fit one pack: exact ratios
    assert summary["grad_norms"] == [r["grad_norm"] for r in summary["step_records"]]
    assert [e["step_done"] for e in events if "step_done" in e] == [0, 1, 2]


def _assert_a_satellite_joined_a_running_step(summary: dict, console: str, timeline: Path) -> None:
    """The mechanism the default is sized to show: the core trains on the first finished groups
    while the satellite serves the rest; once nothing is left to serve, the satellite is sent into
    the step the core is running and trains part of it (measured: in 2 or 3 of the 3 steps)."""
    import xml.etree.ElementTree as ET

    joins = summary["running_step_joins"]
    assert joins, f"no satellite joined a running step; steps {[(r['step'], r['cells']) for r in summary['step_records']]}"
    for j in joins:
        rec = next(r for r in summary["step_records"] if r["step"] == j["step"])
        assert j["cell"] == 1 and j["after_s"] > 0 and rec["started_s"] < j["at_s"] < rec["ended_s"]
        assert j["trained"] and 1 in rec["cells"]  # it took micro-steps of that step, not only a switch
        assert any(k["cell"] == 1 for k in rec["joins"])  # and it pulled the core's weights first
        assert f"cell 1 joins running step {j['step']} (" in console
    svg = ET.parse(timeline).getroot()
    marks = [e for e in svg.iter("{http://www.w3.org/2000/svg}path") if e.get("data-join-step")]
    assert sorted(int(m.get("data-join-step")) for m in marks) == sorted(j["step"] for j in joins)
    assert "time (s)" in [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]  # a short run: seconds


def _assert_tensorboard_holds_every_step(tb_dir: Path, summary: dict) -> None:
    """The default metrics observer wrote each step's training figures, as the summary has them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    trained = [r for r in summary["step_records"] if r["loss"] is not None]
    assert [e.step for e in loss] == [r["step"] for r in trained]
    assert all(abs(e.value - r["loss"]) <= 1e-6 * max(1.0, abs(r["loss"])) for e, r in zip(loss, trained))
    assert [e.value for e in acc.Scalars("train/tokens")] == [r["tokens"] for r in summary["step_records"]]
    assert {"train/grad_norm", "rollout/staleness_mean", "executions/trained", "switch/to_training_s",
            "engines/output_tokens_per_s", "proxy/call_latency_p95_s", "proxy/overhead_mean_s"} <= set(
        acc.Tags()["scalars"])
    # the harnesses' calls between steps: tokens came out of the engines, each call took time
    assert all(e.value > 0 for e in acc.Scalars("engines/output_tokens_per_s"))
    assert all(e.value > 0 for e in acc.Scalars("proxy/call_latency_p95_s"))


def _assert_final_checkpoint_is_the_last_publication(out: Path) -> None:
    """The final checkpoint (written from the Mooncake buffer) loads into transformers' Qwen2 and
    differs from the start weights: it is the trained policy, not a copy of v0."""
    import torch
    from safetensors.torch import load_file

    final = load_file(str(out / "checkpoint" / "model.safetensors"))
    start = load_file(str(out / "weights" / "v0" / "model.safetensors"))
    assert final.keys() == start.keys()
    assert any(not torch.equal(final[k], start[k]) for k in final)
    assert (out / "checkpoint" / "config.json").exists() and (out / "checkpoint" / "tokenizer.json").exists()
