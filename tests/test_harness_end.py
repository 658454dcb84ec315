"""How a harness ended decides what its exit may mean for the reward (never a zero for a crash)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gyre_core.interfaces import ExecutionSpec
from gyre_core.orchestrator.harness import SubprocessHarness, classify_end


@pytest.mark.parametrize("harness, code, end", [
    ("command", 0, "completed"), ("command", 1, "failed"), ("command", 2, "failed"),
    ("command", -9, "crashed"), ("command", 137, "crashed"), ("command", 139, "crashed"),
    ("number-guess", 1, "crashed"), ("number-guess", 0, "completed"),
    ("claude-code", 1, "crashed"),  # no log: no final report
])
def test_classification(harness: str, code: int, end: str) -> None:
    assert classify_end(harness, code) == end


def test_claude_code_that_reported_its_result_ran_to_its_end(tmp_path: Path) -> None:
    log = tmp_path / "e.log"
    log.write_text("some stderr\n" + json.dumps({"type": "result", "is_error": True, "result": "capped"}) + "\n")
    assert classify_end("claude-code", 1, str(log)) == "failed"
    log.write_text("Traceback (most recent call last):\n  ...\nError: boom\n")
    assert classify_end("claude-code", 1, str(log)) == "crashed"
    assert classify_end("claude-code", -15, str(log)) == "crashed"


def test_a_real_process_killed_by_a_signal_is_a_crash(tmp_path: Path) -> None:
    h = SubprocessHarness([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          str(tmp_path), {}, log_path=str(tmp_path / "log"))
    h.harness = "command"
    code = h.wait(30)
    assert code == -9 and h.end_kind(code) == "crashed"
    h2 = SubprocessHarness([sys.executable, "-c", "raise SystemExit(3)"], str(tmp_path), {})
    h2.harness = "command"
    assert h2.end_kind(h2.wait(30)) == "failed"


def test_spec_carries_the_exit_to_the_evaluator() -> None:
    from gyre_core.orchestrator.live_executions import _with_exit

    spec = ExecutionSpec(execution_id=1, workdir="/w", proxy_base_url="http://x", api_key="k", harness_timeout_s=1,
                         overall_budget_s=2, harness="command", task="t", extra={"task": "sum-file"})
    s = _with_exit(spec, {"code": -9, "end": "crashed"})
    assert s.extra == {"task": "sum-file", "harness_exit": -9, "harness_end": "crashed"} and spec.extra == {"task": "sum-file"}
