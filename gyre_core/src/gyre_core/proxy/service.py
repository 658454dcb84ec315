"""The API-neutral proxy core: executions, credentials, rendering, engine calls, recording.

Interface for the HTTP faces (``openai_api``, ``anthropic_api``) and the orchestrator
-------------------------------------------------------------------------------------
::

    service = ProxyService(renderer, config)            # renderer: ChatRenderer(tokenizer)
    service.add_engine(client, kind="standalone"|"cell", cell_index=None, capacity=inf)

    # orchestrator (also over HTTP under /gyre/, admin token)
    eid, key = service.create_execution(execution_id=None, sampling=None, metadata=None)
    service.close_execution(eid)                         # key revoked; records stay readable
    service.records(eid) -> ExecutionRecords            # .tree, .calls, .tree_json()
    service.selected(eid, j_max, seed) -> list[SelectedTrajectory]
    service.reroute(engine_url, destinations=None) -> RerouteResult
    service.restore_engine(engine_url)
    service.inflight(engine_url) -> list[str]            # engine request ids in flight there
    await service.hand_off(engine_url) -> list[KVHandOff] # after reroute: running calls' KV to their new engine
    service.handoffs.summary() -> dict                   # interrupted calls: handed off, re-prefilled, saved
    service.incremental_stats() -> dict                  # tail renders vs full-render fallbacks

    # a face, per HTTP request
    execution_id: str = service.authenticate(api_key)    # ProxyError(401) for an unknown/closed key
    response: ChatResponse = await service.complete(ChatRequest(execution_id=..., ...))
    # or, when streaming (so a 4xx still gets its HTTP status before the stream starts):
    prepared = await service.prepare_async(request)      # worker thread; ProxyError 4xx, nothing recorded
    response = await service.execute(prepared)

    # the HTTP app (``app.build_app``) mounts faces: callables ``face(app, service)`` that add
    # routes and register their error renderer for their path prefix; everything on the wire
    # (limits, credentials, JSON checks, error shapes, SSE) is ``http_layer``'s.

``complete`` raises :class:`ProxyError` for anything the caller did wrong (4xx, nothing recorded)
and for engine failures it could not hide (5xx, nothing recorded). A face renders ``ProxyError``
in its own API's error shape.

Streaming: the engine call is not streamed token by token. A face that was asked to stream calls
``prepare``, sends its stream's opening event, awaits ``execute``, then emits the answer as its API's events. The
record must be complete and exact before the harness sees any of it; that is also what lets an
engine abort during a role change be retried invisibly (see below).

Decisions
---------
* Sampling parameters come from Gyre's configuration (global, optionally per execution), never
  from the harness; the harness's ``max_tokens`` may only lower the cap.
* An execution is pinned to one engine. When a role change takes the engine out of rollout, the
  orchestrator reroutes the execution and calls :meth:`ProxyService.hand_off`: the engine hands
  the running call's KV cache to the execution's new engine and aborts it there, and the call is
  *continued* on the new engine from prompt + partial output, prefilling only what the KV did not
  cover (re-prefilling everything when the hand-off could not be done; the reason is counted in
  :attr:`ProxyService.handoffs`). The record holds the joined generation -- every log-prob a
  behaviour log-prob of the one weight version both engines served. A call whose sampling depends
  on the output so far (a grammar constraint, a repetition/frequency/presence penalty), or whose
  continuation came from another weight version, or whose engine vanished mid-call
  (:class:`EngineUnreachable`), is generated again from its prompt instead: never spliced.
* Output generated under a constraint (``regex``, ``json_schema``, ``ebnf``, ``structural_tag`` in
  the sampling config) is recorded with provenance ``EXTERNAL``: its log-probs are those of the
  masked distribution, not behaviour log-probs, so those tokens are never training targets. The
  engine's log-probs stay in the call record. The same holds for per-execution sampling that
  truncates or reshapes the distribution (``top_p`` < 1, ``top_k``, ``min_p``, penalties, greedy):
  see :func:`samples_the_policy`. Each node records its call's temperature; the trainer takes its
  log-probs at that temperature.
* A call the client abandons (disconnect) is aborted at the engine and not recorded.
* Per-call proxy work stays proportional to the new content, not the context: the request is
  matched against the execution's tree message by message (``ContextIndex.match_messages``, a
  dict lookup per message), and only the messages after the matched node are rendered
  (``ChatRenderer.render_tail``). When the template cannot be tail-rendered exactly (probed once,
  checked at the boundary every call), the call falls back to the full render and the text walk
  (``ContextIndex.match``), and is counted (:meth:`ProxyService.incremental_stats`). The first
  ``verify_tail_renders`` tail-rendered calls are also checked against the full render; a
  difference disables tail rendering for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from gyre_core.interfaces import (
    EngineClient,
    EngineError,
    EngineUnreachable,
    GenerateResult,
    KVHandOff,
    KVHandOffEngine,
    RoleClass,
)
from gyre_core.proxy.call_stats import CallStats, LimitEvents
from gyre_core.proxy.classify import ON_MAIN_PATH_KEY, classify_metadata, on_main_path, request_role_metadata
from gyre_core.proxy.context_index import Match, answer_tail
from gyre_core.proxy.interruptions import HandOffs, join, may_continue, remaining_params, settle
from gyre_core.proxy.parse import parse_output
from gyre_core.proxy.records import CallRecord, ExecutionRecords
from gyre_core.proxy.render import ChatRenderer, ContextTooLong, tools_key
from gyre_core.proxy.routing import EngineRouter, NoEngineAvailable, RerouteResult
from gyre_core.proxy.types import ChatMessage, ChatRequest, ChatResponse, ProxyError, Usage, recordable_headers
from gyre_core.proxy.validate import validate_messages, validate_tools
from gyre_core.selection import select_trajectories
from gyre_core.trajectory import Provenance, SelectedTrajectory

__all__ = ["CONSTRAINT_KEYS", "ExecutionLeaf", "PreparedCall", "ProxyConfig", "ProxyService"]

CONSTRAINT_KEYS = ("regex", "json_schema", "ebnf", "structural_tag")
"""Sampling parameters that force tokens: output generated under them is never a target."""

AGENT_ID_HEADERS = ("x-gyre-agent-id", "x-claude-code-agent-id", "x-agent-id")
PARENT_AGENT_HEADERS = ("x-gyre-parent-agent-id", "x-claude-code-parent-agent-id")


@dataclass(frozen=True)
class ProxyConfig:
    """Gyre's side of every model call (the harness does not get to choose these)."""

    served_models: tuple[str, ...] = ("gyre",)
    """Model names the harnesses may ask for; anything else is a 404."""
    sampling: Mapping[str, Any] = field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0})
    """SGLang ``sampling_params`` for every call (``max_new_tokens`` is set per call)."""
    max_new_tokens: int = 4096
    context_window: int | None = None
    """Prompt + answer limit; default: the tokenizer's ``model_max_length``."""
    max_retries: int = 8
    retry_wait_s: float = 10.0
    """How long a retry waits for the orchestrator to reroute an execution off an engine that
    aborted or vanished before failing over on its own."""
    engine_wait_s: float = 300.0
    """How long a call waits for a registered rollout engine to accept again when none does (an
    engine being restarted by the orchestrator's watchdog while the others train) before it
    fails with 503. With no engine registered at all the 503 is immediate."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body (413 beyond, checked from ``Content-Length`` before it is read)."""
    max_connections: int = 4096
    """Open connections, all executions together (fitted under the descriptor limit at start);
    at the cap the oldest connection that has sent nothing is closed to make room."""
    max_connections_per_execution: int = 64
    """Connections one execution's requests may hold open (429 and a closed connection beyond)."""
    max_calls_per_execution: int = 32
    """Requests of one execution in flight at once (429 beyond): a harness with parallel subagents
    stays far below it, a flood of calls does not pass it."""
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    """Request body bytes of one execution in flight at once (429 beyond): what one execution's
    bodies can hold of the orchestrator's memory (plus their decoded copies) at any moment."""
    header_timeout_s: float = 10.0
    """From a connection's start (or its previous answer) to a complete request head; past it
    the connection is closed (idle sockets, slowloris heads)."""
    body_idle_timeout_s: float = 30.0
    """Longest pause between two chunks of a request body (408 beyond)."""
    prepare_workers: int = 4
    """Threads that render and tokenise requests; each execution has at most one call among them
    (queued or running), so one execution's huge requests occupy at most one of them."""
    continue_interrupted: bool = True
    """Continue a call its engine aborted (a role change) from its partial output on the
    execution's new engine, instead of generating it again from the prompt (see
    :mod:`gyre_core.proxy.interruptions` for when a call may not be continued)."""
    kv_handoff: bool = True
    """Hand the running calls' KV cache to their destination on a role change, so the
    continuation does not prefill the context again (engines that offer it)."""
    handoff_timeout_s: float = 30.0
    """Bound on each stage of one KV hand-off (source drain, destination import)."""


