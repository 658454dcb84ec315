"""Weight publication over the Mooncake Transfer Engine: the core exposes, each engine pulls.

Why a pull: after a burst the core publishes one policy version and every rollout engine must load
it, at its own pace (an engine may still be finishing a request). A one-sided read needs nothing
from the core but its buffer staying registered, so the core never waits for the slowest engine,
and K engines can pull the same bytes without a collective they would all have to join.

Layout of one published version (one contiguous, registered host buffer)::

    [tensor 0 | pad | tensor 1 | pad | ... | manifest JSON]

Each tensor starts on a 64-byte boundary; the manifest lists name, dtype, shape, offset and byte
count of every tensor. The :class:`~gyre_core.interfaces.WeightsRef` ``location`` is a small JSON
object (format tag, Mooncake session ``host:port``, buffer address and size, where the manifest is,
a CRC32 of the whole buffer), so it travels through the core's events unchanged.

The engine side (:class:`WeightPuller`, used by the SGLang custom weight loader in
:mod:`gyre_sglang.server_plugin.weight_loading`) reads the whole buffer into a registered staging
buffer of its own and refuses it unless the CRC32 and the manifest check out, *before* any
parameter is touched: a torn, partial or failed pull leaves the engine on its previous version.

:func:`load_published` is what the orchestrator calls: it drives SGLang's own update path
(``/begin_weight_update``, ``/update_weights_from_tensor`` with ``load_format`` naming Gyre's
custom loader, ``/end_weight_update``) so SGLang records the new ``weight_version`` and flushes
its cache only when the load succeeded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import pickle
import threading
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from gyre_core.interfaces import EngineError, WeightsRef
from gyre_core.transfer_endpoint import HOST_ENV, MooncakeEndpoint, start_transfer_engine

if TYPE_CHECKING:  # pragma: no cover
    from gyre_sglang.client import SGLangClient

log = logging.getLogger("gyre.sglang")

__all__ = [
    "FORMAT",
    "LOADER",
    "REF_TENSOR_NAME",
    "ManifestEntry",
    "PublicationError",
    "PulledWeights",
    "VERSION_WAIT_S",
    "WeightPublisher",
    "WeightPuller",
    "await_version",
    "load_published",
    "parse_location",
]

FORMAT = "gyre.mooncake.v1"
"""Format tag of a location produced by :class:`WeightPublisher`."""

LOADER = "gyre_sglang.server_plugin.weight_loading.load_published_weights"
"""Dotted path of Gyre's custom weight loader; the SGLang server must be started with
``--custom-weight-loader`` naming it (SGLang only dispatches to listed loaders)."""

REF_TENSOR_NAME = "gyre.weights_ref"
"""Name of the one tensor carried by ``/update_weights_from_tensor``: the location's UTF-8 bytes."""

ALIGN = 64

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


class PublicationError(RuntimeError):
    """A publication could not be made, pulled or verified (the engine keeps its old weights)."""


def _endpoint(host: str | MooncakeEndpoint | None) -> MooncakeEndpoint:
    """This process's Mooncake endpoint: as given, or as the environment configures it
    (:mod:`gyre_core.transfer_endpoint`; loopback and TCP when nothing is set)."""
    if isinstance(host, MooncakeEndpoint):
        return host
    from_env = MooncakeEndpoint.from_env()
    if host:
        return MooncakeEndpoint(host, from_env.protocol, from_env.device)
    if not os.environ.get(HOST_ENV) and os.environ.get("MC_TCP_BIND_ADDRESS"):
        return MooncakeEndpoint(os.environ["MC_TCP_BIND_ADDRESS"], from_env.protocol, from_env.device)
    return from_env


def _new_engine(endpoint: MooncakeEndpoint) -> Any:
    try:
        return start_transfer_engine(endpoint)
    except RuntimeError as e:
        raise PublicationError(str(e)) from e


def _crc32(buf: torch.Tensor, nbytes: int) -> int:
    return zlib.crc32(memoryview(buf[:nbytes].numpy()))


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise PublicationError(f"{self.name}: unsupported dtype {self.dtype!r}") from None


@dataclass(frozen=True)
class Location:
    """A parsed ``WeightsRef.location`` (see the module docstring)."""

    version: int
    session: str
    addr: int
    nbytes: int
    manifest_offset: int
    manifest_nbytes: int
    crc32: int
    partial: bool

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": self.version, "session": self.session, "addr": self.addr,
            "nbytes": self.nbytes, "manifest_offset": self.manifest_offset,
            "manifest_nbytes": self.manifest_nbytes, "crc32": self.crc32, "partial": self.partial,
        }, separators=(",", ":"))


