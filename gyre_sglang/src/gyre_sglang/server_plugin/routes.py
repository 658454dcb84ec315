"""Gyre's HTTP routes on the SGLang server, and the hooks behind them.

Each feature module (``kv_handoff``, ``weight_loading``) exposes a ``register()`` that installs its
own routes and scheduler hooks; this module only calls them, in the process where they belong.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

FEATURES = (
    "gyre_sglang.server_plugin.guard",
    "gyre_sglang.server_plugin.info",
    "gyre_sglang.server_plugin.intake",
    "gyre_sglang.server_plugin.kv_handoff",
    "gyre_sglang.server_plugin.weight_loading",
)
"""Feature modules whose ``register()`` runs in every SGLang process. Append new ones here."""


def register() -> None:
    for name in FEATURES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a feature whose own import fails must say so
                raise
            continue
        mod.register()
