"""One process's tensors of one version, put where other processes pull them.

The seam under every move of weights between Gyre's own processes: a training rank puts its part
of a published policy version for the engines to pull (``gyre_megatron`` over Mooncake), and the
core puts its parameters once per step for a joining satellite to pull
(:mod:`gyre_megatron.transfer`). Two transports stand behind it, chosen by
``publication.transport``:

- :class:`MooncakeParts`: one registered host buffer a version, read one-sided by the puller
  (:mod:`gyre_core.published_weights`: manifest, CRC32); nothing touches a file system.
- :class:`DiskParts`: one safetensors file a version in a folder every puller can read (a shared
  file system across nodes), with the same CRC32 over its bytes.

Either way the puller gets the tensors only once the bytes check out, so a torn or partial read
never reaches a parameter; what the tensors must look like (names, shapes, dtypes) is the
caller's check, since only it knows its own layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from gyre_core.published_weights import PublicationError, WeightPublisher, WeightPuller, parse_parts
from gyre_core.transfer_endpoint import MooncakeEndpoint

__all__ = ["DISK_FORMAT", "DiskParts", "MooncakeParts", "WeightParts"]

DISK_FORMAT = "gyre.disk.v1"


class WeightParts(Protocol):
    """Put tensors as one version's part; pull a part another process put."""

    def put(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """A copy of ``tensors`` exposed as ``version``'s part; returns its location (a string
        that travels through stores, events and journals unchanged)."""
        ...

    def pulled(self, location: str) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]:
        """The tensors at ``location``, verified, for the length of the ``with`` block."""
        ...

    def source(self, location: str) -> str:
        """Where ``location``'s bytes come from (a Mooncake session, a file), for the records."""
        ...

    def release_older_than(self, version: int) -> None:
        """Parts put for versions before ``version`` may go: every reader holds a newer one."""
        ...

    def close(self) -> None:
        """Everything this side put or staged goes."""
        ...


class MooncakeParts:
    """Parts as registered buffers on this process's Mooncake engine (``engine``: the one the
    process shares between its publication and its satellite exposure)."""

    def __init__(self, endpoint: MooncakeEndpoint, engine: Callable[[], Any] | None = None) -> None:
        self.endpoint = endpoint
        self.publisher = WeightPublisher(endpoint, engine=engine)
        self._puller = WeightPuller(endpoint, engine=engine)

    def put(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        return self.publisher.publish(version, tensors, partial=True).location

    @contextlib.contextmanager
    def pulled(self, location: str) -> Iterator[Mapping[str, torch.Tensor]]:
        try:
            yield dict(self._puller.pull(location).tensors())  # views into the staging buffer
        finally:
            self._puller.close()  # the staging buffer lives for one pull

    def source(self, location: str) -> str:
        return parse_parts(location)[0].session

    def release_older_than(self, version: int) -> None:
        self.publisher.release_older_than(version)

    def close(self) -> None:
        self.publisher.close()
        self._puller.close()


class DiskParts:
    """Parts as safetensors files under ``folder`` (``v<version>/part-<id>.safetensors``), written
    to a temporary name and renamed, so a reader never sees half a file; the location carries the
    file's size and CRC32, checked before anything is handed out."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._mine: dict[int, list[Path]] = {}
        self._lock = threading.Lock()

    def put(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        from safetensors.torch import save

        if not tensors:
            raise PublicationError("nothing to put")
        data = save({k: t.detach().contiguous().cpu() for k, t in tensors.items()})
        path = self.folder / f"v{version}" / f"part-{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._mine.setdefault(version, []).append(path)
        return json.dumps({"format": DISK_FORMAT, "version": version, "path": str(path.resolve()),
                           "nbytes": len(data), "crc32": zlib.crc32(data)}, separators=(",", ":"))

    @contextlib.contextmanager
    def pulled(self, location: str) -> Iterator[Mapping[str, torch.Tensor]]:
        from safetensors.torch import load

        loc = _disk_location(location)
        try:
            data = Path(loc["path"]).read_bytes()
        except OSError as e:
            raise PublicationError(f"version {loc['version']}: cannot read {loc['path']} ({e.strerror}): the "
                                   "part was released, or this node does not see the folder") from None
        if len(data) != loc["nbytes"] or zlib.crc32(data) != loc["crc32"]:
            raise PublicationError(f"version {loc['version']}: {loc['path']} does not match its location "
                                   f"({len(data)} of {loc['nbytes']} bytes, CRC32 {zlib.crc32(data):#010x} "
                                   f"!= {loc['crc32']:#010x}); torn or overwritten")
        yield load(data)

    def source(self, location: str) -> str:
        return str(_disk_location(location)["path"])

    def release_older_than(self, version: int) -> None:
        self._remove(lambda v: v < version)

    def close(self) -> None:
        self._remove(lambda v: True)

    def _remove(self, which: Callable[[int], bool]) -> None:
        with self._lock:
            paths = [p for v in [v for v in self._mine if which(v)] for p in self._mine.pop(v)]
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()
            with contextlib.suppress(OSError):
                p.parent.rmdir()  # only once the last part of that version is gone


def _disk_location(location: str) -> dict[str, Any]:
    try:
        loc = json.loads(location)
        ok = loc.get("format") == DISK_FORMAT and all(k in loc for k in ("version", "path", "nbytes", "crc32"))
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise PublicationError(f"not a {DISK_FORMAT} location: {location[:200]!r}")
    return loc
