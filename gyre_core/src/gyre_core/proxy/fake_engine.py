"""``FakeEngine``: a stand-in rollout engine for the proxy's fast tests and its benchmarks.

Not a model and not SGLang: it answers ``generate`` with scripted token ids and made-up log-probs,
so proxy tests can pin down exactly what must be recorded, and benchmarks measure the proxy alone.
It implements :class:`gyre_core.interfaces.EngineClient`; everything that needs a real engine runs
against a real SGLang server in ``integration_tests/``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gyre_core.interfaces import EngineUnreachable, GenerateResult

__all__ = ["FakeEngine", "FakeEngineCall"]


@dataclass(frozen=True)
class FakeEngineCall:
    rid: str | None
    input_ids: tuple[int, ...]
    sampling_params: Mapping[str, Any]


@dataclass
class FakeEngine:
    """Answers each call with the next scripted output (or ``default_output``), truncated to
    ``max_new_tokens``. ``abort_next`` / ``vanish_next`` make the next calls end as an engine
    abort (partial output, ``finish_reason="abort"``) or as :class:`EngineUnreachable`."""

    url: str
    default_output: Sequence[int] = (1,)
    logprob: float = -0.5
    weight_version: str = "fake-0"
    delay_s: float = 0.0
    abort_next: int = 0
    vanish_next: int = 0
    outputs: deque[tuple[int, ...]] = field(default_factory=deque)
    calls: list[FakeEngineCall] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def script(self, *outputs: Sequence[int]) -> None:
        self.outputs.extend(tuple(o) for o in outputs)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        self.calls.append(FakeEngineCall(rid, tuple(input_ids), dict(sampling_params)))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.vanish_next > 0:
            self.vanish_next -= 1
            raise EngineUnreachable("/generate", None, f"{self.url} vanished (FakeEngine)")
        if self.abort_next > 0:
            self.abort_next -= 1
            partial = (7, 7)
            return GenerateResult(rid or "", partial, (self.logprob,) * len(partial), "abort",
                                  len(input_ids), 0, self.weight_version)
        out = self.outputs.popleft() if self.outputs else tuple(self.default_output)
        cap = int(sampling_params.get("max_new_tokens", len(out)))
        finish = "stop" if len(out) <= cap else "length"
        out = out[:cap]
        return GenerateResult(rid or "", out, (self.logprob,) * len(out), finish, len(input_ids), 0,
                              self.weight_version)

    async def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)