def parse_location(location: str) -> Location:
    """Parse and sanity-check a location string; :class:`PublicationError` if it is not Gyre's."""
    try:
        d = json.loads(location)
        if d.get("format") != FORMAT:
            raise PublicationError(f"not a {FORMAT} location (format={d.get('format')!r})")
        loc = Location(int(d["version"]), str(d["session"]), int(d["addr"]), int(d["nbytes"]),
                       int(d["manifest_offset"]), int(d["manifest_nbytes"]), int(d["crc32"]),
                       bool(d.get("partial", False)))
    except PublicationError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PublicationError(f"malformed weights location: {e}: {location[:200]!r}") from e
    if loc.nbytes <= 0 or loc.manifest_nbytes <= 0 or loc.manifest_offset + loc.manifest_nbytes != loc.nbytes:
        raise PublicationError(f"inconsistent weights location: {location[:200]!r}")
    return loc


@dataclass
class _Published:
    buffer: torch.Tensor
    location: Location


class _MooncakeSide:
    """One lazily created Mooncake engine (init takes milliseconds; many processes never need one)."""

    def __init__(self, host: str | MooncakeEndpoint | None = None) -> None:
        self.endpoint = _endpoint(host)
        self.host = self.endpoint.host
        self._engine: Any = None
        self._lock = threading.Lock()

    @property
    def engine(self) -> Any:
        if self._engine is None:
            self._engine = _new_engine(self.endpoint)
        return self._engine


