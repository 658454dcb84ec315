"""The orchestrator killed outright (SIGKILL) mid-run and resumed with ``--resume``.

Counts: steps reach the target; no rollout group is trained in two completed steps; every
execution the journal saw finish before the crash is accounted for after the resume (trained,
dropped, surplus, excluded or waiting) -- zero lost; executions running at the crash are started
again under the same id and counted once (launched == finished + stopped at the end); and no
process the killed orchestrator started outlives it (engines, ranks, harnesses die with it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(1200)]
psutil = pytest.importorskip("psutil")
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

STEPS = 4


def _journal(out: Path) -> list[dict]:
    p = out / "journal.jsonl"
    if not p.exists():
        return []
    recs = []
    for line in p.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return recs


def _steps_done(recs: list[dict]) -> int:
    return sum(1 for r in recs if r["kind"] == "event" and r["event"]["type"] == "MicroStepsDone")


def test_kill_and_resume_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--steps", str(STEPS)]
    log1 = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(cmd, stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    started: list = []
    try:
        deadline = time.monotonic() + 600
        while _steps_done(_journal(out)) < 2:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run did not reach 2 steps"
            time.sleep(0.5)
        started = psutil.Process(first.pid).children(recursive=True)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        log1.close()
        if first.poll() is None:
            first.kill()
    before = _journal(out)
    finished_before = {r["event"]["execution_id"] for r in before if r["kind"] == "event"
                       and r["event"]["type"] == "ExecutionEnded" and r["event"]["outcome"] != "cancelled"}
    assert finished_before, "nothing had finished before the crash"

    # Nothing the orchestrator started survives it (engines, Megatron ranks, harnesses).
    gone_by = time.monotonic() + 45
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < gone_by:
        time.sleep(1)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # clean up before failing
        p.kill()
    assert not alive, [p.cmdline()[:4] for p in alive]

    resumed = subprocess.run(cmd + ["--resume", "--json-summary"], capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])

    assert summary["steps"] == STEPS
    groups = [g for rec in summary["step_records"] for g in rec["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * 2  # B = 2 groups per step, each trained once
    ex = summary["executions"]
    accounted = ex["trained"] + ex["dropped"] + ex["filtered"] + ex["surplus"] + ex["excluded"] + ex["waiting"] + ex["cancelled"]
    assert accounted == ex["finished"]
    assert ex["launched"] == ex["finished"] + ex["stopped"] + ex["running"]
    after = _journal(out)
    ended_after = {r["event"]["execution_id"] for r in after if r["kind"] == "event"
                   and r["event"]["type"] == "ExecutionEnded"}
    assert finished_before <= ended_after
    # each execution ended exactly once across both runs
    ends = [r["event"]["execution_id"] for r in after if r["kind"] == "event" and r["event"]["type"] == "ExecutionEnded"]
    assert len(ends) == len(set(ends))
    assert (out / "checkpoint" / "model.safetensors").exists()
    # the crashed run published over Mooncake (its buffers died with it): the resumed core rebuilt
    # the last published version from its checkpoint, and the engines started on that
    published = [json.loads(r["location"]) for r in before if r["kind"] == "published"]
    if published:
        v = max(p["version"] for p in published)
        assert f"rebuilding published policy version {v}" in resumed.stderr
        assert (out / "weights" / f"v{v}" / "model.safetensors").exists()


def test_a_run_killed_again_and_again_resumes_to_its_end(tmp_path: Path) -> None:
    """Three SIGKILLs at random points (after an execution's end, a step, a publication or a role
    switch; torn journal tails among them), each resumed: the same accounting holds at the end.
    ``benchmarks/crash_resume.py`` runs the same with 20 kills."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "crash_resume", Path(__file__).resolve().parents[2] / "benchmarks" / "crash_resume.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.crash_chain(tmp_path / "run", kills=3, steps=4, seed=1)
    print(f"\ncrash chain: {json.dumps(res['points'])}; executions {res['executions']}; {res['wall_s']} s")
    assert res["kills"] >= 2 and any(p["torn_tail"] for p in res["points"])
    assert res["steps"] == 4 and res["groups_trained"] == 4 * 2 and res["groups_trained_twice"] == 0
    assert res["ended_twice"] == 0 and res["accounted"] == res["finished"] > 0
