"""A published policy version as registered host buffers that engines read over Mooncake.

Why a pull: after a burst the core publishes one policy version and every rollout engine must load
it, at its own pace (an engine may still be finishing a request). A one-sided read needs nothing
from the publisher but its buffer staying registered, so training never waits for the slowest
engine, and K engines can pull the same bytes without a collective they would all have to join.

Who publishes: every process that holds part of the model in the serving layout (each pipeline
stage of the core, on its own node) registers its own part with :class:`WeightPublisher`; no
process ever holds the whole model for a publication. One part's layout (one contiguous,
registered host buffer)::

    [tensor 0 | pad | tensor 1 | pad | ... | manifest JSON]

Each tensor starts on a 64-byte boundary; the manifest lists name, dtype, shape, offset and byte
count of every tensor. A part's location is a small JSON object (format tag, Mooncake session
``host:port``, buffer address and size, where the manifest is, a CRC32 of the whole buffer); a
version's :class:`~gyre_core.interfaces.WeightsRef` ``location`` is one part's location, or
:func:`compose`'s list of them, so it travels through the run's events and journal unchanged.

The engine side (:class:`WeightPuller`, run by the SGLang custom weight loader of ``gyre-sglang``)
reads every part into one registered staging buffer of its own and refuses the version unless
each part's CRC32 and manifest check out and no tensor appears twice, *before* any parameter is
touched: a torn, partial or failed pull leaves the engine on its previous version.

The same two classes carry the core's parameters to a satellite that joins a running step
(``gyre_megatron.transfer``): one weight format, one verification, for both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from gyre_core.interfaces import WeightsRef
from gyre_core.transfer_endpoint import HOST_ENV, MooncakeEndpoint, MooncakeError, Registrations, read, start_transfer_engine

__all__ = [
    "FORMAT",
    "PARTS_FORMAT",
    "Location",
    "ManifestEntry",
    "PublicationError",
    "PulledWeights",
    "WeightPublisher",
    "WeightPuller",
    "compose",
    "parse_location",
    "parse_parts",
]

FORMAT = "gyre.mooncake.v1"
"""Format tag of a location produced by :class:`WeightPublisher`."""

PARTS_FORMAT = "gyre.mooncake.parts.v1"
"""Format tag of a version published in parts (:func:`compose`), each part a :data:`FORMAT` location."""

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


def compose(version: int, parts: Sequence[str], *, partial: bool = False) -> str:
    """The location of ``version`` published in ``parts`` (each a part's location, e.g. one per
    pipeline stage): the part itself when there is one, else a list the puller reads in order.
    ``partial``: the parts together are still a subset of the model's tensors."""
    locs = [parse_location(p) for p in parts]
    if not locs:
        raise PublicationError(f"version {version}: no part to publish")
    if any(loc.version != version for loc in locs):
        raise PublicationError(f"version {version}: parts of versions {sorted({loc.version for loc in locs})}")
    if len(locs) == 1 and locs[0].partial == partial:
        return parts[0]
    return json.dumps({"format": PARTS_FORMAT, "version": version, "partial": partial,
                       "parts": [json.loads(p) for p in parts]}, separators=(",", ":"))


def parse_parts(location: str) -> list[Location]:
    """Every part of a version's location (one, for a location that is not :func:`compose`'s)."""
    return _parse_version(location)[0]


