"""An engine key that starts with "-" still reaches SGLang as the key.

``secrets.token_urlsafe`` starts a key with "-" once in 64 draws; passed as ``--api-key KEY`` the
engine's argparse took it for an option and the engine exited at start ("expected one
argument"), which failed a CI resume run. The command is parsed here by argparse, as SGLang's
``launch_server`` parses it.
"""

from __future__ import annotations

import argparse

import pytest

from gyre_sglang.server import SGLangServer


@pytest.mark.parametrize("key", ["-leading-dash", "--double", "plain_Key-123"])
def test_the_engine_key_survives_the_command_line(tmp_path, key: str) -> None:
    cmd = SGLangServer(tmp_path, api_key=key, port=30000).command()
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--api-key")
    known, _ = parser.parse_known_args(cmd[3:])
    assert known.api_key == key
