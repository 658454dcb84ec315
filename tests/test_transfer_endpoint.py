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



@pytest.mark.mooncake
def test_registered_memory_is_readable_once_registered_and_gone_once_released() -> None:
    """Two real Mooncake engines on loopback: a region registered (twice: once to Mooncake) is
    read by the peer byte for byte; after ``release_all`` the same read fails; a process that
    registers nothing starts no engine."""
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda)")
    import torch

    from gyre_core.transfer_endpoint import Registrations, read, start_transfer_engine

    started: list[object] = []
    idle = Registrations(lambda: started.append(1))
    idle.release_all()
    assert not started, "nothing registered: no engine is started"

    owner, reader = start_transfer_engine(MooncakeEndpoint()), start_transfer_engine(MooncakeEndpoint())
    src, dst = torch.arange(1024, dtype=torch.float32), torch.zeros(1024)
    n = src.numel() * src.element_size()
    exposed, landing = Registrations(lambda: owner), Registrations(lambda: reader)
    exposed.register(src.data_ptr(), n)
    exposed.register(src.data_ptr(), n)  # exposed again: already registered
    landing.register(dst.data_ptr(), n)
    session = f"127.0.0.1:{owner.get_rpc_port()}"
    assert read(reader, session, [dst.data_ptr()], [src.data_ptr()], [n]) == 0
    assert torch.equal(dst, src)
    exposed.release_all()
    assert src.data_ptr() not in exposed
    assert read(reader, session, [dst.data_ptr()], [src.data_ptr()], [n]) != 0
    landing.release_all()
