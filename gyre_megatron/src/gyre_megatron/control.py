"""The control plane between the orchestrator and ranks that a cluster launcher started.

On one machine the orchestrator spawns the ranks itself and talks to them through
``multiprocessing`` queues (:class:`~gyre_megatron.launch.World`). On a cluster the ranks are
started by the launcher the site already uses -- ``torchrun`` on every node -- and reach back to
the orchestrator over TCP: :class:`ControlServer` runs in the orchestrator's process and each rank
holds one connection to it (:class:`ControlClient`). Over it travel the rank's commands and engine
commands, its answers, its beats, and its claims on the orchestrator's micro-step queues, which
stay real :class:`~gyre_core.dataplane.microstep_queue.MicroStepQueue` objects in the orchestrator
(each micro-step is still handed out exactly once).

The wire (:mod:`gyre_megatron.wire`) carries no pickle: a connection must first prove the per-run
key (mutual HMAC over fresh nonces, fixed-size messages, a handshake deadline), and only then are
its length-prefixed frames of JSON and raw tensor bytes read, each bounded in size. A peer that
fails any of it is disconnected without an answer (no traceback ever reaches a peer); idle
connections that never authenticate time out on their own thread, so they cannot keep ranks from
joining. The key file is 0600 and the server binds loopback unless told otherwise.

Ranks beat every second; a rank that has not beaten for ``dead_after_s`` is dead to the
orchestrator, and a rank whose connection closes (the orchestrator is gone) exits, so a killed
orchestrator leaves no ranks (and, through them, no engines) behind on any node.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gyre_core.dataplane.microstep_queue import MicroStepQueue
from gyre_megatron.wire import AuthenticationFailed, WireError, client_handshake, read_frame, server_handshake, write_frame

__all__ = ["AuthenticationFailed", "ControlClient", "ControlServer", "read_key", "write_key"]

KEY_ENV = "GYRE_CONTROL_KEY_FILE"
ADDRESS_ENV = "GYRE_CONTROL"
HELLO_MAX_BYTES = 64 * 1024
"""A rank's first frame (its rank and world size) is small: nothing bigger is read."""

log = logging.getLogger("gyre.control")


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
    """The key in ``path``, refused when anyone but its owner may read or write it, when its owner
    is not this process's user, or when it is a symlink: a key others can read lets them drive the
    ranks, and a key someone else planted (0600 but theirs, in a shared folder) would let them
    impersonate the orchestrator to the ranks."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"control key {path}: cannot be opened ({e.strerror}; a symlink is refused)") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise ValueError(f"control key {path} is owned by uid {st.st_uid}, not by this process's user "
                             f"(uid {os.geteuid()}): a key someone else owns is refused")
        mode = st.st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"control key {path} has mode {mode:o}: only its owner may read it (chmod 600)")
        key = f.read().strip()
    if len(key) < 32:
        raise ValueError(f"control key in {path} is too short")
    return key.encode()


class _Hub:
    """The orchestrator's side of every rank: outboxes, answers, micro-step queues, beats."""

    def __init__(self, size: int, opts: Any) -> None:
        self.size = size
        self.opts = opts
        self.outbox = [queue.Queue() for _ in range(size)]  # type: ignore[var-annotated]
        self.results: queue.Queue[Any] = queue.Queue()
        self.microsteps: dict[int, MicroStepQueue[Any]] = {}
        self.beats: dict[int, float] = {}
        self.refused: list[str] = []
        self.lock = threading.Lock()

    def hello(self, rank: Any, world_size: Any) -> str | None:
        """Why a rank reporting in is refused, or ``None`` (then it counts as joined)."""
        if not (isinstance(rank, int) and isinstance(world_size, int)):
            return "a hello needs an integer rank and world size"
        why = None
        if world_size != self.size:
            why = f"this run needs a world of {self.size} rank(s) (cells × tp × pp); the launcher started {world_size}"
        elif not 0 <= rank < self.size:
            why = f"rank {rank} outside 0..{self.size - 1}"
        with self.lock:
            if why is None and rank in self.beats:
                return f"rank {rank} has already joined"
            if why is not None:
                self.refused.append(why)  # the orchestrator fails its wait with this, at once
                return why
            self.beats[rank] = time.monotonic()
        return None

    def microstep_queue(self, index: int) -> MicroStepQueue[Any]:
        with self.lock:
            if index not in self.microsteps:
                self.microsteps[index] = MicroStepQueue()
            return self.microsteps[index]


