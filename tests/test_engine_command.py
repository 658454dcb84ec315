"""The engine's command line: placement flags SGLang accepts, and no engine key on it.

The key once travelled as ``--api-key`` (and a key starting with "-", one ``token_urlsafe`` draw in
64, was taken for an option); it now travels in the environment only, so whatever its first
character it never meets argparse. ``tests/test_engine_key_transport.py`` checks the key's way.
"""

from __future__ import annotations

import argparse

import pytest

from gyre_sglang.server import SGLangServer


@pytest.mark.parametrize("key", ["-leading-dash", "--double", "plain_Key-123"])
def test_the_engine_key_is_not_on_the_command_line(tmp_path, key: str) -> None:
    cmd = SGLangServer(tmp_path, api_key=key, port=30000).command()
    assert not [a for a in cmd if key in a or a.startswith("--api-key")], cmd


def test_a_cells_engine_is_placed_on_the_cells_gpus(tmp_path) -> None:
    """With CUDA, a cell's engine starts at the cell's first GPU and spans its GPUs (without it
    every engine would start on GPU 0); a placement the user passes in ``extra_args`` wins."""
    server = SGLangServer(tmp_path, base_gpu_id=4, tp_size=2)
    assert server.gpu_args() == ["--base-gpu-id", "4", "--tp-size", "2"]
    assert SGLangServer(tmp_path).gpu_args() == ["--tp-size", "1"]
    own = SGLangServer(tmp_path, base_gpu_id=4, tp_size=2, extra_args=["--base-gpu-id=6", "--tp", "1"])
    assert own.gpu_args() == []


def test_sglang_accepts_the_placement_flags() -> None:
    """The flags Gyre adds are SGLang's own (parsed by SGLang's server-argument parser)."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    known = parser.parse_args(["--model-path", "m", "--base-gpu-id", "4", "--tp-size", "2"])
    assert (known.base_gpu_id, known.tp_size) == (4, 2)
