"""``gyre-score unittest``: a task's own ``unittest`` tests, scored so that the agent cannot forge a pass.

Used as ``[task] evaluator = ["gyre-score", "unittest"]``. Gyre runs it in the execution's
workspace (inside the execution's sandbox) with the task record in ``GYRE_TASK_RECORD`` and its
verdict token on standard input (:mod:`gyre_core.scoring.verdict`). It

1. reads the token and makes itself non-dumpable before anything of the agent's runs;
2. writes the task's tests **from the record**, never from the workspace, into a fresh folder
   the agent never saw: the record's ``tests`` (``{"path": "content"}``), or else the entries of
   its ``workspace`` object named ``test*.py`` (the agent may read those, and may have changed
   its copies: the record's are the ones run);
3. runs them in a separate isolated Python (:mod:`gyre_core.scoring.unittest_runner`) against the
   workspace, with a timeout;
4. rewards the tests that must pass: the record's ``must_pass`` (``unittest`` ids such as
   ``test_util.TestAdd.test_add``), or SWE-bench's ``FAIL_TO_PASS`` + ``PASS_TO_PASS``, or else
   every test the files define. A test passes only if the runner's report shows it passed;
   the reward is 1.0 when all of them did (``--fraction``: the share that did), else 0.0.

What the agent's code can do to the test process and what it gets:

* exit it, kill it, crash at import, print a verdict, write a report of its own: no signed report,
  so no test is seen passing (0.0);
* patch ``unittest`` or ``builtins``: seen by the runner's snapshot, 0.0;
* kill this scorer: Gyre sees a signal death, unresolved (never a pass);
* run past the timeout: unresolved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

from gyre_core.scoring.verdict import emit, protect_self, read_token

__all__ = ["main", "named_tests", "score", "test_files"]

OUTPUT_LIMIT = 256 * 1024
"""Bytes of the test process's own output kept (for the detail), and of its report."""


class Unresolved(Exception):
    """The scorer cannot judge (a record without tests, a timeout): never a zero."""


def test_files(record: Mapping[str, Any]) -> dict[str, str]:
    """The test files to write, from the record only (see the module docstring)."""
    tests = record.get("tests")
    if tests is None:
        ws = record.get("workspace")
        if isinstance(ws, list):  # a Parquet map column reads back as (path, content) pairs
            ws = dict(ws)
        tests = {k: v for k, v in (ws or {}).items() if PurePosixPath(str(k)).name.startswith("test")
                 and str(k).endswith(".py")} if isinstance(ws, dict) else {}
    if isinstance(tests, list):
        tests = dict(tests)
    if not isinstance(tests, dict) or not tests:
        raise Unresolved("the record has no tests (a 'tests' object, or test*.py files in its 'workspace' object)")
    out: dict[str, str] = {}
    for name, content in tests.items():
        p = PurePosixPath(str(name))
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise Unresolved(f"the record's test path {name!r} leaves the tests' folder")
        out[str(p)] = str(content)
    return out


def _names(value: Any) -> list[str]:
    if isinstance(value, str):  # SWE-bench writes these lists as JSON strings
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            value = [value]
    return [str(v) for v in value or []]


def named_tests(record: Mapping[str, Any]) -> list[str]:
    """The ids that must pass (empty: every test the files define)."""
    if record.get("must_pass") is not None:
        return _names(record["must_pass"])
    return _names(record.get("FAIL_TO_PASS")) + _names(record.get("PASS_TO_PASS"))


def _drain(stream: Any, into: bytearray) -> None:
    while chunk := stream.read(65536):
        if len(into) < OUTPUT_LIMIT:
            into += chunk[: OUTPUT_LIMIT - len(into)]


