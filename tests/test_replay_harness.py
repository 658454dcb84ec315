"""The replay harness: each execution replays one recorded execution through a real proxy.

The proxy is Gyre's own (uvicorn, the OpenAI face); the engine behind it is ``FakeEngine``, a
named stand-in (the e2e replay run uses real SGLang engines). Checked: the recorded pace (the
process ends at the scaled duration, not before), calls with growing context, and each recorded
outcome's ending -- what the run's evaluator and timeouts then make of it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre_core.orchestrator.replay_plan import ReplayPlan
from gyre_core.proxy.fake_engine import FakeEngine
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.service import ProxyConfig, ProxyService
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.workload import ExecutionRecord
from gyre_core.tasks import digits
from gyre_core.tiny_model import cached_tiny_model

TRACE = [ExecutionRecord("q-a", 1000.0, Outcome.COMPLETED), ExecutionRecord("q-a", 2000.0, Outcome.FAILED),
         ExecutionRecord("q-a", 3000.0, Outcome.HARNESS_TIMEOUT), ExecutionRecord("q-b", 500.0, Outcome.OVERALL_TIMEOUT)]


def test_a_group_replays_one_query_scaled_and_the_same_on_every_run() -> None:
    plan = ReplayPlan(TRACE, time_scale=0.01, seed=3)
    again = ReplayPlan(TRACE, time_scale=0.01, seed=3)
    for gid in range(6):
        group = [plan.record(gid, i, 3) for i in range(3)]
        assert len({r.query for r in group}) == 1
        assert [r.as_extra() for r in group] == [again.record(gid, i, 3).as_extra() for i in range(3)]
        for r in group:
            assert r.duration_s == pytest.approx(0.01 * r.recorded_s)
        refill = plan.record(gid, 5, 3)  # past the group: one more execution of the same query
        assert refill.query == group[0].query
    a_groups = [gid for gid in range(6) if plan.record(gid, 0, 3).query == "q-a"]
    gid = a_groups[0]
    assert sorted(plan.record(gid, i, 3).outcome for i in range(3)) == ["completed", "failed", "harness_timeout"]


@pytest.fixture(scope="module")
def proxy():
    """Gyre's proxy on a loopback port, in a thread of its own."""
    import uvicorn

    from gyre_core.proxy.app import build_app
    from gyre_core.proxy.http_layer import uvicorn_config

    renderer = ChatRenderer.from_model_dir(cached_tiny_model())
    svc = ProxyService(renderer, ProxyConfig(served_models=("gyre-policy",)))
    eng = FakeEngine("http://fake", default_output=tuple(renderer.encode("123<|im_end|>")))
    svc.add_engine(eng)
    server = uvicorn.Server(uvicorn_config(build_app(svc, admin_token="admin-token-0123456789"), host="127.0.0.1", port=0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield svc, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _replay(proxy, tmp_path: Path, outcome: str, duration_s: float) -> tuple[subprocess.Popen, Path, int]:
    svc, url = proxy
    eid, key = svc.create_execution()
    work = tmp_path / outcome
    work.mkdir()
    env = {**os.environ, "OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": key, "GYRE_MODEL": "gyre-policy"}
    proc = subprocess.Popen([sys.executable, "-m", "gyre_core.tasks.replay_harness", "Reply with digits.",
                             "--duration-s", str(duration_s), "--outcome", outcome, "--calls", "3"],
                            cwd=work, env=env, start_new_session=True)
    return proc, work, eid


@pytest.mark.timeout(120)
def test_completed_and_failed_end_at_the_recorded_pace_with_what_the_evaluator_needs(proxy, tmp_path: Path) -> None:
    svc, _ = proxy
    t0 = time.monotonic()
    done, done_dir, done_eid = _replay(proxy, tmp_path, "completed", 3.0)
    failed, failed_dir, _ = _replay(proxy, tmp_path, "failed", 3.0)
    assert done.wait(60) == 0 and failed.wait(60) == 1
    assert time.monotonic() - t0 >= 3.0  # not before the recorded (scaled) duration
    assert digits.score_workspace(done_dir)[0] == 1.0  # the policy's own reply, "123"
    assert digits.score_workspace(failed_dir)[0] == 0.0  # a complete failure: scored zero
    calls = svc.records(done_eid).calls
    assert len(calls) == 3
    assert calls[0].input_len < calls[1].input_len < calls[2].input_len  # the context grows


@pytest.mark.timeout(120)
def test_timeouts_keep_working_until_the_run_kills_them(proxy, tmp_path: Path) -> None:
    scored, scored_dir, _ = _replay(proxy, tmp_path, "harness_timeout", 1.0)
    lost, lost_dir, _ = _replay(proxy, tmp_path, "overall_timeout", 1.0)
    try:
        time.sleep(4.0)
        assert scored.poll() is None and lost.poll() is None  # past their duration, still running
        assert digits.score_workspace(scored_dir)[0] == 1.0  # what a harness timeout's assessment scores
        assert not (lost_dir / digits.REPLY_FILE).exists()  # nothing to assess: discarded, never a zero
    finally:
        for p in (scored, lost):
            p.kill()
            p.wait(10)
