"""Satellite weight pull: the core's parameters for one step, read by a joining satellite.

A joining satellite must not interrupt the core, which is mid-batch: a collective broadcast would
need every member of the prefix group to take part, including satellites busy with their own
micro-steps. A one-sided read needs nobody: the core *exposes* its parameters once per step and
publishes where they are in the ranks' c10d store, and the satellite *pulls* them.

The bytes travel through the run's weight transport (:mod:`gyre_core.weight_parts`, chosen by
``publication.transport``), the seam a publication's parts go through as well: over Mooncake the
core copies its parameters into one registered host buffer with a manifest and a CRC32 (a pinned
buffer on a GPU: the Mooncake build Gyre depends on registers host memory only) and the
satellite reads it into a staging buffer of its own; on disk the core writes one safetensors
file into a folder every node sees. Either way the satellite verifies the bytes (CRC32), then
every tensor's count, shape and dtype, *before* it touches a parameter, and the copy is a valid
snapshot for the whole join window whatever the core does next. Over Mooncake one engine per
rank serves both this and the rank's part of each publication.

Cost: one pass over the parameters on the core per step (a device-to-host copy on a GPU, which a
register-in-place design would need as well), and on a joining satellite one read plus a copy into
its parameters; what was exposed goes when the window ends (:meth:`SatelliteWeights.release`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from gyre_core.published_weights import PublicationError
from gyre_core.weight_parts import WeightParts

__all__ = ["SatelliteWeights"]


class SatelliteWeights:
    """One rank's side of the satellite pull, through ``parts`` (the run's weight transport) and
    the ranks' c10d ``store``, where the core says where its parameters are."""

    def __init__(self, store: Any, parts: WeightParts) -> None:
        self.store = store
        self.parts = parts
        self.last_peer = ""
        """Where the last :meth:`pull` read from (the core's advertised Mooncake session, or its file)."""

    def release(self) -> None:
        """End the window: the core's exposed copy goes (a satellite keeps nothing between pulls)."""
        self.parts.close()

    def expose(self, key: str, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Core: put a copy of ``tensors`` and publish its location under ``key``."""
        self.release()  # the previous window's copy goes first (a step redone after a failure too)
        self.store.set(key, self.parts.put(step, {str(i): t for i, t in enumerate(tensors)}))

    def pull(self, key: str, tensors: Sequence[torch.Tensor]) -> tuple[int, float]:
        """Satellite: read what the core exposed under ``key`` into ``tensors``, verified first;
        return (bytes read, seconds)."""
        t0 = time.monotonic()
        got = self.store.get(key)
        location = got.decode() if isinstance(got, bytes) else str(got)
        try:
            with self.parts.pulled(location) as pulled:
                if sorted(pulled, key=int) != [str(i) for i in range(len(tensors))]:
                    raise PublicationError(f"layout mismatch ({len(pulled)} tensors exposed, {len(tensors)} here)")
                for i, t in enumerate(tensors):
                    src = pulled[str(i)]
                    if src.shape != t.shape or src.dtype != t.dtype:
                        raise PublicationError(f"tensor {i}: exposed {src.dtype} {tuple(src.shape)}, "
                                               f"here {t.dtype} {tuple(t.shape)}")
                nbytes = sum(src.numel() * src.element_size() for src in pulled.values())
                for i, t in enumerate(tensors):
                    t.copy_(pulled[str(i)])
        except PublicationError as e:
            raise RuntimeError(f"{key}: {e}") from e
        self.last_peer = self.parts.source(location)
        return nbytes, time.monotonic() - t0
