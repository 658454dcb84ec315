"""The plugin seam: entry-point discovery, hook semantics, and the core staying backend-free."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pluggy
import pytest

import gyre_core
from gyre_core import hookspecs
from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import (
    SEAMS,
    Assessment,
    ExecutionSpec,
    RoleClass,
    StateRef,
    TrajectoryLeaf,
    Validity,
)
from gyre_core.plugins import PluginLoadError, describe_plugins, plugin_manager


@dataclass(frozen=True)
class Leaf:
    execution_id: int
    metadata: Mapping[str, Any] = field(default_factory=dict)


def _spec(**kw: Any) -> ExecutionSpec:
    base: dict[str, Any] = dict(
        execution_id=7,
        workdir="/tmp/ws",
        proxy_base_url="http://127.0.0.1:8100",
        api_key="secret-key",
        harness_timeout_s=60.0,
        overall_budget_s=120.0,
    )
    base.update(kw)
    return ExecutionSpec(**base)


def _hookspec_functions() -> dict[str, Any]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("gyre_") and inspect.isfunction(fn)
    }


# ------------------------------------------------------------------ discovery through entry points


def test_installed_plugins_are_found_through_entry_points() -> None:
    pm = plugin_manager()
    assert {"megatron", "sglang"} <= {name for name, _ in pm.list_name_plugin()}

    info = {d["plugin"]: d for d in describe_plugins(pm)}
    assert info["megatron"]["name"] == "gyre-megatron"
    assert info["megatron"]["seams"] == ["training"]
    assert info["megatron"]["distribution"] == "gyre-megatron 0.1.0"
    assert info["sglang"]["name"] == "gyre-sglang"
    assert info["sglang"]["seams"] == ["serving"]
    assert info["sglang"]["distribution"] == "gyre-sglang 0.1.0"
    for d in info.values():
        assert d["version"] == gyre_core.__version__
        assert set(d["seams"]) <= SEAMS


def test_plugins_implement_only_known_hooks() -> None:
    # check_pending already ran inside plugin_manager(); this states the invariant explicitly.
    pm = plugin_manager()
    for plugin in pm.get_plugins():
        for name in dir(plugin):
            if name.startswith("gyre_"):
                assert hasattr(pm.hook, name), f"{plugin!r} implements unknown hook {name}"


def test_failing_plugin_import_names_the_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real (metadata-only) installed distribution whose gyre entry point cannot be imported.
    dist_info = tmp_path / "broken_gyre_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-gyre-plugin\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text("[gyre]\nbroken = gyre_no_such_module.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(PluginLoadError) as excinfo:
        plugin_manager()
    message = str(excinfo.value)
    assert "'broken'" in message
    assert "gyre_no_such_module.plugin" in message
    assert "broken-gyre-plugin 0.1" in message
    assert isinstance(excinfo.value.__cause__, ModuleNotFoundError)


def test_misspelt_hook_is_rejected() -> None:
    pm = plugin_manager(load_entrypoints=False)
    typo = types.SimpleNamespace(gyre_clasify_role=hookimpl(lambda leaf: None))
    pm.register(typo, name="typo")
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_info_must_use_known_seams() -> None:
    pm = plugin_manager(load_entrypoints=False)

    class Bad:
        @hookimpl
        def gyre_plugin_info(self) -> dict[str, Any]:
            return {"name": "bad", "version": "0", "seams": ["trianing"]}

    pm.register(Bad(), name="bad")
    with pytest.raises(PluginLoadError, match="trianing"):
        describe_plugins(pm)


# ------------------------------------------------------------------ hook semantics


def test_classification_is_firstresult_first_non_none_wins() -> None:
    pm = plugin_manager()
    calls: list[str] = []

    class NotMine:
        @hookimpl
        def gyre_classify_role(self, leaf: TrajectoryLeaf) -> RoleClass | None:
            calls.append("not-mine")
            return None

    class Mine:
        @hookimpl
        def gyre_classify_role(self, leaf: TrajectoryLeaf) -> RoleClass | None:
            calls.append("mine")
            return RoleClass.SUB_AGENT_SUMMARY if leaf.metadata.get("sub") else None

    class Fallback:
        @hookimpl(trylast=True)
        def gyre_classify_role(self, leaf: TrajectoryLeaf) -> RoleClass | None:
            calls.append("fallback")
            return RoleClass.MAIN_AGENT_TASK

    pm.register(Fallback(), name="fallback")
    pm.register(Mine(), name="mine")
    pm.register(NotMine(), name="not-mine")  # registered last: asked first

    sub = Leaf(1, {"sub": True})
    assert isinstance(sub, TrajectoryLeaf)
    assert pm.hook.gyre_classify_role(leaf=sub) is RoleClass.SUB_AGENT_SUMMARY
    assert calls == ["not-mine", "mine"]  # fallback never asked once "mine" answered

    calls.clear()
    assert pm.hook.gyre_classify_role(leaf=Leaf(2)) is RoleClass.MAIN_AGENT_TASK
    assert calls == ["not-mine", "mine", "fallback"]


def test_classification_with_no_plugin_answering_is_none() -> None:
    pm = plugin_manager()
    assert pm.hook.gyre_classify_role(leaf=Leaf(1)) is None


def test_evaluation_is_firstresult_and_carries_state() -> None:
    pm = plugin_manager()
    state = StateRef(artifact_version="v3", branch="exec-7")

    class OtherTasks:
        @hookimpl
        def gyre_evaluate(self, spec: ExecutionSpec, state: StateRef) -> Assessment | None:
            return None if spec.harness != "other" else Assessment.valid(0.0, state)

    class Tests:
        @hookimpl
        def gyre_evaluate(self, spec: ExecutionSpec, state: StateRef) -> Assessment | None:
            if spec.extra.get("evaluator_down"):
                return Assessment.unresolved(state, "evaluator unreachable")
            return Assessment.valid(0.75, state, "3/4 tests pass")

    pm.register(Tests(), name="tests")
    pm.register(OtherTasks(), name="other")

    result = pm.hook.gyre_evaluate(spec=_spec(harness="claude_code"), state=state)
    assert result == Assessment(0.75, Validity.VALID, state, "3/4 tests pass")
    assert result.state is state

    down = pm.hook.gyre_evaluate(spec=_spec(extra={"evaluator_down": True}), state=state)
    assert down.validity is Validity.UNRESOLVED and down.score is None


def test_events_are_broadcast_to_every_observer() -> None:
    pm = plugin_manager()
    seen: list[tuple[str, float, object]] = []

    class Observer:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        @hookimpl
        def gyre_on_event(self, time: float, event: object) -> None:
            seen.append((self.tag, time, event))

    pm.register(Observer("a"), name="a")
    pm.register(Observer("b"), name="b")
    pm.hook.gyre_on_event(time=1.5, event="StepStarted")
    assert sorted(tag for tag, _, _ in seen) == ["a", "b"]
    assert all(t == 1.5 and e == "StepStarted" for _, t, e in seen)


# ------------------------------------------------------------------ specs and types


def test_every_hookspec_is_documented_and_marked() -> None:
    specs = _hookspec_functions()
    assert set(specs) == {
        "gyre_plugin_info",
        "gyre_make_training_side",
        "gyre_make_serving_side",
        "gyre_launch_harness",
        "gyre_start_engine",
        "gyre_task_instance",
        "gyre_make_engine_client",
        "gyre_evaluate",
        "gyre_classify_role",
        "gyre_on_event",
        "gyre_on_metrics",
        "gyre_preflight",
        "gyre_shutdown",
    }
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    for name, fn in specs.items():
        assert (fn.__doc__ or "").strip(), f"{name} has no docstring"
        assert hasattr(fn, marker), f"{name} is not a hookspec"
        firstresult = getattr(fn, marker)["firstresult"]
        assert firstresult == (name not in {"gyre_plugin_info", "gyre_on_event", "gyre_on_metrics", "gyre_preflight",
                                           "gyre_shutdown"}), name
        assert ("firstresult" if firstresult else "Broadcast") in fn.__doc__, name


def test_role_classes_are_in_priority_order() -> None:
    assert list(RoleClass) == sorted(RoleClass)
    assert [c.name for c in RoleClass] == [
        "MAIN_AGENT_TASK",
        "MAIN_AGENT_SUMMARY",
        "SUB_AGENT_TASK",
        "SUB_AGENT_SUMMARY",
    ]


def test_assessment_never_mixes_unresolved_and_a_score() -> None:
    state = StateRef("v1", "main")
    with pytest.raises(ValueError):
        Assessment(0.0, Validity.UNRESOLVED, state)
    with pytest.raises(ValueError):
        Assessment(None, Validity.VALID, state)
    with pytest.raises(ValueError):
        Assessment(float("nan"), Validity.VALID, state)


def test_execution_spec_keeps_api_key_out_of_repr() -> None:
    assert "secret-key" not in repr(_spec())


# ------------------------------------------------------------------ the core stays backend-free


def test_importing_gyre_core_does_not_import_backends() -> None:
    """Importing every gyre_core module, and loading the installed plugins, pulls in no backend.

    Runs in a fresh interpreter: this test process may have imported anything already.
    """
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import gyre_core
        for mod in pkgutil.walk_packages(gyre_core.__path__, "gyre_core."):
            importlib.import_module(mod.name)
        from gyre_core.plugins import plugin_manager
        plugin_manager()
        heavy = sorted(
            m for m in sys.modules
            if m.split(".")[0] in {"megatron", "sglang"}
        )
        print(",".join(heavy))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"gyre_core imported backends: {out.stdout.strip()}"


def test_the_proxy_command_gets_engine_clients_from_the_serving_plugin() -> None:
    """``gyre-orchestrate proxy --engine URL`` asks the installed plugins for its engine clients
    (the core imports no backend); without a serving plugin it says which one to install."""
    import pluggy

    from gyre_core.cli import _engine_clients
    from gyre_core.config import ConfigError

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    with pytest.raises(ConfigError, match="gyre-sglang"):
        _engine_clients(pm, ["http://127.0.0.1:9"])

    class Serving:
        @hookspecs.hookimpl
        def gyre_make_engine_client(self, url, options):
            return ("client", url)

    pm.register(Serving())
    assert _engine_clients(pm, ["http://a:1", "http://b:2"]) == [("client", "http://a:1"), ("client", "http://b:2")]
