"""Where each Mooncake engine of a run listens: configured per node, never an assumed loopback."""

from __future__ import annotations

import pytest

from gyre_core.orchestrator.run_config import load_run_config
from gyre_core.config import ConfigError
from gyre_core.transfer_endpoint import HOST_ENV, MooncakeEndpoint, advertised_host


def test_a_node_setting_wins_over_the_route_toward_the_peer() -> None:
    assert advertised_host("10.1.2.3", {HOST_ENV: "10.9.9.9", "GYRE_ADVERTISE_HOST": "n1"}) == "10.9.9.9"
    assert advertised_host("10.1.2.3", {"GYRE_ADVERTISE_HOST": "node-7"}) == "node-7"


def test_a_peer_on_this_machine_is_reached_over_loopback() -> None:
    assert advertised_host("127.0.0.1", {}) == "127.0.0.1"
    assert advertised_host(None, {}) == "127.0.0.1"


def test_a_remote_peer_gets_this_nodes_routed_address() -> None:
    # a UDP connect sends nothing; the kernel picks the source address of its route
    host = advertised_host("192.0.2.1", {})  # TEST-NET-1: routed (default route) or not, never loopback-assumed
    assert host and host != "localhost"


def test_the_endpoint_travels_to_a_child_as_its_environment() -> None:
    ep = MooncakeEndpoint("10.0.0.5", "rdma", "mlx5_0")
    env = ep.env()
    assert env[HOST_ENV] == "10.0.0.5" and env["MC_TCP_BIND_ADDRESS"] == "10.0.0.5"
    assert MooncakeEndpoint.from_env(None, env) == ep


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="protocol"):
        MooncakeEndpoint("10.0.0.5", "udp")


@pytest.mark.parametrize("key, value, match", [
    ("publication.transport", '"nfs"', "publication.transport"),
    ("publication.protocol", '"udp"', "publication.protocol"),
    ("publication.protocol", '"rdma"', "publication.device"),
])
def test_publication_settings_are_checked_before_anything_runs(key: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_run_config(None, {key: value})


def test_mooncake_is_the_default_transport() -> None:
    cfg = load_run_config(None, {})
    assert cfg.publication.transport == "mooncake" and cfg.publication.protocol == "tcp"


def test_a_wildcard_control_host_gives_this_nodes_own_address() -> None:
    host = advertised_host("0.0.0.0", {})
    assert host and host not in ("0.0.0.0", "")


class _FakeEngineForTest:
    """Stands in for a Mooncake engine: records calls, fails a registration when told to."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at

    def register_memory(self, addr: int, n: int) -> int:
        self.calls.append(("register", addr, n))
        return -1 if addr == self.fail_at else 0

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister", addr))
        return 0

    def batch_transfer_sync_read(self, session: str, local: list, remote: list, lengths: list) -> int:
        self.calls.append(("read", session, local, remote, lengths))
        return 0


def test_each_region_is_registered_once_and_every_one_is_released() -> None:
    from gyre_core.transfer_endpoint import MooncakeError, Registrations, read

    engine = _FakeEngineForTest(fail_at=0x300)
    started = []
    mem = Registrations(lambda: started.append(1) or engine)
    mem.release_all()
    assert not started, "nothing registered: no engine is started"
    mem.register(0x100, 64)
    mem.register(0x100, 64)  # exposed again: registered once
    mem.register(0x200, 32)
    assert 0x100 in mem and engine.calls == [("register", 0x100, 64), ("register", 0x200, 32)]
    with pytest.raises(MooncakeError, match="0x300.*rc=-1"):
        mem.register(0x300, 8)
    assert 0x300 not in mem
    mem.unregister(0x100)
    mem.unregister(0x100)  # twice: once to Mooncake
    mem.release_all()
    assert [c for c in engine.calls if c[0] == "unregister"] == [("unregister", 0x100), ("unregister", 0x200)]
    assert read(engine, "10.0.0.2:1234", (1,), (2,), (3,)) == 0
    assert engine.calls[-1] == ("read", "10.0.0.2:1234", [1], [2], [3])
