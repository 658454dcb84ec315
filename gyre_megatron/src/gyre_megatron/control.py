"""The control plane between the orchestrator and ranks that a cluster launcher started.

On one machine the orchestrator spawns the ranks itself and talks to them through
``multiprocessing`` queues (:class:`~gyre_megatron.launch.World`). On a cluster the ranks are
started by the launcher the site already uses -- ``torchrun`` on every node -- and reach back to
the orchestrator over TCP: :class:`ControlServer` runs in the orchestrator's process (a
``multiprocessing.managers`` server in a thread, authenticated with a per-run key) and hosts the
same objects the local world passes at spawn time: one command queue per rank, one queue for
engine commands per rank, the result queue and the micro-step queues, which stay real
:class:`~gyre_core.dataplane.microstep_queue.MicroStepQueue` objects in the orchestrator (ranks
claim from them through proxies, so each micro-step is still handed out exactly once).

Anyone holding the key can drive the ranks (the protocol is pickle), so the key file is 0600 and
the server binds loopback unless told otherwise. Ranks beat every second; a rank that has not
beaten for ``dead_after_s`` is dead to the orchestrator, and a rank process that cannot beat (the
orchestrator is gone) exits, so a killed orchestrator leaves no ranks (and, through them, no
engines) behind on any node.
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import threading
import time
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any, Callable

from gyre_core.dataplane.microstep_queue import MicroStepQueue

__all__ = ["ControlServer", "ControlClient", "read_key", "write_key"]

KEY_ENV = "GYRE_CONTROL_KEY_FILE"
ADDRESS_ENV = "GYRE_CONTROL"


def write_key(path: str | Path) -> bytes:
    """A fresh per-run key in ``path`` (mode 0600): only who can read it can drive the ranks."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    # O_EXCL | O_NOFOLLOW: never write the key through a symlink someone planted, nor into a file
    # another user already opened (its mode would not be ours)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key.encode()


def read_key(path: str | Path) -> bytes:
    """The key in ``path``, refused when anyone but its owner may read or write it (or it is a
    symlink): a key others can read lets them drive the ranks."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"control key {path}: cannot be opened ({e.strerror}; a symlink is refused)") from None
    with os.fdopen(fd) as f:
        mode = os.fstat(f.fileno()).st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"control key {path} has mode {mode:o}: only its owner may read it (chmod 600)")
        key = f.read().strip()
    if len(key) < 32:
        raise ValueError(f"control key in {path} is too short")
    return key.encode()


class _Hub:
    """What the server hosts; every method runs in the orchestrator's process."""

    def __init__(self, size: int, opts: Any) -> None:
        self.size = size
        self.opts = opts
        self.cmd = [queue.Queue() for _ in range(size)]  # type: ignore[var-annotated]
        self.engine_cmd = [queue.Queue() for _ in range(size)]  # type: ignore[var-annotated]
        self.results: queue.Queue[Any] = queue.Queue()
        self.microsteps: dict[int, MicroStepQueue[Any]] = {}
        self.beats: dict[int, float] = {}
        self.refused: list[str] = []
        self.lock = threading.Lock()

    def hello(self, rank: int, world_size: int) -> Any:
        """A rank reports in; returns the run's rank options (or refuses a wrong world)."""
        why = None
        if world_size != self.size:
            why = f"this run needs a world of {self.size} rank(s) (cells × pp); the launcher started {world_size}"
        elif not 0 <= rank < self.size:
            why = f"rank {rank} outside 0..{self.size - 1}"
        if why is not None:
            with self.lock:
                self.refused.append(why)  # the orchestrator fails its wait with this, at once
            raise ValueError(why)
        with self.lock:
            self.beats[rank] = time.monotonic()
        return self.opts

    def beat(self, rank: int) -> None:
        with self.lock:
            self.beats[rank] = time.monotonic()

    def microstep_queue(self, index: int) -> MicroStepQueue[Any]:
        with self.lock:
            if index not in self.microsteps:
                self.microsteps[index] = MicroStepQueue()
            return self.microsteps[index]


class _ClientManager(BaseManager):
    pass


_METHODS = ("hub", "cmd_queue", "engine_queue", "results", "microstep_queue")
for _name in _METHODS:
    _ClientManager.register(_name)


