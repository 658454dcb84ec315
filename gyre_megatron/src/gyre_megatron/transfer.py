"""Satellite weight pull over the Mooncake Transfer Engine (TCP on CPU, RDMA on GPUs).

A joining satellite must not interrupt the core, which is mid-batch: a collective broadcast would
need every member of the prefix group to take part, including satellites busy with their own
micro-steps. A one-sided read needs nobody: the core *exposes* its parameters (registers their
memory once per step and publishes the addresses in the c10d store) and the satellite *pulls*
them. The parameters are a valid snapshot for the whole join window because the core only
updates them after the gradient all-reduce, which the satellite itself takes part in after its
pull. A checksum published with the layout lets the satellite refuse a torn or wrong read.

Parameters on a GPU travel through pinned host copies: the Mooncake build Gyre depends on
registers host memory only. The copy costs one device-to-host pass on the core per step and one
host-to-device pass on each joining satellite.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gyre_core.transfer_endpoint import MooncakeEndpoint, Registrations, read, start_transfer_engine

__all__ = ["Exposure", "WeightTransport", "checksum"]


def checksum(tensors: Sequence[torch.Tensor]) -> float:
    """A float64 fingerprint of ``tensors`` (order-sensitive): sum of ``i``-weighted sums."""
    return float(sum((i + 1) * t.detach().double().sum().item() for i, t in enumerate(tensors)))


@dataclass
class Exposure:
    key: str
    addrs: list[int]


class WeightTransport:
    """One Mooncake engine per rank, created lazily (init takes milliseconds).

    ``endpoint`` is where this rank's engine listens: the address of its own node that the other
    ranks reach (the core publishes it with its layout; a satellite reads from whatever the core
    advertised), and the protocol (``tcp``, or ``rdma`` with its devices)."""

    def __init__(self, store: Any, endpoint: MooncakeEndpoint | None = None) -> None:
        self.store = store
        self.endpoint = endpoint or MooncakeEndpoint()
        self._engine: Any = None
        self._registered = Registrations(lambda: self.engine)
        self._staged: list[torch.Tensor] = []
        """Pinned host copies of exposed device tensors (kept until :meth:`release`)."""
        self.last_peer = ""
        """The Mooncake session the last :meth:`pull` read from (the core's advertised address)."""

    @property
    def host(self) -> str:
        return self.endpoint.host

    @property
    def engine(self) -> Any:
        if self._engine is None:
            self._engine = start_transfer_engine(self.endpoint)
        return self._engine

    def _register(self, t: torch.Tensor) -> tuple[int, int]:
        addr, n = t.data_ptr(), t.numel() * t.element_size()
        self._registered.register(addr, n)
        return addr, n

    def release(self) -> None:
        """Unregister everything (storages may move, e.g. after an offload round trip)."""
        self._registered.release_all()
        self._staged = []

    def expose(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Core: make ``tensors`` readable and publish where they are under ``key``."""
        if any(t.is_cuda for t in tensors):
            self.release()  # the previous window's copies go first
            self._staged = [_host_copy(t) for t in tensors]
            tensors = self._staged
        bufs = [self._register(t) for t in tensors]
        peer = f"{self.host}:{self.engine.get_rpc_port()}"
        self.store.set(key, json.dumps({"peer": peer, "bufs": bufs, "checksum": checksum(tensors)}))

    def pull(self, key: str, tensors: Sequence[torch.Tensor]) -> tuple[int, float]:
        """Satellite: read the exposed tensors into ``tensors``; return (bytes, seconds)."""
        t0 = time.monotonic()
        meta = json.loads(self.store.get(key))
        targets = list(tensors)
        staged = any(t.is_cuda for t in targets)
        if staged:  # read into pinned host buffers, then onto the device
            tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in targets]
        if len(meta["bufs"]) != len(tensors):
            raise RuntimeError(f"{key}: layout mismatch ({len(meta['bufs'])} vs {len(tensors)} tensors)")
        local = [self._register(t) for t in tensors]
        for (la, ln), (ra, rn) in zip(local, meta["bufs"]):
            if ln != rn:
                raise RuntimeError(f"{key}: size mismatch {ln} vs {rn}")
        rc = read(self.engine, meta["peer"], [a for a, _ in local], [a for a, _ in meta["bufs"]], [n for _, n in local])
        if rc != 0:
            raise RuntimeError(f"Mooncake read from {meta['peer']} failed ({rc})")
        self.last_peer = str(meta["peer"])
        got = checksum(tensors)
        if abs(got - meta["checksum"]) > 1e-9 * max(1.0, abs(meta["checksum"])):
            raise RuntimeError(f"{key}: checksum mismatch after pull ({got} vs {meta['checksum']})")
        if staged:
            for t, h in zip(targets, tensors):
                t.copy_(h)
            for a, _ in local:  # the host buffers die here: their registration with them
                self._registered.unregister(a)
        return sum(n for _, n in local), time.monotonic() - t0


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
