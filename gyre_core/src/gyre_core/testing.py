"""Helpers for tests that run whole jobs (shipped, like ``gyre_sglang.testing``, so every test
folder and plugin can use them).

``run_job`` runs ``gyre-orchestrate run --json-summary`` in a child process, as a user would, and
``assert_accounted`` checks the invariant every finished run must keep: no finished execution lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

__all__ = ["assert_accounted", "run_job"]


def run_job(out: Path, *args: str, timeout: float = 840.0) -> tuple[dict[str, Any], str]:
    """``gyre-orchestrate run --out OUT --json-summary ARGS``: its summary and its console
    (stderr); a run that exits non-zero fails the test with the console's tail."""
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--json-summary", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def assert_accounted(ex: Mapping[str, int]) -> None:
    """A summary's ``executions``: every finished execution is trained, dropped, filtered, surplus,
    excluded, cancelled or still waiting, each with its cause, and every launched one finished,
    stopped or runs."""
    assert ex["dispatched"] >= ex["launched"] >= ex["finished"] > 0, ex
    accounted = ex["trained"] + ex["dropped"] + ex["filtered"] + ex["surplus"] + ex["excluded"] + ex["waiting"] + ex["cancelled"]
    assert accounted == ex["finished"], ex
    assert ex["launched"] - ex["finished"] == ex["stopped"] + ex["running"], ex
    # and each one not trained has its cause: the causes of a fate add up to its count
    causes = ex["not_trained"]
    for fate in ("dropped", "filtered", "surplus", "excluded", "waiting", "cancelled"):
        assert sum(causes.get(fate, {}).values()) == ex[fate], (fate, ex)
    assert "cause not recorded" not in str(causes), causes