class ControlServer:
    """The orchestrator's end: serve the hub on ``(host, port)`` until :meth:`close`."""

    def __init__(self, size: int, opts: Any, host: str, port: int, key: bytes) -> None:
        self.hub = _Hub(size, opts)
        hub = self.hub
        # Callables run in this process (the server is not a separate manager process), so
        # closures over the hub are fine; proxies carry their results to the ranks. A class of
        # its own per server: registrations are class state, and two servers must not share them.
        manager_cls: Any = type("_ServerManager", (BaseManager,), {})
        manager_cls.register("hub", callable=lambda: hub, exposed=("hello", "beat"))
        manager_cls.register("cmd_queue", callable=lambda r: hub.cmd[r])
        manager_cls.register("engine_queue", callable=lambda r: hub.engine_cmd[r])
        manager_cls.register("results", callable=lambda: hub.results)
        manager_cls.register("microstep_queue", callable=hub.microstep_queue,
                                exposed=("close", "claim_pickled", "unclaimed"))
        self._manager = manager_cls(address=(host, port), authkey=key)
        self._server = self._manager.get_server()
        self.address: tuple[str, int] = self._server.address
        self._closed = threading.Event()
        self._server.stop_event = self._closed  # the stdlib's per-connection loops watch it
        self._thread = threading.Thread(target=self._serve, daemon=True, name="gyre-control")
        self._thread.start()

    def _serve(self) -> None:
        # The stdlib's serve_forever is made for a manager *process*: it resets sys.stdout and
        # calls sys.exit when stopped. In a thread of the orchestrator, accept here instead; each
        # connection is authenticated and served in its own thread by the stdlib server.
        while not self._closed.is_set():
            try:
                conn = self._server.listener.accept()
            except Exception:
                if self._closed.is_set():
                    return
                continue
            threading.Thread(target=self._server.handle_request, args=(conn,), daemon=True).start()

    def seen_within(self, rank: int, seconds: float) -> bool:
        with self.hub.lock:
            t = self.hub.beats.get(rank)
        return t is not None and time.monotonic() - t <= seconds

    def joined(self) -> list[int]:
        with self.hub.lock:
            return sorted(self.hub.beats)

    def close(self) -> None:
        self._closed.set()
        try:
            self._server.listener.close()
        except OSError:
            pass
        self._thread.join(5)


class ControlClient:
    """A rank's end: connect, report in, and keep beating until :meth:`close`."""

    def __init__(self, host: str, port: int, key: bytes, rank: int, world_size: int,
                 connect_timeout_s: float = 120.0, on_lost: Callable[[], None] | None = None) -> None:
        """``on_lost`` is called once when beats have failed for 5 s (the orchestrator is gone);
        a rank process passes one that exits, so nothing outlives its orchestrator."""
        self._on_lost = on_lost
        self._stopped = threading.Event()
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._manager = _ClientManager(address=(host, port), authkey=key)
                self._manager.connect()
                break
            except (ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        self.host = host
        """The orchestrator's address this rank dialed (a peer every service of this node can route to)."""
        self.rank = rank
        # One proxy, one connection per thread (the stdlib keeps them thread-local): a beat is a
        # message on an open connection, not a new one.
        self._hub = self._manager.hub()
        self.opts = self._hub.hello(rank, world_size)  # raises the hub's ValueError if refused
        self.cmd = self._manager.cmd_queue(rank)
        self.engine_cmd = self._manager.engine_queue(rank)
        self.results = self._manager.results()
        self.queues = _RemoteQueues(self._manager)
        self._beating = threading.Thread(target=self._beat, daemon=True, name="gyre-beat")
        self._beating.start()

    def _beat(self) -> None:
        misses = 0
        while not self._stopped.wait(1.0):
            try:
                self._hub.beat(self.rank)
                misses = 0
            except Exception:
                misses += 1
                if misses >= 5:
                    if self._on_lost is not None:
                        self._on_lost()
                    return

    def close(self) -> None:
        """Stop beating (the orchestrator then sees this rank go silent)."""
        self._stopped.set()


class _RemoteMicroSteps:
    """A rank's view of one of the orchestrator's micro-step queues (claims travel pickled)."""

    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy

    def claim(self, timeout: float | None = None) -> Any:
        raw = self._proxy.claim_pickled(timeout)
        return None if raw is None else pickle.loads(raw)

    def unclaimed(self) -> int:
        return int(self._proxy.unclaimed())


class _RemoteQueues:
    """``queues[i]`` on a rank: the orchestrator's micro-step queue ``i``."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._cache: dict[int, _RemoteMicroSteps] = {}

    def __getitem__(self, index: int) -> _RemoteMicroSteps:
        if index not in self._cache:
            self._cache[index] = _RemoteMicroSteps(self._manager.microstep_queue(index))
        return self._cache[index]
