"""KV-cache pin and hand-off between two SGLang servers, over Mooncake (server side).

Source side. ``POST /gyre/kv/pin {rid}`` marks a running request. When SGLang releases the
request's KV (it finished or was aborted: ``release_kv_cache`` with ``checkpoint=True`` has just
inserted its computed tokens into the radix tree), a hook takes a tree lock on the node that
insert ended on, before anything can evict it. The pin is then *ready*: its token ids and their
KV-pool slot indices are fixed and no forward pass writes them any more. The pin carries a lease;
``POST /gyre/kv/release {handle}`` unlocks it, and an expired lease unlocks it by itself (a
destination that died never acknowledges). ``GET /gyre/kv/handle/{h}`` answers the descriptor the
destination needs: the Mooncake session (``host:rpc_port``), the registered base address and
bytes-per-token of each KV buffer (K and V of every layer), the token ids and their slots.

Destination side. ``POST /gyre/kv/import {descriptor}`` allocates slots for the tokens its own
radix tree lacks, reads their KV with Mooncake ``batch_transfer_sync_read`` (TCP on CPU, RDMA on
GPUs) into its own pool, which is registered once (as SGLang's PD disaggregation does), inserts
token ids -> slots into its radix tree, and acknowledges (releases) the source pin. A request then
sent with ``input_ids = prompt + partial output`` hits that prefix (``meta_info.cached_tokens``)
and continues decoding without recomputing it. The transfer runs on a worker thread so the
destination keeps decoding; allocation and insertion run on the scheduler thread. On any failure
the destination frees what it allocated and the caller re-sends the request (re-prefill).

All tree and pool operations run inside the scheduler loop (see :mod:`kv_channel`). Limits: one
scheduler per server (TP=1, DP=1; with TP>1 each rank holds a shard of the heads and would need
its own transfer), full-attention MHA pools with a slot-major (NHD) layout; hybrid SWA/Mamba and
MLA pools are refused with a clear error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gyre_core.transfer_endpoint import read
from gyre_sglang.server_plugin import kv_channel

try:  # at module level: FastAPI resolves the routes' string annotations in this module's globals
    from fastapi import Request
except ImportError:  # pragma: no cover - fastapi comes with SGLang
    Request = Any  # type: ignore[misc,assignment]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
DEFAULT_HOLD_S = 10.0


class KVHandoffError(RuntimeError):
    """A pin or import cannot be served (clear reason in the message)."""


# --------------------------------------------------------------------------------------------
# Scheduler-side state (one per scheduler process)
# --------------------------------------------------------------------------------------------


@dataclass
class Pin:
    """A request's KV held in the radix tree under a lease (source), or an import's hold (dest)."""

    handle: str
    rid: str
    kind: str  # "source" (pinned for a hand-off) or "import" (destination hold until reuse)
    lease_s: float
    created: float = field(default_factory=time.monotonic)
    state: str = "pending"  # pending -> ready | empty; ready -> (released | expired: dropped)
    lock: Any = None
    token_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    extra_key: str | None = None
    cache_salt: str | None = None
    reason: str = ""

    def expired(self, now: float) -> bool:
        return now - self.created > self.lease_s

    def public(self, now: float) -> dict[str, Any]:
        return {
            "handle": self.handle, "rid": self.rid, "kind": self.kind, "state": self.state,
            "tokens": len(self.token_ids), "age_s": round(now - self.created, 3),
            "lease_left_s": round(self.lease_s - (now - self.created), 3), "reason": self.reason,
        }


@dataclass
class Import:
    """A destination-side transfer in flight: its slots are allocated but not yet in the tree."""

    import_id: str
    token_ids: list[int]
    extra_key: str | None
    cache_salt: str | None
    cached_before: int
    match_lock: Any
    prefix_slots: Any  # tensor: slots of the part already in our tree
    new_slots: Any  # tensor: slots allocated for the transferred part
    future: Future[int] | None
    started: float = field(default_factory=time.monotonic)
    state: str = "running"  # running -> done | failed; cancelled while running -> failed
    cancelled: bool = False
    error: str = ""
    hold: str | None = None
    transfer_s: float = 0.0
    bytes: int = 0


class _State:
    def __init__(self) -> None:
        self.pins: dict[str, Pin] = {}
        self.pending_by_rid: dict[str, str] = {}
        self.imports: dict[str, Import] = {}
        self.counts: dict[str, int] = {
            "pinned": 0, "released": 0, "expired": 0, "empty": 0,
            "imports_done": 0, "imports_failed": 0, "imported_tokens": 0,
        }
        self.engine: Any = None  # sglang's MooncakeTransferEngine
        self.registered: tuple[list[int], list[int], list[int]] | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-kv-import")
        self.lock = threading.Lock()


_STATE = _State()


def _tree(s: Any) -> Any:
    tree = s.tree_cache
    if not tree.supports_prefix_sharing():
        raise KVHandoffError("the radix cache is disabled on this server (--disable-radix-cache): nothing to pin")
    if getattr(s, "is_hybrid_swa", False) or tree.supports_swa() or tree.supports_mamba():
        raise KVHandoffError("KV hand-off supports full-attention KV pools only (no SWA/Mamba state)")
    return tree


def _kv_pool(s: Any) -> Any:
    kv = s.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(kv, "k_buffer") or not hasattr(kv, "get_contiguous_buf_infos"):
        raise KVHandoffError(f"KV hand-off needs an MHA KV pool, this server has {type(kv).__name__}")
    if getattr(kv, "use_hnd", False):
        raise KVHandoffError("KV hand-off needs the slot-major (NHD) KV layout")
    return kv


def _layout(s: Any) -> dict[str, Any]:
    kv = _kv_pool(s)
    ptrs, lens, item_lens = kv.get_contiguous_buf_infos()
    page = int(s.page_size)
    return {
        "buffers": [int(p) for p in ptrs],
        "buffer_bytes": [int(n) for n in lens],
        "bytes_per_token": [int(n) // page for n in item_lens],
        "page_size": page,
        "dtype": str(kv.dtype),
        "layer_num": int(kv.layer_num),
    }


def _endpoint(s: Any) -> tuple[str, str | None]:
    """The host peers reach this engine's KV at, and its RDMA device: the run's Mooncake endpoint
    when Gyre started the engine (``GYRE_MOONCAKE_*``), else the server's own address. SGLang's
    shared engine reads its protocol from ``MOONCAKE_PROTOCOL`` (default ``rdma``): set it from
    the run's, so a TCP run does not look for RDMA devices and an RDMA run uses the configured one."""
    from gyre_core.transfer_endpoint import HOST_ENV, MooncakeEndpoint

    if os.environ.get(HOST_ENV):
        ep = MooncakeEndpoint.from_env()
        os.environ.setdefault("MOONCAKE_PROTOCOL", ep.protocol)
        if ep.protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        return ep.host, ep.device or None
    host = s.server_args.host
    if host in ("0.0.0.0", "::", "", None):
        from sglang.srt.utils.network import get_local_ip_auto

        host = get_local_ip_auto()
    return host, None


