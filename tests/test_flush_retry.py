"""A role switch survives SGLang refusing the cache flush while it still drops aborted requests.

The tokenizer manager forgets an aborted request a moment before the scheduler empties its
queues, and SGLang answers ``/flush_cache`` with HTTP 400 in that window (seen in a CI run of the
digits e2e test). The client here is a stand-in (``_RefusingClientStandIn``) so the window can be
made exact; the real engine's refusal is what ``integration_tests/e2e`` runs into.
"""

from __future__ import annotations

import asyncio

import pytest

from gyre_core.interfaces import EngineError
from gyre_sglang.serving_side import SGLangServingSide


class _RefusingClientStandIn:
    def __init__(self, refusals: int, status: int = 400) -> None:
        self.refusals = refusals
        self.status = status
        self.calls = 0

    async def flush_cache(self) -> None:
        self.calls += 1
        if self.calls <= self.refusals:
            raise EngineError("/flush_cache", self.status, "Flush cache failed.")


def test_a_refused_flush_is_retried_until_the_engine_accepts() -> None:
    side = SGLangServingSide("http://127.0.0.1:1", drain_timeout=5.0)
    client = _RefusingClientStandIn(refusals=3)
    asyncio.run(side._flush(client))  # type: ignore[arg-type]
    assert client.calls == 4


def test_a_flush_refused_past_the_drain_timeout_is_the_error() -> None:
    side = SGLangServingSide("http://127.0.0.1:1", drain_timeout=0.2)
    client = _RefusingClientStandIn(refusals=10**9)
    with pytest.raises(EngineError, match="Flush cache failed"):
        asyncio.run(side._flush(client))  # type: ignore[arg-type]
    assert client.calls > 1


def test_other_engine_errors_are_not_retried() -> None:
    side = SGLangServingSide("http://127.0.0.1:1", drain_timeout=5.0)
    client = _RefusingClientStandIn(refusals=1, status=500)
    with pytest.raises(EngineError):
        asyncio.run(side._flush(client))  # type: ignore[arg-type]
    assert client.calls == 1
