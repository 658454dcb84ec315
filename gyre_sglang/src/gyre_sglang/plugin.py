"""The ``gyre`` entry point of ``gyre-sglang``.

For now this module only describes the plugin. Later issues fill the seam it announces:
``gyre_make_serving_side`` (a :class:`gyre_core.interfaces.ServingSide` that drives an SGLang
server over HTTP: stop intake and hand requests off for rerouting, abort, flush, release and resume
memory, load published weights, health). The SGLang server-side plugin (entry-point group
``sglang.srt.plugins``) is registered by a later issue too. Keep SGLang imports inside the hook
bodies: this module is imported whenever ``gyre-orchestrate`` starts.
"""

from __future__ import annotations

from typing import Any

from gyre_core.hookspecs import hookimpl

from gyre_sglang import __version__


@hookimpl
def gyre_plugin_info() -> dict[str, Any]:
    return {"name": "gyre-sglang", "version": __version__, "seams": ["serving"]}
