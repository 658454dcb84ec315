"""Upstream's every-run noise stays off the console; every other line a native call prints still shows."""

from __future__ import annotations

import logging
import os

from gyre_core.upstream_noise import is_noise, mooncake_quiet_env, native_stderr_filtered

SEGMENT = "E1203 13:12:11.900573  2790 transfer_metadata.cpp:1098] Local segment descriptor not found"


def test_noise_goes_to_the_upstream_log_and_real_errors_to_stderr(capfd, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="gyre.upstream")
    with native_stderr_filtered() as printed:
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
        os.write(2, (SEGMENT + "\n").encode())
        os.write(2, b"E1203 tcp_transport.cpp:12] bind failed: address in use\n")
    err = capfd.readouterr().err
    assert "bind failed: address in use" in err
    assert "Local segment descriptor" not in err and "InitGoogleLogging" not in err
    assert len(printed) == 3  # the caller still sees everything (a failed initialize quotes it)
    logged = [r.getMessage() for r in caplog.records if r.name == "gyre.upstream"]
    assert SEGMENT in logged and not any("bind failed" in m for m in logged)


def test_only_the_known_lines_count_as_noise() -> None:
    assert is_noise(SEGMENT)
    assert not is_noise("E1203 transfer_metadata.cpp:1098] Remote segment descriptor not found")
    assert not is_noise("Local segment descriptor not found")  # only Mooncake's own log line


def test_the_users_mooncake_log_level_wins() -> None:
    env = {"MC_LOG_LEVEL": "INFO"}
    mooncake_quiet_env(env)
    assert env["MC_LOG_LEVEL"] == "INFO"
    env = {}
    mooncake_quiet_env(env)
    assert env["MC_LOG_LEVEL"] == "ERROR"


def test_a_run_sends_upstream_noise_to_its_log_and_keeps_other_warnings(tmp_path, monkeypatch) -> None:
    import warnings

    from gyre_core.upstream_noise import upstream_log, upstream_log_file

    console: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: console.append(str(message)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with upstream_log_file(tmp_path / "upstream.log"):
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
            warnings.warn("checkpoint format is deprecated")
            upstream_log.debug("%s", SEGMENT)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
    assert console[0] == "checkpoint format is deprecated"
    assert len(console) == 2 and console[1].startswith("Transformer Engine")  # only the one outside the run
    logged = (tmp_path / "upstream.log").read_text()
    assert "Transformer Engine and Apex are not installed" in logged and SEGMENT in logged
    assert "deprecated" not in logged
