"""The Async baseline runs live through ``gyre-orchestrate run`` (Colocate runs live in
``test_torchrun_run.py``, on torchrun-started ranks).

Same real parts as the embedded Gyre run (Megatron ranks over gloo, two SGLang CPU engines, the
TITO proxy, harness processes). What the mode must show on the wire, per the scheduler
(docs/design.md, "The three modes"): cell 0 is the fixed training pool from the start (one switch
to training, never back), cell 1 only serves; μ = 1, so every step publishes, and step s only
consumes groups admitted at versions ≤ s (0 ≤ staleness ≤ s; the first step's are all 0). Every
finished execution is accounted for (trained, dropped, surplus, excluded, waiting, cancelled) and
each step trains N·B executions.

The run also brings a model family of its own as the user's checkpoint (``model.dir``): a tiny
Qwen3-MoE (Qwen3's attention, 4 experts, 2 per token) on cells of TP 2 × EP 2 (each rank holds 2
experts; sequence-parallel). Megatron imports it, SGLang serves each published version of it
(gathered from the expert-parallel ranks), and the kept checkpoint is of the family the run trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gyre_core.testing import assert_accounted, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(600)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

N, B, STEPS = 4, 2, 2


def _run(out: Path, mode: str, phi: float, mu: int, family: str, *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from gyre_core.tiny_model import cached_tiny_model

    model = cached_tiny_model(family=family, hidden_size=64, num_layers=2, max_position_embeddings=2048)
    args = ["--set", f"model.dir={model}", "--set", f"scheduler.mode={mode}", "--set", f"scheduler.extra_dispatch={phi}",
            "--set", f"scheduler.steps_per_burst={mu}", "--set", f"scheduler.group_size={N}",
            "--set", f"scheduler.groups_per_step={B}", "--set", "run.max_wall_s=420.0", *extra]
    summary, _ = run_job(out, "--config", str(SMALL_JOB), "--steps", str(STEPS), *args, timeout=540)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    # the family went all the way: the kept checkpoint is one (trained: not the starting weights)
    kept = json.loads((out / "checkpoint" / "config.json").read_text())
    assert kept["model_type"] == family and kept["architectures"] == [{"qwen3_moe": "Qwen3MoeForCausalLM"}[family]]
    return summary, events


def _check_accounting(summary: dict[str, Any]) -> None:
    ex = summary["executions"]
    assert_accounted(ex)
    assert ex["trained"] == STEPS * B * N, ex
    assert summary["steps"] == STEPS and len(summary["step_records"]) == STEPS
    for rec in summary["step_records"]:
        assert len(rec["groups"]) == B and rec["executions"] == B * N, rec


def test_async_trains_on_a_fixed_pool(tmp_path: Path) -> None:
    phi, mu = 1.0, 1  # solve_burst("async", 1.0)
    summary, events = _run(tmp_path / "async", "async", phi, mu, "qwen3_moe",
                           "--set", "training.tp=2", "--set", "training.ep=2", "--set", "training.objective=dapo",
                           "--set", "training.correction=tis",
                           # the team's Megatron settings: Adam's beta2, weight decay, a linear decay
                           "--set", "training.megatron={adam_beta2 = 0.98, weight_decay = 0.01, "
                                    "lr_decay_style = \"linear\", min_lr = 1e-5}",
                           "--set", "training.kl_coef=0.1")  # a KL penalty to the warm start
    # two cells of two ranks each (tensor and expert parallel)
    assert sorted(p.name for p in (tmp_path / "async").glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    assert summary["mode"] == "async"
    _check_accounting(summary)
    # trained on DAPO (token-level clip-higher) under truncated IS: the ratio to the trainer's own
    # log-probs is 1, so nothing is clipped; the sampler–trainer gap and the truncated share, every step
    for rec in summary["step_records"]:
        assert rec["tokens"] > 0 and rec["ratio_pass_tokens"] == 0, rec  # no whole-execution ratio pass
        assert rec["token_clip_fraction"] == 0 and rec["clip_fraction"] == 0, rec
        assert 0 <= rec["correction_fraction"] <= 1, rec
        assert 0 <= rec["logp_diff_mean"] <= rec["logp_diff_max"] < 1 and 0 <= rec["kl_k3"] < 0.1, rec

    # megatron-core's schedule over the run's steps, from training.lr (1e-4) down to min_lr
    lrs = [rec["lr"] for rec in summary["step_records"]]
    assert lrs == pytest.approx([1e-4 - (1e-4 - 1e-5) * s / STEPS for s in range(STEPS)], rel=1e-9), lrs

    # the KL penalty's reference is the warm start: step 0 trains the warm start itself (KL 0),
    # the next one a policy an update away from it
    kls = [rec["kl_ref"] for rec in summary["step_records"]]
    assert abs(kls[0]) < 1e-7 < kls[-1], kls
    assert all(rec["reference_pass_s"] > 0 for rec in summary["step_records"])

    # the training pool (cell 0) switches once, at the start; cell 1 never switches
    switches = summary["role_switches"]
    assert [(s["cell"], s["transition"]) for s in switches] == [(0, "to_training")], switches
    assert all(rec["cells"] == [0] for rec in summary["step_records"])
    assert not any(e.get("command") in ("CellToRollout", "JoinStep") for e in events)
    # boundary dispatch: Q_b = (φ + μ)·B groups at start, then one publication per step
    first_pub = next(i for i, e in enumerate(events) if e.get("event") == "PublicationDone")
    assert sum(1 for e in events[:first_pub] if e.get("command") == "DispatchGroup") == int((phi + mu) * B)
    assert [e["version"] for e in events if e.get("command") == "Publish"][:1] == [1]
    # staleness: step s consumes groups admitted at versions 0..s
    for rec in summary["step_records"]:
        assert all(0 <= d <= rec["step"] for d in rec["staleness"]), rec
    assert summary["step_records"][0]["staleness"] == [0] * B
    assert 0.0 <= summary["mean_staleness"] <= phi + (mu - 1) / 2 + 0.5
