"""``load_published`` when SGLang loads the new weights but refuses to flush its prefix cache.

SGLang answers the update with an error whenever its scheduler is not fully idle at that instant
(a batch just finished, a KV hand-off pin is held): a race a real engine shows only now and then
(a live run failed at its third publication on it). The engine here is a stand-in that answers
exactly as SGLang 0.5.23 does, so both outcomes are checked every time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("mooncake.engine")

from gyre_core.interfaces import EngineError, WeightsRef  # noqa: E402
from gyre_sglang.weight_publication import load_published  # noqa: E402

REFUSAL = ("Weights were updated, but the cache was not flushed because requests are still running or "
           "queued. Retract or finish them, then call /flush_cache.")


class StubEngineAnswering:
    """Stand-in for an :class:`SGLangClient`: records calls, answers the update as told."""

    def __init__(self, update_answer: Any, *, raise_status: int | None = None, records_version: bool = True,
                 flush_ok: bool = False) -> None:
        self.update_answer, self.raise_status = update_answer, raise_status
        self.records_version, self.flush_ok = records_version, flush_ok
        self.version, self.calls = "0", []  # type: tuple[str, list[str]]
        self.url = "http://stub"

    async def server_info(self) -> dict[str, Any]:
        return {"tp_size": 1}

    async def begin_weight_update(self) -> None:
        self.calls.append("begin")

    async def end_weight_update(self) -> None:
        self.calls.append("end")

    async def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        self.calls.append(path)
        if self.records_version:
            self.version = body["weight_version"]
        if self.raise_status is not None:
            raise EngineError(path, self.raise_status, self.update_answer)
        return self.update_answer

    async def weight_version(self) -> str:
        return self.version

    async def flush_cache(self) -> None:
        self.calls.append("flush")
        if not self.flush_ok:
            raise EngineError("/flush_cache", 400, "Cache not flushed because there are pending requests.")


REF = WeightsRef(version=3, location='{"stub": true}')


@pytest.mark.parametrize("as_http_error", [True, False])
@pytest.mark.parametrize("flush_ok", [True, False])
def test_a_refused_flush_after_a_load_is_a_load(as_http_error: bool, flush_ok: bool) -> None:
    engine = (StubEngineAnswering(REFUSAL, raise_status=400, flush_ok=flush_ok) if as_http_error
              else StubEngineAnswering({"success": False, "message": REFUSAL}, flush_ok=flush_ok))
    assert asyncio.run(load_published(engine, REF)) == "3"  # type: ignore[arg-type]
    # the session is closed, then the flush is tried once more (its refusal is not an error)
    assert engine.calls == ["begin", "/update_weights_from_tensor", "end", "flush"]


def test_the_refusal_does_not_hide_a_load_that_did_not_happen() -> None:
    engine = StubEngineAnswering(REFUSAL, raise_status=400, records_version=False)
    with pytest.raises(EngineError, match="weight_version '0' after loading 3"):
        asyncio.run(load_published(engine, REF, version_wait_s=0.2))  # type: ignore[arg-type]


@pytest.mark.parametrize("answer", ["layout mismatch: model.embed_tokens.weight", {"success": False, "message": "torn pull"}])
def test_other_failures_still_fail_and_close_the_session(answer: Any) -> None:
    engine = StubEngineAnswering(answer, raise_status=400 if isinstance(answer, str) else None, records_version=False)
    with pytest.raises(EngineError):
        asyncio.run(load_published(engine, REF))  # type: ignore[arg-type]
    assert engine.calls == ["begin", "/update_weights_from_tensor", "end"]


def test_without_flush_cache_a_refusal_message_is_not_expected_and_fails() -> None:
    engine = StubEngineAnswering({"success": False, "message": REFUSAL})
    with pytest.raises(EngineError):
        asyncio.run(load_published(engine, REF, flush_cache=False))  # type: ignore[arg-type]


class StubEngineReportingLate(StubEngineAnswering):
    """Stand-in for a busy SGLang engine: the load succeeds, but ``/model_info`` (answered by the
    tokenizer manager) reports the new version only after ``late_reads`` more reads -- what a CI
    machine under load showed live, where one read after the load still saw the old version."""

    def __init__(self, late_reads: int, **kw: Any) -> None:
        super().__init__({"success": True, "message": ""}, records_version=False, flush_ok=True, **kw)
        self.late_reads, self.reads, self.loads = late_reads, 0, 0

    async def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        self.loads += 1
        self.pending, self.reads = body["weight_version"], 0
        return await super().post(path, body, timeout=timeout)

    async def weight_version(self) -> str:
        self.reads += 1
        if self.reads > self.late_reads:
            self.version = self.pending
        return self.version


def test_a_version_that_reaches_model_info_late_is_waited_for() -> None:
    engine = StubEngineReportingLate(late_reads=4)
    assert asyncio.run(load_published(engine, REF, version_wait_s=10.0)) == "3"  # type: ignore[arg-type]
    assert engine.reads == 5 and engine.loads == 1


def test_a_version_that_never_shows_fails_after_the_bounded_wait() -> None:
    engine = StubEngineReportingLate(late_reads=10**9)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"weight_version '0' after loading 3 \(waited 0.3 s\)"):
        asyncio.run(load_published(engine, REF, version_wait_s=0.3))  # type: ignore[arg-type]
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_the_serving_side_retries_a_load_that_did_not_take() -> None:
    """The first load's version never shows in time; the second try's does: one load retried,
    no error reaches the orchestrator."""
    from gyre_sglang.serving_side import SGLangServingSide

    engine = StubEngineReportingLate(late_reads=10**9)
    side = SGLangServingSide("http://stub", version_wait_s=0.2, load_attempts=2)
    calls = {"n": 0}

    async def loader(client: Any, weights: WeightsRef) -> str:
        calls["n"] += 1
        if calls["n"] == 2:
            engine.late_reads = 0  # the engine caught up
        return await load_published(client, weights, version_wait_s=0.2)

    side.weight_loader = loader
    assert asyncio.run(side._load(engine, REF)) == "3"  # type: ignore[arg-type]
    assert calls["n"] == 2 and engine.loads == 2

    calls["n"], engine.late_reads, engine.version = 5, 10**9, "0"  # never catches up: the error surfaces
    with pytest.raises(EngineError, match="after loading 3"):
        asyncio.run(side._load(engine, REF))  # type: ignore[arg-type]
