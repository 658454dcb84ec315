"""The ``gyre`` entry point of ``gyre-megatron``.

For now this module only describes the plugin. Later issues fill the seam it announces:
``gyre_make_training_side`` (a :class:`gyre_core.interfaces.TrainingSide` backed by megatron-core:
enter/leave training, start/join a streaming step, close the stream, publish weights) and, if
useful, ``gyre_on_event`` for training-side metrics. Keep megatron-core and torch imports inside the
hook bodies: this module is imported whenever ``gyre-orchestrate`` starts, including for
simulations on machines without Megatron.
"""

from __future__ import annotations

from typing import Any

from gyre_core.hookspecs import hookimpl

from gyre_megatron import __version__


@hookimpl
def gyre_plugin_info() -> dict[str, Any]:
    return {"name": "gyre-megatron", "version": __version__, "seams": ["training"]}
