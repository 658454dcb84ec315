"""CPU redirection for megatron-core 0.13.x (see :mod:`.cpu_redirect`).

0.13 also calls ``Tensor.cuda()`` in its schedules (``total_num_tokens``), so this one
additionally makes ``Tensor.cuda`` the identity (only with CUDA absent).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .cpu_redirect import CUDA_MODULES, Redirection, apply_for

TARGET = SpecifierSet(">=0.13,<0.14")

MODULES = CUDA_MODULES


def apply(version: str) -> Redirection:
    """Apply to megatron-core ``version``; refuse any version outside ``TARGET``."""
    return apply_for(TARGET, version, MODULES, tensor_cuda=True)