class _Connection:
    """One socket with a send lock: frames from several threads never interleave."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            write_frame(self.sock, obj)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ControlServer:
    """The orchestrator's end: serve ranks on ``(host, port)`` until :meth:`close`.

    ``handshake_timeout_s`` bounds how long a connection may take to prove the key (each waits on
    its own thread, so idle connections cost a thread, not the accept loop);
    ``max_frame_bytes`` bounds every frame after it (a micro-step or an answer with tensors);
    ``idle_timeout_s`` drops an authenticated rank that stopped sending (it beats every second)."""

    def __init__(self, size: int, opts: Any, host: str, port: int, key: bytes, *, handshake_timeout_s: float = 5.0,
                 idle_timeout_s: float = 30.0, max_frame_bytes: int = 1 << 30, max_pending: int = 512) -> None:
        self.hub = _Hub(size, opts)
        self._key = key
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._max_pending = max_pending
        self._pending = threading.BoundedSemaphore(max_pending)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=min(socket.SOMAXCONN, 1024))
        self._sock.settimeout(1.0)  # the accept loop looks at the closed flag at least this often
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[_Connection] = set()
        self._conns_lock = threading.Lock()
        self._rejected_lock = threading.Lock()
        self.rejected = 0
        """Connections closed before they proved the key (wrong key, garbage, timeouts, overflow)."""
        self._thread = threading.Thread(target=self._accept, daemon=True, name="gyre-control")
        self._thread.start()

    # what the orchestrator calls
    def send_command(self, rank: int, message: tuple[Any, ...]) -> None:
        """``(seq, method, args, kwargs)`` to rank ``rank`` (kept until it joins)."""
        self.hub.outbox[rank].put(("cmd", message))

    def send_engine(self, rank: int, message: tuple[Any, ...]) -> None:
        """``(seq, op, args, kwargs)`` for the engine thread of rank ``rank``."""
        self.hub.outbox[rank].put(("engine", message))

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
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (a close alone does not)
        except OSError:
            pass
        self._sock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:  # ranks see their connection close: they exit
            c.close()
        for box in self.hub.outbox:
            box.put((None, None))
        self._thread.join(5)

    # serving
    def _reject(self) -> None:
        with self._rejected_lock:  # shared by the connection threads
            self.rejected += 1

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
                sock.settimeout(self.handshake_timeout_s)
            except OSError:  # a timeout of the loop's own, or the listener closed
                if self._closed.is_set():
                    return
                continue
            if not self._pending.acquire(blocking=False):
                self._reject()  # more handshakes in flight than anyone honest needs
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), daemon=True, name="gyre-control-peer").start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _Connection(sock)
        rank: int | None = None
        try:
            try:
                sock.settimeout(self.handshake_timeout_s)
                server_handshake(sock, self._key)
                hello = read_frame(sock, HELLO_MAX_BYTES)
            except (AuthenticationFailed, WireError, OSError):
                self._reject()
                return  # no answer to a peer that did not prove the key
            finally:
                self._pending.release()
            if not (isinstance(hello, dict) and hello.get("op") == "hello"):
                return
            why = self.hub.hello(hello.get("rank"), hello.get("world_size"))
            if why is not None:
                conn.send({"op": "refused", "error": why})
                return
            rank = int(hello["rank"])
            sock.settimeout(self.idle_timeout_s)
            with self._conns_lock:
                self._conns.add(conn)
            conn.send({"op": "welcome", "opts": self.hub.opts})
            threading.Thread(target=self._send_outbox, args=(rank, conn), daemon=True,
                             name=f"gyre-control-out{rank}").start()
            self._read(rank, conn)
        except (WireError, OSError) as e:
            if rank is not None and not self._closed.is_set():
                log.warning("control connection of rank %s closed: %s", rank, e)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _send_outbox(self, rank: int, conn: _Connection) -> None:
        box = self.hub.outbox[rank]
        while True:
            kind, message = box.get()
            if kind is None:
                return
            try:
                conn.send({"op": kind, "m": message})
            except (OSError, TypeError) as e:
                log.warning("rank %d: command not sent: %s", rank, e)
                return

    def _read(self, rank: int, conn: _Connection) -> None:
        while not self._closed.is_set():
            msg = read_frame(conn.sock, self.max_frame_bytes)
            op = msg.get("op") if isinstance(msg, dict) else None
            if op == "beat":
                with self.hub.lock:
                    self.hub.beats[rank] = time.monotonic()
            elif op == "result":  # answered for its own rank only: a rank cannot speak for another
                self.hub.results.put((rank, msg.get("seq"), bool(msg.get("ok")), msg.get("payload")))
                with self.hub.lock:
                    self.hub.beats[rank] = time.monotonic()
            elif op in ("claim", "unclaimed") and isinstance(msg.get("queue"), int) and isinstance(msg.get("id"), int):
                threading.Thread(target=self._answer_claim, args=(conn, msg), daemon=True).start()
            else:
                conn.send({"op": "error", "error": "unknown message"})
                return

    def _answer_claim(self, conn: _Connection, msg: dict[str, Any]) -> None:
        q = self.hub.microstep_queue(int(msg["queue"]))
        reply: dict[str, Any] = {"op": "answer", "id": msg["id"]}
        if msg["op"] == "unclaimed":
            reply["n"] = q.unclaimed()
        else:
            timeout = msg.get("timeout")
            timeout = None if timeout is None else max(0.0, float(timeout))
            try:
                item = q.claim(timeout)
                reply.update(status="end" if item is None else "item", item=item)
            except queue.Empty:
                reply["status"] = "empty"
        try:
            conn.send(reply)
        except (OSError, TypeError) as e:  # a claimed item whose answer never left is the step's loss: say so
            log.warning("micro-step answer not sent: %s", e)


_LOST = object()


class _Inbox:
    """Commands for a rank; ``get`` raises :class:`ConnectionError` once the orchestrator is gone."""

    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def get(self) -> Any:
        item = self._q.get()
        if item is _LOST:
            self._q.put(_LOST)
            raise ConnectionError("the orchestrator's control connection closed")
        return item


class _Answers:
    """A rank's answers, sent as they are put: ``put((rank, seq, ok, payload))``."""

    def __init__(self, client: "ControlClient") -> None:
        self._client = client

    def put(self, answer: tuple[int, int, bool, Any]) -> None:
        _, seq, ok, payload = answer
        try:
            self._client._conn.send({"op": "result", "seq": seq, "ok": ok, "payload": payload})
        except TypeError as e:  # the answer holds something the wire does not carry: a failure, said
            self._client._conn.send({"op": "result", "seq": seq, "ok": False, "payload": f"TypeError: {e}"})


