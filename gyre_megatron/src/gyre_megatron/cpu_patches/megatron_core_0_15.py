"""CPU redirection for megatron-core 0.15.x (see :mod:`.cpu_redirect`).

Same CUDA-only lines as 0.16 (device literals in schedules, P2P, buffers, optimizer).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .cpu_redirect import CUDA_MODULES, Redirection, apply_for

TARGET = SpecifierSet(">=0.15,<0.16")

MODULES = CUDA_MODULES


def apply(version: str) -> Redirection:
    """Apply to megatron-core ``version``; refuse any version outside ``TARGET``."""
    return apply_for(TARGET, version, MODULES, tensor_cuda=True)  # tied embeddings: language_module calls weight.data.cuda()
