"""Stand-ins for ``triton``, ``torchvision`` and ``sgl_kernel`` under SGLang 0.5.23 on CPU.

- ``triton``: SGLang already ships a stub for machines without Triton (``sglang._platform_stubs``,
  written for Apple silicon, where it is gated on ``darwin``/``arm64``/MPS). We install that very
  stub by opening its gate for the duration of the call; its ``torch.mps`` and non-blocking-copy
  shims are no-ops for CPU tensors.
- ``torchvision`` and ``sgl_kernel``: imported at module level by code the CPU engine never runs
  (a multimodal config, the CUDA kernel wrappers); a module whose every attribute is again a stub
  (SGLang's ``_MockModule``) satisfies those imports. Calling into one fails loudly, it never
  computes a wrong number silently: a stub call returns a decorator, not a tensor. transformers
  probes ``find_spec("torchvision")`` to choose its image code paths; its cached answer is taken
  *before* the stand-in exists, so transformers keeps treating torchvision as absent.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any
from unittest import mock

from packaging.specifiers import SpecifierSet

TARGET = SpecifierSet("==0.5.23")
MODULES = ("triton", "torchvision", "sgl_kernel")
# Submodules left absent so that SGLang takes its own ``except ImportError`` fallback.
ABSENT = frozenset({"sgl_kernel.scalar_type"})


class _StubFinder:
    """Meta-path finder answering ``import NAME`` / ``import NAME.x`` with SGLang's mock modules."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".", 1)[0] not in self.roots:
            return None
        if fullname in ABSENT:
            raise ModuleNotFoundError(f"No module named {fullname!r} (left absent by Gyre's CPU patch)", name=fullname)
        from sglang._platform_stubs import _make_mock

        mod = sys.modules.get(fullname) or _make_mock(fullname)
        parent, _, child = fullname.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
        return mod.__spec__


def _install_triton_stub() -> None:
    import platform

    import torch
    from sglang import _platform_stubs

    with (
        mock.patch.object(sys, "platform", "darwin"),
        mock.patch.object(platform, "machine", return_value="arm64"),
        mock.patch.object(torch.backends.mps, "is_available", return_value=True),
    ):
        _platform_stubs.install_platform_stubs()


def apply(version: str) -> list[str]:
    """Install the stand-ins this machine lacks; returns the names of the modules stood in for."""
    if version not in TARGET:
        raise LookupError(f"patch for sglang {TARGET} cannot apply to {version}")
    return install_stand_ins()


def install_stand_ins() -> list[str]:
    """The stand-ins themselves, for any release whose ``_platform_stubs`` and imports match 0.5.23's."""
    missing = [m for m in MODULES if m not in sys.modules and importlib.util.find_spec(m) is None]
    if "triton" in missing:
        _install_triton_stub()
    others = tuple(m for m in missing if m != "triton")
    if "torchvision" in others:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # cache the true answer (absent) first
    if others:
        sys.meta_path.insert(0, _StubFinder(others))
    return missing