class WeightPublisher(_MooncakeSide):
    """Core side: one Mooncake engine; each :meth:`publish` fills a new registered buffer.

    A version's buffer stays registered (and readable by engines) until :meth:`release` is called
    for it, so an engine still pulling version v is never torn by the publication of v+1. The
    caller releases a version once every engine reports a newer one.
    """

    def __init__(self, host: str | MooncakeEndpoint | None = None) -> None:
        super().__init__(host)
        self._published: dict[int, _Published] = {}

    @property
    def session(self) -> str:
        return f"{self.host}:{self.engine.get_rpc_port()}"

    @property
    def versions(self) -> list[int]:
        return sorted(self._published)

    def publish(self, version: int, named_tensors: Mapping[str, torch.Tensor], *, partial: bool = False) -> WeightsRef:
        """Copy ``named_tensors`` (serving-layout names, e.g. HF) into one registered buffer.

        ``partial=True`` announces a subset of the model's tensors; otherwise the engine refuses
        a publication that lacks any tensor of its checkpoint.
        """
        if not named_tensors:
            raise PublicationError("nothing to publish")
        with self._lock:
            if version in self._published:
                raise PublicationError(f"version {version} is already published; release it first")
            entries: list[ManifestEntry] = []
            off = 0
            for name, t in named_tensors.items():
                dt = str(t.dtype).removeprefix("torch.")
                if dt not in _DTYPES:
                    raise PublicationError(f"{name}: unsupported dtype {t.dtype}")
                n = t.numel() * t.element_size()
                entries.append(ManifestEntry(name, dt, tuple(int(s) for s in t.shape), off, n))
                off += (n + ALIGN - 1) // ALIGN * ALIGN
            manifest = json.dumps({"version": version, "tensors": [
                {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
                for e in entries
            ]}, separators=(",", ":")).encode()
            total = off + len(manifest)
            buf = torch.zeros(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            for e, t in zip(entries, named_tensors.values()):
                if e.nbytes:
                    buf[e.offset:e.offset + e.nbytes].view(e.torch_dtype).view(e.shape).copy_(t.detach())
            buf[off:].copy_(torch.frombuffer(bytearray(manifest), dtype=torch.uint8))
            addr = buf.data_ptr()
            if self.engine.register_memory(addr, total) != 0:
                raise PublicationError(f"Mooncake register_memory failed ({total} bytes)")
            loc = Location(version, self.session, addr, total, off, len(manifest), _crc32(buf, total), partial)
            self._published[version] = _Published(buf, loc)
            return WeightsRef(version=version, location=loc.to_json())

    def buffer(self, version: int) -> torch.Tensor:
        """The registered bytes of ``version`` (inspection and fault injection)."""
        return self._published[version].buffer

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s tensors by name: views into its registered buffer (no copy)."""
        p = self._published[version]
        raw = p.buffer[p.location.manifest_offset:p.location.nbytes].numpy().tobytes()
        return {e.name: p.buffer[e.offset:e.offset + e.nbytes].view(e.torch_dtype).view(e.shape)
                for e in _parse_manifest(raw, p.location)}

    def save(self, version: int, path: str) -> None:
        """Write ``version`` as one safetensors file (the run's final checkpoint, not a publication)."""
        from safetensors.torch import save_file

        save_file({k: v.clone() for k, v in self.tensors(version).items()}, path)

    def release(self, version: int) -> None:
        """Stop exposing ``version`` (engines that have not pulled it yet will fail cleanly)."""
        with self._lock:
            p = self._published.pop(version, None)
            if p is not None and self._engine is not None:
                self._engine.unregister_memory(p.location.addr)

    def release_older_than(self, version: int) -> None:
        for v in [v for v in self._published if v < version]:
            self.release(v)

    def close(self) -> None:
        """Release every version and drop the engine."""
        for v in list(self._published):
            self.release(v)
        self._engine = None

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class PulledWeights:
    """A verified pull: the manifest plus zero-copy views into the puller's staging buffer.

    The views are valid until the same puller's next :meth:`WeightPuller.pull`.
    """

    version: int
    entries: list[ManifestEntry]
    partial: bool
    staging: torch.Tensor
    pull_s: float

    @property
    def nbytes(self) -> int:
        return int(self.staging.numel())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.entries:
            yield e.name, self.staging[e.offset:e.offset + e.nbytes].view(e.torch_dtype).view(e.shape)


def _parse_manifest(raw: bytes, loc: Location) -> list[ManifestEntry]:
    try:
        m = json.loads(raw.decode())
        entries = [ManifestEntry(str(t["name"]), str(t["dtype"]), tuple(int(s) for s in t["shape"]),
                                 int(t["offset"]), int(t["nbytes"])) for t in m["tensors"]]
        version = int(m["version"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise PublicationError(f"malformed manifest: {e}") from e
    if version != loc.version:
        raise PublicationError(f"manifest is for version {version}, location says {loc.version}")
    seen: set[str] = set()
    for e in entries:
        numel = 1
        for s in e.shape:
            numel *= s
        if e.name in seen:
            raise PublicationError(f"tensor {e.name!r} appears twice in the manifest")
        seen.add(e.name)
        esize = torch.empty((), dtype=e.torch_dtype).element_size()
        if e.nbytes != numel * esize or e.offset < 0 or e.offset + e.nbytes > loc.manifest_offset or e.offset % ALIGN:
            raise PublicationError(f"{e.name}: manifest entry out of bounds or inconsistent: {e}")
    return entries


class WeightPuller(_MooncakeSide):
    """Engine side: one Mooncake engine and one registered staging buffer, reused across pulls."""

    def __init__(self, host: str | MooncakeEndpoint | None = None) -> None:
        super().__init__(host)
        self._staging: torch.Tensor | None = None

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                self.engine.unregister_memory(self._staging.data_ptr())
                self._staging = None
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if self.engine.register_memory(buf.data_ptr(), nbytes) != 0:
                raise PublicationError(f"Mooncake register_memory failed for the staging buffer ({nbytes} bytes)")
            self._staging = buf
        return self._staging

    def pull(self, location: str) -> PulledWeights:
        """Read a published version and verify it (CRC32, manifest); raise on any mismatch."""
        loc = parse_location(location)
        with self._lock:
            staging = self._staging_for(loc.nbytes)
            t0 = time.perf_counter()
            rc = self.engine.transfer_sync_read(loc.session, staging.data_ptr(), loc.addr, loc.nbytes)
            pull_s = time.perf_counter() - t0
            if rc != 0:
                raise PublicationError(
                    f"Mooncake read of version {loc.version} from {loc.session} failed (rc={rc}): "
                    "the publisher is gone or no longer exposes this version")
            got = _crc32(staging, loc.nbytes)
            if got != loc.crc32:
                raise PublicationError(
                    f"version {loc.version}: CRC32 mismatch after the pull ({got:#010x} != {loc.crc32:#010x}); "
                    "torn or corrupted read")
            raw = staging[loc.manifest_offset:loc.nbytes].numpy().tobytes()
            entries = _parse_manifest(raw, loc)
            return PulledWeights(loc.version, entries, loc.partial, staging[:loc.nbytes], pull_s)

    def close(self) -> None:
        if self._staging is not None and self._engine is not None:
            self._engine.unregister_memory(self._staging.data_ptr())
        self._staging = None
        self._engine = None


def ref_payload(ref: WeightsRef) -> str:
    """The base64 ``serialized_named_tensors`` entry carrying ``ref.location`` to the loader.

    Plain pickle of one CPU uint8 tensor (bytes inline): SGLang's safe unpickler accepts it, and
    unlike its default ForkingPickler payload it holds no shared-memory handle, so it works from
    another process or host.
    """
    t = torch.frombuffer(bytearray(ref.location.encode()), dtype=torch.uint8)
    return base64.b64encode(pickle.dumps([(REF_TENSOR_NAME, t)])).decode()


FLUSH_REFUSED = "cache was not flushed because requests are still running"
"""SGLang's answer when the new weights are in but the prefix cache could not be flushed."""

VERSION_WAIT_S = 30.0
"""How long a load waits for ``/model_info`` to report the version it loaded (``publication.version_wait_s``)."""


async def await_version(client: "SGLangClient", version: int, wait_s: float = VERSION_WAIT_S) -> str:
    """Poll the engine's ``weight_version`` until it reports ``version``; bounded by ``wait_s``.

    Why a wait and not one read: SGLang records the new version inside its scheduler process, and
    ``/model_info`` is answered by the tokenizer manager, which learns it later. On a loaded
    machine (an engine generating for other executions while it loads) the first read after a
    successful load can still show the previous version. Raises :class:`EngineError` naming the
    last version seen once ``wait_s`` is spent.
    """
    deadline = time.monotonic() + max(0.0, wait_s)
    delay = 0.05
    while True:
        seen = await client.weight_version()
        if seen == str(version) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(1.0, delay * 2)
    if seen != str(version):
        raise EngineError("/model_info", 200,
                          f"engine reports weight_version {seen!r} after loading {version} (waited {wait_s:g} s)")
    return seen


async def load_published(client: "SGLangClient", ref: WeightsRef, *, flush_cache: bool = True,
                         timeout: float | None = None, version_wait_s: float = VERSION_WAIT_S) -> str:
    """Make the engine behind ``client`` pull and load ``ref``; return its new ``weight_version``.

    Runs inside SGLang's begin/end weight-update session (0.5.23 requires it for tensor updates)
    and always closes the session. On failure raises :class:`~gyre_core.interfaces.EngineError`
    with the engine's message; the engine keeps its previous weights and version.

    An engine in rollout keeps generating while a version is published (that is the point of
    bounded staleness), and SGLang refuses to flush its prefix cache with requests running: it
    loads the weights, records the version, then answers with an error. That answer is a
    successful load here (the version check below proves it); the flush is tried once more and
    otherwise skipped, so cached prefixes computed by the previous version may be reused until
    evicted. Token records stay exact either way: the log-probs are those the engine sampled with.

    The new version may reach ``/model_info`` after the update's answer (:func:`await_version`
    waits up to ``version_wait_s`` for it); a load whose version never shows is an error, which
    the serving side retries before it calls the engine failed.
    """
    info = await client.server_info()
    tp = int(info.get("tp_size", 1) or 1)
    body = {
        "serialized_named_tensors": [ref_payload(ref)] * tp,
        "load_format": LOADER,
        "flush_cache": flush_cache,
        "weight_version": str(ref.version),
    }
    flush_refused = False
    await client.begin_weight_update()
    try:
        try:
            ans = await client.post("/update_weights_from_tensor", body, timeout=timeout)
        except EngineError as e:
            if not (flush_cache and FLUSH_REFUSED in str(e)):
                raise
            flush_refused = True
        else:
            if not isinstance(ans, Mapping) or not ans.get("success", False):
                if not (flush_cache and FLUSH_REFUSED in str(ans)):
                    raise EngineError("/update_weights_from_tensor", 200, str(ans))
                flush_refused = True
    except BaseException:
        try:  # close the session, but report the update's own failure, not this one's
            await client.end_weight_update()
        except Exception:  # noqa: BLE001
            pass
        raise
    await client.end_weight_update()
    version = await await_version(client, ref.version, version_wait_s)
    if flush_refused:
        try:
            await client.flush_cache()
        except EngineError:
            log.info("engine %s loaded version %s with requests running; its prefix cache was not flushed",
                     getattr(client, "url", "?"), ref.version)
    return version
