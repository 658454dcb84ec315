"""The live run's configuration: validated up front, every error names ``section.key``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_core.config import ConfigError
from gyre_core.interfaces import TaskOptions
from gyre_core.orchestrator.run_config import load_run_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def test_defaults_are_the_embedded_job() -> None:
    cfg = load_run_config()
    assert (cfg.scheduler.cells, cfg.scheduler.group_size, cfg.scheduler.groups_per_step) == (2, 4, 4)
    assert cfg.run.steps == 3 and cfg.harness.kind == "number-guess" and cfg.proxy.host == "127.0.0.1"


def test_the_embedded_preset_is_the_default_written_out() -> None:
    import dataclasses

    assert dataclasses.asdict(load_run_config(EXAMPLES / "embedded-cpu.toml")) == dataclasses.asdict(load_run_config())


def test_the_tests_small_job_differs_from_the_default_only_in_its_sizes() -> None:
    import dataclasses

    small = load_run_config(Path(__file__).resolve().parents[1] / "integration_tests" / "e2e" / "small-job.toml")
    assert small.harness.kind == "number-guess" and small.scheduler.mode.value == "gyre"
    assert (small.model.hidden_size, small.scheduler.groups_per_step, small.scheduler.cell_capacity) == (64, 2, 4)
    default = dataclasses.asdict(load_run_config())
    changed = {k for k, v in dataclasses.asdict(small).items() if v != default[k]}
    assert changed == {"scheduler", "model"}, changed


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_documented_presets_validate(path: Path, tmp_path: Path) -> None:
    import tomllib

    raw = tomllib.loads(path.read_text())
    # a preset names the user's model folder; here any existing folder stands in for it
    load_run_config(path, {"model.dir": f'"{tmp_path}"'} if raw.get("model", {}).get("dir") else {})


def test_flags_override_the_file(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[scheduler]\ncells = 3\n[run]\nsteps = 5\n")
    cfg = load_run_config(f, {"run.steps": "7", "sampling.max_new_tokens": "40", "serving.extra_args": '["--tp", "2"]'})
    assert cfg.scheduler.cells == 3 and cfg.run.steps == 7
    assert cfg.sampling.max_new_tokens == 40 and cfg.serving.extra_args == ["--tp", "2"]


@pytest.mark.parametrize("overrides, where", [
    ({"run.stepz": "1"}, "run.stepz"),
    ({"scheduler.cels": "2"}, "scheduler.cels"),
    ({"bogus.key": "1"}, "[bogus]"),
    ({"harness.kind": '"nope"'}, "harness.kind"),
    ({"run.steps": "0"}, "run.steps"),
    ({"run.steps": '"three"'}, "run.steps"),
    ({"scheduler.rho_min": "2"}, "scheduler"),
    ({"harness.timeout_s": "500", "harness.overall_budget_s": "100"}, "harness.timeout_s"),
    ({"harness.kind": '"command"'}, "harness.command"),
    ({"harness.evaluator_timeout_s": "-1"}, "harness.evaluator_timeout_s"),
    ({"publication.version_wait_s": "-1"}, "publication.version_wait_s"),
    ({"publication.load_attempts": "0"}, "publication.load_attempts"),
    ({"run.resume": "true"}, "run.out_dir"),
    ({"proxy.port": "70000"}, "proxy.port"),
    ({"training.importance_cap": "0"}, "training.importance_cap"),
    ({"model.dir": '"/no/such/model"'}, "model.dir"),
    ({"model.hidden_size": "0"}, "model.hidden_size"),
    ({"model.num_layers": "-2"}, "model.num_layers"),
    ({"model.num_layers": "3", "training.pp": "2"}, "model.num_layers"),
    ({"training.tp": "0"}, "training.tp"),
    ({"training.precision": '"fp16"'}, "training.precision"),
    ({"cluster.launcher": '"slurm"'}, "cluster.launcher"),
    ({"cluster.ray_gpus_per_rank": "-1"}, "cluster.ray_gpus_per_rank"),
    ({"cluster.ray_resources_per_rank": '{gyre_slot = "one"}'}, "cluster.ray_resources_per_rank"),
    ({"training.tp": "4"}, "training.tp"),
    ({"sampling.top_p": "5"}, "sampling.top_p"),
    ({"sampling.top_p": "0.9"}, "sampling.top_p"),
    ({"sampling.temperature": "0"}, "sampling.temperature"),
    ({"proxy.host": '""'}, "proxy.host"),
    ({"training.clip_grad": "-1"}, "training.clip_grad"),
    ({"training.step_timeout_s": "0"}, "training.step_timeout_s"),
    ({"scheduler.cells": "100000"}, "scheduler.cells"),
    ({"run.seed": "-1"}, "run.seed"),
    ({"training.clip_low": "1.5"}, "training.clip_low"),
    ({"training.clip_high": "-0.1"}, "training.clip_high"),
    ({"sampling.temperature": "-1"}, "sampling.temperature"),
    ({"watchdog.failures": "0"}, "watchdog.failures"),
    ({"eval.interval": "2"}, "task.eval"),  # an evaluation needs held-out tasks
    ({"task.eval": '"held_out.jsonl"'}, "task.eval"),  # held-out tasks need the file task
    ({"eval.samples": "0"}, "eval.samples"),
    ({"task.setup": '["make"]'}, "task.setup"),  # a set-up belongs to file tasks
    ({"eval.max_concurrent": "0"}, "eval.max_concurrent"),
    ({"watchdog.health_timeout_s": "0"}, "watchdog.health_timeout_s"),
])
def test_bad_values_name_their_key(overrides: dict, where: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config(None, overrides)
    assert where in str(e.value)


def test_unreadable_or_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file"):
        load_run_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler\ncells = 2\n")
    with pytest.raises(ConfigError, match="config file"):
        load_run_config(bad)


def test_cli_refuses_bad_config_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gyre_core.cli import main

    assert main(["run", "--out", str(tmp_path / "x"), "--set", "scheduler.cells=0"]) == 2
    assert "scheduler" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_unknown_task_is_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gyre_core.cli import main

    out = tmp_path / "x"
    assert main(["run", "--out", str(out), "--set", 'task.name="no-such-task"',
                 "--set", 'harness.kind="command"', "--set", 'harness.command=["true"]']) == 2
    assert "task.name" in capsys.readouterr().err
    assert not out.exists()


def test_built_in_task_instances_are_deterministic_per_group() -> None:
    from gyre_core.orchestrator.embedded import _plugin_manager

    pm = _plugin_manager()
    a = pm.hook.gyre_task_instance(task="number-guess", group_id=3, seed=1, options=TaskOptions(turns=2))
    b = pm.hook.gyre_task_instance(task="number-guess", group_id=3, seed=1, options=TaskOptions(turns=2))
    c = pm.hook.gyre_task_instance(task="number-guess", group_id=4, seed=1, options=TaskOptions(turns=2))
    assert a.as_extra() == b.as_extra() and a.as_extra()["task"] == "number-guess"
    assert a.as_extra()["turns"] == 2 and a.prompt == b.prompt
    assert (a.secret, c.secret) != (None, None)
    assert pm.hook.gyre_task_instance(task="other", group_id=0, seed=0, options=TaskOptions()) is None


def test_version_names_gyre_and_what_it_found(capsys) -> None:
    from gyre_core import __version__
    from gyre_core.cli import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"gyre-orchestrate {__version__}")
    assert any(line.strip().startswith("torch ") for line in lines[1:])


def test_replay_settings_are_checked_before_anything_runs(tmp_path) -> None:
    base = {"harness.kind": '"replay"', "task.name": '"digits"'}
    cfg = load_run_config(None, base)
    assert cfg.harness.kind == "replay" and cfg.harness.time_scale > 0
    with pytest.raises(ConfigError, match="task.name"):
        load_run_config(None, {"harness.kind": '"replay"'})
    with pytest.raises(ConfigError, match="harness.time_scale"):
        load_run_config(None, {**base, "harness.time_scale": "0"})
    assert load_run_config(None, {**base, "harness.token_scale": "0.003"}).harness.token_scale == 0.003
    with pytest.raises(ConfigError, match="harness.token_scale.*≥ 0"):
        load_run_config(None, {**base, "harness.token_scale": "-0.1"})
    with pytest.raises(ConfigError, match="harness.token_scale.*replay_calls"):
        load_run_config(None, {**base, "harness.token_scale": "0.003", "harness.replay_calls": "1"})
    with pytest.raises(ConfigError, match="harness.trace"):
        load_run_config(None, {**base, "harness.trace": f'"{tmp_path / "missing.jsonl"}"'})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "duration_s": -1, "outcome": "completed"}\n')
    with pytest.raises(ConfigError, match="harness.trace.*duration_s"):
        load_run_config(None, {**base, "harness.trace": f'"{bad}"'})


def test_a_paced_run_takes_its_durations_from_a_trace_that_is_checked_first(tmp_path) -> None:
    base = {"harness.kind": '"command"', "harness.command": '["true"]', "harness.paced": "true"}
    assert load_run_config(None, base).harness.paced is True
    with pytest.raises(ConfigError, match="harness.paced.*replay harness"):
        load_run_config(None, {"harness.kind": '"replay"', "task.name": '"digits"', "harness.paced": "true"})
    with pytest.raises(ConfigError, match="harness.trace"):
        load_run_config(None, {**base, "harness.trace": f'"{tmp_path / "missing.jsonl"}"'})


def test_a_model_that_cannot_split_over_tp_is_refused_by_size(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 80,
        "vocab_size": 161, "hidden_size": 48, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError) as e:
        load_run_config(None, {"model.dir": json.dumps(str(tmp_path)), "training.tp": "2"})
    assert "training.tp" in str(e.value) and "vocab_size 161" in str(e.value)
    assert "num_attention_heads" not in str(e.value)  # 6 heads split over 2
    with pytest.raises(ConfigError, match="num_key_value_heads 2 is not a multiple of training.tp 3"):
        load_run_config(None, {"model.dir": json.dumps(str(tmp_path)), "training.tp": "3"})


def test_expert_parallelism_is_checked_against_the_model_before_anything_starts(tmp_path) -> None:
    import json

    moe = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
           "vocab_size": 160, "hidden_size": 48, "num_hidden_layers": 2, "num_local_experts": 6,
           "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    (tmp_path / "config.json").write_text(json.dumps(moe))
    model = {"model.dir": json.dumps(str(tmp_path))}
    assert load_run_config(None, {**model, "training.tp": "2", "training.ep": "2"}).training.ep == 2
    with pytest.raises(ConfigError, match=r"training.ep.*must be 1 or training.tp \(2\)"):
        load_run_config(None, {**model, "training.tp": "2", "training.ep": "4"})
    with pytest.raises(ConfigError, match="training.ep.*the tiny model is dense"):
        load_run_config(None, {"training.tp": "2", "training.ep": "2"})
    (tmp_path / "config.json").write_text(json.dumps({**moe, "num_local_experts": 5}))
    with pytest.raises(ConfigError, match="training.ep.*num_experts 5 is not a multiple of training.ep 2"):
        load_run_config(None, {**model, "training.tp": "2", "training.ep": "2"})
    (tmp_path / "config.json").write_text(json.dumps({**moe, "moe_intermediate_size": 25}))
    with pytest.raises(ConfigError, match="training.tp.*moe_intermediate_size 25"):  # each expert split over tp
        load_run_config(None, {**model, "training.tp": "2"})
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in moe.items() if "expert" not in k}))
    with pytest.raises(ConfigError, match="training.ep.*a dense model"):
        load_run_config(None, {**model, "training.tp": "2", "training.ep": "2"})