@dataclass
class _Execution:
    records: ExecutionRecords
    key_hash: str
    sampling: Mapping[str, Any]
    metadata: Mapping[str, Any]
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a call of this execution is prepared (worker thread) or recorded (event loop)."""
    errors: list[dict[str, Any]] = field(default_factory=list)
    """Every infrastructure error (5xx) this execution was answered with: Gyre's failures, not
    the policy's, so its outcome cannot be taken as the task's verdict (see
    :meth:`ProxyService.infrastructure_errors`)."""


@dataclass(frozen=True)
class PreparedCall:
    """A call checked, rendered and encoded, ready for the engine (see :meth:`ProxyService.prepare`)."""

    request: ChatRequest
    execution_id: int
    messages: tuple[ChatMessage, ...]
    """The request's messages with tool-call payloads restored."""
    prompt: str
    """The rendered prompt text after the matched node's canonical text (what is encoded, after
    ``match.tail``); the full prompt is never built on the fast path."""
    match: Match
    new_ids: list[int]
    """Tokens encoded for this call (the rest of ``input_ids`` was reused from the tree)."""
    input_ids: list[int]
    params: dict[str, Any]
    constrained: bool
    started: float
    call_id: str
    """Id of the record this call will make (known before the engine runs, for stream ids)."""
    tools_key: str = ""
    incremental: bool = False
    """``prompt`` was rendered as a tail after ``match.matched_messages`` messages."""
    full_prompt: str | None = None
    """The full render, when this call made one (the fallback)."""