def _ensure_engine(s: Any) -> Any:
    """SGLang's shared Mooncake engine for this process, with the whole KV pool registered once."""
    if _STATE.engine is not None:
        return _STATE.engine
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine,
        init_mooncake_transfer_engine,
    )

    existed = get_mooncake_transfer_engine() is not None
    host, device = _endpoint(s)
    engine = init_mooncake_transfer_engine(hostname=host, gpu_id=int(getattr(s, "gpu_id", 0) or 0),
                                           ib_device=device)
    layout = _layout(s)
    for ptr, n in zip(layout["buffers"], layout["buffer_bytes"]):
        try:
            engine.register(ptr, n)
        except RuntimeError:
            if not existed:  # PD disaggregation may have registered the pool already
                raise
    _STATE.engine = engine
    logger.info("gyre kv hand-off: Mooncake session %s, %d KV buffers registered",
                engine.get_session_id(), len(layout["buffers"]))
    return engine


def _radix_key(token_ids: list[int], extra_key: str | None, cache_salt: str | None) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt)


def _match(tree: Any, token_ids: list[int], extra_key: str | None, cache_salt: str | None) -> tuple[int, Any]:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    res = tree.match_prefix(MatchPrefixParams(key=_radix_key(token_ids, extra_key, cache_salt)))
    return int(res.device_prefix_len), res.last_device_node


