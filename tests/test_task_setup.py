"""A task's set-up command: run in the workspace, where and as the harness runs, before it starts;
never with the execution's key; a failure means the harness never starts (excluded, never a zero)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from gyre_core.interfaces import ExecutionSpec
from gyre_core.orchestrator.harness import TaskSetupFailed, gyre_launch_harness

HARNESS = [sys.executable, "-c", "import pathlib; pathlib.Path('seen.txt').write_text(open('built.txt').read())"]


def _spec(tmp_path: Path, setup: list[str], sandbox: dict | None = None) -> ExecutionSpec:
    extra = {"task": "file", "command": HARNESS, "setup": setup, "setup_timeout_s": 30.0,
             "workspace_files": {"src.txt": "source"}}
    if sandbox is not None:
        extra["sandbox"] = sandbox
    return ExecutionSpec(execution_id=3, workdir=str(tmp_path / "run" / "e00003"), proxy_base_url="http://127.0.0.1:9",
                         api_key="secret-key-of-e3", harness_timeout_s=30.0, overall_budget_s=60.0,
                         harness="command", task="fix it", extra=extra)


SETUP = [sys.executable, "-c", "import os, pathlib; src = pathlib.Path('src.txt').read_text(); "
         "pathlib.Path('built.txt').write_text(src + ' built as ' + str(os.getuid())); "
         "pathlib.Path('env.txt').write_text(repr(dict(os.environ)))"]


def test_the_set_up_runs_in_the_workspace_before_the_harness_and_without_its_key(tmp_path: Path) -> None:
    spec = _spec(tmp_path, SETUP)
    handle = gyre_launch_harness(spec=spec)
    assert handle.wait(30) == 0
    work = Path(spec.workdir)
    assert (work / "seen.txt").read_text().startswith("source built as")  # the task's files were in; the harness saw it
    env = (work / "env.txt").read_text()
    assert "secret-key-of-e3" not in env and "OPENAI_API_KEY" not in env


def test_a_failing_set_up_starts_no_harness(tmp_path: Path) -> None:
    spec = _spec(tmp_path, [sys.executable, "-c", "raise SystemExit(4)"])
    with pytest.raises(TaskSetupFailed, match="task set-up exited 4"):
        gyre_launch_harness(spec=spec)
    assert not (Path(spec.workdir) / "seen.txt").exists()
    assert not Path(spec.workdir).with_name("e00003.log").exists()  # no harness log: it never started
    slow = _spec(tmp_path / "slow", [sys.executable, "-c", "import time; time.sleep(60)"])
    slow.extra["setup_timeout_s"] = 0.5
    with pytest.raises(TaskSetupFailed, match="did not finish within 0.5 s"):
        gyre_launch_harness(spec=slow)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_set_up_runs_inside_the_sandbox_as_its_user(tmp_path: Path, offline_sandbox: dict) -> None:
    from gyre_core.orchestrator.sandbox import SANDBOX_UID

    sandbox = offline_sandbox
    spec = _spec(tmp_path, SETUP, sandbox)
    handle = gyre_launch_harness(spec=spec)
    assert handle.wait(60) == 0
    assert (Path(spec.workdir) / "seen.txt").read_text() == f"source built as {SANDBOX_UID}"
