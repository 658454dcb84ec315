"""Finding and describing installed Gyre plugins.

Backends register a module under the ``gyre`` entry-point group, e.g. in their ``pyproject.toml``::

    [project.entry-points.gyre]
    megatron = "gyre_megatron.plugin"

so that installing ``gyre-megatron`` or ``gyre-sglang`` is all it takes for ``gyre-orchestrate`` to
use them, and the core never imports a backend by name.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pluggy

from gyre_core import hookspecs
from gyre_core.interfaces import SEAMS

__all__ = ["ENTRY_POINT_GROUP", "PluginLoadError", "describe_plugins", "plugin_manager"]

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME


class PluginLoadError(RuntimeError):
    """An installed plugin could not be imported, registered or described.

    Raised instead of the bare import error so that the message names the entry point and the
    distribution that declared it -- the thing a user has to reinstall or uninstall.
    """


def _describe_entry_point(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f", distribution {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {ep.name!r} = {ep.value!r} (group {ep.group!r}{where})"


def plugin_manager(*, load_entrypoints: bool = True) -> pluggy.PluginManager:
    """Return a plugin manager with Gyre's hook specs and every installed ``gyre`` plugin.

    ``load_entrypoints=False`` gives a bare manager (hook specs only), for tests and for callers
    that register their plugins explicitly.

    Raises :class:`PluginLoadError` naming the entry point if a plugin fails to import or to
    register, and if a plugin implements a ``gyre_*`` hook that does not exist (a typo would
    otherwise mean the implementation is silently never called).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if not load_entrypoints:
        return pm
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:
            continue
        seen.add(ep.name)
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
        except Exception as exc:
            raise PluginLoadError(
                f"failed to load Gyre plugin {_describe_entry_point(ep)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginLoadError(f"invalid Gyre plugin {exc.plugin!r}: {exc}") from exc
    return pm


def describe_plugins(pm: pluggy.PluginManager) -> list[dict[str, Any]]:
    """Answers of every registered plugin to ``gyre_plugin_info``, sorted by plugin name.

    Each dict is the plugin's own answer (``name``, ``version``, ``seams``) plus ``plugin`` (the
    name it is registered under, i.e. the entry-point name) and ``distribution`` (``"name version"``
    of the installed distribution, or ``None`` for plugins registered at runtime).
    """
    dists = {id(plugin): f"{dist.project_name} {dist.version}" for plugin, dist in pm.list_plugin_distinfo()}
    described = []
    for impl in pm.hook.gyre_plugin_info.get_hookimpls():
        try:
            info = impl.function()
        except Exception as exc:
            raise PluginLoadError(
                f"Gyre plugin {impl.plugin_name!r} failed in gyre_plugin_info: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(info, dict) or not {"name", "version", "seams"} <= info.keys():
            raise PluginLoadError(
                f"Gyre plugin {impl.plugin_name!r}: gyre_plugin_info must return a dict with "
                f"'name', 'version' and 'seams', got {info!r}"
            )
        unknown = set(info["seams"]) - SEAMS
        if unknown:
            raise PluginLoadError(
                f"Gyre plugin {impl.plugin_name!r} lists unknown seams {sorted(unknown)}; "
                f"known seams: {sorted(SEAMS)}"
            )
        described.append(
            {
                **info,
                "seams": list(info["seams"]),
                "plugin": impl.plugin_name,
                "distribution": dists.get(id(impl.plugin)),
            }
        )
    return sorted(described, key=lambda d: d["plugin"])