def _parse_version(location: str) -> tuple[list[Location], bool]:
    """A version's parts and its own ``partial`` flag (the composite's, or its one part's)."""
    try:
        d = json.loads(location)
    except ValueError as e:
        raise PublicationError(f"malformed weights location: {e}: {location[:200]!r}") from e
    if not (isinstance(d, dict) and d.get("format") == PARTS_FORMAT):
        loc = parse_location(location)
        return [loc], loc.partial
    parts = d.get("parts")
    if not isinstance(parts, list) or not parts:
        raise PublicationError(f"weights location without parts: {location[:200]!r}")
    locs = [parse_location(json.dumps(p)) for p in parts]
    if any(loc.version != d.get("version") for loc in locs):
        raise PublicationError(f"inconsistent weights location (parts of other versions): {location[:200]!r}")
    return locs, bool(d.get("partial", False))


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
    """One lazily created Mooncake engine (init takes milliseconds; many processes never need one)
    and the memory registered with it. ``engine``: a process's shared engine instead (a training
    rank publishes versions and exposes its parameters to satellites from one engine)."""

    def __init__(self, host: str | MooncakeEndpoint | None = None, engine: Callable[[], Any] | None = None) -> None:
        self.endpoint = _endpoint(host)
        self.host = self.endpoint.host
        self._engine: Any = None
        self._shared_engine = engine
        self._memory = Registrations(lambda: self.engine)
        self._lock = threading.Lock()

    def _register(self, addr: int, nbytes: int, what: str) -> None:
        try:
            self._memory.register(addr, nbytes)
        except MooncakeError as e:
            raise PublicationError(f"{e} for {what}") from None

    @property
    def engine(self) -> Any:
        if self._engine is None:
            self._engine = self._shared_engine() if self._shared_engine is not None else _new_engine(self.endpoint)
        return self._engine


class WeightPublisher(_MooncakeSide):
    """Core side: one Mooncake engine; each :meth:`publish` fills a new registered buffer.

    A version's buffer stays registered (and readable by engines) until :meth:`release` is called
    for it, so an engine still pulling version v is never torn by the publication of v+1. The
    caller releases a version once every engine reports a newer one.
    """

    def __init__(self, host: str | MooncakeEndpoint | None = None, engine: Callable[[], Any] | None = None) -> None:
        super().__init__(host, engine)
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
            self._register(addr, total, f"version {version}")
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
            if p is not None:
                self._memory.unregister(p.location.addr)

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

    def __init__(self, host: str | MooncakeEndpoint | None = None, engine: Callable[[], Any] | None = None) -> None:
        super().__init__(host, engine)
        self._staging: torch.Tensor | None = None

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                self._memory.unregister(self._staging.data_ptr())
                self._staging = None
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._register(buf.data_ptr(), nbytes, "the staging buffer")
            self._staging = buf
        return self._staging

    def pull(self, location: str) -> PulledWeights:
        """Read a published version, every part of it, and verify each part (CRC32, manifest) and
        the whole (no tensor twice); raise on any mismatch before anything is handed out."""
        locs, partial = _parse_version(location)
        starts, total = [], 0
        for loc in locs:  # each part on its own aligned region of one staging buffer
            starts.append(total)
            total += (loc.nbytes + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            staging = self._staging_for(total)
            entries: list[ManifestEntry] = []
            t0 = time.perf_counter()
            for loc, base in zip(locs, starts):
                rc = read(self.engine, loc.session, [staging.data_ptr() + base], [loc.addr], [loc.nbytes])
                if rc != 0:
                    raise PublicationError(
                        f"Mooncake read of version {loc.version} from {loc.session} failed (rc={rc}): "
                        "the publisher is gone or no longer exposes this version")
                got = _crc32(staging[base:], loc.nbytes)
                if got != loc.crc32:
                    raise PublicationError(
                        f"version {loc.version}: CRC32 mismatch after the pull from {loc.session} "
                        f"({got:#010x} != {loc.crc32:#010x}); torn or corrupted read")
                raw = staging[base + loc.manifest_offset:base + loc.nbytes].numpy().tobytes()
                entries += [dataclasses.replace(e, offset=e.offset + base) for e in _parse_manifest(raw, loc)]
            pull_s = time.perf_counter() - t0
            names = [e.name for e in entries]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise PublicationError(f"version {locs[0].version}: tensors in more than one part: {twice[:5]}")
            return PulledWeights(locs[0].version, entries, partial, staging[:total], pull_s)

    def close(self) -> None:
        self._memory.release_all()
        self._staging = None
        self._engine = None
