"""The typed options across the plugin seam: each setting reaches the plugin under one name, and a
restarted engine starts again with its own options."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gyre_core.interfaces import EngineOptions, GSPOConfig
from gyre_core.orchestrator.plugin_options import engine_options, serving_options, training_options
from gyre_core.orchestrator.run_config import load_run_config

# (setting, value, where the training plugin reads it)
TRAINING_PATHS = [
    ("training.lr", 3e-4, lambda o: o.lr),
    ("training.clip_grad", 0.5, lambda o: o.clip_grad),
    ("training.pp", 2, lambda o: o.pp),
    ("training.precision", "bf16", lambda o: o.precision),
    ("training.step_timeout_s", 42.0, lambda o: o.step_timeout_s),
    ("training.collective_timeout_s", 7.0, lambda o: o.data_timeout_s),
    ("training.importance_cap", 3.0, lambda o: o.objective.token_weight_cap),
    ("training.clip_low", 0.2, lambda o: o.objective.clip_low),
    ("training.clip_high", 0.3, lambda o: o.objective.clip_high),
    ("scheduler.steps_per_burst", 3, lambda o: o.burst_steps),
    ("publication.transport", "disk", lambda o: o.publication.transport),
    ("publication.protocol", "rdma", lambda o: o.publication.mooncake.protocol),
    ("publication.load_attempts", 4, lambda o: o.publication.load_attempts),
    ("cluster.join_timeout_s", 30.0, lambda o: o.launch.join_timeout_s),
]


@pytest.mark.parametrize("setting,value,read", TRAINING_PATHS, ids=[t[0] for t in TRAINING_PATHS])
def test_a_training_setting_reaches_the_plugin_as_set(setting: str, value: Any, read: Any, tmp_path: Path) -> None:
    extra = {"publication.device": "mlx5_0"} if setting == "publication.protocol" else {}
    cfg = load_run_config(None, {setting: value, **extra})
    opts = training_options(cfg, tmp_path, {"hidden_size": 64})
    assert read(opts) == value
    # and with the default, the plugin sees the run configuration's default (one default, in one place)
    default = training_options(load_run_config(None, {}), tmp_path, {})
    assert read(default) != value


def test_training_options_carry_the_run_s_own_derived_values(tmp_path: Path) -> None:
    cfg = load_run_config(None, {"run.steps": 5})
    opts = training_options(cfg, tmp_path, {"hidden_size": 64})
    assert opts.objective == GSPOConfig()  # the paper's: cap 5, clipping [0.995, 1.005]
    assert opts.max_steps == 5 + 8  # a queue per step, and room for re-streams
    assert opts.normalise_by_tokens is False  # W_t already normalise per execution
    assert opts.publication.folder == str(tmp_path / "weights")
    assert opts.launch.key_file == str(tmp_path / "control.key")
    assert opts.publication.mooncake.peer == ""  # a local run: every endpoint on this machine
    assert opts.cells == cfg.scheduler.cells and opts.model == {"hidden_size": 64}


def test_serving_and_engine_options_keep_the_engine_key_off_repr(tmp_path: Path) -> None:
    cfg = load_run_config(None, {"serving.extra_args": ["--dtype", "float32"], "publication.version_wait_s": 9.0})
    e = engine_options(cfg, "sekret-key", tmp_path / "engine0.log", base_gpu_id=2, tp_size=2, memory_saver=True)
    assert (e.extra_args, e.base_gpu_id, e.tp_size, e.memory_saver) == (("--dtype", "float32"), 2, 2, True)
    s = serving_options(cfg, "http://127.0.0.1:1", "sekret-key")
    assert s.version_wait_s == 9.0 and s.api_key == "sekret-key"
    assert "sekret" not in repr(e) and "sekret" not in repr(s)
    assert engine_options(cfg, "k", tmp_path / "e.log", base_gpu_id=0, tp_size=1, mooncake=False).mooncake is None


def test_a_restarted_engine_starts_with_its_own_gpus_and_memory_saver(tmp_path: Path) -> None:
    """The watchdog's restart starts the dead engine with the options it started with (its GPUs,
    memory saver, Mooncake endpoint), only its log file new."""
    from gyre_core.orchestrator.embedded import _engine_watchdog

    cfg = load_run_config(None, {})
    opts = {i: engine_options(cfg, "k", tmp_path / f"engine{i}.log", base_gpu_id=2 * i, tp_size=2, memory_saver=True)
            for i in range(2)}
    started: list[EngineOptions] = []

    def start(model_dir: str, options: EngineOptions) -> Any:
        started.append(options)
        return SimpleNamespace(url="http://new", kill=lambda: None, alive=lambda: True)

    pm = SimpleNamespace(hook=SimpleNamespace(gyre_start_engine=start))
    engines = [SimpleNamespace(url=f"http://e{i}", kill=lambda: None, alive=lambda: True) for i in range(2)]
    wd = _engine_watchdog(pm, opts, serving_options(cfg, "", "k"), tmp_path, tmp_path, [], engines, 0,
                          lambda m: None, cfg, [None, None])
    asyncio.run(wd.restart(1))
    (again,) = started
    assert (again.base_gpu_id, again.tp_size, again.memory_saver, again.mooncake) == (2, 2, True, opts[1].mooncake)
    assert again.log_path == str(tmp_path / "engine1.restart1.log")


def test_every_publication_transport_the_configuration_admits_has_one_transport_class() -> None:
    """``publication.transport`` is checked against a list in the run configuration and acted on
    by name in gyre_megatron's table: the two lists are the same."""
    from typing import get_args

    from gyre_core.orchestrator.run_config import PublicationSection
    from gyre_megatron.export import TRANSPORTS, DiskTransport, MooncakeTransport
    from gyre_core.interfaces import PublicationOptions

    assert set(get_args(PublicationSection.model_fields["transport"].annotation)) == set(TRANSPORTS)
    disk = TRANSPORTS["disk"](PublicationOptions(transport="disk", folder="/runs/x/weights"))
    assert disk == DiskTransport("/runs/x/weights") and isinstance(TRANSPORTS["mooncake"](PublicationOptions()),
                                                                   MooncakeTransport)