@dataclass(frozen=True)
class ExecutionLeaf:
    """A tree leaf as the ``gyre_classify_role`` hook sees it (``TrajectoryLeaf``)."""

    execution_id: int
    metadata: Mapping[str, Any]


MAX_EXECUTION_ID = 2**31
"""Execution ids are bounded: automatic ids count up from the largest, and trajectory response ids
pack the execution into 31 bits."""

SAMPLING_RULES: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 100.0), "top_p": (float, 0.0, 1.0), "top_k": (int, -1, 1 << 20),
    "min_p": (float, 0.0, 1.0), "max_new_tokens": (int, 1, 1 << 20),
    "repetition_penalty": (float, 0.0, 100.0), "frequency_penalty": (float, -2.0, 2.0),
    "presence_penalty": (float, -2.0, 2.0),
}
"""Per-execution sampling the proxy accepts at creation: type and inclusive range (the run
config's ``[sampling]`` follows the same rules; ``top_p`` must moreover be > 0)."""


_NEUTRAL: dict[str, float] = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                               "frequency_penalty": 0.0, "presence_penalty": 0.0}
"""Sampling settings that leave the tempered distribution ``softmax(logits / T)`` as it is."""


def samples_the_policy(params: Mapping[str, Any]) -> bool:
    """Whether a call with these settings samples from ``softmax(logits / T)`` itself, the
    distribution the trainer can take the same log-probs of. Truncation (``top_p``, ``top_k``,
    ``min_p``), penalties and greedy decoding (temperature 0) reshape it, and SGLang reports the
    log-probs before they act: such output is recorded as ``EXTERNAL`` (context, never a target),
    as constrained output is."""
    if float(params.get("temperature", 1.0)) <= 0:
        return False
    return all(params.get(k, v) in (None, v) or (k == "top_k" and params.get(k) == 0) for k, v in _NEUTRAL.items())