def _ready(pin: Pin, tree: Any, node: Any, token_ids: Any, length: int | None = None) -> None:
    """Lock ``node`` (the end of the tree path holding ``token_ids[:length]``) for ``pin``."""
    pin.lock = tree.lock(node)
    slots = tree.path_device_indices(node)
    if length is not None:
        slots = slots[:length]
    pin.slots = [int(x) for x in slots.tolist()]
    pin.token_ids = [int(t) for t in token_ids[: len(pin.slots)]]
    pin.state = "ready"


def _unlock(s: Any, pin: Pin) -> None:
    if pin.lock is not None:
        s.tree_cache.unlock(pin.lock)
        pin.lock = None


def _drop(s: Any, pin: Pin, count: str) -> None:
    _unlock(s, pin)
    _STATE.pins.pop(pin.handle, None)
    if _STATE.pending_by_rid.get(pin.rid) == pin.handle:
        _STATE.pending_by_rid.pop(pin.rid, None)
    _STATE.counts[count] += 1


def _find_live_req(s: Any, rid: str) -> Any:
    for req in list(s.waiting_queue) + list(s.collect_inflight_reqs()):
        if req.rid == rid and not req.finished():
            return req
    chunked = getattr(s, "chunked_req", None)
    if chunked is not None and chunked.rid == rid:
        return chunked
    return None


