"""The engine's scheduler side channel runs no operation for a caller without the engine's key.

Its operations hand out a call's token ids, release pins and import KV: a harness that reached the
socket must not be able to use them. Checked on the dispatcher the scheduler runs (no engine needed).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("zmq")

from gyre_sglang.server_plugin import kv_channel  # noqa: E402

KEY = "engine-key-0123456789abcdef"
calls: list[dict[str, Any]] = []


@kv_channel.op("test_echo")
def _echo(scheduler: Any, msg: dict[str, Any]) -> dict[str, Any]:
    calls.append(dict(msg))
    return {"echo": msg.get("x")}


@pytest.mark.parametrize("message", [
    {"op": "test_echo", "x": 1},                      # no key
    {"op": "test_echo", "x": 1, "key": "wrong"},      # a wrong key
    {"op": "test_echo", "x": 1, "key": KEY[:-1]},     # a prefix of it
    {"op": "test_echo", "x": 1, "key": 12345},        # not a string
    ["test_echo"],                                     # not even an object
])
def test_a_message_without_the_key_is_refused_before_any_handler(message: Any) -> None:
    calls.clear()
    reply = kv_channel._dispatch(None, json.dumps(message).encode(), KEY)
    assert reply["ok"] is False and "refused" in reply["error"] and calls == []


def test_the_key_opens_the_channel_and_never_reaches_the_handler() -> None:
    calls.clear()
    reply = kv_channel._dispatch(None, json.dumps({"op": "test_echo", "x": 7, "key": KEY}).encode(), KEY)
    assert reply == {"ok": True, "echo": 7} and calls == [{"op": "test_echo", "x": 7}]


def test_an_engine_without_a_key_serves_nothing() -> None:
    reply = kv_channel._dispatch(None, json.dumps({"op": "test_echo", "key": None}).encode(), None)
    assert reply["ok"] is False
