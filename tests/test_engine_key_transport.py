"""The engine key never travels on a command line nor into a log, and each server has a private
``TMPDIR`` (no real SGLang server here; the real one is checked in
``integration_tests/sglang/test_engine_key_hidden.py``).

A command line is readable by every local user (``/proc/<pid>/cmdline``): the key goes to the
server in ``GYRE_ENGINE_KEY`` and :mod:`gyre_sglang.launch_server` sets it on SGLang's parsed
arguments. SGLang logs those arguments at start, so their ``repr`` and ``resolved_dict`` must
redact it. SGLang's ZMQ IPC sockets are made with :mod:`tempfile`, so they follow ``TMPDIR``.
"""

from __future__ import annotations

import logging
import os
import pickle
import runpy
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre_sglang.launch_server import ENGINE_KEY_ENV, refusal, secret_flags, with_key
from gyre_sglang.server import SGLangServer, ServerStartError
from gyre_sglang.server_plugin import redaction

KEYS = ["-leading-dash_0123456789abcdefghij", "plain_Key-123_0123456789abcdefghij"]


@pytest.mark.parametrize("key", KEYS)
def test_the_key_is_in_the_environment_and_on_no_argument(tmp_path, key: str) -> None:
    server = SGLangServer(tmp_path, api_key=key, port=30000, extra_args=["--log-level", "info"])
    argv, env = server.launch_spec(str(tmp_path / "private"))
    assert env[ENGINE_KEY_ENV] == key
    assert not [a for a in argv if key in a], argv
    assert not secret_flags(argv)
    assert argv[1:3] == ["-m", "gyre_sglang.launch_server"]
    assert env["TMPDIR"] == str(tmp_path / "private")


def test_the_private_tmpdir_wins_over_a_users_and_lies_inside_it(tmp_path) -> None:
    server = SGLangServer(tmp_path, env={"TMPDIR": str(tmp_path)})
    folder = server.new_tmpdir()
    assert Path(folder).parent == tmp_path and Path(folder).name.startswith("gyre-sglang-")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert server.launch_spec(folder)[1]["TMPDIR"] == folder


@pytest.mark.parametrize("extra", [["--api-key=k"], ["--api-key", "k"], ["--admin-api-key", "k"], ["--api-k=k"]])
def test_a_key_in_extra_args_is_refused(tmp_path, extra: list[str]) -> None:
    with pytest.raises(ValueError, match="must not carry --api-key"):
        SGLangServer(tmp_path, extra_args=extra).command()


def test_the_launcher_refuses_a_key_on_its_command_line_without_echoing_it() -> None:
    why = refusal(["--model-path", "m", "--api-key=TOPSECRET"], "k" * 32)
    assert why and "--api-key" in why and "TOPSECRET" not in why
    assert "GYRE_ENGINE_KEY is not set" in (refusal(["--model-path", "m"], "") or "")
    assert refusal(["--model-path", "m", "--api-key-file-like-value"], "k" * 32) is None
    assert refusal(["--model-path", "m"], "k" * 32) is None


def test_the_key_is_set_on_what_sglang_parsed() -> None:
    parsed = with_key(lambda argv: SimpleNamespace(argv=argv, api_key=None), "k" * 32)(["--port", "1"])
    assert (parsed.api_key, parsed.argv) == ("k" * 32, ["--port", "1"])


def _sglang_server_args():  # type: ignore[no-untyped-def]
    return pytest.importorskip("sglang.srt.server_args")


@pytest.mark.parametrize("key", KEYS)
def test_the_real_parser_gets_the_key_and_keeps_it_off_its_launch_command(key: str) -> None:
    sa = with_key(_sglang_server_args().prepare_server_args, key)(["--model-path", "/nonexistent"])
    assert sa.api_key == key
    assert key not in (sa.launch_command or "")  # served on /server_info
    assert pickle.loads(pickle.dumps(sa)).api_key == key  # what the scheduler processes receive


def test_sglang_main_calls_the_wrapped_parser(monkeypatch) -> None:
    """``sglang/launch_server.py`` binds ``prepare_server_args`` from ``sglang.srt.server_args`` when
    it runs, so the wrapper installed there before it runs is the one its ``__main__`` calls (run
    here under another name: its imports only, no server)."""
    module = _sglang_server_args()
    wrapped = with_key(module.prepare_server_args, "k" * 32)
    monkeypatch.setattr(module, "prepare_server_args", wrapped)
    names = runpy.run_module("sglang.launch_server", run_name="gyre_check")
    assert names["prepare_server_args"] is wrapped


