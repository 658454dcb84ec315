"""The control plane's wire format: authenticated, bounded frames of JSON and raw tensor bytes.

Nothing a peer sends is parsed before it has proven that it holds the run's key: the handshake is
mutual HMAC-SHA256 over fresh nonces, in messages of fixed size. After it, each frame is a
length-prefixed JSON header plus attachments: tensors and arrays travel as raw bytes with their
dtype and shape, structures as JSON. Only the types :func:`wire_types` names (the rank options and
the micro-step structures) are rebuilt from a frame; nothing else can be named and no code is
loaded, so even an authenticated peer cannot make the other end run anything. Frames over the
receiver's limit are refused before their body is read.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any

import numpy as np
import torch

__all__ = ["AuthenticationFailed", "FrameTooLarge", "WireError", "client_handshake", "decode", "encode", "pack",
           "read_frame", "server_handshake", "unpack", "wire_types", "write_frame"]

MAGIC = b"GYRE-CONTROL/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32


class WireError(Exception):
    """A malformed handshake or frame: the connection is closed."""


class FrameTooLarge(WireError):
    """A frame announced more bytes than the receiver accepts."""


class AuthenticationFailed(Exception):
    """The peer does not hold the run's key (or would not prove it)."""


_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool)
}
_NUMPY_DTYPES = frozenset(("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"))


@functools.lru_cache(maxsize=1)
def wire_types() -> dict[str, type]:
    """The classes a frame may name: what crosses between the orchestrator and its ranks."""
    from gyre_core.dataplane.materialise import TrainingRow
    from gyre_core.dataplane.packing import MicroStep, Pack
    from gyre_core.interfaces import EngineOptions, MooncakeOptions, ObjectiveConfig, RoleClass
    from gyre_core.trajectory import TrajectoryRow
    from gyre_megatron.model import ModelSpec
    from gyre_megatron.rank_options import RankOptions

    return {c.__name__: c for c in (RankOptions, ModelSpec, ObjectiveConfig, MooncakeOptions, EngineOptions, MicroStep,
                                    Pack, TrainingRow, TrajectoryRow, RoleClass)}


# ----------------------------------------------------------------------------- handshake

def _mac(key: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, MAGIC + who + first + second, hashlib.sha256).digest()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, key: bytes) -> None:
    """The orchestrator's side: the rank proves the key first, then the orchestrator does."""
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce)
    reply = recv_exactly(sock, NONCE_BYTES + MAC_BYTES)
    theirs, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, b"rank", nonce, theirs)):
        raise AuthenticationFailed("the peer does not hold the run's key")
    sock.sendall(_mac(key, b"orchestrator", theirs, nonce))


def client_handshake(sock: socket.socket, key: bytes) -> None:
    """A rank's side; :class:`AuthenticationFailed` if either end lacks the key."""
    hello = recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise WireError("not a Gyre control server")
    theirs = hello[len(MAGIC):]
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(nonce + _mac(key, b"rank", theirs, nonce))
    try:
        proof = recv_exactly(sock, MAC_BYTES)
    except ConnectionError:
        raise AuthenticationFailed("the orchestrator refused this rank's key") from None
    if not hmac.compare_digest(proof, _mac(key, b"orchestrator", nonce, theirs)):
        raise AuthenticationFailed("the control server does not hold the run's key")


# ----------------------------------------------------------------------------- values

