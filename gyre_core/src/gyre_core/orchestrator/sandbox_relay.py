"""Inside an execution's sandbox: the proxy's address is the only way out, then the harness runs.

``python -m gyre_core.orchestrator.sandbox_relay [--drop-to UID] SOCKET HOST PORT -- ARGV...``
first becomes ``UID`` for good when told to (a root orchestrator's sandbox), loads the system-call
filter (:mod:`gyre_core.orchestrator.sandbox_filter`; the harness's also refuses Unix sockets),
then listens on
``HOST:PORT`` in the sandbox's own network namespace (the proxy's address, so the harness's base
URL is unchanged) and forwards every connection, byte for byte, to the proxy's Unix socket bound
into the sandbox; then it runs ``ARGV`` and ends as it ends: the same exit code, or the same
signal, so the orchestrator can tell a crash from a failure.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            upstream.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


_PR_CAPBSET_DROP = 24


def drop_to(uid: int) -> None:
    """Become ``uid`` (and its gid, no other group) for good, with an empty capability bounding
    set: what a root orchestrator's sandbox does before anything of the harness runs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):  # while CAP_SETPCAP still holds; past the last capability: EINVAL, ignored
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"could not become uid {uid}")


def main(argv: list[str]) -> int:
    drop = None
    if argv[:1] == ["--drop-to"]:
        drop, argv = int(argv[1]), argv[2:]
    if len(argv) < 5 or argv[3] != "--":
        print("usage: sandbox_relay [--drop-to UID] SOCKET HOST PORT -- ARGV...", file=sys.stderr)
        return 2
    path, host, port, cmd = argv[0], argv[1], int(argv[2]), argv[4:]
    from gyre_core.orchestrator.sandbox_filter import apply

    if drop is not None:
        drop_to(drop)
    from gyre_core.scoring.verdict import protect_self

    protect_self()  # the harness (same uid) cannot open the relay's descriptors (Gyre's pipes) via /proc
    apply(harness=False)  # the relay itself connects to the proxy's socket
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    # the harness is forked before any thread starts, so its filter is loaded in a single-threaded
    # process; it then refuses Unix sockets too (the listener is not inherited: close-on-exec)
    pid = os.fork()
    if pid == 0:
        try:
            apply(harness=True)
            os.execvp(cmd[0], cmd)
        except BaseException as exc:  # noqa: BLE001 - nothing may return into the relay's code
            print(f"sandbox_relay: cannot start {cmd[0]!r}: {exc}", file=sys.stderr)
        os._exit(127)
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):  # pass a stop on to the harness
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die of the same signal, so the orchestrator sees a signal death
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # only if the signal did not end this process
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
