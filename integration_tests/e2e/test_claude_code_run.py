"""``gyre-orchestrate run`` with ``harness.kind = "claude-code"``: the real CLI as every execution's harness.

One small live job: two cells, the ``sum-file`` task, Claude Code (the pinned CLI, installed with
npm on first use) started per execution in its own directory and ``HOME`` with its own key, talking
to the proxy's Anthropic face, served by the real SGLang engines; one training step on what it
recorded. Counts: every ended execution ran the CLI to its result, served by the policy, and got a
verdict on its workspace (0 or 1, with its token records in the journal), also a CLI that reported
an error and exited 1 (it ran to its end: the task judges what it left); all are accounted for and
none is excluded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gyre_core.testing import assert_accounted, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.claude_code, pytest.mark.sglang, pytest.mark.megatron,
              pytest.mark.timeout(900)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "claude_code"))
from claude_cli import CLIUnavailable, ensure_cli  # noqa: E402


def test_claude_code_harness_runs_a_live_step(tmp_path: Path) -> None:
    try:
        claude = ensure_cli()
    except CLIUnavailable as e:
        pytest.skip(str(e))
    cfg = tmp_path / "run.toml"
    # A tiny model has a small context: two tools and a one-line system prompt keep Claude Code's
    # requests within it; everything else is the CLI's own behaviour.
    cfg.write_text(f"""
[scheduler]
cells = 2
cell_capacity = 2
group_size = 2
groups_per_step = 1
extra_dispatch = 1.0
rho_min = 0.5
supply_window_s = 2.0
[run]
steps = 1
[task]
name = "sum-file"
[harness]
kind = "claude-code"
claude_bin = "{claude}"
args = ["--tools", "Write,Bash", "--system-prompt", "You are a coding agent. Use the Write tool.", "--max-turns", "3"]
timeout_s = 180
overall_budget_s = 400
[model]
hidden_size = 64
num_layers = 2
max_seq_len = 8192
[dataplane]
token_budget = 8192
[serving]
max_total_tokens = 32768
[sampling]
max_new_tokens = 48
""")
    out = tmp_path / "run"
    summary, _ = run_job(out, "--config", str(cfg), timeout=840)
    assert summary["steps"] == 1 and summary["policy_version"] == 1
    ex = summary["executions"]
    assert_accounted(ex)
    assert ex["trained"] == 2 and ex["excluded"] == 0, ex

    journal = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    scored = {j["execution_id"]: j for j in journal if j["kind"] == "scored"}
    trajectories = {j["execution_id"]: j for j in journal if j["kind"] == "trajectory"}
    placeholders = {j["execution_id"] for j in journal if j["kind"] == "placeholder"}
    assert placeholders == set()  # every CLI ran to its result: each end is assessed, none stood in for
    assert len(scored) >= ex["trained"]
    for eid in sorted(scored):
        # the real CLI ran to its result through the proxy, as this execution, in its own home
        result = json.loads((out / "executions" / f"e{eid:05d}.log").read_text().strip().splitlines()[-1])
        assert result["type"] == "result", result
        assert result["modelUsage"]["gyre-policy"]["outputTokens"] > 0  # the policy answered it
        assert (out / "executions" / f"e{eid:05d}.home" / ".claude").is_dir()
        assert scored[eid]["reward"] in (0.0, 1.0)  # a verdict on the workspace, never a stand-in
        assert trajectories[eid]["tree"]["nodes"], f"execution {eid}: no token records"
        if result["is_error"]:
            # the CLI reported an error (a random tiny model often runs into the proxy's
            # max_new_tokens, which Claude Code treats as one) and exited 1: it ran to its end, so
            # the workspace it left is judged -- a real zero unless answer.txt holds the sum
            assert trajectories[eid]["harness_exit"] == {"code": 1, "end": "failed"}
        else:
            assert trajectories[eid]["harness_exit"] is None
