"""Each training step's figures reach the metrics observers, and TensorBoard's files hold them.

``step_metrics`` is checked against a step record as the live run writes it; the TensorBoard
observer writes through ``torch.utils.tensorboard`` and the test reads the event files back with
TensorBoard's own reader. The config refuses unknown backends before anything runs.
"""

from __future__ import annotations

import pytest

from gyre_core.config import ConfigError
from gyre_core.metrics import step_metrics
from gyre_core.orchestrator.run_config import load_run_config

RECORD = {"step": 2, "groups": [4, 5], "staleness": [1, 2], "mean_reward": 0.625, "executions": 8, "cells": [0, 1],
          "duration_s": 3.5, "micro_steps": 2, "split_executions": 0, "joins": [], "loss": 0.0123,
          "grad_norm": 0.5, "clip_fraction": 0.1, "ratio_mean": 1.0, "ratio_max": 1.2, "tokens": 812}


def test_a_step_record_becomes_named_scalars_and_unmeasured_figures_are_absent() -> None:
    switches = [{"cell": 0, "transition": "to_training", "total_s": 0.5, "phases": {"abort": 0.25, "flush": 0.05}},
                {"cell": 1, "transition": "to_training", "total_s": 1.5, "phases": {"abort": 0.75}}]
    m = step_metrics(RECORD, executions={"running": 3, "trained": 8, "launched_on": {"cell0": 4}}, switches=switches,
                     interrupted_calls={"interrupted": 2, "handed_off": 1, "reasons": {"x": 1}},
                     publication={"version": 2, "export_s": 0.1, "load_s": 0.2, "transport": "mooncake"})
    assert m["train/loss"] == 0.0123 and m["train/grad_norm"] == 0.5 and m["train/tokens"] == 812
    assert m["rollout/mean_reward"] == 0.625 and m["rollout/staleness_mean"] == 1.5 and m["rollout/staleness_max"] == 2
    assert m["executions/running"] == 3 and "executions/launched_on" not in m
    assert m["switch/to_training_s"] == 1.0 and m["switch/to_training/abort_s"] == 0.5
    assert m["calls/handed_off"] == 1 and "calls/reasons" not in m
    assert m["publication/load_s"] == 0.2
    assert all(isinstance(v, float) for v in m.values())
    bare = step_metrics({**RECORD, "loss": None, "mean_reward": None, "staleness": []})
    assert "train/loss" not in bare and "rollout/mean_reward" not in bare and "rollout/staleness_mean" not in bare


def test_tensorboard_event_files_hold_every_step(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gyre_core.metrics.tensorboard import TensorBoardObserver

    obs = TensorBoardObserver(tmp_path / "tb")
    for step in range(3):
        obs.gyre_on_metrics(step=step, metrics={**step_metrics({**RECORD, "step": step, "loss": 0.1 * step})})
    obs.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [round(e.value, 6) for e in loss] == [0.0, 0.1, 0.2]
    assert {"train/grad_norm", "rollout/mean_reward", "train/tokens"} <= set(acc.Tags()["scalars"])


@pytest.mark.parametrize("override, message", [
    ({"metrics.backends": '["tensorboard", "mlflow"]'}, "metrics.backends: unknown backend 'mlflow'"),
    ({"metrics.backends": '["tensorboard", "tensorboard"]'}, "metrics.backends: names a backend twice"),
    ({"metrics.wandb_mode": '"sometimes"'}, "metrics.wandb_mode: unknown mode"),
])
def test_bad_metrics_settings_are_refused_up_front(override: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, override)


def test_wandb_without_the_package_is_a_preflight_line(monkeypatch) -> None:
    import importlib.util

    from gyre_core.orchestrator.preflight import _core_problems
    from gyre_core.plugins import plugin_manager

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_run_config(None, {"metrics.backends": '["wandb"]'})
    problems = _core_problems(cfg, plugin_manager(load_entrypoints=False))
    assert any(p.startswith("metrics.backends: 'wandb' needs the wandb package") for p in problems), problems


def test_the_wandb_observer_logs_each_step_at_its_step(tmp_path, monkeypatch) -> None:
    """W&B itself is an optional extra that CI does not install: ``_WandbStandIn`` records the
    calls the observer makes (``init`` with the mode and folder, ``log`` per step, ``finish``)."""
    import sys
    import types

    calls: list[tuple] = []

    class _RunStandIn:
        def log(self, data, step):
            calls.append(("log", step, dict(data)))

        def finish(self):
            calls.append(("finish",))

    stand_in = types.ModuleType("wandb")
    stand_in.init = lambda **kw: calls.append(("init", kw)) or _RunStandIn()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    from gyre_core.metrics.wandb import WandbObserver

    obs = WandbObserver(tmp_path / "wandb", project="p", mode="offline", config={"run": {"steps": 2}})
    obs.gyre_on_metrics(step=0, metrics={"train/loss": 0.5})
    obs.gyre_on_metrics(step=1, metrics={"train/loss": 0.25})
    obs.close()
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline" and calls[0][1]["dir"] == str(tmp_path / "wandb")
    assert calls[1:] == [("log", 0, {"train/loss": 0.5}), ("log", 1, {"train/loss": 0.25}), ("finish",)]


def test_engine_throughput_and_proxy_latency_cover_the_calls_since_the_last_step() -> None:
    from gyre_core.proxy.call_stats import CallStats

    now = [100.0]
    stats = CallStats(clock=lambda: now[0])
    assert stats.drain() == {}  # no call: nothing measured, not zeros
    for out_tokens, call_s, engine_s in [(10, 1.0, 0.8), (30, 3.0, 2.9), (20, 2.0, 1.5)]:
        stats.record(output_tokens=out_tokens, call_s=call_s, engine_s=engine_s)
    now[0] = 104.0
    m = stats.drain()
    assert m["engines/calls"] == 3 and m["engines/output_tokens"] == 60
    assert m["engines/output_tokens_per_s"] == pytest.approx(60 / 4.0)
    assert m["engines/tokens_per_engine_s"] == pytest.approx(60 / 5.2)
    assert m["proxy/call_latency_mean_s"] == pytest.approx(2.0)
    assert m["proxy/call_latency_p50_s"] == 2.0 and m["proxy/call_latency_p95_s"] == 3.0
    assert m["proxy/overhead_mean_s"] == pytest.approx((0.2 + 0.1 + 0.5) / 3)
    now[0] = 110.0
    assert stats.drain() == {}  # the window restarted at the last drain
    stats.record(output_tokens=12, call_s=0.5, engine_s=0.5)
    now[0] = 112.0
    assert stats.drain()["engines/output_tokens_per_s"] == pytest.approx(12 / 2.0)
    named = step_metrics(RECORD, call_stats={"engines/calls": 3.0, "proxy/call_latency_p95_s": 3.0, "other": 1.0})
    assert named["engines/calls"] == 3.0 and named["proxy/call_latency_p95_s"] == 3.0 and "other" not in named