def _run_tests(tests_dir: str, workspace: str, ids: Sequence[str], timeout_s: float, scratch: str) -> dict[str, Any]:
    """The runner's report, or ``{"missing": why}`` when the test process left none."""
    import secrets

    token = secrets.token_hex(16)
    r, w = os.pipe()
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "HOME") if k in os.environ}
    argv = [sys.executable, "-I", "-B", "-X", f"pycache_prefix={os.path.join(scratch, 'pyc')}", "-m",
            "gyre_core.scoring.unittest_runner", tests_dir, workspace, str(w), *ids]
    proc = subprocess.Popen(argv, cwd=workspace, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, pass_fds=(w,), start_new_session=True)
    os.close(w)
    report, output = bytearray(), bytearray()
    readers = [threading.Thread(target=_drain, args=(os.fdopen(r, "rb"), report), daemon=True),
               threading.Thread(target=_drain, args=(proc.stdout, output), daemon=True)]
    for t in readers:
        t.start()
    assert proc.stdin is not None
    try:
        proc.stdin.write((token + "\n").encode())
        proc.stdin.close()
    except OSError:
        pass
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
        raise Unresolved(f"the tests did not finish within {timeout_s:g} s") from None
    _kill_group(proc.pid)  # what the agent's code left running in the test process's session
    for t in readers:
        t.join(timeout=2.0)
    lines = [ln for ln in bytes(report).decode("utf-8", "replace").splitlines() if ln.strip()]
    tail = bytes(output).decode("utf-8", "replace").strip().splitlines()[-3:]
    if not lines:
        ended = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
        return {"missing": f"the test process {ended} before it reported" + (f" ({' | '.join(tail)})" if tail else "")}
    try:
        parsed = [json.loads(ln) for ln in lines]
    except ValueError:
        parsed = []
    if len(lines) != 1 or not parsed or not isinstance(parsed[0], dict) or parsed[0].get("token") != token:
        return {"missing": "the test process's report was written by something else (forged or added lines)"}
    return dict(parsed[0])


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def score(record: Mapping[str, Any], workspace: str, timeout_s: float, fraction: bool) -> dict[str, Any]:
    """The verdict for the agent's work in ``workspace``: ``{"reward", "passed", "tests", ...}``."""
    files = test_files(record)
    ids = named_tests(record)
    with tempfile.TemporaryDirectory(prefix="gyre-score-") as scratch:
        tests_dir = os.path.join(scratch, "tests")
        for name, content in files.items():
            dest = Path(tests_dir, name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(content, encoding="utf-8")
        os.chmod(scratch, 0o755)  # the test process is this user too: only the folder's name is fresh
        report = _run_tests(tests_dir, os.path.abspath(workspace), ids, timeout_s, scratch)
    if "missing" in report:
        return {"reward": 0.0, "passed": 0, "tests": len(ids), "why": f"no test seen passing: {report['missing']}"}
    outcomes: dict[str, str] = {str(k): str(v) for k, v in dict(report.get("tests") or {}).items()}
    if report.get("tampered"):
        return {"reward": 0.0, "passed": 0, "tests": len(ids or outcomes),
                "why": "the agent's code patched the test runner: " + ", ".join(report["tampered"][:5])}
    wanted = ids or sorted(outcomes)
    if not wanted:
        return {"reward": 0.0, "passed": 0, "tests": 0, "why": "the test files define no test"}
    passed = [t for t in wanted if outcomes.get(t) == "passed"]
    failed = [t for t in wanted if outcomes.get(t) != "passed"]
    reward = len(passed) / len(wanted) if fraction else float(not failed)
    out: dict[str, Any] = {"reward": reward, "passed": len(passed), "tests": len(wanted)}
    if failed:
        out["why"] = "not passed: " + ", ".join(f"{t} ({outcomes.get(t, 'not run')})" for t in failed[:5])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    token = read_token()  # first: nothing of the agent's has run yet
    protect_self()
    ap = argparse.ArgumentParser(prog="gyre-score", description="Score a task's tests against the workspace.")
    sub = ap.add_subparsers(dest="runner", required=True)
    ut = sub.add_parser("unittest", help="the record's unittest tests (the only runner so far)")
    ut.add_argument("--fraction", action="store_true", help="reward the share of tests passed, not all-or-nothing")
    ut.add_argument("--timeout", type=float, default=50.0, help="seconds the tests may run (default 50)")
    ut.add_argument("--workspace", default=".", help="the agent's workspace (default: the current folder)")
    args = ap.parse_args(argv)
    try:
        raw = os.environ.get("GYRE_TASK_RECORD")
        if not raw:
            raise Unresolved("GYRE_TASK_RECORD is not set (Gyre sets it for [task] evaluator commands)")
        record = json.loads(raw)
        if not isinstance(record, dict):
            raise Unresolved("GYRE_TASK_RECORD is not a JSON object")
        verdict = score(record, args.workspace, args.timeout, args.fraction)
    except Unresolved as exc:
        emit(token, unresolved=str(exc))
        return 3
    emit(token, **verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