@pytest.fixture
def redacting_server_args(monkeypatch):  # type: ignore[no-untyped-def]
    """SGLang's ``ServerArgs`` with Gyre's redaction, restored after the test."""
    cls = _sglang_server_args().ServerArgs
    monkeypatch.setattr(cls, "__repr__", cls.__repr__)
    monkeypatch.setattr(cls, "resolved_dict", cls.resolved_dict)
    monkeypatch.setattr(cls, "_gyre_redacted", False, raising=False)
    redaction.patch_server_args(cls)
    redaction.patch_server_args(cls)  # idempotent: not wrapped twice
    return cls


@pytest.mark.parametrize("key", KEYS)
def test_what_sglang_logs_of_its_arguments_hides_the_key(redacting_server_args, key: str) -> None:
    """SGLang logs ``server_args={_server_args_for_logging(server_args)}`` (``entrypoints/engine.py``),
    which is ``redact_watermark_secrets(server_args.resolved_dict())``; ``f"{server_args}"`` is its
    ``repr``."""
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets

    sa = with_key(_sglang_server_args().prepare_server_args, key)(["--model-path", "/nonexistent"])
    logged = str(redact_watermark_secrets(sa.resolved_dict()))
    assert key not in logged and "'api_key': '<redacted>'" in logged
    assert key not in repr(sa) and key not in f"{sa}" and "api_key='<redacted>'" in repr(sa)
    assert sa.api_key == key  # the record keeps it: SGLang's auth and the scheduler channel read it


def test_a_log_line_that_carries_the_key_is_scrubbed(caplog) -> None:
    key = KEYS[0]
    before = logging.getLogRecordFactory()
    try:
        redaction.scrub_logs(key)
        installed = logging.getLogRecordFactory()
        redaction.scrub_logs(key)  # once per process, however often the plugin registers
        assert logging.getLogRecordFactory() is installed is not before
        with caplog.at_level(logging.INFO):
            logging.getLogger("sglang.test").info("server_args=%s", {"api_key": key})
    finally:
        logging.setLogRecordFactory(before)
    assert key not in caplog.records[0].getMessage() and "<redacted>" in caplog.records[0].getMessage()
    # a malformed record is passed on untouched (logging reports it), never raised at the caller
    record = redaction.scrubbing_factory(logging.LogRecord, key)("n", logging.INFO, "p", 1, "bad %d", ("x",), None)
    assert record.msg == "bad %d"


def test_the_server_process_gets_a_private_tmpdir_that_goes_with_it(tmp_path, monkeypatch) -> None:
    """A stand-in process (no SGLang) reports where :mod:`tempfile` puts its files, as SGLang's
    ``PortArgs.init_new`` names its IPC sockets with ``tempfile.NamedTemporaryFile``."""
    probe = ("import os, tempfile; f = tempfile.NamedTemporaryFile(delete=False); d = os.path.dirname(f.name); "
             "print('PROBE', d, oct(os.stat(d).st_mode & 0o777), 'GYRE_ENGINE_KEY' in os.environ, flush=True)")
    # (without Gyre's CPU patch, whose sitecustomize would import torch in the stand-in)
    server = SGLangServer(tmp_path, log_path=tmp_path / "engine.log", env={"GYRE_SGLANG_CPU_PATCH": ""})
    monkeypatch.setattr(server, "command", lambda: [sys.executable, "-c", probe])
    with pytest.raises(ServerStartError, match="exited with code 0"):
        server.start(timeout=60)
    line = next(x for x in (tmp_path / "engine.log").read_text().splitlines() if x.startswith("PROBE"))
    _, folder, mode, has_key = line.split()
    assert Path(folder).name.startswith("gyre-sglang-") and mode == "0o700" and has_key == "True"
    assert not Path(folder).exists() and server.tmpdir is None  # removed with the server


@pytest.mark.parametrize("end", ["kill", "stop"])
def test_kill_and_stop_remove_the_private_tmpdir(tmp_path, end: str) -> None:
    server = SGLangServer(tmp_path, env={"TMPDIR": str(tmp_path)})
    server.tmpdir = folder = server.new_tmpdir()
    (Path(folder) / "socket").write_text("")
    getattr(server, end)()
    assert server.tmpdir is None and not Path(folder).exists()