def _enc(obj: Any, atts: list[bytes]) -> Any:
    if isinstance(obj, enum.Enum):  # an allowed enum, by name (before int: RoleClass is an IntEnum)
        if wire_types().get(type(obj).__name__) is not type(obj):
            raise TypeError(f"enum {type(obj).__qualname__} does not cross the control plane")
        return {"$enum": type(obj).__name__, "v": obj.name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"tensor dtype {t.dtype} does not cross the control plane")
        atts.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return {"$t": len(atts) - 1, "dtype": name, "shape": list(t.shape)}
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _NUMPY_DTYPES:
            raise TypeError(f"array dtype {obj.dtype} does not cross the control plane")
        atts.append(obj.tobytes(order="C"))  # (ascontiguousarray would make a 0-d array 1-d)
        return {"$a": len(atts) - 1, "dtype": obj.dtype.name, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return _enc(obj.item(), atts)
    if isinstance(obj, (bytes, bytearray)):
        atts.append(bytes(obj))
        return {"$b": len(atts) - 1}
    if isinstance(obj, list):
        return [_enc(v, atts) for v in obj]
    if isinstance(obj, tuple):
        return {"$tuple": [_enc(v, atts) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _enc(v, atts) for k, v in obj.items()}
        return {"$dict": [[_enc(k, atts), _enc(v, atts)] for k, v in obj.items()]}
    name = type(obj).__name__
    if wire_types().get(name) is type(obj) and dataclasses.is_dataclass(obj):
        return {"$dc": name, "f": {f.name: _enc(getattr(obj, f.name), atts) for f in dataclasses.fields(obj)}}
    raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} does not cross the control plane")


def encode(obj: Any) -> tuple[bytes, list[bytes]]:
    """``obj`` as a JSON header and its attachments; :class:`TypeError` for what may not cross."""
    atts: list[bytes] = []
    head = json.dumps(_enc(obj, atts), separators=(",", ":")).encode()
    return head, atts


def _dec(node: Any, atts: list[bytes]) -> Any:
    if isinstance(node, list):
        return [_dec(v, atts) for v in node]
    if not isinstance(node, dict):
        return node
    if not node or not next(iter(node)).startswith("$"):
        return {k: _dec(v, atts) for k, v in node.items()}
    if "$tuple" in node:
        return tuple(_dec(v, atts) for v in _typed(node["$tuple"], list))
    if "$dict" in node:
        pairs = _typed(node["$dict"], list)
        out = {}
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise WireError("a $dict entry is not a [key, value] pair")
            k = _dec(pair[0], atts)
            try:
                out[k] = _dec(pair[1], atts)
            except TypeError:
                raise WireError("a $dict key is not hashable") from None
        return out
    if "$t" in node or "$a" in node:
        raw = _attachment(node.get("$t", node.get("$a")), atts)
        shape = _typed(node.get("shape"), list)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise WireError(f"bad shape {shape!r}")
        count = 1
        for s in shape:
            count *= s
        if "$t" in node:
            dtype = _TORCH_DTYPES.get(node.get("dtype"))  # type: ignore[arg-type]
            if dtype is None:
                raise WireError(f"tensor dtype {node.get('dtype')!r} is not accepted")
            if len(raw) != count * torch.empty((), dtype=dtype).element_size():
                raise WireError("tensor bytes do not match its dtype and shape")
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if node.get("dtype") not in _NUMPY_DTYPES:
            raise WireError(f"array dtype {node.get('dtype')!r} is not accepted")
        dt = np.dtype(node["dtype"])
        if len(raw) != count * dt.itemsize:
            raise WireError("array bytes do not match its dtype and shape")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if "$b" in node:
        return _attachment(node["$b"], atts)
    if "$enum" in node:
        cls = wire_types().get(node["$enum"])
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or not isinstance(node.get("v"), str):
            raise WireError(f"unknown enum {node.get('$enum')!r}")
        try:
            return cls[node["v"]]
        except KeyError:
            raise WireError(f"{node['$enum']} has no member {node['v']!r}") from None
    if "$dc" in node:
        cls = wire_types().get(node["$dc"])  # type: ignore[arg-type]
        fields = node.get("f")
        if cls is None or not dataclasses.is_dataclass(cls) or not isinstance(fields, dict):
            raise WireError(f"unknown structure {node.get('$dc')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != names:
            raise WireError(f"{node['$dc']}: fields {sorted(fields)} are not {sorted(names)}")
        obj = object.__new__(cls)  # the sender's object, field by field (as pickle would, minus code)
        for k, v in fields.items():
            object.__setattr__(obj, k, _dec(v, atts))
        return obj
    raise WireError(f"unknown tag {next(iter(node))!r}")


def _typed(v: Any, t: type) -> Any:
    if not isinstance(v, t):
        raise WireError(f"expected {t.__name__}, got {type(v).__name__}")
    return v


def _attachment(i: Any, atts: list[bytes]) -> bytes:
    if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(atts)):
        raise WireError(f"no attachment {i!r}")
    return atts[i]


def decode(head: bytes, atts: list[bytes]) -> Any:
    try:
        tree = json.loads(head)
        return _dec(tree, atts)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WireError(f"bad frame header: {type(e).__name__}") from None


# ----------------------------------------------------------------------------- frames

_FRAME = struct.Struct(">Q")
_HEAD = struct.Struct(">II")


def pack(obj: Any) -> bytes:
    """``obj`` as one frame body: header length and attachment count, the header, each
    attachment with its length (what :func:`write_frame` sends and the ranks' control broadcasts
    carry)."""
    head, atts = encode(obj)
    parts = [_HEAD.pack(len(head), len(atts)), head]
    for a in atts:
        parts += [_FRAME.pack(len(a)), a]
    return b"".join(parts)


def write_frame(sock: socket.socket, obj: Any) -> None:
    """One frame: total length, then the body (:func:`pack`). Encoded fully before anything is sent."""
    body = pack(obj)
    sock.sendall(_FRAME.pack(len(body)) + body)


def read_frame(sock: socket.socket, max_bytes: int) -> Any:
    """The next frame's value; :class:`FrameTooLarge` before reading a body over ``max_bytes``."""
    (n,) = _FRAME.unpack(recv_exactly(sock, _FRAME.size))
    if n > max_bytes:
        raise FrameTooLarge(f"a frame of {n} bytes (the limit is {max_bytes})")
    return unpack(recv_exactly(sock, n))


def unpack(body: bytes) -> Any:
    """The value of one frame body (:func:`pack`); :class:`WireError` for anything malformed."""
    n = len(body)
    if n < _HEAD.size:
        raise WireError("frame too short")
    hlen, count = _HEAD.unpack_from(body)
    pos = _HEAD.size + hlen
    if pos > n or count > n:
        raise WireError("frame header overruns the frame")
    head = body[_HEAD.size:pos]
    atts = []
    for _ in range(count):
        if pos + _FRAME.size > n:
            raise WireError("attachment overruns the frame")
        (alen,) = _FRAME.unpack_from(body, pos)
        pos += _FRAME.size
        if pos + alen > n:
            raise WireError("attachment overruns the frame")
        atts.append(body[pos:pos + alen])
        pos += alen
    if pos != n:
        raise WireError("trailing bytes after the last attachment")
    return decode(head, atts)
