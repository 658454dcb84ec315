"""Stand-ins for ``triton``, ``torchvision`` and ``sgl_kernel`` under SGLang 0.5.22 on CPU.

0.5.22 imports the same three CUDA-only modules as 0.5.23 and ships the same
``sglang._platform_stubs``, so the stand-ins are 0.5.23's (:mod:`.sglang_0_5_23`); this module only
gates them on its own release. (0.5.20 was tried and is not supported: on CPU its configs register
image processors with the transformers 5.12 it pins, which then insists on a real torchvision;
0.5.21 pins the same transformers and was not tried.)
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .sglang_0_5_23 import ABSENT, MODULES, install_stand_ins

__all__ = ["ABSENT", "MODULES", "TARGET", "apply"]

TARGET = SpecifierSet("==0.5.22")


def apply(version: str) -> list[str]:
    """Install the stand-ins this machine lacks; returns the names of the modules stood in for."""
    if version not in TARGET:
        raise LookupError(f"patch for sglang {TARGET} cannot apply to {version}")
    return install_stand_ins()
