"""Move a running request's KV cache from one SGLang server to another (client side).

:func:`hand_off` drives the routes of ``gyre_sglang.server_plugin.kv_handoff``: it checks that the
destination answers, pins the request on the source, aborts it there (the caller's ``/generate``
returns with ``finish_reason == "abort"`` and the partial output), waits until the source holds
the request's computed KV, has the destination read it over Mooncake and insert it into its radix
cache, and makes sure the source pin is released (the destination acknowledges it itself; this
client releases it again when that acknowledgement did not arrive). The caller then re-sends the
request to the destination with :func:`continue_on`: the prefix is served from the imported KV.

Failures: anything that only prevents the KV from moving (request already gone, radix cache off,
transfer error or timeout) returns ``fell_back=True`` with the reason; :func:`continue_on` then
simply re-prefills. A destination that does not answer raises :class:`DestinationUnreachable`
(there is nothing to continue on): before the source is touched when it is dead from the start,
after the source pin is released when it dies mid-way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from gyre_core.interfaces import EngineClient, EngineError, EngineUnreachable, GenerateResult

__all__ = ["DestinationUnreachable", "EngineRoutes", "HandOffError", "HandOffResult", "continue_on", "hand_off"]


class EngineRoutes(EngineClient, Protocol):
    """What a hand-off needs of each engine's client (:class:`gyre_sglang.client.SGLangClient` is
    one, and calls into this module): generation, and any route of Gyre's server plugin. Named
    here so that this module does not import the client back."""

    async def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any: ...

    async def get(self, path: str, *, timeout: float | None = None) -> Any: ...


class HandOffError(RuntimeError):
    """A KV hand-off could not be carried out, and no fallback applies."""


class DestinationUnreachable(HandOffError):
    """The destination server did not answer; the source holds no pin for the request."""


@dataclass(frozen=True)
class HandOffResult:
    """What a hand-off did, with its timings (seconds).

    ``prefix_tokens``: tokens whose KV the destination now holds for the request (0 on fallback);
    ``imported_tokens`` of them came over Mooncake, ``cached_before`` were already there.
    """

    rid: str
    fell_back: bool
    reason: str = ""
    prefix_tokens: int = 0
    imported_tokens: int = 0
    cached_before: int = 0
    bytes: int = 0
    acked: bool = False
    pin_s: float = 0.0
    drain_s: float = 0.0
    import_s: float = 0.0
    transfer_s: float = 0.0
    total_s: float = 0.0


async def _release(source: EngineRoutes, handle: str) -> None:
    try:
        await source.post("/gyre/kv/release", {"handle": handle})
    except EngineError:
        pass  # the source's lease releases it


async def hand_off(
    source: EngineRoutes,
    dest: EngineRoutes,
    rid: str,
    *,
    timeout: float = 30.0,
    lease_s: float | None = None,
    abort: bool = True,
    token_ids: Sequence[int] | None = None,
) -> HandOffResult:
    """Hand request ``rid``'s KV from ``source`` to ``dest``; see the module docstring.

    ``timeout`` bounds the wait for the source to stop writing and the import each; ``lease_s``
    is the source-side lease (default: ``2 * timeout + 10``), after which the source frees the
    pin whoever forgot it. With ``abort=False`` the request is expected to end by itself (or
    already ended, then ``token_ids`` = its prompt + output find its KV in the source's tree).
    """
    t0 = time.perf_counter()
    lease = lease_s if lease_s is not None else 2 * timeout + 10.0

    def fallback(reason: str, **kw: Any) -> HandOffResult:
        return HandOffResult(rid=rid, fell_back=True, reason=reason, total_s=time.perf_counter() - t0, **kw)

    try:
        await dest.get("/gyre/kv/pins", timeout=min(timeout, 10.0))
    except EngineUnreachable as e:
        raise DestinationUnreachable(f"KV hand-off of {rid!r}: destination {dest.url} does not answer ({e})") from e
    except EngineError as e:
        raise HandOffError(f"KV hand-off of {rid!r}: destination {dest.url} lacks Gyre's KV routes ({e})") from e

    body: dict[str, Any] = {"rid": rid, "lease_s": lease}
    if token_ids is not None:
        body["token_ids"] = list(token_ids)
    handle: str | None = None
    try:
        ans = await source.post("/gyre/kv/pin", body, timeout=timeout)
        handle = str(ans["handle"])
    except EngineError as e:
        reason = f"source refused the pin: {e}"
    pin_s = time.perf_counter() - t0
    if abort:
        try:
            await source.abort_request(rid)
        except EngineError as e:
            if handle is not None:
                await _release(source, handle)
            return fallback(f"abort on the source failed: {e}", pin_s=pin_s)
    if handle is None:
        return fallback(reason, pin_s=pin_s)

    t1 = time.perf_counter()
    try:
        desc = await source.get(f"/gyre/kv/handle/{handle}?wait_s={timeout}", timeout=timeout + 10.0)
    except EngineError as e:
        await _release(source, handle)
        return fallback(f"source lost the pin: {e}", pin_s=pin_s)
    drain_s = time.perf_counter() - t1
    if desc.get("state") != "ready":
        await _release(source, handle)
        why = desc.get("reason") or f"still {desc.get('state')} after {timeout:.0f} s"
        return fallback(f"source holds no KV for the request: {why}", pin_s=pin_s, drain_s=drain_s)

    t2 = time.perf_counter()
    try:
        imp = await dest.post(
            "/gyre/kv/import",
            {"descriptor": desc, "source_url": source.url, "timeout_s": timeout},
            timeout=timeout + 15.0,
        )
    except EngineUnreachable as e:
        await _release(source, handle)
        raise DestinationUnreachable(
            f"KV hand-off of {rid!r}: destination {dest.url} stopped answering during the import ({e}); "
            "the source pin is released"
        ) from e
    except EngineError as e:
        await _release(source, handle)
        return fallback(f"import on the destination failed: {e}", pin_s=pin_s, drain_s=drain_s,
                        import_s=time.perf_counter() - t2)
    import_s = time.perf_counter() - t2
    acked = bool(imp.get("acked"))
    if not acked:
        await _release(source, handle)
    return HandOffResult(
        rid=rid, fell_back=False, prefix_tokens=int(imp["prefix_tokens"]),
        imported_tokens=int(imp["imported_tokens"]), cached_before=int(imp["cached_before"]),
        bytes=int(imp.get("bytes", 0)), acked=acked, pin_s=pin_s, drain_s=drain_s, import_s=import_s,
        transfer_s=float(imp.get("transfer_s", 0.0)), total_s=time.perf_counter() - t0,
    )


async def continue_on(
    dest: EngineRoutes,
    prompt_ids: Sequence[int],
    partial: GenerateResult,
    sampling_params: Mapping[str, Any],
    *,
    rid: str | None = None,
    return_logprob: bool = True,
) -> GenerateResult:
    """Re-send a request cut short by an abort to ``dest``: ``prompt + partial output`` as input,
    the rest of ``max_new_tokens`` as budget. The answer carries only the *new* tokens; its
    ``cached_tokens`` shows how much of the input the destination did not recompute."""
    params = dict(sampling_params)
    if "max_new_tokens" in params:
        params["max_new_tokens"] = max(int(params["max_new_tokens"]) - len(partial.output_ids), 0)
    return await dest.generate(
        list(prompt_ids) + list(partial.output_ids), params, rid=rid, return_logprob=return_logprob
    )
