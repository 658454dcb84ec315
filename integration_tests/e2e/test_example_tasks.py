"""The shipped example (``examples/tasks/command.toml``) as a user runs it: the user's own tasks and
evaluator from files, 2 steps, one held-out evaluation of the last policy on every eval task. The
user brings a model of their own as well (``model.dir``, a tiny Llama: a head size of its own, no
biases): Megatron imports it, SGLang serves each version of it, and the run keeps a Llama checkpoint.

Real parts throughout: Megatron ranks, SGLang CPU servers, the proxy, the toy agent in its sandbox
(OpenAI SDK), the example's evaluator command (the task's unit tests) in the sandbox. Then
``gyre-orchestrate eval`` on the run's checkpoint: the same held-out tasks, engines only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_core.testing import assert_accounted, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(900)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_trains_two_steps_and_evaluates_the_held_out_tasks(tmp_path: Path, monkeypatch) -> None:
    from gyre_core.tiny_model import cached_tiny_model

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    out = tmp_path / "run"
    # Llama with Llama 3.1's RoPE scaling: SGLang serves it, the cells train it, the export keeps it
    model = cached_tiny_model(family="llama", hidden_size=64, num_layers=2, max_position_embeddings=2048,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    # at test sizes: 2 groups of 2 a step, short replies (the agent asks for 256 tokens; the proxy caps)
    small = ["--set", "scheduler.group_size=2", "--set", "scheduler.groups_per_step=2",
             "--set", "sampling.max_new_tokens=48", "--set", "eval.max_concurrent=6"]
    summary, console = run_job(out, "--config", "examples/tasks/command.toml", "--set", "run.max_wall_s=600.0",
                               "--set", f"model.dir={model}", *small, timeout=840)
    assert summary["status"] == "ok" and summary["steps"] == 2
    kept = json.loads((out / "checkpoint" / "config.json").read_text())
    assert (kept["model_type"], kept["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert kept["rope_scaling"]["rope_type"] == "llama3" and kept["rope_scaling"]["factor"] == 8.0
    ex = summary["executions"]
    assert_accounted(ex)
    eval_tasks = len((ROOT / "examples" / "tasks" / "eval.jsonl").read_text().splitlines())
    # one evaluation, of the last policy: every held-out task once, never trained on
    (ev,) = summary["evaluations"]
    print(f"\nexample: {summary['wall_s']} s; evaluation {ev}; executions {ex}")
    assert ev["step"] == 2 and ev["tasks"] == eval_tasks and ev["executions"] == eval_tasks
    assert ev["unresolved"] < eval_tasks and ev["pass_rate"] is not None and 0.0 <= ev["pass_rate"] <= 1.0
    lines = [json.loads(x) for x in (out / "eval" / "step2.jsonl").read_text().splitlines()]
    assert sorted(t["record_index"] for t in lines) == list(range(eval_tasks))
    assert "evaluation of version 2: pass rate" in console
    # the evaluation's executions are not the scheduler's: none was dispatched, trained or journalled
    assert ex["dispatched"] < 1 << 30 and all(e < 1 << 30 for e in _journalled_execution_ids(out))
    workspaces = [p for p in (out / "eval" / "v2").iterdir() if p.is_dir() and not p.name.endswith(".home")]
    assert len(workspaces) == eval_tasks  # each in its own workspace

    # the checkpoint the run kept, evaluated alone: engines only, the same tasks and evaluator
    alone = tmp_path / "eval-alone"
    proc = subprocess.run([sys.executable, "-m", "gyre_core.cli", "eval", "--model", str(out / "checkpoint"),
                           "--config", "examples/tasks/command.toml", "--out", str(alone), "--json-summary",
                           *small],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"eval alone: {result}")
    assert result["status"] == "ok" and result["evaluation"]["executions"] == eval_tasks
    assert len((alone / "eval" / "step0.jsonl").read_text().splitlines()) == eval_tasks
    assert not (alone / "journal.jsonl").exists() and not list(alone.glob("rank*.log"))  # no trainer


def _journalled_execution_ids(out: Path) -> set[int]:
    ids = set()
    for line in (out / "journal.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "execution_id" in rec:
            ids.add(int(rec["execution_id"]))
    return ids
