"""The plugin seam without ranks: the hook is discovered, and declines where megatron-core is absent."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.megatron


def test_training_hook_is_discovered_and_declines_without_megatron_core(monkeypatch) -> None:
    from gyre_core.interfaces import TrainingOptions
    from gyre_core.plugins import describe_plugins, plugin_manager

    pm = plugin_manager()
    info = [p for p in describe_plugins(pm) if p.get("name") == "gyre-megatron"]
    assert info and "training" in info[0]["seams"]
    # where megatron-core cannot be imported, another backend may answer: no ranks are started
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    assert pm.hook.gyre_make_training_side(cell=0, options=TrainingOptions(cells=2)) is None
