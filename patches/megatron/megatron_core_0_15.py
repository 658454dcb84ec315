"""CPU redirection for megatron-core 0.15.x (see :mod:`.cpu_redirect`).

Same CUDA-only lines as 0.16 (device literals in schedules, P2P, buffers, optimizer).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .cpu_redirect import Redirection, apply_common

TARGET = SpecifierSet(">=0.15,<0.16")

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
