"""The decoder families Gyre imports from and exports to Hugging Face checkpoints.

One module per family says what its checkpoints hold beyond the shared layout (RMSNorm,
SwiGLU MLP, grouped-query attention, plain RoPE): whether attention projections carry biases,
whether queries and keys are normalised per head, whether ``config.json`` names a head size of
its own, and which settings the family has that Gyre does not model (refused by name). The
tensor mapping itself is shared (:mod:`gyre_megatron.hf_import`, :mod:`gyre_megatron.export`):
the families differ in which tensors exist, not in how the shared ones are laid out. A
mixture-of-experts family (Qwen3-MoE) replaces each MLP by a router over SwiGLU experts laid out
like the dense MLP, which expert parallelism (``training.ep``) spreads over a stage's ranks.
"""

from __future__ import annotations

from gyre_megatron.families import llama, qwen2, qwen3, qwen3_moe
from gyre_megatron.families.base import DecoderFamily

__all__ = ["FAMILIES", "DecoderFamily", "family_named"]

FAMILIES: dict[str, DecoderFamily] = {f.model_type: f for f in (qwen2.FAMILY, qwen3.FAMILY, llama.FAMILY, qwen3_moe.FAMILY)}
"""``model_type`` → family."""


def family_named(model_type: str) -> DecoderFamily | None:
    return FAMILIES.get(model_type)
