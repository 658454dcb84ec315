"""Inside an execution's sandbox: the proxy's address is the only way out, then the harness runs.

``python -m gyre_core.orchestrator.sandbox_relay SOCKET HOST PORT -- ARGV...`` listens on
``HOST:PORT`` in the sandbox's own network namespace (the proxy's address, so the harness's base
URL is unchanged) and forwards every connection, byte for byte, to the proxy's Unix socket bound
into the sandbox; then it runs ``ARGV`` and ends as it ends: the same exit code, or the same
signal, so the orchestrator can tell a crash from a failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
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


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print("usage: sandbox_relay SOCKET HOST PORT -- ARGV...", file=sys.stderr)
        return 2
    path, host, port, cmd = argv[0], argv[1], int(argv[2]), argv[4:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):  # pass a stop on to the harness
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    if code < 0:  # die of the same signal, so the orchestrator sees a signal death
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # only if the signal did not end this process
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
