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


@pytest.mark.parametrize("transport", [pytest.param("mooncake", marks=pytest.mark.mooncake), "disk"])
def test_a_satellite_pulls_the_cores_parameters_verified_through_either_transport(transport: str, tmp_path) -> None:
    """The satellite pull through the run's weight transport (``publication.transport``): a core
    exposes its parameters (a copy, so later updates do not tear the read), the satellite pulls
    them exactly; a torn part, a layout or a dtype of its own are refused before any parameter is
    touched; released, nothing is read. Over Mooncake the rank's publication and its satellite
    exposure share one engine."""
    import torch
    import torch.distributed as dist

    from gyre_core.weight_parts import DiskParts, MooncakeParts
    from gyre_megatron.transfer import SatelliteWeights

    store = dist.HashStore()
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda)")
        from gyre_core.transfer_endpoint import MooncakeEndpoint, start_transfer_engine

        endpoint, engines = MooncakeEndpoint("127.0.0.1"), {}

        def rank_engine() -> object:  # one engine per rank, made on first use
            if "e" not in engines:
                engines["e"] = start_transfer_engine(endpoint)
            return engines["e"]

        core_parts = MooncakeParts(endpoint, engine=rank_engine)
        core, satellite = SatelliteWeights(store, core_parts), SatelliteWeights(store, MooncakeParts(endpoint))
    else:
        core_parts = DiskParts(tmp_path / "satellite")
        core, satellite = SatelliteWeights(store, core_parts), SatelliteWeights(store, DiskParts(tmp_path / "satellite"))
    params = [torch.randn(3, 5), torch.arange(7, dtype=torch.float32), torch.randn(2, 2, dtype=torch.float64)]
    core.expose("gyre/step4/w0", 4, params)
    snapshot = [p.clone() for p in params]
    params[0].add_(1.0)  # the core moves on after the all-reduce: the exposed copy does not
    mine = [torch.zeros_like(p) for p in params]
    nbytes, secs = satellite.pull("gyre/step4/w0", mine)
    assert nbytes == sum(p.numel() * p.element_size() for p in params) and secs >= 0
    assert all(torch.equal(a, b) for a, b in zip(mine, snapshot))

    untouched = [torch.zeros_like(p) for p in params]
    with pytest.raises(RuntimeError, match="layout mismatch"):
        satellite.pull("gyre/step4/w0", untouched[:2])
    with pytest.raises(RuntimeError, match="tensor 2: exposed torch.float64"):
        satellite.pull("gyre/step4/w0", untouched[:2] + [torch.zeros(2, 2)])
    if transport == "mooncake":
        assert satellite.last_peer == f"{endpoint.host}:{rank_engine().get_rpc_port()}"
        publication = MooncakeParts(endpoint, engine=rank_engine)
        publication.put(1, {"w": torch.ones(2)})
        assert publication.publisher.engine is core_parts.publisher.engine  # one engine per rank for both
        publication.close()
        core_parts.publisher.buffer(4)[0] ^= 0xFF  # a torn read: the CRC32 no longer matches
        torn, gone = "CRC32 mismatch", "failed"
    else:
        (part,) = (tmp_path / "satellite" / "v4").iterdir()
        assert satellite.last_peer == str(part)
        raw = bytearray(part.read_bytes())
        raw[-1] ^= 0xFF  # a file overwritten in place under the reader
        part.write_bytes(bytes(raw))
        torn, gone = "does not match its location", "was released"
    with pytest.raises(RuntimeError, match=torn):
        satellite.pull("gyre/step4/w0", untouched)
    assert all(not t.any() for t in untouched)

    core.release()
    with pytest.raises(RuntimeError, match=gone):
        satellite.pull("gyre/step4/w0", mine)
    if transport == "disk":
        assert not (tmp_path / "satellite" / "v4").exists()  # released: the core's files went
