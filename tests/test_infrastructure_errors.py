"""Only the task decides a zero: an execution Gyre failed is not scored as the policy's failure.

The proxy records every 5xx it answers an execution with (no engine available, an engine
refusing the call, a call interrupted too often); a harness may still finish after one (Claude
Code ends with ``is_error`` and a result line), and its evaluator may then score the workspace.
That score stands only if the evaluator vouches for it despite the errors; otherwise the execution
is unresolved, excluded with the cause "infrastructure error", and counted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("transformers")

from gyre_core.interfaces import Assessment, EngineError, StateRef  # noqa: E402
from gyre_core.orchestrator.live_executions import exclusion_cause, infra_verdict  # noqa: E402
from gyre_core.proxy.fake_engine import FakeEngine  # noqa: E402
from gyre_core.proxy.render import ChatRenderer  # noqa: E402
from gyre_core.proxy.service import ProxyConfig, ProxyService  # noqa: E402
from gyre_core.proxy.types import ChatMessage, ChatRequest, ProxyError  # noqa: E402
from gyre_core.tiny_model import cached_tiny_model  # noqa: E402

STATE = StateRef(artifact_version="final", branch="/w/e1")
ERRORS = [{"status": 503, "kind": "overloaded", "message": "no rollout engine is available"}]


class RefusingEngine(FakeEngine):
    """Stand-in engine that refuses every call (as an SGLang server answering 4xx/5xx would)."""

    async def generate(self, input_ids: Any, sampling_params: Any, *, rid: str | None = None,
                       return_logprob: bool = True) -> Any:
        raise EngineError("/generate", 500, "CUDA error: an illegal memory access")


def test_the_proxy_records_every_5xx_it_answers_an_execution_with() -> None:
    svc = ProxyService(ChatRenderer.from_model_dir(cached_tiny_model()),
                       ProxyConfig(served_models=("tiny",), retry_wait_s=0.1))
    svc.add_engine(RefusingEngine("http://refusing"))
    eid, _ = svc.create_execution(1)
    other, _ = svc.create_execution(2)
    request = ChatRequest(execution_id=str(eid), model="tiny", messages=(ChatMessage("user", "hi"),))
    with pytest.raises(ProxyError) as info:
        asyncio.run(svc.complete(request))
    assert info.value.status == 502
    (err,) = svc.infrastructure_errors(eid)
    assert err["status"] == 502 and err["kind"] == "engine" and "illegal memory access" in err["message"]
    assert svc.infrastructure_errors(other) == []  # recorded with its execution only
    svc.close_execution(eid)
    assert len(svc.infrastructure_errors(eid)) == 1  # still there when the execution is assessed


def test_a_score_after_an_infrastructure_error_stands_only_if_the_evaluator_vouches_for_it() -> None:
    zero = Assessment.valid(0.0, STATE, "no answer.json")
    taken = infra_verdict(zero, ERRORS)
    assert taken is not None and taken.score is None and taken.detail.startswith("infrastructure error")
    assert exclusion_cause([taken], harness_crashed=False) == "infrastructure error"
    vouched = Assessment.valid(1.0, STATE, "tests pass", despite_infrastructure_errors=True)
    assert infra_verdict(vouched, ERRORS) is vouched
    assert infra_verdict(zero, None) is zero and infra_verdict(zero, []) is zero  # no error: as scored
    unresolved = Assessment.unresolved(STATE, "evaluator raised")
    assert infra_verdict(unresolved, ERRORS) is unresolved


def test_claude_code_ending_with_is_error_after_a_gyre_5xx_is_unresolved_not_a_zero(tmp_path) -> None:
    """The CLI ran to its end (its log ends with a ``result`` object with ``is_error``): a failed
    end, assessed. After a 5xx from Gyre its zero is not taken; without one, the zero stands."""
    import json

    from gyre_core.orchestrator.harness import classify_end

    log = tmp_path / "e.log"
    log.write_text(json.dumps({"type": "result", "is_error": True, "result": "API Error: 503 overloaded"}) + "\n")
    assert classify_end("claude-code", 1, str(log)) == "failed"  # assessed like any end
    zero = Assessment.valid(0.0, STATE, "no answer.json")
    after_5xx = infra_verdict(zero, ERRORS)
    assert after_5xx is not None and after_5xx.score is None
    assert exclusion_cause([after_5xx], harness_crashed=False) == "infrastructure error"
    assert infra_verdict(zero, None) is zero  # the policy's own failure: the task's zero stands


def test_a_complete_failure_the_task_declares_is_the_zero_placeholder() -> None:
    from gyre_core.dataplane.assessment import AssessmentLedger
    from gyre_core.scheduler.events import EvaluationValid, Outcome

    failure = Assessment.complete_failure(STATE, "nothing to judge")
    assert failure.score == 0.0 and failure.nothing_to_assess
    with pytest.raises(ValueError):  # a complete failure is a zero, nothing else
        Assessment(0.5, failure.validity, STATE, nothing_to_assess=True)
    ledger = AssessmentLedger()
    ledger.register(3, deadline=60.0)
    ledger.terminated(3, Outcome.COMPLETED, STATE)
    assert isinstance(ledger.evaluate(3, lambda s: failure, 1.0), EvaluationValid)
    assert ledger.reward(3) == 0.0 and ledger.is_placeholder(3)
    # after a 5xx from Gyre, "nothing to assess" may be Gyre's doing: unresolved unless vouched
    taken = infra_verdict(failure, ERRORS)
    assert taken is not None and taken.score is None


def test_file_tasks_declare_a_complete_failure(tmp_path) -> None:
    from gyre_core.tasks.file_tasks import COMPLETE_FAILURE, reward_value, run_evaluator_command

    assert reward_value({"complete_failure": True}) == COMPLETE_FAILURE
    with pytest.raises(TypeError):
        reward_value({"complete_failure": "yes"})
    import sys

    cmd = [sys.executable, "-c", "print('checking'); print('{\"complete_failure\": true}'); raise SystemExit(1)"]
    value, detail = run_evaluator_command(cmd, str(tmp_path), 30.0, None)
    assert value == COMPLETE_FAILURE and "complete failure" in detail
