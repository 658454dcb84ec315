"""An engine whose auto-picked port is taken before it binds is restarted on a fresh port.

The engine process here is a stand-in (``_StandInServer``: a few lines of Python that bind the
port like uvicorn does, answer ``/health_generate``, and report ``[Errno 98]`` as SGLang's log
does when the bind fails), so the retry logic of ``SGLangServer.start`` runs in a second, not the
40 s of a real SGLang start; the real server's log line was observed in a crash-chain run.
"""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest

from gyre_sglang import server as server_module
from gyre_sglang.server import SGLangServer, ServerStartError

_STAND_IN = textwrap.dedent("""
    import http.server, sys
    port = int(sys.argv[1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    try:
        srv = http.server.HTTPServer(("127.0.0.1", port), H)
    except OSError as e:
        print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address "
              f"('127.0.0.1', {port}): address already in use", flush=True)
        if len(sys.argv) > 2:  # as SGLang was seen to do: stay alive after the failed bind
            import time
            print("INFO:     Waiting for application shutdown.", flush=True)
            time.sleep(600)
        sys.exit(1)
    srv.serve_forever()
""")


class _StandInServer(SGLangServer):
    """Mock engine process: binds and serves health like SGLang, without loading a model."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", _STAND_IN, str(self.port)]


class _LingeringStandInServer(SGLangServer):
    """Mock engine process that, like a real SGLang start once seen in CI, stays alive after its
    bind failed instead of exiting."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", _STAND_IN, str(self.port), "linger"]


@pytest.fixture
def occupied_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: a health probe is refused at once
        yield int(s.getsockname()[1])


def test_auto_port_taken_is_retried_on_a_fresh_port(tmp_path: Path, monkeypatch, occupied_port: int) -> None:
    real_free_port = server_module.free_port
    picks = iter([occupied_port, occupied_port])
    monkeypatch.setattr(server_module, "free_port", lambda: next(picks, None) or real_free_port())
    server = _StandInServer(tmp_path, log_path=tmp_path / "engine.log")
    server.start(timeout=30)
    try:
        assert server.port != occupied_port
        assert server.healthy()
        assert (tmp_path / "engine.log").read_text().count("address already in use") == 2
    finally:
        server.stop()


def test_a_port_the_caller_chose_is_not_changed(tmp_path: Path, occupied_port: int) -> None:
    server = _StandInServer(tmp_path, port=occupied_port, log_path=tmp_path / "engine.log")
    with pytest.raises(ServerStartError, match=f"could not bind port {occupied_port}"):
        server.start(timeout=30)
    assert server.port == occupied_port


def test_attempts_are_bounded(tmp_path: Path, monkeypatch, occupied_port: int) -> None:
    monkeypatch.setattr(server_module, "free_port", lambda: occupied_port)
    server = _StandInServer(tmp_path, log_path=tmp_path / "engine.log")
    with pytest.raises(ServerStartError, match="address already in use"):
        server.start(timeout=30, port_attempts=3)
    assert (tmp_path / "engine.log").read_text().count("address already in use") == 3


def test_a_start_that_lingers_after_a_failed_bind_is_retried_at_once(tmp_path: Path, monkeypatch,
                                                                     occupied_port: int) -> None:
    import time

    real_free_port = server_module.free_port
    picks = iter([occupied_port])
    monkeypatch.setattr(server_module, "free_port", lambda: next(picks, None) or real_free_port())
    server = _LingeringStandInServer(tmp_path, log_path=tmp_path / "engine.log")
    t0 = time.monotonic()
    server.start(timeout=60)
    try:
        assert server.port != occupied_port and server.healthy()
        assert time.monotonic() - t0 < 30  # not the start timeout: the log said the port was taken
    finally:
        server.stop()
