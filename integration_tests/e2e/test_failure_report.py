"""A live run that fails reads in one look: one line of cause per link on the console, no
tracebacks there, every traceback in ``<out>/error.log``, and ``summary.json`` saying so.

The failure is real: SGLang engines given 2 s to become healthy (a CPU engine needs ~30 s), after
the Megatron ranks have started, so the report has to come through the run's own teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(300)]
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")


def test_failed_run_prints_causes_and_keeps_tracebacks_in_the_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out),
                           "--set", "serving.start_timeout_s=2"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr
    failed = [ln for ln in err if ln.startswith("gyre-orchestrate: run failed: ")]
    assert len(failed) == 1 and "ServerStartError" in failed[0] and "not healthy after 2 s" in failed[0]
    assert err[-1] == f"gyre-orchestrate: full tracebacks in {out / 'error.log'}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_log"] == str(out / "error.log")
    assert summary["causes"][0] in failed[0]
    assert "Traceback (most recent call last)" in (out / "error.log").read_text()
