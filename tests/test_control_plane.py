"""The control plane that torchrun-started ranks use to reach the orchestrator: key and world checks.

A rank with the wrong key must not get in (the control port drives training and engines), a
launcher that started the wrong number of ranks is refused with a clear error, and micro-steps
claimed through the wire arrive whole, each once. The hostile-peer cases (garbage, idle floods,
oversized frames, no pickle) are in ``test_control_wire.py``.
"""

from __future__ import annotations

import os
import stat
import time

import pytest

from gyre_megatron.control import AuthenticationFailed, ControlClient, ControlServer, read_key, write_key


@pytest.fixture
def server(tmp_path):
    key = write_key(tmp_path / "k")
    srv = ControlServer(2, {"opts": 1}, "127.0.0.1", 0, key)
    yield srv, key
    srv.close()


def test_key_file_is_private_and_readable(tmp_path) -> None:
    key = write_key(tmp_path / "k")
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600
    assert read_key(tmp_path / "k") == key


def test_a_key_others_may_read_or_a_symlinked_key_is_refused(tmp_path) -> None:
    key = write_key(tmp_path / "k")
    os.chmod(tmp_path / "k", 0o666)
    with pytest.raises(ValueError, match="mode 666"):
        read_key(tmp_path / "k")
    os.chmod(tmp_path / "k", 0o600)
    (tmp_path / "link").symlink_to(tmp_path / "k")
    with pytest.raises(ValueError, match="symlink"):
        read_key(tmp_path / "link")
    (tmp_path / "planted").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        write_key(tmp_path / "planted")  # never written through a planted link
    assert not (tmp_path / "elsewhere").exists() and read_key(tmp_path / "k") == key


def test_run_defaults_bind_loopback() -> None:
    from gyre_core.orchestrator.run_config import RunConfig

    cluster = RunConfig().cluster
    assert (cluster.launcher, cluster.control_host, cluster.engine_host) == ("local", "127.0.0.1", "127.0.0.1")


def test_wrong_key_is_refused(server) -> None:
    srv, _ = server
    host, port = srv.address
    with pytest.raises(AuthenticationFailed):
        ControlClient(host, port, b"x" * 64, 0, 2, connect_timeout_s=1)
    assert srv.joined() == [] and srv.rejected == 1


def test_wrong_world_size_is_refused_with_a_clear_error(server) -> None:
    srv, key = server
    host, port = srv.address
    with pytest.raises(ValueError, match="world of 2 rank"):
        ControlClient(host, port, key, 0, 3, connect_timeout_s=1)
    assert srv.hub.refused and "world of 2" in srv.hub.refused[0]  # the orchestrator stops waiting on it


def test_claims_over_the_wire_are_whole_and_once(server) -> None:
    srv, key = server
    host, port = srv.address
    a = ControlClient(host, port, key, 0, 2, connect_timeout_s=5)
    b = ControlClient(host, port, key, 1, 2, connect_timeout_s=5)
    assert a.opts == {"opts": 1} and srv.joined() == [0, 1]
    q = srv.hub.microstep_queue(0)
    items = [{"i": i, "payload": list(range(i))} for i in range(20)]
    for it in items:
        q.put(it)
    q.close()
    got = []
    for client in (a, b) * 20:
        item = client.queues[0].claim(1.0)
        if item is not None:
            got.append(item)
    assert sorted(got, key=lambda x: x["i"]) == items
    assert a.queues[0].claim(0.1) is None and b.queues[0].unclaimed() == 0
    a.close()
    b.close()


def test_a_lost_orchestrator_is_reported_once(tmp_path) -> None:
    key = write_key(tmp_path / "k")
    srv = ControlServer(1, {}, "127.0.0.1", 0, key)
    lost = []
    client = ControlClient(*srv.address, key, 0, 1, connect_timeout_s=5, on_lost=lambda: lost.append(1))
    srv.close()
    deadline = time.monotonic() + 15
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    client._beating.join(5)
    assert lost == [1] and not client._beating.is_alive()
    with pytest.raises(ConnectionError):
        client.cmd.get()  # a rank blocked on its next command is woken: serve_rank then exits


def test_two_servers_in_one_process_keep_their_own_runs(tmp_path) -> None:
    key = write_key(tmp_path / "k")
    first = ControlServer(1, {"run": 1}, "127.0.0.1", 0, key)
    second = ControlServer(1, {"run": 2}, "127.0.0.1", 0, key)
    try:
        a = ControlClient(*first.address, key, 0, 1, connect_timeout_s=5)
        b = ControlClient(*second.address, key, 0, 1, connect_timeout_s=5)
        assert (a.opts, b.opts) == ({"run": 1}, {"run": 2})
        a.close()
        b.close()
    finally:
        first.close()
        second.close()
