"""CPU stand-ins for SGLang, one module per supported upstream version.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``) serves a model with plain PyTorch,
but its modules import three packages that have no CPU build on PyPI: ``triton``, ``torchvision``
(a CUDA-linked wheel) and ``sgl_kernel``. Each ``sglang_X_Y_Z`` module names the versions it targets
(``TARGET``) and installs import-time stand-ins for exactly those modules; :func:`select` refuses any
other version. ``site/sitecustomize.py`` applies the selected patch in every process of a server
that ``gyre_sglang.server`` starts, and only when CUDA is absent: a GPU deployment never sees them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

VERSION_MODULES = ("sglang_0_5_22", "sglang_0_5_23")


def select(version: str) -> ModuleType:
    """The patch module whose ``TARGET`` contains ``version``; ``LookupError`` if none does."""
    from packaging.version import Version

    v = Version(version)
    for name in VERSION_MODULES:
        mod = importlib.import_module(f"{__name__}.{name}")
        if v in mod.TARGET:
            return mod
    raise LookupError(f"no Gyre CPU patch for sglang {version} (supported: 0.5.22, 0.5.23)")
