"""A run that cannot start says why in seconds, and a failed run reads in one look.

The preflight test runs the real ``gyre-orchestrate run`` with Mooncake made unloadable (a mock
package that fails its import the way the dynamic loader fails without libibverbs1): it must exit
non-zero within 10 s, name the missing part and its fix, and start nothing (no run folder, which
every engine, rank and harness writes into).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_core.orchestrator.failure import cause_lines, write_error_log
from gyre_core.orchestrator.preflight import PreflightFailed, check_preflight, preflight
from gyre_core.orchestrator.run_config import load_run_config
from gyre_core.plugins import plugin_manager

MOCK_MOONCAKE = Path(__file__).parent / "fixtures" / "mooncake_unloadable"


def _env_with_unloadable_mooncake() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(MOCK_MOONCAKE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_run_with_unloadable_mooncake_exits_in_seconds_naming_it_and_starts_nothing(tmp_path: Path) -> None:
    pytest.importorskip("gyre_megatron")
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, env=_env_with_unloadable_mooncake())
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 10, elapsed
    err = proc.stderr
    assert "Mooncake transfer engine" in err and "libibverbs.so.1" in err and "apt-get install -y libibverbs1" in err
    assert "Traceback" not in err
    problem_lines = [ln for ln in err.splitlines() if ln.lstrip().startswith("- ")]
    assert len(problem_lines) == 1, err  # one line per missing part, and only Mooncake is missing here
    assert not out.exists(), "the preflight must run before anything is started or written"


def test_single_cell_run_does_not_need_mooncake(tmp_path: Path) -> None:
    """Only satellites pull weights over Mooncake: a one-cell run must not be refused for it."""
    pytest.importorskip("gyre_megatron")
    code = ("import sys; from gyre_core.orchestrator.preflight import preflight;"
            "from gyre_core.orchestrator.run_config import load_run_config;"
            "from gyre_core.orchestrator.embedded import _plugin_manager;"
            "cfg = load_run_config(None, {'scheduler.cells': sys.argv[1]});"
            "print(repr(preflight(cfg, _plugin_manager())))")
    one = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=60,
                         env=_env_with_unloadable_mooncake())
    two = subprocess.run([sys.executable, "-c", code, "2"], capture_output=True, text=True, timeout=60,
                         env=_env_with_unloadable_mooncake())
    assert one.returncode == 0 and "Mooncake" not in one.stdout, one.stdout + one.stderr
    assert two.returncode == 0 and "Mooncake" in two.stdout, two.stdout + two.stderr


def test_every_missing_part_gets_its_own_line(tmp_path: Path) -> None:
    cfg = load_run_config(None, {"model.dir": str(tmp_path), "harness.kind": "claude-code",
                                 "harness.claude_bin": str(tmp_path / "claude-not-here")})
    pm = plugin_manager()
    problems = preflight(cfg, pm)
    assert any(p.startswith("model.dir:") and "has no config.json" in p for p in problems), problems
    assert any(p.startswith("harness.claude_bin:") and "npm install" in p for p in problems), problems
    with pytest.raises(PreflightFailed) as e:
        check_preflight(cfg, pm)
    assert e.value.problems == problems
    assert str(e.value).count("\n  - ") == len(problems)


def test_model_dir_without_config_is_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    cfg = load_run_config(None, {"model.dir": str(tmp_path)})
    problems = preflight(cfg, plugin_manager())
    assert f"model.dir: {tmp_path} has no config.json" in problems


def test_the_default_run_passes_preflight_on_a_prepared_machine() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("megatron") is None:
        pytest.skip("SGLang or megatron-core not installed")
    from gyre_core.orchestrator.embedded import _plugin_manager

    assert preflight(load_run_config(None, {}), _plugin_manager()) == []


def _remote_failure() -> BaseException:
    remote_tb = ("Traceback (most recent call last):\n  File \"runtime.py\", line 459, in serve\n"
                 "    out = fn(*args)\nRuntimeError: CUDA out of memory on rank 1")
    try:
        try:
            try:
                raise OSError("libibverbs.so.1: cannot open shared object file")
            except OSError as low:
                raise RuntimeError(f"rank 1: {remote_tb}") from low
        except RuntimeError as mid:
            raise RuntimeError("training step 0: RankError: see cause") from mid
    except RuntimeError as top:
        return top


def test_cause_lines_give_one_line_per_link_with_remote_tracebacks_reduced() -> None:
    lines = cause_lines(_remote_failure())
    assert len(lines) == 3, lines
    assert lines[0] == "RuntimeError: training step 0: RankError: see cause"
    assert lines[1].startswith("RuntimeError: rank 1:")
    assert lines[1].endswith("... RuntimeError: CUDA out of memory on rank 1")  # the remote cause, not its frames
    assert lines[2] == "OSError: libibverbs.so.1: cannot open shared object file"
    assert all("\n" not in ln for ln in lines)


def test_error_log_keeps_every_traceback(tmp_path: Path) -> None:
    path = write_error_log(tmp_path, _remote_failure())
    text = path.read_text()
    assert text.count("Traceback (most recent call last)") >= 3  # ours, the remote one, the root
    assert "CUDA out of memory on rank 1" in text and "libibverbs.so.1" in text


def test_an_unsupported_architecture_is_refused_before_anything_starts(tmp_path: Path) -> None:
    pytest.importorskip("gyre_megatron")
    import json

    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "rope_scaling": {"type": "yarn"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    problems = preflight(load_run_config(None, {"model.dir": str(tmp_path)}), plugin_manager())
    (line,) = [p for p in problems if "unsupported model" in p]
    assert line.startswith("model.dir:") and "model_type 'gemma'" in line and "rope_scaling" in line