def release_hook(original_fn: Any, req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``release_kv_cache``: a pinned request's checkpointed path is locked at once."""
    handle = _STATE.pending_by_rid.get(getattr(req, "rid", None)) if _STATE.pending_by_rid else None
    if handle is None:  # the common case: not pinned, SGLang's path untouched
        return original_fn(req, tree_cache, *args, **kwargs)
    checkpoint = kwargs.get("checkpoint", args[0] if args else False)
    will_insert = bool(checkpoint) and not req.skip_radix_cache_insert and req.kv.holds_kv
    out = original_fn(req, tree_cache, *args, **kwargs)
    pin = _STATE.pins.get(handle)
    _STATE.pending_by_rid.pop(req.rid, None)
    if pin is None or pin.state != "pending":
        return out
    try:
        if not will_insert or req.last_node is None:
            pin.state, pin.reason = "empty", "the request's KV was freed without caching it"
            return out
        # The checkpoint just moved req.last_node to the end of the inserted path, whose keys
        # are the request's first len(path) fill ids; nothing ran since that could evict it.
        _ready(pin, tree_cache, req.last_node, req.full_untruncated_fill_ids)
        pin.extra_key, pin.cache_salt = req.extra_key, req.cache_salt
        pin.created = time.monotonic()  # the lease runs from the moment the KV is held
    except Exception as exc:  # never break SGLang's release path
        logger.exception("gyre kv pin of %s failed", req.rid)
        pin.state, pin.reason = "empty", f"pin failed: {exc}"
    return out


def uncached_hook(self: Any, ps: Any, uncached: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """BEFORE hook on the idle pool-invariant check: slots of imports in flight are accounted."""
    inflight = sum(len(imp.new_slots) for imp in _STATE.imports.values() if imp.state == "running")
    return (self, ps), {"uncached": uncached + inflight}


def flush_hook(original_fn: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``Scheduler.flush_cache``: never reset the pools under a hand-off.

    A ready source pin may be being read by a destination right now, and an import in flight
    writes into slots the reset would hand out again: refuse (as SGLang refuses while requests
    run; leases bound the wait). Destination holds only protect reuse: they are dropped.
    """
    busy = [p for p in _STATE.pins.values() if p.kind == "source" and p.state == "ready"]
    running = [i for i in _STATE.imports.values() if i.state == "running"]
    if busy or running:
        logger.warning("Cache not flushed: %d KV pin(s) held for a hand-off, %d KV import(s) in flight",
                       len(busy), len(running))
        return False
    ok = original_fn(self, *args, **kwargs)
    if ok:
        for pin in list(_STATE.pins.values()):
            pin.lock = None  # the tree it locked is gone
            _drop(self, pin, "released")
        _STATE.imports.clear()
    return ok


# -- scheduler ops ----------------------------------------------------------------------------


@kv_channel.op("kv_pin")
def _op_pin(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    tree = _tree(s)
    _kv_pool(s)
    rid = str(msg["rid"])
    lease_s = float(msg.get("lease_s") or DEFAULT_LEASE_S)
    pin = Pin(handle=uuid.uuid4().hex, rid=rid, kind="source", lease_s=lease_s)
    if rid in _STATE.pending_by_rid:
        raise KVHandoffError(f"request {rid!r} is already pinned (handle {_STATE.pending_by_rid[rid]})")
    if _find_live_req(s, rid) is not None:
        _STATE.pins[pin.handle] = pin
        _STATE.pending_by_rid[rid] = pin.handle
    elif msg.get("token_ids"):
        token_ids = [int(t) for t in msg["token_ids"]]
        extra_key, salt = msg.get("extra_key"), msg.get("cache_salt")
        length, node = _match(tree, token_ids, extra_key, salt)
        if length == 0:
            raise KVHandoffError(f"request {rid!r} is not running and none of its tokens are cached")
        _ready(pin, tree, node, token_ids, length)
        pin.extra_key, pin.cache_salt = extra_key, salt
        _STATE.pins[pin.handle] = pin
    else:
        raise KVHandoffError(f"request {rid!r} is not running here (finished, aborted, or unknown)")
    _STATE.counts["pinned"] += 1
    return {"handle": pin.handle, "state": pin.state}


@kv_channel.op("kv_handle")
def _op_handle(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    now = time.monotonic()
    pin = _STATE.pins.get(str(msg["handle"]))
    if pin is None:
        raise KVHandoffError(f"unknown KV handle {msg['handle']!r} (released, expired, or never pinned)")
    if pin.state == "pending" and _find_live_req(s, pin.rid) is None:
        # It left the scheduler without passing release_kv_cache (e.g. aborted while queued).
        pin.state, pin.reason = "empty", "the request ended without caching its KV"
    out = pin.public(now)
    if pin.state == "empty":
        _drop(s, pin, "empty")
    if pin.state != "ready":
        return out
    engine = _ensure_engine(s)
    out.update({
        "session": engine.get_session_id(), "token_ids": pin.token_ids, "slots": pin.slots,
        "extra_key": pin.extra_key, "cache_salt": pin.cache_salt, **_layout(s),
    })
    return out


@kv_channel.op("kv_release")
def _op_release(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    pin = _STATE.pins.get(str(msg["handle"]))
    if pin is None:
        return {"released": False}
    _drop(s, pin, "released")
    return {"released": True}


@kv_channel.op("kv_pins")
def _op_pins(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    now = time.monotonic()
    tree = s.tree_cache
    return {
        "pins": [p.public(now) for p in _STATE.pins.values()],
        "imports_running": sum(1 for i in _STATE.imports.values() if i.state == "running"),
        "counts": dict(_STATE.counts),
        "protected_tokens": int(tree.protected_size()),
        "evictable_tokens": int(tree.evictable_size()),
        "available_tokens": int(s.token_to_kv_pool_allocator.available_size()),
        "session": _STATE.engine.get_session_id() if _STATE.engine is not None else None,
    }


@kv_channel.op("kv_digest")
def _op_digest(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """SHA-256 of the cached K and V rows of ``token_ids`` (a diagnostic: did the bytes move intact?)."""
    import hashlib

    import torch

    tree = _tree(s)
    kv = _kv_pool(s)
    token_ids = [int(t) for t in msg["token_ids"]]
    length, node = _match(tree, token_ids, msg.get("extra_key"), msg.get("cache_salt"))
    h = hashlib.sha256()
    if length:
        slots = tree.path_device_indices(node)[:length].to(torch.int64)
        for layer in range(kv.layer_num):
            for buf in (kv.k_buffer[layer], kv.v_buffer[layer]):
                rows = buf[slots.to(buf.device)].detach().cpu().contiguous()
                h.update(rows.view(torch.uint8).numpy().tobytes())
    return {"matched": length, "sha256": h.hexdigest()}


def _address_runs(
    src_base: list[int], dst_base: list[int], bpt: list[int], src_slots: list[int], dst_slots: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(local, remote, length) triples for every buffer, one per run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []  # (src_start, dst_start, n)
    for a, b in zip(src_slots, dst_slots):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    local: list[int] = []
    remote: list[int] = []
    lens: list[int] = []
    for sb, db, n_bytes in zip(src_base, dst_base, bpt):
        for a, b, n in runs:
            remote.append(sb + a * n_bytes)
            local.append(db + b * n_bytes)
            lens.append(n * n_bytes)
    return local, remote, lens


TRANSFER_BATCH = 128
"""Most (local, remote, length) entries per Mooncake batch read. A fragmented KV pool gives one
entry per run of consecutive slots and buffer (thousands for a long context); Mooncake's TCP
transport rejects a batch that overfills its lane queue ("TCP lane queue-full rejection") and
the whole read fails, so a long import is read in batches of this size."""


def _batches(local: list[int], remote: list[int], lens: list[int], size: int
             ) -> list[tuple[list[int], list[int], list[int]]]:
    """The entries in consecutive batches of at most ``size``."""
    return [(local[i:i + size], remote[i:i + size], lens[i:i + size]) for i in range(0, len(lens), size)]


def _check_compatible(mine: dict[str, Any], desc: dict[str, Any]) -> None:
    for key in ("bytes_per_token", "dtype", "layer_num"):
        if mine[key] != desc.get(key):
            raise KVHandoffError(
                f"source and destination KV layouts differ in {key}: {desc.get(key)!r} != {mine[key]!r} "
                "(same model and KV dtype required)"
            )
    if len(desc["token_ids"]) != len(desc["slots"]):
        raise KVHandoffError("malformed descriptor: token_ids and slots differ in length")


@kv_channel.op("kv_import_start")
def _op_import_start(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    import torch

    desc = msg["descriptor"]
    tree = _tree(s)
    mine = _layout(s)
    _check_compatible(mine, desc)
    token_ids = [int(t) for t in desc["token_ids"]]
    src_slots = [int(x) for x in desc["slots"]]
    page = int(mine["page_size"])
    usable = len(token_ids) - len(token_ids) % page
    token_ids, src_slots = token_ids[:usable], src_slots[:usable]
    extra_key, salt = desc.get("extra_key"), desc.get("cache_salt")
    engine = _ensure_engine(s)

    cached, node = _match(tree, token_ids, extra_key, salt) if token_ids else (0, None)
    match_lock = tree.lock(node) if cached > 0 else None  # keep our part alive during the transfer
    prefix_slots = tree.path_device_indices(node)[:cached] if cached > 0 else torch.empty(0, dtype=torch.int64)
    need = usable - cached
    imp = Import(
        import_id=uuid.uuid4().hex, token_ids=token_ids, extra_key=extra_key, cache_salt=salt,
        cached_before=cached, match_lock=match_lock, prefix_slots=prefix_slots,
        new_slots=torch.empty(0, dtype=torch.int64), future=None,
    )
    _STATE.imports[imp.import_id] = imp
    if need <= 0:
        _finish_import(s, imp, ok=True)
        return {"import_id": imp.import_id}
    alloc = s.token_to_kv_pool_allocator
    slots = alloc.alloc(need)
    if slots is None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        tree.evict(EvictParams(num_tokens=need))
        slots = alloc.alloc(need)
    if slots is None:
        imp.state, imp.error = "failed", f"no room for {need} tokens in the KV pool"
        _finish_import(s, imp, ok=False)
        return {"import_id": imp.import_id}
    imp.new_slots = slots.to(torch.int64)
    local, remote, lens = _address_runs(
        desc["buffers"], mine["buffers"], mine["bytes_per_token"], src_slots[cached:], imp.new_slots.tolist()
    )
    imp.bytes = sum(lens)
    session = str(desc["session"])

    def transfer() -> int:
        t0 = time.perf_counter()
        ret = 0
        for lo, re_, ln in _batches(local, remote, lens, TRANSFER_BATCH):
            ret = read(engine.engine, session, lo, re_, ln)
            if ret != 0:
                break
        imp.transfer_s = time.perf_counter() - t0
        return ret

    imp.future = _STATE.executor.submit(transfer)
    return {"import_id": imp.import_id}


def _finish_import(s: Any, imp: Import, ok: bool) -> None:
    """Scheduler thread: insert a finished transfer into the tree, or free what it allocated."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    tree = s.tree_cache
    try:
        if ok and not imp.cancelled:
            import torch

            value = torch.cat([imp.prefix_slots.to(torch.int64), imp.new_slots])
            key = _radix_key(imp.token_ids, imp.extra_key, imp.cache_salt)
            result = tree.insert(InsertParams(key=key, value=value, prev_prefix_len=imp.cached_before))
            if not hasattr(tree, "tree_core"):
                # The legacy RadixCache leaves freeing duplicates to the caller (the unified
                # tree frees the part of [prev_prefix_len, prefix_len) it already had itself).
                dup = value[imp.cached_before: int(result.prefix_len)]
                if len(dup):
                    s.token_to_kv_pool_allocator.free(dup)
            length, node = _match(tree, imp.token_ids, imp.extra_key, imp.cache_salt)
            hold = Pin(handle=uuid.uuid4().hex, rid=imp.import_id, kind="import", lease_s=DEFAULT_HOLD_S)
            _ready(hold, tree, node, imp.token_ids, length)
            _STATE.pins[hold.handle] = hold
            imp.hold = hold.handle
            imp.state = "done"
            _STATE.counts["imports_done"] += 1
            _STATE.counts["imported_tokens"] += len(imp.new_slots)
        else:
            if len(imp.new_slots):
                s.token_to_kv_pool_allocator.free(imp.new_slots)
            imp.new_slots = imp.new_slots[:0]
            imp.state = "failed"
            imp.error = imp.error or ("cancelled" if imp.cancelled else "transfer failed")
            _STATE.counts["imports_failed"] += 1
    finally:
        if imp.match_lock is not None:
            tree.unlock(imp.match_lock)
            imp.match_lock = None


@kv_channel.on_tick
def _tick(s: Any) -> None:
    """Every scheduler iteration: finish transfers that completed, expire leases."""
    if not _STATE.pins and not _STATE.imports:
        return
    for imp in list(_STATE.imports.values()):
        if imp.state == "running" and imp.future is not None and imp.future.done():
            exc = imp.future.exception()
            ret = -1 if exc is not None else imp.future.result()
            if ret != 0:
                imp.error = f"Mooncake batch_transfer_sync_read returned {ret}" + (f" ({exc})" if exc else "")
            _finish_import(s, imp, ok=ret == 0)
        if imp.state != "running" and time.monotonic() - imp.started > 300:
            _STATE.imports.pop(imp.import_id, None)  # nobody polled it: forget the record
    now = time.monotonic()
    for pin in list(_STATE.pins.values()):
        if pin.expired(now):
            if pin.state == "ready" and pin.kind == "source":
                logger.warning("gyre kv pin %s of %s expired unacknowledged; released", pin.handle, pin.rid)
            _drop(s, pin, "empty" if pin.state == "empty" else "expired")


@kv_channel.op("kv_import_poll")
def _op_import_poll(s: Any, msg: dict[str, Any]) -> dict[str, Any]:
    imp = _STATE.imports.get(str(msg["import_id"]))
    if imp is None:
        raise KVHandoffError(f"unknown import {msg['import_id']!r}")
    if msg.get("cancel") and imp.state == "running":
        imp.cancelled = True
        imp.error = str(msg.get("reason") or "cancelled by the caller")
    out = {
        "state": imp.state, "error": imp.error, "prefix_tokens": len(imp.token_ids),
        "cached_before": imp.cached_before, "imported_tokens": len(imp.new_slots),
        "bytes": imp.bytes, "transfer_s": imp.transfer_s, "hold": imp.hold,
    }
    if imp.state != "running":
        _STATE.imports.pop(imp.import_id, None)
    return out


# --------------------------------------------------------------------------------------------
# HTTP routes (SGLang's HTTP server process)
# --------------------------------------------------------------------------------------------


def _server_addr() -> tuple[str, int, str | None]:
    from sglang.srt.entrypoints import http_server

    sa = http_server._global_state.tokenizer_manager.server_args
    return sa.host, int(sa.port), getattr(sa, "api_key", None)


async def _sched(message: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    host, port, key = _server_addr()
    return await kv_channel.call(host, port, message, timeout=timeout, key=key)


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": message})


async def _ack_source(source_url: str, handle: str, timeout: float) -> tuple[bool, str]:
    import aiohttp

    try:
        t = aiohttp.ClientTimeout(total=timeout)
        # engines of one run share the run's engine key (see gyre_sglang.server_plugin.guard)
        key = os.environ.get("GYRE_ENGINE_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession(timeout=t, headers=headers) as http:
            async with http.post(source_url.rstrip("/") + "/gyre/kv/release", json={"handle": handle}) as r:
                return r.status == 200, "" if r.status == 200 else f"HTTP {r.status}: {await r.text()}"
    except Exception as exc:  # the source may be gone; its lease frees the pin then
        return False, f"{type(exc).__name__}: {exc}"


def _install_routes() -> None:
    try:
        from sglang.srt.entrypoints.http_server import app
    except Exception:  # not the HTTP server process
        return
    if any(getattr(r, "path", None) == "/gyre/kv/pin" for r in app.routes):
        return
    import asyncio

    async def pin(request: Request) -> Any:
        body = await request.json()
        if "rid" not in body:
            return _error(400, "body needs 'rid'")
        ans = await _sched({"op": "kv_pin", **body})
        return ans if ans["ok"] else _error(409, ans["error"])

    async def handle(handle: str, wait_s: float = 0.0) -> Any:
        deadline = time.monotonic() + min(max(wait_s, 0.0), 600.0)
        while True:
            ans = await _sched({"op": "kv_handle", "handle": handle})
            if not ans["ok"]:
                return _error(404, ans["error"])
            if ans["state"] != "pending" or time.monotonic() >= deadline:
                return ans
            await asyncio.sleep(0.01)

    async def release(request: Request) -> Any:
        body = await request.json()
        ans = await _sched({"op": "kv_release", "handle": str(body.get("handle", ""))})
        return ans if ans["ok"] else _error(500, ans["error"])

    async def pins() -> Any:
        ans = await _sched({"op": "kv_pins"})
        return ans if ans["ok"] else _error(500, ans["error"])

    async def digest(request: Request) -> Any:
        body = await request.json()
        ans = await _sched({"op": "kv_digest", **body})
        return ans if ans["ok"] else _error(422, ans["error"])

    async def import_kv(request: Request) -> Any:
        body = await request.json()
        desc = body.get("descriptor")
        if not isinstance(desc, dict) or desc.get("state") != "ready":
            return _error(400, "body needs 'descriptor': a ready answer of the source's /gyre/kv/handle")
        timeout = float(body.get("timeout_s") or 30.0)
        t0 = time.perf_counter()
        ans = await _sched({"op": "kv_import_start", "descriptor": desc}, timeout=timeout)
        if not ans["ok"]:
            return _error(422, ans["error"])
        import_id = ans["import_id"]
        deadline = time.monotonic() + timeout
        while True:
            cancel = time.monotonic() >= deadline
            ans = await _sched({"op": "kv_import_poll", "import_id": import_id, "cancel": cancel,
                                "reason": f"timed out after {timeout:.1f} s"})
            if not ans["ok"]:
                return _error(500, ans["error"])
            if ans["state"] != "running":
                break
            if cancel:  # cancelled while the transfer thread still runs: the tick frees it later
                return _error(504, f"KV import timed out after {timeout:.1f} s")
            await asyncio.sleep(0.002)
        ans["elapsed_s"] = time.perf_counter() - t0
        ans["acked"], ans["ack_error"] = False, ""
        if ans["state"] == "done" and body.get("source_url") and desc.get("handle"):
            ans["acked"], ans["ack_error"] = await _ack_source(str(body["source_url"]), str(desc["handle"]), 10.0)
        if ans["state"] != "done":
            return _error(502, f"KV import failed: {ans['error']}")
        return ans

    app.add_api_route("/gyre/kv/pin", pin, methods=["POST"])
    app.add_api_route("/gyre/kv/handle/{handle}", handle, methods=["GET"])
    app.add_api_route("/gyre/kv/release", release, methods=["POST"])
    app.add_api_route("/gyre/kv/pins", pins, methods=["GET"])
    app.add_api_route("/gyre/kv/import", import_kv, methods=["POST"])
    app.add_api_route("/gyre/kv/digest", digest, methods=["POST"])


_hooks_registered = False


def register() -> None:
    """Plugin feature entry point: scheduler hooks (every process; harmless where unused), routes."""
    global _hooks_registered
    if not _hooks_registered:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        kv_channel.install_scheduler_hook()
        HookRegistry.register("sglang.srt.mem_cache.common.release_kv_cache", release_hook, HookType.AROUND)
        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.flush_cache", flush_hook, HookType.AROUND)
        HookRegistry.register(
            "sglang.srt.managers.scheduler_components.invariant_checker."
            "SchedulerInvariantChecker._check_all_pools",
            uncached_hook, HookType.BEFORE,
        )
        _hooks_registered = True
    _install_routes()


if os.environ.get("GYRE_KV_DEBUG"):
    logger.setLevel(logging.DEBUG)
