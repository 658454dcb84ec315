"""A task's own command in an execution's workspace: its evaluator, or its set-up.

It runs where the harness ran -- inside the execution's sandbox when the run has one, as the
sandbox's user, with only a minimal environment (never the execution's API key) -- in its own
session, with a timeout. What it prints is read up to :data:`OUTPUT_LIMIT_BYTES` from the end.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["OUTPUT_LIMIT_BYTES", "run_in_workspace"]

OUTPUT_LIMIT_BYTES = 64 * 1024


def run_in_workspace(cmd: Sequence[str], workdir: str, timeout_s: float, sandbox: Mapping[str, Any] | None,
                     env: Mapping[str, str] | None = None, what: str = "command",
                     stdin_text: str | None = None, judge: bool = False) -> tuple[int | None, str, str]:
    """``(exit code, or None if it could not start or ran out of time; the end of its stdout;
    a one-line detail)``. ``stdin_text``: what its standard input holds (else it is empty);
    ``judge``: the task's evaluator (it may see what scores, which the set-up may not).
    Never raises for what the command does."""
    argv, fds = list(cmd), ()
    if sandbox:
        from gyre_core.orchestrator.sandbox import SandboxSpec, wrap

        home = str(Path(workdir).parent / f"{Path(workdir).name}.home")
        launch = wrap(argv, SandboxSpec.from_extra(sandbox), workdir, home, judge=judge)
        argv, fds = launch.argv, launch.pass_fds
    base = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV") if k in os.environ}
    try:
        proc = subprocess.Popen(argv, cwd=workdir, env={**base, **dict(env or {})},
                                stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=fds,
                                start_new_session=True)
    except OSError as exc:
        return None, "", f"{what} cannot start: {exc}"
    try:
        out, _ = proc.communicate(None if stdin_text is None else stdin_text.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "", f"{what} did not finish within {timeout_s:g} s"
    code = proc.returncode
    ended = "exited 0" if code == 0 else (f"ended with signal {-code}" if code < 0 else f"exited {code}")
    return code, out[-OUTPUT_LIMIT_BYTES:].decode("utf-8", "replace"), f"{what} {ended}"
