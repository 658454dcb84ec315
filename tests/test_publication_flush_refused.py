"""``load_published`` when SGLang loads the new weights but refuses to flush its prefix cache.

SGLang answers the update with an error whenever its scheduler is not fully idle at that instant
(a batch just finished, a KV hand-off pin is held): a race a real engine shows only now and then
(a live run failed at its third publication on it). The engine here is a stand-in that answers
exactly as SGLang 0.5.23 does, so both outcomes are checked every time.
"""

from __future__ import annotations

import asyncio
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
        asyncio.run(load_published(engine, REF))  # type: ignore[arg-type]


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
