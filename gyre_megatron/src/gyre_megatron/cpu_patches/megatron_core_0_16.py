"""CPU redirection for megatron-core 0.16.x (see :mod:`.cpu_redirect`).

Lines (0.16.1): schedules.py ~596/983/2138 ``device="cuda"``; p2p_communication.py
~190-202, 242, 313, 321, 398 ``torch.cuda.current_device()``/``synchronize()``; utils.py ~631 global
memory buffer; transformer/utils.py ~35 default causal mask; param_and_grad_buffer.py ~783-806;
optimizer.py / clip_grads.py scalars; the CUDA RNG tracker.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .cpu_redirect import CUDA_MODULES, Redirection, apply_for

TARGET = SpecifierSet(">=0.16,<0.17")

MODULES = CUDA_MODULES


def apply(version: str) -> Redirection:
    """Apply to megatron-core ``version``; refuse any version outside ``TARGET``."""
    return apply_for(TARGET, version, MODULES, tensor_cuda=True)  # tied embeddings: language_module calls weight.data.cuda()
