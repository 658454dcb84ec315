"""CPU device redirection for megatron-core, one module per supported upstream version range.

Megatron hard-codes ``"cuda"`` in a handful of schedule, P2P, buffer and optimizer lines. On a
machine without CUDA these lines can only raise, so Gyre's tests (gloo ranks on CPU) need them
pointed at the CPU. Each ``megatron_core_0_NN`` module names the upstream versions it targets
(``TARGET``) and the modules it touches (``MODULES``); :func:`select` picks the one matching the
installed version and refuses any other. The shared machinery is :mod:`.cpu_redirect`.

Nothing here is ever applied when CUDA is available: a GPU deployment runs unmodified upstream
code. ``gyre_megatron.patching`` loads this folder and applies the selected patch.
"""

from __future__ import annotations

import importlib
from types import ModuleType

VERSION_MODULES = (
    "megatron_core_0_13",
    "megatron_core_0_14",
    "megatron_core_0_15",
    "megatron_core_0_16",
)


def select(version: str) -> ModuleType:
    """The patch module whose ``TARGET`` contains ``version``; ``LookupError`` if none does."""
    from packaging.version import Version

    v = Version(version)
    for name in VERSION_MODULES:
        mod = importlib.import_module(f"{__name__}.{name}")
        if v in mod.TARGET:
            return mod
    raise LookupError(f"no Gyre CPU patch for megatron-core {version} (supported: 0.13.x to 0.16.x)")
