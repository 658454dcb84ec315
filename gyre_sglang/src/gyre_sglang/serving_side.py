"""The serving side of a cell: an SGLang server switched in and out of rollout.

*To training*, in this order, each phase timed:

1. ``stop_intake``  -- close Gyre's intake gate: new generation requests get 503 and the proxy
   sends them elsewhere;
2. ``hand_off``     -- list the requests still in flight and give their ids to the orchestrator,
   which reserves capacity on the destinations and re-routes them (the proxy retries each one
   there, invisibly to the harness; with KV hand-off the destination continues without re-prefill);
3. ``abort``        -- abort what is still running here (each caller gets its partial output with
   ``finish_reason == "abort"``, which is the proxy's signal to retry at the destination);
4. ``flush``        -- drop the prefix cache (it refers to KV memory about to be released);
5. ``release_memory`` -- release KV cache and weights (real on GPUs with
   ``--enable-memory-saver``; a no-op on SGLang's CPU engine).

*To rollout*: ``resume_memory`` → ``load_weights`` (the current version; skipped when the engine
kept the weights through the release and they are that version) → ``open_intake``.

The engine process stays alive throughout. Every phase is reported as a
:class:`~gyre_core.interfaces.PhaseTiming` to ``on_phase`` as soon as it ends (the orchestrator
forwards them to ``gyre_on_event``) and returned in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

from gyre_core.interfaces import EngineError, PhaseTiming, WeightsRef

from gyre_sglang.client import SGLangClient

__all__ = ["SGLangServingSide", "WeightLoader", "role_switch_problems"]

log = logging.getLogger("gyre.sglang")

WeightLoader = Callable[[SGLangClient, WeightsRef], Awaitable[str]]
"""Loads a published version into the engine and returns the engine's new ``weight_version``."""


async def load_from_disk(client: SGLangClient, weights: WeightsRef, *, version_wait_s: float | None = None) -> str:
    """``location`` is a model directory in the serving layout (safetensors). A refused cache
    flush after the load (requests running) is a load, as for a Mooncake publication."""
    from gyre_sglang.weight_publication import FLUSH_REFUSED, VERSION_WAIT_S, await_version

    try:
        await client.update_weights_from_disk(weights.location, weight_version=str(weights.version))
    except EngineError as e:
        if FLUSH_REFUSED not in str(e):
            raise
    return await await_version(client, weights.version, VERSION_WAIT_S if version_wait_s is None else version_wait_s)


async def load_any(client: SGLangClient, weights: WeightsRef, *, version_wait_s: float | None = None) -> str:
    """Default loader: a Mooncake publication (its location is a JSON object) is pulled by the
    engine (:func:`gyre_sglang.weight_publication.load_published`); anything else is a directory.
    Either waits up to ``version_wait_s`` for the engine to report the loaded version."""
    from gyre_sglang.weight_publication import VERSION_WAIT_S, load_published

    wait = VERSION_WAIT_S if version_wait_s is None else version_wait_s
    if weights.location.lstrip().startswith("{"):
        return await load_published(client, weights, version_wait_s=wait)
    return await load_from_disk(client, weights, version_wait_s=wait)


