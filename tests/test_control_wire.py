"""The torchrun control plane against hostile peers, and its pickle-free wire format.

Before a peer has proven the run's key the server reads fixed-size handshake bytes and nothing
else; whatever a peer sends that is not the protocol closes its connection without an answer (no
traceback). Idle connections that never authenticate do not keep ranks from joining. After the
handshake, frames are bounded and carry JSON plus raw tensor bytes: only the rank options and the
micro-step structures can be named, and an unknown name closes the connection.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.dataplane.materialise import TrainingRow
from gyre_core.dataplane.objective import GSPOConfig
from gyre_core.dataplane.packing import MicroStep, Pack
from gyre_core.interfaces import EngineOptions, MooncakeOptions, RoleClass
from gyre_core.trajectory import TrajectoryRow
from gyre_megatron.control import ControlClient, ControlServer, write_key
from gyre_megatron.model import ModelSpec
from gyre_megatron.runtime import RankOptions
from gyre_megatron.wire import MAGIC, NONCE_BYTES, WireError, client_handshake, decode, encode, write_frame


@pytest.fixture
def served(tmp_path):
    key = write_key(tmp_path / "k")
    srv = ControlServer(2, RankOptions(cells=2, pp=1, spec=ModelSpec(hidden_size=32)), "127.0.0.1", 0, key,
                        handshake_timeout_s=1.0, max_frame_bytes=1 << 20)
    yield srv, key
    srv.close()


def _said_back(srv: ControlServer, payload: bytes, wait_s: float = 3.0) -> bytes:
    """What a raw peer that sends ``payload`` gets back before the server closes on it."""
    s = socket.create_connection(srv.address, timeout=wait_s)
    s.sendall(payload)
    try:
        return _closed(s)
    finally:
        s.close()


@pytest.mark.parametrize("payload", [
    b"\x80\x04\x95garbage" * 20,
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 40,
    struct.pack(">Q", 1 << 62) + b"\x00" * 56,  # an oversized length header
])
def test_a_peer_that_does_not_prove_the_key_gets_no_answer(served, payload: bytes) -> None:
    srv, _ = served
    got = _said_back(srv, payload)
    assert got.startswith(MAGIC) and len(got) == len(MAGIC) + NONCE_BYTES  # the challenge, then the close
    assert b"Traceback" not in got and srv.joined() == []


def test_ranks_join_while_100_idle_connections_are_open(served) -> None:
    srv, key = served
    idle = [socket.create_connection(srv.address) for _ in range(100)]
    try:
        t0 = time.monotonic()
        a = ControlClient(*srv.address, key, 0, 2, connect_timeout_s=5)
        b = ControlClient(*srv.address, key, 1, 2, connect_timeout_s=5)
        assert srv.joined() == [0, 1] and time.monotonic() - t0 < 5
        a.close()
        b.close()
        deadline = time.monotonic() + 10  # the idle ones never authenticated: each is cut at its deadline
        while srv.rejected < 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.rejected >= 100
    finally:
        for s in idle:
            s.close()


def _authenticated(srv: ControlServer, key: bytes) -> socket.socket:
    s = socket.create_connection(srv.address, timeout=5)
    client_handshake(s, key)
    return s


def _closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (or the socket's timeout passes)."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return got


def test_an_oversized_frame_is_refused_unread_and_the_server_goes_on(served) -> None:
    srv, key = served
    s = _authenticated(srv, key)
    s.sendall(struct.pack(">Q", 1 << 40))  # announces a terabyte: refused before any body is read
    assert _closed(s) == b""
    ok = ControlClient(*srv.address, key, 0, 2, connect_timeout_s=5)
    assert isinstance(ok.opts, RankOptions) and ok.opts.spec.hidden_size == 32
    ok.close()


@pytest.mark.parametrize("head", [
    b"not json",
    json.dumps({"op": "hello", "rank": {"$dc": "Popen", "f": {}}, "world_size": 2}).encode(),
    json.dumps({"op": "hello", "rank": {"$dc": "RankOptions", "f": {"cells": 1}}, "world_size": 2}).encode(),
    b"[" * 30_000 + b"]" * 30_000,  # nested past the parser's recursion limit
])
def test_a_malformed_hello_closes_the_connection_with_no_traceback(served, head: bytes) -> None:
    srv, key = served
    s = _authenticated(srv, key)
    body = struct.pack(">II", len(head), 0) + head
    s.sendall(struct.pack(">Q", len(body)) + body)
    got = _closed(s)
    assert b"Traceback" not in got and srv.joined() == []


def test_a_joined_rank_that_names_an_unknown_type_is_disconnected(served) -> None:
    srv, key = served
    s = _authenticated(srv, key)
    write_frame(s, {"op": "hello", "rank": 0, "world_size": 2})
    s.settimeout(5)
    assert _recv_frame(s)["op"] == "welcome"
    head = json.dumps({"op": "result", "seq": 1, "ok": True, "payload": {"$dc": "os.system", "f": {}}}).encode()
    body = struct.pack(">II", len(head), 0) + head
    s.sendall(struct.pack(">Q", len(body)) + body)
    assert b"Traceback" not in _closed(s)
    assert srv.hub.results.empty()  # nothing of it reached the orchestrator


def _recv_frame(s: socket.socket) -> dict:
    from gyre_megatron.wire import read_frame

    return read_frame(s, 1 << 20)  # type: ignore[no-any-return]


def _micro_step() -> MicroStep:
    rows = []
    for i, n in enumerate((5, 3)):
        row = TrajectoryRow(execution_id=10 + i, group_id=2, role=RoleClass.SUB_AGENT_TASK,
                            token_ids=torch.arange(n), loss_mask=torch.tensor([False] + [True] * (n - 1)),
                            behaviour_logprobs=torch.tensor([0.0] + [-0.5] * (n - 1)),
                            response_ids=torch.tensor([-1] + [7] * (n - 1)))
        rows.append(TrainingRow(row, exec_slot=i, advantage=0.25 - i, loss_weights=torch.rand(n)))
    return MicroStep(step=3, index=1, packs=(Pack(tuple(rows), 2), Pack((), 0)))


def test_a_micro_step_and_the_rank_options_cross_by_value() -> None:
    m = _micro_step()
    back = decode(*encode(m))
    assert (back.step, back.index, len(back.packs), back.packs[1].rows) == (3, 1, 2, ())
    for a, b in zip(m.packs[0].rows, back.packs[0].rows):
        assert (b.exec_slot, b.advantage, b.row.role) == (a.exec_slot, a.advantage, a.row.role)
        assert isinstance(b.row.role, RoleClass)
        for f in ("token_ids", "loss_mask", "behaviour_logprobs", "response_ids"):
            x, y = getattr(a.row, f), getattr(b.row, f)
            assert x.dtype == y.dtype and torch.equal(x, y)
        assert torch.equal(a.loss_weights, b.loss_weights)
    opts = RankOptions(cells=3, pp=2, objective=GSPOConfig(5.0, 0.1, 0.2), mooncake=MooncakeOptions(protocol="tcp", peer="10.0.0.1"))
    assert decode(*encode(opts)) == opts
    # a torchrun cell's engine is started by its node's first rank, with the run's engine options
    engine = EngineOptions(extra_args=("--dtype", "float32"), api_key="k", log_path="/tmp/e.log", base_gpu_id=2,
                           tp_size=2, memory_saver=True, mooncake=MooncakeOptions(peer="10.0.0.1"))
    assert decode(*encode(engine)) == engine


def test_anything_else_does_not_cross() -> None:
    class Mine:
        pass

    for bad in (Mine(), {1, 2}, object(), torch.zeros(2, dtype=torch.complex64)):
        with pytest.raises(TypeError):
            encode(bad)


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.floats(allow_nan=False),
                  st.text(max_size=8), st.binary(max_size=16))
_tree = st.recursive(_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.tuples(kids, kids),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), kids, max_size=4)), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(_tree)
def test_plain_structures_round_trip(value) -> None:
    assert decode(*encode(value)) == value


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float16]),
       st.lists(st.integers(0, 4), max_size=3))
def test_tensors_and_arrays_round_trip_exactly(dtype: torch.dtype, shape: list[int]) -> None:
    t = (torch.rand(shape) * 100).to(dtype)
    back = decode(*encode({"t": t, "a": t.float().numpy()}))
    assert back["t"].dtype == dtype and list(back["t"].shape) == shape and torch.equal(back["t"], t)
    assert np.array_equal(back["a"], t.float().numpy())


def test_bytes_that_disagree_with_their_shape_are_refused() -> None:
    head, atts = encode(torch.zeros(4))
    with pytest.raises(WireError, match="do not match"):
        decode(head, [atts[0][:-1]])
    with pytest.raises(WireError, match="no attachment"):
        decode(head, [])
