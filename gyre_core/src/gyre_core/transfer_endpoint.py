"""Gyre's one Mooncake helper: where a process's Transfer Engine listens, and the calls made on it.

Three kinds of process open a Mooncake engine in a run: the orchestrator (it registers each
published policy version), every training rank (the core exposes its parameters to satellites that
join a running step) and every SGLang engine (it pulls published versions, and KV caches on a
hand-off). A peer reads from the address the owner *advertised*, so on a cluster each process must
advertise an address of its own node that the others reach -- never a loopback it assumed.

The endpoint travels to child processes as three environment variables (:data:`HOST_ENV`,
:data:`PROTOCOL_ENV`, :data:`DEVICE_ENV`); :func:`advertised_host` finds a node's address when none
is configured. Mooncake itself is imported only when an engine is started.

Every Mooncake call Gyre makes goes through here: :func:`start_transfer_engine`,
:class:`Registrations` (memory registered with an engine, each region once, every one released)
and :func:`read` (one-sided reads). Two users build on them: weights, in one format
(:mod:`gyre_core.published_weights`: a policy version published to the engines, and the core's
parameters a joining satellite pulls, ``gyre_megatron.transfer``), and the KV hand-off
(``gyre_sglang``'s server plugin).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ADVERTISE_ENV", "DEVICE_ENV", "HOST_ENV", "PROTOCOLS", "PROTOCOL_ENV", "WILDCARDS", "MooncakeEndpoint",
           "MooncakeError", "Registrations", "advertised_host", "read", "start_transfer_engine"]

HOST_ENV = "GYRE_MOONCAKE_HOST"
"""The address this node's Mooncake engines advertise (set it per node where the automatic one is wrong)."""
PROTOCOL_ENV = "GYRE_MOONCAKE_PROTOCOL"
DEVICE_ENV = "GYRE_MOONCAKE_DEVICE"
"""RDMA device list handed to Mooncake (e.g. ``mlx5_0,mlx5_1``); empty for TCP."""
ADVERTISE_ENV = "GYRE_ADVERTISE_HOST"
"""This node's address for every service it offers (engine URLs, Mooncake), if set."""

PROTOCOLS = ("tcp", "rdma")


WILDCARDS = ("0.0.0.0", "::", "")
"""Bind addresses that mean "every interface": never an address a peer can dial."""


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _node_address() -> str:
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def advertised_host(peer: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The address of this node that ``peer`` (e.g. the orchestrator's control host) reaches.

    Order: :data:`HOST_ENV`, then :data:`ADVERTISE_ENV`, then -- toward a peer on another host --
    the local address of the kernel's route to it (a UDP ``connect`` sends nothing), and loopback
    for a peer on this machine or when no peer is known. A wildcard peer (a control plane bound
    to every interface) gives this node's own address.
    """
    env = os.environ if environ is None else environ
    for name in (HOST_ENV, ADVERTISE_ENV):
        if env.get(name):
            return str(env[name])
    if peer is not None and peer in WILDCARDS:
        return _node_address()
    if not peer or _loopback(peer):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
    except OSError:
        return _node_address()


@dataclass(frozen=True)
class MooncakeEndpoint:
    """One process's Mooncake engine: the host it advertises, the protocol and RDMA devices."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"Mooncake protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if not self.host:
            raise ValueError("a Mooncake endpoint needs the host its peers reach")

    @classmethod
    def from_env(cls, peer: str | None = None, environ: Mapping[str, str] | None = None) -> "MooncakeEndpoint":
        """This process's endpoint as its parent configured it (see the module docstring)."""
        env = os.environ if environ is None else environ
        return cls(advertised_host(peer, env), env.get(PROTOCOL_ENV) or "tcp", env.get(DEVICE_ENV, ""))

    def env(self) -> dict[str, str]:
        """The variables that give a child process this endpoint (and Mooncake's TCP bind address)."""
        return {HOST_ENV: self.host, PROTOCOL_ENV: self.protocol, DEVICE_ENV: self.device,
                "MC_TCP_BIND_ADDRESS": self.host}


def start_transfer_engine(endpoint: MooncakeEndpoint) -> Any:
    """A Mooncake ``TransferEngine`` in peer-to-peer handshake mode, listening on ``endpoint``."""
    from gyre_core.upstream_noise import mooncake_quiet_env, native_stderr_filtered

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", endpoint.host)
    mooncake_quiet_env()
    from mooncake.engine import TransferEngine

    with native_stderr_filtered() as printed:
        engine = TransferEngine()
        rc = engine.initialize(endpoint.host, "P2PHANDSHAKE", endpoint.protocol, endpoint.device)
    if rc != 0:
        said = "; ".join(line for line in printed if line.strip())[-2000:]
        raise RuntimeError(f"Mooncake TransferEngine.initialize({endpoint.host!r}, {endpoint.protocol!r}) failed ({rc})"
                           + (f": {said}" if said else ""))
    return engine


class MooncakeError(RuntimeError):
    """A Mooncake call failed; the message names the call and its return code."""


class Registrations:
    """The memory regions registered with one process's Mooncake engine.

    A region is registered once however often it is exposed, and :meth:`release_all` unregisters
    every one (storages may move: an offload round trip, a resized buffer). ``engine`` is called
    for the engine when one is needed, so a process that never registers never starts one.
    """

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self._regions: dict[int, int] = {}

    def __contains__(self, addr: int) -> bool:
        return addr in self._regions

    def register(self, addr: int, nbytes: int) -> None:
        if addr in self._regions:
            return
        rc = self._engine().register_memory(addr, nbytes)
        if rc != 0:
            raise MooncakeError(f"Mooncake register_memory failed at {addr:#x} ({nbytes} bytes, rc={rc})")
        self._regions[addr] = nbytes

    def unregister(self, addr: int) -> None:
        if self._regions.pop(addr, None) is not None:
            self._engine().unregister_memory(addr)

    def release_all(self) -> None:
        for addr in list(self._regions):
            self.unregister(addr)


def read(engine: Any, session: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> int:
    """One-sided reads from the peer engine at ``session`` (``host:rpc_port``): ``lengths[i]``
    bytes at its address ``remote[i]`` into this process's registered ``local[i]``. Returns
    Mooncake's code, 0 when every byte arrived (callers say what a failure means for them)."""
    return int(engine.batch_transfer_sync_read(session, list(local), list(remote), list(lengths)))
