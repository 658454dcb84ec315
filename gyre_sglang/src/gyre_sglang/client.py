"""Async client for one SGLang server: one method per upstream endpoint Gyre uses, nothing hidden.

Answers come back typed (:class:`~gyre_core.interfaces.GenerateResult`, :class:`UpdateResult`);
any non-2xx answer becomes an :class:`~gyre_core.interfaces.EngineError` carrying the endpoint and
the server's own message, and a server that does not answer at all raises
:class:`~gyre_core.interfaces.EngineUnreachable` (the caller may retry elsewhere). SGLang answers
some failures with HTTP 200 and ``success: false``: those raise too, so "returned" always means
"took effect".

The endpoint contract is SGLang 0.5.22's and 0.5.23's (see ``SUPPORTED_SGLANG``); ``post``/``get`` reach any
other route, e.g. the ``/gyre/`` routes of Gyre's server plugin.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import aiohttp

from gyre_core.interfaces import EngineClient, EngineError, EngineUnreachable, GenerateResult, KVHandOff

__all__ = ["SUPPORTED_SGLANG", "PauseMode", "SGLangClient", "UpdateResult"]

SUPPORTED_SGLANG = ">=0.5.22,<0.5.24"
"""SGLang versions whose HTTP contract this client (and Gyre's server plugin) is tested against:
0.5.23 by every sglang-marked test, 0.5.22 by the smoke subset (gyre_sglang/scripts/test-sglang-matrix.sh)."""

PauseMode = Literal["abort", "retract", "in_place"]
MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]


@dataclass(frozen=True)
class UpdateResult:
    """The answer of a weight update or weight-group call that succeeded."""

    message: str
    num_paused_requests: int = 0


def _message(body: Any, text: str) -> str:
    if isinstance(body, Mapping):
        for key in ("message", "detail", "error"):
            if key in body:
                v = body[key]
                return v if isinstance(v, str) else json.dumps(v)
    return text.strip()[:2000] or "(empty body)"


def parse_generate(body: Mapping[str, Any]) -> GenerateResult:
    """Turn SGLang's ``/generate`` answer into a :class:`GenerateResult` (strict: no guessing)."""
    try:
        meta = body["meta_info"]
        out_ids = tuple(int(t) for t in body["output_ids"])
        triples = meta.get("output_token_logprobs") or []
        if triples and len(triples) != len(out_ids):
            raise ValueError(f"{len(triples)} log-probs for {len(out_ids)} output tokens")
        for (_, tid, *_rest), oid in zip(triples, out_ids):
            if int(tid) != oid:
                raise ValueError(f"log-prob token {tid} does not match output token {oid}")
        logprobs = tuple(float(t[0]) for t in triples) if triples else tuple(float("nan") for _ in out_ids)
        fr = meta.get("finish_reason") or {}
        finish = fr.get("type", "stop") if isinstance(fr, Mapping) else str(fr)
        matched = fr.get("matched") if isinstance(fr, Mapping) else None
        return GenerateResult(
            rid=str(meta.get("id", "")),
            output_ids=out_ids,
            logprobs=logprobs,
            finish_reason=str(finish),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=str(meta.get("weight_version", "")),
            matched_stop=matched,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError("/generate", 200, f"malformed answer: {e}") from e


class SGLangClient:
    """One SGLang server at ``url``. Use as ``async with SGLangClient(url) as c:`` or call
    :meth:`close`. ``timeout`` bounds every call except :meth:`generate`, whose own bound is
    ``generate_timeout`` (a long decode is not a failure)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 120.0,
        generate_timeout: float | None = 3600.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.generate_timeout = generate_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def auth_headers(self) -> dict[str, str]:
        """The engine key's header, for callers that speak to the server with their own client."""
        return dict(self._headers)

    # -- plumbing -------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        t = aiohttp.ClientTimeout(total=self.timeout if timeout is None else timeout)
        try:
            async with self._http().request(method, self.url + path, json=body, timeout=t) as r:
                text = await r.text()
                malformed = object()
                try:
                    parsed = json.loads(text) if text else None
                except json.JSONDecodeError:
                    parsed = malformed
                if r.status >= 400:
                    raise EngineError(path, r.status, _message(None if parsed is malformed else parsed, text))
                if parsed is malformed:
                    if r.content_type == "application/json":
                        raise EngineError(path, r.status, f"malformed JSON answer: {text[:200]!r}")
                    return text
                return parsed
        except EngineError:
            raise
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            raise EngineUnreachable(path, None, f"{self.url} did not answer: {type(e).__name__}: {e}") from e

    async def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """POST JSON ``body`` to any route; the parsed JSON answer (``None`` for an empty one)."""
        return await self._request("POST", path, {} if body is None else body, timeout)

    async def get(self, path: str, *, timeout: float | None = None) -> Any:
        return await self._request("GET", path, None, timeout)

    async def _update(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> UpdateResult:
        ans = await self.post(path, dict(body), timeout=timeout)
        if not isinstance(ans, Mapping) or not ans.get("success", False):
            raise EngineError(path, 200, _message(ans, str(ans)))
        return UpdateResult(str(ans.get("message", "")), int(ans.get("num_paused_requests", 0) or 0))

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        """``POST /generate`` with token ids (the chat template is the proxy's business).

        An aborted request returns normally with ``finish_reason == "abort"`` and its partial
        output; only transport and engine errors raise.
        """
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
        }
        if return_logprob:
            body["logprob_start_len"] = -1
        if rid is not None:
            body["rid"] = rid
        ans = await self.post("/generate", body, timeout=self.generate_timeout)
        if not isinstance(ans, Mapping):
            raise EngineError("/generate", 200, f"malformed answer: {ans!r:.200}")
        return parse_generate(ans)

    async def abort_request(self, rid: str) -> None:
        """``POST /abort_request``. SGLang ignores unknown rids; so does this (it is idempotent)."""
        await self.post("/abort_request", {"rid": rid})

    async def abort_known(self, rid: str) -> None:
        """Gyre's ``POST /gyre/abort``: like :meth:`abort_request`, but an rid the engine does not
        know raises :class:`EngineError` (404) instead of passing silently."""
        await self.post("/gyre/abort", {"rid": rid})

    async def abort_all(self) -> None:
        await self.post("/abort_request", {"abort_all": True})

    async def hand_off_kv(self, rid: str, dest: EngineClient, *, timeout: float = 30.0) -> KVHandOff:
        """Gyre's KV hand-off of running call ``rid`` to ``dest`` (see :mod:`gyre_sglang.kv_handoff`).

        Only between engines serving the same weight version: KV computed by another policy is
        not the destination's KV. A refusal or failure is ``moved=False`` with the reason; the
        call is then aborted by the caller's drain and continued with a re-prefill.
        """
        from gyre_sglang.kv_handoff import HandOffError, hand_off

        if not isinstance(dest, SGLangClient):
            return KVHandOff(rid, False, f"destination {dest.url} is not an SGLang engine")
        try:
            mine, theirs = await asyncio.gather(self.weight_version(), dest.weight_version())
        except EngineError as e:
            return KVHandOff(rid, False, f"weight version unknown: {e}")
        if mine != theirs:
            return KVHandOff(rid, False, f"weight versions differ ({mine!r} here, {theirs!r} at {dest.url})")
        try:
            res = await hand_off(self, dest, rid, timeout=timeout)
        except HandOffError as e:
            return KVHandOff(rid, False, str(e))
        return KVHandOff(rid, not res.fell_back, res.reason, res.prefix_tokens, res.bytes, res.total_s)

    # -- serving state --------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self.post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.post("/continue_generation", {})

    async def flush_cache(self) -> None:
        """``POST /flush_cache``; SGLang refuses (non-2xx) while requests are running."""
        await self.post("/flush_cache", {})

    async def release_memory_occupation(self, tags: Sequence[MemoryTag] | None = None) -> None:
        await self.post("/release_memory_occupation", {"tags": list(tags) if tags else None})

    async def resume_memory_occupation(self, tags: Sequence[MemoryTag] | None = None) -> None:
        await self.post("/resume_memory_occupation", {"tags": list(tags) if tags else None})

    # -- weights --------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> UpdateResult:
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._update("/update_weights_from_disk", body, timeout)

    async def begin_weight_update(self, selector: Literal["target", "draft", "all"] = "all") -> UpdateResult:
        return await self._update("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> UpdateResult:
        return await self._update("/end_weight_update", {})

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> UpdateResult:
        return await self._update("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> UpdateResult:
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes),
                                "shapes": [list(s) for s in shapes], "group_name": group_name,
                                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._update("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> UpdateResult:
        return await self._update("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> str:
        ans = await self.post("/update_weight_version",
                              {"new_version": new_version, "abort_all_requests": abort_all_requests})
        if not isinstance(ans, Mapping) or not ans.get("success", False):
            raise EngineError("/update_weight_version", 200, _message(ans, str(ans)))
        return str(ans.get("new_version", new_version))

    # -- introspection --------------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        ans = await self.get("/model_info")
        if not isinstance(ans, dict):
            raise EngineError("/model_info", 200, f"malformed answer: {ans!r:.200}")
        return ans

    async def weight_version(self) -> str:
        """The policy version the engine serves (``weight_version`` of ``/model_info``)."""
        return str((await self.model_info()).get("weight_version", ""))

    async def server_info(self) -> dict[str, Any]:
        ans = await self.get("/server_info")
        if not isinstance(ans, dict):
            raise EngineError("/server_info", 200, f"malformed answer: {ans!r:.200}")
        return ans

    async def health(self, timeout: float = 10.0) -> bool:
        """``GET /health_generate``: True when the engine answers *and* can generate."""
        try:
            await self.get("/health_generate", timeout=timeout)
            return True
        except EngineError:
            return False
