"""Apply the repository's versioned megatron-core CPU patches (``patches/megatron/``).

The patches live outside the package, versioned per upstream release, so that what Gyre changes
in megatron-core is reviewable in one place. They are found through ``GYRE_PATCHES_DIR`` or, in a
source checkout, at ``<repo>/patches``. :func:`ensure_cpu_patches` is idempotent and does nothing
when CUDA is available: a GPU deployment never runs patched upstream code.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ensure_cpu_patches", "load_patch_package", "megatron_core_version"]

_applied: Any = None


def megatron_core_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def _patches_root() -> Path:
    env = os.environ.get("GYRE_PATCHES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "patches"


def load_patch_package() -> ModuleType:
    """Import ``patches/megatron`` as the package ``gyre_patches_megatron``."""
    name = "gyre_patches_megatron"
    if name in sys.modules:
        return sys.modules[name]
    root = _patches_root() / "megatron"
    if not (root / "__init__.py").is_file():
        raise ImportError(f"Gyre's megatron patches not found at {root} (set GYRE_PATCHES_DIR)")
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def ensure_cpu_patches() -> Any:
    """Apply the CPU patch for the installed megatron-core once; ``None`` when CUDA is present."""
    global _applied
    import torch

    if torch.cuda.is_available():
        return None
    if _applied is None:
        version = megatron_core_version()
        patch = load_patch_package().select(version)
        _applied = patch.apply(version)
    return _applied
