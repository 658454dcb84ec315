"""Satellite weight pull: the core's parameters for one step, read by a joining satellite.

A joining satellite must not interrupt the core, which is mid-batch: a collective broadcast would
need every member of the prefix group to take part, including satellites busy with their own
micro-steps. A one-sided read needs nobody: the core *exposes* its parameters once per step and
publishes where they are in the ranks' c10d store, and the satellite *pulls* them.

The bytes travel the way a published policy version does (:mod:`gyre_core.published_weights`):
the core copies its parameters into one registered host buffer with a manifest and a CRC32 (a
pinned buffer on a GPU: the Mooncake build Gyre depends on registers host memory only), and the
satellite reads that buffer into its own registered staging buffer and verifies the CRC32, the
manifest and every tensor's shape and dtype *before* it touches a parameter. The copy is a valid
snapshot for the whole join window whatever the core does next. One Mooncake engine per rank
serves both this and the rank's part of each publication.

Cost: one pass over the parameters on the core per step (a device-to-host copy on a GPU, which a
register-in-place design would need as well), and on a joining satellite one read plus a copy into
its parameters; both buffers go when the window ends (:meth:`SatelliteWeights.release`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from gyre_core.published_weights import PublicationError, WeightPublisher, WeightPuller, parse_parts
from gyre_core.transfer_endpoint import MooncakeEndpoint, start_transfer_engine

__all__ = ["SatelliteWeights"]


class SatelliteWeights:
    """One rank's side of the satellite pull, on the rank's Mooncake engine (created lazily: init
    takes milliseconds).

    ``endpoint`` is where this rank's engine listens: the address of its own node that the other
    ranks reach (the core's location names it; a satellite reads from whatever the core
    advertised), and the protocol (``tcp``, or ``rdma`` with its devices)."""

    def __init__(self, store: Any, endpoint: MooncakeEndpoint | None = None) -> None:
        self.store = store
        self.endpoint = endpoint or MooncakeEndpoint()
        self._engine: Any = None
        self._exposed = WeightPublisher(self.endpoint, engine=lambda: self.engine)
        self._puller = WeightPuller(self.endpoint, engine=lambda: self.engine)
        self.last_peer = ""
        """The Mooncake session the last :meth:`pull` read from (the core's advertised address)."""

    @property
    def engine(self) -> Any:
        if self._engine is None:
            self._engine = start_transfer_engine(self.endpoint)
        return self._engine

    def release(self) -> None:
        """End the window: the core's exposed copy and a satellite's staging buffer are
        unregistered and freed."""
        self._exposed.close()
        self._puller.close()

    def expose(self, key: str, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Core: copy ``tensors`` into a registered buffer and publish its location under ``key``."""
        self.release()  # the previous window's copy goes first (a step redone after a failure too)
        ref = self._exposed.publish(step, {str(i): t for i, t in enumerate(tensors)}, partial=True)
        self.store.set(key, ref.location)

    def pull(self, key: str, tensors: Sequence[torch.Tensor]) -> tuple[int, float]:
        """Satellite: read what the core exposed under ``key`` into ``tensors``, verified first;
        return (bytes read, seconds)."""
        t0 = time.monotonic()
        got = self.store.get(key)
        location = got.decode() if isinstance(got, bytes) else str(got)
        try:
            pulled = dict(self._puller.pull(location).tensors())
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
        finally:
            self._puller.close()  # the staging buffer lives for one pull
        self.last_peer = parse_parts(location)[0].session
        return nbytes, time.monotonic() - t0