class SGLangServingSide:
    """Implements :class:`gyre_core.interfaces.ServingSide` for one SGLang server.

    ``cell`` is the cell index (``-1`` for a standalone engine); ``clock`` gives the times the
    phases are reported with; ``weight_loader`` turns a :class:`WeightsRef` into loaded weights
    (:func:`load_any`: pulled over Mooncake when the core published it there, else from disk,
    waiting up to ``version_wait_s`` for the engine to report the loaded version). A load that
    fails is tried ``load_attempts`` times in all before its error reaches the caller (who then
    treats the engine as failed: the watchdog restarts it on the current policy).
    The async methods are the :class:`~gyre_core.interfaces.ServingSide` protocol; the synchronous
    ones (``to_training``, ``to_rollout``, ``load_weights``, ``health``) run them on
    a private event loop for callers outside asyncio.
    """

    def __init__(
        self,
        url: str,
        *,
        cell: int = -1,
        clock: Callable[[], float] = time.monotonic,
        on_phase: Callable[[PhaseTiming], None] | None = None,
        weight_loader: WeightLoader | None = None,
        version_wait_s: float | None = None,
        load_attempts: int = 2,
        memory_tags: Sequence[str] = ("kv_cache", "weights"),
        drain_timeout: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.cell = cell
        self.clock = clock
        self.on_phase = on_phase
        if load_attempts < 1:
            raise ValueError(f"load_attempts must be ≥ 1, got {load_attempts}")
        self.weight_loader: WeightLoader = weight_loader or functools.partial(load_any, version_wait_s=version_wait_s)
        self.load_attempts = load_attempts
        self.memory_tags = tuple(memory_tags)
        self.drain_timeout = drain_timeout
        self.weight_version: str | None = None
        self.weights_kept: bool | None = None
        """Whether releasing memory keeps the weights (read from the engine at its first switch):
        SGLang's CPU engine releases nothing, and a GPU engine started with
        ``--enable-weights-cpu-backup`` restores them from host memory on resume. Then an engine
        that comes back to the version it left with loads nothing (see :meth:`ato_rollout`)."""

    def _client(self) -> SGLangClient:
        return SGLangClient(self.url, api_key=self.api_key)

    async def _phase(self, out: list[PhaseTiming], transition: str, name: str, work: Awaitable[object]) -> object:
        start = self.clock()
        result = await work
        timing = PhaseTiming(self.cell, transition, name, start, self.clock())
        out.append(timing)
        if self.on_phase is not None:
            self.on_phase(timing)
        return result

    async def _drain(self, client: SGLangClient) -> list[str]:
        """Wait until the engine has no request in flight; the rids still listed at the deadline."""
        deadline = time.monotonic() + self.drain_timeout
        while True:
            rids = await self.in_flight(client)
            if not rids or time.monotonic() > deadline:
                return rids
            await asyncio.sleep(0.05)

    async def _flush(self, client: SGLangClient) -> None:
        """Flush the cache, retrying while SGLang still refuses.

        The tokenizer manager forgets an aborted request before the scheduler has dropped it from
        its queues, so a flush right after the drain can be refused (HTTP 400) for a few
        iterations. Retry until ``drain_timeout``; past it, the refusal is the error.
        """
        deadline = time.monotonic() + self.drain_timeout
        while True:
            try:
                await client.flush_cache()
                return
            except EngineError as exc:
                if exc.status != 400 or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    @staticmethod
    async def in_flight(client: SGLangClient) -> list[str]:
        return list((await client.get("/gyre/requests"))["rids"])

    async def ato_training(self, hand_off: Callable[[Sequence[str]], object]) -> list[PhaseTiming]:
        t = "to_training"
        out: list[PhaseTiming] = []
        async with self._client() as c:
            if self.weights_kept is None:
                info = await c.server_info()
                self.weights_kept = (not str(info.get("device") or "").startswith("cuda")
                                     or bool(info.get("enable_weights_cpu_backup")))
            if self.weight_version is None:  # the version it serves (started on, or loaded by another side)
                self.weight_version = await c.weight_version()
            await self._phase(out, t, "stop_intake", c.post("/gyre/intake", {"open": False}))

            async def give_away() -> None:
                rids = await self.in_flight(c)
                done = hand_off(rids)
                if asyncio.iscoroutine(done):
                    await done

            await self._phase(out, t, "hand_off", give_away())

            async def abort() -> None:
                await c.abort_all()
                left = await self._drain(c)
                if left:
                    raise RuntimeError(f"engine {self.url} still runs {len(left)} requests after abort: {left[:5]}")

            await self._phase(out, t, "abort", abort())
            await self._phase(out, t, "flush", self._flush(c))
            await self._phase(out, t, "release_memory", c.release_memory_occupation(self.memory_tags))  # type: ignore[arg-type]
        return out

    async def ato_rollout(self, weights: WeightsRef | None) -> list[PhaseTiming]:
        t = "to_rollout"
        out: list[PhaseTiming] = []
        async with self._client() as c:
            await self._phase(out, t, "resume_memory", c.resume_memory_occupation(list(reversed(self.memory_tags))))  # type: ignore[arg-type]
            # A satellite returns before its burst's version is published (which it then loads
            # with every rollout engine): when its weights survived the release and are still
            # the current version, it pulls nothing now -- one pull per burst, not two.
            kept = self.weights_kept and weights is not None and self.weight_version == str(weights.version)
            if weights is not None and not kept:
                self.weight_version = str(await self._phase(out, t, "load_weights", self._load(c, weights)))
            await self._phase(out, t, "open_intake", c.post("/gyre/intake", {"open": True}))
        return out

    async def _load(self, c: SGLangClient, weights: WeightsRef) -> str:
        """Load ``weights``, trying again when a load did not take (the engine's error, or a
        version that never showed); the last error is raised after ``load_attempts`` tries."""
        for attempt in range(1, self.load_attempts + 1):
            try:
                return await self.weight_loader(c, weights)
            except EngineError as e:
                if attempt == self.load_attempts:
                    raise
                log.warning("engine %s: loading version %s failed (try %d of %d), trying again: %s",
                            self.url, weights.version, attempt, self.load_attempts, e)
        raise AssertionError("unreachable")

    async def aload_weights(self, weights: WeightsRef) -> str:
        async with self._client() as c:
            self.weight_version = await self._load(c, weights)
        return self.weight_version

    async def ahealth(self) -> bool:
        async with self._client() as c:
            return await c.health()

    async def arole_switch_problems(self, *, kv_handoff: bool) -> list[str]:
        async with self._client() as c:
            return role_switch_problems(await c.server_info(), self.url, kv_handoff=kv_handoff)

    # -- synchronous conveniences, for callers outside asyncio ---------------------------------

    def to_training(self, hand_off: Callable[[Sequence[str]], None]) -> Sequence[PhaseTiming]:
        return asyncio.run(self.ato_training(hand_off))

    def to_rollout(self, weights: WeightsRef | None) -> Sequence[PhaseTiming]:
        return asyncio.run(self.ato_rollout(weights))

    def load_weights(self, weights: WeightsRef) -> None:
        asyncio.run(self.aload_weights(weights))

    def health(self) -> bool:
        return asyncio.run(self.ahealth())

    def role_switch_problems(self, *, kv_handoff: bool) -> list[str]:
        return asyncio.run(self.arole_switch_problems(kv_handoff=kv_handoff))


def role_switch_problems(info: Mapping[str, Any], url: str, *, kv_handoff: bool) -> list[str]:
    """Why the engine whose ``/server_info`` is ``info`` cannot switch roles in this run.

    * KV hand-off runs on the engine's TP rank 0 (Gyre's scheduler plugin there pins, exports
      and imports the pages), so on a tensor-parallel engine it would move one shard of the heads:
      refused rather than done in part.
    * On a GPU, SGLang releases weights and KV cache only when started with
      ``--enable-memory-saver`` (Gyre sets it for every cell's engine); without it, training
      would share the GPU with a full engine.
    """
    problems: list[str] = []
    tp = int(info.get("tp_size") or 1)
    if kv_handoff and tp > 1:
        problems.append(f"proxy.kv_handoff: engine {url} runs SGLang tensor parallelism {tp}, and a KV hand-off "
                        "moves the cache of TP rank 0 only: set proxy.kv_handoff = false (a moved call then "
                        "re-prefills on its new engine)")
    device = str(info.get("device") or "")
    if device.startswith("cuda") and not info.get("enable_memory_saver"):
        problems.append(f"serving: engine {url} runs on a GPU without --enable-memory-saver, so a role switch "
                        "would not release its weights and KV cache for training (Gyre starts a cell's "
                        "engine with it; one started otherwise needs it too)")
    return problems
