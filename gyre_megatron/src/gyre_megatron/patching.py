"""Apply gyre-megatron's versioned megatron-core CPU patches (:mod:`gyre_megatron.cpu_patches`).

The patches ship inside the package, one module per upstream release range, so that what Gyre
changes in megatron-core is reviewable in one place and an installed wheel carries them.
:func:`ensure_cpu_patches` is idempotent and does nothing when CUDA is available: a GPU
deployment never runs patched upstream code.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["ensure_cpu_patches", "load_patch_package", "megatron_core_version"]

_applied: Any = None


def megatron_core_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def load_patch_package() -> ModuleType:
    """The patch package (``select(version)``, ``VERSION_MODULES``)."""
    return importlib.import_module("gyre_megatron.cpu_patches")


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
