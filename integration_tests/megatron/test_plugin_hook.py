"""The plugin seam without ranks: the hook declines options that are not Megatron's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.megatron


def test_training_hook_declines_foreign_options_and_is_discovered() -> None:
    from gyre_core.plugins import describe_plugins, plugin_manager

    pm = plugin_manager()
    assert pm.hook.gyre_make_training_side(cell=0, options={"engine": "other"}) is None
    info = [p for p in describe_plugins(pm) if p.get("name") == "gyre-megatron"]
    assert info and "training" in info[0]["seams"]
