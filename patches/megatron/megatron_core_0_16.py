"""CPU redirection for megatron-core 0.16.x (see :mod:`.cpu_redirect`).

Lines (0.16.1): schedules.py ~596/983/2138 ``device="cuda"``; p2p_communication.py
~190-202, 242, 313, 321, 398 ``torch.cuda.current_device()``/``synchronize()``; utils.py ~631 global
memory buffer; transformer/utils.py ~35 default causal mask; param_and_grad_buffer.py ~783-806;
optimizer.py / clip_grads.py scalars; the CUDA RNG tracker.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .cpu_redirect import Redirection, apply_common

TARGET = SpecifierSet(">=0.16,<0.17")

MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
)


def apply(version: str) -> Redirection:
    """Apply to megatron-core ``version``; refuse any version outside ``TARGET``."""
    if version not in TARGET:
        raise ValueError(f"this patch targets megatron-core {TARGET}, not {version}")
    return apply_common(MODULES, tensor_cuda=False)
