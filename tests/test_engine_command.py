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


def test_a_cells_engine_starts_with_the_memory_saver(tmp_path) -> None:
    """A cell's engine releases its memory while the cell trains, which SGLang does only with
    its memory saver: Gyre adds it for cells (once, whatever the user passes), not for the
    standalone pool's engine, which never switches."""
    saver = ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    assert SGLangServer(tmp_path, memory_saver=True).gpu_args() == ["--tp-size", "1", *saver]
    assert not set(saver) & set(SGLangServer(tmp_path).gpu_args())
    both = SGLangServer(tmp_path, memory_saver=True, extra_args=saver)
    assert both.gpu_args() == ["--tp-size", "1"]


@pytest.mark.parametrize("info, kv_handoff, named", [
    ({"tp_size": 1, "device": "cpu"}, True, []),
    ({"tp_size": 2, "device": "cuda", "enable_memory_saver": True}, True, ["proxy.kv_handoff"]),
    ({"tp_size": 2, "device": "cuda", "enable_memory_saver": True}, False, []),
    ({"tp_size": 1, "device": "cuda", "enable_memory_saver": False}, False, ["--enable-memory-saver"]),
    ({"tp_size": 4, "device": "cuda"}, True, ["proxy.kv_handoff", "--enable-memory-saver"]),
    ({"tp_size": 2, "device": "cpu"}, True, ["proxy.kv_handoff"]),
])
def test_an_engine_that_cannot_switch_as_configured_is_refused_by_name(info, kv_handoff, named) -> None:
    """What the run asks each cell's engine (``/server_info``) before any execution: a KV
    hand-off that would move one TP shard of the cache, or a GPU engine that cannot release its
    memory, is one line each naming the setting; never a silent partial move."""
    from gyre_sglang.serving_side import role_switch_problems

    lines = role_switch_problems(info, "http://e0", kv_handoff=kv_handoff)
    assert len(lines) == len(named)
    for line, name in zip(lines, named):
        assert name in line and "http://e0" in line and "\n" not in line


def test_sglang_accepts_the_placement_flags() -> None:
    """The flags Gyre adds are SGLang's own (parsed by SGLang's server-argument parser)."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    known = parser.parse_args(["--model-path", "m", "--base-gpu-id", "4", "--tp-size", "2", "--enable-memory-saver",
                               "--enable-weights-cpu-backup"])
    assert (known.base_gpu_id, known.tp_size, known.enable_memory_saver, known.enable_weights_cpu_backup) == (4, 2, True, True)


def test_a_cpu_engine_stops_without_sglangs_gpu_crash_diagnostics(tmp_path, monkeypatch) -> None:
    """Stopping a server ends its scheduler first, which SGLang takes for a crash: it would sleep
    5 s before a CUDA core dump and a py-spy dump. On a machine with neither, both are off in the
    server's environment (the stop takes 0.7 s, not 5.5 s); a user's own setting wins, and a
    machine with py-spy keeps its dump."""
    import gyre_sglang.server as server_module

    monkeypatch.setattr(server_module, "_cuda_available", lambda: False)
    monkeypatch.setattr(server_module.shutil, "which", lambda name: None)
    for name in ("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "SGLANG_PYSPY_DUMP_BEFORE_CRASH"):
        monkeypatch.delenv(name, raising=False)
    env = SGLangServer(tmp_path).environment(str(tmp_path))
    assert env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0"

    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")
    assert SGLangServer(tmp_path).environment(str(tmp_path))["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    given = SGLangServer(tmp_path, env={"SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "1"}).environment(str(tmp_path))
    assert given["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "1"

    monkeypatch.delenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH")
    monkeypatch.setattr(server_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert "SGLANG_PYSPY_DUMP_BEFORE_CRASH" not in SGLangServer(tmp_path).environment(str(tmp_path))
