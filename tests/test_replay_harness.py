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
    assert all(plan.record(gid, 0, 3).context_tokens == 0 for gid in range(6))  # no token scale: short tool results
    a_groups = [gid for gid in range(6) if plan.record(gid, 0, 3).query == "q-a"]
    gid = a_groups[0]
    assert sorted(plan.record(gid, i, 3).outcome for i in range(3)) == ["completed", "failed", "harness_timeout"]


def test_context_tokens_scale_the_recorded_tokens_or_ones_in_proportion_to_duration() -> None:
    with_tokens = [ExecutionRecord("q", 1000.0, Outcome.COMPLETED, 50_000), ExecutionRecord("q", 3000.0, Outcome.COMPLETED, 90_000)]
    plan = ReplayPlan(with_tokens, time_scale=0.01, seed=0, token_scale=0.01)
    got = {plan.record(0, i, 2).recorded_s: plan.record(0, i, 2).context_tokens for i in range(2)}
    assert got == {1000.0: 500, 3000.0: 900}
    bare = ReplayPlan(TRACE, time_scale=0.01, seed=0, token_scale=0.5)  # no tokens: 1 token per recorded second
    for gid in range(4):
        r = bare.record(gid, 0, 3)
        assert r.context_tokens == round(0.5 * r.recorded_s) and r.as_extra()["context_tokens"] == r.context_tokens


def test_tool_results_share_out_what_the_context_still_lacks() -> None:
    from gyre_core.tasks.replay_harness import tool_output, tool_words

    assert tool_words(0, 10, 2, 1.0) == 0  # no target: one-line tool results
    assert tool_words(500, 600, 2, 1.0) == 0  # already past it
    assert tool_words(500, 100, 2, 2.0) == 100  # 400 tokens over two results at 2 tokens a word
    text = tool_output(300, 1)
    assert len(text.split()) >= 300 and text == tool_output(300, 1) and text != tool_output(300, 2)


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


def _replay(proxy, tmp_path: Path, outcome: str, duration_s: float, *extra: str,
            calls: int = 3) -> tuple[subprocess.Popen, Path, int]:
    svc, url = proxy
    eid, key = svc.create_execution()
    work = tmp_path / outcome
    work.mkdir()
    env = {**os.environ, "OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": key, "GYRE_MODEL": "gyre-policy"}
    proc = subprocess.Popen([sys.executable, "-m", "gyre_core.tasks.replay_harness", "Reply with digits.",
                             "--duration-s", str(duration_s), "--outcome", outcome, "--calls", str(calls), *extra],
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("calls", [2, 4])
def test_tool_results_grow_the_context_to_the_recorded_tokens(proxy, tmp_path: Path, calls: int) -> None:
    """With ``--context-tokens`` the last call's context holds about that many tokens, from the
    rate the run measures with its tokenizer; with a rate far off, the sizing corrects itself from
    the proxy's usage counts after the first tool result."""
    from gyre_core.tasks.replay_harness import tool_output

    svc, _ = proxy
    text = tool_output(400, 0)
    rate = len(svc.renderer.encode(text)) / len(text.split())  # what the run passes
    target = 900
    proc, _, eid = _replay(proxy, tmp_path, "completed", 0.5, "--context-tokens", str(target),
                           "--tokens-per-word", f"{rate:.3f}", calls=calls)
    assert proc.wait(60) == 0
    lens = [c.input_len for c in svc.records(eid).calls]
    assert len(lens) == calls and lens == sorted(lens)
    assert 0.85 * target <= lens[-1] <= 1.05 * target, lens
    if calls > 2:  # started from a rate 3x too low: the first result overshoots its share, the rest correct it
        (tmp_path / "off").mkdir()
        off, _, eid = _replay(proxy, tmp_path / "off", "completed", 0.5, "--context-tokens", str(target),
                              "--tokens-per-word", f"{rate / 3:.3f}", calls=calls)
        assert off.wait(60) == 0
        lens = [c.input_len for c in svc.records(eid).calls]
        assert lens[-1] <= 1.6 * target and lens[2] - lens[1] < (lens[1] - lens[0]) / 2, lens