def validate_sampling(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """``sampling`` checked key by key (:data:`SAMPLING_RULES`), or a 400 naming the bad key."""
    out: dict[str, Any] = {}
    for k, v in sampling.items():
        if k in CONSTRAINT_KEYS:  # grammar constraints, passed to the engine (their output is never a target)
            if not isinstance(v, str) or len(v) > 1 << 20:
                raise ProxyError(400, "invalid_request", f"sampling.{k}: must be a string (at most 1 MiB)")
            out[k] = v
            continue
        rule = SAMPLING_RULES.get(k)
        if rule is None:
            raise ProxyError(400, "invalid_request", f"sampling.{k}: unknown (expected one of "
                                                     f"{', '.join([*SAMPLING_RULES, *CONSTRAINT_KEYS])})")
        kind, lo, hi = rule
        ok_type = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        if not ok_type or not math.isfinite(v) or not lo <= v <= hi or (k == "top_p" and v <= 0):
            raise ProxyError(400, "invalid_request", f"sampling.{k}: must be a {kind.__name__} in [{lo}, {hi}]")
        out[k] = kind(v)
    return out


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for n in names:
        v = headers.get(n)
        if v:
            return v
    return None


def default_role(leaf: ExecutionLeaf) -> RoleClass:
    """Fallback when no plugin classifies a leaf: Claude Code's marks (``classify``)."""
    return classify_metadata(leaf.metadata)


class ProxyService:
    """The TITO proxy's core. Lives on one asyncio event loop.

    The one exception is :meth:`prepare` (rendering and tokenising, O(context)), which
    :meth:`prepare_async` runs in a pool of ``prepare_workers`` threads so a large request never
    stalls the loop; an execution's records are only read there under that execution's lock, which
    the loop also holds while it records the execution's calls. The tokenizer releases the GIL
    while it encodes, so executions are prepared in parallel.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        config: ProxyConfig | None = None,
        *,
        classify: Callable[[ExecutionLeaf], RoleClass | None] | None = None,
    ) -> None:
        self.renderer = renderer
        self.config = config or ProxyConfig()
        self.router = EngineRouter()
        self.policy_version: int | None = None
        self._classify = classify
        self._executions: dict[int, _Execution] = {}
        self._by_key: dict[str, int] = {}
        self._inflight: dict[str, dict[str, int]] = {}  # engine url -> rid -> execution id
        window = self.config.context_window or renderer.context_window
        self.context_window: int | None = window
        self.verify_tail_renders = 8
        """Tail-rendered calls still to be checked against the full render (O(context) each)."""
        self._stats = {"tail_renders": 0, "root_renders": 0, "full_render_fallbacks": 0,
                       "verified": 0, "verify_mismatches": 0, "verify_other_node": 0,
                       "continuation_fallbacks": 0}
        self._prepare_pool = ThreadPoolExecutor(max_workers=max(1, self.config.prepare_workers),
                                                thread_name_prefix="gyre-prepare")
        self._prepare_turns: dict[str, list[Any]] = {}
        """Per execution: ``[lock, callers]``, so one execution has one call in the pool's queue."""
        self._stats_lock = threading.Lock()
        self.wire_events = LimitEvents()
        """Refusals by the HTTP layer's limits, per execution (see :meth:`limit_events`)."""
        self.handoffs = HandOffs()
        self.call_stats = CallStats()  # engine throughput and proxy latency, drained per step
        """Interrupted calls: KV hand-offs, continuations, re-prefills (the run summary's figures)."""

    # -- engines ---------------------------------------------------------------------------------

    def add_engine(self, client: EngineClient, **kwargs: Any) -> None:
        self.router.add_engine(client, **kwargs)

    def reroute(self, engine_url: str, destinations: list[str] | None = None) -> RerouteResult:
        """An engine leaves rollout: pin its executions elsewhere (in-flight calls retry there)."""
        return self.router.reroute(engine_url, destinations)

    def restore_engine(self, engine_url: str) -> None:
        self.router.restore(engine_url)

    def _count(self, name: str) -> None:
        with self._stats_lock:  # prepare runs in several threads
            self._stats[name] += 1

    def inflight(self, engine_url: str) -> list[str]:
        return sorted(self._inflight.get(engine_url, {}))

    def incremental_stats(self) -> dict[str, Any]:
        """How calls were rendered: ``tail_renders`` (only the new messages), ``root_renders``
        (nothing matched: everything is new), ``full_render_fallbacks`` (the whole conversation
        rendered and walked as text because a tail could not be rendered exactly), plus the
        verification counters and whether the template supports tail rendering at all."""
        return {**self._stats, "alias_edges": sum(e.records.index.aliases for e in self._executions.values()),
                "tail_rendering": self.renderer.supports_tail_rendering(),
                "tail_unsupported_reason": self.renderer.tail_unsupported_reason}

    # -- executions ------------------------------------------------------------------------------

    def create_execution(
        self,
        execution_id: int | None = None,
        *,
        sampling: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> tuple[int, str]:
        """Register an execution; returns its id and a fresh API key (shown once, stored hashed)."""
        if execution_id is None:
            execution_id = max(self._executions, default=-1) + 1
        if isinstance(execution_id, bool) or not isinstance(execution_id, int) or not 0 <= execution_id < MAX_EXECUTION_ID:
            raise ProxyError(400, "invalid_request", f"execution_id must be an integer in [0, {MAX_EXECUTION_ID})")
        sampling = validate_sampling(sampling or {})
        if execution_id in self._executions:
            raise ProxyError(409, "conflict", f"execution {execution_id} exists")
        key = "gyre-" + secrets.token_urlsafe(32)
        h = _key_hash(key)
        self._executions[execution_id] = _Execution(
            ExecutionRecords(execution_id), h, dict(sampling or {}), dict(metadata or {})
        )
        self._by_key[h] = execution_id
        return execution_id, key

    def close_execution(self, execution_id: int) -> None:
        """Revoke the key and unpin the engine; the records stay readable until :meth:`forget`."""
        ex = self._get(execution_id)
        ex.closed = True
        self._by_key.pop(ex.key_hash, None)
        self.router.release(execution_id)

    def infrastructure_errors(self, execution_id: int) -> list[dict[str, Any]]:
        """The 5xx answers the execution got (no engine available, interrupted too often, an
        engine refusing the call), oldest first. A harness that finishes after one of them may
        still report a result, but that result is not the task's verdict on the policy."""
        return list(self._get(execution_id).errors)

    def forget(self, execution_id: int) -> None:
        self.close_execution(execution_id)
        del self._executions[execution_id]
        self.wire_events.forget(execution_id)

    def limit_events(self, execution_id: int) -> dict[str, int]:
        """How often the execution was refused by a wire limit, by kind (``body_too_large``,
        ``connections``, ``calls_in_flight``, ``body_bytes_in_flight``, ``body_timeout``). Each was
        answered with a 4xx the harness can act on; none fails the run."""
        return self.wire_events.of(execution_id)

    def limit_summary(self) -> dict[str, Any]:
        """Every refusal by kind, the connection-level events (evicted, refused, timed-out
        heads) and the executions concerned."""
        return self.wire_events.summary()

    def execution_ids(self) -> list[int]:
        return sorted(self._executions)

    def is_closed(self, execution_id: int) -> bool:
        return self._get(execution_id).closed

    def _get(self, execution_id: int) -> _Execution:
        try:
            return self._executions[execution_id]
        except KeyError:
            raise ProxyError(404, "not_found", f"no execution {execution_id}") from None

    def execution_of_key(self, api_key: str) -> int | None:
        """The open execution an API key belongs to, or None (the wire limits' lookup)."""
        return self._by_key.get(_key_hash(api_key))

    def authenticate(self, api_key: str | None) -> str:
        """The execution id (as ``ChatRequest.execution_id``) an API key belongs to; else 401."""
        eid = self._by_key.get(_key_hash(api_key)) if api_key else None
        if eid is None:
            raise ProxyError(401, "authentication", "invalid API key")
        return str(eid)

    def records(self, execution_id: int) -> ExecutionRecords:
        return self._get(execution_id).records

    def policy_versions(self, execution_id: int) -> list[int]:
        """The policy versions the execution's calls were served under: more than one when a
        publication landed while it ran (engines load each new version as it is published)."""
        return sorted({c.policy_version for c in self.records(execution_id).calls if c.policy_version is not None})

    def selected(self, execution_id: int, j_max: int, seed: int) -> list[SelectedTrajectory]:
        """Selection over the execution's tree, classes from the classify hook (fallback: headers)."""
        rec = self.records(execution_id)
        roles = {leaf: self.role_of(execution_id, leaf) for leaf in rec.tree.leaves()}
        return select_trajectories(rec.tree, roles, j_max, seed)

    def role_of(self, execution_id: int, leaf_id: int) -> RoleClass:
        rec = self.records(execution_id)
        leaf = ExecutionLeaf(execution_id, {**rec.tree.node(leaf_id).metadata,
                                            ON_MAIN_PATH_KEY: on_main_path(rec.tree, leaf_id)})
        role = self._classify(leaf) if self._classify is not None else None
        return RoleClass(role) if role is not None else default_role(leaf)

    # -- one model call --------------------------------------------------------------------------

    def _check(self, request: ChatRequest) -> tuple[_Execution, int]:
        try:
            eid = int(request.execution_id)
        except (TypeError, ValueError):
            raise ProxyError(401, "authentication", "unknown execution") from None
        ex = self._executions.get(eid)
        if ex is None or ex.closed:
            raise ProxyError(401, "authentication", "unknown or closed execution")
        if request.model not in self.config.served_models:
            raise ProxyError(404, "not_found", f"model {request.model!r} is not served here")
        if request.max_tokens is not None and (
            isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1
        ):
            raise ProxyError(400, "invalid_request", "max_tokens must be a positive integer")
        validate_tools(request.tools)
        validate_messages(request.messages)
        return ex, eid

    def _sampling(self, ex: _Execution, request: ChatRequest, prompt_len: int) -> dict[str, Any]:
        params = {**self.config.sampling, **ex.sampling}
        cap = min(int(params.pop("max_new_tokens", self.config.max_new_tokens)), self.config.max_new_tokens)
        if request.max_tokens is not None:
            cap = min(cap, request.max_tokens)
        if self.context_window is not None:
            room = self.context_window - prompt_len
            if room < 1:
                raise ProxyError(
                    400, "invalid_request",
                    f"context_length_exceeded: the prompt has {prompt_len} tokens, the window is {self.context_window}",
                )
            cap = min(cap, room)
        params["max_new_tokens"] = cap
        return params

    async def complete(self, request: ChatRequest) -> ChatResponse:
        """Serve one model call and record it (see the module docstring)."""
        return await self.execute(await self.prepare_async(request))

    async def prepare_async(self, request: ChatRequest) -> "PreparedCall":
        """:meth:`prepare` in the proxy's worker thread, off the event loop.

        Fair between executions: each has at most one call waiting for (or in) the worker, so an
        execution that sends many large requests at once queues behind itself, and every other
        execution's call waits for at most one preparation per execution ahead of it."""
        key = request.execution_id
        turn = self._prepare_turns.get(key)
        if turn is None:
            turn = self._prepare_turns[key] = [asyncio.Lock(), 0]
        turn[1] += 1
        try:
            async with turn[0]:
                return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self.prepare, request)
        finally:
            turn[1] -= 1
            if turn[1] == 0:
                self._prepare_turns.pop(key, None)

    def prepare(self, request: ChatRequest) -> "PreparedCall":
        """Everything before the engine call: checks, payload restoration, rendering, matching,
        incremental encoding, sampling. Raises :class:`ProxyError` (4xx) with nothing recorded;
        a streaming face calls it before it sends its response headers."""
        started = time.time()
        ex, eid = self._check(request)
        with ex.lock:
            rec = ex.records
            messages = rec.payloads.restore(request.messages)
            tkey = tools_key(request.tools)
            match, rest, incremental, full = self._match_and_render(rec, messages, request.tools, tkey)
            reused = rec.path_ids(match.node_id)
            # the window is checked before the new text is encoded whole (``encode_within``): a
            # prompt far past it costs a division or a few pieces' encoding, not its whole encoding
            room = None if self.context_window is None else self.context_window - 1 - len(reused)
            try:
                new_ids = self.renderer.encode_within(match.tail + rest, room)
            except ContextTooLong as exc:
                raise ProxyError(
                    400, "invalid_request",
                    f"context_length_exceeded: the prompt has at least {len(reused) + exc.at_least} tokens, "
                    f"the window is {self.context_window}",
                ) from None
            input_ids = reused + new_ids
        params = self._sampling(ex, request, len(input_ids))
        constrained = any(params.get(k) is not None for k in CONSTRAINT_KEYS)
        return PreparedCall(
            request, eid, messages, rest, match, new_ids, input_ids, params, constrained, started,
            "gyre-" + secrets.token_hex(8), tkey, incremental, full,
        )

    def _match_and_render(
        self, rec: ExecutionRecords, messages: tuple[ChatMessage, ...], tools: Any, tkey: str
    ) -> tuple[Match, str, bool, str | None]:
        """The matched node and the prompt text after it: (match, rest, incremental, full prompt)."""
        r = self.renderer
        if r.supports_tail_rendering():
            def equivalent(msgs: Any, i: int, stored: Any) -> bool:
                head = tuple(msgs[:i])
                mine = r.render_tail(head + (msgs[i],), i, tools, add_generation_prompt=False, tkey=tkey)
                return mine is not None and mine == r.render_tail(
                    head + (stored,), i, tools, add_generation_prompt=False, tkey=tkey)

            match = rec.index.match_messages(tkey, messages, equivalent)
            if match.node_id is None:
                self._count("root_renders")
                prompt = r.render(messages, tools, add_generation_prompt=True)
                return match, prompt, True, prompt
            rest = r.render_tail(messages, match.matched_messages, tools, add_generation_prompt=True,
                                 boundary=rec.index.segment(match.node_id), tkey=tkey)
            if rest is not None and self.verify_tail_renders <= 0:
                self._count("tail_renders")
                return match, rest, True, None
            if rest is not None:
                with self._stats_lock:
                    self.verify_tail_renders -= 1
                self._count("verified")
                full = r.render(messages, tools, add_generation_prompt=True)
                if full == rec.index.path_text(match.node_id) + rest:
                    if rec.index.match(full).node_id != match.node_id:
                        self._count("verify_other_node")
                    self._count("tail_renders")
                    return match, rest, True, full
                self._count("verify_mismatches")
                r.disable_tail_rendering("a tail render differed from the full render (checked at run time)")
        self._count("full_render_fallbacks")
        prompt = r.render(messages, tools, add_generation_prompt=True)
        match = rec.index.match(prompt)
        return match, prompt[match.matched_chars:], False, prompt

    async def execute(self, call: "PreparedCall") -> ChatResponse:
        """The engine call (with invisible retries), parsing, and recording of a prepared call."""
        request, eid, messages, match = call.request, call.execution_id, call.messages, call.match
        new_ids, input_ids, params, constrained, started = (
            call.new_ids, call.input_ids, call.params, call.constrained, call.started
        )
        ex = self._executions.get(eid)
        if ex is None or ex.closed:
            raise ProxyError(401, "authentication", "unknown or closed execution")
        rec = ex.records
        try:
            result, engine_url, attempts, engine_s, engines = await self._generate(eid, input_ids, params)
        except ProxyError as err:
            if err.status >= 500:  # recorded with the execution: Gyre failed it, not its policy
                ex.errors.append({"status": err.status, "kind": err.kind, "message": err.message[:300],
                                  "at": round(time.time(), 3), "call_id": call.call_id})
            raise
        if ex.closed:
            raise ProxyError(401, "authentication", "execution closed while the call ran")

        prefix = "toolu_" if request.api == "anthropic" else "call_"
        sampled_text = self.renderer.decode(result.output_ids)
        parsed = parse_output(sampled_text, eos_text=self.renderer.eos_text, call_id_prefix=prefix)
        answer = ChatMessage("assistant", parsed.content, parsed.reasoning, parsed.tool_calls)
        with ex.lock:
            segment, tail = self._continuation(call, answer, sampled_text)
        logprobs_ok = all(math.isfinite(x) for x in result.logprobs)
        trainable = not constrained and logprobs_ok and samples_the_policy(params)
        finish = result.finish_reason
        finish_reason = "length" if finish == "length" else ("tool_calls" if parsed.tool_calls else "stop")
        call_id = call.call_id
        headers = recordable_headers(request.headers)  # an allowlist: no credential is ever recorded
        agent_id = _first_header(request.headers, AGENT_ID_HEADERS)
        node_meta = {
            "call_id": call_id,
            "api": request.api,
            "agent_id": agent_id,
            "parent_agent_id": _first_header(request.headers, PARENT_AGENT_HEADERS),
            "headers": headers,
            "engine": engine_url,
            "engines": engines,
            "weight_version": result.weight_version,
            "policy_version": self.policy_version,
            "constrained": constrained,
            "finish_reason": finish_reason,
            "system_head": next((m.content[:2000] for m in request.messages if m.role == "system"), ""),
            "last_user_text": next((m.content[-4000:] for m in reversed(request.messages) if m.role == "user"), ""),
            "summary_request": bool(request_role_metadata(request).get("summary_request")),
        }
        finished = time.time()
        self.call_stats.record(output_tokens=len(result.output_ids), call_s=max(0.0, finished - started),
                               engine_s=engine_s)

        def make_record(node_id: int) -> CallRecord:
            return CallRecord(
                call_id=call_id, execution_id=eid, node_id=node_id, parent_id=match.node_id,
                input_len=len(input_ids), new_input_ids=tuple(new_ids), output_ids=result.output_ids,
                logprobs=result.logprobs,
                output_provenance=Provenance.SAMPLED if trainable else Provenance.EXTERNAL,
                finish_reason=finish_reason, engine=engine_url, weight_version=result.weight_version,
                policy_version=self.policy_version, agent_id=agent_id, api=request.api, model=request.model,
                constrained=constrained, attempts=attempts, started_at=started, finished_at=finished,
                engine_s=engine_s,
                metadata={"reused_tokens": len(input_ids) - len(new_ids), "cached_tokens": result.cached_tokens,
                          "logprobs_missing": not logprobs_ok},
            )

        with ex.lock:
            rec.add_call(
                parent=match.node_id, new_input_ids=new_ids, output_ids=result.output_ids, logprobs=result.logprobs,
                output_provenance=Provenance.SAMPLED if trainable else Provenance.EXTERNAL,
                segment=segment, tail=tail, node_metadata=node_meta, make_record=make_record,
                messages=messages + (answer,), tools_key=call.tools_key, match=match,
                temperature=float(params.get("temperature", 1.0)) or 1.0,
            )
            for c in parsed.tool_calls:
                rec.payloads.put(c)
        return ChatResponse(
            call_id=call_id, model=request.model, content=parsed.content, reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls, finish_reason=finish_reason,  # type: ignore[arg-type]
            usage=Usage(len(input_ids), len(result.output_ids), result.cached_tokens),
        )

    def _continuation(self, call: PreparedCall, answer: ChatMessage, sampled_text: str) -> tuple[str | None, str]:
        """The new node's canonical segment and tail (see ``context_index``): the template's text
        for the request's messages plus the answer, after the matched node's canonical text."""
        r, rest, match, tools = self.renderer, call.prompt, call.match, call.request.tools
        convo = call.messages + (answer,)
        if call.incremental:
            k = match.matched_messages if match.node_id is not None else 0
            boundary = self._executions[call.execution_id].records.index.segment(match.node_id) if k else None
            canon_rest = r.render_tail(convo, k, tools, add_generation_prompt=False, boundary=boundary,
                                       tkey=call.tools_key)
            if canon_rest is not None:
                if not canon_rest.startswith(rest):
                    return None, ""  # the template renders this answer differently from its prompt: a leaf for good
                return canon_rest, answer_tail(canon_rest[len(rest):], sampled_text, r.eos_text)
            self._count("continuation_fallbacks")
        try:
            prompt = call.full_prompt if call.full_prompt is not None else r.render(
                call.messages, tools, add_generation_prompt=True)
            canon = r.render(convo, tools, add_generation_prompt=False)
        except ProxyError:
            return None, ""
        matched = len(prompt) - len(rest)
        if not canon.startswith(prompt) or matched < 0 or prompt[matched:] != rest:
            return None, ""
        return canon[matched:], answer_tail(canon[len(prompt):], sampled_text, r.eos_text)

    async def _generate(
        self, eid: int, input_ids: list[int], params: Mapping[str, Any]
    ) -> tuple[GenerateResult, str, int, float, list[str]]:
        """One complete generation; engine aborts and disappearances are retried invisibly.

        An aborted attempt's partial output is carried into the next attempt when the sampling
        allows it (see :mod:`gyre_core.proxy.interruptions`); the answer lists every engine that
        generated part of it.
        """
        cfg = self.config
        attempts = 0
        exclude: frozenset[str] = frozenset()
        t_engine = 0.0
        continuable = cfg.continue_interrupted and may_continue(params, CONSTRAINT_KEYS)
        carried: GenerateResult | None = None
        engines: list[str] = []
        interrupted: tuple[KVHandOff | None, str] | None = None  # the last cut attempt, not yet counted
        while True:
            if carried is not None and len(carried.output_ids) >= int(params["max_new_tokens"]):
                done = GenerateResult(carried.rid, carried.output_ids, carried.logprobs, "length",
                                      carried.prompt_tokens, carried.cached_tokens, carried.weight_version)
                return done, engines[-1], attempts, t_engine, engines
            try:
                slot = self.router.assign(eid, exclude=exclude)
            except NoEngineAvailable:
                if exclude:
                    exclude = frozenset()
                    continue
                if not await self._wait_for_engine():
                    raise ProxyError(503, "overloaded", "no rollout engine is available") from None
                continue
            url = slot.url
            rid = f"gyre-{eid}-{secrets.token_hex(6)}"
            attempts += 1
            self._inflight.setdefault(url, {})[rid] = eid
            unreachable = False
            t0 = time.perf_counter()
            ids = input_ids + list(carried.output_ids) if carried is not None else input_ids
            try:
                result = await slot.client.generate(ids, remaining_params(params, carried), rid=rid,
                                                    return_logprob=True)
            except EngineUnreachable:
                unreachable = True
            except EngineError as exc:
                self.handoffs.forget(rid)
                raise ProxyError(502, "engine", f"the rollout engine refused the call: {exc.message}") from None
            except asyncio.CancelledError:
                self.handoffs.forget(rid)
                asyncio.ensure_future(self._abort_quietly(slot.client, rid))
                raise
            finally:
                t_engine += time.perf_counter() - t0
                self._inflight.get(url, {}).pop(rid, None)
            if interrupted is not None and not unreachable:
                self.handoffs.count_continuation(*interrupted, cached_tokens=result.cached_tokens, engine=url)
                interrupted = None
            if not unreachable and result.finish_reason != "abort":
                self.handoffs.forget(rid)
                if carried is not None:
                    joined = join(carried, result)
                    if joined is None:  # another policy continued it: generate the call again, whole
                        self.handoffs.regenerated += 1
                        carried, engines = None, []
                        continue
                    result = joined
                return result, url, attempts, t_engine, engines + [url]
            if attempts > cfg.max_retries:
                self.handoffs.forget(rid)
                raise ProxyError(503, "overloaded", f"the call was interrupted {attempts} times; giving up")
            self.handoffs.interrupted += 1
            handoff = await self.handoffs.outcome(rid, timeout=4 * cfg.handoff_timeout_s + 30)
            if unreachable:
                interrupted = (handoff, "engine unreachable")
            elif continuable and result.output_ids:
                merged = result if carried is None else join(carried, result)
                if merged is None:
                    self.handoffs.regenerated += 1
                    carried, engines = None, []
                else:
                    carried = merged
                    engines.append(url)
                interrupted = (handoff, "no KV hand-off (the engine aborted the call)")
            else:
                if not continuable:
                    self.handoffs.regenerated += 1
                interrupted = (handoff, "not continuable (constrained or penalised sampling)" if not continuable
                               else "no KV hand-off (the engine aborted the call)")
            moved = await self._wait_for_reroute(eid, url)
            exclude = frozenset({url}) if (unreachable and not moved) else frozenset()

    async def hand_off(self, engine_url: str, rids: Sequence[str] | None = None) -> list[KVHandOff]:
        """Hand the KV of the calls running on ``engine_url`` to their executions' new engines.

        Call after :meth:`reroute` moved the executions and before the engine's requests are
        aborted: each hand-off aborts its call on the source, and the call continues on its
        destination from the handed-off KV (a failed hand-off only costs a re-prefill). ``rids``
        limits it to those requests (default: every call of this proxy running there).
        """
        slot = self.router.slot(engine_url)
        running = dict(self._inflight.get(engine_url, {}))
        if rids is not None:
            wanted = set(rids)
            running = {r: e for r, e in running.items() if r in wanted}
        mover = slot.client if isinstance(slot.client, KVHandOffEngine) else None

        async def one(rid: str, eid: int) -> KVHandOff:
            dest = self.router.engine_of(eid)
            if not self.config.kv_handoff:
                return KVHandOff(rid, False, "KV hand-off is off")
            if mover is None:
                return KVHandOff(rid, False, "the engine offers no KV hand-off")
            if dest is None or dest == engine_url:
                return KVHandOff(rid, False, "no destination engine")
            out = await mover.hand_off_kv(rid, self.router.slot(dest).client, timeout=self.config.handoff_timeout_s)
            return dataclasses.replace(out, dest=dest)

        futures = {rid: self.handoffs.start(rid) for rid in running}  # before any await: no call misses its own
        return list(await asyncio.gather(*(settle(futures[r], one(r, e), r) for r, e in running.items())))

    async def _wait_for_engine(self) -> bool:
        """Wait (bounded by ``engine_wait_s``) until some registered engine accepts again."""
        if not self.router.engines():
            return False
        deadline = time.monotonic() + self.config.engine_wait_s
        while not any(s.accepting for s in self.router.engines()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _wait_for_reroute(self, eid: int, url: str) -> bool:
        """Wait (bounded) until the execution is moved off ``url`` or ``url`` stops accepting."""
        deadline = time.monotonic() + self.config.retry_wait_s
        delay = 0.01
        while True:
            slot = self.router.slot(url)
            if self.router.engine_of(eid) != url or not slot.accepting:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    @staticmethod
    async def _abort_quietly(client: EngineClient, rid: str) -> None:
        try:
            await client.abort_request(rid)
        except Exception:  # best effort: the engine may be gone already
            pass