class ControlClient:
    """A rank's end: connect, prove the key, report in, and keep beating until :meth:`close`."""

    def __init__(self, host: str, port: int, key: bytes, rank: int, world_size: int,
                 connect_timeout_s: float = 120.0, on_lost: Callable[[], None] | None = None,
                 max_frame_bytes: int = 1 << 30) -> None:
        """``on_lost`` is called once when the orchestrator's connection closes or beats fail for
        5 s; a rank process passes one that exits, so nothing outlives its orchestrator.
        :class:`AuthenticationFailed` if the key is wrong, :class:`ValueError` if refused."""
        self._on_lost = on_lost
        self._stopped = threading.Event()
        self._lost_once = threading.Lock()
        self._lost = False
        self.max_frame_bytes = max_frame_bytes
        deadline = time.monotonic() + connect_timeout_s
        while True:
            sock = None
            try:
                sock = socket.create_connection((host, port), timeout=10.0)
                client_handshake(sock, key)
                write_frame(sock, {"op": "hello", "rank": rank, "world_size": world_size})
                reply = read_frame(sock, max_frame_bytes)
                break
            except AuthenticationFailed:
                if sock is not None:
                    sock.close()
                raise
            except (OSError, WireError):
                if sock is not None:
                    sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        if not isinstance(reply, dict) or reply.get("op") != "welcome":
            sock.close()
            raise ValueError(reply.get("error", "refused") if isinstance(reply, dict) else "refused")
        sock.settimeout(None)
        self._conn = _Connection(sock)
        self.host = host
        """The orchestrator's address this rank dialed (a peer every service of this node can route to)."""
        self.rank = rank
        self.opts = reply.get("opts")
        self.cmd = _Inbox()
        self.engine_cmd = _Inbox()
        self.results = _Answers(self)
        self.queues = _RemoteQueues(self)
        self._ids = itertools.count()
        self._waiting: dict[int, list[Any]] = {}  # id -> [Event, answer]
        self._waiting_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name="gyre-control-in")
        self._reader.start()
        self._beating = threading.Thread(target=self._beat, daemon=True, name="gyre-beat")
        self._beating.start()

    def _read(self) -> None:
        try:
            while True:
                msg = read_frame(self._conn.sock, self.max_frame_bytes)
                op = msg.get("op") if isinstance(msg, dict) else None
                if op == "cmd":
                    self.cmd.put(tuple(msg["m"]))
                elif op == "engine":
                    self.engine_cmd.put(tuple(msg["m"]))
                elif op == "answer":
                    with self._waiting_lock:
                        slot = self._waiting.get(msg.get("id"))  # type: ignore[arg-type]
                    if slot is not None:
                        slot[1] = msg
                        slot[0].set()
                else:
                    raise WireError(f"unexpected message {op!r}")
        except (OSError, WireError, KeyError, TypeError) as e:
            if not self._stopped.is_set():
                log.warning("rank %d: control connection lost: %s", self.rank, e)
        self._gone()

    def _gone(self) -> None:
        with self._lost_once:
            if self._lost:
                return
            self._lost = True
        self.cmd.put(_LOST)
        self.engine_cmd.put(_LOST)
        with self._waiting_lock:
            for slot in self._waiting.values():
                slot[0].set()
        if self._on_lost is not None and not self._stopped.is_set():
            self._on_lost()

    def _beat(self) -> None:
        misses = 0
        while not self._stopped.wait(1.0) and not self._lost:
            try:
                self._conn.send({"op": "beat"})
                misses = 0
            except OSError:
                misses += 1
                if misses >= 5:
                    self._gone()
                    return

    def ask(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """One request to the orchestrator and its answer (a micro-step claim, a count)."""
        i = next(self._ids)
        slot: list[Any] = [threading.Event(), None]
        with self._waiting_lock:
            self._waiting[i] = slot
        try:
            self._conn.send({**message, "id": i})
            # the orchestrator answers a claim within its timeout; the margin covers the round trip
            if not slot[0].wait(None if timeout is None else timeout + 30.0) or slot[1] is None:
                raise ConnectionError("no answer from the orchestrator's control connection")
            return slot[1]  # type: ignore[no-any-return]
        finally:
            with self._waiting_lock:
                self._waiting.pop(i, None)

    def close(self) -> None:
        """Stop beating and hang up (the orchestrator then sees this rank go silent)."""
        self._stopped.set()
        self._conn.close()


class _RemoteMicroSteps:
    """A rank's view of one of the orchestrator's micro-step queues (claims by value)."""

    def __init__(self, client: ControlClient, index: int) -> None:
        self._client, self._index = client, index

    def claim(self, timeout: float | None = None) -> Any:
        answer = self._client.ask({"op": "claim", "queue": self._index, "timeout": timeout}, timeout)
        status = answer.get("status")
        if status == "empty":
            raise queue.Empty
        if status == "end":
            return None
        if status != "item":
            raise WireError(f"unexpected claim answer {status!r}")
        return answer.get("item")

    def unclaimed(self) -> int:
        return int(self._client.ask({"op": "unclaimed", "queue": self._index}, 30.0)["n"])


class _RemoteQueues:
    """``queues[i]`` on a rank: the orchestrator's micro-step queue ``i``."""

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        self._cache: dict[int, _RemoteMicroSteps] = {}

    def __getitem__(self, index: int) -> _RemoteMicroSteps:
        if index not in self._cache:
            self._cache[index] = _RemoteMicroSteps(self._client, index)
        return self._cache[index]
