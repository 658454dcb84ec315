"""What happens to a model call its engine interrupts: KV hand-off, continuation, accounting.

A role change takes an engine out of rollout while calls run on it. The orchestrator reroutes the
engine's executions first, then (:meth:`HandOffs.start`) asks the engine to hand each running
call's KV cache to the engine its execution now runs on; the hand-off aborts the call on the
source, whose ``generate`` returns the partial output. The proxy then *continues* the call on the
destination: prompt + partial output as input, the rest of the token budget as budget. With the
KV handed off the destination prefills almost nothing; without it (no hand-off offered, the
destination lacked room, the engines serve different versions) it re-prefills, and the reason is
counted.

A continued call is recorded as one generation: the partial and the continuation joined. That is
exact only when both parts come from the same policy and the sampling does not depend on what
was generated so far, so :func:`may_continue` refuses constrained or penalised sampling, and
:func:`join` refuses parts with different weight versions; the call is then generated again from
its prompt (as a call interrupted by a dead engine is), never spliced.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Mapping, Sequence

from gyre_core.interfaces import GenerateResult, KVHandOff

__all__ = ["HandOffs", "join", "may_continue", "remaining_params"]

_NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
"""Sampling parameters whose effect depends on the output so far: continuing from a partial
output (which the engine then reads as prompt) is the same distribution only at these values."""


def may_continue(params: Mapping[str, Any], constraint_keys: Sequence[str]) -> bool:
    """Whether a call with these sampling parameters may be continued from its partial output."""
    if any(k in params for k in constraint_keys):
        return False  # a grammar restarts from its start state on the continuation
    return all(float(params.get(k, v)) == v for k, v in _NEUTRAL.items())


def remaining_params(params: Mapping[str, Any], carried: GenerateResult | None) -> dict[str, Any]:
    """The sampling parameters of the next attempt: the budget less what was already generated."""
    out = dict(params)
    if carried is not None:
        out["max_new_tokens"] = int(params["max_new_tokens"]) - len(carried.output_ids)
    return out


def join(carried: GenerateResult, more: GenerateResult) -> GenerateResult | None:
    """One generation from a partial output and its continuation; ``None`` when they come from
    different policies (a weight version changed in between), which must not be spliced."""
    if carried.weight_version != more.weight_version:
        return None
    return GenerateResult(
        rid=more.rid, output_ids=carried.output_ids + more.output_ids, logprobs=carried.logprobs + more.logprobs,
        finish_reason=more.finish_reason, prompt_tokens=carried.prompt_tokens,
        cached_tokens=carried.cached_tokens, weight_version=more.weight_version, matched_stop=more.matched_stop,
    )


def _reason_key(reason: str) -> str:
    """A reason without its particulars (URLs, request ids, handles, numbers), to count by."""
    key = re.sub(r"https?://\S+", "<url>", reason)
    key = re.sub(r"'[^']*'", "'…'", key)
    key = re.sub(r"\b[0-9a-f]{12,}\b", "<id>", key)
    key = re.sub(r"\d+(\.\d+)?", "N", key)
    return key.strip()[:200] or "unknown"


@dataclass
class HandOffs:
    """The hand-offs of interrupted calls, and the counts the run summary reports.

    ``interrupted``: attempts cut short by their engine (abort or disappearance) and continued or
    generated again elsewhere; each is then counted once as ``handed_off`` (continued on the KV it
    handed off; ``prefill_tokens_saved`` adds the tokens the destination did not prefill) or as
    ``reprefilled`` (``reasons`` says why). ``regenerated``: continuations thrown away because
    the destination served another policy, and calls that could not be continued at all.
    """

    interrupted: int = 0
    handed_off: int = 0
    reprefilled: int = 0
    prefill_tokens_saved: int = 0
    handoff_bytes: int = 0
    regenerated: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    _pending: dict[str, "asyncio.Future[KVHandOff]"] = field(default_factory=dict)

    def start(self, rid: str) -> "asyncio.Future[KVHandOff]":
        """A hand-off of ``rid`` begins; the interrupted call waits for its outcome."""
        fut: asyncio.Future[KVHandOff] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        return fut

    async def outcome(self, rid: str, timeout: float) -> KVHandOff | None:
        """The outcome of ``rid``'s hand-off, if one was started (waited for up to ``timeout``)."""
        fut = self._pending.pop(rid, None)
        if fut is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return KVHandOff(rid, False, f"hand-off still running after {timeout:.0f} s")

    def forget(self, rid: str) -> None:
        """The attempt ended by itself: a hand-off started too late moves nothing it continues."""
        self._pending.pop(rid, None)

    def count_continuation(self, handoff: KVHandOff | None, reason: str, cached_tokens: int, engine: str) -> None:
        """An interrupted attempt was continued on ``engine`` by an attempt that reused
        ``cached_tokens`` of its input."""
        if handoff is not None and handoff.moved:
            self.handoff_bytes += handoff.bytes
            if not handoff.dest or handoff.dest == engine:
                self.handed_off += 1
                self.prefill_tokens_saved += min(handoff.prefix_tokens, cached_tokens)
                return
            reason = "continued on another engine than the one the KV went to"
            handoff = None
        self.reprefilled += 1
        key = _reason_key(handoff.reason if handoff is not None and handoff.reason else reason)
        if key not in self.reasons and len(self.reasons) >= 16:
            key = "other"
        self.reasons[key] = self.reasons.get(key, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {"interrupted": self.interrupted, "handed_off": self.handed_off, "reprefilled": self.reprefilled,
                "prefill_tokens_saved": self.prefill_tokens_saved, "handoff_bytes": self.handoff_bytes,
                "regenerated": self.regenerated, "reasons": dict(self.reasons)}


async def settle(fut: "asyncio.Future[KVHandOff]", work: Awaitable[KVHandOff], rid: str) -> KVHandOff:
    """Run one hand-off and resolve its future whatever happens (an error is a fallback reason)."""
    try:
        out = await work
    except Exception as exc:  # noqa: BLE001 -- a failed hand-off only costs a re-prefill
        out = KVHandOff(rid, False, f"hand-off failed: {type(exc).__name__}: {exc}")
    if not fut.done():
        fut.set_result(out)
    return out
