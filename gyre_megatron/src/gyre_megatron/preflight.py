"""What a run's training side needs loaded, checked in the orchestrator before any rank starts.

Light on purpose: it locates megatron-core instead of importing it (seconds, and warnings), but
does load Mooncake's transfer engine, because what fails there is the dynamic loader
(``libibverbs.so.1``), which only a real import shows.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Mapping

__all__ = ["SUPPORTED_MEGATRON_CORE", "megatron_core_below", "megatron_core_problem", "megatron_settings_problems", "model_problems", "mooncake_problem",
           "training_side_problems"]

SUPPORTED_MEGATRON_CORE = ">=0.13,<0.17"
"""The releases whose megatron test group runs in CI, each with its CPU patch and compat path."""

MOONCAKE_FIX = ("install the system package libibverbs1 (as root: apt-get install -y libibverbs1; "
                "without root see the README, 'System packages')")


def mooncake_problem() -> str | None:
    """Why Mooncake's transfer engine cannot be loaded here, or ``None`` when it can."""
    from gyre_core.upstream_noise import mooncake_quiet_env

    mooncake_quiet_env()  # its log level is read once, at this first import
    try:
        importlib.import_module("mooncake.engine")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("mooncake"):
            return ("Mooncake transfer engine: not installed (pip install mooncake-transfer-engine-non-cuda "
                    "on CPU, mooncake-transfer-engine with CUDA)")
        return f"Mooncake transfer engine: cannot be loaded ({exc})"
    except ImportError as exc:
        msg = str(exc)
        if "libibverbs" in msg:
            return f"Mooncake transfer engine: cannot be loaded ({msg.splitlines()[0]}); {MOONCAKE_FIX}"
        return f"Mooncake transfer engine: cannot be loaded ({msg.splitlines()[0] if msg else exc!r})"
    return None


def _located_megatron_core_version() -> str | None:
    """The installed megatron-core's version, read from ``package_info.py`` without importing the
    package (a source checkout on ``PYTHONPATH`` has no distribution metadata)."""
    import ast

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    info = Path(next(iter(spec.submodule_search_locations))) / "package_info.py"
    fields: dict[str, object] = {}
    try:
        for node in ast.parse(info.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if isinstance(node.value, ast.Constant):
                    fields[node.targets[0].id] = node.value.value
    except (OSError, SyntaxError):
        return None
    if not all(isinstance(fields.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE') or ''}"


def megatron_core_problem(version: str | None = None) -> str | None:
    """Why the installed megatron-core release cannot be used, or ``None`` when it can.

    Each supported release has its own compat path and CPU patch and runs the megatron tests; a
    newer one is refused here, at start, instead of failing somewhere inside a training step."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = version if version is not None else _located_megatron_core_version()
    if version is None:
        return None  # not found, or unreadable: the import check reports it
    try:
        ok = Version(version) in SpecifierSet(SUPPORTED_MEGATRON_CORE, prereleases=True)
    except InvalidVersion:
        return f"megatron-core: cannot read its version ({version!r})"
    if ok:
        return None
    return (f"megatron-core {version}: this gyre-megatron supports 0.13.x to 0.16.x "
            f"(pip install 'megatron-core{SUPPORTED_MEGATRON_CORE}', or a gyre-megatron release that supports {version})")


def model_problems(model_dir: str) -> list[str]:
    """Why the training side cannot start from the HF checkpoint ``model_dir`` (empty: it can)."""
    from gyre_megatron.hf_import import UnsupportedModel, spec_from_hf_dir

    try:
        spec_from_hf_dir(model_dir)
    except UnsupportedModel as exc:
        return [f"model.dir: {exc}"]

    if not any(Path(model_dir).glob("*.safetensors")):
        return [f"model.dir: {model_dir} has no *.safetensors weights (convert .bin checkpoints first)"]
    return []


def megatron_settings_problems(table: Mapping[str, Any], model_dir: str, layout: Mapping[str, Any]) -> list[str]:
    """``[training.megatron]`` against the installed megatron-core: each key alone (its name and
    type), then all of them together with the run's model and layout, as the ranks will build
    their configs (``layout``: ``[training]``'s ``tp``, ``pp``, ``ep``, ``precision``, ``lr`` and
    ``run.steps`` as ``steps``; the model's sizes from ``model.dir``, else ``[model]``'s)."""
    from gyre_megatron.megatron_settings import settings_problems, settings_refused
    from gyre_megatron.model import ModelSpec

    problems = settings_problems(table)
    if problems:
        return problems
    if model_dir and (Path(model_dir) / "config.json").is_file():
        from gyre_megatron.hf_import import UnsupportedModel, spec_from_hf_dir

        try:
            spec = spec_from_hf_dir(model_dir)
        except UnsupportedModel:
            return []  # model_problems says why
    else:
        sizes = {k: v for k, v in layout.get("model", {}).items() if k in ModelSpec.__dataclass_fields__}
        spec = ModelSpec(**sizes)
    return settings_refused(table, spec, pp=int(layout.get("pp", 1)), tp=int(layout.get("tp", 1)),
                            ep=int(layout.get("ep", 1)), precision=str(layout.get("precision", "fp32")),
                            total_steps=int(layout.get("steps", 1)), lr=float(layout.get("lr", 1.0)))


def megatron_core_below(release: tuple[int, int]) -> bool:
    """Whether the installed megatron-core is older than ``release`` (``(major, minor)``);
    False when none is found."""
    version = _located_megatron_core_version()
    return version is not None and tuple(int(x) for x in version.split(".")[:2]) < release


def training_side_problems(cells: int, model_dir: str = "", launcher: str = "local",
                           megatron: Mapping[str, Any] | None = None,
                           layout: Mapping[str, Any] | None = None, transformer_impl: str = "auto") -> list[str]:
    """One line per problem; ``megatron`` (``[training.megatron]``) is checked against the
    installed megatron-core once it is found (:func:`megatron_settings_problems`). An explicit
    ``transformer_impl = "transformer_engine"`` is checked here only where the ranks run on this
    machine (``launcher = "local"``); elsewhere a rank that cannot build TE's spec says why."""
    problems: list[str] = []
    if transformer_impl == "transformer_engine" and launcher == "local":
        from gyre_megatron.model import transformer_engine_problem

        if (why := transformer_engine_problem()) is not None:
            problems.append(f"training.transformer_impl = \"transformer_engine\": {why} (or set it to \"auto\")")
    if launcher == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("Ray: not installed, and cluster.launcher = \"ray\" needs it (pip install 'gyre-megatron[ray]')")
    if model_dir and (Path(model_dir) / "config.json").is_file():  # a missing one is the core's to report
        problems.extend(model_problems(model_dir))
    for mod, fix in (("torch", "pip install torch"), ("megatron.core", f"pip install 'megatron-core{SUPPORTED_MEGATRON_CORE}'")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{mod}: not installed ({fix})")
        elif mod == "megatron.core" and (p := megatron_core_problem()):
            problems.append(p)
        elif mod == "megatron.core" and megatron:
            problems.extend(megatron_settings_problems(megatron, model_dir, layout or {}))
    if cells > 1:  # satellites join a running step by pulling the core's weights over Mooncake
        p = mooncake_problem()
        if p:
            problems.append(p)
    return problems
