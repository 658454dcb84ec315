"""scripts/system-deps.sh, the first thing both README commands run: it returns at once on a
prepared machine, and where it cannot install what is missing it stops with one message that
names the packages and the command, before anything else is set up."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "system-deps.sh"
SETUP = ROOT / "scripts" / "setup.sh"


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})


def test_prepared_machine_passes_at_once() -> None:
    if _run(SCRIPT, "run", GYRE_SETUP_NO_INSTALL="1").returncode != 0:
        pytest.skip("this machine lacks a system package (the no-root path is tested below)")
    t0 = time.monotonic()
    proc = _run(SCRIPT, "run", GYRE_SETUP_NO_INSTALL="1")
    assert proc.returncode == 0 and proc.stderr == ""
    assert time.monotonic() - t0 < 5


def test_without_root_it_names_the_packages_and_the_command() -> None:
    proc = _run(SCRIPT, "test", GYRE_SETUP_NO_INSTALL="1", GYRE_SETUP_ASSUME_MISSING="libibverbs1 nodejs")
    assert proc.returncode == 3
    err = proc.stderr.splitlines()
    assert err[0] == "setup: error: missing system packages: libibverbs1 nodejs"
    assert any("libibverbs.so.1" in ln for ln in err) and any("Claude Code" in ln for ln in err)
    assert "setup: install them as root:  apt-get install -y --no-install-recommends libibverbs1 nodejs" in err
    assert proc.stdout == ""


def test_run_needs_no_node_and_node_can_be_declined() -> None:
    for args, env in ((("run",), {}), (("test",), {"GYRE_SETUP_NO_NODE": "1"})):
        proc = _run(SCRIPT, *args, GYRE_SETUP_NO_INSTALL="1", GYRE_SETUP_ASSUME_MISSING="nodejs npm", **env)
        assert "nodejs" not in proc.stderr, (args, env, proc.stderr)


def test_setup_stops_before_anything_else_when_a_package_cannot_be_installed() -> None:
    proc = _run(SETUP, "run", GYRE_SETUP_NO_INSTALL="1", GYRE_SETUP_ASSUME_MISSING="libibverbs1",
                GYRE_SETUP_FORCE="1")  # forced: without the stop it would reinstall .venv/
    assert proc.returncode == 3
    assert proc.stderr.startswith("setup: error: missing system packages: libibverbs1")
    assert "installing gyre-core" not in proc.stderr
